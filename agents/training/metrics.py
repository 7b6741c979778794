"""Training metrics: one record per step to a JSONL file and the reporters (TensorBoard, W&B), and a plot of the curves.

A record is a flat ``{name: float}`` dict. Names are ``group/quantity``; the trainer writes:

- ``reward/mean``, ``reward/std`` (population std), ``reward/min``, ``reward/max``: leaf rewards
  of the batch's paths;
- ``policy/...``: what the loss reports (``loss``, ``pg_loss``, ``clip_frac_low``,
  ``clip_frac_high``, ``ratio_mean``, ``approx_kl``, ``kl_ref``, ``entropy`` and per-loss
  extras such as ATPO's ``turns``; docs/algorithms/losses.md "Loss metrics", eqs. 55, 56); ``policy/entropy``
  is the exact full-vocabulary token entropy of the action tokens from the training forward pass
  (docs/algorithms/index.md eq. 2);
- ``mismatch/max_abs``, ``mismatch/mean_abs``, ``mismatch/tokens``: the sampler's log-probs
  against the trainer's, before the update (docs/algorithms/training.md eq. 59);
- ``optim/grad_norm`` (before clipping), ``optim/lr``, ``optim/updates``,
  ``optim/skipped_updates`` (non-finite gradients);
- ``tokens/trained``, ``tokens/action``, ``batch/sequences``; ``batch/tokens_forwarded`` (the
  update passes' tokens: padding included, each shared prefix once under ``packing="tree"``)
  and, under tree packing, ``batch/tree_batched_passes``, ``batch/tree_flex_passes`` and
  ``batch/tree_varlen_passes`` (the fractions of passes whose tree attention ran as one batched
  SDPA call, one FlexAttention call, or one varlen flash call a layer on a GPU, rather than per path);
- ``time/old_logprobs_s``, ``time/update_s``, ``time/sync_s``, ``time/step_s``;
- ``throughput/update_tokens_per_s`` and, from the caller's numbers,
  ``throughput/rollout_tokens_per_s``;
- from a rollout on an engine that keeps :class:`~agents.engines.base.BatchStats`, ``engine/busy_frac``,
  ``engine/mean_rows``, ``engine/busy_tokens_per_s`` and ``engine/prefill_frac`` (:meth:`~agents.engines.base.BatchStats.usage`).

The rollout side is the caller's: it passes its own numbers, for instance
:data:`ROLLOUT_TIME` (``time/rollout_s``), :data:`GENERATED_TOKENS` (``tokens/generated``) and
``reward/em``, and the trainer merges them into the same record.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from agents.rollout.diagnostics import GENERATED_TOKENS, ROLLOUT_TIME
from agents.training.reporting import Reporter, open_reporters

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

__all__ = [
    "FRACTION",
    "GENERATED_TOKENS",
    "METRIC_DISPLAY",
    "PLOT_PANELS",
    "ROLLOUT_TIME",
    "Display",
    "MetricsLog",
    "curves_figure",
    "draw_curve",
    "label_axis",
    "plot_curves",
    "read_jsonl",
    "save_figure",
]


#: The panels of :func:`plot_curves`: a title and the metrics drawn in it (named and with the
#: unit of :data:`METRIC_DISPLAY`). ``reward/mean`` is drawn with a ±``reward/std`` band.
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
    ("engine busy", ("engine/busy_frac",)),
)


class Display(NamedTuple):
    """How a metric is shown: its name in a legend, its unit (the y-axis label) and its range."""

    name: str
    unit: str
    bounds: tuple[float, float] | None = None  # the values it can take; None: not known


#: The range of a proportion.
FRACTION = (0.0, 1.0)

#: The legend name, unit and range of each metric of :data:`PLOT_PANELS`; the metrics of a panel
#: share its unit.
METRIC_DISPLAY: dict[str, Display] = {
    "reward/mean": Display("mean over leaves", "reward"),
    "reward/em": Display("exact match", "fraction of leaves", FRACTION),
    "policy/entropy": Display("token entropy", "nats per token"),
    "policy/clip_frac_low": Display("clipped (low side)", "fraction of tokens", FRACTION),
    "policy/clip_frac_high": Display("clipped (high side)", "fraction of tokens", FRACTION),
    "policy/approx_kl": Display("to the rollout policy (k3)", "nats"),
    "policy/kl_ref": Display("to the reference policy", "nats"),
    "mismatch/max_abs": Display("max over tokens", "|Δ log p| (nats)"),
    "mismatch/mean_abs": Display("mean over tokens", "|Δ log p| (nats)"),
    "optim/grad_norm": Display("before clipping", "L2 norm"),
    "time/rollout_s": Display("rollout", "seconds"),
    "time/old_logprobs_s": Display("old log-probs", "seconds"),
    "time/update_s": Display("update", "seconds"),
    "time/sync_s": Display("weight sync", "seconds"),
    "throughput/update_tokens_per_s": Display("update (all tokens)", "tokens/s"),
    "throughput/rollout_tokens_per_s": Display("rollout (generated)", "tokens/s"),
    "engine/busy_frac": Display("during the rollout", "fraction of the time", FRACTION),
}

_JSONL = "metrics.jsonl"


class MetricsLog:
    """Per-step metrics kept in memory and, with ``out_dir``, written as they come.

    Files under ``out_dir``: ``metrics.jsonl`` (one JSON object per step, ``{"step": n, ...}``),
    always, and what the reporters of ``report_to`` write (:mod:`agents.training.reporting`):
    TensorBoard event files under ``tensorboard/``, the W&B run's files under ``wandb/``.

    Args:
        out_dir: the run folder, or ``None`` to keep the history in memory only (no reporters).
        report_to: reporters besides the JSONL file: ``tensorboard``, ``wandb``, or ``none``.
        resume_step: continue a run from this step: records of later steps (written after the
            checkpoint being resumed) are dropped from the JSONL file and TensorBoard, and W&B
            continues the run's W&B run (it cannot drop steps). Without it, ``out_dir`` must not
            hold another run's metrics.
        run_dir: the run folder when ``out_dir`` is a folder inside it (``heldout/``): W&B then
            logs to the run's W&B run, each name after that folder's (``heldout/em``).
        wandb_project: the W&B project (``None``: ``$WANDB_PROJECT``, else ``agentenv``).
        wandb_config: attached to the W&B run when the run folder holds no ``config.json``.
    """

    def __init__(
        self,
        out_dir: str | Path | None = None,
        *,
        report_to: str | Sequence[str] = ("tensorboard",),
        resume_step: int | None = None,
        run_dir: str | Path | None = None,
        wandb_project: str | None = None,
        wandb_config: Mapping[str, Any] | None = None,
    ) -> None:
        self.out_dir = None if out_dir is None else Path(out_dir)
        self.history: list[dict[str, float]] = []
        self.reporters: list[Reporter] = []
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
        self.reporters = open_reporters(
            report_to,
            self.out_dir,
            resume_step=resume_step,
            run_dir=None if run_dir is None else Path(run_dir),
            wandb_project=wandb_project,
            wandb_config=wandb_config,
        )

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
        for reporter in self.reporters:
            reporter.log(step, metrics)

    def close(self) -> None:
        """Close the reporters (the JSONL file is closed after every record)."""
        reporters, self.reporters = self.reporters, []
        for reporter in reporters:
            reporter.close()


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


def label_axis(axis: Axes, title: str, unit: str, *, steps: bool = True) -> None:
    """Title a panel and label its y-axis with ``unit``; with ``steps``, the x-axis is the training step.

    The step axis gets integer ticks only, at least one even for a single step.
    """
    from matplotlib.ticker import MaxNLocator

    axis.set_title(title)
    axis.set_ylabel(unit)
    if steps:
        axis.set_xlabel("training step")
        axis.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
    axis.grid(alpha=0.3)


def draw_curve(
    axis: Axes,
    history: Sequence[Mapping[str, Any]],
    name: str,
    *,
    label: str | None = None,
    band_label: str | None = "± std (within min–max)",
    color: str | None = None,
    band: bool = True,
) -> None:
    """Draw metric ``name`` of ``history`` against the step; ``reward/mean`` with its ±std band
    unless ``band`` is false (many runs on one axis).

    The line is labelled ``label`` (default: the metric's :data:`METRIC_DISPLAY` name). The band
    is clipped to each step's ``[reward/min, reward/max]`` where those are logged, since the mean
    ± std can reach past the rewards the batch had (the std of rewards of -1 and 1 is 1).
    """
    records = [record for record in history if name in record]
    steps = [record["step"] for record in records]
    values = [record[name] for record in records]
    (line,) = axis.plot(steps, values, marker="o", markersize=3, color=color, label=label or _display(name).name)
    if not band or name != "reward/mean" or not all("reward/std" in record for record in records):
        return
    low = [value - record["reward/std"] for value, record in zip(values, records)]
    high = [value + record["reward/std"] for value, record in zip(values, records)]
    if all("reward/min" in record and "reward/max" in record for record in records):
        low = [max(v, record["reward/min"]) for v, record in zip(low, records)]
        high = [min(v, record["reward/max"]) for v, record in zip(high, records)]
    band_color = line.get_color()
    if len(records) == 1:  # one step has no area to fill: the spread is an error bar
        spread = [[values[0] - low[0]], [high[0] - values[0]]]
        axis.errorbar(steps, values, yerr=spread, fmt="none", capsize=4, color=band_color, label=band_label)
    else:
        axis.fill_between(steps, low, high, alpha=0.2, linewidth=0, color=band_color, label=band_label)


def curves_figure(
    history: Sequence[Mapping[str, Any]],
    panels: Sequence[tuple[str, Sequence[str]]] = PLOT_PANELS,
    *,
    title: str | None = None,
) -> Figure:
    """The figure of :func:`plot_curves`: one panel per entry of ``panels`` that has data.

    Panels whose metrics never occur are left out; a panel of several metrics has a legend of
    their :data:`METRIC_DISPLAY` names, and a panel of proportions shows no value outside [0, 1].
    ``title`` (e.g. the run's algorithm, environment, model and folder) heads the figure.
    """
    from matplotlib.figure import Figure  # no pyplot: no global backend or figure state

    present = [
        (panel, [name for name in names if any(name in record for record in history)]) for panel, names in panels
    ]
    present = [(panel, names) for panel, names in present if names]
    if not present:
        raise ValueError("nothing to plot: no record holds any metric named in the panels")
    columns = min(3, len(present))
    rows = math.ceil(len(present) / columns)
    figure = Figure(figsize=(4.2 * columns, 3.0 * rows), layout="constrained")
    if title:
        figure.suptitle(title)
    axes = figure.subplots(rows, columns, squeeze=False).flatten()
    for axis, (panel, names) in zip(axes, present):
        for name in names:
            draw_curve(axis, history, name)
        label_axis(axis, panel, _display(names[0]).unit)
        bounds = _display(names[0]).bounds
        if bounds is not None:  # autoscaling pads past the range: clip fractions of 0 showed -0.04
            low, high = axis.get_ylim()
            pad = 0.02 * (high - low)
            axis.set_ylim(max(low, bounds[0] - pad), min(high, bounds[1] + pad))
        if len(names) > 1 or names == ["reward/mean"]:
            axis.legend(fontsize="x-small")
    for axis in axes[len(present) :]:
        axis.set_visible(False)
    return figure


def plot_curves(
    history: Sequence[Mapping[str, Any]],
    path: str | Path,
    panels: Sequence[tuple[str, Sequence[str]]] = PLOT_PANELS,
    *,
    title: str | None = None,
) -> Path:
    """Draw the metrics of ``history`` (records with a ``step``) against the step as a PNG.

    The figure is :func:`curves_figure`'s (``title`` heads it). Returns ``path``.
    """
    return save_figure(curves_figure(history, panels, title=title), path)


def save_figure(figure: Figure, path: str | Path) -> Path:
    """Write ``figure`` as a PNG at 100 dpi (its folder made if needed); returns ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    return path


def _display(name: str) -> Display:
    """A metric's :data:`METRIC_DISPLAY` entry; a metric without one is shown by its key, unit unknown."""
    return METRIC_DISPLAY.get(name, Display(name, "value"))
