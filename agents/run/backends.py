"""The two contracts of a run's parts: where its rollouts run (:class:`RolloutBackend`) and where it trains (:class:`TrainerBackend`).

:class:`LocalRollout` runs the rollouts and held-out evaluations in this process, on one engine
(``cluster.rollout_workers = 0``); :class:`agents.run.cluster.rollout_workers.RolloutPool` on Ray
actors that each own an engine. :class:`agents.training.trainer.Trainer` trains in this process;
:class:`agents.run.cluster.trainer_ranks.TrainerGroup` on Ray ranks that shard it. The training loop
(:mod:`agents.run.train`) and its step producers (:mod:`agents.run.steps`) use nothing else of
either. :func:`run_engine` builds a run's engine, here or on a worker.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from agents.engines.base import BatchStats, Engine, WeightReceiver
from agents.engines.factory import ColocatedTrainer, make_engine
from agents.eval.heldout import HeldOut, evaluate_heldout
from agents.rollout.episodes import task_episode
from agents.rollout.strategies import PromptTrees
from agents.rollout.tree_loop import rollout_trees
from agents.run.steps import StepProducer, SynchronousSteps

if TYPE_CHECKING:
    from pathlib import Path

    from agentenv.wrappers import TokenEnv
    from agents.rollout.episodes import RolloutConfig
    from agents.rollout.tree import TrainingPath
    from agents.run.config import RunParts, TrainConfig
    from agents.run.task_order import TaskOrder
    from agents.training.trainer import Trainer
    from agents.training.trainer_config import TrainerConfig

__all__ = ["LocalRollout", "RolloutBackend", "TrainerBackend", "run_engine"]


class TrainerBackend(Protocol):
    """What the training loop asks of the place it trains (steps 3-5 of :mod:`agents.run.train`)."""

    config: TrainerConfig
    #: Steps trained so far (the weights after step ``s`` are version ``s``).
    step_count: int
    tokenizer: Any
    #: Receives the weights after every step (:meth:`step`, :meth:`sync_weights`); None: nothing does.
    engine: WeightReceiver | None

    @property
    def local(self) -> Trainer | None:
        """The trainer object when it runs in this process (an engine here may share its model, and it logs
        to W&B from here), else None."""
        ...

    @property
    def placement(self) -> list[dict[str, Any]]:
        """Where each rank runs, ``{"rank", "node", "ip", "pid"}``; empty for a trainer in this process."""
        ...

    @property
    def rendezvous(self) -> tuple[str, int] | None:
        """Where the ranks met (address, port); None for a trainer in this process."""
        ...

    async def step(
        self, paths: Sequence[TrainingPath], rollout_metrics: Mapping[str, float] | None = None
    ) -> dict[str, float]:
        """Train on one rollout batch (after :meth:`accumulate`, its remaining paths), sync :attr:`engine`, and
        return the step's record (:meth:`agents.training.trainer.Trainer.step`)."""
        ...

    async def accumulate(self, paths: Sequence[TrainingPath]) -> None:
        """Run the next step's passes on part of its batch now (asynchronous training's streamed update)."""
        ...

    async def sync_weights(self) -> None:
        """Hand the current weights to :attr:`engine`."""
        ...

    def save_checkpoint(self, *, data_position: dict[str, Any] | None = None, plot_title: str | None = None) -> Path:
        """Write a checkpoint of the step trained last; its folder."""
        ...

    def resume(self, path: str | Path) -> dict[str, Any]:
        """Load a checkpoint (weights, optimiser, RNG, step count); its ``data_position``."""
        ...

    def open_steps_bar(self) -> None:
        """Show the run's ``train`` progress bar now."""
        ...

    def close(self) -> None:
        """Release what the trainer holds (its ranks, its reporters)."""
        ...


class RolloutBackend(Protocol):
    """What the training loop asks of the place its rollouts run (steps 2 and 5 of :mod:`agents.run.train`)."""

    @property
    def engine(self) -> WeightReceiver:
        """What receives the trainer's weights after every step (the trainer's ``engine``)."""
        ...

    @property
    def supports_sleep(self) -> bool:
        """Whether the engines share the trainer's GPUs and sleep through each update (so nothing can roll
        out during one)."""
        ...

    @property
    def placement(self) -> list[dict[str, Any]]:
        """Where each rollout worker runs, ``{"rank", "node", "ip", "pid"}``; empty when they run in this process."""
        ...

    async def rollout(
        self, tasks: Sequence[int], seed: int, on_branches: Callable[[int], None] | None = None
    ) -> list[PromptTrees]:
        """The trees of every task (``agents.rollout.episodes.task_episode``), in order, prompt ``i`` of the batch
        with index ``i``, under the rollout ``seed``; ``on_branches(n)`` counts the branches that end (as
        :func:`~agents.rollout.tree_loop.rollout_trees` counts them)."""
        ...

    async def evaluate(self, kwargs: Mapping[str, Any]) -> HeldOut:
        """:func:`agents.eval.heldout.evaluate_heldout` with ``kwargs`` on the engine (or one of them)."""
        ...

    def steps(
        self, config: TrainConfig, parts: RunParts, order: TaskOrder, progress: bool | None, trainer: TrainerBackend
    ) -> StepProducer:
        """Where each step's batch comes from on this backend (:mod:`agents.run.steps`)."""
        ...

    def metrics(self) -> dict[str, float]:
        """Numbers of the last rollout to add to the step's metrics (``{}`` when there are none)."""
        ...

    def set_version(self, version: int) -> None:
        """The engines hold the weights of ``version`` now: a resumed run's versions go on from its step
        (the weights after step ``s`` are version ``s``). A backend whose trees carry no versions ignores it."""
        ...

    async def close(self) -> None:
        """Release the engines (and the processes that hold them)."""
        ...


