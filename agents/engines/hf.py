"""Generation with a transformers model, batching the requests of many concurrent episodes.

One worker thread owns the model's forward passes, so the event loop never blocks. Requests
queue up; whenever the worker is idle it waits ``batch_window_s`` for more to arrive, then
prefills them together (left padding) and decodes them step by step with a KV cache, a
:class:`SlotCache` in which every row keeps its own length. Requests that arrive while a batch
is decoding join it at the next step (their prefilled KV copied into free rows), and finished
rows leave it at once, so the batch stays full when episodes finish their turns at different
times; neither copies the other rows. Each row keeps its own sampling parameters, stops and
random generator.

A prefix cache keeps the KV of recently finished requests (up to ``prefix_cache_tokens``
tokens, least recently used first out). A prompt that shares a prefix with one of them (the next
turn of an episode, a fork of it, or just the same system prompt) reuses that prefix's KV and
prefills only the rest, as vLLM's automatic prefix caching does: an episode's turn costs its new
tokens, not its whole context. Any change of the weights (an optimiser step on a shared model,
``update_weights``) empties the cache, since the KV was computed with the old ones.

On CPU the engine switches a model that uses ``sdpa`` attention to :data:`CPU_GQA_ATTENTION`:
the same function, except that under no-grad it lets torch's kernel read the shared KV heads of
grouped-query attention instead of copying them per query head (identical results; see
:func:`_sdpa_cpu_gqa`), and its forward passes compute linear layers on inputs of 2 to 32 rows
(decode steps) as weight times input (see :class:`WeightFirstLinear`). The trainer's forward passes, which need gradients, are unchanged.

``HFEngine(model=trainer_model, tokenizer=tokenizer)`` generates with the trainer's own model
object: weights are never copied. Hold :attr:`HFEngine.forward_lock` while changing the weights
in place (an optimiser step) if generations may be in flight.

Supported models: decoder-only models with full attention in every layer (Llama, Qwen2/3,
SmolLM2, Mistral without sliding windows); batching sequences of different lengths in one cache
is exact only for those.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import AttentionInterface, AttentionMaskInterface, DynamicCache, PreTrainedModel, PreTrainedTokenizerBase
from transformers.cache_utils import Cache, DynamicLayer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from agents.engines.base import Completion, Engine, FinishReason, SamplingParams, find_stop
from agents.models import DEFAULT_MODEL, load_model, load_tokenizer

__all__ = ["CPU_GQA_ATTENTION", "BatchStats", "HFEngine", "PrefixCache", "SlotCache", "WeightFirstLinear", "sample_next_tokens"]

#: The attention implementation HFEngine gives an ``sdpa`` model on CPU (see :func:`_sdpa_cpu_gqa`).
CPU_GQA_ATTENTION = "sdpa-cpu-gqa"


def _sdpa_cpu_gqa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, minus its copy of the KV heads on CPU under no-grad.

    With a mask, transformers repeats each KV head once per query head of its group before
    calling torch (CUDA's fast kernels need that); torch's CPU kernel takes the groups itself
    (``enable_gqa``) with bit-identical results. At 32 rows x 600 cached positions of SmolLM2 the
    copy cost 58.7 ms a layer against 4.9 ms without it, 90% of a decode step (this machine).
    """
    grouped = query.shape[1] != key.shape[1]
    if (not grouped or attention_mask is None or query.device.type != "cpu" or torch.is_grad_enabled()
            or kwargs.get("position_bias") is not None):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                            dropout_p=kwargs.get("dropout", 0.0), scale=kwargs.get("scaling"),
                                            enable_gqa=True)
    return output.transpose(1, 2).contiguous(), None


AttentionInterface.register(CPU_GQA_ATTENTION, _sdpa_cpu_gqa)
AttentionMaskInterface.register(CPU_GQA_ATTENTION, sdpa_mask)

