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
tokens, not its whole context. Requests that arrive together and share a prefix the cache does
not hold yet (the n chains of one prompt, a tree's first turns) compute it once: the first of
them is prefilled alone, its KV cached, and the others reuse it. Any change of the weights (an optimiser step on a shared model,
``update_weights``) empties the cache, since the KV was computed with the old ones.

``update_weights_in_flight`` changes the weights between two decode steps while rows go on
decoding: their next tokens come from the new weights (on the KV the old ones computed), and each
token records the version that sampled it. A row whose KV predates the load is not offered to the
prefix cache.

On CPU the engine switches a model that uses ``sdpa`` attention to :data:`CPU_GQA_ATTENTION`:
the same function, except that under no-grad it lets torch's kernel read the shared KV heads of
grouped-query attention instead of copying them per query head (identical results; see
:func:`_sdpa_cpu_gqa`; a bfloat16 decode step's attention is two batched products, 10x faster than
torch's CPU flash kernel for one query a row), and its float32 forward passes compute linear layers on inputs of 2 to 32 rows
(decode steps) as weight times input (see :class:`WeightFirstLinear`). A bfloat16 Llama or Qwen2 model decodes with a
:class:`~agents.engines.fused_decode.FusedDecodeStep` (the same logits without transformers' modules). The trainer's
forward passes, which need gradients, are unchanged.

A model whose dtype is not ``compute_dtype`` (the trainer's float32 one, generating in bfloat16)
generates from a :class:`ComputeCopy` of its weights in ``compute_dtype``, copied again before the
first forward pass after any change of the weights, on a GPU or a CPU; autocast would cast every
weight again at every step (issue 37's H200 profile counted 579 casts among the ~2,300 operations of
a SmolLM2 decode step). A decode step waits for the GPU once: the
rows' sampling parameters live on it (:class:`~agents.engines.sampling.RowSampler`, built when rows
join or leave), the sampled ids, log-probs and entropies come back in one transfer, the KV cache
keeps its lengths on the host too, and the attention mask is passed whole (transformers would read
a padding mask back to see whether it masks anything). Stop strings are looked for in the text of
the last tokens only (:func:`completion_stop`), with the same answer as a search of the whole text.

``HFEngine(model=trainer_model, tokenizer=tokenizer)`` generates with the trainer's own model
object: on a CPU weights are never copied. Hold :attr:`HFEngine.forward_lock` while changing the
weights in place (an optimiser step) if generations may be in flight.

Supported models: decoder-only models with full attention in every layer (Llama, Qwen2/3,
SmolLM2, Mistral without sliding windows); batching sequences of different lengths in one cache
is exact only for those.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import copy
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from transformers import DynamicCache, PreTrainedModel, PreTrainedTokenizerBase

from agents.engines.base import BatchStats, Completion, Engine, FinishReason, SamplingParams, find_stop
from agents.engines.cpu_kernels import (
    CPU_GQA_ATTENTION,
    WeightFirstLinear,
    pack_linear_layers,
    packed_linear_supported,
    weights_version,
)
from agents.engines.fused_decode import FusedDecodeStep
from agents.engines.kv_cache import PREFIX_CACHE_BYTES, PrefixCache, SlotCache, kv_bytes_per_token
from agents.engines.sampling import RowSampler, to_device
from agents.models import (
    DEFAULT_MODEL,
    cpu_compute_dtype,
    load_model,
    load_tokenizer,
    release_free_memory,
    release_openmp_threads,
)

if TYPE_CHECKING:
    from peft import PeftModel

__all__ = [
    "MAX_PREFILL_TOKENS",
    "SHARED_PREFIX_TOKENS",
    "ComputeCopy",
    "HFEngine",
    "completion_stop",
    "shared_prefix_order",
]


@dataclass(eq=False)
class _Request:
    prompt: list[int]
    params: SamplingParams
    future: concurrent.futures.Future
    generator: torch.Generator | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    token_entropies: list[float] = field(default_factory=list)
    versions: list[int | None] = field(default_factory=list)  # each token's weights (update_weights_in_flight)
    next_version: int | None = None  # the weights of the logits that give its next token
    loads_at_prefill: int = 0  # in-flight loads before its prefill: its KV is older if more came since


@dataclass
class _Batch:
    """Rows decoding together: their KV cache and next-token logits."""

    requests: list[_Request]  # row r's request; its cached positions are cache.lengths[r]
    cache: SlotCache
    logits: torch.Tensor  # [rows, vocab] float32 logits of each row's next token
    sampler: RowSampler  # the rows' sampling parameters, in row order


_CLOSE = object()

#: A prefix-cache lookup: the length of a prompt's cached prefix and its KV per layer, or None.
_Hit = tuple[int, list[tuple[torch.Tensor, torch.Tensor]]] | None

#: Fewest uncached prompt tokens that requests arriving together must share for the first of them
#: to be prefilled before the others (one more forward pass, so it must save more than it costs).
SHARED_PREFIX_TOKENS = 64

#: KV positions one prefill pass holds at most by default (HFEngine's ``max_prefill_tokens``): 377 MB of
#: SmolLM2-135M's bfloat16 KV a copy. 128 multihop-qa episodes joining at once in one pass grew the process
#: by ~5 GB (three copies of every row's KV held together). Splitting costs little: 1,024 new tokens
#: already run the matrix products at their large-matrix rate on a CPU, and rows that reuse a cached
#: prompt (the samples of one prompt) run one new token each, in passes of tens of milliseconds.
MAX_PREFILL_TOKENS = 16_384


def shared_prefix_order(
    prompts: Sequence[Sequence[int]], cached: Sequence[int], min_shared: int = SHARED_PREFIX_TOKENS
) -> tuple[list[int], list[int]]:
    """Which prompts to prefill first, and which after them because they share an uncached prefix with one of the first.

    Prompt ``i`` waits when some earlier prompt of the first group has at least ``min_shared``
    more tokens in common with it (up to its last token, which is always computed) than the
    ``cached[i]`` the prefix cache holds for it.
    """
    first: list[int] = []
    then: list[int] = []
    arrays = [np.asarray(prompt, dtype=np.int64) for prompt in prompts]
    for i, prompt in enumerate(arrays):
        shared = 0
        for j in first:
            n = min(len(prompt) - 1, len(arrays[j]))
            differ = np.flatnonzero(prompt[:n] != arrays[j][:n])
            shared = max(shared, int(differ[0]) if len(differ) else n)
        (then if shared - cached[i] >= min_shared else first).append(i)
    return first, then


class ComputeCopy:
    """A copy of ``model`` with its floating-point parameters in ``dtype``, to generate from.

    :meth:`refresh` copies the model's weights into it again if they changed since (an optimiser
    step on a shared model, a load); it sees that from the parameters' version counters, which every
    in-place change bumps. The copy is made without a full-precision copy of the weights on the way;
    buffers (the rotary frequencies) keep their dtype, as a model loaded in ``dtype`` keeps them. A bfloat16
    copy on a CPU multiplies by prepacked weights (:func:`~agents.engines.cpu_kernels.pack_linear_layers`;
    ``packed_layers`` counts them).
    """

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype) -> None:
        self._sources = list(model.parameters())
        # deepcopy takes what the memo holds for an object instead of copying it: the cast parameters.
        memo: dict[int, object] = {
            id(p): torch.nn.Parameter(p.detach().to(dtype) if p.is_floating_point() else p.detach().clone(), False)
            for p in self._sources
        }
        self.model = copy.deepcopy(model, memo).eval()
        self._targets = list(self.model.parameters())
        # On a CPU its bfloat16 linear layers run oneDNN on prepacked weights, packed again after each refresh.
        cpu_bfloat16 = dtype == torch.bfloat16 and next(model.parameters()).device.type == "cpu"
        self.packed_layers = pack_linear_layers(self.model) if cpu_bfloat16 and packed_linear_supported() else 0
        self.version = weights_version(self._sources)

    def refresh(self) -> bool:
        """Copy the model's weights again if they changed; whether they had."""
        version = weights_version(self._sources)
        if version == self.version:
            return False
        with torch.no_grad():
            for source, target in zip(self._sources, self._targets):
                target.copy_(source)
        self.version = version
        return True


#: Tokens at the start of a stop-string window whose text may decode differently there than in the
#: whole completion (a character split over up to 4 byte tokens, a first token's dropped leading
#: space), and last tokens whose text a new token may change (the bytes of a character it completes).
_EDGE_TOKENS = 4


def completion_stop(
    tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int], stops: Sequence[str]
) -> tuple[str, str] | None:
    """The stop string that occurs first in the text of ``token_ids``, and the text past it; ``None`` if none does.

    The answer of :func:`~agents.engines.base.find_stop` on the whole decoded text, for a text that
    held no stop string before its last token (a decode step checks every token): a stop string
    the last token completes ends in the text of the last ``_EDGE_TOKENS`` tokens, so only a
    window of the last tokens is decoded, long enough that, past its first ``_EDGE_TOKENS``
    tokens, it holds the longest stop string before those last ones. Only when the window holds a
    stop string is the whole text decoded, for the exact match and the text past it.
    """
    longest = max(len(stop) for stop in stops)
    end = len(token_ids)
    start = max(0, end - longest - 4 * _EDGE_TOKENS)
    # Between the window's edge tokens and the last ones, the characters a stop string may reach back over
    # (with room for a split character's replacement marks, which a decode of that span alone may count).
    while (
        start > 0
        and len(_decode(tokenizer, token_ids[start + _EDGE_TOKENS : end - _EDGE_TOKENS])) < longest + _EDGE_TOKENS
    ):
        start = max(0, 2 * start - end)  # twice the window
    if find_stop(_decode(tokenizer, token_ids[start:]), stops) is None:
        return None
    text = _decode(tokenizer, token_ids)
    match = find_stop(text, stops)
    return None if match is None else (match[0], text[match[1] :])


def _decode(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int]) -> str:
    text = tokenizer.decode(list(token_ids), skip_special_tokens=True)
    assert isinstance(text, str)  # one sequence decodes to one string (a batch to a list)
    return text


