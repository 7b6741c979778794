"""Training metrics: one record per step to a JSONL file and TensorBoard, and a plot of the curves.

A record is a flat ``{name: float}`` dict. Names are ``group/quantity``; the trainer writes:

- ``reward/mean``, ``reward/std`` (population std), ``reward/min``, ``reward/max``: leaf rewards
  of the batch's paths;
- ``policy/...``: what the loss reports (``loss``, ``pg_loss``, ``clip_frac_low``,
  ``clip_frac_high``, ``ratio_mean``, ``approx_kl``, ``kl_ref``, ``entropy`` and per-loss
  extras such as ATPO's ``turns``; docs/algorithms.md "Loss metrics", eqs. 55, 56); ``policy/entropy``
  is the exact full-vocabulary token entropy of the action tokens from the training forward pass
  (docs/algorithms.md eq. 2);
- ``mismatch/max_abs``, ``mismatch/mean_abs``, ``mismatch/tokens``: the sampler's log-probs
  against the trainer's, before the update (docs/algorithms.md eq. 59);
- ``optim/grad_norm`` (before clipping), ``optim/lr``, ``optim/updates``,
  ``optim/skipped_updates`` (non-finite gradients);
- ``tokens/trained``, ``tokens/action``, ``batch/sequences``; ``batch/tokens_forwarded`` (the
  update passes' tokens: padding included, each shared prefix once under ``packing="tree"``)
  and, under tree packing, ``batch/tree_batched_passes`` and ``batch/tree_flex_passes`` (the
  fractions of passes whose tree attention ran as one batched SDPA call, or as one FlexAttention
  call on a GPU, rather than per path);
- ``time/old_logprobs_s``, ``time/update_s``, ``time/sync_s``, ``time/step_s``;
- ``throughput/update_tokens_per_s`` and, from the caller's numbers,
  ``throughput/rollout_tokens_per_s``.

The rollout side is the caller's: it passes its own numbers, for instance
:data:`ROLLOUT_TIME` (``time/rollout_s``), :data:`GENERATED_TOKENS` (``tokens/generated``) and
``reward/em``, and the trainer merges them into the same record.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from agents.rollout.diagnostics import GENERATED_TOKENS, ROLLOUT_TIME

__all__ = [
    "GENERATED_TOKENS",
    "PLOT_PANELS",
    "ROLLOUT_TIME",
    "MetricsLog",
    "plot_curves",
    "read_jsonl",
]


#: The panels of :func:`plot_curves`: a title and the metrics drawn in it. ``reward/mean`` is
#: drawn with a ±``reward/std`` band.
PLOT_PANELS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("reward", ("reward/mean",)),
    ("exact match", ("reward/em",)),
    ("token entropy", ("policy/entropy",)),
    ("clip fraction", ("policy/clip_frac_low", "policy/clip_frac_high")),
    ("KL", ("policy/approx_kl", "policy/kl_ref")),
    ("sampler mismatch |Δ log p|", ("mismatch/max_abs", "mismatch/mean_abs")),
    ("grad norm", ("optim/grad_norm",)),
    ("seconds per step", ("time/rollout_s", "time/old_logprobs_s", "time/update_s", "time/sync_s")),
    ("tokens/s", ("throughput/update_tokens_per_s", "throughput/rollout_tokens_per_s")),
)

_JSONL = "metrics.jsonl"
_TENSORBOARD = "tensorboard"


class MetricsLog:
    """Per-step metrics kept in memory and, with ``out_dir``, written as they come.

    Files under ``out_dir``: ``metrics.jsonl`` (one JSON object per step, ``{"step": n, ...}``)
    and TensorBoard event files under ``tensorboard/`` (when ``tensorboard`` is true).

    Args:
        out_dir: the run folder, or ``None`` to keep the history in memory only.
        tensorboard: also write TensorBoard scalars.
        resume_step: continue a run from this step: records of later steps (written after the
            checkpoint being resumed) are dropped from the JSONL file and TensorBoard. Without
            it, ``out_dir`` must not hold another run's metrics.
    """

    def __init__(
        self, out_dir: str | Path | None = None, *, tensorboard: bool = True, resume_step: int | None = None
    ) -> None:
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.history: list[dict[str, float]] = []
        self._writer = None
        if self.out_dir is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        if resume_step is not None and self.jsonl_path.is_file():
            self.history = [record for record in read_jsonl(self.jsonl_path) if record["step"] <= resume_step]
            self.jsonl_path.write_text("".join(json.dumps(record) + "\n" for record in self.history))
        elif resume_step is None:
            if self.jsonl_path.is_file() and self.jsonl_path.stat().st_size:
                raise FileExistsError(
                    f"{self.out_dir} already holds the metrics of a run; resume it from one of "
                    "its checkpoints, or choose an empty folder"
                )
            self.jsonl_path.write_text("")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events of steps after the checkpoint from TensorBoard's view.
            purge = None if resume_step is None else resume_step + 1
            self._writer = SummaryWriter(str(self.out_dir / _TENSORBOARD), purge_step=purge)

    @property
    def jsonl_path(self) -> Path:
        """Where the JSONL records go (``out_dir/metrics.jsonl``)."""
        if self.out_dir is None:
            raise ValueError("this MetricsLog keeps its history in memory only (out_dir=None)")
        return self.out_dir / _JSONL

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record the metrics of ``step``; non-finite values are kept in memory and written as null."""
        if "step" in metrics:
            raise ValueError("'step' is the record's key; pass the step number as the step argument")
        record = {"step": int(step), **{name: float(value) for name, value in metrics.items()}}
        self.history.append(record)
        if self.out_dir is None:
            return
        with self.jsonl_path.open("a") as file:
            file.write(json.dumps({k: v if math.isfinite(v) else None for k, v in record.items()}) + "\n")
        if self._writer is not None:
            for name, value in metrics.items():
                self._writer.add_scalar(name, float(value), step)
            self._writer.flush()

    def close(self) -> None:
        """Close the TensorBoard writer (the JSONL file is closed after every record)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def read_jsonl(path: str | Path) -> list[dict[str, float]]:
    """The records of a ``metrics.jsonl`` file; ``null`` values read back as NaN."""
    records = []
    for number, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise ValueError(f"{path}:{number} is not a JSON line ({error})") from None
        records.append({k: math.nan if v is None else v for k, v in record.items()})
    return records


def plot_curves(
    history: Sequence[Mapping[str, Any]],
    path: str | Path,
    panels: Sequence[tuple[str, Sequence[str]]] = PLOT_PANELS,
) -> Path:
    """Draw the metrics of ``history`` (records with a ``step``) against the step as a PNG.

    One panel per entry of ``panels`` that has data; panels whose metrics never occur are left
    out. Returns ``path``.
    """
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state

    present = [
        (title, [name for name in names if any(name in record for record in history)]) for title, names in panels
    ]
    present = [(title, names) for title, names in present if names]
    if not present:
        raise ValueError("nothing to plot: no record holds any metric named in the panels")
    columns = min(3, len(present))
    rows = math.ceil(len(present) / columns)
    figure = Figure(figsize=(4.2 * columns, 3.0 * rows), layout="constrained")
    axes = figure.subplots(rows, columns, squeeze=False).flatten()
    for axis, (title, names) in zip(axes, present):
        for name in names:
            points = [(record["step"], record[name]) for record in history if name in record]
            steps, values = zip(*points)
            axis.plot(steps, values, marker="o", markersize=3, label=name)
            if name == "reward/mean" and all("reward/std" in record for record in history if name in record):
                spread = [record["reward/std"] for record in history if name in record]
                axis.fill_between(
                    steps,
                    [v - s for v, s in zip(values, spread)],
                    [v + s for v, s in zip(values, spread)],
                    alpha=0.2,
                    label="± reward/std",
                )
        axis.set_title(title)
        axis.set_xlabel("step")
        axis.grid(alpha=0.3)
        if len(names) > 1 or title == "reward":
            axis.legend(fontsize="x-small")
    for axis in axes[len(present) :]:
        axis.set_visible(False)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return path
