"""KV caches of HFEngine: the running batch's :class:`SlotCache` and the cross-request :class:`PrefixCache`."""

from __future__ import annotations

import collections
from collections.abc import Sequence

import numpy as np
import torch
from transformers.cache_utils import Cache, DynamicLayer

from agents.models import AttentionShape

__all__ = ["GROWTH", "PREFIX_CACHE_BYTES", "PrefixCache", "SlotCache", "kv_bytes_per_token"]

GROWTH = 256  # spare columns a batch's cache allocates when a row outgrows its room
#: The KV memory HFEngine's prefix cache may hold by default: 3 GiB, 139,810 tokens of SmolLM2-135M
#: in bfloat16 (the contexts of 128 concurrent multihop-qa episodes of ~700 tokens, with room to
#: spare) and 21,845 of Qwen3-4B. It fills only as requests finish and empties at every weight change.
PREFIX_CACHE_BYTES = 3 * 2**30


def kv_bytes_per_token(config: object, dtype: torch.dtype) -> int:
    """Bytes of keys and values one token takes in every layer of a model with this (text) config, in ``dtype``."""
    shape = AttentionShape.of(config)
    layers = int(config.num_hidden_layers)  # type: ignore[attr-defined]
    return layers * 2 * shape.kv_heads * shape.head_dim * dtype.itemsize


class _SlotLayer(DynamicLayer):
    """One layer of a :class:`SlotCache`: its room, [row capacity, kv heads, column capacity, head dim] for keys and values."""

    def __init__(self, cache: SlotCache) -> None:
        super().__init__()
        self.cache = cache
        self.room: tuple[torch.Tensor, torch.Tensor] | None = None

    def kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The room for keys and values, which ``SlotCache._reserve`` allocates before any row is stored."""
        assert self.room is not None, "SlotCache._reserve allocates the room before rows are stored"
        return self.room

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step: write each row's new key and value at its own column; return columns [0, width]."""
        if key_states.shape[-2] != 1:
            raise ValueError(
                "a SlotCache takes one new position per row and forward pass (prefill with a DynamicCache)"
            )
        rows, columns, width = self.cache.rows_index, self.cache.lengths, self.cache.width + 1
        keys, values = self.kv()
        # Under autocast keys leave the rotary embedding in float32 and values come out in bfloat16: both are
        # stored in the room's dtype.
        keys[rows, :, columns] = key_states[:, :, 0].to(keys.dtype)
        values[rows, :, columns] = value_states[:, :, 0].to(values.dtype)
        return keys[: len(rows), :, :width], values[: len(rows), :, :width]

    def get_seq_length(self) -> int:
        return self.cache.width


