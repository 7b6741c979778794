"""Sampling one token per row of a batch of logits, with vLLM's semantics (temperature, top-k, top-p, seeds).

:class:`RowSampler` keeps a running batch's parameters as device tensors, built when rows join or
leave rather than at every step, and :meth:`SampledTokens.to_host` brings a step's ids, log-probs,
entropies and top-k log-probs to the host in one transfer: on a GPU a decode step then waits for
the device once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agents.engines.base import SamplingParams

__all__ = ["HostTokens", "RowSampler", "SampledTokens", "sample_next_tokens", "to_device"]


def to_device(values: Sequence, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``values`` as a tensor on ``device``; onto a GPU through pinned memory, so the host does not wait
    for the device (a copy from ordinary memory waits for all the work queued before it)."""
    if torch.device(device).type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    return torch.tensor(values, dtype=dtype, pin_memory=True).to(device, non_blocking=True)


@dataclass
class HostTokens:
    """A sampling step's results as Python values (see :meth:`SampledTokens.to_host`)."""

    token_ids: list[int]
    logprobs: list[float]
    entropies: list[float] | None
    top_logprobs: list[list[tuple[int, float]]]  # per row, the largest requested top-k, best first


@dataclass
class SampledTokens:
    """One sampling step over a batch of rows (see :func:`sample_next_tokens`), on the logits' device."""

    token_ids: torch.Tensor  # [rows]
    logprobs: torch.Tensor  # [rows] log-prob of each sampled id under its sampling distribution
    entropies: torch.Tensor | None  # [rows] entropy of the full temperature-scaled distribution, if asked
    top_ids: torch.Tensor | None = None  # [rows, k] the largest requested top-k's ids, best first (k > 0)
    top_values: torch.Tensor | None = None  # [rows, k] their log-probs

    @property
    def top_logprobs(self) -> list[list[tuple[int, float]]]:
        """Per row, the largest requested top-k as (id, log-prob), best first (empty lists if none was asked)."""
        if self.top_ids is None or self.top_values is None:
            return [[] for _ in range(len(self.token_ids))]
        return [list(zip(i.tolist(), v.tolist())) for i, v in zip(self.top_ids, self.top_values)]

    def to_host(self) -> HostTokens:
        """Everything as Python values, read from the device in one transfer.

        float64 holds every id (< 2**53) and float32 log-prob exactly, so the values are those that
        reading each tensor on its own gives.
        """
        columns = [self.token_ids.double()[:, None], self.logprobs.double()[:, None]]
        if self.entropies is not None:
            columns.append(self.entropies.double()[:, None])
        k = 0 if self.top_ids is None or self.top_values is None else self.top_ids.shape[1]
        if k:
            assert self.top_ids is not None and self.top_values is not None
            columns += [self.top_ids.double(), self.top_values.double()]
        rows = torch.cat(columns, dim=1).tolist()
        first_top = 2 + (self.entropies is not None)
        return HostTokens(
            token_ids=[int(row[0]) for row in rows],
            logprobs=[row[1] for row in rows],
            entropies=None if self.entropies is None else [row[2] for row in rows],
            top_logprobs=[
                [(int(i), v) for i, v in zip(row[first_top : first_top + k], row[first_top + k :])] for row in rows
            ],
        )


