"""The training loop: rollout trees on the engine, credit, a trainer step, weight sync, checkpoints.

One step (read :func:`train` top to bottom):

1. the next ``prompts_per_step`` tasks of the environment in the run's task order
   (:class:`~agents.run.task_order.TaskOrder`: a seeded permutation of the tasks after the held-out ones, renewed
   every epoch);
2. their rollout trees under the learner's strategy, all prompts concurrently on the engine
   (:func:`agents.rollout.strategies.rollout_trees`), seeded from the run's seed and the step;
3. credit assignment per prompt (the learner's ``credit``) into training paths;
4. :meth:`agents.training.trainer.Trainer.step`: old log-probs, the loss's mini-batch updates, weight
   sync to the engine, metrics (with the rollout's numbers) to ``metrics.jsonl`` and the reporters of
   ``trainer.report_to`` (TensorBoard, W&B);
5. every ``checkpoint_every`` steps and after the last, a checkpoint holding the task order's
   position, and the checkpoints older than the newest ``keep_checkpoints`` intact ones removed
   (:func:`~agents.training.checkpoint.prune_checkpoints`); every ``eval_every`` steps, at the steps
   whose rollouts reach each of ``eval_at_tokens``, before the first (``eval_before``) and after the
   last, the held-out evaluation (:mod:`agents.eval.heldout`).

Steps 2-3 are :mod:`agents.run.steps` (one rollout after another, or pipelined on rollout workers up
to ``max_staleness`` steps ahead); where the rollouts run is a
:class:`~agents.run.backends.RolloutBackend`; the run folder's checks and the resume are
:mod:`agents.run.folder`.

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

import contextlib
import dataclasses
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

import agentenv
from agentenv.registration import load_entry_point
from agentenv.wrappers import TokenEnv
from agents.eval.heldout import HeldOut, HeldOutEvaluation, HeldOutLog
from agents.learners import Learner
from agents.progress import note
from agents.run.backends import LocalRollout, RolloutBackend, TrainerBackend, run_engine
from agents.run.cluster.config import ClusterConfig
from agents.run.cluster.rollout_workers import RolloutPool, WorkerSpec
from agents.run.cluster.runtime import cpu_share, ensure_ray
from agents.run.cluster.trainer_ranks import TrainerGroup
from agents.run.config import RunParts, TrainConfig, build, effective_config
from agents.run.folder import (
    CONFIG_FILE,
    PLACEMENT_FILE,
    prepare_run_folder,
    require_the_runs_algorithm,
    resume_trainer,
)
from agents.run.memory_plan import GIB, run_plan, set_flags
from agents.run.task_order import TaskOrder
from agents.training.checkpoint import prune_checkpoints
from agents.training.metrics import read_jsonl
from agents.training.reporting import import_wandb
from agents.training.trainer import Trainer

__all__ = ["TrainResult", "plot_title", "train"]


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
        config: The run (see :class:`~agents.run.config.TrainConfig`).
        out_dir: The run folder; must not hold another run unless ``resume`` (one that stopped
            before its first trained step is replaced).
        learner: Your own learner instead of ``config.algo``'s; the config's ``credit`` and
            ``loss`` sections still apply to it, and its ``strategy`` section when the config is
            made for it (``agents.run.config.resolve(..., learner=learner)``; see
            :func:`agents.run.config.build`).
        resume: Continue the run in ``out_dir`` from its newest intact checkpoint. Only
            :data:`~agents.run.config.RESUMABLE` values (``steps``, evaluation and checkpoint
            cadence, ``keep_checkpoints``, the reporters) may differ from the saved configuration; another
            ``algo`` is refused first.
        progress: Progress of model loading, every step (``train``), its rollout, its update
            and the held-out evaluations: ``False`` none; ``True`` or ``None`` tqdm bars on a
            terminal, and plain lines every 30 s when stderr is a file or a pipe (:mod:`agents.progress`).
        log: Where one-line notes go (checkpoints, evaluations; default stdout, flushed).
    """
    out = Path(out_dir)
    if resume:
        require_the_runs_algorithm(out, learner.name if learner is not None else config.algo)
    parts = build(config, learner)
    if "wandb" in parts.trainer.report_to:
        import_wandb()  # a missing client fails before the run folder is touched
    effective = effective_config(config, parts)
    cleanup = contextlib.AsyncExitStack()  # closes what was made, in reverse, however the run ends
    try:
        # Made first, so that a bad environment id or option fails before the run folder or the model is touched.
        task_env = agentenv.make(config.env, **config.env_kwargs)
        cleanup.callback(task_env.close)
        checkpoint = prepare_run_folder(out, effective, resume, log)
        (out / CONFIG_FILE).write_text(json.dumps(effective.to_dict(), indent=2) + "\n", encoding="utf-8")
        _warn_if_it_cannot_fit(config, parts, log)
        if parts.cluster.uses_ray:
            ensure_ray(parts.cluster.address, processes=_processes(parts.cluster))
        trainer = _make_trainer(config, parts, out, progress)
        cleanup.callback(trainer.close)
        env = TokenEnv(task_env, trainer.tokenizer)
        rollout = _make_rollout(config, parts, env, trainer, log)
        cleanup.push_async_callback(rollout.close)
        if config.max_staleness and rollout.supports_sleep and parts.trainer.sleep_engine:
            raise ValueError(
                f"max_staleness={config.max_staleness} rolls out during the update, but the engines share the "
                "trainer's GPUs and sleep through it: cluster.placement=split (or max_staleness=0)"
            )
        _record_placement(out, trainer, rollout, log)
        trainer.engine = rollout.engine  # each step ends with the weights synced to it
        position: dict[str, Any] = {}
        if checkpoint is not None:
            checkpoint, position = resume_trainer(trainer, checkpoint, log)
            rollout.set_version(trainer.step_count - 1)  # the sync below makes it the step's: the weights after s are s
            await trainer.sync_weights()
            log(f"resumed {out} at step {trainer.step_count} from {checkpoint}")
        heldout = HeldOutLog(
            out,
            resume_step=trainer.step_count if checkpoint is not None else None,
            report_to=_heldout_reporters(parts, trainer, log),
            wandb_project=parts.trainer.wandb_project,
        )
        cleanup.callback(heldout.close)
        count = len(env.tasks) if env.tasks is not None else None  # None: each reset draws its task
        order = TaskOrder(count, config.holdout, config.seed, **position)
        title = plot_title(parts.learner.name, config, out)
        evaluation = HeldOutEvaluation(config, parts.tree, rollout.evaluate, heldout, progress, log, title)
        trainer.open_steps_bar()  # the run's bar from its first step on, before any rollout
        if trainer.step_count == 0 and config.eval_before:
            await evaluation.run(step=0)
        last_checkpoint = checkpoint
        batches = rollout.steps(config, parts, order, progress, trainer)
        cleanup.push_async_callback(batches.close)
        spent = RolloutTokens(config.max_rollout_tokens, out, trainer.step_count)
        for step in range(trainer.step_count + 1, config.steps + 1):
            paths, metrics, position = await batches.batch(step)
            record = await trainer.step(paths, metrics)
            batches.trained(step)
            log(_step_note(step, config.steps, record, config.prompts_per_step))
            before = spent.tokens
            last = spent.add(record) or step == config.steps
            crossed = any(before < point <= spent.tokens for point in config.eval_at_tokens)
            if last and step < config.steps:
                log(f"step {step}: {spent.tokens} rollout tokens reach max_rollout_tokens={spent.budget}; the run ends")
            if step % config.checkpoint_every == 0 or last:
                last_checkpoint = _checkpoint(trainer, config, step, position, title, log)
            if last or crossed or (config.eval_every and step % config.eval_every == 0):
                await evaluation.run(step=step)
            if last:
                break
        history = read_jsonl(out / "metrics.jsonl") if (out / "metrics.jsonl").is_file() else []
        return TrainResult(out, effective, trainer.step_count, last_checkpoint, history, list(heldout.results))
    finally:
        await cleanup.aclose()


