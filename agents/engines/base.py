"""The engine contract: token ids in, sampled token ids with their log-probs out.

Every engine implements one coroutine, :meth:`Engine.generate`, that many episodes call at the
same time. Its result is exact: ``Completion.token_ids`` are the ids the sampler drew, in order,
never decoded and re-encoded, so a trainer can recompute log-probs on exactly those ids.

Log-prob convention (all engines). ``Completion.logprobs[i]`` is the log-probability of the
sampled token under the distribution it was sampled from: the model's logits divided by the
temperature, then restricted by top-k and top-p and renormalised (vLLM's
``logprobs_mode="processed_logprobs"``, the mode verl's vLLM rollout uses for rollout log-probs).
With top-k and top-p off, as in the RL recipes of AT²PO, AEPO and ARPO, this is
``log_softmax(logits / T)``, the quantity verl's actor recomputes as the old policy's log-prob.
Greedy decoding (``temperature=0``) reports ``log_softmax(logits)``, i.e. temperature 1.

Stops. Generation ends at the first sampled token that is an end-of-sequence id
(``finish_reason="eos"``), one of ``stop_token_ids`` or the token whose text completes one of
the ``stop`` strings (``"stop"``), or after ``max_new_tokens`` (``"length"``). The stopping
token is part of ``token_ids``. A BPE token can carry characters beyond a stop string (a token
``">\\n"`` completing ``"</search"`` + ``">"``); the ids are kept exactly as sampled and the
extra characters are reported in ``Completion.stop_overshoot`` so an environment can decide
what to do with them. (SmolLM2 tokenises ``"</search>"`` as ``"</"``, ``"search"``, ``">"``, so
its overshoot is usually empty.)
"""

from __future__ import annotations

import abc
import asyncio
import math
import operator
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "BatchStats",
    "Completion",
    "Engine",
    "FinishReason",
    "SamplingParams",
    "WeightReceiver",
    "find_stop",
    "stop_overshoot",
    "update_then_sync",
]

FinishReason = Literal["stop", "length", "eos"]

# Long enough for one agent turn (reasoning + one tool call); the papers cap a whole response,
# tool results included, at 6192 tokens (docs/algorithms/training.md "Token budgets").
DEFAULT_MAX_NEW_TOKENS = 512


@dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion.

    ``temperature=0`` is greedy decoding; ``top_k=-1`` and ``top_p=1`` switch those filters off;
    ``stop`` are strings and ``stop_token_ids`` ids that end generation (see the module
    docstring); ``seed`` makes a sample reproducible on the same engine; ``logprobs_topk`` asks
    for that many top log-probs per position; ``return_entropy`` asks for the entropy of the full
    temperature-scaled next-token distribution per position (engines with
    ``supports_entropy``); ``ignore_eos`` goes on past end-of-sequence tokens up to ``max_new_tokens``
    or a stop (vLLM's ``ignore_eos``: fixed-length generations for benchmarks).
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    logprobs_topk: int = 0
    return_entropy: bool = False
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        # Lists are accepted for convenience and stored as tuples so params stay hashable.
        object.__setattr__(self, "stop", _as_tuple(self.stop, str, "stop"))
        object.__setattr__(self, "stop_token_ids", _as_tuple(self.stop_token_ids, int, "stop_token_ids"))
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 switches it off), got {self.top_p!r}")
        if self.top_k != -1 and self.top_k < 1:
            raise ValueError(f"top_k must be -1 (off) or >= 1, got {self.top_k!r}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens!r}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(i < 0 for i in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be >= 0, got {self.stop_token_ids!r}")
        if self.logprobs_topk < 0:
            raise ValueError(f"logprobs_topk must be >= 0, got {self.logprobs_topk!r}")

    @property
    def greedy(self) -> bool:
        """Whether this asks for greedy decoding (temperature 0)."""
        return self.temperature == 0


@dataclass
class Completion:
    """What one :meth:`Engine.generate` call sampled.

    ``logprobs[i]`` belongs to ``token_ids[i]`` (see the module docstring for the
    distribution); ``top_logprobs[i]`` lists ``(token_id, logprob)`` pairs, best first, when
    asked for; ``token_entropies[i]`` is the full-vocabulary entropy at position ``i`` when asked for.
    ``stop_reason`` is the matched stop string or stop token id (``None`` for ``"length"`` and
    ``"eos"``); ``stop_overshoot`` the text the last token carries beyond a matched stop string.
    ``version`` is the version of the weights that sampled it, where a rollout worker's
    gate stamps it (:class:`agents.run.cluster.rollout_workers.VersionGate`; ``None`` elsewhere): the
    oldest token's when the weights changed while it was generated. ``token_versions[i]`` is the
    version that sampled ``token_ids[i]``, from an engine that loaded weights in flight
    (:meth:`Engine.update_weights_in_flight`; ``None`` for a token sampled before its first such
    load, and for the whole list elsewhere).
    """

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    stop_reason: str | int | None = None
    stop_overshoot: str = ""
    top_logprobs: list[list[tuple[int, float]]] | None = None
    token_entropies: list[float] | None = None
    version: int | None = None
    token_versions: list[int | None] | None = None

    def __post_init__(self) -> None:
        if len(self.logprobs) != len(self.token_ids):
            raise ValueError(f"{len(self.logprobs)} logprobs for {len(self.token_ids)} tokens")
        for name in ("top_logprobs", "token_entropies", "token_versions"):
            values = getattr(self, name)
            if values is not None and len(values) != len(self.token_ids):
                raise ValueError(f"{len(values)} {name} for {len(self.token_ids)} tokens")


