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

A checkpoint is written to a temporary folder and renamed into place, so a crash never leaves
half of one under the final name.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import tempfile
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
    "checkpoint_name",
    "get_rng_state",
    "latest_checkpoint",
    "load_checkpoint",
    "save_checkpoint",
    "set_rng_state",
]

#: Written into every ``trainer_state.json``; :func:`load_checkpoint` refuses other formats.
FORMAT = "agents.Checkpoint/1"

_MODEL, _STATE_PT, _STATE_JSON, _SHARDED = "model", "trainer_state.pt", "trainer_state.json", "sharded"
_NAME = re.compile(r"step_(\d+)")


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
    root = Path(root)
    if not root.is_dir():
        return None
    found = [
        (int(match.group(1)), path)
        for path in root.iterdir()
        if (match := _NAME.fullmatch(path.name)) and (path / _STATE_JSON).is_file()
    ]
    return max(found)[1] if found else None


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
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        model.save_pretrained(str(tmp / _MODEL))  # safetensors; a PeftModel writes only its adapter (it takes a str)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp / _MODEL)
        torch.save(
            {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "rng": get_rng_state()},
            tmp / _STATE_PT,
        )
        (tmp / _STATE_JSON).write_text(state_text + "\n")
        if path.exists():
            shutil.rmtree(path)
        os.rename(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
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
    """
    path = Path(path)
    state_json = path / _STATE_JSON
    if not state_json.is_file():
        raise FileNotFoundError(
            f"{path} is not a checkpoint folder (no {_STATE_JSON}); "
            f"give a folder such as runs/NAME/checkpoints/{checkpoint_name(1)}"
        )
    state = json.loads(state_json.read_text())
    if state.get("format") != FORMAT:
        raise ValueError(f"{path} holds a checkpoint of format {state.get('format')!r}, expected {FORMAT!r}")
    tensors = torch.load(path / _STATE_PT, weights_only=True)
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
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {folder}")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
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
    tmp = path.parent / f".{path.name}.writing"  # one name every rank knows
    if rank == 0:
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    dist.barrier()
    try:
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:  # the consolidated model, as one process saves it
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
            if path.exists():
                shutil.rmtree(path)
            os.rename(tmp, path)
        dist.barrier()
    finally:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
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
        for file in sorted(folder.glob("*.safetensors")):
            weights.update(load_file(file))
        if not weights:
            raise FileNotFoundError(f"no *.safetensors weights in {folder}")
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
