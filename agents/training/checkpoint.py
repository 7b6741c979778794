"""Checkpoints of a training run: everything needed to continue it exactly where it stopped.

One checkpoint is a folder (``step_000003`` under the run's ``checkpoints/``) holding:

- ``model/``: the policy as a transformers checkpoint (``config.json``, ``model.safetensors``,
  the tokenizer when one is given), loadable by ``agents.models.load_model(path / "model")``;
  for a LoRA policy, the adapter instead (``adapter_config.json``, ``adapter_model.safetensors``,
  the format ``peft`` reads; its base model is the one named in ``adapter_config.json``);
- ``trainer_state.pt``: optimiser and learning-rate scheduler state and the Python, NumPy and
  torch random-number generator states (read back with ``torch.load(weights_only=True)``);
- ``trainer_state.json``: the format tag, the step, the caller's data position (an opaque
  JSON dict, e.g. the index of the next dataset row) and the trainer's configuration.

A trainer of N > 1 ranks (FSDP2) writes ``sharded/`` besides: model and optimiser state as
``torch.distributed.checkpoint`` shards (each rank writes its own, so the folder must be on a
file system every rank sees), while ``trainer_state.pt`` then holds no optimiser; ``model/`` is
the consolidated model all the same, written by rank 0. Either kind resumes at any number of
ranks: shards are resharded on load, and a single-process checkpoint is loaded in full and
sharded.

A checkpoint is written to a temporary folder (``.step_000003.tmp.RANDOM.PID@HOST``), every file
and folder of it is fsynced, and it is renamed into place (the parent folder fsynced after), so a
crash, even of the machine, never leaves half of one under the final name. The temporary folders
of writers that died are removed by the next save in the same folder (only those of dead processes
on this host) and when a run resumes (all of them: nothing else writes in a run's folder then); see
:func:`remove_stale_temporaries`.

:func:`load_checkpoint` first checks the folder cheaply (:func:`verify_checkpoint`: the JSON files
parse, the safetensors headers match the file sizes, the ``.pt`` archive is complete), and a
damaged file raises :class:`CorruptCheckpointError` naming the file and the previous intact
checkpoint; :func:`latest_valid_checkpoint` is the newest checkpoint that passes. Bytes overwritten
inside tensor data go unnoticed (there are no checksums).

:func:`prune_checkpoints` bounds a run's folder: it removes the checkpoints older than the newest
few intact ones (for the embedded 135M model each is 1.6 GB: 0.5 GB of weights, 1.1 GB of AdamW
state), never the newest intact one.
"""

from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import socket
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from peft import PeftModel
    from torch.nn.modules.module import _IncompatibleKeys
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "Checkpoint",
    "CorruptCheckpointError",
    "checkpoint_name",
    "get_rng_state",
    "latest_checkpoint",
    "latest_valid_checkpoint",
    "load_checkpoint",
    "prune_checkpoints",
    "remove_stale_temporaries",
    "save_checkpoint",
    "set_rng_state",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)

#: Written into every ``trainer_state.json``; :func:`load_checkpoint` refuses other formats.
FORMAT = "agents.Checkpoint/1"

_MODEL, _STATE_PT, _STATE_JSON, _SHARDED = "model", "trainer_state.pt", "trainer_state.json", "sharded"
_NAME = re.compile(r"step_(\d+)")
# A temporary folder: ".NAME.tmp.RANDOM.PID@HOST" (the writer's process, to tell whether it still runs),
# or, as older versions named them, ".step_N.RANDOM" and ".step_N.writing" (writer unknown).
_TEMPORARY = re.compile(r"\..+\.tmp\.[a-z0-9_]+\.(?P<pid>\d+)@(?P<host>.+)")
_UNOWNED_TEMPORARY = re.compile(r"\.step_\d+\.(writing|[a-z0-9_]{8})")
#: Names of the temporary folders this process is writing now (a dead process's pid may be this one's again).
_writing: set[str] = set()
_MAX_SAFETENSORS_HEADER = 100_000_000  # safetensors' own limit; a garbage length must not be read into memory