@dataclass
class BatchStats:
    """Counters of an engine's forward passes (HFEngine's ``stats``): whether requests were batched, how busy it was."""

    prefill_passes: int = 0
    decode_passes: int = 0
    generated_tokens: int = 0
    largest_batch: int = 0  # most rows decoded together in one forward pass
    prompt_tokens: int = 0  # prompt tokens of all requests
    prefix_cache_hit_tokens: int = 0  # of those, the ones whose KV came from the prefix cache
    prefill_seconds: float = 0.0  # wall time in prefill passes (KV copies included)
    decode_seconds: float = 0.0  # wall time in decode steps (sampling, settling finished rows, the pass)
    decode_rows: int = 0  # rows of all decode passes (per pass: the batch's size)

    def since(self, earlier: BatchStats) -> BatchStats:
        """The counts between ``earlier`` (a copy of these stats) and now; ``largest_batch`` is the largest so far."""
        return self._combined(earlier, operator.sub, self.largest_batch)

    def plus(self, other: BatchStats) -> BatchStats:
        """These counts and ``other``'s added (``largest_batch``: the larger)."""
        return self._combined(other, operator.add, max(self.largest_batch, other.largest_batch))

    def _combined(self, other: BatchStats, op: Callable[[Any, Any], Any], largest_batch: int) -> BatchStats:
        counts = {name: op(getattr(self, name), getattr(other, name)) for name in self.__dataclass_fields__}
        return BatchStats(**{**counts, "largest_batch": largest_batch})

    def usage(self, seconds: float) -> dict[str, float]:
        """``engine/*`` metrics of counts over ``seconds`` of wall time (a rollout's).

        ``engine/busy_frac``: the fraction of the time the worker ran forward passes or sampled;
        ``engine/mean_rows``: rows per decode pass (how full it kept its batches); ``engine/busy_tokens_per_s``:
        generated tokens per busy second (the engine's own rate at those rows); ``engine/prefill_frac``: the
        share of the busy time in prefill passes (prompts and the turns' new tokens joining the batch).
        """
        busy = self.prefill_seconds + self.decode_seconds
        return {
            "engine/busy_frac": busy / seconds if seconds > 0 else 0.0,
            "engine/prefill_frac": self.prefill_seconds / busy if busy > 0 else 0.0,
            "engine/mean_rows": self.decode_rows / self.decode_passes if self.decode_passes else 0.0,
            "engine/busy_tokens_per_s": self.generated_tokens / busy if busy > 0 else 0.0,
        }


