"""Sampling one token per row of a batch of logits, with vLLM's semantics (temperature, top-k, top-p, seeds)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from agents.engines.base import SamplingParams

__all__ = ["SampledTokens", "sample_next_tokens"]


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
        # H = -Σ p log p over the whole vocabulary (the exact token entropy, docs/algorithms.md eq. 2).
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
