"""Each training step's batch: its tasks rolled out, credit assigned, the rollout's metrics (steps 2-3 of :mod:`agents.run.train`).

Two producers give the training loop its batches, one ``batch(step)`` a step (the :class:`StepProducer`
contract):
:class:`SynchronousSteps` rolls each step out after the previous step's update and sync (a run
without rollout workers); :class:`PipelinedSteps` keeps the rollout workers up to η =
``max_staleness`` steps ahead of the trainer and, with ``stream_update``, hands each prompt's
trees to the trainer as they come back. Both draw a step's tasks from the run's
:class:`~agents.run.task_order.TaskOrder` and seed its rollout with :func:`rollout_seed`, so the tasks and
seeds of a step do not depend on which producer runs it.
"""

from __future__ import annotations

import asyncio
import collections
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from agents.progress import note, progress_bar
from agents.rollout.diagnostics import rollout_metrics
from agents.rollout.strategies import PromptTrees
from agents.rollout.tree import TrainingPath
from agents.rollout.tree_loop import planned_branches
from agents.run.task_order import TaskOrder

if TYPE_CHECKING:
    from agents.run.backends import RolloutBackend, TrainerBackend
    from agents.run.cluster.rollout_workers import RolloutPool
    from agents.run.config import RunParts, TrainConfig

__all__ = [
    "PipelinedSteps",
    "Refill",
    "StepProducer",
    "SynchronousSteps",
    "has_signal",
    "rollout_seed",
    "rollout_step",
    "round_seed",
    "sample_with_signal",
    "streamed_update",
]


class StepProducer(Protocol):
    """Where the training loop's batches come from (:meth:`agents.run.backends.RolloutBackend.steps`)."""

    async def batch(self, step: int) -> tuple[list[TrainingPath], dict[str, float], dict[str, int]]:
        """Step ``step``'s paths (empty when they went to the trainer as they came back), its rollout metrics, and
        the task order's position after its tasks (what a checkpoint saves)."""
        ...

    def trained(self, step: int) -> None:
        """The trainer has updated on step ``step`` and synced the engines."""
        ...

    async def close(self) -> None:
        """Stop what is still rolling out."""
        ...


#: A step's rounds of rollouts: ``roll(tasks, round)`` gives the trees of ``tasks`` under round ``round``'s seed.
Roll = Callable[[list[int], int], Awaitable[list[PromptTrees]]]


def rollout_seed(seed: int, step: int) -> int:
    """The rollout seed of ``step`` (1-based) in a run seeded with ``seed``."""
    return int(np.random.SeedSequence(seed, spawn_key=(step,)).generate_state(1)[0])


def round_seed(seed: int, round: int) -> int:
    """The seed of a step's dynamic-sampling round ``round`` (:func:`sample_with_signal`) under the step's
    rollout ``seed``: ``seed`` itself for the first, a fresh one for each later round's new prompts."""
    return seed if round == 0 else int(np.random.SeedSequence(seed, spawn_key=(round,)).generate_state(1)[0])


@dataclass(frozen=True)
class Refill:
    """Dynamic sampling's side of a step (``TrainConfig.dynamic_sampling``): ``take(n)`` gives the next
    ``n`` tasks of the run's order; at most ``most`` prompts are rolled out for the step, at least ``least``
    a round while that many are left."""

    take: Callable[[int], list[int]]
    most: int
    least: int = 1


async def rollout_step(
    rollout: RolloutBackend,
    parts: RunParts,
    tasks: Sequence[int],
    seed: int,
    budget_reward: float | None,
    on_branches: Callable[[int], None],
    refill: Refill | None = None,
) -> tuple[list[TrainingPath], dict[str, float]]:
    """Steps 2-3 of :mod:`agents.run.train`: the trees of ``tasks`` (``on_branches`` counts the ended
    branches, see :func:`~agents.rollout.tree_loop.rollout_trees`), with ``refill`` those without
    signal replaced (:func:`sample_with_signal`), credit, and the rollout's metrics."""

    async def roll(batch: list[int], round: int) -> list[PromptTrees]:
        return await rollout.rollout(batch, round_seed(seed, round), on_branches)

    start = time.perf_counter()
    prompts, sampling = await _sample(roll, list(tasks), refill, budget_reward)
    seconds = time.perf_counter() - start
    paths = _credit(parts, prompts, budget_reward)
    metrics = _rollout_record(rollout, tasks, prompts, seconds, len(paths))
    return paths, {**metrics, **sampling}


