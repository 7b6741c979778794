"""The learners' policy losses, as pure functions on ``[batch, tokens]`` tensors.

Every loss has the signature ``f(logprobs, old_logprobs, advantages, mask, **hyper) -> (loss,
metrics)``, with all four tensors aligned token by token:

- ``logprobs``: log π_θ of each token under the policy being trained (carries the gradient);
- ``old_logprobs``: log π_old of the same tokens (the sampler's, or recomputed), no gradient;
- ``advantages``: the advantage each token is trained with;
- ``mask``: 1 on action tokens, 0 on prompt, observation, warning and padding tokens.

Losses are minimised; ``r = exp(log π_θ − log π_old)`` per token. Values off the mask never
reach the loss or its gradient, even when they are NaN or infinite. ``metrics`` maps names to
Python floats: ``loss``, ``pg_loss``, ``clip_frac_low`` and ``clip_frac_high`` (fractions of
action tokens whose ratio lies outside the clip range on the side where clipping acts:
``A < 0`` below ``1 − ε_low``, ``A > 0`` above ``1 + ε_high``), ``ratio_mean`` (of the ratio
the loss clips), ``approx_kl`` (k3 estimate of KL(π_old ‖ π_θ) from the token ratios), plus
per-loss extras. Formulas and defaults: docs/algorithms/losses.md "Losses".

:func:`sft_loss` is no policy-gradient loss: supervised fine-tuning (a cold start before RL,
:mod:`agents.sft.train`) takes the same four tensors and ignores ``old_logprobs`` and ``advantages``, so
the trainer runs it as it runs the others; its metrics are ``loss``, ``pg_loss`` and ``nll``.

Every policy-gradient loss also takes ``behaviour_logprobs``, for rollouts sampled by an older policy than
``old_logprobs``'s (asynchronous training): the decoupled objective (AReaL) then clips against
π_old, the proximal policy, and weights each token's loss by ``π_old / π_behaviour``
(:func:`behaviour_weights`; docs/algorithms/steps.md "Decoupled objective"). Without it, or with
``behaviour_logprobs`` equal to ``old_logprobs``, every loss is exactly the one above.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

__all__ = [
    "AGGREGATIONS",
    "LOSSES",
    "TRAINER_INPUTS",
    "LossFn",
    "aepo_loss",
    "aggregate",
    "atpo_loss",
    "behaviour_weights",
    "entropy_aware_advantages",
    "gspo_loss",
    "ppo_clip_loss",
    "register_loss",
    "sft_loss",
]

#: Names of the ways a ``[batch, tokens]`` loss is reduced to a scalar (see :func:`aggregate`).
AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")

# verl compute_policy_loss clamps log r to ±20 so that exp() stays finite (docs/algorithms/losses.md eq. 38)
_LOG_RATIO_BOUND = 20.0
_MAX_LOG_SEGMENT_RATIO = 10.0  # docs/algorithms/losses.md eqs. 42, 45 (GSPO, ATPO; verl's GSPO loss): clamp log s ≤ 10
# verl kl_penalty("low_var_kl"): clamps of the k3 estimator (docs/algorithms/losses.md eq. 50)
_KL_LOG_BOUND, _KL_BOUND = 20.0, 10.0
_ZERO_STD = 1e-6  # an entropy spread below this counts as std 0 (then std := 1) (docs/algorithms/credit.md eq. 36)


def aggregate(values: torch.Tensor, mask: torch.Tensor, mode: str = "token-mean") -> torch.Tensor:
    """Reduce per-token ``values`` over the tokens where ``mask`` is 1.

    - ``"token-mean"``: mean over all masked tokens of the batch;
    - ``"seq-mean-token-mean"``: mean over each sequence's masked tokens, then over sequences;
    - ``"seq-mean-token-sum"``: sum over each sequence's masked tokens, then mean over sequences.

    Sequences without any masked token are left out of the mean over sequences; an all-zero
    mask gives 0 (docs/algorithms/losses.md "Aggregation modes", eqs. 52–54).
    """
    if mode not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {mode!r}; choose one of {', '.join(AGGREGATIONS)}")
    mask = mask.bool()
    masked = torch.where(mask, values, 0.0)
    tokens = mask.sum(-1)
    if mode == "token-mean":
        return masked.sum() / tokens.sum().clamp(min=1)  # docs/algorithms/losses.md eq. 52
    per_sequence = masked.sum(-1)
    if mode == "seq-mean-token-mean":
        per_sequence = per_sequence / tokens.clamp(min=1)  # docs/algorithms/losses.md eq. 53
    return per_sequence.sum() / (tokens > 0).sum().clamp(min=1)  # docs/algorithms/losses.md eqs. 53, 54


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 0.2,  # PPO / GRPO clip range (DeepSeekMath; verl clip_ratio_low)
    eps_high: float = 0.2,  # 0.28 for DAPO's clip-higher (Yu et al. 2025)
    dual_clip: float | None = 3.0,  # c of dual-clip PPO (Ye et al. 2020; verl clip_ratio_c); None: off
    agg: str = "token-mean",  # GRPO in verl
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.001,  # GRPO's β (DeepSeekMath; verl kl_loss_coef); used only with ref_logprobs
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,  # no entropy bonus in GRPO, AT²PO or AEPO
    behaviour_logprobs: torch.Tensor | None = None,
    behaviour_weight_cap: float | None = None,  # AReaL behav_imp_weight_cap (its default: no cap)
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate (GRPO, DAPO): ``ℓ = max(−A·r, −A·clip(r, 1−ε_low, 1+ε_high))``.

    For ``A < 0`` also the dual clip ``ℓ = min(ℓ, −A·c)``. Optional terms: ``kl_coef ·
    agg(k3(π_θ, π_ref))`` when ``ref_logprobs`` is given, and ``− entropy_coef · agg(entropy)``
    when ``entropy`` (per-token entropy carrying its gradient) is given. Extra metrics:
    ``dual_clip_frac``, and ``kl_ref``/``entropy`` with their optional inputs.
    Formulas and defaults: docs/algorithms/losses.md "PPO-clip" (eqs. 39, 40), with eqs. 50, 51 for the optional terms.
    """
    mask = _check_inputs(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        ref_logprobs=ref_logprobs,
        entropy=entropy,
        behaviour_logprobs=behaviour_logprobs,
    )
    behaviour = _Behaviour(behaviour_logprobs, behaviour_weight_cap)
    pg_loss, metrics = _clipped_policy_loss(
        logprobs, old_logprobs, advantages, mask, eps_low, eps_high, dual_clip, False, agg, behaviour
    )
    return _with_regularizers(pg_loss, metrics, logprobs, mask, agg, ref_logprobs, kl_coef, entropy, entropy_coef)


