"""The async token-in-token-out rollout loop and the :class:`Trajectory` it records.

Many episodes run concurrently over :class:`~agentenv.wrappers.TokenEnv`s and one
:class:`~agents.engines.base.Engine`. Each turn of an episode is::

    completion = await engine.generate(ids_so_far, SamplingParams(stop=env.stop_strings, ...))
    obs_ids, reward, terminated, truncated, info = await env.astep(completion.token_ids)
    ids_so_far += completion.token_ids + obs_ids

so the next prompt is the episode's running id list (prompt + action + observation + …), never
decoded and re-tokenised, and every action id is exactly what the sampler drew, with its
log-prob. A trainer can recompute log-probs on exactly these ids.

The loop bounds how many episodes run at once (an :class:`asyncio.Semaphore`; with a batching
engine this is the largest batch it can form), gives each episode an optional wall-clock
timeout, and records a failing episode (an exception in the env or the engine, a timeout) with
its error instead of stopping the others; a tool call hung past the timeout is abandoned to its
thread (see :meth:`agentenv.Tool.acall`). Cancelling the caller cancels every running episode.

Token budget (the papers' limits, docs/algorithms/training.md "Token budgets"): a prompt longer than
``max_prompt_tokens`` (2000) is an error; the response, tool results included, is capped at
``max_response_tokens`` (6192): each turn may sample at most what is left, an observation that
would overrun the budget is cut to fit, and the episode ends with status ``"budget"`` as soon as
no token is left.

Example::

    env = TokenEnv(agentenv.make("multihop-qa"), tokenizer)
    episodes = [Episode(env.fork(), options={"index": i}) for i in range(8)]
    trajectories = await run_episodes(engine, episodes, RolloutConfig(concurrency=8))
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from agentenv.wrappers import TokenEnv
from agents.engines.base import Completion, Engine, SamplingParams

if TYPE_CHECKING:
    from agents.rollout.tree import Node, RolloutTree

__all__ = [
    "DEFAULT_MAX_PROMPT_TOKENS",
    "DEFAULT_MAX_RESPONSE_TOKENS",
    "Episode",
    "EpisodeStatus",
    "RolloutConfig",
    "Trajectory",
    "TurnRecord",
    "episodes_for",
    "run_episode",
    "run_episodes",
    "stream_episodes",
    "take_turn",
    "task_episode",
]

DEFAULT_MAX_PROMPT_TOKENS = 2000  # AT²PO / AEPO: max prompt length 2000 tokens
DEFAULT_MAX_RESPONSE_TOKENS = 6192  # AT²PO / AEPO: max response length, tool results included
DEFAULT_CONCURRENCY = 64  # episodes in flight; the loop reaches >= 90% of ideal throughput here

#: How an episode ended: the env ended it (``terminated``: an answer; ``truncated``: a turn
#: limit), the token budget ran out (``budget``), the timeout passed (``timeout``), or an
#: exception was raised by the env or the engine (``error``).
EpisodeStatus = Literal["terminated", "truncated", "budget", "timeout", "error"]


@dataclass(frozen=True)
class RolloutConfig:
    """How the loop runs episodes; every field has the papers' or a measured default.

    Attributes:
        sampling: Sampling parameters of every turn. The env's stop strings are added to
            ``sampling.stop``; ``max_new_tokens`` is lowered to what the budget leaves. With
            ``sampling.seed`` set, turn t of episode i samples with a seed derived from
            ``(seed, i, t)``, so episodes differ from each other and a rerun repeats them.
        concurrency: Episodes in flight at once.
        episode_timeout: Seconds one episode may take (``None``: no limit); waiting for a
            concurrency slot does not count.
        max_prompt_tokens: Longest prompt accepted (2000 in AT²PO and AEPO).
        max_response_tokens: Token budget of everything after the prompt, actions and tool
            results together (6192 in AT²PO and AEPO).
        keep_states: Keep a fork of the env at each turn boundary (:attr:`TurnRecord.env`),
            so a rollout tree can branch from any turn later. Off by default: a fork of a
            stateful tool holds resources (a sandbox is a process) until it is closed.
    """

    sampling: SamplingParams = field(default_factory=SamplingParams)
    concurrency: int = DEFAULT_CONCURRENCY
    episode_timeout: float | None = None
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS
    max_response_tokens: int = DEFAULT_MAX_RESPONSE_TOKENS
    keep_states: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(self.sampling).__name__}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency!r}")
        if self.episode_timeout is not None and not self.episode_timeout > 0:
            raise ValueError(f"episode_timeout must be > 0 seconds or None, got {self.episode_timeout!r}")
        if self.max_prompt_tokens < 1 or self.max_response_tokens < 1:
            raise ValueError(
                f"max_prompt_tokens and max_response_tokens must be >= 1, got "
                f"{self.max_prompt_tokens!r} and {self.max_response_tokens!r}"
            )

    def check_prompt(self, prompt_ids: Sequence[int]) -> None:
        """Raise ``ValueError`` if the prompt is longer than ``max_prompt_tokens``."""
        if len(prompt_ids) > self.max_prompt_tokens:
            raise ValueError(
                f"the prompt has {len(prompt_ids)} tokens, more than max_prompt_tokens={self.max_prompt_tokens}; "
                "raise RolloutConfig.max_prompt_tokens or shorten the prompt"
            )

    def turn_sampling(self, env: TokenEnv, *, max_new_tokens: int, seed: int | None) -> SamplingParams:
        """The sampling of one turn in ``env``: ``sampling`` with the env's stop strings added, the cap and the seed."""
        base = self.sampling
        stop = base.stop + tuple(s for s in env.stop_strings if s not in base.stop)
        return dataclasses.replace(base, stop=stop, max_new_tokens=max_new_tokens, seed=seed)