def _checkpoint(
    trainer: TrainerBackend,
    config: TrainConfig,
    step: int,
    position: dict[str, int],
    title: str,
    log: Callable[[str], None],
) -> Path:
    """Step 5: save a checkpoint after ``step`` and remove those past ``keep_checkpoints``; the new one's folder."""
    checkpoint = trainer.save_checkpoint(data_position=position, plot_title=title)
    log(f"step {step}: checkpoint {checkpoint}")
    if config.keep_checkpoints is not None:
        for old in prune_checkpoints(checkpoint.parent, config.keep_checkpoints):
            log(f"step {step}: removed checkpoint {old} (keep_checkpoints={config.keep_checkpoints})")
    return checkpoint


class RolloutTokens:
    """The tokens a run has sampled (``sampling/tokens`` of its steps, those before a resume read back
    from ``metrics.jsonl``) against its ``max_rollout_tokens``."""

    def __init__(self, budget: int | None, out: Path, resumed_at: int) -> None:
        self.budget = budget
        earlier = read_jsonl(out / "metrics.jsonl") if resumed_at and (out / "metrics.jsonl").is_file() else []
        self.tokens = int(sum(record.get("sampling/tokens", 0.0) for record in earlier if record["step"] <= resumed_at))

    def add(self, record: dict[str, float]) -> bool:
        """Count a step's tokens; whether the budget is reached."""
        self.tokens += int(record.get("sampling/tokens", 0.0))
        return self.budget is not None and self.tokens >= self.budget


