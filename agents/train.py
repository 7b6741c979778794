"""The training loop: rollout trees on the engine, credit, a trainer step, weight sync, checkpoints.

One step (read :func:`train` top to bottom):

1. the next ``prompts_per_step`` tasks of the environment in the run's task order
   (:class:`TaskOrder`: a seeded permutation of the tasks after the held-out ones, renewed
   every epoch);
2. their rollout trees under the learner's strategy, all prompts concurrently on the engine
   (:func:`agents.rollout.strategies.rollout_trees`), seeded from the run's seed and the step;
3. credit assignment per prompt (the learner's ``credit``) into training paths;
4. :meth:`agents.training.trainer.Trainer.step`: old log-probs, the loss's mini-batch updates, weight
   sync to the engine, metrics (with the rollout's numbers) to ``metrics.jsonl`` and the reporters of
   ``trainer.report_to`` (TensorBoard, W&B);
5. every ``checkpoint_every`` steps and after the last, a checkpoint holding the task order's
   position, and the checkpoints older than the newest ``keep_checkpoints`` intact ones removed
   (:func:`~agents.training.checkpoint.prune_checkpoints`); every ``eval_every`` steps, before
   the first (``eval_before``) and after the last, the held-out evaluation (:mod:`agents.heldout`).

``resume=True`` continues a run folder from its latest checkpoint: weights, optimiser, schedule,
random generators, step and task position. A checkpoint with a damaged file is skipped for the
newest intact one before it (a logged line names it and the file), the temporary folders of
interrupted saves are removed, and the algorithm must be the run's. Every step's rollout seed
derives from the run's seed and the step number, so the continued run draws the same tasks and
the same seeds as an uninterrupted one. (An engine that batches concurrent requests, as ``HFEngine`` does, may round
a logit differently when batches form differently; samples are unaffected unless a draw falls
within that rounding, and the trainer's own computation is deterministic.)

The run folder holds ``config.json`` (the effective configuration: every hyper-parameter, a
valid ``--config`` file, and the run configuration W&B gets), ``metrics.jsonl``, ``tensorboard/``
and ``wandb/`` (as ``trainer.report_to`` says), ``curves.png``, ``heldout/metrics.jsonl``,
``heldout.png`` and ``checkpoints/step_NNNNNN/`` (``model/`` is a
transformers checkpoint that ``agents eval --model`` loads). The environment is made before the
folder is touched, so that a bad id or option leaves nothing behind; a folder that holds neither a
checkpoint nor a trained step (a run that stopped before its first) is no run to protect, and a
new run starts in it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import inspect
import json
import os
import shutil
import statistics
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

import agentenv
from agentenv.wrappers import TokenEnv
from agents.cluster.config import ClusterConfig
from agents.config import RESUMABLE, RunParts, TrainConfig, build, effective_config
from agents.engines.base import Engine
from agents.heldout import HeldOut, HeldOutEvaluation, HeldOutLog, evaluate_heldout
from agents.learners import Learner
from agents.progress import note, progress_bar
from agents.rollout import task_episode
from agents.rollout.diagnostics import rollout_metrics
from agents.rollout.strategies import PromptTrees
from agents.rollout.tree import TrainingPath
from agents.rollout.tree_loop import planned_branches, rollout_trees
from agents.training.checkpoint import (
    CorruptCheckpointError,
    latest_checkpoint,
    latest_valid_checkpoint,
    prune_checkpoints,
    remove_stale_temporaries,
)
from agents.training.metrics import read_jsonl
from agents.training.reporting import import_wandb
from agents.training.trainer import Trainer

if TYPE_CHECKING:
    from agents.cluster.trainer_ranks import TrainerGroup

__all__ = ["CONFIG_FILE", "TaskOrder", "TrainResult", "plot_title", "rollout_seed", "saved_config", "train"]

#: The effective configuration in the run folder.
CONFIG_FILE = "config.json"


@dataclass
class TaskOrder:
    """The order in which a run trains on its environment's tasks, and its position in it.

    An environment with a task list of ``tasks`` entries trains on tasks ``holdout … tasks−1``
    (the first ``holdout`` are held out for evaluation), each epoch in a fresh permutation drawn
    from ``(seed, epoch)``. One without a task list (``tasks=None``) is reset with seeds
    ``holdout, holdout+1, …`` (evaluation uses seeds below ``holdout``).

    Attributes:
        tasks: Size of the task list, or ``None`` for seeded resets.
        holdout: Tasks (or seeds) reserved for evaluation.
        seed: Seeds the permutations.
        epoch: Passes over the tasks completed.
        offset: Position within the current epoch's permutation (or seeds drawn so far).
    """

    tasks: int | None
    holdout: int
    seed: int
    epoch: int = 0
    offset: int = 0

    def __post_init__(self) -> None:
        if self.tasks is not None and self.tasks <= self.holdout:
            raise ValueError(
                f"the environment has {self.tasks} tasks and holdout={self.holdout} keeps them all for "
                "evaluation; lower holdout"
            )

    def take(self, count: int) -> list[int]:
        """The next ``count`` task indices (or reset seeds), crossing into the next epoch when needed."""
        if self.tasks is None:
            start = self.holdout + self.offset
            self.offset += count
            return list(range(start, start + count))
        taken: list[int] = []
        while len(taken) < count:
            order = self._permutation(self.epoch)
            chunk = order[self.offset : self.offset + count - len(taken)]
            taken += chunk
            self.offset += len(chunk)
            if self.offset == len(order):
                self.epoch, self.offset = self.epoch + 1, 0
        return taken

    def position(self) -> dict[str, int]:
        """Where the order stands (stored in checkpoints; ``TaskOrder(..., **position)`` restores it)."""
        return {"epoch": self.epoch, "offset": self.offset}

    def _permutation(self, epoch: int) -> list[int]:
        assert self.tasks is not None  # take() permutes task lists only; seeded resets need no order
        rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(epoch,)))
        return [self.holdout + int(i) for i in rng.permutation(self.tasks - self.holdout)]


def rollout_seed(seed: int, step: int) -> int:
    """The rollout seed of ``step`` (1-based) in a run seeded with ``seed``."""
    return int(np.random.SeedSequence(seed, spawn_key=(step,)).generate_state(1)[0])


@dataclass
class TrainResult:
    """What a finished :func:`train` call leaves behind.

    Attributes:
        out_dir: The run folder.
        config: The effective configuration (``config.json``).
        steps: Steps trained in total (with those before a resume).
        checkpoint: The last checkpoint written.
        history: The trainer's metric records, one per step.
        heldout: The held-out evaluations, in order (step 0 is before training).
    """

    out_dir: Path
    config: TrainConfig
    steps: int
    checkpoint: Path | None
    history: list[dict[str, float]] = field(default_factory=list)
    heldout: list[HeldOut] = field(default_factory=list)


async def train(
    config: TrainConfig,
    out_dir: str | Path,
    *,
    learner: Learner | None = None,
    resume: bool = False,
    progress: bool | None = None,
    log: Callable[[str], None] = note,
) -> TrainResult:
    """Train ``config``'s learner (or ``learner``) and write the run to ``out_dir``.

    Args:
        config: The run (see :class:`~agents.config.TrainConfig`).
        out_dir: The run folder; must not hold another run unless ``resume`` (one that stopped
            before its first trained step is replaced).
        learner: Your own learner instead of ``config.algo``'s; the config's ``credit`` and
            ``loss`` sections still apply to it, and its ``strategy`` section when the config is
            made for it (``agents.config.resolve(..., learner=learner)``; see
            :func:`agents.config.build`).
        resume: Continue the run in ``out_dir`` from its newest intact checkpoint. Only
            :data:`~agents.config.RESUMABLE` values (``steps``, evaluation and checkpoint
            cadence, ``keep_checkpoints``, the reporters) may differ from the saved configuration; another
            ``algo`` is refused first.
        progress: Progress of model loading, every step (``train``), its rollout, its update
            and the held-out evaluations: ``False`` none; ``True`` or ``None`` tqdm bars on a
            terminal, and plain lines every 30 s when stderr is a file or a pipe (:mod:`agents.progress`).
        log: Where one-line notes go (checkpoints, evaluations; default stdout, flushed).
    """
    out = Path(out_dir)
    if resume:
        _require_the_runs_algorithm(out, learner.name if learner is not None else config.algo)
    parts = build(config, learner)
    if "wandb" in parts.trainer.report_to:
        import_wandb()  # a missing client fails before the run folder is touched
    effective = effective_config(config, parts)
    cleanup = contextlib.AsyncExitStack()  # closes what was made, in reverse, however the run ends
    try:
        # Made first, so that a bad environment id or option fails before the run folder or the model is touched.
        task_env = agentenv.make(config.env, **config.env_kwargs)
        cleanup.callback(task_env.close)
        checkpoint = _prepare_run_folder(out, effective, resume, log)
        (out / CONFIG_FILE).write_text(json.dumps(effective.to_dict(), indent=2) + "\n", encoding="utf-8")
        _warn_if_it_cannot_fit(config, parts, log)

        cluster = parts.cluster
        if cluster.uses_ray:
            from agents.cluster.runtime import ensure_ray

            ensure_ray(cluster.address, processes=_processes(cluster))
        trainer = _make_trainer(config, parts, out, progress)
        cleanup.callback(trainer.close)
        env = TokenEnv(task_env, trainer.tokenizer)
        rollout = _make_rollout(config, parts, env, trainer, log)
        cleanup.push_async_callback(rollout.close)
        if config.max_staleness and getattr(rollout, "supports_sleep", False) and parts.trainer.sleep_engine:
            raise ValueError(
                f"max_staleness={config.max_staleness} rolls out during the update, but the engines share the "
                "trainer's GPUs and sleep through it: cluster.placement=split (or max_staleness=0)"
            )
        trainer.engine = rollout.engine  # each step ends with the weights synced to it
        position: dict[str, Any] = {}
        if checkpoint is not None:
            checkpoint, position = _resume(trainer, checkpoint, log)
            if hasattr(rollout, "version"):  # versions go on from the checkpoint's: the weights after step s are s
                rollout.version = trainer.step_count - 1
            await trainer.sync_weights()
            log(f"resumed {out} at step {trainer.step_count} from {checkpoint}")
        heldout = HeldOutLog(
            out,
            resume_step=trainer.step_count if checkpoint is not None else None,
            report_to=_heldout_reporters(parts, trainer, log),
            wandb_project=parts.trainer.wandb_project,
        )
        cleanup.callback(heldout.close)
        order = TaskOrder(len(env.tasks) if hasattr(env, "tasks") else None, config.holdout, config.seed, **position)
        title = plot_title(parts.learner.name, config, out)
        evaluation = HeldOutEvaluation(config, parts.tree, rollout.evaluate, heldout, progress, log, title)
        trainer.open_steps_bar()  # the run's bar from its first step on, before any rollout
        if trainer.step_count == 0 and config.eval_before:
            await evaluation.run(step=0)
        last_checkpoint = checkpoint
        if parts.cluster.rollout_workers:  # at η = 0 the synchronous steps, with the workers' idle time measured
            batches: _SynchronousSteps | _PipelinedSteps = _PipelinedSteps(
                config,
                parts,
                rollout,
                order,
                progress,
                ahead=config.max_staleness,
                accumulate=_streamed(config, trainer),
            )
        else:
            batches = _SynchronousSteps(config, parts, rollout, order, progress)
        cleanup.push_async_callback(batches.close)
        for step in range(trainer.step_count + 1, config.steps + 1):
            paths, metrics, position = await batches.batch(step)
            record = await trainer.step(paths, metrics)
            batches.trained(step)
            log(_step_note(step, config.steps, record))
            if step % config.checkpoint_every == 0 or step == config.steps:
                last_checkpoint = trainer.save_checkpoint(data_position=position, plot_title=title)
                log(f"step {step}: checkpoint {last_checkpoint}")
                if config.keep_checkpoints is not None:
                    for old in prune_checkpoints(last_checkpoint.parent, config.keep_checkpoints):
                        log(f"step {step}: removed checkpoint {old} (keep_checkpoints={config.keep_checkpoints})")
            if step == config.steps or (config.eval_every and step % config.eval_every == 0):
                await evaluation.run(step=step)
        history = read_jsonl(out / "metrics.jsonl") if (out / "metrics.jsonl").is_file() else []
        return TrainResult(out, effective, trainer.step_count, last_checkpoint, history, list(heldout.results))
    finally:
        await cleanup.aclose()


def plot_title(algo: str, config: TrainConfig, out_dir: str | Path) -> str:
    """The heading of a run's ``curves.png`` and ``heldout.png``: what was trained on what, and where."""
    return f"{algo} · {config.env} · {config.model} ({out_dir})"