def aepo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    entropy: torch.Tensor | None = None,
    eps_low: float = 0.2,  # AEPO (docs/algorithms/losses.md eq. 47: ε = 0.2)
    eps_high: float = 0.2,  # AEPO (docs/algorithms/losses.md eq. 47: ε = 0.2)
    dual_clip: float | None = 3.0,  # AEPO (docs/algorithms/losses.md eqs. 40, 48: dual clip c = 3 when Ã < 0)
    clip_balanced: bool = True,  # AEPO entropy clipping-balanced upper bound
    entropy_aware_advantage: bool = True,  # AEPO entropy-aware advantage Ã
    entropy_advantage_coef: float = 0.2,  # AEPO paper: Ã = Â·(1 + 0.2·sg(z))
    agg: str = "token-mean",  # AEPO code (verl default)
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,  # AEPO trains without a KL term
    entropy_coef: float = 0.0,  # no entropy bonus by default
    behaviour_logprobs: torch.Tensor | None = None,
    behaviour_weight_cap: float | None = None,  # AReaL behav_imp_weight_cap (its default: no cap)
) -> tuple[torch.Tensor, dict[str, float]]:
    """AEPO's entropy-balanced policy loss (Dong et al. 2025).

    With ``clip_balanced`` the upper clip bound becomes ``(1+ε_high)·r/sg(r)``:
    ``u = clip(r, 1−ε_low, (1+ε_high)·r/sg(r))``, ``ℓ = max(−Ã·r, −Ã·u)``, dual clip for ``Ã < 0``.
    The forward value equals PPO's, but tokens with ``r > 1+ε_high`` and ``Ã > 0`` keep the
    gradient ``(1+ε_high)·Ã·∇log π`` instead of 0.

    With ``entropy_aware_advantage`` (on whenever the flag is on, bonus or not) the advantages
    are first rescaled by :func:`entropy_aware_advantages`; this needs ``entropy``, the per-token
    entropy of the full next-token distribution from the training forward pass. The same tensor
    feeds the optional entropy bonus. With both flags off this is :func:`ppo_clip_loss` with the same
    hyper-parameters. Formulas and defaults: docs/algorithms/losses.md "AEPO clipping-balanced" (eqs. 47–49).
    """
    if entropy_aware_advantage and entropy is None:
        raise ValueError(
            "aepo_loss with entropy_aware_advantage=True needs `entropy`, the per-token entropy "
            "[batch, tokens] from the training forward pass; pass it, or set "
            "entropy_aware_advantage=False"
        )
    mask = _check_inputs(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        ref_logprobs=ref_logprobs,
        entropy=entropy,
        behaviour_logprobs=behaviour_logprobs,
    )
    if entropy_aware_advantage and entropy is not None:  # entropy is never None here: checked above
        # docs/algorithms/credit.md eq. 37
        advantages = entropy_aware_advantages(advantages, entropy, mask, coef=entropy_advantage_coef)
    behaviour = _Behaviour(behaviour_logprobs, behaviour_weight_cap)
    pg_loss, metrics = _clipped_policy_loss(
        logprobs, old_logprobs, advantages, mask, eps_low, eps_high, dual_clip, clip_balanced, agg, behaviour
    )
    return _with_regularizers(pg_loss, metrics, logprobs, mask, agg, ref_logprobs, kl_coef, entropy, entropy_coef)


