"""A run's folder: starting a new run in it, resuming the run it holds, and the configuration saved there.

:func:`prepare_run_folder` checks a folder before a run writes to it: a new run never overwrites
one that trained (what a run that stopped before its first step left is replaced); a resume needs
the run's own configuration (only :data:`~agents.run.config.RESUMABLE` values may change) and an
intact checkpoint, skipping damaged ones for the newest intact one before them.
:func:`resume_trainer` loads that checkpoint, going back further when loading finds damage the
checks could not see.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agents.run.config import RESUMABLE, TrainConfig
from agents.training.checkpoint import (
    CorruptCheckpointError,
    latest_checkpoint,
    latest_valid_checkpoint,
    remove_stale_temporaries,
)

if TYPE_CHECKING:
    from agents.run.backends import TrainerBackend

__all__ = [
    "CONFIG_FILE",
    "PLACEMENT_FILE",
    "prepare_run_folder",
    "require_the_runs_algorithm",
    "resume_trainer",
    "saved_config",
]

#: The effective configuration in the run folder.
CONFIG_FILE = "config.json"
#: Where a run on Ray put each trainer rank and rollout worker (node id, address, pid), written at its start.
PLACEMENT_FILE = "placement.json"


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


def require_the_runs_algorithm(out: Path, algo: str) -> None:
    """Refuse to resume ``out`` with another learner (before building anything: the saved strategy,
    credit and loss sections are its own learner's, and another learner's would reject them)."""
    if not (out / CONFIG_FILE).is_file():
        return  # prepare_run_folder says that there is no run to resume
    saved = saved_config(out).get("algo")
    if saved != algo:
        raise ValueError(
            f"--resume continues the run in {out}, trained with algo {saved!r}, but this run asks for {algo!r}; "
            f"the algorithm differs, and a checkpoint continues only its own: resume with --algo {saved} "
            "(or without --algo), or train the other algorithm in a new run folder (another --out)"
        )


#: What a run writes at the top of its folder besides ``checkpoints/``.
_RUN_FILES = (CONFIG_FILE, "metrics.jsonl", "tensorboard", "wandb", "heldout", "curves.png", "heldout.png")


def prepare_run_folder(out: Path, effective: TrainConfig, resume: bool, log: Callable[[str], None]) -> Path | None:
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


def resume_trainer(
    trainer: TrainerBackend, checkpoint: Path, log: Callable[[str], None]
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