def _heldout_reporters(parts: RunParts, trainer: Trainer | TrainerGroup, log: Callable[[str], None]) -> tuple[str, ...]:
    """The held-out log's reporters: the trainer's, but W&B only in the process whose trainer logs to it (one
    W&B run takes one process; trainer ranks log from rank 0's)."""
    report_to = tuple(parts.trainer.report_to)
    if "wandb" not in report_to or isinstance(trainer, Trainer):
        return report_to
    log("W&B gets the trainer's metrics from trainer rank 0's process, not the held-out scores (heldout/ has them)")
    return tuple(name for name in report_to if name != "wandb") or ("none",)


def _on_gpu(config: TrainConfig) -> bool:
    import torch

    return torch.cuda.is_available() and (config.device or "cuda").startswith("cuda")


def _gpu_share(cluster: ClusterConfig) -> float:
    """The part of a GPU one trainer rank (or one GPU of a worker's vLLM) asks Ray for: half of it when
    ranks and engines are colocated (Ray then packs one of each onto every GPU), else all of it."""
    both = cluster.trainer_ranks > 1 and cluster.rollout_workers > 0
    return 0.5 if both and cluster.placement == "colocated" else 1.0


def _processes(cluster: ClusterConfig) -> int:
    """The run's Ray actors: the rollout workers, and the trainer ranks when there are several."""
    return cluster.rollout_workers + (cluster.trainer_ranks if cluster.trainer_ranks > 1 else 0)


