"""Scoring tokens from logits: the one place where "the logits at t − 1 score token t" is written.

Every consumer of a forward pass over saved ids (the trainer's log-probs and entropies, the
sampler/trainer mismatch check, the benchmarks) scores through this module, so they all agree
on the shift and on the temperature: a token sampled at temperature T has the log-prob
``log softmax(z / T)[token]`` (docs/algorithms/index.md "Log-probs and temperature").

:func:`score_tokens` scores every token from a forward pass's logits. :func:`score_positions`
scores chosen tokens only, from the hidden states, running the output layer on a chunk of
positions at a time and recomputing each chunk in the backward pass: the trainer then holds
one chunk's float32 logits instead of ``[batch, tokens, vocab]`` of them (about 20 GB for four
8k-token paths of a 150k-token vocabulary). In a packed row (:mod:`agents.training.packing`) the
token before a token is not always the one to its left; :func:`score_logits` and
:func:`score_states` take the distributions (or hidden states) already paired with the tokens
they score.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.utils.checkpoint import checkpoint

__all__ = ["score_logits", "score_positions", "score_states", "score_tokens"]


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
            over the whole vocabulary: docs/algorithms/index.md eqs. 2, 3).
        entropy_grad: Let the entropy carry a gradient (an entropy bonus); otherwise it is computed
            without one, which saves the memory of a second graph through the softmax.

    Returns:
        ``(logprobs, entropies)``, each ``[batch, tokens − 1]`` and aligned with ``ids[:, 1:]``
        (``entropies`` is ``None`` unless asked for). Position 0 has no context and no score.
    """
    return score_logits(logits[:, :-1], ids[:, 1:], temperature, entropy=entropy, entropy_grad=entropy_grad)


def score_positions(
    hidden: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    ids: torch.Tensor,
    positions: torch.Tensor,
    temperature: float = 1.0,
    *,
    entropy: bool = False,
    entropy_grad: bool = False,
    chunk_size: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of the tokens ``ids[positions]`` only, from the hidden states before them.

    Args:
        hidden: ``[batch, tokens, width]``, the last hidden states of a forward pass over ``ids``.
        head: The output layer (``model.get_output_embeddings()``): hidden states to logits.
        ids: ``[batch, tokens]`` token ids.
        positions: ``[n, 2]`` (row, column) of the tokens to score; every column ≥ 1.
        temperature, entropy, entropy_grad: as in :func:`score_tokens`.
        chunk_size: Positions whose logits exist at once. Under autograd each chunk is
            recomputed in the backward pass, so only the hidden states are kept.

    Returns:
        ``(logprobs, entropies)``, each ``[n]`` and aligned with ``positions``; the same values as
        :func:`score_tokens` at those tokens, up to float rounding of the smaller matrix products.
    """
    rows, columns = positions[:, 0], positions[:, 1]
    if bool((columns < 1).any()):
        raise ValueError("positions must have columns >= 1: the first token has no context to be scored from")
    states = hidden[rows, columns - 1]  # the hidden state at t − 1 scores token t
    return score_states(
        states,
        head,
        ids[rows, columns],
        temperature,
        entropy=entropy,
        entropy_grad=entropy_grad,
        chunk_size=chunk_size,
    )


def score_states(
    states: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    entropy: bool = False,
    entropy_grad: bool = False,
    chunk_size: int = 2048,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) of ``targets[i]`` under ``head(states[i])``, ``chunk_size`` at a time.

    ``states`` is ``[n, width]``: each the hidden state just before its target. Arguments and
    results otherwise as in :func:`score_positions`.
    """

    def chunk_scores(states: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logprobs, entropies = score_logits(
            head(states), targets, temperature, entropy=entropy, entropy_grad=entropy_grad
        )
        return logprobs, entropies if entropies is not None else logprobs.new_zeros(())

    recompute = torch.is_grad_enabled() and states.requires_grad
    logprobs, entropies = [], []
    for start in range(0, len(targets), chunk_size):
        part = slice(start, start + chunk_size)
        if recompute:
            out = checkpoint(chunk_scores, states[part], targets[part], use_reentrant=False)
        else:
            out = chunk_scores(states[part], targets[part])
        logprobs.append(out[0])
        entropies.append(out[1])
    if not logprobs:
        empty = states.new_zeros(0, dtype=torch.float32)
        return empty, empty.clone() if entropy else None
    return torch.cat(logprobs), torch.cat(entropies) if entropy else None


def score_logits(
    logits: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    *,
    entropy: bool = False,
    entropy_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-prob of each target under softmax(logits / T), ``logits[..., :]`` the distribution of ``targets[...]``.

    Arguments and results otherwise as in :func:`score_tokens` (no shift: the caller pairs them).
    """
    scaled = logits.float() / temperature
    log_z = torch.logsumexp(scaled, dim=-1)
    # log softmax(z/T)[token]  (docs/algorithms/index.md eq. 4)
    logprobs = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - log_z
    entropies = None
    if entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            # H = log Z − Σ_v p_v z_v  (docs/algorithms/index.md eq. 3)
            entropies = log_z - (torch.softmax(scaled, dim=-1) * scaled).sum(-1)
    return logprobs, entropies