def entropy_aware_advantages(
    advantages: torch.Tensor,
    entropy: torch.Tensor,
    mask: torch.Tensor,
    coef: float = 0.2,  # AEPO paper
) -> torch.Tensor:
    """AEPO's entropy-aware advantage ``Ã_t = Â_t · (1 + coef · sg(z_t))``.

    ``z_t`` is the token entropy standardised over the action tokens of the batch given
    (the micro-batch): ``(H_t − mean) / std`` with the unbiased std; a std of 0 (or below 1e-6,
    or fewer than two action tokens) is replaced by 1. Off the mask ``z = 0``
    (docs/algorithms/credit.md "AEPO entropy-aware advantage", eqs. 36, 37).
    """
    mask = mask.bool()
    h = entropy.detach().to(torch.float64)
    count = mask.sum()
    mean = torch.where(mask, h, 0.0).sum() / count.clamp(min=1)  # docs/algorithms/credit.md eq. 36
    # docs/algorithms/credit.md eq. 36
    variance = torch.where(mask, (h - mean) ** 2, 0.0).sum() / (count - 1).clamp(min=1)
    std = variance.sqrt()
    std = torch.where(std > _ZERO_STD, std, torch.ones_like(std))  # docs/algorithms/credit.md eq. 36
    z = torch.where(mask, (h - mean) / std, 0.0).to(advantages.dtype)  # docs/algorithms/credit.md eq. 36
    return advantages * (1 + coef * z)  # Ã = Â·(1 + 0.2·sg(z_t))  (docs/algorithms/credit.md eq. 37)


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 3e-4,  # GSPO paper §5 (Zheng et al. 2025; docs/algorithms/losses.md "GSPO")
    eps_high: float = 4e-4,  # GSPO paper §5 (docs/algorithms/losses.md "GSPO")
    agg: str = "seq-mean-token-mean",  # GSPO objective: 1/|y_i| Σ_t, then mean over sequences
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,  # GSPO trains without a KL term
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    behaviour_logprobs: torch.Tensor | None = None,
    behaviour_weight_cap: float | None = None,  # AReaL behav_imp_weight_cap (its default: no cap)
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO: one importance ratio per sequence, ``s = exp(mean_t log r_t)`` over its action tokens.

    Token form: ``log s_t = sg(log s) + log π_θ(t) − sg(log π_θ(t))``, so the forward value is
    the sequence ratio and the gradient is ``s·∇log π_θ(t)``; ``ℓ_t = max(−A_t·s_t,
    −A_t·clip(s_t, 1−ε_low, 1+ε_high))``, no dual clip. Extra metrics: ``sequences`` and
    ``clipped_sequences``. Formulas and defaults: docs/algorithms/losses.md "GSPO" (eqs. 41–43).
    """
    mask = _check_inputs(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        ref_logprobs=ref_logprobs,
        entropy=entropy,
        behaviour_logprobs=behaviour_logprobs,
    )
    # one segment per sequence (docs/algorithms/losses.md eq. 41)
    first_action_token = mask & (mask.long().cumsum(-1) == 1)
    behaviour = _Behaviour(behaviour_logprobs, behaviour_weight_cap)
    pg_loss, metrics = _segment_ratio_loss(
        logprobs, old_logprobs, advantages, mask, first_action_token, eps_low, eps_high, agg, "sequences", behaviour
    )
    return _with_regularizers(pg_loss, metrics, logprobs, mask, agg, ref_logprobs, kl_coef, entropy, entropy_coef)


def atpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float = 3e-3,  # AT²PO official code (docs/algorithms/losses.md eq. 46)
    eps_high: float = 4e-3,  # AT²PO official code (docs/algorithms/losses.md eq. 46)
    agg: str = "seq-mean-token-mean",  # AT²PO official code
    turn_ids: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,  # AT²PO trains without a KL term
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,  # AT²PO: no entropy bonus
    behaviour_logprobs: torch.Tensor | None = None,
    behaviour_weight_cap: float | None = None,  # AReaL behav_imp_weight_cap (its default: no cap)
) -> tuple[torch.Tensor, dict[str, float]]:
    """ATPO: turn-level importance sampling and clipping (AT²PO).

    For a token t of turn k: ``log s_t = sg(mean_{u∈k} log r_u) + log π_θ(t) − sg(log π_θ(t))``,
    clamped to ``≤ 10``; ``ℓ_t = max(−A_t·s_t, −A_t·clip(s_t, 1−ε_low, 1+ε_high))``, no dual clip.
    The forward value of ``s_t`` is the turn's geometric-mean ratio, so a turn is clipped as a
    unit; its gradient is ``s_t·∇log π_θ(t)``.

    A turn is a maximal run of mask-1 tokens in a row. With ``turn_ids`` (the
    :class:`~agents.training.batch.PathBatch` field), a run is also split where the turn id changes, which
    separates two actions that no observation token divides. Extra metrics: ``turns`` and
    ``clipped_turns``. Formulas and defaults: docs/algorithms/losses.md "ATPO" (eqs. 44–46).
    """
    mask = _check_inputs(
        logprobs,
        old_logprobs,
        advantages,
        mask,
        ref_logprobs=ref_logprobs,
        entropy=entropy,
        turn_ids=turn_ids,
        behaviour_logprobs=behaviour_logprobs,
    )
    previous = F.pad(mask[:, :-1], (1, 0), value=False)
    turn_start = mask & ~previous  # docs/algorithms/losses.md eq. 44
    if turn_ids is not None:
        previous_turn = F.pad(turn_ids[:, :-1], (1, 0), value=-1)
        turn_start = turn_start | (mask & previous & (turn_ids != previous_turn))  # docs/algorithms/losses.md eq. 44
    behaviour = _Behaviour(behaviour_logprobs, behaviour_weight_cap)
    pg_loss, metrics = _segment_ratio_loss(
        logprobs, old_logprobs, advantages, mask, turn_start, eps_low, eps_high, agg, "turns", behaviour
    )
    return _with_regularizers(pg_loss, metrics, logprobs, mask, agg, ref_logprobs, kl_coef, entropy, entropy_coef)


def sft_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    agg: str = "token-mean",  # the mean NLL per action token (transformers' causal-LM loss; TRL's SFTTrainer)
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,  # no KL term in a cold start; used only with ref_logprobs
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Supervised fine-tuning: the negative log-likelihood of the action tokens, ``ℓ = agg(−log π_θ)``.

    ``old_logprobs`` and ``advantages`` are checked for shape and otherwise ignored (the loss is the
    same whatever they hold). With the default ``agg="token-mean"`` the trainer weights its
    micro-batches by action tokens (docs/algorithms/training.md eq. 58), so an update's loss and gradient are
    those of the mean NLL over every action token of the batch. The optional KL and entropy terms
    are the other losses' (eqs. 50, 51), off by default. Extra metric: ``nll`` (equal to
    ``pg_loss``). Formula: docs/algorithms/steps.md "Supervised cold start" (eq. 80).
    """
    mask = _check_inputs(logprobs, old_logprobs, advantages, mask, ref_logprobs=ref_logprobs, entropy=entropy)
    nll = aggregate(-logprobs, mask, agg)  # docs/algorithms/steps.md eq. 80
    metrics = {"nll": nll.item()}
    return _with_regularizers(nll, metrics, logprobs, mask, agg, ref_logprobs, kl_coef, entropy, entropy_coef)