class RowSampler:
    """The sampling parameters of a running batch's rows, as tensors on ``device``.

    :meth:`set_rows` is called when rows join or leave (it copies their parameters to the device
    without waiting for it); :meth:`sample` then reads none of them from the host.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        self.set_rows([], [])

    def set_rows(self, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]) -> None:
        """The rows' parameters and random generators, in row order."""
        self.params, self.generators = list(params), list(generators)
        # Greedy rows use temperature 1 for their log-probs (vLLM does the same).
        temperatures = [p.temperature or 1.0 for p in params]
        self.temperature = to_device(temperatures, torch.float32, self.device)
        self.scaled = any(t != 1.0 for t in temperatures)  # else the logits are their own scaled logits
        self.filtered = not all(p.top_k == -1 and p.top_p == 1.0 for p in params)
        self.top_k = to_device([p.top_k for p in params], torch.long, self.device)  # -1: the whole vocabulary
        self.top_p = to_device([p.top_p for p in params], torch.float32, self.device)
        self.entropy = any(p.return_entropy for p in params)
        self.logprobs_topk = max((p.logprobs_topk for p in params), default=0)
        sampled = [row for row, p in enumerate(params) if not p.greedy]
        self.sampled_generators = [self.generators[row] for row in sampled]
        # None: every row samples (the sampled rows are then the batch itself, not a copy)
        self.sampled_rows = None if len(sampled) == len(params) else to_device(sampled, torch.long, self.device)

    def sample(self, logits: torch.Tensor) -> SampledTokens:
        """One token per row of ``logits`` [rows, vocab], each row under its own parameters.

        The same semantics as vLLM's sampler: temperature, then top-k, then top-p on what top-k
        kept; greedy rows take the arg-max and report temperature-1 log-probs.
        """
        logits = logits.float()
        # Each skip below saves a pass over [rows, vocab] floats (1-4 ms at 64 rows of a 49k vocabulary on a CPU).
        scaled = logits / self.temperature[:, None] if self.scaled else logits
        full_logprobs = torch.log_softmax(scaled, dim=-1)
        filtered = _filter_top_k_top_p(scaled, self.top_k, self.top_p) if self.filtered else scaled
        logprobs = full_logprobs if filtered is scaled else torch.log_softmax(filtered, dim=-1)
        entropies = None
        if self.entropy:
            # H = -Σ p log p over the whole vocabulary (the exact token entropy, docs/algorithms/index.md eq. 2).
            entropies = -(full_logprobs.exp() * full_logprobs).sum(-1)
        if self.sampled_generators and self.sampled_rows is None:  # every row samples
            token_ids = _inverse_cdf_sample(logprobs, self.sampled_generators, filtered=self.filtered)
        else:
            token_ids = logits.argmax(-1)
            if self.sampled_generators:
                rows = self.sampled_rows
                token_ids[rows] = _inverse_cdf_sample(logprobs[rows], self.sampled_generators, filtered=self.filtered)
        chosen = logprobs.gather(-1, token_ids[:, None])[:, 0]
        top_ids = top_values = None
        if self.logprobs_topk:
            top_values, top_ids = logprobs.topk(self.logprobs_topk, dim=-1)
        return SampledTokens(token_ids, chosen, entropies, top_ids, top_values)


def sample_next_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator]
) -> SampledTokens:
    """Sample one token per row of ``logits`` [rows, vocab] under each row's own parameters.

    The same semantics as vLLM's sampler: temperature, then top-k, then top-p on what top-k kept;
    greedy rows take the arg-max and report temperature-1 log-probs. A running batch keeps a
    :class:`RowSampler` instead, which builds the parameters' tensors once.
    """
    sampler = RowSampler(logits.device)
    sampler.set_rows(params, generators)
    return sampler.sample(logits)


def _inverse_cdf_sample(
    logprobs: torch.Tensor, generators: Sequence[torch.Generator], filtered: bool = True
) -> torch.Tensor:
    """One draw per row from exp(logprobs): the first token whose cumulative probability exceeds
    u·total, u ~ U[0, 1) from the row's generator (one random number per token; torch.multinomial
    costs about 40x more on a 49k vocabulary). ``filtered=False`` says no log-prob is -inf."""
    cdf = logprobs.exp().cumsum(-1)
    u = torch.stack([torch.rand((), generator=g, device=logprobs.device) for g in generators])
    index = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
    # u·total can round up to the total; take the last token that has probability then.
    if not filtered:
        return index.clamp(max=logprobs.shape[-1] - 1)
    last_possible = logprobs.shape[-1] - 1 - (logprobs > float("-inf")).flip(-1).long().argmax(-1)
    return torch.minimum(index, last_possible)


def _filter_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Set logits outside each row's top-k (-1: all), then outside its top-p nucleus, to -inf."""
    vocab = scaled.shape[-1]
    top_k = torch.where((top_k == -1) | (top_k > vocab), vocab, top_k)
    ordered, order = scaled.sort(dim=-1, descending=True)
    # top-k: keep logits >= the k-th largest (ties at the boundary are kept, as in vLLM).
    kth = ordered.gather(-1, (top_k - 1)[:, None])
    ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    # top-p: keep the smallest prefix whose probability reaches p; the best token always stays.
    probs = ordered.softmax(-1)
    outside = (probs.cumsum(-1) - probs) >= top_p[:, None]
    ordered = ordered.masked_fill(outside, float("-inf"))
    return torch.full_like(scaled, float("-inf")).scatter(-1, order, ordered)
