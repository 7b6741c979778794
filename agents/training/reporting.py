"""Where training metrics go besides ``metrics.jsonl``: TensorBoard and Weights & Biases.

``report_to`` names the reporters (:data:`REPORTERS`, Hugging Face Transformers' spelling):
``tensorboard`` (event files under ``tensorboard/`` of the log's folder), ``wandb`` (one W&B run
per run folder, its files under ``wandb/`` there), several at once, or ``none`` for nothing
besides the JSONL file. A :class:`~agents.training.metrics.MetricsLog` opens them with
:func:`open_reporters` and passes every record to each.

W&B's own environment variables keep working: ``WANDB_MODE=offline`` (no network; ``wandb sync``
uploads the run later), ``WANDB_PROJECT``, ``WANDB_API_KEY``, ``WANDB_DIR`` (W&B's files go there
instead of the run folder's ``wandb/``), …; the run is named after the run folder and attached the run's configuration (the folder's ``config.json``). The W&B
run's id is kept in the run folder, so a resumed run continues the same W&B run. W&B cannot take
back logged steps as TensorBoard's ``purge_step`` does: a resumed run logs from the step after its
checkpoint on, so steps that the interrupted run logged past its checkpoint appear twice (W&B
draws them against ``step``, the training step, not its own counter).

Nothing here imports wandb or torch until a reporter is opened: the CLI's parser checks
``report_to`` with :func:`check_report_to`.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "REPORTERS",
    "WANDB_INSTALL",
    "Reporter",
    "TensorBoardReporter",
    "WandbReporter",
    "check_report_to",
    "import_wandb",
    "open_reporters",
]

#: The names ``report_to`` takes; ``none`` stands alone.
REPORTERS = ("tensorboard", "wandb", "none")
#: How to install the W&B client with this package.
WANDB_INSTALL = "pip install 'agentenv[wandb]'"
#: The W&B project when neither the caller nor ``$WANDB_PROJECT`` names one.
WANDB_PROJECT = "agentenv"
_TENSORBOARD = "tensorboard"
_WANDB = "wandb"  # W&B writes its files to RUN/wandb/ when given dir=RUN
_WANDB_ID = "run_id.txt"  # in RUN/wandb/: not "run-*", which `wandb sync` takes for a run's folder
_RUN_CONFIG = "config.json"  # agents.run.folder.CONFIG_FILE, the run's effective configuration


class Reporter(Protocol):
    """Receives every record of a :class:`~agents.training.metrics.MetricsLog`."""

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """Record the metrics of ``step``."""

    def close(self) -> None:
        """Write out what is pending and let go of the reporter's files and processes."""


def check_report_to(names: str | Sequence[str], source: str = "report_to") -> tuple[str, ...]:
    """``names`` as a tuple without repeats, each one of :data:`REPORTERS` and ``none`` alone.

    A string is one name. ``source`` names the setting in the error (``--report-to`` on the command line).
    """
    if not isinstance(names, (str, list, tuple)):
        raise ValueError(f"{source} takes reporter names ({', '.join(REPORTERS)}), got {names!r}")
    given = tuple(dict.fromkeys([names] if isinstance(names, str) else names))
    for name in given:
        if name not in REPORTERS:
            raise ValueError(f"{source} has no reporter {name!r}; choose from {', '.join(REPORTERS)} (several allowed)")
    if "none" in given and len(given) > 1:
        others = ", ".join(name for name in given if name != "none")
        raise ValueError(f"{source} 'none' means nothing besides metrics.jsonl, so it cannot go with {others}")
    return given


def import_wandb() -> Any:
    """The ``wandb`` module, or an ImportError saying how to install it."""
    try:
        import wandb
    except ImportError:
        raise ImportError(f"report_to 'wandb' needs the wandb package: {WANDB_INSTALL}") from None
    return wandb


def open_reporters(
    report_to: str | Sequence[str],
    folder: Path,
    *,
    resume_step: int | None = None,
    run_dir: Path | None = None,
    wandb_project: str | None = None,
    wandb_config: Mapping[str, Any] | None = None,
) -> list[Reporter]:
    """The reporters ``report_to`` names for the log in ``folder``.

    Args:
        report_to: Names of :data:`REPORTERS`.
        folder: The log's folder (TensorBoard writes to ``folder/tensorboard``).
        resume_step: Continuing a run from this step: TensorBoard hides the later steps, W&B
            continues the run folder's W&B run.
        run_dir: The run folder ``folder`` lies in (default ``folder``): its W&B run gets this
            log's metrics, their names after ``folder``'s path within it (``heldout/em``).
        wandb_project: See :class:`WandbReporter`.
        wandb_config: See :class:`WandbReporter`.
    """
    run_dir = folder if run_dir is None else run_dir
    within = folder.resolve().relative_to(run_dir.resolve()).as_posix()
    opened: list[Reporter] = []
    try:
        for name in check_report_to(report_to):
            if name == "tensorboard":
                opened.append(TensorBoardReporter(folder / _TENSORBOARD, resume_step=resume_step))
            elif name == "wandb":
                opened.append(
                    WandbReporter(
                        run_dir,
                        prefix="" if within == "." else within + "/",
                        resume=resume_step is not None,
                        project=wandb_project,
                        config=wandb_config,
                    )
                )
    except BaseException:
        for reporter in opened:
            reporter.close()
        raise
    return opened