@dataclass(frozen=True)
class Episode:
    """One episode to run: the env it runs in and how that env is reset.

    The loop resets and steps ``env``; it does not close it. Give each episode its own env
    (``base_env.fork()`` is O(1) for the shipped envs).

    Attributes:
        env: The token-level environment.
        seed: ``env.reset(seed=...)``.
        options: ``env.reset(options=...)``, e.g. ``{"index": 3}`` for task 3 of a QA env.
        key: Any label of the caller's, copied into the trajectory (e.g. ``(env_id, question, sample)``).
    """

    env: TokenEnv
    seed: int | None = None
    options: Mapping[str, Any] | None = None
    key: Any = None

    def __post_init__(self) -> None:
        if not isinstance(self.env, TokenEnv):
            raise TypeError(
                f"Episode.env must be an agentenv TokenEnv, got {type(self.env).__name__}; wrap a text "
                f"env with TokenEnv(env, tokenizer) so the loop can exchange token ids with it"
            )


@dataclass
class TurnRecord:
    """One turn: the sampled action and the observation the env returned for it.

    Attributes:
        action_ids: The ids the engine sampled, exactly.
        sampler_logprobs: The sampler's log-prob of each action id (:attr:`agents.engines.Completion.logprobs`).
        obs_ids: The observation ids that follow the action (empty when the episode ended;
            cut when the token budget ran out, see ``info["obs_cut"]``).
        action_span: ``(start, end)`` of the action in :attr:`Trajectory.ids`.
        obs_span: ``(start, end)`` of the observation in :attr:`Trajectory.ids`.
        reward: The env's reward for this step.
        finish_reason: Why the engine stopped (``"stop"``, ``"length"``, ``"eos"``).
        stop_reason: The stop string or token id that matched, if any.
        token_entropies: Full-distribution entropy per action token, when the engine gave them.
        top_logprobs: Top log-probs per action token, when asked for (``sampling.logprobs_topk``).
        env: A fork of the env taken just before this action was applied (``None`` unless
            ``keep_states``): ``env.sequence()`` is the context the action was sampled from, and
            stepping ``env`` with another action branches a sibling of this turn.
        info: The env's step info (tool used, parse error, grade on the last turn).
        version: The version of the weights that sampled the action
            (:attr:`agents.engines.Completion.version`; ``None`` when the engine does not say).
        token_versions: Each action token's version where the weights changed during the action
            (a load in flight); ``None`` when every token has ``version``.
    """

    action_ids: list[int]
    sampler_logprobs: list[float]
    obs_ids: list[int]
    action_span: tuple[int, int]
    obs_span: tuple[int, int]
    reward: float
    finish_reason: str
    stop_reason: str | int | None = None
    token_entropies: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    env: TokenEnv | None = None
    info: dict[str, Any] = field(default_factory=dict)
    version: int | None = None
    token_versions: list[int] | None = None

    def add_to(
        self,
        tree: RolloutTree,
        parent: Node,
        *,
        obs_ids: Sequence[int],
        env: TokenEnv | None,
        terminal: bool,
        reward: float | None,
        info: dict[str, Any],
    ) -> Node:
        """Append this turn under ``parent`` as a node of ``tree`` and return it: the one place a turn becomes a
        node, so the sampler's log-probs, entropies and weights versions reach every tree alike.

        ``obs_ids`` are the observation tokens that came after ``parent``'s action (the node's
        own, :attr:`Node.obs_ids`); ``env`` the state this turn starts from; see
        :meth:`RolloutTree.add_turn` for the rest.
        """
        return tree.add_turn(
            parent,
            obs_ids=obs_ids,
            action_ids=self.action_ids,
            sampler_logprobs=self.sampler_logprobs,
            token_entropies=self.token_entropies,
            env=env,
            terminal=terminal,
            reward=reward,
            info=info,
            version=self.version,
            token_versions=self.token_versions,
        )


