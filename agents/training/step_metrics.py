"""A training step's numbers: what its passes and updates add up to, and the record they make.

:class:`StepWork` collects a step (or the parts of one, under ``Trainer.accumulate``): the loss
metrics of every micro-batch (:class:`LossMetrics`), the sampler/trainer mismatch
(:class:`Mismatch`), the optimiser's numbers, timings, and the batch's sizes;
:meth:`StepWork.result` is the trainer's record and :func:`merge_rollout_metrics` adds the
caller's; :class:`StepLog` writes the records and shows the ``train`` bar. The names are those of :mod:`agents.training.metrics`, which logs and draws them
(and loads without torch; this module is the trainer's side).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import distributed as dist

from agents.progress import progress_bar
from agents.training.batch import PathBatch
from agents.training.metrics import GENERATED_TOKENS, ROLLOUT_TIME, MetricsLog
from agents.training.sharding import sum_over_ranks
from agents.training.trainer_config import TrainerConfig

if TYPE_CHECKING:
    from agents.training.forward import MicroBatch

__all__ = [
    "COUNT_METRICS",
    "TRAINER_GROUPS",
    "TRAINER_METRICS",
    "LossMetrics",
    "Mismatch",
    "StepLog",
    "StepWork",
    "checked_rollout_metrics",
    "merge_rollout_metrics",
]

#: Metric groups and names the trainer writes; the caller's rollout metrics must avoid them.
TRAINER_GROUPS = ("policy/", "mismatch/", "optim/", "batch/", "throughput/")
TRAINER_METRICS = frozenset(
    {
        "reward/mean",
        "reward/std",
        "reward/min",
        "reward/max",
        "tokens/trained",
        "tokens/action",
        "time/old_logprobs_s",
        "time/update_s",
        "time/sync_s",
        "time/step_s",
    }
)
#: Loss metrics that count things (turns, sequences): summed over micro-batches, not averaged.
COUNT_METRICS = frozenset({"turns", "clipped_turns", "sequences", "clipped_sequences"})


def checked_rollout_metrics(rollout: Mapping[str, float]) -> dict[str, float]:
    """The caller's metrics as floats, refusing names the trainer writes itself."""
    clash = sorted(name for name in rollout if name in TRAINER_METRICS or name.startswith(TRAINER_GROUPS))
    if clash:
        raise ValueError(
            f"rollout_metrics names {clash}, which the trainer computes itself; rename them "
            f"(the trainer owns {', '.join(TRAINER_GROUPS)}* and {', '.join(sorted(TRAINER_METRICS))})"
        )
    try:
        return {str(name): float(value) for name, value in rollout.items()}
    except (TypeError, ValueError) as error:
        raise ValueError(f"rollout_metrics values must be numbers: {error}") from None


def merge_rollout_metrics(own: dict[str, float], rollout: dict[str, float]) -> dict[str, float]:
    """The trainer's metrics with the caller's, plus what follows from both (step time, rollout tokens/s)."""
    record = {**own, **rollout}
    record["time/step_s"] = sum(
        record.get(name, 0.0) for name in (ROLLOUT_TIME, "time/old_logprobs_s", "time/update_s", "time/sync_s")
    )
    if ROLLOUT_TIME in rollout and GENERATED_TOKENS in rollout and rollout[ROLLOUT_TIME] > 0:
        record["throughput/rollout_tokens_per_s"] = rollout[GENERATED_TOKENS] / rollout[ROLLOUT_TIME]
    return record


class Mismatch:
    """|sampler log-prob − trainer log-prob| over action tokens: max and mean (docs/algorithms/training.md eq. 59)."""

    def __init__(self) -> None:
        self.max, self.sum, self.tokens = 0.0, 0.0, 0

    def add(self, trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor) -> None:
        difference = (trainer.double() - sampler.double()).abs()[mask]  # docs/algorithms/training.md eq. 59
        if difference.numel():
            self.max = max(self.max, float(difference.max()))
            self.sum += float(difference.sum())
            self.tokens += difference.numel()

    def combine_ranks(self) -> None:
        """Every rank's comparisons together (max of the maxima, sums and counts summed)."""
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.max, self.sum, self.tokens))
        self.max = max(part[0] for part in gathered)
        self.sum = sum(part[1] for part in gathered)
        self.tokens = sum(part[2] for part in gathered)

    def result(self) -> dict[str, float]:
        return {
            "mismatch/max_abs": self.max,
            "mismatch/mean_abs": self.sum / max(self.tokens, 1),
            "mismatch/tokens": float(self.tokens),
        }


class LossMetrics:
    """Loss metrics of the micro-batches: weighted means per update (counts summed), then per step."""

    def __init__(self) -> None:
        self.update: dict[str, float] = defaultdict(float)
        self.totals: dict[str, float] = defaultdict(float)
        self.updates = 0

    def add(self, metrics: Mapping[str, float], share: float) -> None:
        for name, value in metrics.items():
            self.update[name] += value if name in COUNT_METRICS else value * share

    def scale(self, factor: float) -> None:
        """The update's weighted sums × ``factor`` (weights given as units, divided by their total at the end)."""
        for name in self.update:
            if name not in COUNT_METRICS:
                self.update[name] *= factor

    def combine_ranks(self) -> None:
        """The update's sums over every rank's micro-batches (each rank added its own shares)."""
        self.update = defaultdict(float, sum_over_ranks(self.update))

    def end_update(self) -> None:
        for name, value in self.update.items():
            self.totals[name] += value
        self.update.clear()
        self.updates += 1

    def result(self, epochs: int) -> dict[str, float]:
        """Averages over the updates; counts summed over one epoch's mini-batches."""
        return {
            name: value / (epochs if name in COUNT_METRICS else self.updates) for name, value in self.totals.items()
        }