def _clipped_policy_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
    dual_clip: float | None,
    balanced_upper: bool,
    agg: str,
    behaviour: _Behaviour,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The token-ratio clipped surrogate shared by PPO/GRPO and AEPO."""
    advantages = torch.where(mask, advantages, 0.0)
    log_ratio = _log_ratio(logprobs, old_logprobs, mask)
    ratio = torch.exp(log_ratio)  # docs/algorithms/losses.md eq. 38
    if balanced_upper:
        # AEPO: forward 1+ε_h, gradient (1+ε_h)·∇log π  (docs/algorithms/losses.md eq. 47)
        upper = (1 + eps_high) * ratio / ratio.detach()
    else:
        upper = torch.full_like(ratio, 1 + eps_high)
    clipped = torch.minimum(torch.clamp(ratio, min=1 - eps_low), upper)  # docs/algorithms/losses.md eqs. 39, 47
    # PPO clipped surrogate (docs/algorithms/losses.md eqs. 39, 48)
    token_loss = torch.maximum(-advantages * ratio, -advantages * clipped)
    metrics = _clip_metrics(ratio, log_ratio, advantages, mask, eps_low, eps_high)
    if dual_clip is not None:
        # dual clip: for A < 0, ℓ = min(ℓ, −A·c)  (docs/algorithms/losses.md eq. 40)
        token_loss = torch.where(advantages < 0, torch.minimum(token_loss, -advantages * dual_clip), token_loss)
        with torch.no_grad():
            metrics["dual_clip_frac"] = _masked_mean((advantages < 0) & (ratio > dual_clip), mask)
    if behaviour.logprobs is not None:
        weights = behaviour_weights(old_logprobs, behaviour.logprobs, mask, cap=behaviour.cap)
        token_loss = token_loss * weights  # docs/algorithms/steps.md eq. 77
        metrics.update(_behaviour_metrics(old_logprobs, behaviour.logprobs, weights, mask))
    return aggregate(token_loss, mask, agg), metrics


def _segment_ratio_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    segment_start: torch.Tensor,
    eps_low: float,
    eps_high: float,
    agg: str,
    unit: str,
    behaviour: _Behaviour,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped surrogate with one geometric-mean ratio per segment (GSPO: sequence, ATPO: turn)."""
    advantages = torch.where(mask, advantages, 0.0)
    log_ratio = _log_ratio(logprobs, old_logprobs, mask)
    segments = _Segments(mask, segment_start)
    segment_mean = segments.mean(log_ratio.detach())  # docs/algorithms/losses.md eqs. 41, 45
    # log s_t = sg(mean_{u∈segment} log r_u) + log π_θ(t) − sg(log π_θ(t))   (GSPO token form)
    log_s = segment_mean + torch.where(mask, logprobs - logprobs.detach(), 0.0)  # docs/algorithms/losses.md eqs. 42, 45
    s = torch.exp(torch.clamp(log_s, max=_MAX_LOG_SEGMENT_RATIO))  # docs/algorithms/losses.md eqs. 42, 45
    clipped = torch.clamp(s, 1 - eps_low, 1 + eps_high)  # docs/algorithms/losses.md eqs. 43, 46
    # clipped surrogate on s (docs/algorithms/losses.md eqs. 43, 46)
    token_loss = torch.maximum(-advantages * s, -advantages * clipped)
    metrics = _clip_metrics(s, log_ratio, advantages, mask, eps_low, eps_high)
    with torch.no_grad():
        clipped_tokens = ((advantages > 0) & (s > 1 + eps_high)) | ((advantages < 0) & (s < 1 - eps_low))
        metrics[unit] = float(segments.count)
        metrics[f"clipped_{unit}"] = float((segments.sums(clipped_tokens & mask) > 0).sum())
    if behaviour.logprobs is not None:
        weights = behaviour_weights(old_logprobs, behaviour.logprobs, mask, cap=behaviour.cap, segments=segments)
        token_loss = token_loss * weights  # docs/algorithms/steps.md eq. 77
        metrics.update(_behaviour_metrics(old_logprobs, behaviour.logprobs, weights, mask))
    return aggregate(token_loss, mask, agg), metrics