class WeightFirstLinear(TorchFunctionMode):
    """Within this mode, ``F.linear(x, W)`` with 2 to ``max_rows`` input rows runs as ``(W @ xᵀ)ᵀ``.

    The same product, summed in another order (float32 rounding differences, ~1e-6). MKL's sgemm
    is slow for an input of a few rows, as a decode step's is (one per sequence), when the weight is
    its transposed second operand, as F.linear has it. SmolLM2-135M decode steps on this 2-core
    machine (400 cached positions): 4 rows 222-317 ms as F.linear, 122-141 ms weight first; 16 rows
    295-339 vs 216-239 ms; 32 rows about even. One row (12% slower) and prefill-sized inputs (50%
    slower at 32 x 300 tokens) keep F.linear. HFEngine's forward passes on CPU use this mode.
    transformers and torch offer no switch for it.
    """

    def __init__(self, max_rows: int = 32) -> None:
        super().__init__()
        self.max_rows = max_rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        x, weight = args[0], args[1]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        rows = x.numel() // x.shape[-1]
        if not 2 <= rows <= self.max_rows:
            return func(*args, **kwargs)
        # Contiguous again: the layers after it are slow on the transposed layout.
        out = torch.mm(weight, x.reshape(rows, -1).t()).t().contiguous()
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], weight.shape[0])


GROWTH = 256  # spare columns a batch's cache allocates when a row outgrows its room


