"""Trainer ranks: the policy sharded over a ``torch.distributed`` group with FSDP2, and what the ranks share.

With N ranks (:class:`agents.training.trainer.Trainer` with ``distributed=True``) every rank gets
the whole batch and runs its share of the micro-batches; gradients are summed, so every update
is the one process's:

- :func:`shard` shards the policy (and a reference copy) layer by layer under a
  :class:`FSDPRoot`, inside whose forward every pass of the trainer runs;
- :func:`rank_passes`: rank r of N runs micro-batches r, r + N, …, padded with passes that
  contribute nothing so that every rank runs as many (FSDP's collectives pair up across ranks);
- :func:`sum_over_ranks` adds up what each rank counted; :func:`gathered_state_dict` brings the
  full weights to rank 0; :func:`place_in_group` is a trainer's rank and world size.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import torch
from torch import distributed as dist
from transformers.modeling_layers import GradientCheckpointingLayer

__all__ = ["FSDPRoot", "gathered_state_dict", "place_in_group", "rank_passes", "shard", "sum_over_ranks"]

Pass = TypeVar("Pass")


class FSDPRoot(torch.nn.Module):
    """The FSDP2 root around a sharded model: ``FSDPRoot(model)(run, *args)`` is ``run(model, *args)``.

    FSDP2 gathers the root's parameters (embeddings, final norm, output layer) in the root's
    forward pre-hook and reduces their gradients from hooks it sets there; a pass that calls the
    decoder and the head separately (the chunked head of :mod:`agents.training.forward`) would
    bypass both. Running every pass as this module's forward keeps them, whatever the pass calls inside.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, run: Any, *args: Any) -> Any:
        return run(self.model, *args)


def shard(models: Sequence[torch.nn.Module], device: torch.device, compute_dtype: torch.dtype) -> dict[int, FSDPRoot]:
    """Shard ``models`` (the policy, a reference copy) over the default group with FSDP2: each decoder
    layer, then the rest under an :class:`FSDPRoot`; returns the roots by ``id`` of the model they hold.

    Gradients are summed over the ranks, not averaged: each rank's micro-batches carry their
    share of the whole mini-batch already.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # Every rank starts from rank 0's weights: a random initialisation (LoRA's A, a model
    # built from a config) would otherwise differ between the ranks, and shard into a mix.
    with torch.no_grad():
        for tensor in [tensor for model in models for tensor in (*model.parameters(), *model.buffers())]:
            dist.broadcast(tensor.data, src=0)
    dtypes = {p.dtype for p in models[0].parameters()}
    if len(dtypes) > 1:
        raise ValueError(
            f"trainer ranks > 1 shard the policy with FSDP2, which needs one parameter dtype, but it has "
            f"{', '.join(sorted(map(str, dtypes)))} (LoRA over a bfloat16 base?); set "
            "TrainerConfig.base_dtype='float32' or use one trainer rank"
        )
    # An explicit mesh on the model's device: without one FSDP moves CPU models to CUDA where there is a GPU.
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    bf16 = device.type == "cuda" and compute_dtype == torch.bfloat16
    # float32 throughout otherwise (the default policy); bfloat16 compute on a GPU as one process's autocast.
    policy = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    roots = {}
    for model in models:
        root = FSDPRoot(model)
        for module in [*_decoder_layers(model), root]:
            fully_shard(module, mesh=mesh, mp_policy=policy)
            module.set_gradient_divide_factor(1.0)  # type: ignore[operator]  # an FSDPModule now
            module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]  # plain SUM (gloo has no PREMUL_SUM)
        roots[id(model)] = root
    return roots


def rank_passes(items: Sequence[Pass], filler: Pass, rank: int, world_size: int) -> list[tuple[Pass, bool]]:
    """Rank ``rank``'s passes over ``items``: ``(item, real)``.

    Items r, r + N, r + 2N, … of N ranks (every item with one), then as many passes on ``filler``
    (``real`` False: it contributes nothing) as make every rank run the same number of passes:
    FSDP's all-gathers and reduce-scatters run in each pass and must pair up across the ranks.
    """
    mine = items[rank::world_size]
    count = -(-len(items) // world_size)
    return [(item, True) for item in mine] + [(filler, False)] * (count - len(mine))


def sum_over_ranks(values: Mapping[str, float]) -> dict[str, float]:
    """Each name's values summed over the ranks (in rank order, so every rank gets the same floats)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(values))
    total: dict[str, float] = defaultdict(float)
    for part in gathered:
        for name, value in part.items():
            total[name] += value
    return dict(total)


def gathered_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The sharded ``model``'s full state dict on rank 0's CPU (every rank must call it; the others get ``{}``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 only
    gathered = get_model_state_dict(model, options=options)
    if dist.get_rank() != 0:
        return {}
    return {name: value for name, value in gathered.items() if isinstance(value, torch.Tensor)}


def place_in_group(distributed: bool) -> tuple[int, int]:
    """``(rank, world size)`` of a trainer: 0 of 1 for the single process, else the initialised default group's."""
    if not distributed:
        return 0, 1
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "Trainer(distributed=True) is one rank of a torch.distributed group: call "
            "torch.distributed.init_process_group first (agents.run.cluster.trainer_ranks.TrainerGroup does), "
            "or leave distributed=False for the single process"
        )
    return dist.get_rank(), dist.get_world_size()


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers FSDP shards one by one: transformers' checkpointable layers, else ``model.layers``."""
    layers: list[torch.nn.Module] = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if layers:
        return layers
    for module in model.modules():
        found = getattr(module, "layers", None)
        if isinstance(found, torch.nn.ModuleList):
            return list(found)
    return []