class _Segments:
    """The segments (GSPO: sequences, ATPO: turns) of a ``[batch, tokens]`` mask, for per-segment sums and means."""

    def __init__(self, mask: torch.Tensor, segment_start: torch.Tensor) -> None:
        self.mask, self.count = mask, int(segment_start.sum())
        per_row = segment_start.long().sum(-1)
        row_offsets = (per_row.cumsum(0) - per_row).unsqueeze(-1)  # segments that start in the rows above
        # Segment index of every token in row-major order; tokens off the mask go to a spare bucket.
        self.index = torch.where(mask, segment_start.long().cumsum(-1) + row_offsets - 1, self.count).flatten()
        self.tokens = self.sums(mask)

    def sums(self, values: torch.Tensor) -> torch.Tensor:
        """Each segment's sum of ``values`` (float64: a bfloat16 sum over a few hundred tokens would be
        inexact), and the spare bucket's last."""
        totals = torch.zeros(self.count + 1, dtype=torch.float64, device=values.device)
        return totals.index_add_(0, self.index, values.flatten().to(torch.float64))

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """Each token's segment mean of ``values`` over the mask (0 off it), shaped and typed like ``values``."""
        means = self.sums(torch.where(self.mask, values, 0.0)) / self.tokens.clamp(min=1)
        return means[self.index].view_as(values).to(values.dtype)