class HFEngine(Engine):
    """A transformers causal LM behind the :class:`Engine` interface (CPU or GPU).

    ``model`` is a model name (see :func:`agents.models.resolve_model`), loaded in ``dtype`` on
    ``device``, or a loaded model to share (used as it is; a trainer's peft LoRA model too); with a
    loaded model pass its ``tokenizer`` too. ``max_batch_size`` caps the rows of
    one forward pass; ``batch_window_s`` is how long an idle worker waits for more requests
    before starting a batch; ``seed`` seeds the generator of requests without their own seed;
    ``prefix_cache_tokens`` bounds the tokens whose KV the prefix cache keeps (0 turns it off;
    the default, None, is as many as :data:`~agents.engines.kv_cache.PREFIX_CACHE_BYTES` (3 GiB) of
    KV hold: 139,810 tokens of SmolLM2-135M in bfloat16. A multihop-qa step of 128 concurrent episodes
    rolled out in 48 s with 131,072 tokens against 75 s with 32,768, the default before: evicted
    contexts are prefilled again at the next turn). ``compute_dtype`` is what the
    forward passes and the KV cache use: by default bfloat16 on a GPU; on a CPU, for a float32 model,
    :func:`~agents.models.cpu_compute_dtype` (bfloat16 where the CPU has AMX or AVX512-BF16),
    else the model's own dtype. A model in another dtype generates from a :class:`ComputeCopy` in it (memory for one
    more copy of the weights in ``compute_dtype``); the sampled tokens' log-probs and entropies are
    computed from float32 logits either way. ``fused_decode`` lets a bfloat16 Llama-family model on a CPU decode with
    a :class:`~agents.engines.fused_decode.FusedDecodeStep` (the same logits, without transformers' modules;
    :attr:`fused_decode` is ``None`` where it does not apply or was turned off). ``max_prefill_tokens`` bounds
    the KV positions (rows x padded columns, cached prefixes included) of one prefill pass: requests
    that join together beyond it are prefilled in several passes (a prompt longer than it goes alone),
    as vLLM bounds a step's tokens with ``max_num_batched_tokens``.
    """

    supports_entropy = True
    supports_inflight_updates = True

    def __init__(
        self,
        model: str | PreTrainedModel | PeftModel = DEFAULT_MODEL,
        tokenizer: str | PreTrainedTokenizerBase | None = None,
        *,
        device: str | torch.device = "cpu",
        dtype: torch.dtype = torch.float32,
        max_batch_size: int = 32,
        batch_window_s: float = 0.005,
        seed: int | None = None,
        prefix_cache_tokens: int | None = None,
        compute_dtype: torch.dtype | None = None,
        fused_decode: bool = True,
        max_prefill_tokens: int = MAX_PREFILL_TOKENS,
    ) -> None:
        if isinstance(model, str):
            tokenizer = model if tokenizer is None else tokenizer
            model = load_model(model, dtype=dtype, device=device)
        elif tokenizer is None:
            raise ValueError("HFEngine(model=<loaded model>) needs tokenizer= as well (an object or a model name)")
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
        if max_prefill_tokens < 1:
            raise ValueError(
                f"max_prefill_tokens must be >= 1 (KV positions of one prefill pass), got {max_prefill_tokens}"
            )
        if prefix_cache_tokens is not None and prefix_cache_tokens < 0:
            raise ValueError(f"prefix_cache_tokens must be >= 0 (0 turns the cache off), got {prefix_cache_tokens}")
        layer_types = getattr(model.config.get_text_config(), "layer_types", None) or ["full_attention"]
        if any(kind != "full_attention" for kind in layer_types):
            raise ValueError(
                f"HFEngine supports models with full attention in every layer; this one has {sorted(set(layer_types))}"
            )
        if model.device.type == "cpu" and model.config._attn_implementation == "sdpa":
            model.set_attn_implementation(CPU_GQA_ATTENTION)
        # A float32 model (the trainer's, shared) generates in bfloat16 on a GPU (half the KV cache, the tensor
        # cores' speed) and on a CPU that multiplies bfloat16 in hardware (docs/benchmarks.md, "The CPU against its
        # limits"); its log-probs then differ from the float32 model's, which the trainer recomputes.
        if compute_dtype is None:
            if model.device.type == "cuda":
                compute_dtype = torch.bfloat16
            else:
                compute_dtype = cpu_compute_dtype() if model.dtype == torch.float32 else model.dtype
        self.compute_dtype: torch.dtype = compute_dtype
        on_gpu = model.device.type == "cuda"
        #: The copy in compute_dtype that the forward passes run (None: they run the model itself).
        self.compute_copy = ComputeCopy(model, compute_dtype) if compute_dtype != model.dtype else None
        forward_model = self.compute_copy.model if self.compute_copy is not None else model
        #: The decode step without transformers' modules (CPU, bfloat16, Llama-family), or None: the forward pass.
        self.fused_decode: FusedDecodeStep | None = None
        if fused_decode and FusedDecodeStep.unsupported(forward_model) is None:
            self.fused_decode = FusedDecodeStep(forward_model)
        # Weight-first products pay off for float32 on MKL only (see WeightFirstLinear).
        weight_first = model.device.type == "cpu" and compute_dtype == torch.float32
        self._forward_mode = WeightFirstLinear if weight_first else contextlib.nullcontext
        # A whole [rows, 1, 1, columns] mask for sdpa on a GPU: from a padding mask transformers would build it
        # after reading whether it masks anything, a wait for the GPU. On a CPU no wait; the padding mask as ever.
        self._whole_mask = on_gpu and model.config._attn_implementation == "sdpa"
        self.model: PreTrainedModel | PeftModel = model
        self.tokenizer: PreTrainedTokenizerBase = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.batch_window_s = batch_window_s
        self.eos_token_ids = _eos_token_ids(model, self.tokenizer)
        self.vocab_size = model.get_output_embeddings().weight.shape[0]
        self.max_positions = getattr(model.config.get_text_config(), "max_position_embeddings", None)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        #: Held by the worker during every forward pass; hold it to change weights in place.
        self.forward_lock = threading.Lock()
        # A load takes this first and the worker passes through it before each pass, so a load waits
        # for one pass at most: a threading.Lock is not fair, and a busy worker would take it back at once.
        self._turnstile = threading.Lock()
        self.stats = BatchStats()
        if prefix_cache_tokens is None:
            per_token = kv_bytes_per_token(model.config.get_text_config(), compute_dtype)
            prefix_cache_tokens = PREFIX_CACHE_BYTES // per_token
        self.prefix_cache = PrefixCache(prefix_cache_tokens)
        self._weights_version = -1
        self._inflight_version: int | None = None  # the last update_weights_in_flight's version
        self._inflight_loads = 0
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
            raise ValueError(
                f"prompt of {len(ids)} tokens leaves no room in the model's {self.max_positions} positions"
            )
        if self._closed:
            raise RuntimeError("HFEngine is closed")
        self._start_worker()
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.model.device).manual_seed(params.seed)
        request = _Request(ids, params, concurrent.futures.Future(), generator)
        self._release_threads()  # this thread's OpenMP team would slow the worker's (a model loaded here)
        self._inbox.put(request)
        # Cancelling this coroutine cancels the future; the worker drops the row at its next step.
        return await asyncio.wrap_future(request.future)

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy ``state_dict`` into the model between forward passes (a partial dict is fine)."""
        await asyncio.to_thread(self._load, state_dict, None)

    async def update_weights_in_flight(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Copy ``state_dict`` into the model between two decode steps; rows in flight go on with it.

        Tokens sampled from then on have ``version`` in :attr:`Completion.token_versions`.
        """
        await asyncio.to_thread(self._load, state_dict, version)

    def _load(self, state_dict: Mapping[str, torch.Tensor], version: int | None) -> None:
        with self._turnstile, self.forward_lock, torch.no_grad():
            result = self.model.load_state_dict(dict(state_dict), strict=False)
            if version is not None:
                self._inflight_version = version
                self._inflight_loads += 1
        self._release_threads()  # an executor thread's
        if result.unexpected_keys:
            raise KeyError(f"weights the model does not have: {result.unexpected_keys[:5]}")

    async def close(self) -> None:
        self._closed = True
        if self._thread is not None:
            self._inbox.put(_CLOSE)
            await asyncio.to_thread(self._thread.join)
            self._thread = None

    # ---- the worker thread -------------------------------------------------------------

    def _release_threads(self) -> None:
        """On CPU, end the calling thread's OpenMP helpers (:func:`~agents.models.release_openmp_threads`)."""
        if self.model.device.type == "cpu":
            release_openmp_threads()

    def _start_worker(self) -> None:
        with self._start_lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, name="HFEngine-worker", daemon=True)
                self._thread.start()

    def _serve(self) -> None:
        waiting: collections.deque[_Request] = collections.deque()
        batch: _Batch | None = None
        while True:
            if not self._collect(waiting, block=batch is None and not waiting):  # queued ones need no wait
                break
            newcomers: list[_Request] = []
            while waiting and len(newcomers) + (len(batch.requests) if batch else 0) < self.max_batch_size:
                request = waiting.popleft()
                if not request.future.cancelled():
                    newcomers.append(request)
            if batch is None and not newcomers:
                continue
            with self._turnstile:  # a load waiting here goes first
                pass
            try:
                with self.forward_lock, torch.inference_mode(), self._forward_mode():
                    if newcomers:
                        start = time.perf_counter()
                        batch = self._join(batch, newcomers)
                        self.stats.prefill_seconds += time.perf_counter() - start
                    assert batch is not None  # joined now, or running (no batch and no newcomers continued above)
                    batch = self._step(batch)
            except Exception as error:  # a failed forward pass fails its rows, not the worker
                for request in (batch.requests if batch else []) + newcomers:
                    _settle(request.future, exception=error)
                if batch is not None:
                    batch.cache.release()
                batch = None
        for request in list(waiting) + (batch.requests if batch else []):
            _settle(request.future, exception=RuntimeError("HFEngine was closed before this request finished"))

    def _collect(self, waiting: collections.deque, block: bool) -> bool:
        """Move arrived requests to ``waiting``; when ``block``, wait for one plus the batch window."""
        try:
            if block:
                self._release_threads()  # idle: the trainer or the caller may compute now
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
        # Before the lookups below: ordered by a stale cache that was emptied only at their prefill, requests
        # sharing a prompt were all prefilled whole in one pass (the first rollout after each training step:
        # one 64-row pass of 520-token prompts took 40.7 s instead of ~2 s).
        self._drop_stale_prefixes()
        hits = self._lookups(requests)
        then: list[_Request] = []
        if self.prefix_cache.max_tokens and len(requests) > 1:
            first, later = shared_prefix_order([r.prompt for r in requests], [hit[0] if hit else 0 for hit in hits])
            requests, hits, then = [requests[i] for i in first], [hits[i] for i in first], [requests[i] for i in later]
        batch = self._add_prefilled(batch, requests, hits, cache_prompts=bool(then))
        if then:  # their shared prefixes are now cached: they prefill only the rest
            batch = self._add_prefilled(batch, then, self._lookups(then), cache_prompts=False)
        self._set_sampler_rows(batch)
        return batch

    def _lookups(self, requests: list[_Request]) -> list[_Hit]:
        """Each request's longest cached prefix (a prompt token is always run: its logits give the first sampled token)."""
        return [self.prefix_cache.lookup(r.prompt, limit=len(r.prompt) - 1) for r in requests]

    def _add_prefilled(
        self, batch: _Batch | None, requests: list[_Request], hits: list[_Hit], cache_prompts: bool
    ) -> _Batch:
        """Prefill ``requests`` (``hits``: their lookups) in bounded passes, each pass's rows joining ``batch``
        (or starting one) before the next; with ``cache_prompts`` their prompts' KV goes to the prefix cache."""
        for chunk, chunk_hits in self._prefill_chunks(requests, hits):
            sequences, logits = self._prefill(chunk, chunk_hits)
            if cache_prompts:
                for request, kv in zip(chunk, sequences):
                    self.prefix_cache.add(request.prompt, kv)
            if batch is None:
                cache = SlotCache(
                    len(sequences[0]), self.max_batch_size, device=logits.device, dtype=self.compute_dtype
                )
                batch = _Batch([], cache, logits[:0], RowSampler(logits.device))
            batch.cache.add_rows(sequences)
            for request in chunk:
                request.next_version, request.loads_at_prefill = self._inflight_version, self._inflight_loads
            batch.requests += chunk
            batch.logits = torch.cat([batch.logits, logits])
            del sequences  # the chunk's KV now lives in the batch's room (and the prefix cache)
        assert batch is not None  # requests is never empty
        return batch

    def _prefill_chunks(self, requests: list[_Request], hits: list[_Hit]) -> list[tuple[list[_Request], list[_Hit]]]:
        """``requests`` in prefill passes of at most ``max_prefill_tokens`` KV positions each, with their cache hits.

        A pass holds rows x (longest cached prefix + longest uncached rest) positions several times
        over (the prefix cache's KV gathered, the pass's own cache, each row's copy), so one pass of
        every joining request grew a 128-episode multihop-qa rollout by ~5 GB at once. Rows sorted by
        their cached and uncached lengths share a pass with rows like them, which also pads less.
        """
        reused = [hit[0] if hit else 0 for hit in hits]
        order = sorted(range(len(requests)), key=lambda i: (reused[i], len(requests[i].prompt) - reused[i]))
        chunks: list[tuple[list[_Request], list[_Hit]]] = []
        cached = new = 0  # the last chunk's padded widths
        for i in order:
            row_cached, row_new = reused[i], len(requests[i].prompt) - reused[i]
            if (
                chunks
                and (len(chunks[-1][0]) + 1) * (max(cached, row_cached) + max(new, row_new)) <= self.max_prefill_tokens
            ):
                cached, new = max(cached, row_cached), max(new, row_new)
            else:
                chunks.append(([], []))
                cached, new = row_cached, row_new
            chunks[-1][0].append(requests[i])
            chunks[-1][1].append(hits[i])
        return chunks

    def _set_sampler_rows(self, batch: _Batch) -> None:
        """Give the batch's sampler its rows' parameters and generators (after rows joined or left)."""
        batch.sampler.set_rows(
            [r.params for r in batch.requests], [r.generator or self._generator for r in batch.requests]
        )

    def _forward_model(self) -> torch.nn.Module:
        """What a forward pass runs: the model, or on a GPU its copy in compute_dtype, brought up to date first."""
        if self.compute_copy is None:
            return self.model
        self.compute_copy.refresh()
        return self.compute_copy.model

    def _drop_stale_prefixes(self) -> None:
        """Empty the prefix cache if the weights changed since its KV was computed."""
        version = weights_version(self.model.parameters())
        if version != self._weights_version:
            if len(self.prefix_cache):
                self.prefix_cache.clear()
                release_free_memory()  # up to PREFIX_CACHE_BYTES just freed, among other sizes
            self._weights_version = version

    def _prefill(
        self, requests: list[_Request], hits: list[_Hit]
    ) -> tuple[list[list[tuple[torch.Tensor, torch.Tensor]]], torch.Tensor]:
        """One forward pass over the prompts' tokens that the prefix cache does not hold.

        ``hits`` are the prompts' prefix-cache lookups (:meth:`_lookups`). Returns each prompt's KV per layer
        ([kv heads, prompt length, head dim]) and the logits of its next token. Row layout of the
        pass: [left padding | cached prefix | padding | new tokens], so that the new tokens of every
        row end at the right edge.
        """
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
                keys, values = (
                    torch.zeros((rows, heads, cached, dim), dtype=self.compute_dtype, device=device) for _ in "kv"
                )
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
        output = self._forward_model()(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=cache,
            use_cache=True,
            # An index, not logits_to_keep=1: transformers' slice [:, -1:] is a strided view, and torch's matmul
            # multiplies one by expanding the output layer's weight per row (64 rows of SmolLM2: a 3.6 GB copy, 6 s).
            logits_to_keep=torch.tensor([new - 1], device=device),
        )
        self.stats.prefill_passes += 1
        sequences = []
        for row in range(rows):
            columns = attention_mask[row].nonzero()[:, 0]
            sequences.append(
                [
                    (keys[row].index_select(1, columns), values[row].index_select(1, columns))
                    for keys, values, *_ in cache
                ]
            )
        return sequences, output.logits[:, -1].float()

    def _step(self, batch: _Batch) -> _Batch | None:
        """Sample one token for every row, settle finished rows, and run the next decode pass."""
        start = time.perf_counter()
        sampled = batch.sampler.sample(batch.logits).to_host()  # the step's one wait for the device
        self.stats.generated_tokens += len(batch.requests)  # before settling: a woken caller may read it
        leaving = []
        for row, request in enumerate(batch.requests):
            token = sampled.token_ids[row]
            request.token_ids.append(token)
            request.logprobs.append(sampled.logprobs[row])
            request.versions.append(request.next_version)
            if request.params.logprobs_topk:
                request.top_logprobs.append(sampled.top_logprobs[row][: request.params.logprobs_topk])
            if request.params.return_entropy:
                assert sampled.entropies is not None  # computed when any row asks for them
                request.token_entropies.append(sampled.entropies[row])
            completion = self._finish(request, token, batch.cache.host_lengths[row] + 1)
            if completion is not None and request.loads_at_prefill == self._inflight_loads:
                # The cache holds the prompt and every sampled token but this last one.
                self.prefix_cache.add(request.prompt + request.token_ids[:-1], batch.cache.row(row))
            if completion is not None:
                _settle(request.future, result=completion)
            if completion is not None or request.future.cancelled():
                leaving.append(row)
        for row in reversed(leaving):  # from the end, so the last row, moved into the gap, is one that stays
            batch.cache.remove_row(row)
            batch.requests[row] = batch.requests[-1]
            batch.requests.pop()
        if not batch.requests:
            batch.cache.release()
            self.stats.decode_seconds += time.perf_counter() - start
            return None
        if leaving:
            self._set_sampler_rows(batch)
        next_tokens = to_device([[r.token_ids[-1]] for r in batch.requests], torch.long, self.model.device)
        attention_mask, position_ids = batch.cache.decode_inputs()
        if self.fused_decode is not None:
            self._forward_model()  # brings the compute copy up to date
            batch.logits = self.fused_decode(next_tokens[:, 0], attention_mask, batch.cache)
        else:
            if self._whole_mask:
                attention_mask = attention_mask.bool()[:, None, None, :]
            output = self._forward_model()(
                input_ids=next_tokens,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=batch.cache,
                use_cache=True,
            )
            batch.logits = output.logits[:, -1].float()
        batch.cache.advance()
        for request in batch.requests:
            request.next_version = self._inflight_version
        self.stats.decode_seconds += time.perf_counter() - start
        self.stats.decode_passes += 1
        self.stats.decode_rows += len(batch.requests)
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
        elif token in self.eos_token_ids and not params.ignore_eos:
            reason = "eos"
        elif params.stop:
            match = completion_stop(self.tokenizer, request.token_ids, params.stop)
            if match is not None:
                reason, (stop_reason, overshoot) = "stop", match
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
            token_entropies=request.token_entropies if params.return_entropy else None,
            # versions go from None (before the first in-flight load) to ints, never back
            token_versions=request.versions if request.versions[-1] is not None else None,
        )


def _settle(future: concurrent.futures.Future, *, result=None, exception: BaseException | None = None) -> None:
    """Complete ``future`` unless its caller cancelled it meanwhile."""
    try:
        if exception is not None:
            future.set_exception(exception)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


def _eos_token_ids(model: PreTrainedModel | PeftModel, tokenizer: PreTrainedTokenizerBase) -> frozenset[int]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = [] if ids is None else [ids] if isinstance(ids, int) else list(ids)
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return frozenset(ids)