async def _sample(
    roll: Roll, tasks: list[int], refill: Refill | None, budget_reward: float | None
) -> tuple[list[PromptTrees], dict[str, float]]:
    """The step's prompts: those of ``tasks``, or with ``refill`` the dynamic sampling's; and ``sampling/*``."""
    if refill is None:
        prompts = await roll(tasks, 0)
        return prompts, {"sampling/prompts": float(len(prompts)), "sampling/tokens": float(_tokens(prompts))}
    return await sample_with_signal(
        roll, tasks, refill.take, most=refill.most, budget_reward=budget_reward, least=refill.least
    )


def _tokens(prompts: list[PromptTrees]) -> int:
    return sum(prompt.tokens for prompt in prompts)


def has_signal(prompt: PromptTrees) -> bool:
    """Whether the rewards of ``prompt``'s leaves differ: a prompt whose leaves all score the same gets
    advantage 0 on every path from every learner's credit (docs/algorithms/steps.md eq. 81)."""
    return len({leaf.reward for leaf in prompt.leaves}) > 1


async def sample_with_signal(
    roll: Roll,
    tasks: list[int],
    take: Callable[[int], list[int]],
    *,
    most: int,
    budget_reward: float | None,
    least: int = 1,
) -> tuple[list[PromptTrees], dict[str, float]]:
    """DAPO's dynamic sampling (Yu et al. 2025, §3.2): the trees of ``tasks``, each prompt without
    signal (:func:`has_signal`) dropped and replaced by further tasks from ``take(n)`` until
    ``len(tasks)`` prompts have signal or ``most`` prompts have been rolled out.

    A round rolls out as many new tasks as the step lacks, scaled by the share of this step's prompts
    that had signal so far (all at once: on one engine a batch of prompts costs little more than one).
    Prompts with signal beyond ``len(tasks)`` are dropped too, so every step trains on the same number
    of prompts. When none has signal after ``most``, the step keeps its first ``len(tasks)`` prompts
    (its loss is 0; the step's log line says so). The metrics count what it cost, in ``sampling/*``.

    A round rolls out at least ``least`` prompts while ``most`` allows (round 0: the step's tasks, then the
    order's next): a round's rollout runs until its longest tree ends, so on an engine whose batches a round
    leaves a few rows short, prompts rolled out together cost little more time than the first of them, and
    the next round's wait is saved when they bring the signal (eq. 83).
    """
    want = len(tasks)
    first = list(tasks) + take(min(most, max(least, want)) - want)  # eq. 83
    sampled = _score_budget_cut(await roll(first, 0), budget_reward)
    rounds = 1
    while (with_signal := sum(map(has_signal, sampled))) < want and len(sampled) < most:
        more = math.ceil((want - with_signal) * len(sampled) / max(with_signal, 1))  # eq. 82
        more = min(most - len(sampled), max(least, more))  # eq. 83
        sampled += _score_budget_cut(await roll(take(more), rounds), budget_reward)
        rounds += 1
    kept = [prompt for prompt in sampled if has_signal(prompt)][:want] or sampled[:want]
    kept_ids = {id(prompt) for prompt in kept}
    dropped = [prompt for prompt in sampled if id(prompt) not in kept_ids]
    return kept, {
        "sampling/rounds": float(rounds),
        "sampling/prompts": float(len(sampled)),
        "sampling/prompts_kept": float(len(kept)),
        "sampling/prompts_dropped": float(len(dropped)),
        "sampling/signal_frac": with_signal / len(sampled),
        "sampling/tokens": float(_tokens(sampled)),
        "sampling/tokens_dropped": float(_tokens(dropped)),
    }


def _score_budget_cut(prompts: list[PromptTrees], budget_reward: float | None) -> list[PromptTrees]:
    """``prompts`` with the reward of each leaf that the token budget cut set to ``budget_reward`` (if not None)."""
    if budget_reward is not None:
        for leaf in _budget_cut(prompts):  # no answer: what the environment's reward gives an unanswered episode
            leaf.reward = float(budget_reward)
    return prompts


