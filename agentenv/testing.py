"""Conformance checks for environments: Gymnasium's ``check_env`` plus the fork contract.

Use it in your own tests::

    from agentenv.testing import check_env
    check_env(agentenv.make("my-env"))

It raises :class:`EnvCheckError` (an ``AssertionError``) naming the violated rule.
"""

from __future__ import annotations

import asyncio
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

from gymnasium.utils.env_checker import check_env as gymnasium_check_env

from agentenv.core import Env

__all__ = ["EnvCheckError", "check_env"]

Result = tuple[Any, float, bool, bool]  # (obs, reward, terminated, truncated)
SEED = 0


class EnvCheckError(AssertionError):
    """An environment breaks the agentenv contract; the message says which rule and how."""


def _run(env: Env, actions: Sequence[str]) -> list[Result]:
    """Step through ``actions`` until the episode ends; the results, info left out."""
    results = []
    for action in actions:
        obs, reward, terminated, truncated, _ = env.step(action)
        results.append((obs, float(reward), bool(terminated), bool(truncated)))
        if terminated or truncated:
            break
    return results


async def _arun(env: Env, actions: Sequence[str]) -> tuple[Any, list[Result]]:
    obs, _ = await env.areset(seed=SEED)
    results = []
    for action in actions:
        o, reward, terminated, truncated, _ = await env.astep(action)
        results.append((o, float(reward), bool(terminated), bool(truncated)))
        if terminated or truncated:
            break
    return obs, results


def _snapshot(env: Env) -> Any:
    """A view of the state that must not change when a fork is stepped (where the env offers one)."""
    transcript = getattr(env, "transcript", None)
    return transcript() if callable(transcript) else None


def _default_actions(env: Env) -> list[str]:
    demo = getattr(env, "demo_actions", None)
    if callable(demo):
        actions = list(demo())
        if actions:
            return actions
    env.action_space.seed(SEED)
    return [env.action_space.sample() for _ in range(3)]


def _fork_policies(env: Env) -> dict[str, str]:
    """The ``fork_policy`` the env's tools declare (see :mod:`agentenv.tools`), by tool name."""
    tools = getattr(env, "tools", None)
    if not isinstance(tools, Mapping):
        return {}
    return {
        name: policy for name, t in tools.items() if (policy := getattr(getattr(t, "fn", None), "fork_policy", None))
    }


def _tools(names: list[str]) -> str:
    return ("tool " if len(names) == 1 else "tools ") + ", ".join(f"`{n}`" for n in names)


def _expect(condition: bool, name: str, rule: str, detail: str) -> None:
    if not condition:
        raise EnvCheckError(f"{name}: {rule}\n  {detail}")


def check_env(env: Env, *, actions: Sequence[str] | None = None, skip_gymnasium: bool = False) -> None:
    """Check ``env`` against Gymnasium's API and agentenv's fork and async contract.

    Args:
        env: The environment (built with :func:`agentenv.make` so that its spec is known).
        actions: Actions to drive the checks (default: the env's ``demo_actions()`` after a
            seeded reset, else samples of its action space). The first one should not end
            the episode, so that forks are tested mid-episode.
        skip_gymnasium: Skip Gymnasium's own checker.

    Fork rules checked: a fork made mid-episode diverges without touching its parent; the same
    actions on two forks give equal observations and rewards (unless the spec is marked
    ``nondeterministic``, or a tool declares ``fork_policy="share"``: a warning then says so); a
    fork made after the end is a usable environment that leaves the ended parent as it was;
    ``areset``/``astep`` agree with ``reset``/``step``. A tool declaring ``fork_policy="refuse"``
    fails the check.
    Call it from synchronous code (it drives the sync API).
    """
    base = env.unwrapped
    name = type(base).__name__
    if not isinstance(base, Env):
        raise EnvCheckError(f"{name}: must subclass agentenv.Env (got {type(base).__mro__[1:3]})")
    if not skip_gymnasium:
        gymnasium_check_env(env, skip_render_check=False)
    deterministic = not (env.spec is not None and env.spec.nondeterministic)
    independent = deterministic and not _shared_tools(base, name)

    env.reset(seed=SEED)
    actions = list(actions) if actions is not None else _default_actions(base)
    _expect(len(actions) >= 2, name, "needs at least two actions to check forks", f"got {actions!r}")
    env.reset(seed=SEED)
    reference = _reference_episode(base, name, actions)
    forks = [
        _check_a_fork_diverges(base, name, actions, reference, independent),
        *_check_two_forks_agree(base, name, actions, reference, independent),
    ]
    forks.append(_check_a_fork_after_the_end(forks[1], name, actions, reference, deterministic))
    forks.append(_check_async_agrees(base, name, actions, reference, deterministic))
    for fork in forks:
        fork.close()