class _Behaviour(NamedTuple):
    """The behaviour policy's log-probs (``None``: the sampler was π_old) and the weight cap."""

    logprobs: torch.Tensor | None
    cap: float | None


def behaviour_weights(
    old_logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    mask: torch.Tensor,
    *,
    cap: float | None = None,
    segments: _Segments | None = None,
) -> torch.Tensor:
    """The decoupled objective's weights ``w_t = π_old(a_t) / π_behaviour(a_t)``, without gradient.

    ``old_logprobs`` are the proximal policy's (recomputed before the update) and
    ``behaviour_logprobs`` the sampler's. With ``segments`` (the GSPO and ATPO losses) a token's
    weight is its segment's geometric mean, as its ratio is. Tokens whose weight exceeds ``cap``
    get weight 0 (AReaL filters them out) but stay in the aggregation's count; off the mask, 0.
    docs/algorithms/steps.md "Decoupled objective" (eqs. 75–77).
    """
    mask = mask.bool()
    if cap is not None and not cap > 1:
        raise ValueError(f"behaviour_weight_cap must be > 1 (AReaL's rule), got {cap}")
    log_w = _log_ratio(old_logprobs.detach(), behaviour_logprobs.detach(), mask)  # docs/algorithms/steps.md eq. 75
    if segments is not None:
        log_w = segments.mean(log_w)  # docs/algorithms/steps.md eq. 75
    weights = torch.where(mask, torch.exp(log_w), 0.0)
    if cap is not None:
        weights = torch.where(weights > cap, 0.0, weights)  # docs/algorithms/steps.md eq. 76
    return weights


