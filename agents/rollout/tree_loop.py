"""The async loop that grows the rollout trees of a batch of prompts under one strategy.

Every prompt of the batch runs concurrently. Within a prompt the loop goes in **steps**: each
step takes one turn of every running branch, all concurrently on the engine (a batching engine
sees them together), then records the turns in order and asks the strategy about each one.
Doing the bookkeeping in branch order, between steps, is what makes a prompt's trees
reproducible: which branch gets the last slot of a budget, or draws which random number, never
depends on which engine call returned first. (The reference implementations of ARPO, AEPO and
AT²PO proceed in the same rounds.)

**Turns run ahead** where nothing but its own path decides a branch's next turn: when the
strategy forks nothing after a turn (it does not override :meth:`Strategy.after_turn`: Chain,
AT²PO's EntropyTree, Tree-GRPO's RandomTree) and the budget caps neither tokens nor tool calls,
each branch takes its turns back to back, and the steps only record them, in the same order.
The trees are the same; what changes is that no branch waits for the slowest turn of a step
before its next one, so a batching engine keeps more rows busy. ARPO and AEPO branch after
turns, from the shared random generator and leaf budget and from the path's live state, so
their branches keep to the steps.

A turn is :func:`agents.rollout.take_turn`: token ids in, token ids out, never re-encoded. A
branch starts from a **fork** of the environment state at its branch point, so stateful tools
(a Python session, a browsed page) continue from exactly that state in each branch.

Seeds: with ``TreeConfig.seed`` set, turn ``t`` of the prompt's ``b``-th branch samples with a
seed derived from ``(seed, prompt index, b, t)``, and the strategy's random generator from
``(seed, prompt index)``; a deterministic engine (greedy or seeded) then reproduces the trees.

Example::

    env = TokenEnv(agentenv.make("python-math"), tokenizer)
    episodes = [Episode(env.fork(), options={"index": i}) for i in range(4)]
    results = await rollout_trees(engine, episodes, EntropyTree(), TreeConfig(seed=0))
    for prompt in results:
        turnwise_credit(prompt.trees[0])
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from agentenv.wrappers import TokenEnv
from agents.engines.base import Completion, Engine
from agents.rollout.diagnostics import tree_metrics
from agents.rollout.episodes import (
    Episode,
    EpisodeStatus,
    RolloutConfig,
    Trajectory,
    TurnRecord,
    run_episode,
    take_turn,
)
from agents.rollout.strategies.base import Branch, BranchEvent, BranchPoint, Budget, PromptTrees, Strategy, TreeStats
from agents.rollout.tree import Node, RolloutTree

__all__ = ["TreeConfig", "planned_branches", "rollout_trees"]


@dataclass(frozen=True)
class TreeConfig:
    """How :func:`rollout_trees` runs: the turns as in :func:`agents.rollout.run_episodes`, plus a tree's own settings.

    Attributes:
        rollout: How every turn runs (:class:`~agents.rollout.RolloutConfig`): sampling (its
            ``seed`` must stay ``None``: set ``seed``; the env's stop strings are added and the
            strategy may raise ``logprobs_topk``), ``concurrency`` (turns in flight across all
            prompts), ``max_prompt_tokens``, ``max_response_tokens`` (the token budget of one
            root-to-leaf path; a path that uses it up ends as a leaf) and ``keep_states`` (keep
            each node's environment state, ``node.env``, after the rollout to branch again later;
            off by default: the loop closes them, since they may hold sandboxes). Its
            ``episode_timeout`` must stay ``None``: a tree times out per turn (``turn_timeout``).
        seed: The rollout seed (see the module docstring); ``None`` samples freshly.
        budget: Caps per prompt on leaves, tool calls and tokens.
        turn_timeout: Seconds one turn (generation and tool) may take; ``None``: no limit. A
            turn that times out abandons its branch, like any failing turn.
    """

    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    seed: int | None = None
    budget: Budget = field(default_factory=Budget)
    turn_timeout: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.rollout, RolloutConfig):
            raise TypeError(f"rollout must be an agents.rollout.RolloutConfig, got {type(self.rollout).__name__}")
        if self.rollout.sampling.seed is not None:
            raise ValueError(
                "TreeConfig.rollout.sampling.seed must be None; set TreeConfig.seed, from which the "
                "loop derives one seed per turn"
            )
        if self.rollout.episode_timeout is not None:
            raise ValueError(
                "TreeConfig.rollout.episode_timeout must be None; a tree's branches time out per "
                "turn: set TreeConfig.turn_timeout"
            )
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0):
            raise ValueError(f"seed must be a non-negative int or None, got {self.seed!r}")
        if not isinstance(self.budget, Budget):
            raise TypeError(f"budget must be an agents.rollout.strategies.Budget, got {type(self.budget).__name__}")
        if self.turn_timeout is not None and not self.turn_timeout > 0:
            raise ValueError(f"turn_timeout must be > 0 seconds or None, got {self.turn_timeout!r}")


def planned_branches(strategy: Strategy, config: TreeConfig | None = None) -> int | None:
    """The branches one prompt's rollout starts: the strategy's count, capped by ``Budget.leaves`` (``None``: not known)."""
    planned, cap = strategy.branches_per_prompt, (config or TreeConfig()).budget.leaves
    return planned if cap is None or planned is None else min(planned, cap)


async def rollout_trees(
    engine: Engine,
    episodes: Iterable[Episode],
    strategy: Strategy,
    config: TreeConfig | None = None,
    *,
    indices: Sequence[int] | None = None,
    on_branches: Callable[[int], None] | None = None,
) -> list[PromptTrees]:
    """Grow the rollout trees of every episode's prompt under ``strategy``, all prompts concurrently.

    Each episode's env is reset once (it stays the trees' root state and is never stepped or
    closed); every branch runs on a fork. A failing turn abandons its branch (recorded in
    ``stats.errors``); a prompt that cannot start at all gets ``error``. Branches that end
    without a leaf are pruned, so every remaining path ends in a leaf.

    ``indices`` are the prompts' positions in the whole batch (default ``0, 1, …``), from which
    their seeds derive: a rollout worker running some prompts of a batch grows the same trees
    as one process running them all.

    ``on_branches(count)`` is called as branches end (at their leaf, or abandoned), with how many
    just ended (a progress bar's ``update``). When a prompt ends it is also called with the
    branches that :func:`planned_branches` counted but never ran (a budget refused them, the
    prompt failed), so that the counts of a strategy that knows its branches add up to
    ``len(episodes) × planned_branches(strategy, config)``.

    Returns:
        One :class:`PromptTrees` per episode, in order, with ``metrics`` filled
        (:func:`agents.rollout.diagnostics.tree_metrics`).
    """
    config = config or TreeConfig()
    if not isinstance(engine, Engine):
        raise TypeError(f"engine must be an agents.engines.Engine, got {type(engine).__name__}")
    if not isinstance(strategy, Strategy):
        raise TypeError(f"strategy must be an agents.rollout.strategies.Strategy, got {type(strategy).__name__}")
    episodes = list(episodes)
    for position, episode in enumerate(episodes):
        if not isinstance(episode, Episode):
            raise TypeError(f"episodes[{position}] is a {type(episode).__name__}, not an agents.rollout.Episode")
    indices = list(range(len(episodes))) if indices is None else [int(index) for index in indices]
    if len(indices) != len(episodes) or len(set(indices)) != len(indices):
        raise ValueError(f"indices must give each of the {len(episodes)} episodes its own position, got {indices}")
    run = _Run(engine, strategy, config, on_branches)
    tasks = [asyncio.create_task(_PromptLoop(run, index, episode).grow()) for index, episode in zip(indices, episodes)]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


class _Run:
    """What all prompts of one :func:`rollout_trees` call share."""

    def __init__(
        self, engine: Engine, strategy: Strategy, config: TreeConfig, on_branches: Callable[[int], None] | None
    ) -> None:
        self.engine = engine
        self.strategy = strategy
        self.config = config
        self.on_branches = on_branches
        self.planned = planned_branches(strategy, config)
        sampling = config.rollout.sampling
        sampling = dataclasses.replace(sampling, logprobs_topk=max(sampling.logprobs_topk, strategy.logprobs_topk))
        # The turns' own config: the loop forks the states it needs itself.
        self.rollout = dataclasses.replace(config.rollout, sampling=sampling, keep_states=False)
        self.keeps_states = strategy.keeps_turn_states or config.rollout.keep_states
        self.slots = asyncio.Semaphore(config.rollout.concurrency)

    def seed(self, *key: int) -> int | None:
        """A seed for ``key`` derived from the rollout seed (``None`` without one)."""
        if self.config.seed is None:
            return None
        return int(np.random.SeedSequence(self.config.seed, spawn_key=key).generate_state(1)[0])


class _Probe:
    """The loop's :class:`~agents.rollout.strategies.Probe`: pre-monitoring samples of one prompt."""

    def __init__(self, loop: _PromptLoop) -> None:
        self._loop = loop

    @property
    def vocab_size(self) -> int | None:
        """The engine's vocabulary size, when it tells (``vocab_size`` attribute)."""
        return getattr(self._loop.run.engine, "vocab_size", None)

    async def sample(self, max_new_tokens: int) -> Completion:
        """One completion of the prompt alone, stopping at the env's stop strings."""
        loop, run = self._loop, self._loop.run
        params = run.rollout.turn_sampling(
            loop.root_env, max_new_tokens=max_new_tokens, seed=run.seed(loop.prompt.index, 0, 0)
        )
        async with run.slots:
            completion = await run.engine.generate(loop.prompt_ids, params)
        loop.prompt.premonitor_tokens += len(completion.token_ids)
        return completion

    async def episode(self) -> Trajectory:
        """One whole episode of the prompt's task on a fork of the env (its tools really run)."""
        loop, run = self._loop, self._loop.run
        env = loop.fork(0, loop.root_env)
        config = dataclasses.replace(
            run.rollout, sampling=dataclasses.replace(run.rollout.sampling, seed=run.seed(loop.prompt.index, 0, 1))
        )
        episode = Episode(env, seed=loop.episode.seed, options=loop.episode.options)
        try:
            trajectory = await run_episode(run.engine, episode, config)
        finally:
            env.close()
        loop.prompt.premonitor_tokens += trajectory.num_action_tokens
        return trajectory


class _PromptLoop:
    """Grows the trees of one prompt."""

    def __init__(self, run: _Run, index: int, episode: Episode) -> None:
        self.run = run
        self.episode = episode
        self.root_env: TokenEnv = episode.env
        self.prompt_ids: list[int] = []
        rng = np.random.default_rng(np.random.SeedSequence(run.config.seed, spawn_key=(index,)))
        self.prompt = PromptTrees(index=index, key=episode.key, trees=[], rng=rng)
        self.kept: list[Node] = []  # nodes whose env this loop forked
        self.unclosed: dict[Branch, None] = {}  # branches whose env is still open, in order
        budget = run.config.budget
        self.runs_ahead = (
            type(run.strategy).after_turn is Strategy.after_turn and budget.tokens is None and budget.tool_calls is None
        )
        self.ahead: dict[Branch, _Ahead] = {}  # the branches taking their turns ahead of the steps
        self.reported = 0  # branches counted to run.on_branches

    async def grow(self) -> PromptTrees:
        prompt, strategy = self.prompt, self.run.strategy
        start = time.perf_counter()
        try:
            options = dict(self.episode.options) if self.episode.options else None
            prompt_ids, prompt.info = await self.root_env.areset(seed=self.episode.seed, options=options)
            self.prompt_ids = list(prompt_ids)
            self.run.rollout.check_prompt(self.prompt_ids)
            prompt.trees = [RolloutTree(self.prompt_ids, env=self.root_env) for _ in range(strategy.trees_per_prompt)]
            prompt.stats = [TreeStats() for _ in prompt.trees]
            await strategy.prepare(prompt, _Probe(self))
            live = self.open(strategy.start(prompt))
            while True:
                if not live:
                    live = self.open(strategy.next_round(prompt))
                    if not live:
                        break
                live = await self.step(live)
            strategy.finish(prompt)
        except Exception as error:  # a prompt that fails is recorded and never stops the others
            prompt.error = f"{type(error).__name__}: {error}"
        finally:
            try:
                await self.stop_running_ahead()
            finally:
                for branch in list(self.unclosed):
                    self.retire(branch)
                self.drop_dead_ends()
                self.release_states()
        prompt.seconds = time.perf_counter() - start
        prompt.metrics = [
            tree_metrics(tree, stats, [e for e in prompt.events if e.tree == position])
            for position, (tree, stats) in enumerate(zip(prompt.trees, prompt.stats))
        ]
        if self.run.planned is not None:
            self.report(self.run.planned - self.reported)  # those never started: the prompt is done
        return prompt

    # -- branches -----------------------------------------------------------------------------

    def open(self, points: list[BranchPoint]) -> list[Branch]:
        """Start a branch at each point the leaf budget allows."""
        prompt, leaves = self.prompt, self.run.config.budget.leaves
        opened = []
        for point in points:
            if not isinstance(point, BranchPoint):
                raise TypeError(
                    f"{type(self.run.strategy).__name__} returned a {type(point).__name__}, not a BranchPoint"
                )
            if leaves is not None and prompt.started >= leaves:
                prompt.refused += 1
                self.exhausted("leaves")
                continue
            if not 0 <= point.tree < len(prompt.trees):
                raise ValueError(f"branch point names tree {point.tree}; this prompt has {len(prompt.trees)} trees")
            parent = point.parent
            if prompt.trees[point.tree].node(parent.id) is not parent:
                raise ValueError(f"branch point parent {parent.id} is not in tree {point.tree}")
            if point.kind != "chain":
                source = point.source if point.source is not None and not point.source.is_root else None
                prompt.events.append(
                    BranchEvent(
                        point.tree,
                        prompt.step,
                        point.kind,
                        parent.depth,
                        None if source is None else source.entropy,
                        prompt.entropy_median(),
                    )
                )
            opened.append(
                Branch(
                    number=prompt.started,
                    tree=point.tree,
                    kind=point.kind,
                    parent=parent,
                    obs_ids=list(point.obs_ids),
                    env=self.fork(point.tree, point.env),
                    ids=parent.context_ids() + list(point.obs_ids),
                    tool_calls=int(parent.info.get("tool_calls", 0)),
                    reward=float(parent.info.get("return", 0.0)),
                    notes=dict(point.notes),
                )
            )
            self.unclosed[opened[-1]] = None
            prompt.started += 1
            if self.runs_ahead:
                self.ahead[opened[-1]] = _Ahead(self, opened[-1])
        return opened

    async def step(self, live: list[Branch]) -> list[Branch]:
        """One turn of every running branch the budgets allow; returns the branches still running."""
        prompt, budget = self.prompt, self.run.config.budget
        prompt.step += 1
        tokens_left = None if budget.tokens is None else budget.tokens - prompt.tokens
        calls_left = None if budget.tool_calls is None else budget.tool_calls - prompt.tool_calls
        spent = [
            name
            for name, left in (("tokens", tokens_left), ("tool_calls", calls_left))
            if left is not None and left < 1
        ]
        if spent:
            for name in spent:
                self.exhausted(name)
            for branch in live:
                self.cut(branch)
            return []
        # The branches that run this step, in order: a turn runs at most one tool, and the tokens
        # left are shared evenly (one each to the first ones when fewer than the branches).
        running = live
        if calls_left is not None:
            running = running[:calls_left]
        cap = None
        if tokens_left is not None:
            running = running[:tokens_left]
            # cap ← min(cap, ⌊tokens_left / running branches⌋)  (docs/algorithms/training.md eq. 63)
            cap = min(self.run.rollout.sampling.max_new_tokens, tokens_left // len(running))
        results = await asyncio.gather(*(self.next_turn(branch, cap) for branch in running), return_exceptions=True)
        for branch in running:
            if branch in self.ahead:
                self.ahead[branch].taken()
        outcomes = dict(zip(running, results))
        still: list[Branch] = []
        for branch in live:
            if branch not in outcomes:
                still.append(branch)
                continue
            outcome = outcomes[branch]
            if isinstance(outcome, BaseException):
                if not isinstance(outcome, Exception):
                    raise outcome
                stats = prompt.stats[branch.tree]
                stats.errors.append(f"{type(outcome).__name__}: {outcome}")
                stats.dropped += 1
                self.retire(branch)
                continue
            turn, status, fork = outcome
            node = self.record(branch, turn, status, fork)
            points = self.run.strategy.after_turn(prompt, branch, node, turn, status is not None)
            if status is None:
                still.append(branch)
            else:
                self.retire(branch)
            still += self.open(points)
        return still

    async def next_turn(
        self, branch: Branch, cap: int | None
    ) -> tuple[TurnRecord, EpisodeStatus | None, TokenEnv | None]:
        """The branch's next turn: taken now, or the one it has taken ahead (see the module docstring)."""
        ahead = self.ahead.get(branch)
        if ahead is None:
            return await self.turn(branch, branch.ids, branch.turns, cap)
        return await ahead.next()

    async def turn(
        self, branch: Branch, ids: list[int], turns: int, cap: int | None
    ) -> tuple[TurnRecord, EpisodeStatus | None, TokenEnv | None]:
        """Sample and apply the branch's turn number ``turns`` after context ``ids`` (forking its env first when states are kept)."""
        run = self.run
        fork = self.fork(branch.tree, branch.env) if run.keeps_states else None
        try:
            async with run.slots:
                try:
                    async with asyncio.timeout(run.config.turn_timeout):
                        turn, status = await take_turn(
                            run.engine,
                            branch.env,
                            ids,
                            run.rollout,
                            prompt_length=len(self.prompt_ids),
                            seed=run.seed(self.prompt.index, branch.number + 1, turns),
                            max_new_tokens=cap,
                            fork=fork,
                        )
                except TimeoutError:
                    raise TimeoutError(f"the turn took longer than turn_timeout={run.config.turn_timeout} s") from None
        except BaseException:
            if fork is not None:
                fork.close()
            raise
        return turn, status, fork

    def record(self, branch: Branch, turn: TurnRecord, status: EpisodeStatus | None, fork: TokenEnv | None) -> Node:
        """Add the turn to the branch's tree and advance the branch."""
        calls = turn.info.get("tool_calls")
        made = max(0, calls - branch.tool_calls) if isinstance(calls, int) else 0  # the env counts per episode
        branch.tool_calls += made
        branch.reward += turn.reward
        info = {
            "branch": branch.number,
            "finish_reason": turn.finish_reason,
            "tool": turn.info.get("tool"),
            "tool_calls": branch.tool_calls,
            "return": branch.reward,
        }
        if status is not None:
            info["status"] = status
        if "obs_cut" in turn.info:
            info["obs_cut"] = turn.info["obs_cut"]
        if "grade" in turn.info:  # an answered episode's grade (EM, F1, format), for the trainer's metrics
            info["grade"] = dict(turn.info["grade"])
        ended = status is not None
        node = turn.add_to(
            self.prompt.trees[branch.tree],
            branch.parent,
            obs_ids=branch.obs_ids,
            env=fork,
            terminal=ended,
            reward=branch.reward if ended else None,
            info=info,
        )
        if fork is not None:
            self.kept.append(node)
        stats = self.prompt.stats[branch.tree]
        stats.turns += 1
        stats.tokens += len(turn.action_ids)
        stats.context_tokens += len(branch.ids)
        stats.tool_calls += made
        branch.parent = branch.last = node
        branch.obs_ids = list(turn.obs_ids)
        branch.ids += turn.action_ids
        branch.ids += turn.obs_ids
        branch.turns += 1
        return node

    def cut(self, branch: Branch) -> None:
        """End a branch because a budget ran out: its last turn becomes a leaf when it can."""
        stats = self.prompt.stats[branch.tree]
        stats.budget_cuts += 1
        last = branch.last
        if last is not None and not last.children and not last.terminal:
            last.finish(branch.reward)
            last.info["status"] = "budget"
        else:
            stats.dropped += 1  # nothing of its own to end, or others already branch below its last turn
        self.retire(branch)

    def retire(self, branch: Branch) -> None:
        """Close the env of a branch that has ended."""
        del self.unclosed[branch]
        self.ahead.pop(branch, None)
        branch.env.close()
        self.report(1)

    def report(self, count: int) -> None:
        """Count ``count`` ended branches to ``run.on_branches``, never past the planned ones."""
        if self.run.planned is not None:
            count = min(count, self.run.planned - self.reported)
        if count > 0 and self.run.on_branches is not None:
            self.reported += count
            self.run.on_branches(count)

    async def stop_running_ahead(self) -> None:
        """Stop the branches still taking turns ahead (the prompt failed) and close the states they kept."""
        for ahead in self.ahead.values():
            ahead.task.cancel()
        await asyncio.gather(*(ahead.task for ahead in self.ahead.values()), return_exceptions=True)
        for ahead in self.ahead.values():
            ahead.discard()

    def fork(self, tree: int, env: TokenEnv) -> TokenEnv:
        """``env.fork()``, counted and timed on the tree's stats."""
        stats = self.prompt.stats[tree]
        start = time.perf_counter()
        child = env.fork()
        stats.fork_seconds += time.perf_counter() - start
        stats.forks += 1
        return child

    def exhausted(self, name: str) -> None:
        if name not in self.prompt.budget_exhausted:
            self.prompt.budget_exhausted.append(name)

    # -- the end ------------------------------------------------------------------------------

    def drop_dead_ends(self) -> None:
        """Prune turns that lead to no leaf (branches abandoned after an error or a budget)."""
        for tree in self.prompt.trees:
            if any(not node.terminal and not node.children for node in tree.nodes()):
                tree.prune(tree.leaves())

    def release_states(self) -> None:
        """Close the environment states this loop kept, except on kept nodes when asked to keep them."""
        keep = self.run.config.rollout.keep_states
        for node in self.kept:
            if keep and any(_holds(tree, node) for tree in self.prompt.trees):
                continue
            node.env.close()
            node.env = None


class _Ahead:
    """A branch taking its turns back to back, ahead of the steps that record them.

    A turn stays in ``outcomes`` until a step has recorded it, so that a rollout cancelled at any
    moment closes the states of exactly the turns no step took (:meth:`discard`).
    """

    def __init__(self, loop: _PromptLoop, branch: Branch) -> None:
        self.outcomes: collections.deque[tuple[TurnRecord, EpisodeStatus | None, TokenEnv | None] | Exception] = (
            collections.deque()
        )
        self.ready = asyncio.Event()
        self.task = asyncio.create_task(self.run(loop, branch))

    async def run(self, loop: _PromptLoop, branch: Branch) -> None:
        # Its own copy of the context: the steps extend ``branch.ids`` as they record the turns.
        ids, turns = list(branch.ids), branch.turns
        while True:
            try:
                outcome = await loop.turn(branch, ids, turns, None)
            except Exception as error:  # the step that reaches this turn records the error
                self.put(error)
                return
            self.put(outcome)
            turn, status, _ = outcome
            if status is not None:
                return
            ids += turn.action_ids
            ids += turn.obs_ids
            turns += 1

    def put(self, outcome: tuple[TurnRecord, EpisodeStatus | None, TokenEnv | None] | Exception) -> None:
        self.outcomes.append(outcome)
        self.ready.set()

    async def next(self) -> tuple[TurnRecord, EpisodeStatus | None, TokenEnv | None]:
        """The oldest turn no step has recorded (waiting for it); it stays until :meth:`taken`."""
        while not self.outcomes:
            self.ready.clear()
            await self.ready.wait()
        outcome = self.outcomes[0]
        if isinstance(outcome, Exception):
            raise outcome
        return outcome

    def taken(self) -> None:
        """The step has the oldest turn: it is the step's to record (or to close)."""
        self.outcomes.popleft()

    def discard(self) -> None:
        """Close the states kept by turns no step took."""
        for outcome in self.outcomes:
            if not isinstance(outcome, Exception) and outcome[2] is not None:
                outcome[2].close()
        self.outcomes.clear()


def _holds(tree: RolloutTree, node: Node) -> bool:
    try:
        return tree.node(node.id) is node
    except KeyError:
        return False