def plot_title(algo: str, config: TrainConfig, out_dir: str | Path) -> str:
    """The heading of a run's ``curves.png`` and ``heldout.png``: what was trained on what, and where."""
    return f"{algo} · {config.env} · {config.model} ({out_dir})"


def _heldout_reporters(parts: RunParts, trainer: TrainerBackend, log: Callable[[str], None]) -> tuple[str, ...]:
    """The held-out log's reporters: the trainer's, but W&B only in the process whose trainer logs to it (one
    W&B run takes one process; trainer ranks log from rank 0's)."""
    report_to = tuple(parts.trainer.report_to)
    if "wandb" not in report_to or trainer.local is not None:
        return report_to
    log("W&B gets the trainer's metrics from trainer rank 0's process, not the held-out scores (heldout/ has them)")
    return tuple(name for name in report_to if name != "wandb") or ("none",)


def _on_gpu(config: TrainConfig) -> bool:
    return torch.cuda.is_available() and (config.device or "cuda").startswith("cuda")


def _gpu_share(cluster: ClusterConfig) -> float:
    """The part of a GPU one trainer rank (or one GPU of a worker's vLLM) asks Ray for: half of it when
    ranks and engines are colocated (Ray then packs one of each onto every GPU), else all of it."""
    both = cluster.trainer_ranks > 1 and cluster.rollout_workers > 0
    return 0.5 if both and cluster.placement == "colocated" else 1.0


def _processes(cluster: ClusterConfig) -> int:
    """The run's Ray actors: the rollout workers, and the trainer ranks when there are several."""
    return cluster.rollout_workers + (cluster.trainer_ranks if cluster.trainer_ranks > 1 else 0)


def _make_trainer(config: TrainConfig, parts: RunParts, out: Path, progress: bool | None) -> TrainerBackend:
    """The trainer in this process, or ``cluster.trainer_ranks`` ranks sharding it (Ray actors)."""
    trainer_config = dataclasses.replace(parts.trainer, progress=progress)
    if parts.cluster.trainer_ranks == 1:
        return Trainer(config.model, trainer_config, out_dir=out)
    gpus = _gpu_share(parts.cluster) if _on_gpu(config) else 0
    return TrainerGroup(
        config.model,
        trainer_config,
        ranks=parts.cluster.trainer_ranks,
        out_dir=out,
        gpus_per_rank=gpus,
        seed=config.seed,
        bucket_bytes=parts.cluster.sync_bucket_mb * 2**20,
        resources=parts.cluster.rank_resources,
        strategy=parts.cluster.rank_strategy,
    )


def _make_rollout(
    config: TrainConfig, parts: RunParts, env: TokenEnv, trainer: TrainerBackend, log: Callable[[str], None]
) -> RolloutBackend:
    """Where the rollouts run: this process's engine (on the trainer's own model when it is here),
    or ``cluster.rollout_workers`` Ray actors."""
    cluster = parts.cluster
    if not cluster.rollout_workers:
        return LocalRollout(env, run_engine(config, parts.tree.rollout, trainer.local, log), trainer.tokenizer, parts)
    engine = cluster.worker_engine or config.engine
    own_engine = _load_entry_point(engine) if ":" in engine else None  # "module:attr", the user's engine
    worker_config = dataclasses.replace(config, engine=config.engine if own_engine else engine)
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
        engine=own_engine,
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
        resources=cluster.worker_resources,
        strategy=cluster.worker_strategy,
    )