@dataclass
class Trajectory:
    """One episode as the loop recorded it.

    ``ids`` is the prompt followed by each turn's action and observation ids; :attr:`mask` is 1
    on action ids; :attr:`sampler_logprobs` is aligned with ``ids`` (``None`` off the mask).

    Attributes:
        index: Position of the episode in the list given to the loop.
        key: The :attr:`Episode.key`.
        prompt_ids: The prompt (chat template applied).
        turns: The turns, first to last.
        status: How the episode ended (see :data:`EpisodeStatus`).
        error: ``"ExceptionType: message"`` when ``status`` is ``"error"`` or ``"timeout"``.
        info: The env's reset info updated by its last step info (question, answers, grade …).
        seconds: Wall-clock time of the episode (excluding the wait for a concurrency slot).
    """

    index: int
    key: Any
    prompt_ids: list[int]
    turns: list[TurnRecord]
    status: EpisodeStatus
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def reward(self) -> float:
        """The episode's return: the sum of its step rewards."""
        return math.fsum(turn.reward for turn in self.turns)

    @property
    def ids(self) -> list[int]:
        """The whole episode's token ids: prompt, then each turn's action and observation."""
        ids = list(self.prompt_ids)
        for turn in self.turns:
            ids += turn.action_ids
            ids += turn.obs_ids
        return ids

    @property
    def mask(self) -> list[int]:
        """1 on action (sampled) tokens, 0 on prompt and observation tokens; aligned with :attr:`ids`."""
        mask = [0] * len(self.prompt_ids)
        for turn in self.turns:
            mask += [1] * len(turn.action_ids) + [0] * len(turn.obs_ids)
        return mask

    @property
    def sampler_logprobs(self) -> list[float | None]:
        """The sampler's log-prob of each token, ``None`` where :attr:`mask` is 0."""
        logprobs: list[float | None] = [None] * len(self.prompt_ids)
        for turn in self.turns:
            logprobs += turn.sampler_logprobs
            logprobs += [None] * len(turn.obs_ids)
        return logprobs

    @property
    def response_length(self) -> int:
        """Tokens after the prompt (actions and observations), the quantity the budget caps."""
        return sum(len(turn.action_ids) + len(turn.obs_ids) for turn in self.turns)

    @property
    def num_action_tokens(self) -> int:
        """Tokens the engine sampled in this episode."""
        return sum(len(turn.action_ids) for turn in self.turns)

    @property
    def ok(self) -> bool:
        """Whether the episode ran without an exception or timeout."""
        return self.status not in ("error", "timeout")

    def to_dict(self, tokenizer: Any = None) -> dict[str, Any]:
        """A JSON-ready record (one line of a trajectories JSONL file).

        Keys: ``ids``, ``mask``, ``sampler_logprobs`` (null off the mask), ``reward``, ``status``,
        ``error``, ``question``, ``answers``, ``grade``, ``turns`` (spans, finish reasons,
        tools), ``token_entropies`` when the engine gave them, and ``text`` (the decoded episode,
        special tokens kept) when a tokenizer is given.
        """
        record: dict[str, Any] = {
            "index": self.index,
            "key": self.key if _json_scalar_or_list(self.key) else repr(self.key),
            "id": self.info.get("id"),
            "question": self.info.get("question"),
            "answers": self.info.get("answers"),
            "grade": self.info.get("grade"),
            "reward": self.reward,
            "status": self.status,
            "error": self.error,
            "ids": self.ids,
            "mask": self.mask,
            "sampler_logprobs": self.sampler_logprobs,
            "turns": [
                {
                    "action_span": list(turn.action_span),
                    "obs_span": list(turn.obs_span),
                    "finish_reason": turn.finish_reason,
                    "stop_reason": turn.stop_reason,
                    "reward": turn.reward,
                    "tool": turn.info.get("tool"),
                }
                for turn in self.turns
            ],
            "seconds": self.seconds,
        }
        if self.turns and all(turn.token_entropies is not None for turn in self.turns):
            entropies: list[float | None] = [None] * len(self.prompt_ids)
            for turn in self.turns:
                entropies += turn.token_entropies + [None] * len(turn.obs_ids)  # type: ignore[operator]
            record["token_entropies"] = entropies
        if tokenizer is not None:
            record["text"] = tokenizer.decode(record["ids"], skip_special_tokens=False)
        return record

    def add_to(self, tree: RolloutTree, parent: Node | None = None) -> Node:
        """Append this trajectory's turns to ``tree`` as one chain and return its last node.

        The chain hangs under ``parent`` (default: the root, whose prompt must equal this
        trajectory's). A trajectory whose env ended it (``terminated``/``truncated``) becomes a
        leaf with its reward; any other stays open (a strategy decides, e.g. ``tree.prune``).
        Each node's ``env`` is the turn's :attr:`TurnRecord.env`.
        """
        node = tree.root if parent is None else parent
        if parent is None and tree.prompt_ids != self.prompt_ids:
            raise ValueError("the tree's prompt differs from this trajectory's prompt; pass the parent node explicitly")
        if not self.turns:
            raise ValueError(f"trajectory {self.index} has no turns ({self.status}: {self.error}); nothing to add")
        previous_obs: list[int] = []
        for position, turn in enumerate(self.turns):
            last = position == len(self.turns) - 1
            terminal = last and self.status in ("terminated", "truncated")
            node = turn.add_to(
                tree,
                node,
                obs_ids=previous_obs,
                env=turn.env,
                terminal=terminal,
                reward=self.reward if terminal else None,
                info={"finish_reason": turn.finish_reason, "tool": turn.info.get("tool"), "status": self.status},
            )
            previous_obs = turn.obs_ids
        return node

    def close_envs(self) -> None:
        """Close the env forks kept at the turn boundaries (releases stateful tools, e.g. sandboxes)."""
        for turn in self.turns:
            if turn.env is not None:
                turn.env.close()
                turn.env = None