class LocalRollout(RolloutBackend):
    """Rollouts and evaluations in this process, on one engine (``cluster.rollout_workers = 0``).

    Its trees carry no weights versions: every step's rollout runs after the previous step's sync.
    """

    def __init__(self, env: TokenEnv, engine: Engine, tokenizer: Any, parts: RunParts) -> None:
        self.env, self._engine, self.tokenizer, self.parts = env, engine, tokenizer, parts
        # The engine's counts and the wall time of the rollouts since metrics() was last read (an engine with stats).
        self._usage: tuple[BatchStats, float] | None = None

    @property
    def engine(self) -> Engine:
        return self._engine

    @property
    def supports_sleep(self) -> bool:
        return self._engine.supports_sleep

    @property
    def placement(self) -> list[dict[str, Any]]:
        return []

    def steps(
        self, config: TrainConfig, parts: RunParts, order: TaskOrder, progress: bool | None, trainer: TrainerBackend
    ) -> SynchronousSteps:
        """One rollout after another in this process, each after the previous step's update and sync."""
        return SynchronousSteps(config, parts, self, order, progress)

    async def rollout(
        self, tasks: Sequence[int], seed: int, on_branches: Callable[[int], None] | None = None
    ) -> list[PromptTrees]:
        episodes = [task_episode(self.env, task) for task in tasks]
        stats: BatchStats | None = getattr(self._engine, "stats", None)
        before, start = copy.copy(stats), time.perf_counter()
        try:
            tree = dataclasses.replace(self.parts.tree, seed=seed)
            return await rollout_trees(
                self._engine, episodes, self.parts.learner.strategy, tree, on_branches=on_branches
            )
        finally:
            for episode in episodes:
                episode.env.close()
            if isinstance(stats, BatchStats) and before is not None:  # only these rollouts, not evaluations between
                counts, seconds = stats.since(before), time.perf_counter() - start
                if self._usage is not None:  # an earlier rollout of the same step (dynamic sampling's rounds)
                    counts, seconds = counts.plus(self._usage[0]), self._usage[1] + seconds
                self._usage = counts, seconds

    async def evaluate(self, kwargs: Mapping[str, Any]) -> HeldOut:
        return await evaluate_heldout(self._engine, self.tokenizer, **kwargs)

    def metrics(self) -> dict[str, float]:
        """``engine/*`` of the rollouts since the last call (:meth:`~agents.engines.base.BatchStats.usage`), for an
        engine that keeps :class:`~agents.engines.base.BatchStats` (HFEngine); else none."""
        usage, self._usage = self._usage, None
        return {} if usage is None else usage[0].usage(usage[1])

    def set_version(self, version: int) -> None:
        pass  # no versions here: see the class docstring

    async def close(self) -> None:
        await self._engine.close()


def run_engine(
    config: TrainConfig, rollout: RolloutConfig, trainer: Trainer | None = None, log: Callable[[str], None] = print
) -> Engine:
    """The engine of a run (``config.engine``): an HFEngine on the trainer's own model object, or vLLM synced after
    every step.

    Without ``trainer`` (a rollout worker, or a driver whose trainer runs on other ranks) the engine loads its
    own copy of ``config.model`` and receives the weights by sync. ``config.engine_kwargs`` reach the engine
    (:func:`~agents.engines.factory.make_engine`); ``rollout`` (the run's :class:`~agents.rollout.RolloutConfig`)
    sizes its batch and its longest sequence. vLLM beside a trainer on a GPU leaves it its optimiser state.
    """
    colocated = None
    if trainer is not None and trainer.device.type == "cuda":
        colocated = ColocatedTrainer(trainer.device, sum(p.numel() for p in trainer.trainable_parameters))
    model: Any = config.model
    tokenizer: Any = None
    if trainer is not None and config.engine == "hf":  # the engine shares the trainer's model object
        model, tokenizer = trainer.model, trainer.tokenizer
    return make_engine(
        config.engine,
        model,
        tokenizer=tokenizer,
        concurrency=rollout.concurrency,
        seed=config.seed,
        max_model_len=rollout.max_prompt_tokens + rollout.max_response_tokens,
        engine_kwargs=config.engine_kwargs,
        colocated=colocated,
        log=log,
    )