def _load_entry_point(name: str) -> Callable[[], Any]:
    """The function named ``"module:attr"``, or a ValueError saying what is missing."""
    try:
        return load_entry_point(name)
    except (ImportError, AttributeError) as error:
        raise ValueError(
            f"cluster.worker_engine={name!r} names no function ({error}); give 'module:attr' of a function "
            "returning your engine, importable here and on every node"
        ) from None


def _record_placement(out: Path, trainer: TrainerBackend, rollout: RolloutBackend, log: Callable[[str], None]) -> None:
    """Say where each trainer rank and rollout worker landed, and keep it in ``placement.json``."""
    ranks, workers = trainer.placement, rollout.placement
    if not ranks and not workers:
        return
    for kind, entries in (("trainer rank", ranks), ("rollout worker", workers)):
        for entry in entries:
            log(f"{kind} {entry['rank']} on node {str(entry['node'])[:12]} ({entry['ip']}), pid {entry['pid']}")
    placement: dict[str, Any] = {"trainer_ranks": ranks, "rollout_workers": workers}
    if trainer.rendezvous is not None:
        placement["rendezvous"] = "{}:{}".format(*trainer.rendezvous)
    (out / PLACEMENT_FILE).write_text(json.dumps(placement, indent=2) + "\n", encoding="utf-8")


def _step_note(step: int, steps: int, record: dict[str, float], prompts_per_step: int) -> str:
    """One line about a finished step: its reward and where its time went."""
    answered = f", format ok {record['reward/format_ok']:.0%}" if "reward/format_ok" in record else ""
    return (
        f"step {step}/{steps}: reward {record['reward/mean']:+.3f} ± {record['reward/std']:.3f}{answered} over "
        f"{record['batch/sequences']:.0f} leaves; {record['tokens/generated']:.0f} tokens sampled; "
        f"{record['time/step_s']:.0f} s (rollout {record['time/rollout_s']:.0f}, old log-probs "
        f"{record['time/old_logprobs_s']:.0f}, update {record['time/update_s']:.0f})"
        + _signal_note(record, prompts_per_step)
    )


def _signal_note(record: dict[str, float], prompts_per_step: int) -> str:
    """What the step's line says about its learning signal: dynamic sampling's cost, and loudly a step
    whose prompts all had leaves of one reward (every advantage 0, so the step learned nothing)."""
    note = ""
    if "sampling/prompts_kept" in record:
        note = (
            f"; dynamic sampling kept {record['sampling/prompts_kept']:.0f} of {record['sampling/prompts']:.0f} "
            f"prompts ({record['sampling/tokens_dropped']:.0f} tokens sampled for dropped ones)"
        )
    signal = record.get("tree/signal_frac")
    if signal == 0:
        note += "; NO SIGNAL: every prompt's leaves got the same reward, so every advantage is 0 and nothing was learnt"
    elif "sampling/prompts_kept" in record and record["sampling/prompts_kept"] < prompts_per_step:
        note += (
            f"; only {record['sampling/prompts_kept']:.0f} of the step's {prompts_per_step} prompts have signal "
            "(max_sampled_prompts reached)"
        )
    return note


def _warn_if_it_cannot_fit(config: TrainConfig, parts: RunParts, log: Callable[[str], None]) -> None:
    """On a GPU, say before loading anything when the memory plan says the run will not fit."""
    if not _on_gpu(config):
        return
    plan, settings = run_plan(config, parts)
    if plan.fits is False or settings:
        fix = set_flags(settings)
        log(
            f"warning: by the memory plan this run does not fit the {(plan.device_bytes or 0) / GIB:.0f} GiB "
            "device as configured"
            + (f"; it fits with {fix}" if plan.fits else f"; not even with {fix} ({plan.peak / GIB:.1f} GiB)")
            + " (agents train --plan shows the parts)"
        )