def _credit(parts: RunParts, prompts: list[PromptTrees], budget_reward: float | None) -> list[TrainingPath]:
    """Step 3: the training paths of the finished trees of ``prompts``, each prompt's credit on its own trees.

    Budget-cut leaves are scored here too (again, idempotently, after dynamic sampling): a streamed
    prompt (``PipelinedSteps`` with ``accumulate``) reaches the trainer before its step's rollout returns."""
    _score_budget_cut(prompts, budget_reward)
    paths: list[TrainingPath] = []
    for prompt in prompts:
        if prompt.leaves:
            paths += parts.learner.assign_credit(prompt.trees)
    return paths


def _budget_cut(prompts: list[PromptTrees]) -> list[Any]:
    """The leaves that the token budget ended before the environment did."""
    return [leaf for prompt in prompts for leaf in prompt.leaves if leaf.info.get("status") == "budget"]


def _rollout_record(
    rollout: RolloutBackend, tasks: Sequence[int], prompts: list[PromptTrees], seconds: float, paths: int
) -> dict[str, float]:
    """The rollout's metrics of ``prompts`` (rolled out in ``seconds``, giving ``paths`` training paths)."""
    errors = [error for prompt in prompts for error in _errors(prompt)]
    if not paths:
        raise RuntimeError(
            f"no prompt of the batch produced a finished episode (tasks {tasks}); "
            f"first error: {errors[0] if errors else 'none recorded'}"
        )
    if errors:  # said, never only counted: each abandoned branch or prompt and why
        counted = collections.Counter(errors).most_common()
        note(
            f"rollout: {len(errors)} turn(s) or prompt(s) failed and were abandoned (tree/errors, "
            "tree/prompt_errors): " + "; ".join(error if n == 1 else f"{error} (x{n})" for error, n in counted)
        )
    metrics = rollout_metrics(prompts, seconds)
    metrics["rollout/prompts_without_leaves"] = float(sum(not prompt.leaves for prompt in prompts))
    metrics["rollout/budget_cut_frac"] = len(_budget_cut(prompts)) / max(
        1, sum(len(prompt.leaves) for prompt in prompts)
    )
    leaves = [leaf for prompt in prompts for leaf in prompt.leaves]
    if any("grade" in leaf.info for leaf in leaves):  # the env grades answers; a leaf without one gave none
        grades = [leaf.info.get("grade", {}) for leaf in leaves]
        metrics["reward/em"] = statistics.fmean(float(grade.get("em", 0.0)) for grade in grades)
        metrics["reward/format_ok"] = statistics.fmean(float(grade.get("format_ok", False)) for grade in grades)
    metrics.update(rollout.metrics())
    return metrics


class SynchronousSteps(StepProducer):
    """The batches of a run without rollout workers: each step's rollout after the previous step's update and sync."""

    def __init__(
        self, config: TrainConfig, parts: RunParts, rollout: RolloutBackend, order: TaskOrder, progress: bool | None
    ) -> None:
        self.config, self.parts, self.rollout, self.order, self.progress = config, parts, rollout, order, progress
        self.planned = planned_branches(parts.learner.strategy, parts.tree)

    async def batch(self, step: int) -> tuple[list[TrainingPath], dict[str, float], dict[str, int]]:
        """Step ``step``'s paths and rollout metrics, and the task order's position after its tasks."""
        config = self.config
        tasks = self.order.take(config.prompts_per_step)
        total = None if self.planned is None else self.planned * len(tasks)
        with progress_bar(f"rollout step {step}", total, unit="leaves", leave=False, show=self.progress) as bar:

            def take(count: int) -> list[int]:  # dynamic sampling's further prompts: their leaves join the total
                more = self.order.take(count)
                if bar.total is not None and self.planned is not None:
                    bar.total += self.planned * len(more)
                return more

            refill = Refill(take, config.sampled_prompts, config.min_round_prompts) if config.dynamic_sampling else None
            paths, metrics = await rollout_step(
                self.rollout,
                self.parts,
                tasks,
                rollout_seed(config.seed, step),
                config.budget_reward,
                bar.update,
                refill,
            )
        return paths, metrics, self.order.position()

    def trained(self, step: int) -> None:
        """The trainer has updated on step ``step`` and synced the engines."""

    async def close(self) -> None:
        pass


