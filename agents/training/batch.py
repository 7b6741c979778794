"""Training paths as tensors: the rollout side's lists of ids and advantages, padded for a forward pass.

:func:`collate` right-pads :class:`~agents.rollout.tree.TrainingPath` lists into a :class:`PathBatch`
of ``[batch, tokens]`` tensors; this is where the rollout's plain lists become torch tensors.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from agents.rollout.tree import TrainingPath

__all__ = ["PathBatch", "collate"]


@dataclass
class PathBatch:
    """Training paths right-padded into ``[batch, tokens]`` tensors, all aligned with ``ids``.

    ``sampler_logprobs[b, t]`` is the sampler's log-prob of token ``ids[b, t]`` given ``ids[b, :t]``;
    a trainer computing the same from logits shifts by one (logits at ``t-1`` score token ``t``).

    Attributes:
        ids: token ids (int64), ``pad_id`` after each path's end.
        attention_mask: 1 on real tokens, 0 on padding (int64).
        mask: 1.0 on action tokens, 0.0 elsewhere (float32); the loss mask.
        advantages: per-token advantages, 0 off the mask (float32).
        sampler_logprobs: the sampler's log-probs, 0.0 off the mask (float32; never NaN, so that
            ``mask * x`` stays finite).
        turn_ids: the node each token belongs to, -1 on padding (int64).
        weights: de-duplication weights of shared turns, 0 off the mask (float32).
        rewards: each path's reward, shape ``[batch]`` (float32).
    """

    ids: torch.Tensor
    attention_mask: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    sampler_logprobs: torch.Tensor
    turn_ids: torch.Tensor
    weights: torch.Tensor
    rewards: torch.Tensor

    def to(self, device: torch.device | str) -> PathBatch:
        """The same batch with every tensor on ``device``."""
        return PathBatch(**{name: getattr(self, name).to(device) for name in self.__dataclass_fields__})


def collate(paths: Sequence[TrainingPath], pad_id: int) -> PathBatch:
    """Right-pad training paths into a :class:`PathBatch` of ``[batch, max_len]`` tensors."""
    if not paths:
        raise ValueError("collate needs at least one training path")
    if isinstance(pad_id, bool) or not isinstance(pad_id, int) or pad_id < 0:
        raise ValueError(f"pad_id must be a non-negative token id, got {pad_id!r}")
    width = max(len(path.ids) for path in paths)

    def padded(rows: Iterable[Sequence[float]], fill: float, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor([list(row) + [fill] * (width - len(row)) for row in rows], dtype=dtype)

    return PathBatch(
        ids=padded((path.ids for path in paths), pad_id, torch.int64),
        attention_mask=padded(([1] * len(path.ids) for path in paths), 0, torch.int64),
        mask=padded((path.mask for path in paths), 0, torch.float32),
        advantages=padded((path.advantages for path in paths), 0.0, torch.float32),
        sampler_logprobs=padded(
            ([lp if m else 0.0 for lp, m in zip(p.sampler_logprobs, p.mask)] for p in paths), 0.0, torch.float32
        ),
        turn_ids=padded((path.turn_ids for path in paths), -1, torch.int64),
        weights=padded((path.weights for path in paths), 0.0, torch.float32),
        rewards=torch.tensor([path.reward for path in paths], dtype=torch.float32),
    )