def _json_scalar_or_list(value: Any) -> bool:
    if value is None or isinstance(value, (str, int, float, bool)):
        return True
    return isinstance(value, (list, tuple)) and all(_json_scalar_or_list(v) for v in value)


def _turn_seed(base: int, episode: int, turn: int) -> int:
    """A seed for turn ``turn`` of episode ``episode``, independent streams per (episode, turn)."""
    return int(np.random.SeedSequence([base, episode, turn]).generate_state(1)[0])


async def run_episode(
    engine: Engine, episode: Episode, config: RolloutConfig | None = None, *, index: int = 0
) -> Trajectory:
    """Run one episode to its end; never raises for a failure of the env or the engine.

    An exception becomes ``status="error"`` and a timeout ``status="timeout"``, with the turns
    recorded so far. Cancellation of the task running the episode propagates; a stray
    :class:`asyncio.CancelledError` that the env or the engine raises while nothing cancels that
    task (an aborted request, say) is an ``"error"`` like any other exception.
    """
    config = config or RolloutConfig()
    trajectory = Trajectory(index=index, key=episode.key, prompt_ids=[], turns=[], status="error")
    start = time.perf_counter()
    try:
        async with asyncio.timeout(config.episode_timeout):
            await _play(engine, episode, config, trajectory)
    except TimeoutError:
        trajectory.status = "timeout"
        trajectory.error = f"TimeoutError: the episode took longer than episode_timeout={config.episode_timeout} s"
    except Exception as error:  # a failing episode is recorded and never stops the others
        trajectory.status = "error"
        trajectory.error = f"{type(error).__name__}: {error}"
    except asyncio.CancelledError as error:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise
        # Not a cancellation of this episode: propagated, it would end the whole run.
        trajectory.status = "error"
        trajectory.error = f"CancelledError: {error}"
    trajectory.seconds = time.perf_counter() - start
    return trajectory