class PipelinedSteps(StepProducer):
    """The batches of a run on rollout workers: rollouts up to ``ahead`` = η steps ahead of the trainer.

    Step ``s``'s prompts go to the pool once the trainer has updated on step ``s − η − 1`` (so every
    token of them is sampled by weights at most η syncs older than those that train on them), and
    the trainer takes step ``s``'s trees when all of them are back. The tasks and seeds of a step
    are the synchronous run's (:class:`~agents.run.task_order.TaskOrder`, :func:`rollout_seed`); which weights sample a
    token depends on when the syncs land, so a run is not reproduced exactly. A prompt's trees
    whose oldest token is more than η versions behind the trainer's are dropped (counted in
    ``async/trees_dropped``); the rule above admits none, so this guards the bound.

    With ``accumulate`` (the trainer's :meth:`~agents.training.trainer.Trainer.accumulate`;
    ``stream_update`` at η ≥ 1) each prompt's trees go to the trainer's forward and backward
    passes as soon as they are back and the trainer is free, while the rest of the step rolls
    out; :meth:`batch` then returns no paths, and the trainer's step takes the optimiser step.

    With ``ahead = 0`` the steps are the synchronous ones, in the same order on the same weights
    (tested against :class:`SynchronousSteps`).
    """

    def __init__(
        self,
        config: TrainConfig,
        parts: RunParts,
        rollout: RolloutPool,
        order: TaskOrder,
        progress: bool | None,
        ahead: int,
        accumulate: Callable[[list[TrainingPath]], Awaitable[None]] | None = None,
    ) -> None:
        self.config, self.parts, self.pool, self.order, self.ahead = config, parts, rollout, order, ahead
        self.progress, self.planned = progress, planned_branches(parts.learner.strategy, parts.tree)
        self.accumulate = accumulate
        self.running: dict[int, asyncio.Future[_Rolled]] = {}
        self.arrivals: dict[int, asyncio.Queue[PromptTrees]] = {}  # each running step's trees back so far
        self.leaves: dict[int, int] = {}  # each running step's leaves back so far
        self.prompts: dict[int, int] = {}  # each running step's prompts sent so far (dynamic sampling adds some)
        self.bars: dict[int, Any] = {}  # the progress bar of the step the trainer waits for
        self.positions: dict[int, dict[str, int]] = {}
        self.next_step: int | None = None  # the next step to send to the pool
        self.cycle_start = time.perf_counter()
        self.idle_mark = rollout.idle_seconds()
        self.engine_idle_mark = 0.0  # read when the first step is sent
        self.failures_mark, self.reruns_mark = rollout.failures, rollout.reruns

    def _send(self, last: int) -> None:
        """Send steps up to ``last`` (and at most the run's last) to the pool, in order."""
        assert self.next_step is not None
        while self.next_step <= min(last, self.config.steps):
            step = self.next_step
            tasks = self.order.take(self.config.prompts_per_step)
            self.positions[step] = self.order.position()
            self.leaves[step], self.prompts[step] = 0, len(tasks)
            self.arrivals[step] = asyncio.Queue()
            self.running[step] = asyncio.ensure_future(self._roll(step, tasks))
            self.next_step += 1

    async def _roll(self, step: int, tasks: list[int]) -> _Rolled:
        def back(leaves: int) -> None:
            self.leaves[step] += leaves
            if step in self.bars:
                self.bars[step].update(leaves)

        def arrived(_: int, prompt: PromptTrees) -> None:
            self.arrivals[step].put_nowait(prompt)

        on_prompt = arrived if self.accumulate is not None else None
        seed = rollout_seed(self.config.seed, step)

        async def roll(batch: list[int], round: int) -> list[PromptTrees]:
            return await self.pool.rollout(batch, round_seed(seed, round), back, priority=step, on_prompt=on_prompt)

        start = time.perf_counter()

        # At η = 0 (dynamic sampling needs it) no later step has taken tasks yet, so the replacements are
        # the order's next tasks, as in a synchronous run.
        def take(count: int) -> list[int]:  # dynamic sampling's further prompts: their leaves join the bar's total
            more = self.order.take(count)
            self.prompts[step] += len(more)
            if step in self.bars and self.planned is not None:
                self.bars[step].total = self.planned * self.prompts[step]
            return more

        refill = (
            Refill(take, self.config.sampled_prompts, self.config.min_round_prompts)
            if self.config.dynamic_sampling
            else None
        )
        prompts, sampling = await _sample(roll, tasks, refill, self.config.budget_reward)
        if refill is not None:
            self.positions[step] = self.order.position()
        return _Rolled(tasks, prompts, time.perf_counter() - start, sampling)

    async def batch(self, step: int) -> tuple[list[TrainingPath], dict[str, float], dict[str, int]]:
        """Step ``step``'s paths and metrics (the trainer holds step ``step − 1``'s weights, synced).

        With ``accumulate`` the paths went to the trainer as they came back and none are returned.
        """
        if self.next_step is None:
            self.next_step = step
            self.engine_idle_mark = await self.pool.engine_idle_seconds()
        self._send(step + self.ahead)
        version = self.pool.version  # the trainer's weights: the pool's latest sync
        taken = _Taken()
        wait_start = time.perf_counter()
        total = None if self.planned is None else self.planned * self.prompts[step]
        with progress_bar(
            f"rollout step {step}", total, unit="leaves", initial=self.leaves[step], leave=False, show=self.progress
        ) as self.bars[step]:
            busy = await self._stream(step, version, taken) if self.accumulate is not None else 0.0
            rolled = await self.running.pop(step)
        tasks, prompts, seconds = rolled.tasks, rolled.prompts, rolled.seconds
        del self.bars[step], self.leaves[step], self.prompts[step]
        arrivals = self.arrivals.pop(step)
        ready = time.perf_counter()
        if self.accumulate is None:
            self._take(prompts, version, taken)
        else:  # the trees that came back while the trainer ran the last passes
            await self._pass_on(_drained(arrivals), version, taken)
            busy += time.perf_counter() - ready
            ready = time.perf_counter()
        if not taken.kept:
            raise RuntimeError(
                f"every prompt of step {step} was sampled more than max_staleness={self.ahead} weight versions "
                f"before the trainer's ({version}); no tree is left to train on"
            )
        metrics = _rollout_record(self.pool, tasks, taken.kept, seconds, taken.count)
        metrics.update(_staleness_metrics(taken.kept, taken.staleness, version, self.ahead))
        metrics.update(rolled.sampling)
        metrics["async/trees_dropped"] = float(len(prompts) - len(taken.kept))
        if self.accumulate is not None:
            metrics["async/paths_streamed_frac"] = taken.streamed / max(taken.count, 1)
        idle, engine_idle = self.pool.idle_seconds(), await self.pool.engine_idle_seconds()
        metrics["time/worker_idle_s"] = idle - self.idle_mark
        metrics["time/engine_idle_s"] = engine_idle - self.engine_idle_mark
        metrics["time/trainer_idle_s"] = ready - wait_start - busy
        metrics["time/cycle_s"] = ready - self.cycle_start
        metrics["cluster/worker_failures"] = float(self.pool.failures - self.failures_mark)
        metrics["cluster/prompts_rerun"] = float(self.pool.reruns - self.reruns_mark)
        self.cycle_start, self.idle_mark, self.engine_idle_mark = ready, idle, engine_idle
        self.failures_mark, self.reruns_mark = self.pool.failures, self.pool.reruns
        return taken.paths, metrics, self.positions.pop(step)

    async def _stream(self, step: int, version: int, taken: _Taken) -> float:
        """Pass step ``step``'s trees to the trainer as they come back, until the last is; the seconds it was busy."""
        arrivals, rollout, busy = self.arrivals[step], self.running[step], 0.0
        while not rollout.done():
            next_one: asyncio.Future[Any] = asyncio.ensure_future(arrivals.get())
            await asyncio.wait([next_one, rollout], return_when=asyncio.FIRST_COMPLETED)
            if not next_one.done():  # the last trees came back with no one waiting: batch() takes them
                next_one.cancel()
                break
            early = not rollout.done()  # these passes start before the step's last trees are back
            start = time.perf_counter()
            prompts = [next_one.result(), *_drained(arrivals)]
            await self._pass_on(prompts, version, taken)
            busy += time.perf_counter() - start
            if early:
                taken.streamed = taken.count
        return busy

    async def _pass_on(self, prompts: list[PromptTrees], version: int, taken: _Taken) -> None:
        """The trainer's passes on the kept trees of ``prompts``."""
        assert self.accumulate is not None
        paths = self._take(prompts, version, taken)
        if paths:
            await self.accumulate(paths)

    def _take(self, prompts: list[PromptTrees], version: int, taken: _Taken) -> list[TrainingPath]:
        """The paths of ``prompts`` whose trees are fresh enough (added to ``taken``); the others dropped."""
        fresh: list[PromptTrees] = []
        for prompt in prompts:
            # the staleness bound, docs/algorithms/steps.md eq. 78: a prompt's trees are kept or dropped whole
            stale = version - _oldest_version(prompt, version)
            if stale <= self.ahead:
                fresh.append(prompt)
                taken.staleness.append(stale)
        paths = _credit(self.parts, fresh, self.config.budget_reward)
        taken.kept += fresh
        taken.count += len(paths)
        if self.accumulate is None:
            taken.paths += paths
        return paths

    def trained(self, step: int) -> None:
        """The trainer has updated on step ``step`` and synced the engines: the steps up to ``step + 1 + η`` may go."""
        if self.ahead:
            self._send(step + 1 + self.ahead)

    async def close(self) -> None:
        """Stop the rollouts of steps that will not be trained (the run ended or failed)."""
        for future in self.running.values():
            future.cancel()
        await asyncio.gather(*self.running.values(), return_exceptions=True)
        self.running.clear()


