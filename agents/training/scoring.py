"""Scoring tokens from logits: the one place where "the logits at t − 1 score token t" is written.

Every consumer of a forward pass over saved ids (the trainer's log-probs and entropies, the
sampler/trainer mismatch check, the benchmarks) calls :func:`score_tokens`, so they all agree
on the shift and on the temperature: a token sampled at temperature T has the log-prob
``log softmax(z / T)[token]`` (docs/algorithms.md "Log-probs and temperature").
"""

from __future__ import annotations

import torch

__all__ = ["score_tokens"]


def score_tokens(
    logits: torch.Tensor,
    ids: torch.Tensor,
    temperature: float = 1.0,
    *,
    entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs of ``ids[:, 1:]`` under the distributions the logits before them give, and their entropies.

    Args:
        logits: ``[batch, tokens, vocab]`` from a forward pass over ``ids``.
        ids: ``[batch, tokens]`` token ids.
        temperature: The sampler's temperature: logits are divided by it (greedy sampling reports
            temperature-1 log-probs: pass 1).
        entropy: Also return the entropy of each of those distributions (the exact token entropy,
            over the whole vocabulary: docs/algorithms.md eqs. 2, 3).
        entropy_grad: Let the entropy carry a gradient (an entropy bonus); otherwise it is computed
            without one, which saves the memory of a second graph through the softmax.

    Returns:
        ``(logprobs, entropies)``, each ``[batch, tokens − 1]`` and aligned with ``ids[:, 1:]``
        (``entropies`` is ``None`` unless asked for). Position 0 has no context and no score.
    """
    scaled = logits[:, :-1].float() / temperature
    log_z = torch.logsumexp(scaled, dim=-1)
    # log softmax(z/T)[token]  (docs/algorithms.md eq. 4)
    logprobs = scaled.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1) - log_z
    entropies = None
    if entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            # H = log Z − Σ_v p_v z_v  (docs/algorithms.md eq. 3)
            entropies = log_z - (torch.softmax(scaled, dim=-1) * scaled).sum(-1)
    return logprobs, entropies
