"""Weight sync through Ray's object store: the portable path from trainer ranks to every engine.

The trainer's full state dict is cut into buckets of about ``bucket_bytes`` (each a dict of CPU
tensors, tied tensors once), each bucket ``ray.put`` once; every rollout worker fetches the same
objects (Ray moves them between nodes once per node and shares them in memory between the
processes of one node) and loads them into its engine bucket by bucket, so no process holds a
second full copy. The GPU path, vLLM's own weight transfer (NCCL between GPUs, CUDA IPC when
colocated), goes through :meth:`agents.engines.vllm.VLLMEngine.update_weights`.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

__all__ = ["BucketReceiver", "SyncReport", "buckets", "put_buckets", "weights_digest"]


@dataclass(frozen=True)
class SyncReport:
    """What one sync moved: bytes, buckets, and seconds to put them and to load them everywhere."""

    bytes: int
    buckets: int
    put_s: float
    load_s: float

    def metrics(self) -> dict[str, float]:
        """The report as ``sync/*`` metrics of the step."""
        return {
            "sync/bytes": float(self.bytes),
            "sync/buckets": float(self.buckets),
            "sync/put_s": self.put_s,
            "sync/load_s": self.load_s,
        }


@runtime_checkable
class BucketReceiver(Protocol):
    """What takes the weights as object-store buckets rather than state dicts: the rollout workers
    (:class:`agents.run.cluster.rollout_workers.RolloutPool`), each fetching them itself.
    :class:`agents.run.cluster.trainer_ranks.TrainerGroup` hands any other engine the buckets one by one
    through ``update_weights``."""

    async def load_buckets(self, refs: list[Any], size: int, put_s: float = 0.0) -> SyncReport:
        """Load the buckets ``refs`` (``size`` bytes, put in ``put_s`` seconds) everywhere; what the sync moved."""
        ...


def buckets(state_dict: Mapping[str, torch.Tensor], bucket_bytes: int) -> Iterator[dict[str, torch.Tensor]]:
    """``state_dict`` as CPU tensors in order, in dicts of about ``bucket_bytes`` (a larger tensor alone).

    A tensor sharing the storage of one before it (a tied ``lm_head.weight``) is left out: the
    engine's model ties it again when it loads the first.
    """
    seen: set[tuple[int, tuple[int, ...]]] = set()
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in state_dict.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        tensor = tensor.detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = {}, 0
        bucket[name] = tensor
        size += nbytes
    if bucket:
        yield bucket


def put_buckets(state_dict: Mapping[str, torch.Tensor], bucket_bytes: int) -> tuple[list[Any], int]:
    """Each bucket of ``state_dict`` in Ray's object store; returns the object refs and the bytes put."""
    import ray

    refs, total = [], 0
    for bucket in buckets(state_dict, bucket_bytes):
        total += sum(t.numel() * t.element_size() for t in bucket.values())
        refs.append(ray.put(bucket))
    return refs, total


def weights_digest(state_dict: Mapping[str, torch.Tensor], names: set[str] | None = None) -> str:
    """A SHA-256 over the names, dtypes, shapes and bytes of ``state_dict``'s tensors, in sorted order.

    Two processes holding the same weights give the same digest (``names`` restricts it to
    those entries, e.g. the ones a sync sends).
    """
    import torch  # here: a worker whose engine needs no torch (a scripted one) never loads it

    digest = hashlib.sha256()
    for name in sorted(state_dict):
        if names is not None and name not in names:
            continue
        tensor = state_dict[name].detach().to("cpu").contiguous()
        digest.update(f"{name}:{tensor.dtype}:{tuple(tensor.shape)}".encode())
        digest.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return digest.hexdigest()