@dataclass(frozen=True)
class _Rolled:
    """A step's rollout on the pool: its first tasks, the prompts to train on, the seconds it took, ``sampling/*``."""

    tasks: list[int]
    prompts: list[PromptTrees]
    seconds: float
    sampling: dict[str, float]


@dataclass
class _Taken:
    """What :class:`PipelinedSteps` has taken of a step so far: the kept prompts, their staleness,
    their paths (or, when streamed, how many went to the trainer before the step's last trees were back)."""

    kept: list[PromptTrees] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    paths: list[TrainingPath] = field(default_factory=list)
    count: int = 0
    streamed: int = 0


def _drained(queue: asyncio.Queue[PromptTrees]) -> list[PromptTrees]:
    """Everything in ``queue`` now, without waiting."""
    return [queue.get_nowait() for _ in range(queue.qsize())]


def streamed_update(
    config: TrainConfig, trainer: TrainerBackend
) -> Callable[[list[TrainingPath]], Awaitable[None]] | None:
    """The trainer's ``accumulate`` when the run streams each prompt's trees to it (``stream_update``)."""
    one_update = trainer.config.mini_batches == trainer.config.epochs == 1
    return trainer.accumulate if config.max_staleness and config.stream_update and one_update else None


def _oldest_version(prompt: PromptTrees, default: int) -> int:
    """The version of the weights that sampled the prompt's oldest token (``default`` when no turn says)."""
    versions = [node.version for tree in prompt.trees for node in tree.nodes() if node.version is not None]
    return min(versions, default=default)