class _SlotLayer(DynamicLayer):
    """One layer of a :class:`SlotCache`: its room, [row capacity, kv heads, column capacity, head dim] for keys and values."""

    def __init__(self, cache: SlotCache) -> None:
        super().__init__()
        self.cache = cache
        self.room: tuple[torch.Tensor, torch.Tensor] | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step: write each row's new key and value at its own column; return columns [0, width]."""
        if key_states.shape[-2] != 1:
            raise ValueError("a SlotCache takes one new position per row and forward pass (prefill with a DynamicCache)")
        rows, columns, width = self.cache.rows_index, self.cache.lengths, self.cache.width + 1
        self.room[0][rows, :, columns] = key_states[:, :, 0]
        self.room[1][rows, :, columns] = value_states[:, :, 0]
        return self.room[0][: len(rows), :, :width], self.room[1][: len(rows), :, :width]

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
    columns at a time, rows doubling up to ``max_rows``.
    """

    def __init__(self, num_layers: int, max_rows: int, device: str | torch.device = "cpu") -> None:
        super().__init__(layers=[_SlotLayer(self) for _ in range(num_layers)])
        self.max_rows = max_rows
        self._set_lengths(torch.zeros(0, dtype=torch.long, device=device))

    @property
    def num_rows(self) -> int:
        return len(self.lengths)

    def add_rows(self, sequences: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Append sequences, each given per layer as (keys, values) of [kv heads, length, head dim]."""
        lengths = [kv[0][0].shape[1] for kv in sequences]
        first, rows = self.num_rows, self.num_rows + len(sequences)
        self._reserve(rows, max(lengths), example=sequences[0][0][0])
        for row, (kv, length) in enumerate(zip(sequences, lengths), start=first):
            for layer, (keys, values) in zip(self.layers, kv):
                layer.room[0][row, :, :length] = keys
                layer.room[1][row, :, :length] = values
        self._set_lengths(torch.cat([self.lengths, self.lengths.new_tensor(lengths)]))

    def remove_row(self, row: int) -> None:
        """Drop ``row``: the last row moves into its place."""
        last = self.num_rows - 1
        if row != last:
            length = int(self.lengths[last])
            for layer in self.layers:
                for room in layer.room:
                    room[row, :, :length] = room[last, :, :length]
            self.lengths[row] = self.lengths[last]
        self._set_lengths(self.lengths[:last])

    def row(self, row: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Copies of ``row``'s keys and values per layer, [kv heads, length, head dim] each."""
        length = int(self.lengths[row])
        return [(layer.room[0][row, :, :length].clone(), layer.room[1][row, :, :length].clone())
                for layer in self.layers]

    def decode_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Make room for a decode step; its attention mask [rows, width + 1] and position ids [rows, 1]."""
        self._reserve(self.num_rows, self.width + 1)
        columns = torch.arange(self.width + 1, device=self.lengths.device)
        return (columns[None] <= self.lengths[:, None]).long(), self.lengths[:, None]

    def advance(self) -> None:
        """After a decode step: every row holds one more position."""
        self._set_lengths(self.lengths + 1)

    def _set_lengths(self, lengths: torch.Tensor) -> None:
        self.lengths = lengths  # [rows] positions each row holds
        self.width = int(lengths.max()) if len(lengths) else 0
        self.rows_index = torch.arange(len(lengths), device=lengths.device)

    def _reserve(self, rows: int, columns: int, example: torch.Tensor | None = None) -> None:
        """Grow every layer's room to at least ``rows`` x ``columns``, keeping what it holds."""
        for layer in self.layers:
            if layer.room is None:
                heads, _, dim = example.shape
                layer.room = tuple(example.new_zeros((0, heads, 0, dim)) for _ in "kv")
            held_rows, heads, held_columns, dim = layer.room[0].shape
            if rows <= held_rows and columns <= held_columns:
                continue
            shape = (held_rows if rows <= held_rows else max(rows, min(2 * held_rows, self.max_rows)), heads,
                     held_columns if columns <= held_columns else columns + GROWTH, dim)
            # Zeros, not empty memory: attention reads masked columns too, and a NaN there (0 x NaN) spoils the row.
            room = tuple(layer.room[0].new_zeros(shape) for _ in "kv")
            used_rows, used_columns = self.num_rows, self.width
            for old, new in zip(layer.room, room):
                new[:used_rows, :, :used_columns] = old[:used_rows, :, :used_columns]
            layer.room = room


@dataclass
class BatchStats:
    """Counters of the worker's forward passes (they show whether requests were batched)."""

    prefill_passes: int = 0
    decode_passes: int = 0
    generated_tokens: int = 0
    largest_batch: int = 0  # most rows decoded together in one forward pass
    prompt_tokens: int = 0  # prompt tokens of all requests
    prefix_cache_hit_tokens: int = 0  # of those, the ones whose KV came from the prefix cache


@dataclass(eq=False)
class _Request:
    prompt: list[int]
    params: SamplingParams
    future: concurrent.futures.Future
    generator: torch.Generator | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    entropies: list[float] = field(default_factory=list)


@dataclass
class _Batch:
    """Rows decoding together: their KV cache and next-token logits."""

    requests: list[_Request]  # row r's request; its cached positions are cache.lengths[r]
    cache: SlotCache
    logits: torch.Tensor  # [rows, vocab] float32 logits of each row's next token


_CLOSE = object()


class HFEngine(Engine):
    """A transformers causal LM behind the :class:`Engine` interface (CPU or GPU).

    ``model`` is a model name (see :func:`agents.models.resolve_model`), loaded in ``dtype`` on
    ``device``, or a loaded model to share (used as it is); with a loaded model pass its
    ``tokenizer`` too. ``max_batch_size`` caps the rows of
    one forward pass; ``batch_window_s`` is how long an idle worker waits for more requests
    before starting a batch; ``seed`` seeds the generator of requests without their own seed;
    ``prefix_cache_tokens`` bounds the tokens whose KV the prefix cache keeps (0 turns it off;
    the default holds 32 SmolLM2 episodes of 1,000 tokens in 1.5 GB).
    """

    supports_entropy = True

    def __init__(
        self,
        model: str | PreTrainedModel = DEFAULT_MODEL,
        tokenizer: str | PreTrainedTokenizerBase | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 32,
        batch_window_s: float = 0.005,
        seed: int | None = None,
        prefix_cache_tokens: int = 32768,
    ) -> None:
        if isinstance(model, str):
            tokenizer = model if tokenizer is None else tokenizer
            model = load_model(model, dtype=dtype, device=device)
        elif tokenizer is None:
            raise ValueError("HFEngine(model=<loaded model>) needs tokenizer= as well (an object or a model name)")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0 (0 turns the cache off), got {prefix_cache_tokens}")
        layer_types = getattr(model.config.get_text_config(), "layer_types", None) or ["full_attention"]
        if any(kind != "full_attention" for kind in layer_types):
            raise ValueError(
                f"HFEngine supports models with full attention in every layer; this one has {sorted(set(layer_types))}"
            )
        if model.device.type == "cpu" and model.config._attn_implementation == "sdpa":
            model.set_attn_implementation(CPU_GQA_ATTENTION)
        self._linear_mode = WeightFirstLinear if model.device.type == "cpu" else contextlib.nullcontext
        self.model: PreTrainedModel = model
        self.tokenizer: PreTrainedTokenizerBase = (
            load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        )
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.eos_token_ids = _eos_token_ids(model, self.tokenizer)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        #: Held by the worker during every forward pass; hold it to change weights in place.
        self.forward_lock = threading.Lock()
        self.stats = BatchStats()
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self._weights_version = -1
        self._generator = torch.Generator(device=model.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._start_lock = threading.Lock()
        self._closed = False

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        ids = self._check_request(prompt_ids, params, self.vocab_size)
        if self.max_positions is not None and len(ids) >= self.max_positions:
            raise ValueError(f"prompt of {len(ids)} tokens leaves no room in the model's {self.max_positions} positions")
        if self._closed:
            raise RuntimeError("HFEngine is closed")
        self._start_worker()
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.model.device).manual_seed(params.seed)
        request = _Request(ids, params, concurrent.futures.Future(), generator)
        self._inbox.put(request)
        # Cancelling this coroutine cancels the future; the worker drops the row at its next step.
        return await asyncio.wrap_future(request.future)

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy ``state_dict`` into the model between forward passes (a partial dict is fine)."""

        def load() -> None:
            with self.forward_lock, torch.no_grad():
                result = self.model.load_state_dict(dict(state_dict), strict=False)
            if result.unexpected_keys:
                raise KeyError(f"weights the model does not have: {result.unexpected_keys[:5]}")

        await asyncio.to_thread(load)

    async def close(self) -> None:
        self._closed = True
        if self._thread is not None:
            self._inbox.put(_CLOSE)
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    # ---- the worker thread -------------------------------------------------------------

    def _start_worker(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="HFEngine-worker", daemon=True)
                self._thread.start()

    def _serve(self) -> None:
        waiting: collections.deque[_Request] = collections.deque()
        batch: _Batch | None = None
        while True:
            if not self._collect(waiting, block=batch is None):
                break
            newcomers = []
            while waiting and len(newcomers) + (len(batch.requests) if batch else 0) < self.max_batch_size:
                request = waiting.popleft()
                if not request.future.cancelled():
                    newcomers.append(request)
            if batch is None and not newcomers:
                continue
            try:
                with self.forward_lock, torch.inference_mode(), self._linear_mode():
                    if newcomers:
                        batch = self._join(batch, newcomers)
                    batch = self._step(batch)
            except Exception as error:  # a failed forward pass fails its rows, not the worker
                for request in (batch.requests if batch else []) + newcomers:
                    _settle(request.future, exception=error)
                batch = None
        for request in list(waiting) + (batch.requests if batch else []):
            _settle(request.future, exception=RuntimeError("HFEngine was closed before this request finished"))

    def _collect(self, waiting: collections.deque, block: bool) -> bool:
        """Move arrived requests to ``waiting``; when ``block``, wait for one plus the batch window."""
        try:
            if block:
                item = self._inbox.get()
                if item is _CLOSE:
                    return False
                waiting.append(item)
                deadline = time.monotonic() + self.batch_window_s
                while len(waiting) < self.max_batch_size and (remaining := deadline - time.monotonic()) > 0:
                    item = self._inbox.get(timeout=remaining)
                    if item is _CLOSE:
                        return False
                    waiting.append(item)
            while True:
                item = self._inbox.get_nowait()
                if item is _CLOSE:
                    return False
                waiting.append(item)
        except queue.Empty:
            return True

    def _join(self, batch: _Batch | None, requests: list[_Request]) -> _Batch:
        """Prefill ``requests`` and add them to the running ``batch`` (or start one)."""
        sequences, logits = self._prefill(requests)
        if batch is None:
            cache = SlotCache(len(sequences[0]), self.max_batch_size, device=logits.device)
            batch = _Batch([], cache, logits[:0])
        batch.cache.add_rows(sequences)
        batch.requests += requests
        batch.logits = torch.cat([batch.logits, logits])
        return batch

    def _prefill(self, requests: list[_Request]
                 ) -> tuple[list[list[tuple[torch.Tensor, torch.Tensor]]], torch.Tensor]:
        """One forward pass over the prompts' tokens that the prefix cache does not hold.

        Returns each prompt's KV per layer ([kv heads, prompt length, head dim]) and the logits of
        its next token. Row layout of the pass: [left padding | cached prefix | padding | new
        tokens], so that the new tokens of every row end at the right edge.
        """
        version = sum(p._version for p in self.model.parameters())  # bumped by every in-place change
        if version != self._weights_version:
            self.prefix_cache.clear()
            self._weights_version = version
        # Keep at least one prompt token to run: its logits give the first sampled token.
        hits = [self.prefix_cache.lookup(r.prompt, limit=len(r.prompt) - 1) for r in requests]
        reused = [hit[0] if hit else 0 for hit in hits]
        cached = max(reused)
        new = max(len(r.prompt) - n for r, n in zip(requests, reused))
        device = self.model.device
        rows = len(requests)
        input_ids = torch.full((rows, new), self.pad_token_id, dtype=torch.long, device=device)
        attention_mask = torch.zeros((rows, cached + new), dtype=torch.long, device=device)
        cache = DynamicCache()
        if cached:
            heads, dim = self.prefix_cache.shape
            for layer in range(self.prefix_cache.num_layers):
                keys, values = (torch.zeros((rows, heads, cached, dim), dtype=self.model.dtype, device=device)
                                for _ in "kv")
                for row, (hit, n) in enumerate(zip(hits, reused)):
                    if hit:
                        keys[row, :, cached - n :] = hit[1][layer][0][:, :n]
                        values[row, :, cached - n :] = hit[1][layer][1][:, :n]
                cache.update(keys, values, layer)
        for row, (request, n) in enumerate(zip(requests, reused)):
            attention_mask[row, cached - n : cached] = 1
            rest = request.prompt[n:]
            input_ids[row, new - len(rest) :] = torch.tensor(rest, device=device)
            attention_mask[row, cached + new - len(rest) :] = 1
            self.stats.prompt_tokens += len(request.prompt)
            self.stats.prefix_cache_hit_tokens += n
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, cached:]
        output = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self.stats.prefill_passes += 1
        sequences = []
        for row in range(rows):
            columns = attention_mask[row].nonzero()[:, 0]
            sequences.append([(keys[row].index_select(1, columns), values[row].index_select(1, columns))
                              for keys, values, *_ in cache])
        return sequences, output.logits[:, -1].float()

    def _step(self, batch: _Batch) -> _Batch | None:
        """Sample one token for every row, settle finished rows, and run the next decode pass."""
        params = [r.params for r in batch.requests]
        generators = [r.generator or self._generator for r in batch.requests]
        sampled = sample_next_tokens(batch.logits, params, generators)
        self.stats.generated_tokens += len(batch.requests)  # before settling: a woken caller may read it
        leaving = []
        for row, request in enumerate(batch.requests):
            token = int(sampled.token_ids[row])
            request.token_ids.append(token)
            request.logprobs.append(float(sampled.logprobs[row]))
            if request.params.logprobs_topk:
                request.top_logprobs.append(sampled.top_logprobs[row][: request.params.logprobs_topk])
            if request.params.return_entropy:
                request.entropies.append(float(sampled.entropies[row]))
            completion = self._finish(request, token, int(batch.cache.lengths[row]) + 1)
            if completion is not None:
                # The cache holds the prompt and every sampled token but this last one.
                self.prefix_cache.add(request.prompt + request.token_ids[:-1], batch.cache.row(row))
                _settle(request.future, result=completion)
            if completion is not None or request.future.cancelled():
                leaving.append(row)
        for row in reversed(leaving):  # from the end, so the last row, moved into the gap, is one that stays
            batch.cache.remove_row(row)
            batch.requests[row] = batch.requests[-1]
            batch.requests.pop()
        if not batch.requests:
            return None
        next_tokens = torch.tensor([[r.token_ids[-1]] for r in batch.requests], device=self.model.device)
        attention_mask, position_ids = batch.cache.decode_inputs()
        output = self.model(
            input_ids=next_tokens,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=batch.cache,
            use_cache=True,
        )
        batch.cache.advance()
        batch.logits = output.logits[:, -1].float()
        self.stats.decode_passes += 1
        self.stats.largest_batch = max(self.stats.largest_batch, len(batch.requests))
        return batch

    def _finish(self, request: _Request, token: int, used_positions: int) -> Completion | None:
        """The completion if ``token`` ends the request, else ``None`` (stop beats length)."""
        params = request.params
        reason: FinishReason | None = None
        stop_reason: str | int | None = None
        overshoot = ""
        if token in params.stop_token_ids:
            reason, stop_reason = "stop", token
        elif token in self.eos_token_ids:
            reason = "eos"
        elif params.stop:
            text = self.tokenizer.decode(request.token_ids, skip_special_tokens=True)
            match = find_stop(text, params.stop)
            if match is not None:
                reason, stop_reason, overshoot = "stop", match[0], text[match[1] :]
        if reason is None and (
            len(request.token_ids) >= params.max_new_tokens
            or (self.max_positions is not None and used_positions >= self.max_positions)
        ):
            reason = "length"
        if reason is None:
            return None
        return Completion(
            token_ids=request.token_ids,
            logprobs=request.logprobs,
            finish_reason=reason,
            stop_reason=stop_reason,
            stop_overshoot=overshoot,
            top_logprobs=request.top_logprobs if params.logprobs_topk else None,
            entropies=request.entropies if params.return_entropy else None,
        )


@dataclass
class SampledTokens:
    """One sampling step over a batch of rows (see :func:`sample_next_tokens`)."""

    token_ids: torch.Tensor  # [rows]
    logprobs: torch.Tensor  # [rows] log-prob of each sampled id under its sampling distribution
    top_logprobs: list[list[tuple[int, float]]]  # per row, the largest requested top-k, best first
    entropies: torch.Tensor | None  # [rows] entropy of the full temperature-scaled distribution, if asked


def sample_next_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> SampledTokens:
    """Sample one token per row of ``logits`` [rows, vocab] under each row's own parameters.

    The same semantics as vLLM's sampler: temperature, then top-k, then top-p on what top-k kept;
    greedy rows take the arg-max and report temperature-1 log-probs.
    """
    logits = logits.float()
    # Greedy rows use temperature 1 for their log-probs (vLLM does the same).
    temperature = torch.tensor([p.temperature or 1.0 for p in params], device=logits.device)
    scaled = logits / temperature[:, None]
    full_logprobs = torch.log_softmax(scaled, dim=-1)
    filtered = _filter_top_k_top_p(scaled, params)
    logprobs = full_logprobs if filtered is scaled else torch.log_softmax(filtered, dim=-1)
    entropies = None
    if any(p.return_entropy for p in params):
        # H = -Σ p log p over the whole vocabulary (the exact token entropy of ALGORITHMS.md).
        entropies = -(full_logprobs.exp() * full_logprobs).sum(-1)
    token_ids = logits.argmax(-1)
    sampled_rows = [row for row, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        token_ids[sampled_rows] = _inverse_cdf_sample(logprobs[sampled_rows], [generators[r] for r in sampled_rows])
    chosen = logprobs.gather(-1, token_ids[:, None])[:, 0]
    k = max(p.logprobs_topk for p in params)
    top_logprobs: list[list[tuple[int, float]]] = [[] for _ in params]
    if k:
        values, indices = logprobs.topk(k, dim=-1)
        top_logprobs = [list(zip(i.tolist(), v.tolist())) for i, v in zip(indices, values)]
    return SampledTokens(token_ids, chosen, top_logprobs, entropies)


def _inverse_cdf_sample(logprobs: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    """One draw per row from exp(logprobs): the first token whose cumulative probability exceeds
    u·total, u ~ U[0, 1) from the row's generator (one random number per token; torch.multinomial
    costs about 40x more on a 49k vocabulary)."""
    cdf = logprobs.exp().cumsum(-1)
    u = torch.stack([torch.rand((), generator=g, device=logprobs.device) for g in generators])
    index = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    # u·total can round up to the total; take the last token that has probability then.
    last_possible = logprobs.shape[-1] - 1 - (logprobs > float("-inf")).flip(-1).long().argmax(-1)
    return torch.minimum(index, last_possible)


def _filter_top_k_top_p(scaled: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Set logits outside each row's top-k, then outside its top-p nucleus, to -inf."""
    if all(p.top_k == -1 and p.top_p == 1.0 for p in params):
        return scaled
    vocab = scaled.shape[-1]
    top_k = torch.tensor([vocab if p.top_k == -1 else min(p.top_k, vocab) for p in params], device=scaled.device)
    top_p = torch.tensor([p.top_p for p in params], device=scaled.device)
    ordered, order = scaled.sort(dim=-1, descending=True)
    # top-k: keep logits >= the k-th largest (ties at the boundary are kept, as in vLLM).
    kth = ordered.gather(-1, (top_k - 1)[:, None])
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    # top-p: keep the smallest prefix whose probability reaches p; the best token always stays.
    probs = ordered.softmax(-1)
    outside = (probs.cumsum(-1) - probs) >= top_p[:, None]
    ordered = ordered.masked_fill(outside, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, ordered)


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


def _settle(future: concurrent.futures.Future, *, result=None, exception: BaseException | None = None) -> None:
    """Complete ``future`` unless its caller cancelled it meanwhile."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


def _eos_token_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(ids)