def _behaviour_metrics(
    old_logprobs: torch.Tensor, behaviour_logprobs: torch.Tensor, weights: torch.Tensor, mask: torch.Tensor
) -> dict[str, float]:
    with torch.no_grad():
        d = _log_ratio(behaviour_logprobs, old_logprobs, mask)
        return {
            "behaviour_weight_mean": _masked_mean(weights, mask),
            "behaviour_dropped_frac": _masked_mean(weights == 0, mask),
            # k3 estimate of KL(π_behaviour ‖ π_old): how far the proximal policy has moved from the sampler
            "behaviour_kl": _masked_mean(torch.exp(d) - 1 - d, mask),  # docs/algorithms/losses.md eq. 56
        }


def _with_regularizers(
    pg_loss: torch.Tensor,
    metrics: dict[str, float],
    logprobs: torch.Tensor,
    mask: torch.Tensor,
    agg: str,
    ref_logprobs: torch.Tensor | None,
    kl_coef: float,
    entropy: torch.Tensor | None,
    entropy_coef: float,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Add the optional KL-to-reference and entropy-bonus terms; finish the metrics."""
    loss = pg_loss
    if ref_logprobs is not None:
        # k3 estimator of KL(π_θ ‖ π_ref): exp(d) − d − 1, d = log π_ref − log π_θ (Schulman 2020)
        # docs/algorithms/losses.md eq. 50
        d = torch.clamp(torch.where(mask, ref_logprobs - logprobs, 0.0), -_KL_LOG_BOUND, _KL_LOG_BOUND)
        # docs/algorithms/losses.md eq. 50
        kl = aggregate(torch.clamp(torch.exp(d) - d - 1, -_KL_BOUND, _KL_BOUND), mask, agg)
        loss = loss + kl_coef * kl  # docs/algorithms/losses.md eq. 51
        metrics["kl_ref"] = kl.item()
    if entropy is not None:
        mean_entropy = aggregate(entropy, mask, agg)
        loss = loss - entropy_coef * mean_entropy  # entropy bonus (docs/algorithms/losses.md eq. 51)
        metrics["entropy"] = mean_entropy.item()
    metrics["pg_loss"] = pg_loss.item()
    metrics["loss"] = loss.item()
    return loss, metrics


def _log_ratio(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``log r = log π_θ − log π_old`` on the mask (clamped to ±20), 0 off it (docs/algorithms/losses.md eq. 38)."""
    # docs/algorithms/losses.md eq. 38
    return torch.clamp(torch.where(mask, logprobs - old_logprobs, 0.0), -_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)


def _clip_metrics(
    ratio: torch.Tensor,
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    eps_low: float,
    eps_high: float,
) -> dict[str, float]:
    with torch.no_grad():
        return {
            # docs/algorithms/losses.md eq. 55
            "clip_frac_low": _masked_mean((advantages < 0) & (ratio < 1 - eps_low), mask),
            "clip_frac_high": _masked_mean((advantages > 0) & (ratio > 1 + eps_high), mask),
            "ratio_mean": _masked_mean(ratio, mask),
            # k3 estimate of KL(π_old ‖ π_θ) on samples from π_old: (r − 1) − log r
            "approx_kl": _masked_mean(torch.exp(log_ratio) - 1 - log_ratio, mask),  # docs/algorithms/losses.md eq. 56
        }


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return (torch.where(mask, values.to(torch.float64), 0.0).sum() / mask.sum().clamp(min=1)).item()


def _check_inputs(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    **optional: torch.Tensor | None,
) -> torch.Tensor:
    """Check that every tensor is ``[batch, tokens]`` like ``logprobs``; return the mask as bool."""
    tensors = {
        "logprobs": logprobs,
        "old_logprobs": old_logprobs,
        "advantages": advantages,
        "mask": mask,
        **{name: value for name, value in optional.items() if value is not None},
    }
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor of shape [batch, tokens], got {type(value).__name__}")
        if value.dim() != 2:
            raise ValueError(f"{name} must have shape [batch, tokens], got {tuple(value.shape)}")
        if value.shape != logprobs.shape:
            raise ValueError(
                f"{name} has shape {tuple(value.shape)} but logprobs has {tuple(logprobs.shape)}; "
                "align every tensor token by token"
            )
    if mask.dtype != torch.bool:
        if not ((mask == 0) | (mask == 1)).all():
            raise ValueError("mask must hold only 0 and 1 (1 on action tokens)")
        mask = mask.bool()
    return mask


#: ``f(logprobs, old_logprobs, advantages, mask, **hyper) -> (loss, metrics)``: the signature above.
LossFn = Callable[..., tuple[torch.Tensor, dict[str, float]]]

#: What the trainer hands a loss that names it as a keyword parameter: the tensors it computes and
#: the run's coefficients. They are never hyper-parameters (``loss_kwargs`` cannot set them).
TRAINER_INPUTS: tuple[str, ...] = (
    "entropy",
    "ref_logprobs",
    "turn_ids",
    "behaviour_logprobs",
    "kl_coef",
    "entropy_coef",
)

#: The losses known by name (``TrainerConfig(loss=...)``, a learner's ``loss``, ``--set loss...``).
LOSSES: dict[str, LossFn] = {
    "ppo_clip": ppo_clip_loss,
    "gspo": gspo_loss,
    "atpo": atpo_loss,
    "aepo": aepo_loss,
    "sft": sft_loss,
}


def register_loss(name: str, loss: LossFn | None = None) -> Any:
    """Make ``loss`` selectable by ``name`` everywhere a loss name is accepted; usable as a decorator.

    ``@register_loss("reinforce")`` above a function with the losses' signature is all a new
    named loss needs. A taken name is refused rather than silently replaced.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"a loss name must be a non-empty string, got {name!r}")

    def add(fn: LossFn) -> LossFn:
        if not callable(fn):
            raise TypeError(f"register_loss({name!r}) needs a callable with the losses' signature, got {fn!r}")
        if name in LOSSES and LOSSES[name] is not fn:
            raise ValueError(
                f"a loss named {name!r} is already registered ({LOSSES[name].__qualname__}); choose another name"
            )
        LOSSES[name] = fn
        return fn

    return add if loss is None else add(loss)