def _staleness_metrics(prompts: list[PromptTrees], staleness: list[int], version: int, eta: int) -> dict[str, float]:
    """``async/*`` of the trained prompts: how many versions behind ``version`` their trees and tokens were sampled.

    ``staleness[i]`` is how many versions behind prompt ``i``'s oldest token is. ``async/staleness_k``
    counts the prompts (a prompt's trees are one unit) ``k`` versions behind, ``async/tokens_stale_k``
    the action tokens sampled ``k`` versions behind (k = 0 … η); ``async/staleness_mean`` and
    ``_max`` are over the prompts.
    """
    tokens = [0] * (eta + 1)
    for prompt in prompts:
        for tree in prompt.trees:
            for node in tree.nodes():
                sampled = node.version if node.version is not None else version
                counts = collections.Counter(node.token_versions or {sampled: len(node.action_ids)})
                for token_version, count in counts.items():
                    tokens[min(max(version - token_version, 0), eta)] += count
    metrics = {
        "async/version": float(version),
        "async/staleness_mean": statistics.fmean(staleness),
        "async/staleness_max": float(max(staleness)),
    }
    for k in range(eta + 1):
        metrics[f"async/staleness_{k}"] = float(sum(value == k for value in staleness))
        metrics[f"async/tokens_stale_{k}"] = float(tokens[k])
    return metrics


def _errors(prompt: PromptTrees) -> list[str]:
    return ([prompt.error] if prompt.error else []) + [error for stats in prompt.stats for error in stats.errors]