async def _play(engine: Engine, episode: Episode, config: RolloutConfig, trajectory: Trajectory) -> None:
    """The turns of one episode, recorded into ``trajectory`` as they happen."""
    env = episode.env
    prompt_ids, info = await env.areset(seed=episode.seed, options=dict(episode.options) if episode.options else None)
    trajectory.prompt_ids = list(prompt_ids)
    trajectory.info = info
    config.check_prompt(prompt_ids)
    base_seed = config.sampling.seed
    ids = list(prompt_ids)  # the running context: prompt + action + observation + …
    while True:
        fork = env.fork() if config.keep_states else None
        seed = None if base_seed is None else _turn_seed(base_seed, trajectory.index, len(trajectory.turns))
        try:
            turn, status = await take_turn(
                engine, env, ids, config, prompt_length=len(prompt_ids), seed=seed, fork=fork
            )
        except BaseException:
            if fork is not None:
                fork.close()  # a fork may hold a process (a sandbox); no turn keeps it
            raise
        ids += turn.action_ids
        ids += turn.obs_ids
        trajectory.turns.append(turn)
        trajectory.info.update({k: v for k, v in turn.info.items() if k not in ("action_span", "obs_span", "length")})
        if status is not None:
            trajectory.status = status
            return


async def take_turn(
    engine: Engine,
    env: TokenEnv,
    ids: Sequence[int],
    config: RolloutConfig,
    *,
    prompt_length: int,
    seed: int | None = None,
    max_new_tokens: int | None = None,
    fork: TokenEnv | None = None,
) -> tuple[TurnRecord, EpisodeStatus | None]:
    """One turn of an episode in progress: sample an action after ``ids`` and apply it to ``env``.

    This is the loop's turn, exposed so that a rollout tree can resume an episode from a fork
    of its env (``fork.sequence()[0]`` is the context to pass as ``ids``).

    Args:
        engine: Samples the action.
        env: The episode's env, positioned after ``ids``; it is stepped with the action.
        ids: The running context (prompt + actions + observations so far); not modified. The
            caller appends ``turn.action_ids + turn.obs_ids`` to continue.
        config: Sampling parameters and the token budget (``config.keep_states`` is the
            caller's business: pass the fork it took as ``fork``).
        prompt_length: How many of ``ids`` are the prompt (the budget counts what follows).
        seed: The sampling seed of this turn (replaces ``config.sampling.seed``).
        max_new_tokens: A further cap on this turn's tokens (e.g. a tree's token budget).
        fork: A fork of ``env`` taken before this turn, stored as :attr:`TurnRecord.env`.

    Returns:
        The turn, and how the episode ended: ``"terminated"``/``"truncated"`` (the env ended
        it), ``"budget"`` (no response tokens left after this turn), or ``None`` (it goes on).
    """
    # B − (|context| − |prompt|)  (docs/algorithms/training.md eq. 60)
    budget = config.max_response_tokens - (len(ids) - prompt_length)
    if budget < 1:
        raise ValueError(f"the episode has used its max_response_tokens={config.max_response_tokens}; no turn is left")
    cap = min(config.sampling.max_new_tokens, budget)  # docs/algorithms/training.md eq. 60
    if max_new_tokens is not None:
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens!r}")
        cap = min(cap, max_new_tokens)
    params = config.turn_sampling(env, max_new_tokens=cap, seed=seed)
    completion = await engine.generate(ids, params)
    _check_completion(completion, params)
    action_ids = list(completion.token_ids)
    obs_ids, reward, terminated, truncated, step_info = await env.astep(action_ids)
    action_span = (len(ids), len(ids) + len(action_ids))
    if tuple(step_info.get("action_span", action_span)) != action_span:
        raise RuntimeError(
            f"the env places the action at {step_info['action_span']} but the loop at {action_span}: "
            "the env was stepped outside the loop"
        )
    left = budget - len(action_ids)  # docs/algorithms/training.md eq. 61
    if len(obs_ids) > left:
        step_info["obs_cut"] = len(obs_ids) - max(left, 0)
        obs_ids = obs_ids[: max(left, 0)]  # obs ← obs[: max(0, left)]  (docs/algorithms/training.md eq. 61)
    obs_start = action_span[1]
    turn = TurnRecord(
        action_ids=action_ids,
        sampler_logprobs=list(completion.logprobs),
        obs_ids=list(obs_ids),
        action_span=action_span,
        obs_span=(obs_start, obs_start + len(obs_ids)),
        reward=float(reward),
        finish_reason=completion.finish_reason,
        stop_reason=completion.stop_reason,
        token_entropies=None if completion.token_entropies is None else list(completion.token_entropies),
        top_logprobs=completion.top_logprobs,
        env=fork,
        info=step_info,
        version=completion.version,
        token_versions=_changed_versions(completion.token_versions),
    )
    if terminated or truncated:
        return turn, "terminated" if terminated else "truncated"
    if left - len(obs_ids) < 1:  # the path ends once left − |obs| < 1 (docs/algorithms/training.md "Token budgets")
        return turn, "budget"
    return turn, None