class CorruptCheckpointError(ValueError):
    """A file of a checkpoint folder cannot be read back: truncated, overwritten or missing.

    Attributes:
        file: The damaged file.
        reason: What is wrong with it.
    """

    def __init__(self, file: Path, reason: str, advice: str = "") -> None:
        self.file, self.reason = file, reason
        super().__init__(f"{file} is corrupt: {reason}" + (f"; {advice}" if advice else ""))


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` read besides the tensors it loaded in place."""

    path: Path
    step: int
    data_position: dict[str, Any]
    config: dict[str, Any]


def checkpoint_name(step: int) -> str:
    """The folder name of the checkpoint taken after ``step`` steps: ``step_000003``."""
    return f"step_{step:06d}"


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint folder under ``root`` with the highest step, or ``None`` if there is none."""
    found = _checkpoints(Path(root))
    return found[0][1] if found else None


def latest_valid_checkpoint(
    root: str | Path,
    *,
    older_than: str | Path | None = None,
    on_skip: Callable[[Path, CorruptCheckpointError], None] | None = None,
) -> Path | None:
    """The newest checkpoint folder under ``root`` that passes :func:`verify_checkpoint`, or ``None``.

    ``older_than``: only checkpoints of a lower step than this checkpoint folder's. ``on_skip`` is
    told of each newer checkpoint passed over and why. A checkpoint of another format is no damage
    to skip: its ``ValueError`` propagates.
    """
    limit = _step(Path(older_than)) if older_than is not None else None
    for step, path in _checkpoints(Path(root)):
        if limit is not None and step >= limit:
            continue
        try:
            _verify(path)
        except CorruptCheckpointError as error:
            if on_skip is not None:
                on_skip(path, error)
            continue
        return path
    return None


def verify_checkpoint(path: str | Path) -> None:
    """Check, without loading any tensor, that the checkpoint folder ``path`` can be read back.

    The JSON files (``trainer_state.json``, ``model/config.json``, the tokenizer's) must parse,
    every safetensors file must be as long as its header says, and ``trainer_state.pt`` must be a
    complete ``torch.save`` archive. Raises :class:`CorruptCheckpointError` naming the first
    damaged file and the previous intact checkpoint beside it; ``FileNotFoundError`` when
    ``path`` is no checkpoint folder; ``ValueError`` for a checkpoint of another format.
    """
    path = Path(path)
    try:
        _verify(path)
    except CorruptCheckpointError as error:
        raise _offering_previous(path, error) from None


def prune_checkpoints(root: str | Path, keep: int) -> list[Path]:
    """Remove the checkpoint folders under ``root`` older than its ``keep`` newest intact ones; returns those removed.

    Intact is :func:`verify_checkpoint`'s test, so a damaged checkpoint never counts towards ``keep``
    and the newest intact checkpoint always stays, whatever was damaged after it; a damaged one newer
    than the ``keep``-th intact one stays too (``--resume`` passes over it, and a continued run writes
    it again). Each folder is renamed to a temporary name before it is deleted, so a crash midway
    leaves no half-deleted checkpoint under a checkpoint's name (the next save removes the rest, see
    :func:`remove_stale_temporaries`).
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep must be an int >= 1 (the newest intact checkpoint always stays), got {keep!r}")
    intact = 0
    removed = []
    for _, path in _checkpoints(Path(root)):
        if intact < keep:
            try:
                _verify(path)
            except ValueError:  # damaged (CorruptCheckpointError), or of another format: not one to keep count of
                continue
            intact += 1
            continue
        doomed = path.parent / f".{path.name}.tmp.removed{_owner()}"
        shutil.rmtree(doomed, ignore_errors=True)
        os.rename(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
        removed.append(path)
    return removed


def remove_stale_temporaries(root: str | Path, *, all_writers_gone: bool = False) -> list[Path]:
    """Remove the temporary folders that interrupted saves left in ``root``; returns those removed.

    A folder named for a process of this host is removed when that process has ended. Folders
    whose writer cannot be checked (named for another host, or by an older version) are removed
    only with ``all_writers_gone``: the caller knows that no other process writes checkpoints into
    ``root`` (a run's start, before its trainer exists).
    """
    root = Path(root)
    if not root.is_dir():
        return []
    host = socket.gethostname()
    removed = []
    for folder in root.iterdir():
        owned = _TEMPORARY.fullmatch(folder.name)
        if owned is not None and owned["host"] == host:
            pid = int(owned["pid"])
            stale = not _is_running(pid) or (pid == os.getpid() and folder.name not in _writing)
        else:
            stale = all_writers_gone and (owned is not None or _UNOWNED_TEMPORARY.fullmatch(folder.name) is not None)
        if stale and folder.is_dir():
            shutil.rmtree(folder, ignore_errors=True)
            removed.append(folder)
    return removed


def save_checkpoint(
    path: str | Path,
    *,
    model: PreTrainedModel | PeftModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    step: int,
    data_position: dict[str, Any] | None = None,
    config: dict[str, Any] | None = None,
    tokenizer: PreTrainedTokenizerBase | None = None,
    sharded: bool = False,
) -> Path:
    """Write a checkpoint folder at ``path`` (replacing one already there) and return it.

    The folder appears whole or not at all (see the module docstring); first, the temporary folders
    that dead writers left beside it are removed (:func:`remove_stale_temporaries`).
    ``sharded``: the model is sharded with FSDP2 over the default process group; every rank calls
    this with the same ``path`` (see the module docstring).
    """
    path = Path(path)
    state: dict[str, Any] = {
        "format": FORMAT,
        "step": int(step),
        "data_position": data_position or {},
        "config": config or {},
    }
    try:
        state_text = json.dumps(state, indent=2)
    except TypeError as error:
        raise ValueError(
            f"data_position and config must be JSON-serialisable (str, numbers, bool, None, lists, dicts): {error}"
        ) from None
    if sharded:
        return _save_sharded(path, model, optimizer, scheduler, state, tokenizer)
    path.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale(path.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp.", suffix=_owner(), dir=path.parent))
    _writing.add(tmp.name)
    try:
        model.save_pretrained(str(tmp / _MODEL))  # safetensors; a PeftModel writes only its adapter (it takes a str)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / _MODEL)
        torch.save(
            {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": get_rng_state()},
            tmp / _STATE_PT,
        )
        (tmp / _STATE_JSON).write_text(state_text + "\n")
        _publish(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        _writing.discard(tmp.name)
    return path


def load_checkpoint(
    path: str | Path,
    *,
    model: PreTrainedModel | PeftModel,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    restore_rng: bool = True,
) -> Checkpoint:
    """Load a checkpoint's weights into ``model`` (and state into ``optimizer``, ``scheduler``).

    ``model`` must have the architecture the checkpoint was taken from (a PeftModel for a LoRA
    checkpoint). With ``restore_rng`` the global random generators continue where they were.
    A damaged file raises :class:`CorruptCheckpointError` before anything is loaded (the files'
    checks of :func:`verify_checkpoint`, then ``torch.load`` of ``trainer_state.pt``).
    """
    path = Path(path)
    verify_checkpoint(path)
    state = json.loads((path / _STATE_JSON).read_text())
    try:
        tensors = torch.load(path / _STATE_PT, weights_only=True)
    except Exception as error:  # damaged bytes fail in many ways: EOFError, UnicodeDecodeError, RuntimeError, ...
        # verify_checkpoint saw a complete archive, so its contents are damaged.
        corrupt = CorruptCheckpointError(path / _STATE_PT, f"torch.load failed ({error!r})")
        raise _offering_previous(path, corrupt) from error
    if (path / _SHARDED).is_dir():
        _load_shards(path / _SHARDED, model, optimizer)
    elif _is_sharded(model):
        _load_full_into_shards(path / _MODEL, model, optimizer, tensors["optimizer"])
    else:
        _load_weights(model, path / _MODEL)
        if optimizer is not None:
            optimizer.load_state_dict(tensors["optimizer"])
    if scheduler is not None:
        scheduler.load_state_dict(tensors["scheduler"])
    if restore_rng:
        set_rng_state(tensors["rng"])
    return Checkpoint(path, int(state["step"]), state["data_position"], state["config"])


def get_rng_state() -> dict[str, Any]:
    """The states of Python's, NumPy's and torch's global generators (CPU and every CUDA device)."""
    numpy_state = np.random.get_state(legacy=True)
    # The global RandomState is an MT19937, whose legacy state is always the 5-tuple (a dict only for
    # other bit generators); numpy's stubs type the result as either.
    assert isinstance(numpy_state, tuple)
    name, keys, position, has_gauss, cached_gaussian = numpy_state
    return {
        "python": random.getstate(),
        # As a tensor, so that torch.load(weights_only=True) reads it back.
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(keys.astype(np.int64)),
            "position": int(position),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore the generators from :func:`get_rng_state`'s output."""
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    numpy = state["numpy"]
    np.random.set_state(
        (
            numpy["name"],
            numpy["keys"].numpy().astype(np.uint32),
            numpy["position"],
            numpy["has_gauss"],
            numpy["cached_gaussian"],
        )
    )
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _checkpoints(root: Path) -> list[tuple[int, Path]]:
    """The checkpoint folders under ``root`` with their steps, the newest first."""
    if not root.is_dir():
        return []
    found = [
        (int(match.group(1)), path)
        for path in root.iterdir()
        if (match := _NAME.fullmatch(path.name)) and (path / _STATE_JSON).is_file()
    ]
    return sorted(found, reverse=True)


def _step(path: Path) -> int:
    match = _NAME.fullmatch(path.name)
    if match is None:
        raise ValueError(f"{path} is not named for a step like {checkpoint_name(3)}, so no checkpoint precedes it")
    return int(match.group(1))


def _offering_previous(path: Path, error: CorruptCheckpointError) -> CorruptCheckpointError:
    """``error`` with the way out: the newest intact checkpoint before ``path``, if there is one."""
    previous = latest_valid_checkpoint(path.parent, older_than=path) if _NAME.fullmatch(path.name) else None
    if previous is not None:
        advice = f"load the previous checkpoint, {previous}, instead (agents train --resume falls back to it itself)"
    else:
        advice = f"no earlier checkpoint in {path.parent} is intact, so the run has to start again"
    return CorruptCheckpointError(error.file, error.reason, advice)


def _verify(path: Path) -> None:
    """:func:`verify_checkpoint` without the advice (which itself verifies the earlier checkpoints)."""
    state_json = path / _STATE_JSON
    if not state_json.is_file():
        raise FileNotFoundError(
            f"{path} is not a checkpoint folder (no {_STATE_JSON}); "
            f"give a folder such as runs/NAME/checkpoints/{checkpoint_name(1)}"
        )
    state = _read_json(state_json)
    if "format" not in state:
        raise CorruptCheckpointError(state_json, "it has no 'format' entry")
    if state["format"] != FORMAT:
        raise ValueError(f"{path} holds a checkpoint of format {state['format']!r}, expected {FORMAT!r}")
    for key, kind in (("step", int), ("data_position", dict), ("config", dict)):
        if not isinstance(state.get(key), kind):
            raise CorruptCheckpointError(state_json, f"its {key!r} is {state.get(key)!r}, not a {kind.__name__}")
    state_pt = path / _STATE_PT
    if not state_pt.is_file():
        raise CorruptCheckpointError(state_pt, "the file is missing")
    try:
        with zipfile.ZipFile(state_pt) as archive:  # reads the archive's directory, at its end
            for member in archive.infolist():
                archive.open(member).close()  # reads and checks the member's own header, not its data
    except zipfile.BadZipFile as error:
        raise CorruptCheckpointError(state_pt, f"it is not an intact torch.save archive ({error})") from None
    model = path / _MODEL
    if (model / "adapter_config.json").is_file():
        required = [model / "adapter_model.safetensors"]
    else:
        required = [model / "config.json"] + ([] if any(model.glob("*.safetensors")) else [model / "model.safetensors"])
    for file in required:
        if not file.is_file():
            raise CorruptCheckpointError(file, "the file is missing")
    for file in sorted(model.glob("*.json")):
        _read_json(file)
    for file in sorted(model.glob("*.safetensors")):
        _check_safetensors(file)
    if (path / _SHARDED).is_dir() and not (path / _SHARDED / ".metadata").is_file():
        raise CorruptCheckpointError(path / _SHARDED / ".metadata", "the file is missing")


def _read_json(file: Path) -> dict[str, Any]:
    try:
        value = json.loads(file.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CorruptCheckpointError(file, f"it is not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise CorruptCheckpointError(file, f"it holds a {type(value).__name__}, not a JSON object")
    return value


def _check_safetensors(file: Path) -> None:
    """The file is a header length (8 bytes), a JSON header and exactly the data its offsets cover."""
    size = file.stat().st_size
    with file.open("rb") as stream:
        head = stream.read(8)
        length = int.from_bytes(head, "little")
        if len(head) < 8 or length > min(size - 8, _MAX_SAFETENSORS_HEADER):
            raise CorruptCheckpointError(file, f"its {size} bytes cannot hold the header it announces (truncated?)")
        try:
            header = json.loads(stream.read(length))
            end = max((entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"), default=0)
        except (json.JSONDecodeError, UnicodeDecodeError, TypeError, KeyError, IndexError, AttributeError):
            raise CorruptCheckpointError(file, "its safetensors header is not readable (overwritten?)") from None
    if 8 + length + end != size:
        raise CorruptCheckpointError(
            file, f"it has {size} bytes but its header describes {8 + length + end} (truncated?)"
        )


def _owner() -> str:
    """The suffix that names this process in a temporary folder's name."""
    return f".{os.getpid()}@{socket.gethostname()}"


def _is_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # signal 0 delivers nothing: it only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # it runs, as another user
        pass
    return True


def _remove_stale(root: Path) -> None:
    for folder in remove_stale_temporaries(root):
        logger.warning("removed %s, the temporary folder of a checkpoint save that was interrupted", folder)


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _publish(tmp: Path, path: Path) -> None:
    """Rename the written folder ``tmp`` to ``path`` once all of it is on disk, replacing a folder there.

    Without the fsyncs a crash of the machine could leave the renamed folder with empty files (the
    rename reaching the disk before the data).
    """
    for folder, _, files in os.walk(tmp):
        for name in files:
            _fsync(Path(folder) / name)
        _fsync(Path(folder))  # its entries
    old = None
    if path.exists():
        # Moved aside rather than deleted in place, so a crash leaves no half-deleted checkpoint under its name.
        old = path.parent / f".{path.name}.tmp.replaced{_owner()}"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync(path.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _load_weights(model: PreTrainedModel | PeftModel, folder: Path) -> None:
    """Copy the safetensors weights of ``folder`` into ``model`` in place."""
    from safetensors.torch import load_file

    if (folder / "adapter_config.json").is_file():
        from peft import PeftModel, set_peft_model_state_dict

        if not isinstance(model, PeftModel):
            raise ValueError(f"{folder} holds a LoRA adapter; load it into a LoRA policy (lora_rank > 0)")
        # peft annotates its result as ``namedtuple``; it is what torch's load_state_dict returns
        result: _IncompatibleKeys = set_peft_model_state_dict(model, load_file(folder / "adapter_model.safetensors"))
        if result.unexpected_keys:
            raise ValueError(f"the adapter in {folder} does not fit this model: {result.unexpected_keys[:5]}")
        return
    weights: dict[str, torch.Tensor] = {}
    for file in sorted(folder.glob("*.safetensors")):  # verify_checkpoint saw at least one
        weights.update(load_file(file))
    result = model.load_state_dict(weights, strict=False)
    if result.unexpected_keys:
        raise ValueError(
            f"the checkpoint in {folder} has weights this model lacks: {result.unexpected_keys[:5]} "
            "(a different architecture?)"
        )
    # save_pretrained stores tied weights (lm_head tied to the embeddings) once; they need no file.
    own = model.state_dict()
    loaded = {own[name].data_ptr() for name in weights}
    missing = [name for name in result.missing_keys if own[name].data_ptr() not in loaded]
    if missing:
        raise ValueError(f"the checkpoint in {folder} lacks weights of this model: {missing[:5]}")


def _is_sharded(model: torch.nn.Module) -> bool:
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def _save_sharded(
    path: Path,
    model: PreTrainedModel | PeftModel,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase | None,
) -> Path:
    """save_checkpoint of an FSDP2-sharded model; every rank of the default group calls it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict

    rank = dist.get_rank()
    # Rank 0 alone names (for its process), cleans, creates and renames the folder; the others write into it.
    shared = [path.parent / f".{path.name}.tmp.sharded{_owner()}"]
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(path.parent)
        shutil.rmtree(shared[0], ignore_errors=True)  # a failed save of this process
        shared[0].mkdir()
        _writing.add(shared[0].name)
    dist.broadcast_object_list(shared, src=0)  # rank 0's name, once it made the folder
    tmp = shared[0]
    try:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:  # the consolidated model, as one process saves it
            # Gathered shards are copies: a tied lm_head would be written twice (113 MB for SmolLM2).
            for tied in getattr(model, "all_tied_weights_keys", None) or {}:
                full.pop(tied, None)
            model.save_pretrained(str(tmp / _MODEL), state_dict=full)
            if tokenizer is not None:
                tokenizer.save_pretrained(tmp / _MODEL)
        del full
        model_state, optimizer_state = get_state_dict(model, optimizer)
        dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=tmp / _SHARDED)
        if rank == 0:
            torch.save({"scheduler": scheduler.state_dict(), "rng": get_rng_state()}, tmp / _STATE_PT)
            state = {**state, "ranks": dist.get_world_size()}
            (tmp / _STATE_JSON).write_text(json.dumps(state, indent=2) + "\n")
            _publish(tmp, path)  # other hosts' shards: dcp.save fsynced them where they were written
        dist.barrier()
    finally:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            _writing.discard(tmp.name)
    return path


def _load_shards(folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Model (and optimiser) state from ``torch.distributed.checkpoint`` shards, resharded to this group.

    Without a process group (one process) the shards are read whole into the plain model.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_state_dict,
        set_model_state_dict,
        set_state_dict,
    )

    alone = not (dist.is_available() and dist.is_initialized())

    if optimizer is None:
        state = {"model": get_model_state_dict(model)}
        dcp.load(state, checkpoint_id=folder, no_dist=alone)
        set_model_state_dict(model, state["model"])
        return
    model_state, optimizer_state = get_state_dict(model, optimizer)
    both: dict[str, Any] = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(both, checkpoint_id=folder, no_dist=alone)
    set_state_dict(model, optimizer, model_state_dict=both["model"], optim_state_dict=both["optimizer"])


def _load_full_into_shards(
    folder: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, optimizer_state: dict[str, Any]
) -> None:
    """A single-process checkpoint into an FSDP2-sharded model: full tensors, each rank keeping its shard."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    options = StateDictOptions(full_state_dict=True, strict=False)
    if (folder / "adapter_config.json").is_file():
        # peft saves adapter weights without the adapter's name ("lora_A.weight"); the model has "lora_A.default.weight".
        weights = {
            re.sub(r"(\.lora_[A-Za-z_]+)(\.weight|\.bias)?$", r"\1.default\2", name): tensor
            for name, tensor in load_file(folder / "adapter_model.safetensors").items()
        }
    else:
        weights = {}
        for file in sorted(folder.glob("*.safetensors")):  # verify_checkpoint saw at least one
            weights.update(load_file(file))
        # named_parameters names a tied parameter once (lm_head tied to the embeddings: not at all).
        missing = [name for name, _ in model.named_parameters() if name not in weights]
        if missing:
            raise ValueError(f"the checkpoint in {folder} lacks weights of this model: {missing[:5]}")
    own = {name for name, _ in model.named_parameters()} | {name for name, _ in model.named_buffers()}
    unexpected = sorted(set(weights) - own)
    if unexpected:
        raise ValueError(f"the checkpoint in {folder} has weights this model lacks: {unexpected[:5]}")
    set_model_state_dict(model, dict(weights), options=options)
    if optimizer is None:
        return
    # The optimiser's parameters are the model's trainable ones in order (as the Trainer builds it):
    # its index-keyed state becomes the name-keyed full state that torch.distributed reshards.
    names = [name for name, p in model.named_parameters() if p.requires_grad]
    full: dict[str, Any] = {
        "state": {names[index]: value for index, value in optimizer_state["state"].items()},
        "param_groups": [
            {**group, "params": [names[index] for index in group["params"]]}
            for group in optimizer_state["param_groups"]
        ],
    }
    set_optimizer_state_dict(model, optimizer, full, options=StateDictOptions(full_state_dict=True))
