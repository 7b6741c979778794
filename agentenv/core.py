"""The environment contract: a Gymnasium environment over text whose state can be forked.

An :class:`Env` takes an action string (what the model wrote in one turn) and returns an
observation string (what the tools answered). On top of Gymnasium's ``reset``/``step``/``close``
it adds two things that multi-turn agent RL needs:

- ``areset``/``astep`` coroutines, so that an async rollout loop never blocks on a tool doing I/O;
- ``fork()``, an independent copy of the current state, so that a rollout tree can branch an
  episode at any turn. After a fork, stepping either copy never changes the other.

Subclasses implement either the sync pair (``reset``/``step``) or the async pair
(``areset``/``astep``); the other pair is derived. Each subclass declares its
:attr:`Env.fork_strategy`.
"""

from __future__ import annotations

import asyncio
import atexit
import copy
import threading
from collections.abc import Coroutine, Sequence
from typing import Any, ClassVar, Literal, TypeVar, get_args

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from agentenv.options import OptionError

__all__ = [
    "Env",
    "ForkStrategy",
    "Text",
    "fork",
    "run_sync",
]

#: How an environment implements :meth:`Env.fork`, from cheapest to most expensive:
#: ``immutable`` (the state is immutable and shared), ``copy-on-write`` (history shared,
#: only the small mutable part copied), ``process-fork`` (a worker process is ``os.fork``-ed),
#: ``replay`` (a fresh copy re-runs the episode's actions), ``deepcopy`` (the default for
#: user environments that do not override ``fork``; cost grows with the episode).
ForkStrategy = Literal["immutable", "copy-on-write", "process-fork", "replay", "deepcopy"]

T = TypeVar("T")


class Text(spaces.Text):
    """The space of Python strings of at most ``max_length`` characters, any characters.

    Gymnasium's own ``Text`` admits only a fixed character set; model outputs and tool results
    contain arbitrary Unicode. Sampling (used by Gymnasium's checker) draws short alphanumeric
    strings.
    """

    def __init__(self, max_length: int = 1 << 20, *, sample_length: int = 64) -> None:
        super().__init__(max_length=max_length, min_length=0)
        self.sample_length = min(sample_length, max_length)

    def contains(self, x: Any) -> bool:
        return isinstance(x, str) and len(x) <= self.max_length

    def sample(self, mask: Any = None, probability: Any = None) -> str:
        if mask is None and probability is None:
            mask = (int(self.np_random.integers(1, self.sample_length + 1)), None)
        return super().sample(mask=mask, probability=probability)

    def __repr__(self) -> str:
        return f"Text(max_length={self.max_length})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Text) and other.max_length == self.max_length


_runners = threading.local()


def _thread_runner() -> asyncio.Runner:
    runner = getattr(_runners, "runner", None)
    if runner is None:
        # One long-lived loop per thread: clients bound to a loop (aiohttp sessions) stay valid
        # across sync calls, which a fresh asyncio.run() per step would break.
        runner = _runners.runner = asyncio.Runner()
        if threading.current_thread() is threading.main_thread():
            atexit.register(runner.close)
    return runner


def fork(env: gym.Env) -> gym.Env:
    """``env.fork()`` through any Gymnasium wrappers around an agentenv :class:`Env`.

    ``gymnasium.make`` wraps environments (``OrderEnforcing``, and whatever the caller adds),
    and Gymnasium's wrappers do not pass ``fork`` on. This forks the environment inside and
    gives it a copy of each wrapper (deep-copied, so wrapper state such as a step counter is the
    fork's own).
    """
    if isinstance(env, gym.Wrapper):
        inner = fork(env.env)
        # Copy the wrapper, with the forked environment in place of the one it wraps.
        return copy.deepcopy(env, memo={id(env.env): inner, id(env.unwrapped): inner.unwrapped})
    if not isinstance(env, Env):
        raise TypeError(f"{type(env).__name__} is not an agentenv.Env (or a Gymnasium wrapper of one): it cannot fork")
    return env.fork()