def _make_trainer(config: TrainConfig, parts: RunParts, out: Path, progress: bool | None) -> Trainer | TrainerGroup:
    """The trainer in this process, or ``cluster.trainer_ranks`` ranks sharding it (Ray actors)."""
    trainer_config = dataclasses.replace(parts.trainer, progress=progress)
    if parts.cluster.trainer_ranks == 1:
        return Trainer(config.model, trainer_config, out_dir=out)

    from agents.cluster.trainer_ranks import TrainerGroup

    gpus = _gpu_share(parts.cluster) if _on_gpu(config) else 0
    return TrainerGroup(
        config.model,
        trainer_config,
        ranks=parts.cluster.trainer_ranks,
        out_dir=out,
        gpus_per_rank=gpus,
        seed=config.seed,
        bucket_bytes=parts.cluster.sync_bucket_mb * 2**20,
    )


class _LocalRollout:
    """Steps 2 and 5 in this process, on one engine (``cluster.rollout_workers = 0``).

    The same three calls as :class:`agents.cluster.rollout_workers.RolloutPool`, which runs them
    on Ray actors: ``rollout``, ``evaluate`` and ``metrics``; ``engine`` is what receives the
    trainer's weights.
    """

    def __init__(self, env: TokenEnv, engine: Engine, tokenizer: Any, parts: RunParts) -> None:
        self.env, self.engine, self.tokenizer, self.parts = env, engine, tokenizer, parts

    async def rollout(
        self, tasks: list[int], seed: int, on_branches: Callable[[int], None] | None = None
    ) -> list[PromptTrees]:
        episodes = [task_episode(self.env, task) for task in tasks]
        try:
            tree = dataclasses.replace(self.parts.tree, seed=seed)
            return await rollout_trees(
                self.engine, episodes, self.parts.learner.strategy, tree, on_branches=on_branches
            )
        finally:
            for episode in episodes:
                episode.env.close()

    async def evaluate(self, kwargs: dict[str, Any]) -> HeldOut:
        return await evaluate_heldout(self.engine, self.tokenizer, **kwargs)

    def metrics(self) -> dict[str, float]:
        return {}

    async def close(self) -> None:
        await self.engine.close()