def _shared_tools(base: Env, name: str) -> list[str]:
    """The tools whose forks share their state (a warning says their results go unchecked); a refusing tool fails."""
    policies = _fork_policies(base)
    refused = [t for t, policy in policies.items() if policy == "refuse"]
    _expect(
        not refused,
        name,
        "fork() must give an independent copy",
        f"fork_policy='refuse' is declared by {_tools(refused)} (state that cannot be forked), so fork() "
        "raises; give it a policy that forks to check the env",
    )
    shared = [t for t, policy in policies.items() if policy == "share"]
    if shared:
        warnings.warn(
            f"{name}: fork_policy='share' is declared by {_tools(shared)} (forks share its state): "
            "fork results are not checked for independence",
            stacklevel=3,  # check_env's caller
        )
    return shared


def _reference_episode(base: Env, name: str, actions: list[str]) -> list[Result]:
    """One uninterrupted episode of ``actions`` (the env just reset), its first action not ending it."""
    first, rest = actions[0], actions[1:]
    reference = _run(base, [first])
    _expect(
        not (reference[0][2] or reference[0][3]),
        name,
        "the first check action must not end the episode",
        f"action {first!r} ended it; pass actions= whose first one does not",
    )
    return reference + _run(base, rest)


def _check_a_fork_diverges(base: Env, name: str, actions: list[str], reference: list[Result], independent: bool) -> Env:
    """1. A fork diverges without touching its parent; returns the fork."""
    first, rest = actions[0], actions[1:]
    base.reset(seed=SEED)
    _run(base, [first])
    before = _snapshot(base)
    child = base.fork()
    _expect(child is not base, name, "fork() must return a new object", "it returned self")
    diverging = base.action_space.sample()
    _run(child, [diverging, *rest])
    _expect(
        _snapshot(base) == before,
        name,
        "stepping a fork must not change its parent",
        "the parent's transcript changed after its fork was stepped",
    )
    parent_rest = _run(base, rest)
    if independent:
        _expect(
            parent_rest == reference[1:],
            name,
            "stepping a fork must not change its parent",
            f"after the fork stepped {diverging!r}, the parent's next results differ from an untouched episode:"
            f"\n  got      {parent_rest!r}\n  expected {reference[1:]!r}",
        )
    return child


def _check_two_forks_agree(
    base: Env, name: str, actions: list[str], reference: list[Result], independent: bool
) -> tuple[Env, Env]:
    """2. The same actions on two forks give the same results; returns the two (their episodes ended)."""
    first, rest = actions[0], actions[1:]
    base.reset(seed=SEED)
    _run(base, [first])
    a, b = base.fork(), base.fork()
    results_a, results_b = _run(a, rest), _run(b, rest)
    if independent:
        _expect(
            results_a == results_b == reference[1:],
            name,
            "the same actions on two forks must give the same results",
            f"fork A: {results_a!r}\n  fork B: {results_b!r}\n  uninterrupted: {reference[1:]!r}",
        )
    return a, b


def _check_a_fork_after_the_end(
    ended_env: Env, name: str, actions: list[str], reference: list[Result], deterministic: bool
) -> Env:
    """3. A fork made after the end is usable and leaves the ended parent as it was; returns the fork."""
    ended = _snapshot(ended_env)
    late = ended_env.fork()
    late.reset(seed=SEED)
    late_results = _run(late, actions)
    _expect(
        _snapshot(ended_env) == ended,
        name,
        "resetting a fork made after the end must not change its parent",
        "the ended parent's transcript changed",
    )
    if deterministic:
        _expect(
            late_results == reference,
            name,
            "a fork made after the end must behave like a fresh environment",
            f"got {late_results!r}\n  expected {reference!r}",
        )
    return late


def _check_async_agrees(base: Env, name: str, actions: list[str], reference: list[Result], deterministic: bool) -> Env:
    """4. The async pair agrees with the sync pair; returns the fork it ran on."""
    fresh = base.fork()
    prompt_sync, _ = base.reset(seed=SEED)
    prompt_async, async_results = asyncio.run(_arun(fresh, actions))
    if deterministic:
        _expect(
            prompt_async == prompt_sync and async_results == reference,
            name,
            "areset/astep must agree with reset/step",
            f"async: {async_results!r}\n  sync: {reference!r}",
        )
    return fresh