class WeightReceiver(Protocol):
    """What a trainer hands its new weights to after each step: an :class:`Engine`, or a pool of engines on
    rollout workers (:class:`agents.run.cluster.rollout_workers.RolloutPool`)."""

    @property
    def supports_sleep(self) -> bool:
        """Whether :meth:`sleep` releases accelerator memory the trainer's update may use."""
        ...

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load the full weights (names as the trainer's model has them)."""
        ...

    async def sleep(self, level: int = 1) -> None:
        """Release accelerator memory until :meth:`wake_up` (level 2: the weights too)."""
        ...

    async def wake_up(self) -> None:
        """Take the memory back (after a level-2 sleep, the next :meth:`update_weights` restores the weights)."""
        ...


_Result = TypeVar("_Result")


async def update_then_sync(
    engine: WeightReceiver | None,
    update: Callable[[], Awaitable[_Result]],
    sync: Callable[[], Awaitable[None]],
    *,
    sleep: bool,
    keep_weights: bool,
    before_wake: Callable[[], None] | None = None,
) -> tuple[_Result, float]:
    """A training step's turn with its engine: ``engine`` sleeps through ``update`` (when ``sleep`` and it
    can), wakes, and ``sync`` hands it the new weights.

    The one place that orders these (:class:`agents.training.trainer.Trainer` and
    :class:`agents.run.cluster.trainer_ranks.TrainerGroup` both step through it). ``keep_weights``: the
    engine keeps its weights while asleep (level 1), for a sync that sends only some of them (LoRA's
    adapted layers); otherwise level 2 drops them and the sync reloads them all. ``before_wake`` runs
    before the engine takes its memory back (the trainer drops its gradients). Returns the update's
    result and the seconds spent on the engine (sleeping, waking, syncing).
    """
    sleeping = engine if sleep and engine is not None and engine.supports_sleep else None
    start = time.perf_counter()
    if sleeping is not None:
        await sleeping.sleep(level=1 if keep_weights else 2)
    engine_seconds = time.perf_counter() - start
    result = await update()
    start = time.perf_counter()
    if sleeping is not None:
        if before_wake is not None:
            before_wake()
        await sleeping.wake_up()
    await sync()
    return result, engine_seconds + time.perf_counter() - start


class Engine(abc.ABC):
    """Generates completions for token-id prompts; safe to call from many coroutines at once."""

    #: Whether ``SamplingParams(return_entropy=True)`` is supported.
    supports_entropy: bool = False
    #: Whether :meth:`sleep` releases the engine's accelerator memory (vLLM on a GPU). A trainer
    #: on the same device puts such an engine to sleep while it updates.
    supports_sleep: bool = False
    #: Whether :meth:`update_weights_in_flight` is supported: weights change between two decode
    #: steps while requests go on, and each sampled token records its version.
    supports_inflight_updates: bool = False

    @abc.abstractmethod
    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        """Sample one completion of ``prompt_ids`` under ``params``."""

    async def generate_many(
        self, prompts: Sequence[Sequence[int]], params: SamplingParams | Sequence[SamplingParams]
    ) -> list[Completion]:
        """Generate for many prompts concurrently; one ``params`` for all, or one per prompt."""
        per_prompt = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} SamplingParams for {len(prompts)} prompts")
        return list(await asyncio.gather(*(self.generate(p, s) for p, s in zip(prompts, per_prompt))))

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load new weights (names as in the transformers model's ``state_dict``) without a restart.

        Engines that cannot change their weights (a remote server) raise ``TypeError``.
        """
        raise TypeError(f"{type(self).__name__} cannot load weights from a trainer")

    async def update_weights_in_flight(self, state_dict: Mapping[str, torch.Tensor], version: int) -> None:
        """Load new weights between two decode steps, without waiting for the requests in flight.

        The whole ``state_dict`` changes at once; requests in flight go on with the new weights
        (their earlier tokens' KV stays as the old weights computed it, as PipelineRL does), and
        every token sampled from the new weights' logits has ``version`` in
        :attr:`Completion.token_versions`. Its log-prob is the sampling distribution's, so it
        is the behaviour policy of the decoupled objective. Engines without
        ``supports_inflight_updates`` raise ``TypeError``.
        """
        raise TypeError(
            f"{type(self).__name__} cannot change its weights while requests are in flight "
            "(supports_inflight_updates is False); load them between requests with update_weights"
        )

    async def sleep(self, level: int = 1) -> None:
        """Release accelerator memory until :meth:`wake_up`: the KV cache, and the weights (level 1
        keeps a copy in CPU memory; level 2 drops them, so load weights with :meth:`update_weights`
        after waking). Engines without ``supports_sleep`` raise ``TypeError``."""
        raise TypeError(f"{type(self).__name__} cannot sleep (supports_sleep is False)")

    async def wake_up(self) -> None:
        """Take back what :meth:`sleep` released."""
        raise TypeError(f"{type(self).__name__} cannot sleep (supports_sleep is False)")

    async def close(self) -> None:
        """Release the engine's resources; it cannot generate afterwards."""

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()

    def _check_request(self, prompt_ids: Sequence[int], params: SamplingParams, vocab_size: int) -> list[int]:
        """Validate a request the same way in every engine; returns the prompt as a list of ints."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
        ids = list(map(int, prompt_ids))  # map, min and max run in C: this is on every turn's path
        if not ids:
            raise ValueError("prompt_ids is empty; an engine needs at least one prompt token")
        if min(ids) < 0 or max(ids) >= vocab_size:
            bad = [i for i in ids if not 0 <= i < vocab_size]
            raise ValueError(f"prompt_ids hold ids outside the vocabulary [0, {vocab_size}): {bad[:5]}")
        if params.return_entropy and not self.supports_entropy:
            raise ValueError(
                f"{type(self).__name__} cannot return full-vocabulary entropies; use HFEngine, or "
                f"compute them in the trainer's forward pass, or ask for logprobs_topk to estimate them"
            )
        return ids


def find_stop(text: str, stops: Sequence[str]) -> tuple[str, int] | None:
    """The stop string that occurs first in ``text`` and the index just past it, or ``None``."""
    best: tuple[str, int] | None = None
    best_start = len(text) + 1
    for stop in stops:
        start = text.find(stop)
        if start != -1 and start < best_start:
            best, best_start = (stop, start + len(stop)), start
    return best


def stop_overshoot(tokenizer: PreTrainedTokenizerBase, token_ids: Sequence[int], stop: str) -> str:
    """The text the completion's last token carries beyond its first occurrence of ``stop``."""
    text = tokenizer.decode(list(token_ids), skip_special_tokens=True)
    assert isinstance(text, str)  # one sequence decodes to one string (a batch to a list)
    match = find_stop(text, [stop])
    return text[match[1] :] if match else ""


def _as_tuple(values, kind: type, name: str) -> tuple:
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
        raise TypeError(f"{name} must be a sequence of {kind.__name__}, got {values!r}")
    if not all(isinstance(v, kind) and not isinstance(v, bool) for v in values):
        raise TypeError(f"{name} must hold only {kind.__name__} values, got {values!r}")
    return tuple(values)