def _loop_running() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run a coroutine to completion from synchronous code (the sync half of the contract).

    Raises a clear error when called from inside a running event loop, where blocking would
    deadlock: there, await the async method instead.
    """
    if not _loop_running():
        return _thread_runner().run(coro)
    coro.close()
    raise RuntimeError(
        "A synchronous env method was called from inside a running asyncio event loop; "
        "use the async form instead (`await env.areset(...)`, `await env.astep(...)`)."
    )


class Env(gym.Env[str, str]):
    """A multi-turn text environment whose state can be forked.

    The contract, in addition to :class:`gymnasium.Env`:

    - ``reset(seed=None, options=None) -> (obs: str, info: dict)``
    - ``step(action: str) -> (obs: str, reward: float, terminated: bool, truncated: bool, info: dict)``
    - ``await areset(...)`` / ``await astep(action)``: the same, as coroutines.
    - ``fork() -> Env``: an independent copy of the current state (mid-episode or after the end).
      Stepping either copy never changes the other; the same actions on two forks give the same
      observations and rewards when the tools are deterministic.
    - ``tasks``: the environment's fixed task list, where it has one (``reset(options={"index": i})``
      poses task ``i``: a run holds the first out and trains on the rest), or ``None`` (the class
      default) when each reset draws its own task from the seed.
    - ``close()``: release resources; calling it twice is allowed. A closed environment is done
      for good: ``reset``, ``step``, their async forms and ``fork`` raise ``RuntimeError``
      rather than quietly start new sandboxes or sessions that nothing would close. The base
      methods and :meth:`reset_rng` check this; a subclass that overrides ``step``, ``astep`` or
      ``fork`` calls :meth:`check_open` first.

    Stepping an environment whose episode is over raises ``RuntimeError``; a malformed action
    never does (it becomes an observation explaining the problem).
    """

    metadata: dict[str, Any] = {"render_modes": []}  # as gymnasium.Env declares it (not a ClassVar)
    #: How :meth:`fork` is implemented (see :data:`ForkStrategy`).
    fork_strategy: ClassVar[ForkStrategy] = "deepcopy"

    observation_space = Text()
    action_space = Text()
    #: The fixed task list, or ``None``: each reset draws its task from the seed (see the contract above).
    tasks: Sequence[Any] | None = None
    _closed = False  # a class default: subclasses need not call __init__ for it

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        allowed = get_args(ForkStrategy)
        if cls.fork_strategy not in allowed:
            raise TypeError(
                f"{cls.__name__}.fork_strategy = {cls.fork_strategy!r} is not one of {allowed}. It is a label "
                "saying how the class's fork() works (check_env and the docs report it); it does not choose the "
                "fork: override fork() to change how it is done"
            )

    def __init__(self, render_mode: str | None = None) -> None:
        self.check_render_mode(render_mode)
        self.render_mode = render_mode

    @classmethod
    def check_render_mode(cls, render_mode: Any) -> None:
        """Raise :class:`OptionError` unless ``render_mode`` is None or one of ``metadata["render_modes"]``.

        A class method, so that a subclass can check it before the work its constructor does first.
        """
        modes = cls.metadata["render_modes"]
        if render_mode is not None and not (isinstance(render_mode, str) and render_mode in modes):
            raise OptionError(
                f"render_mode={render_mode!r} is not supported by {cls.__name__}; choose one of {modes} or None",
                "render_mode",
                render_mode,
            )

    # -- the sync and async pairs; a subclass implements one of them -------------------------

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None) -> tuple[str, dict[str, Any]]:
        """Start a new episode; returns the first observation (the prompt) and info.

        A subclass that implements ``reset`` calls ``super().reset(seed=seed)`` first, as in
        Gymnasium, which seeds ``self.np_random``. One that implements ``areset`` instead calls
        ``self.reset_rng(seed)`` there.
        """
        if type(self).reset is not Env.reset or type(self).areset is Env.areset:
            self.reset_rng(seed)  # reached through super().reset(): seed only, as Gymnasium does
            return None  # type: ignore[return-value]
        if _loop_running():
            name = type(self).__name__
            raise RuntimeError(
                f"{name}.reset() was called inside a running event loop, where {name}'s areset() cannot be run "
                f"to completion: await env.areset(...) instead. Inside {name}.areset itself, seed the episode "
                "with self.reset_rng(seed), not super().reset(seed=seed), which would run areset() again"
            )
        return run_sync(self.areset(seed=seed, options=options))

    def step(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Apply one model turn; returns ``(obs, reward, terminated, truncated, info)``."""
        self.check_open()
        if type(self).astep is Env.astep:
            raise TypeError(f"{type(self).__name__} must implement step() or astep()")
        return run_sync(self.astep(action))

    async def areset(
        self, *, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[str, dict[str, Any]]:
        """Coroutine form of :meth:`reset`."""
        if type(self).reset is Env.reset:
            raise TypeError(f"{type(self).__name__} must implement reset() or areset()")
        return self.reset(seed=seed, options=options)

    async def astep(self, action: str) -> tuple[str, float, bool, bool, dict[str, Any]]:
        """Coroutine form of :meth:`step`."""
        self.check_open()
        if type(self).step is Env.step:
            raise TypeError(f"{type(self).__name__} must implement step() or astep()")
        return self.step(action)

    # -- forking ------------------------------------------------------------------------------

    def fork(self) -> Env:
        """An independent copy of the current state.

        The default deep-copies the environment (``fork_strategy = "deepcopy"``), which is
        correct for any picklable state but costs time proportional to that state. Environments
        with long episodes override it to share immutable history.
        """
        self.check_open()
        return copy.deepcopy(self)

    def reset_rng(self, seed: int | None) -> None:
        """Seed ``self.np_random`` as Gymnasium's ``reset`` does (call at the start of ``areset``).

        Raises ``RuntimeError`` if the environment was closed, so an ``areset`` that calls it first
        never starts an episode on a closed environment.
        """
        self.check_open()
        gym.Env.reset(self, seed=seed)

    def _fork_rng(self) -> np.random.Generator | None:
        """A copy of the RNG in its current state, for forks (so both copies draw the same)."""
        return copy.deepcopy(self._np_random)

    # -- closing ------------------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called; a closed environment cannot be reset, stepped or forked."""
        return self._closed

    def close(self) -> None:
        """Release resources and mark the environment closed (calling it twice is allowed)."""
        self._closed = True
        super().close()

    def check_open(self) -> None:
        """Raise ``RuntimeError`` if :meth:`close` was called."""
        if self._closed:
            raise RuntimeError(
                f"this {type(self).__name__} was closed: create a new environment with agentenv.make(...), "
                "or fork() it before closing"
            )