class TensorBoardReporter:
    """Scalars to TensorBoard event files in ``folder``.

    ``resume_step``: steps after it, written by a run that went on past the checkpoint being
    resumed, are hidden from TensorBoard's view (``purge_step``).
    """

    def __init__(self, folder: Path, *, resume_step: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer: Any = SummaryWriter(str(folder), purge_step=None if resume_step is None else resume_step + 1)

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """One scalar per metric at ``step``, flushed."""
        for name, value in metrics.items():
            self._writer.add_scalar(name, float(value), step)
        self._writer.flush()

    def close(self) -> None:
        """Close the event file."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


@dataclass
class _SharedRun:
    run: Any
    users: int = 1


# The W&B run of each run folder open in this process, so that the trainer's log and the held-out
# one share one W&B run; the last reporter to close finishes it.
_RUNS: dict[Path, _SharedRun] = {}


class WandbReporter:
    """Metrics to the Weights & Biases run of a run folder, plotted against ``step``.

    One W&B run per run folder and process: reporters of the same folder share it, and the last
    one to close finishes it. Its id is kept in ``run_dir/wandb/run_id.txt``, and W&B writes its
    files (an offline run's too) under ``run_dir/wandb/``, so the run folder holds everything.

    Args:
        run_dir: The run folder; the W&B run is named after it.
        prefix: Put before each metric name (``heldout/``).
        resume: Continue the W&B run whose id the folder holds (``resume="allow"``) rather than
            start a new one.
        project: The W&B project; ``None``: ``$WANDB_PROJECT``, else ``agentenv``.
        config: Attached to the W&B run when the folder holds no ``config.json``, the effective
            configuration that :func:`agents.run.train.train` writes there (and W&B gets instead).
    """

    def __init__(
        self,
        run_dir: Path,
        *,
        prefix: str = "",
        resume: bool = False,
        project: str | None = None,
        config: Mapping[str, Any] | None = None,
    ) -> None:
        self.prefix = prefix
        self._key = run_dir.resolve()
        shared = _RUNS.get(self._key)
        if shared is None:
            shared = _RUNS[self._key] = _SharedRun(_start_run(self._key, resume, project, config))
        else:
            shared.users += 1
        self._shared: _SharedRun | None = shared

    @property
    def run(self) -> Any:
        """The ``wandb`` run (``None`` once closed)."""
        return None if self._shared is None else self._shared.run

    def log(self, step: int, metrics: Mapping[str, float]) -> None:
        """The metrics under their prefixed names, with ``step``."""
        if self._shared is None:
            raise ValueError("this WandbReporter is closed")
        self._shared.run.log({"step": step, **{self.prefix + name: float(value) for name, value in metrics.items()}})

    def close(self) -> None:
        """Let go of the run; the last reporter on it finishes it (which ends W&B's upload of it)."""
        shared, self._shared = self._shared, None
        if shared is None:
            return
        shared.users -= 1
        if shared.users == 0:
            del _RUNS[self._key]
            shared.run.finish()


def _start_run(run_dir: Path, resume: bool, project: str | None, config: Mapping[str, Any] | None) -> Any:
    """``wandb.init`` for ``run_dir``: its stored id when resuming, else a new one (stored)."""
    wandb = import_wandb()
    id_file = run_dir / _WANDB / _WANDB_ID
    run_id = id_file.read_text().strip() if resume and id_file.is_file() else secrets.token_hex(4)  # W&B's id length
    id_file.parent.mkdir(parents=True, exist_ok=True)
    id_file.write_text(run_id + "\n")
    saved = run_dir / _RUN_CONFIG
    if saved.is_file():
        config = json.loads(saved.read_text(encoding="utf-8"))
    run = wandb.init(
        project=project or os.environ.get("WANDB_PROJECT") or WANDB_PROJECT,
        name=run_dir.name,
        id=run_id,
        resume="allow",
        # The user's WANDB_DIR, else the run folder; read here, as wandb reads it once per process.
        dir=os.environ.get("WANDB_DIR") or run_dir,
        config=dict(config or {}),
        reinit="create_new",  # the process may hold other runs' W&B runs (two folders, or a caller's own)
    )
    # The training step as the x axis; W&B's own counter would run on past a resume's repeated steps.
    run.define_metric("step")
    run.define_metric("*", step_metric="step")
    return run