class SlotCache(Cache):
    """The KV cache of a running batch: row r holds its sequence in columns [0, lengths[r]) of every layer.

    transformers batches generation with left padding, so a sequence joining or leaving the batch
    means re-padding and copying the whole cache; with 32 episodes of ~600 positions in flight
    those copies took 23% of a concurrent rollout on 2 cores. Here a joining sequence's KV is
    copied into free room, a leaving row is overwritten by the last row, and a decode step writes
    each row's new key and value at its own column (its position id, too). Attention reads columns
    [0, width] (``width`` is the longest row) under a padding mask. Room is added ``GROWTH``
    columns at a time, rows doubling up to ``max_rows``, and columns are given back when the
    longest row left needs less than half of them. The lengths are kept on the host too
    (``host_lengths``), so that a decode step never reads them from the device.
    """

    def __init__(
        self, num_layers: int, max_rows: int, device: str | torch.device = "cpu", dtype: torch.dtype | None = None
    ) -> None:
        # self.layers, typed as what they are (transformers types them as any cache layer); never resized
        self.slot_layers = [_SlotLayer(self) for _ in range(num_layers)]
        super().__init__(layers=list(self.slot_layers))
        self.max_rows = max_rows
        self.dtype = dtype  # of the rooms; None: that of the first keys stored
        self.lengths: torch.Tensor  # [rows] positions each row holds
        self.host_lengths: list[int]  # the same, on the host
        self.width: int  # the longest row's
        self.rows_index: torch.Tensor  # [rows] 0, 1, ...
        self._set_lengths(torch.zeros(0, dtype=torch.long, device=device), [])

    @property
    def num_rows(self) -> int:
        return len(self.host_lengths)

    def add_rows(self, sequences: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Append sequences, each given per layer as (keys, values) of [kv heads, length, head dim]."""
        lengths = [kv[0][0].shape[1] for kv in sequences]
        first, rows = self.num_rows, self.num_rows + len(sequences)
        self._reserve(rows, max(lengths), example=sequences[0][0][0])
        for row, (kv, length) in enumerate(zip(sequences, lengths), start=first):
            for layer, (keys, values) in zip(self.slot_layers, kv):
                room_keys, room_values = layer.kv()
                room_keys[row, :, :length] = keys
                room_values[row, :, :length] = values
        self._set_lengths(torch.cat([self.lengths, self.lengths.new_tensor(lengths)]), self.host_lengths + lengths)

    def remove_row(self, row: int) -> None:
        """Drop ``row``: the last row moves into its place."""
        last = self.num_rows - 1
        host_lengths = self.host_lengths[:last]
        if row != last:
            length = self.host_lengths[last]
            for layer in self.slot_layers:
                for room in layer.kv():
                    room[row, :, :length] = room[last, :, :length]
            self.lengths[row] = self.lengths[last]
            host_lengths[row] = length
        self._set_lengths(self.lengths[:last], host_lengths)
        self._shrink()

    def release(self) -> None:
        """Free every layer's room now (the batch is done).

        Not left to the garbage collector: the layers and the cache refer to each other, and Python's
        cyclic collector runs on counts of Python objects, not bytes, so finished batches' rooms
        (3.4 GB for 128 multihop-qa rows) stayed alive beside the next ones.
        """
        for layer in self.slot_layers:
            layer.room = None
        self._set_lengths(self.lengths[:0], [])

    def row(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of ``row``'s keys and values per layer, [kv heads, length, head dim] each."""
        length = self.host_lengths[row]
        return [
            (keys[row, :, :length].clone(), values[row, :, :length].clone())
            for keys, values in (layer.kv() for layer in self.slot_layers)
        ]

    def decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Make room for a decode step; its attention mask [rows, width + 1] and position ids [rows, 1]."""
        self._reserve(self.num_rows, self.width + 1)
        columns = torch.arange(self.width + 1, device=self.lengths.device)
        return (columns[None] <= self.lengths[:, None]).long(), self.lengths[:, None]

    def advance(self) -> None:
        """After a decode step: every row holds one more position."""
        self.lengths = self.lengths + 1
        self.host_lengths = [length + 1 for length in self.host_lengths]
        self.width = max(self.host_lengths, default=0)

    def _set_lengths(self, lengths: torch.Tensor, host_lengths: list[int]) -> None:
        """A new set of rows: their lengths on the device and the host (the same numbers)."""
        self.lengths = lengths
        self.host_lengths = host_lengths
        self.width = max(host_lengths, default=0)
        self.rows_index = torch.arange(len(host_lengths), device=lengths.device)

    def _shrink(self) -> None:
        """Give back columns once the longest row needs less than half the room: a decode step's attention
        reads every column of the room (:func:`~agents.engines.cpu_kernels._whole_rows`), so a room left wide
        by rows that have left made every later step pay for their length."""
        for layer in self.slot_layers:
            if layer.room is None:
                return
            held_rows, heads, held_columns, dim = layer.room[0].shape
            if held_columns <= 2 * (self.width + GROWTH):
                return
            self._move(layer, (held_rows, heads, self.width + GROWTH, dim))

    def _reserve(self, rows: int, columns: int, example: torch.Tensor | None = None) -> None:
        """Grow every layer's room to at least ``rows`` x ``columns``, keeping what it holds."""
        for layer in self.slot_layers:
            if layer.room is None:
                assert example is not None, "the first rows added give the room its shape"
                heads, _, dim = example.shape
                empty = example.new_zeros((0, heads, 0, dim), dtype=self.dtype or example.dtype)
                layer.room = (empty, empty.clone())
            held_rows, heads, held_columns, dim = layer.room[0].shape
            if rows <= held_rows and columns <= held_columns:
                continue
            shape = (
                held_rows if rows <= held_rows else max(rows, min(2 * held_rows, self.max_rows)),
                heads,
                held_columns if columns <= held_columns else columns + GROWTH,
                dim,
            )
            self._move(layer, shape)

    def _move(self, layer: _SlotLayer, shape: tuple[int, int, int, int]) -> None:
        """Give ``layer`` a room of ``shape``, holding the rows and columns in use."""
        # Zeros, not empty memory: attention reads masked columns too, and a NaN there (0 x NaN) spoils the row.
        room = (layer.kv()[0].new_zeros(shape), layer.kv()[0].new_zeros(shape))
        rows, columns = self.num_rows, self.width
        for old, new in zip(layer.kv(), room):
            new[:rows, :, :columns] = old[:rows, :, :columns]
        layer.room = room


class PrefixCache:
    """The KV of recently finished sequences, looked up by longest common prefix.

    Written here because transformers has no cross-request prefix cache (vLLM's is internal to
    its block manager). Entries are kept least recently used first out within ``max_tokens``; an
    entry that is a prefix of a newer one is dropped, since the newer one serves every lookup it
    could. Lookups compare token arrays with numpy, so a few hundred entries cost well under a
    millisecond against a forward pass of tens of milliseconds.
    """

    def __init__(self, max_tokens: int) -> None:
        self.max_tokens = max_tokens
        self._entries: collections.OrderedDict[int, tuple[np.ndarray, list[tuple[torch.Tensor, torch.Tensor]]]] = (
            collections.OrderedDict()
        )
        self._next_key = 0
        self.tokens = 0  # tokens held now
        self.num_layers = 0
        self.shape: tuple[int, int] = (0, 0)  # (kv heads, head dim) of the cached tensors

    def __len__(self) -> int:
        return len(self._entries)

    def clear(self) -> None:
        self._entries.clear()
        self.tokens = 0

    def lookup(self, ids: Sequence[int], limit: int) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]]] | None:
        """The length of the longest cached prefix of ``ids`` (at most ``limit`` tokens) and its KV, or ``None``.

        The KV tensors cover at least that prefix; use their first ``length`` positions.
        """
        if not self._entries or limit < 1:
            return None
        query = np.asarray(ids[:limit], dtype=np.int64)
        best_key, best = None, 0
        for key, (cached, _) in self._entries.items():
            n = min(len(cached), len(query))
            differ = np.flatnonzero(cached[:n] != query[:n])
            common = int(differ[0]) if len(differ) else n
            if common > best:
                best_key, best = key, common
        if best_key is None:
            return None
        self._entries.move_to_end(best_key)
        return best, self._entries[best_key][1]

    def add(self, ids: Sequence[int], kv: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep ``kv`` (per layer, [heads, len(ids), head_dim]) as the KV of ``ids``."""
        if not ids or len(ids) > self.max_tokens:
            return
        array = np.asarray(ids, dtype=np.int64)
        for key, (cached, _) in list(self._entries.items()):
            if len(cached) <= len(array) and np.array_equal(cached, array[: len(cached)]):
                self._drop(key)
        self._entries[self._next_key] = (array, kv)
        self._next_key += 1
        self.tokens += len(array)
        self.num_layers, self.shape = len(kv), (kv[0][0].shape[0], kv[0][0].shape[2])
        while self.tokens > self.max_tokens:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: int) -> None:
        self.tokens -= len(self._entries.pop(key)[0])