class StepWork:
    """What a step's passes and updates add up to: loss metrics, the mismatch, the optimiser's
    numbers, timings, and the sizes of the batch (or of its parts so far, under accumulate)."""

    def __init__(self, batch: PathBatch) -> None:
        self.loss, self.mismatch = LossMetrics(), Mismatch()
        self.optim: defaultdict[str, list[float]] = defaultdict(list)
        self.time_old = self.time_update = 0.0
        self.units = 0  # Σ u_j of the parts accumulated so far
        self.rewards: list[torch.Tensor] = []
        self.trained_tokens = self.action_tokens = 0.0
        self.sequences = 0
        self.tokens_forwarded = 0  # by the update passes (every rank's)
        self.kernels: defaultdict[str | None, int] = defaultdict(int)  # the update passes by tree-attention kernel
        self.add(batch)

    def add(self, batch: PathBatch) -> None:
        self.rewards.append(batch.rewards)
        self.trained_tokens += float(batch.attention_mask.sum())
        self.action_tokens += float(batch.mask.sum())
        self.sequences += batch.ids.shape[0]

    def add_passes(self, micro_batches: Sequence[MicroBatch], times: int = 1) -> None:
        """The update passes over ``micro_batches`` (every rank's), each run ``times``."""
        for micro in micro_batches:
            self.tokens_forwarded += times * micro.tokens_forwarded
            self.kernels[micro.kernel] += times

    def result(self, epochs: int, *, combine_ranks: bool = False) -> dict[str, float]:
        """The trainer's metrics of the step (names: :mod:`agents.training.metrics`); ``combine_ranks``: every
        rank's mismatch together (each compared its own passes; all ranks must call it)."""
        if combine_ranks:
            self.mismatch.combine_ranks()
        rewards = torch.cat(self.rewards).double()
        optim = self.optim
        tree_passes = sum(count for kernel, count in self.kernels.items() if kernel is not None)
        return {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std(correction=0).item(),
            "reward/min": rewards.min().item(),
            "reward/max": rewards.max().item(),
            **{f"policy/{name}": value for name, value in self.loss.result(epochs).items()},
            **self.mismatch.result(),
            "optim/grad_norm": sum(optim["grad_norm"]) / len(optim["grad_norm"]),
            "optim/lr": optim["lr"][-1],
            "optim/updates": float(len(optim["grad_norm"])),
            # an update whose gradient norm is not finite was skipped (agents.training.optimizer.clipped_step)
            "optim/skipped_updates": float(sum(not math.isfinite(norm) for norm in optim["grad_norm"])),
            "tokens/trained": self.trained_tokens,
            "tokens/action": self.action_tokens,
            "batch/sequences": float(self.sequences),
            # What the update's forward passes ran on: padding included, each shared prefix once under tree packing.
            "batch/tokens_forwarded": float(self.tokens_forwarded),
            **(
                {
                    f"batch/tree_{kernel}_passes": self.kernels[kernel] / tree_passes
                    for kernel in ("batched", "flex", "varlen")
                }
                if tree_passes
                else {}
            ),
            "time/old_logprobs_s": self.time_old,
            "time/update_s": self.time_update,
            "throughput/update_tokens_per_s": self.trained_tokens * epochs / self.time_update,
        }


class StepLog:
    """Where a trainer's step records go: the metrics log (``metrics.jsonl`` and the reporters of
    ``report_to``, in ``out_dir``; in memory without one) and the ``train`` progress bar.

    Args:
        config: ``report_to``, ``wandb_project`` and ``total_steps`` are read; W&B gets the whole of it
            unless the run folder holds the run's own ``config.json``.
        out_dir: the run folder (``None`` on ranks other than 0, which keep their records in memory).
        show: whether to show the bar (:func:`agents.progress.progress_bar` says what ``None`` shows).
    """

    def __init__(self, config: TrainerConfig, out_dir: Path | None, *, show: bool | None) -> None:
        self.config, self.out_dir, self.show = config, out_dir, show
        self.metrics: MetricsLog | None = None  # opened by the first step, or by a resume
        self._bar: Any = None

    def open(self, resume_step: int | None = None) -> MetricsLog:
        """(Re)open the metrics log; from a checkpoint's ``resume_step``, its later records are dropped."""
        if self.metrics is not None:
            self.metrics.close()
        self.metrics = MetricsLog(
            self.out_dir,
            report_to=self.config.report_to,
            resume_step=resume_step,
            wandb_project=self.config.wandb_project,
            wandb_config={"trainer": self.config.to_dict()},
        )
        return self.metrics

    def open_bar(self, steps_done: int) -> None:
        """Show the ``train`` bar (``total_steps``, from ``steps_done``) unless it is open."""
        if self._bar is None:
            self._bar = progress_bar("train", self.config.total_steps, unit="steps", initial=steps_done, show=self.show)

    def log(self, step: int, record: Mapping[str, float]) -> None:
        """Write step ``step``'s record and advance the bar."""
        metrics = self.metrics if self.metrics is not None else self.open()
        metrics.log(step, record)
        self.open_bar(step - 1)
        self._bar.set_postfix(reward=f"{record['reward/mean']:.3f}", loss=f"{record['policy/loss']:.4f}", refresh=False)
        self._bar.update()

    def close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def close(self) -> None:
        """Close the metric writers and the bar."""
        if self.metrics is not None:
            self.metrics.close()
        self.close_bar()
