"""Packing a micro-batch of training paths into one row, each shared prefix forwarded once.

A rollout tree's leaves share their prefixes: every chain of a prompt shares the prompt, and the
leaves of a tree learner share whole turns. :func:`pack_paths` lays the paths of a micro-batch
out in one row in which every shared prefix stands once (``share=True``, the trainer's
``packing="tree"``) or every path stands whole (``share=False``, ``packing="flat"``):

- path ``b`` shares the longest prefix it has in common with any path before it (its tokens
  up to there are that path's places in the row); its other tokens follow in the row in order.
  Token ids, not tree metadata, decide what is shared: a causal model gives a token the same
  log-prob in every path whose tokens up to it are equal, so the packed pass is exact for any
  paths, trees and chains alike, and several trees pack into one row where they fit;
- each token's position id is its depth in its own path, so rotary embeddings see what they
  see in the path alone;
- ``where[b, t]`` is the place in the row of path ``b``'s token ``t``. The trainer gathers the
  packed pass's log-probs and entropies back to ``[paths, tokens]`` through it, and the losses
  run there as on unpacked paths: the gradient of a shared token is the sum of what each path
  containing it gives it, which is exactly what the per-path computation gives;
- a token attends to the tokens of its own path up to itself
  (:mod:`agents.training.tree_attention`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["PackedPaths", "new_tokens", "pack_paths"]


@dataclass
class PackedPaths:
    """A micro-batch of paths as one row (see the module docstring).

    Attributes:
        ids: ``[1, P]`` the row's token ids.
        positions: ``[1, P]`` each token's depth in its own path (the position ids).
        where: ``[paths, tokens]`` the place in the row of each path's token (0 on padding).
        previous: ``[P]`` the place of the token before each token in its path (-1 at depth 0).
        starts: per path, the depth of its first token of its own (its shared prefix's length).
        lengths: per path, its number of tokens.
        offsets: per path, the place in the row of its first token of its own; its own tokens
            are ``ids[0, offsets[b] : offsets[b] + lengths[b] - starts[b]]``.
        cache: what the attention derives from the layout once and every layer reuses.
    """

    ids: torch.Tensor
    positions: torch.Tensor
    where: torch.Tensor
    previous: torch.Tensor
    starts: list[int]
    lengths: list[int]
    offsets: list[int]
    cache: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def tokens(self) -> int:
        """The row's length: tokens forwarded."""
        return self.ids.shape[1]


def _shared_prefixes(ids: torch.Tensor, lengths: torch.Tensor, row: int, others: torch.Tensor) -> torch.Tensor:
    """The length of the common prefix of path ``row`` with each path of ``others``."""
    length = int(lengths[row])
    if not len(others) or not length:
        return torch.zeros(len(others), dtype=torch.long)
    depth = torch.arange(length, device=ids.device)
    equal = (ids[others, :length] == ids[row, :length]) & (depth < lengths[others, None])
    return equal.long().cumprod(-1).sum(-1)


def new_tokens(ids: torch.Tensor, lengths: torch.Tensor, row: int, group: list[int]) -> int:
    """How many tokens path ``row`` adds to a row already holding the paths ``group`` (tree packing)."""
    others = torch.tensor(group, dtype=torch.long, device=ids.device)
    shared = _shared_prefixes(ids, lengths, row, others)
    return int(lengths[row]) - (int(shared.max()) if len(group) else 0)


def pack_paths(ids: torch.Tensor, attention_mask: torch.Tensor, *, share: bool = True) -> PackedPaths:
    """The right-padded paths ``ids`` (``[paths, tokens]``, ``attention_mask`` 1 on real tokens) as one row."""
    lengths = attention_mask.sum(-1)
    where = torch.zeros(ids.shape, dtype=torch.long, device=ids.device)
    pieces, depths, starts, offsets = [], [], [], []
    offset = 0
    for row in range(ids.shape[0]):
        length = int(lengths[row])
        start = 0
        if share and row:
            shared = _shared_prefixes(ids, lengths, row, torch.arange(row, device=ids.device))
            parent = int(shared.argmax())  # the earliest path with the longest common prefix
            start = int(shared[parent])
            where[row, :start] = where[parent, :start]
        where[row, start:length] = torch.arange(offset, offset + length - start, device=ids.device)
        pieces.append(ids[row, start:length])
        depths.append(torch.arange(start, length, device=ids.device))
        starts.append(start)
        offsets.append(offset)
        offset += length - start
    previous = torch.full((offset,), -1, dtype=torch.long, device=ids.device)
    for row in range(ids.shape[0]):
        length = int(lengths[row])
        previous[where[row, 1:length]] = where[row, : length - 1]
    return PackedPaths(
        ids=torch.cat(pieces).unsqueeze(0),
        positions=torch.cat(depths).unsqueeze(0),
        where=where,
        previous=previous,
        starts=starts,
        lengths=[int(n) for n in lengths],
        offsets=offsets,
    )