def _make_rollout(
    config: TrainConfig, parts: RunParts, env: TokenEnv, trainer: Trainer | TrainerGroup, log: Callable[[str], None]
) -> Any:
    """Where the rollouts run: this process's engine (on the trainer's own model when it is here),
    or ``cluster.rollout_workers`` Ray actors."""
    cluster = parts.cluster
    if not cluster.rollout_workers:
        here = trainer if isinstance(trainer, Trainer) else None
        return _LocalRollout(env, make_engine(config, parts, here, log), trainer.tokenizer, parts)
    from agents.cluster.rollout_workers import RolloutPool, WorkerSpec
    from agents.cluster.runtime import cpu_share

    engine = cluster.worker_engine or config.engine
    worker_config = dataclasses.replace(config, engine=engine)
    gpus = 0.0
    if engine == "vllm" and _on_gpu(config):
        gpus = cluster.tensor_parallel_size * _gpu_share(cluster)
        worker_config.engine_kwargs = {**config.engine_kwargs, "tensor_parallel_size": cluster.tensor_parallel_size}
    processes = cluster.rollout_workers + (cluster.trainer_ranks if cluster.trainer_ranks > 1 else 1)
    spec = WorkerSpec(
        worker_config,
        agentenv.spec(config.env),
        parts.learner.strategy,
        parts.tree,
        threads=max(1, (os.cpu_count() or 1) // processes),
    )
    log(f"starting {cluster.rollout_workers} rollout workers ({engine} engines)")
    return RolloutPool(
        spec,
        cluster.rollout_workers,
        cpus=cpu_share(processes),
        gpus=gpus,
        restarts=cluster.worker_restarts,
        bucket_bytes=cluster.sync_bucket_mb * 2**20,
        colocated=cluster.placement == "colocated" and gpus > 0,
        log=log,
    )


async def _rollout(
    rollout: Any,
    parts: RunParts,
    tasks: list[int],
    seed: int,
    budget_reward: float | None,
    on_branches: Callable[[int], None],
) -> tuple[list[TrainingPath], dict[str, float]]:
    """Steps 2-3 of the module docstring: the trees of ``tasks`` (``on_branches`` counts the ended
    branches, see :func:`~agents.rollout.tree_loop.rollout_trees`), credit, and the rollout's metrics."""
    start = time.perf_counter()
    prompts = await rollout.rollout(tasks, seed, on_branches)
    seconds = time.perf_counter() - start
    paths = _credit(parts, prompts, budget_reward)
    return paths, _rollout_record(rollout, tasks, prompts, seconds, len(paths))


def _credit(parts: RunParts, prompts: list[PromptTrees], budget_reward: float | None) -> list[TrainingPath]:
    """Step 3: the training paths of the finished trees of ``prompts``, each prompt's credit on its own trees."""
    if budget_reward is not None:
        for leaf in _budget_cut(prompts):  # no answer: what the environment's reward gives an unanswered episode
            leaf.reward = float(budget_reward)
    paths: list[TrainingPath] = []
    for prompt in prompts:
        if prompt.leaves:
            paths += parts.learner.assign_credit(prompt.trees)
    return paths


def _budget_cut(prompts: list[PromptTrees]) -> list[Any]:
    """The leaves that the token budget ended before the environment did."""
    return [leaf for prompt in prompts for leaf in prompt.leaves if leaf.info.get("status") == "budget"]


def _rollout_record(
    rollout: Any, tasks: list[int], prompts: list[PromptTrees], seconds: float, paths: int
) -> dict[str, float]:
    """The rollout's metrics of ``prompts`` (rolled out in ``seconds``, giving ``paths`` training paths)."""
    if not paths:
        errors = [error for prompt in prompts for error in _errors(prompt)]
        raise RuntimeError(
            f"no prompt of the batch produced a finished episode (tasks {tasks}); "
            f"first error: {errors[0] if errors else 'none recorded'}"
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


class _SynchronousSteps:
    """The batches of a run without rollout workers: each step's rollout after the previous step's update and sync."""

    def __init__(
        self, config: TrainConfig, parts: RunParts, rollout: Any, order: TaskOrder, progress: bool | None
    ) -> None:
        self.config, self.parts, self.rollout, self.order, self.progress = config, parts, rollout, order, progress
        self.planned = planned_branches(parts.learner.strategy, parts.tree)

    async def batch(self, step: int) -> tuple[list[TrainingPath], dict[str, float], dict[str, int]]:
        """Step ``step``'s paths and rollout metrics, and the task order's position after its tasks."""
        config = self.config
        tasks = self.order.take(config.prompts_per_step)
        total = None if self.planned is None else self.planned * len(tasks)
        with progress_bar(f"rollout step {step}", total, unit="leaves", leave=False, show=self.progress) as bar:
            paths, metrics = await _rollout(
                self.rollout, self.parts, tasks, rollout_seed(config.seed, step), config.budget_reward, bar.update
            )
        return paths, metrics, self.order.position()

    def trained(self, step: int) -> None:
        """The trainer has updated on step ``step`` and synced the engines."""

    async def close(self) -> None:
        pass


class _PipelinedSteps:
    """The batches of a run on rollout workers: rollouts up to ``ahead`` = η steps ahead of the trainer.

    Step ``s``'s prompts go to the pool once the trainer has updated on step ``s − η − 1`` (so every
    token of them is sampled by weights at most η syncs older than those that train on them), and
    the trainer takes step ``s``'s trees when all of them are back. The tasks and seeds of a step
    are the synchronous run's (:class:`TaskOrder`, :func:`rollout_seed`); which weights sample a
    token depends on when the syncs land, so a run is not reproduced exactly. A prompt's trees
    whose oldest token is more than η versions behind the trainer's are dropped (counted in
    ``async/trees_dropped``); the rule above admits none, so this guards the bound.

    With ``accumulate`` (the trainer's :meth:`~agents.training.trainer.Trainer.accumulate`;
    ``stream_update`` at η ≥ 1) each prompt's trees go to the trainer's forward and backward
    passes as soon as they are back and the trainer is free, while the rest of the step rolls
    out; :meth:`batch` then returns no paths, and the trainer's step takes the optimiser step.

    With ``ahead = 0`` the steps are the synchronous ones, in the same order on the same weights
    (tested against :class:`_SynchronousSteps`).
    """

    def __init__(
        self,
        config: TrainConfig,
        parts: RunParts,
        rollout: Any,
        order: TaskOrder,
        progress: bool | None,
        ahead: int,
        accumulate: Callable[[list[TrainingPath]], Awaitable[None]] | None = None,
    ) -> None:
        self.config, self.parts, self.pool, self.order, self.ahead = config, parts, rollout, order, ahead
        self.progress, self.planned = progress, planned_branches(parts.learner.strategy, parts.tree)
        self.accumulate = accumulate
        self.running: dict[int, asyncio.Future[tuple[list[int], list[PromptTrees], float]]] = {}
        self.arrivals: dict[int, asyncio.Queue[PromptTrees]] = {}  # each running step's trees back so far
        self.leaves: dict[int, int] = {}  # each running step's leaves back so far
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
            self.leaves[step] = 0
            self.arrivals[step] = asyncio.Queue()
            self.running[step] = asyncio.ensure_future(self._roll(step, tasks))
            self.next_step += 1

    async def _roll(self, step: int, tasks: list[int]) -> tuple[list[int], list[PromptTrees], float]:
        def back(leaves: int) -> None:
            self.leaves[step] += leaves
            if step in self.bars:
                self.bars[step].update(leaves)

        def arrived(_: int, prompt: PromptTrees) -> None:
            self.arrivals[step].put_nowait(prompt)

        start = time.perf_counter()
        on_prompt = arrived if self.accumulate is not None else None
        prompts = await self.pool.rollout(
            tasks, rollout_seed(self.config.seed, step), back, priority=step, on_prompt=on_prompt
        )
        return tasks, prompts, time.perf_counter() - start

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
        total = None if self.planned is None else self.planned * self.config.prompts_per_step
        with progress_bar(
            f"rollout step {step}", total, unit="leaves", initial=self.leaves[step], leave=False, show=self.progress
        ) as self.bars[step]:
            busy = await self._stream(step, version, taken) if self.accumulate is not None else 0.0
            tasks, prompts, seconds = await self.running.pop(step)
        del self.bars[step], self.leaves[step]
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
            # the staleness bound, docs/algorithms.md eq. 78: a prompt's trees are kept or dropped whole
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


@dataclass
class _Taken:
    """What :class:`_PipelinedSteps` has taken of a step so far: the kept prompts, their staleness,
    their paths (or, when streamed, how many went to the trainer before the step's last trees were back)."""

    kept: list[PromptTrees] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    paths: list[TrainingPath] = field(default_factory=list)
    count: int = 0
    streamed: int = 0


def _drained(queue: asyncio.Queue[PromptTrees]) -> list[PromptTrees]:
    """Everything in ``queue`` now, without waiting."""
    return [queue.get_nowait() for _ in range(queue.qsize())]


def _streamed(
    config: TrainConfig, trainer: Trainer | TrainerGroup
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


def _step_note(step: int, steps: int, record: dict[str, float]) -> str:
    """One line about a finished step: its reward and where its time went."""
    answered = f", format ok {record['reward/format_ok']:.0%}" if "reward/format_ok" in record else ""
    return (
        f"step {step}/{steps}: reward {record['reward/mean']:+.3f} ± {record['reward/std']:.3f}{answered} over "
        f"{record['batch/sequences']:.0f} leaves; {record['tokens/generated']:.0f} tokens sampled; "
        f"{record['time/step_s']:.0f} s (rollout {record['time/rollout_s']:.0f}, old log-probs "
        f"{record['time/old_logprobs_s']:.0f}, update {record['time/update_s']:.0f})"
    )


def saved_config(out_dir: str | Path) -> dict[str, Any]:
    """The effective configuration saved in a run folder (``config.json``), as a mapping."""
    path = Path(out_dir) / CONFIG_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{out_dir} holds no {CONFIG_FILE}, so there is no run to resume there")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{path}, the run's configuration, is not valid JSON ({error}); repair it (the flags that started "
            "the run print it again with --print-config), or start a new run in another folder"
        ) from None


def _require_the_runs_algorithm(out: Path, algo: str) -> None:
    """Refuse to resume ``out`` with another learner (before building anything: the saved strategy,
    credit and loss sections are its own learner's, and another learner's would reject them)."""
    if not (out / CONFIG_FILE).is_file():
        return  # _prepare_run_folder says that there is no run to resume
    saved = saved_config(out).get("algo")
    if saved != algo:
        raise ValueError(
            f"--resume continues the run in {out}, trained with algo {saved!r}, but this run asks for {algo!r}; "
            f"the algorithm differs, and a checkpoint continues only its own: resume with --algo {saved} "
            "(or without --algo), or train the other algorithm in a new run folder (another --out)"
        )


#: What a run writes at the top of its folder besides ``checkpoints/``.
_RUN_FILES = (CONFIG_FILE, "metrics.jsonl", "tensorboard", "wandb", "heldout", "curves.png", "heldout.png")


def _prepare_run_folder(out: Path, effective: TrainConfig, resume: bool, log: Callable[[str], None]) -> Path | None:
    """Check ``out`` for a new run or a resume; returns the checkpoint to resume from (``None``: new run).

    A folder without a checkpoint is no run to protect when it holds no trained step either (a run
    that stopped before its first, e.g. at loading the model): a new run starts there, in place of
    what that one left. One whose steps were all lost (no checkpoint came) is refused, naming the
    way out. For a resume: removes what interrupted checkpoint saves left, and returns the newest
    checkpoint whose files pass :func:`~agents.training.checkpoint.verify_checkpoint`, logging each
    one skipped.
    """
    saved_path = out / CONFIG_FILE
    root = out / "checkpoints"
    newest = latest_checkpoint(root)
    trained = _trained_steps(out)
    if not resume:
        if newest is not None:
            raise FileExistsError(
                f"{out} already holds a training run (its newest checkpoint is {newest.name}); continue it with "
                "--resume, or choose another --out"
            )
        if trained:
            raise FileExistsError(_lost_steps(out, trained, "start it again there"))
        _replace_a_failed_start(out, log)
        out.mkdir(parents=True, exist_ok=True)
        return None
    if newest is None:
        if trained:
            raise FileNotFoundError(_lost_steps(out, trained, "start it again without --resume"))
        raise FileNotFoundError(
            f"{out} holds no checkpoint to resume from (no step of a run there was trained); "
            "start the run without --resume"
        )
    if not saved_path.is_file():
        raise FileNotFoundError(
            f"{out} holds checkpoints but no {CONFIG_FILE}, the run's configuration, so it cannot be resumed; "
            f"put the {CONFIG_FILE} of the run back, or start a new run in another folder"
        )
    saved = TrainConfig.from_dict(saved_config(out))
    changed = [name for name in saved.changed(effective) if not {name, name.split(".")[0]} & RESUMABLE]
    if changed:
        raise ValueError(
            f"--resume continues the run saved in {saved_path}, but these settings differ from it: "
            f"{', '.join(changed)}; drop them (only {', '.join(sorted(RESUMABLE))} may change), "
            "or start a new run in another folder"
        )
    # No trainer exists yet, so no process of this run is writing a checkpoint.
    for folder in remove_stale_temporaries(root, all_writers_gone=True):
        log(f"removed {folder}, the temporary folder of a checkpoint save that was interrupted")
    skipped: list[str] = []

    def skip(path: Path, error: CorruptCheckpointError) -> None:
        skipped.append(str(error))
        log(_skip_note(path, error))

    checkpoint = latest_valid_checkpoint(root, on_skip=skip)
    if checkpoint is None:
        raise ValueError(
            f"no checkpoint in {root} is intact ({'; '.join(skipped)}); start the run again in another folder"
        )
    return checkpoint


def _trained_steps(out: Path) -> int:
    """How many steps the run in ``out`` recorded in ``metrics.jsonl`` (a line each; 0 without the file)."""
    path = out / "metrics.jsonl"
    if not path.is_file():
        return 0
    return sum(1 for line in path.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip())


def _lost_steps(out: Path, trained: int, then: str) -> str:
    return (
        f"{out} holds a run that trained {trained} step{'s' if trained != 1 else ''} but stopped before its first "
        f"checkpoint, so there is nothing to resume; to {then}, delete the folder first (rm -r {out}), "
        "or choose another --out"
    )


def _replace_a_failed_start(out: Path, log: Callable[[str], None]) -> None:
    """Remove what a run that stopped before its first step left in ``out`` (no checkpoint, no trained step).

    Only when ``out/config.json`` is a run's configuration: a folder of other things named alike is
    refused, never cleared.
    """
    config_path = out / CONFIG_FILE
    if not config_path.is_file():
        return
    try:
        TrainConfig.from_dict(saved_config(out))
    except (ValueError, TypeError):
        raise FileExistsError(
            f"{config_path} is not the configuration of a training run, and a run writes its own there; "
            "choose another --out"
        ) from None
    left = [path for path in (out / name for name in _RUN_FILES) if path.exists()]
    names = ", ".join(path.name + ("/" if path.is_dir() else "") for path in left)
    for path in left:
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()
    log(
        f"{out} held a run that stopped before its first step (no checkpoint, no trained step): starting anew, "
        f"in place of its {names}"
    )


def _resume(
    trainer: Trainer | TrainerGroup, checkpoint: Path, log: Callable[[str], None]
) -> tuple[Path, dict[str, Any]]:
    """``trainer.resume(checkpoint)``, or from the newest intact checkpoint before it when loading finds a
    damaged file that the checks before could not see (``torch.load`` reads all of ``trainer_state.pt``);
    returns the checkpoint used and its data position. (A TrainerGroup's rank fails instead, and the
    group stops: its error names the file and the previous checkpoint.)"""
    while True:
        try:
            return checkpoint, trainer.resume(checkpoint)
        except CorruptCheckpointError as error:
            log(_skip_note(checkpoint, error))
            earlier = latest_valid_checkpoint(
                checkpoint.parent, older_than=checkpoint, on_skip=lambda path, damage: log(_skip_note(path, damage))
            )
            if earlier is None:
                raise
            checkpoint = earlier


def _skip_note(path: Path, error: CorruptCheckpointError) -> str:
    return f"--resume skips checkpoint {path}: {error.file} is corrupt ({error.reason}); trying the one before it"


def _warn_if_it_cannot_fit(config: TrainConfig, parts: RunParts, log: Callable[[str], None]) -> None:
    """On a GPU, say before loading anything when the memory plan says the run will not fit."""
    import torch

    if not torch.cuda.is_available() or not (config.device or "cuda").startswith("cuda"):
        return
    from agents.memory_plan import GIB, run_plan, set_flags

    plan, settings = run_plan(config, parts)
    if plan.fits is False or settings:
        fix = set_flags(settings)
        log(
            f"warning: by the memory plan this run does not fit the {(plan.device_bytes or 0) / GIB:.0f} GiB "
            "device as configured"
            + (f"; it fits with {fix}" if plan.fits else f"; not even with {fix} ({plan.peak / GIB:.1f} GiB)")
            + " (agents train --plan shows the parts)"
        )


def make_engine(
    config: TrainConfig, parts: RunParts, trainer: Trainer | None = None, log: Callable[[str], None] = print
) -> Engine:
    """The run's engine: an HFEngine on the trainer's own model object, or vLLM synced after every step.

    Without ``trainer`` (a rollout worker, or a driver whose trainer runs on other ranks) the
    engine loads its own copy of ``config.model`` and receives the weights by sync. ``engine_kwargs``
    reach the engine; for vLLM those that are not VLLMEngine's own go to vLLM's engine arguments.
    vLLM on the trainer's GPU gets, unless told, the memory share that leaves the trainer its
    optimiser state (see :func:`agents.engines.vllm.colocated_memory_share`).
    """
    rollout = parts.tree.rollout
    kwargs = dict(config.engine_kwargs)
    if config.engine == "hf":
        from agents.engines.hf import HFEngine

        settings = {"max_batch_size": rollout.concurrency, "seed": config.seed, **kwargs}
        if trainer is None:
            return HFEngine(config.model, **settings)
        return HFEngine(trainer.model, trainer.tokenizer, **settings)
    from agents.engines.vllm import VLLMEngine, colocated_memory_share

    own = set(inspect.signature(VLLMEngine).parameters)
    vllm_args = {
        **kwargs.pop("engine_args", {}),
        **{name: kwargs.pop(name) for name in list(kwargs) if name not in own},
    }
    if (
        trainer is not None
        and trainer.device.type == "cuda"
        and "gpu_memory_utilization" not in vllm_args
        and "kv_cache_gib" not in kwargs
    ):
        import torch

        free, total = torch.cuda.mem_get_info(trainer.device)
        optimizer_bytes = 8 * sum(p.numel() for p in trainer.trainable_parameters)  # AdamW's m and v in float32
        vllm_args["gpu_memory_utilization"] = share = colocated_memory_share(free, total, optimizer_bytes)
        log(
            f"vLLM beside the trainer on {trainer.device}: gpu_memory_utilization {share:.2f} "
            f"({free / 2**30:.1f} of {total / 2**30:.1f} GiB free, {optimizer_bytes / 2**30:.1f} GiB kept for "
            "the optimiser state); set engine_kwargs.gpu_memory_utilization to choose"
        )
    if trainer is not None and trainer.device.type == "cuda":
        kwargs.setdefault("weight_transfer", "ipc")  # vLLM's own transfer from the trainer's GPU tensors
    settings = {
        "max_num_seqs": rollout.concurrency,
        "max_model_len": rollout.max_prompt_tokens + rollout.max_response_tokens,
        **kwargs,
    }
    return VLLMEngine(config.model, seed=config.seed, engine_args=vllm_args, **settings)


def _errors(prompt: PromptTrees) -> list[str]:
    return ([prompt.error] if prompt.error else []) + [error for stats in prompt.stats for error in stats.errors]