def _changed_versions(versions: list[int | None] | None) -> list[int] | None:
    """The tokens' versions when they differ within the completion, else ``None`` (one version for all)."""
    if versions is None or None in versions or len(set(versions)) == 1:
        return None  # None in it: a load in flight on an engine without a gate to say the first version
    return versions  # type: ignore[return-value]  # no None left


def _check_completion(completion: Completion, params: SamplingParams) -> None:
    if not isinstance(completion, Completion):
        raise TypeError(f"the engine returned {type(completion).__name__}, not a Completion")
    if not completion.token_ids:
        raise RuntimeError("the engine returned no tokens; a turn needs at least one sampled token")
    if len(completion.token_ids) > params.max_new_tokens:
        raise RuntimeError(
            f"the engine returned {len(completion.token_ids)} tokens for max_new_tokens={params.max_new_tokens}"
        )


async def stream_episodes(
    engine: Engine, episodes: Iterable[Episode], config: RolloutConfig | None = None
) -> AsyncIterator[Trajectory]:
    """Run episodes concurrently and yield each trajectory as soon as its episode ends.

    At most ``config.concurrency`` episodes run at once. Closing the iterator early, or
    cancelling the task that iterates, cancels the episodes still running.
    """
    config = config or RolloutConfig()
    episodes = list(episodes)
    for position, episode in enumerate(episodes):
        if not isinstance(episode, Episode):
            raise TypeError(f"episodes[{position}] is a {type(episode).__name__}, not an agents.rollout.Episode")
    slots = asyncio.Semaphore(config.concurrency)

    async def guarded(index: int, episode: Episode) -> Trajectory:
        async with slots:
            return await run_episode(engine, episode, config, index=index)

    tasks = [asyncio.create_task(guarded(index, episode)) for index, episode in enumerate(episodes)]
    try:
        for finished in asyncio.as_completed(tasks):
            yield await finished
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def run_episodes(
    engine: Engine, episodes: Iterable[Episode], config: RolloutConfig | None = None
) -> list[Trajectory]:
    """Run episodes concurrently; returns their trajectories in the order of ``episodes``."""
    trajectories = [trajectory async for trajectory in stream_episodes(engine, episodes, config)]
    return sorted(trajectories, key=lambda trajectory: trajectory.index)


def task_episode(env: TokenEnv, task: int) -> Episode:
    """The episode of ``task`` on a fork of ``env``: its task-list entry, or a reset seeded with it."""
    if env.tasks is not None:
        return Episode(env.fork(), options={"index": task}, key=task)
    return Episode(env.fork(), seed=task, key=task)


def episodes_for(env: TokenEnv, tasks: Sequence[int], samples: int = 1, key_prefix: Any = None) -> list[Episode]:
    """Episodes posing task ``i`` of a QA-style env ``samples`` times each, every one on its own fork.

    The key of each episode is ``(key_prefix, task, sample)`` (``(task, sample)`` without a prefix).
    """
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples!r}")
    return [
        Episode(
            env.fork(),
            options={"index": task},
            key=(task, sample) if key_prefix is None else (key_prefix, task, sample),
        )
        for task in tasks
        for sample in range(samples)
    ]
