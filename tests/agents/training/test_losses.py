"""Losses: values, gradients and metrics against hand-derived cases (docs/algorithms/losses.md "Losses")."""

import math

import pytest
import torch

from agents.training.losses import (
    aepo_loss,
    aggregate,
    atpo_loss,
    behaviour_weights,
    entropy_aware_advantages,
    gspo_loss,
    ppo_clip_loss,
)

NAN, INF = float("nan"), float("inf")
OLD = -2.0  # the sampler's log-prob of every action token in these cases


def case(ratios, advantages, mask):
    """One-row tensors where token t has ratio ``ratios[t]`` (off-mask tokens hold garbage)."""
    logprobs = torch.tensor(
        [[OLD + math.log(r) if m else -INF for r, m in zip(ratios, mask)]], dtype=torch.float64, requires_grad=True
    )
    old = torch.tensor([[OLD if m else NAN for m in mask]], dtype=torch.float64)
    adv = torch.tensor([[a if m else NAN for a, m in zip(advantages, mask)]], dtype=torch.float64)
    return logprobs, old, adv, torch.tensor([mask])


def grad_of(loss, logprobs):
    loss.backward()
    return logprobs.grad[0].tolist()


# Token regions for PPO with ε = 0.2, c = 3 (the first token is a masked prompt token):
#   r=1.1 A=+1 in range | r=1.5 A=+1 above 1+ε | r=0.5 A=-1 below 1-ε | r=0.5 A=+1 unclipped
#   r=2.0 A=-1 unclipped | r=4.0 A=-2 dual clip
PPO_CASE = ([1.0, 1.1, 1.5, 0.5, 0.5, 2.0, 4.0], [0, 1, 1, -1, 1, -1, -2], [0, 1, 1, 1, 1, 1, 1])


def test_aggregation_modes():
    values = torch.tensor([[1.0, 2.0, 3.0, NAN], [4.0, INF, 0.0, 0.0], [7.0, 7.0, 7.0, 7.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]]).bool()
    assert aggregate(values, mask, "token-mean").item() == 2.5  # (1+2+3+4)/4
    assert aggregate(values, mask, "seq-mean-token-mean").item() == 3.0  # (2 + 4)/2, empty row left out
    assert aggregate(values, mask, "seq-mean-token-sum").item() == 5.0  # (6 + 4)/2
    assert aggregate(values, torch.zeros_like(mask), "token-mean").item() == 0.0
    with pytest.raises(ValueError, match="unknown aggregation 'mean'; choose one of token-mean"):
        aggregate(values, mask, "mean")


def test_ppo_clip_values_gradients_and_metrics():
    logprobs, old, adv, mask = case(*PPO_CASE)
    loss, metrics = ppo_clip_loss(logprobs, old, adv, mask)
    # ℓ per token: -1.1, -1.2 (clipped), 0.8 (clipped), -0.5, 2.0, min(8, 6) = 6 -> mean over 6
    assert loss.item() == pytest.approx((-1.1 - 1.2 + 0.8 - 0.5 + 2.0 + 6.0) / 6, abs=1e-12)
    # dℓ/dlog π = -A·r where unclipped, 0 where clipped or dual-clipped
    assert grad_of(loss, logprobs) == pytest.approx([0, -1.1 / 6, 0, 0, -0.5 / 6, 2.0 / 6, 0], abs=1e-12)
    ratios = PPO_CASE[0][1:]
    assert metrics["clip_frac_high"] == pytest.approx(1 / 6) and metrics["clip_frac_low"] == pytest.approx(1 / 6)
    assert metrics["dual_clip_frac"] == pytest.approx(1 / 6)
    assert metrics["ratio_mean"] == pytest.approx(sum(ratios) / 6, abs=1e-12)
    assert metrics["approx_kl"] == pytest.approx(sum(r - 1 - math.log(r) for r in ratios) / 6, abs=1e-12)
    assert metrics["loss"] == metrics["pg_loss"] == pytest.approx(loss.item())


def test_ppo_without_dual_clip_lets_the_large_ratio_through():
    logprobs, old, adv, mask = case(*PPO_CASE)
    loss, metrics = ppo_clip_loss(logprobs, old, adv, mask, dual_clip=None)
    assert loss.item() == pytest.approx((-1.1 - 1.2 + 0.8 - 0.5 + 2.0 + 8.0) / 6, abs=1e-12)
    assert grad_of(loss, logprobs)[6] == pytest.approx(8.0 / 6, abs=1e-12)
    assert "dual_clip_frac" not in metrics


def test_dapo_clip_higher_keeps_ratio_below_one_plus_eps_high():
    for eps_high, expected_grad in ((0.2, 0.0), (0.28, -1.25)):
        logprobs, old, adv, mask = case([1.25], [1.0], [1])
        loss, _ = ppo_clip_loss(logprobs, old, adv, mask, eps_high=eps_high)
        assert grad_of(loss, logprobs) == pytest.approx([expected_grad], abs=1e-12)


def test_ppo_kl_k3_to_reference():
    logprobs, old, _, mask = case([1.0, 1.0, 1.0], [0, 0, 0], [0, 1, 1])
    adv = torch.zeros_like(old)
    ref = torch.tensor([[NAN, OLD - 0.5, OLD + 0.3]], dtype=torch.float64)
    loss, metrics = ppo_clip_loss(logprobs, old, adv, mask, ref_logprobs=ref, kl_coef=0.1)
    k3 = [math.exp(d) - d - 1 for d in (-0.5, 0.3)]  # d = log π_ref − log π_θ
    assert loss.item() == pytest.approx(0.1 * sum(k3) / 2, abs=1e-12)
    assert metrics["kl_ref"] == pytest.approx(sum(k3) / 2, abs=1e-12)
    # d/dlog π of exp(d) − d − 1 is 1 − exp(d)
    assert grad_of(loss, logprobs) == pytest.approx(
        [0, 0.1 * (1 - math.exp(-0.5)) / 2, 0.1 * (1 - math.exp(0.3)) / 2], abs=1e-12
    )


def test_ppo_entropy_bonus():
    logprobs, old, _, mask = case([1.0, 1.0, 1.0], [0, 0, 0], [0, 1, 1])
    entropy = torch.tensor([[9.0, 1.0, 2.0]], dtype=torch.float64, requires_grad=True)
    loss, metrics = ppo_clip_loss(logprobs, old, torch.zeros_like(old), mask, entropy=entropy, entropy_coef=0.01)
    assert loss.item() == pytest.approx(-0.01 * 1.5, abs=1e-15) and metrics["entropy"] == 1.5
    loss.backward()
    assert entropy.grad[0].tolist() == pytest.approx([0.0, -0.005, -0.005], abs=1e-15)


def test_ppo_batch_padding_never_makes_nan():
    logprobs = torch.tensor([[-1.0, -INF, -INF], [-0.5, -0.7, -INF]], requires_grad=True)
    old = torch.tensor([[-1.2, NAN, NAN], [-0.4, -0.9, NAN]])
    adv = torch.tensor([[1.0, NAN, NAN], [-1.0, -1.0, NAN]])
    mask = torch.tensor([[1, 0, 0], [1, 1, 0]])
    for loss_fn in (ppo_clip_loss, gspo_loss, atpo_loss):
        logprobs.grad = None
        loss, metrics = loss_fn(logprobs, old, adv, mask)
        loss.backward()
        assert math.isfinite(loss.item()) and all(math.isfinite(v) for v in metrics.values())
        assert torch.isfinite(logprobs.grad).all() and logprobs.grad[0, 1:].eq(0).all()


def test_gspo_uses_one_sequence_ratio_for_every_token():
    # row 0: log r = 0.1, 0.3 -> s = e^0.2; row 1: log r = -0.2, 0.0 -> s = e^-0.1
    logprobs = torch.tensor(
        [[-9.0, OLD + 0.1, OLD + 0.3], [OLD - 0.2, OLD, -9.0]], dtype=torch.float64, requires_grad=True
    )
    old = torch.full((2, 3), OLD, dtype=torch.float64)
    adv = torch.tensor([[0.0, 1.0, 1.0], [-1.0, -1.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1], [1, 1, 0]])
    s0, s1 = math.exp(0.2), math.exp(-0.1)
    loss, metrics = gspo_loss(logprobs, old, adv, mask, eps_low=0.3, eps_high=0.3)
    assert loss.item() == pytest.approx((-s0 + s1) / 2, abs=1e-12)  # seq-mean-token-mean
    # gradient s·∇log π(t) on every token of a sequence, whatever its own ratio
    assert logprobs.grad is None
    loss.backward()
    assert logprobs.grad.flatten().tolist() == pytest.approx([0, -s0 / 4, -s0 / 4, s1 / 4, s1 / 4, 0], abs=1e-12)
    assert metrics["ratio_mean"] == pytest.approx((2 * s0 + 2 * s1) / 4, abs=1e-12)
    assert (metrics["sequences"], metrics["clipped_sequences"]) == (2.0, 0.0)
    # the paper's ranges (3e-4, 4e-4) clip both sequences: no gradient, forward at the bounds
    logprobs.grad = None
    loss, metrics = gspo_loss(logprobs, old, adv, mask)
    assert loss.item() == pytest.approx((-(1 + 4e-4) + (1 - 3e-4)) / 2, abs=1e-12)
    loss.backward()
    assert logprobs.grad.eq(0).all()
    assert metrics["clipped_sequences"] == 2.0
    assert (metrics["clip_frac_high"], metrics["clip_frac_low"]) == (0.5, 0.5)


def test_atpo_clips_each_turn_as_a_unit():
    # prompt | turn 1: log r 0.001, 0.003 (s1 = e^0.002, inside [1-3e-3, 1+4e-3]) | observation |
    # turn 2: log r 0.0, 0.015, 0.003 (s2 = e^0.006 > 1.004: clipped, even the token whose own r is 1)
    log_r = [0.0, 0.001, 0.003, 0.0, 0.0, 0.015, 0.003]
    mask = [0, 1, 1, 0, 1, 1, 1]
    logprobs, old, adv, mask_t = case([math.exp(x) for x in log_r], [1.0] * 7, mask)
    loss, metrics = atpo_loss(logprobs, old, adv, mask_t)
    s1 = math.exp(0.002)
    assert loss.item() == pytest.approx((-2 * s1 - 3 * 1.004) / 5, abs=1e-12)
    assert grad_of(loss, logprobs) == pytest.approx([0, -s1 / 5, -s1 / 5, 0, 0, 0, 0], abs=1e-12)
    assert (metrics["turns"], metrics["clipped_turns"]) == (2.0, 1.0)
    assert metrics["clip_frac_high"] == pytest.approx(3 / 5)
    assert metrics["ratio_mean"] == pytest.approx((2 * s1 + 3 * math.exp(0.006)) / 5, abs=1e-12)
    # token-level PPO with the same range would still train turn 2's first token (r = 1)
    logprobs.grad = None
    ppo, _ = ppo_clip_loss(logprobs, old, adv, mask_t, eps_low=3e-3, eps_high=4e-3)
    assert grad_of(ppo, logprobs)[4] == pytest.approx(-1 / 5, abs=1e-12)


def test_atpo_turn_ids_split_adjacent_actions():
    logprobs, old, adv, mask = case([1.0, 1.0, math.exp(0.01), math.exp(0.01)], [1.0] * 4, [1, 1, 1, 1])
    turn_ids = torch.tensor([[5, 5, 6, 6]])
    loss, metrics = atpo_loss(logprobs, old, adv, mask, turn_ids=turn_ids)
    assert (metrics["turns"], metrics["clipped_turns"]) == (2.0, 1.0)
    assert grad_of(loss, logprobs) == pytest.approx([-0.25, -0.25, 0, 0], abs=1e-12)
    logprobs.grad = None
    loss, metrics = atpo_loss(logprobs, old, adv, mask)  # one run of mask 1 = one turn, s = e^0.005
    assert (metrics["turns"], metrics["clipped_turns"]) == (1.0, 1.0)
    assert grad_of(loss, logprobs) == [0.0, 0.0, 0.0, 0.0]


def test_atpo_turns_are_counted_across_rows():
    logprobs = torch.zeros(2, 5, requires_grad=True)
    mask = torch.tensor([[1, 0, 1, 1, 0], [0, 1, 1, 0, 1]])
    loss, metrics = atpo_loss(logprobs, torch.zeros(2, 5), torch.ones(2, 5), mask)
    assert metrics["turns"] == 4.0 and loss.item() == pytest.approx(-1.0)


def test_atpo_clamps_log_turn_ratio_at_ten():
    logprobs, old, adv, mask = case([math.exp(15.0)], [-1.0], [1])
    loss, _ = atpo_loss(logprobs, old, adv, mask)
    assert loss.item() == pytest.approx(math.exp(10.0), rel=1e-12)  # ℓ = max(−A·s, ...) = s = e^10
    assert grad_of(loss, logprobs) == [0.0]


# AEPO regions with ε = 0.2, c = 3: r=1.5 A=+1 above the bound | r=0.5 A=-1 below 1-ε |
#   r=1.1 A=+1 in range | r=1.5 A=-1 unclipped | r=4 A=-1 dual clip
AEPO_CASE = ([1.5, 0.5, 1.1, 1.5, 4.0], [1, -1, 1, -1, -1], [1, 1, 1, 1, 1])


def test_aepo_clip_balanced_forward_equals_ppo_and_keeps_gradient_above_the_bound():
    logprobs, old, adv, mask = case(*AEPO_CASE)
    loss, metrics = aepo_loss(logprobs, old, adv, mask, entropy_aware_advantage=False)
    ppo, ppo_metrics = ppo_clip_loss(logprobs, old, adv, mask, kl_coef=0.0)
    assert loss.item() == pytest.approx(ppo.item(), abs=1e-15)
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 1.1 + 1.5 + 3.0) / 5, abs=1e-12)
    aepo_grad = grad_of(loss, logprobs)
    logprobs.grad = None
    ppo_grad = grad_of(ppo, logprobs)
    # above the bound with A > 0: (1+ε_h)·A for AEPO, 0 for PPO; below 1-ε with A < 0: 0 for both
    assert aepo_grad == pytest.approx([-1.2 / 5, 0, -1.1 / 5, 1.5 / 5, 0], abs=1e-12)
    assert ppo_grad == pytest.approx([0, 0, -1.1 / 5, 1.5 / 5, 0], abs=1e-12)
    assert metrics == ppo_metrics


def test_aepo_without_balanced_clip_is_ppo():
    logprobs, old, adv, mask = case(*AEPO_CASE)
    loss, _ = aepo_loss(logprobs, old, adv, mask, clip_balanced=False, entropy_aware_advantage=False)
    assert grad_of(loss, logprobs) == pytest.approx([0, 0, -1.1 / 5, 1.5 / 5, 0], abs=1e-12)


def test_entropy_aware_advantage_by_hand():
    entropy = torch.tensor([[100.0, 0.5, 1.0, 1.5, 2.0]], dtype=torch.float64)  # token 0 is masked
    mask = torch.tensor([[0, 1, 1, 1, 1]])
    adv = torch.tensor([[7.0, 1.0, 1.0, -2.0, 1.0]], dtype=torch.float64)
    std = math.sqrt((0.75**2 + 0.25**2) * 2 / 3)  # unbiased std over the action tokens, mean 1.25
    z = [(h - 1.25) / std for h in (0.5, 1.0, 1.5, 2.0)]
    expected = [7.0] + [a * (1 + 0.2 * zt) for a, zt in zip((1.0, 1.0, -2.0, 1.0), z)]
    assert entropy_aware_advantages(adv, entropy, mask)[0].tolist() == pytest.approx(expected, abs=1e-12)
    # std 0 -> 1, so constant entropies (or a single token) leave the advantages as they are
    assert entropy_aware_advantages(adv, torch.full_like(entropy, 0.3), mask).equal(adv)
    assert entropy_aware_advantages(adv, entropy, torch.tensor([[0, 0, 1, 0, 0]])).equal(adv)


def test_aepo_entropy_aware_advantage_is_on_with_its_flag_and_off_without():
    logprobs, old, adv, mask = case([1.0] * 5, [0, 1, 1, 1, 1], [0, 1, 1, 1, 1])
    entropy = torch.tensor([[100.0, 0.5, 1.0, 1.5, 2.0]], dtype=torch.float64, requires_grad=True)
    std = math.sqrt(1.25 / 3)
    scaled = [1 + 0.2 * (h - 1.25) / std for h in (0.5, 1.0, 1.5, 2.0)]
    on, _ = aepo_loss(logprobs, old, adv, mask, entropy=entropy)
    on_grad = grad_of(on, logprobs)
    assert on_grad == pytest.approx([0] + [-a / 4 for a in scaled], abs=1e-12)  # r = 1: dℓ = −Ã/4
    assert entropy.grad.eq(0).all()  # sg(z): no gradient into the entropy without a bonus
    logprobs.grad = None
    off, _ = aepo_loss(logprobs, old, adv, mask, entropy=entropy, entropy_aware_advantage=False)
    assert grad_of(off, logprobs) == pytest.approx([0, -0.25, -0.25, -0.25, -0.25], abs=1e-12)
    assert on.item() == pytest.approx(off.item(), abs=1e-12)  # z averages to 0: only the gradient moves
    with pytest.raises(ValueError, match="entropy_aware_advantage=True needs `entropy`"):
        aepo_loss(logprobs, old, adv, mask)


@pytest.mark.parametrize("loss_fn", [ppo_clip_loss, gspo_loss, atpo_loss, aepo_loss])
def test_losses_reject_misshapen_input(loss_fn):
    x = torch.zeros(2, 3)
    extra = {"entropy": x} if loss_fn is aepo_loss else {}
    with pytest.raises(ValueError, match=r"advantages has shape \(2, 4\) but logprobs has \(2, 3\)"):
        loss_fn(x, x, torch.zeros(2, 4), x, **extra)
    with pytest.raises(ValueError, match=r"logprobs must have shape \[batch, tokens\], got \(3,\)"):
        loss_fn(torch.zeros(3), x, x, x, **extra)
    with pytest.raises(ValueError, match="mask must hold only 0 and 1"):
        loss_fn(x, x, x, torch.full((2, 3), 2.0), **extra)
    with pytest.raises(TypeError, match="old_logprobs must be a torch.Tensor"):
        loss_fn(x, [[0.0] * 3] * 2, x, x, **extra)
    with pytest.raises(ValueError, match="unknown aggregation"):
        loss_fn(x, x, x, torch.ones(2, 3), agg="sum", **extra)


# --- The decoupled objective (docs/algorithms/steps.md "Decoupled objective", eqs. 75-77) ---

ALL_LOSSES = [ppo_clip_loss, gspo_loss, atpo_loss, aepo_loss]


def _random_batch(seed):
    generator = torch.Generator().manual_seed(seed)
    shape = (3, 9)
    logprobs = (-torch.rand(shape, generator=generator, dtype=torch.float64) * 3).requires_grad_()
    old = logprobs.detach() + 0.3 * torch.randn(shape, generator=generator, dtype=torch.float64)
    behaviour = old + 0.5 * torch.randn(shape, generator=generator, dtype=torch.float64)
    advantages = torch.randn(shape, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[0, 1, 1, 1, 0, 1, 1, 0, 0], [0, 0, 1, 1, 1, 1, 0, 1, 1], [0, 1, 0, 1, 0, 1, 0, 1, 0]])
    entropy = torch.rand(shape, generator=generator, dtype=torch.float64)
    return logprobs, old, behaviour, advantages, mask, entropy


def _run(loss_fn, logprobs, old, advantages, mask, entropy, **kwargs):
    extra = {"entropy": entropy} if loss_fn is aepo_loss else {}
    logprobs.grad = None
    loss, metrics = loss_fn(logprobs, old, advantages, mask, **extra, **kwargs)
    loss.backward()
    return loss.item(), logprobs.grad.clone(), metrics


@pytest.mark.parametrize("loss_fn", ALL_LOSSES, ids=lambda f: f.__name__)
def test_decoupled_loss_with_the_proximal_policy_as_behaviour_is_exactly_todays(loss_fn):
    logprobs, old, _, advantages, mask, entropy = _random_batch(0)
    plain, plain_grad, plain_metrics = _run(loss_fn, logprobs, old, advantages, mask, entropy)
    same, same_grad, metrics = _run(loss_fn, logprobs, old, advantages, mask, entropy, behaviour_logprobs=old.clone())
    assert same == plain  # bit for bit: every weight is exp(0) = 1
    assert torch.equal(same_grad, plain_grad)
    assert {k: v for k, v in metrics.items() if not k.startswith("behaviour_")} == plain_metrics
    assert metrics["behaviour_weight_mean"] == 1.0
    assert metrics["behaviour_dropped_frac"] == 0.0
    assert metrics["behaviour_kl"] == 0.0


def test_decoupled_ppo_weights_each_tokens_loss_by_proximal_over_behaviour():
    # r_t = π_θ/π_prox drives the clip; w_t = π_prox/π_behav multiplies the clipped loss
    logprobs, old, adv, mask = case(*PPO_CASE)
    behaviour = old + torch.tensor([[0.0, 0.0, math.log(2), 0.0, -math.log(4), 0.0, 0.0]], dtype=torch.float64)
    loss, metrics = ppo_clip_loss(logprobs, old, adv, mask, behaviour_logprobs=behaviour)
    # weights: 1, 1/2 (prox has half the behaviour's probability), 1, 4, 1, 1 on the six action tokens
    token_losses = [-1.1, -1.2 * 0.5, 0.8, -0.5 * 4, 2.0, 6.0]
    assert loss.item() == pytest.approx(sum(token_losses) / 6, abs=1e-12)
    # the weight carries no gradient: dℓ/dlog π = -w·A·r where unclipped
    assert grad_of(loss, logprobs) == pytest.approx([0, -1.1 / 6, 0, 0, -0.5 * 4 / 6, 2.0 / 6, 0], abs=1e-12)
    assert metrics["behaviour_weight_mean"] == pytest.approx((1 + 0.5 + 1 + 4 + 1 + 1) / 6, abs=1e-12)
    assert metrics["clip_frac_high"] == pytest.approx(1 / 6)  # clipping is against π_prox, as before


def test_behaviour_weight_cap_drops_tokens_but_keeps_them_in_the_count():
    logprobs, old, adv, mask = case(*PPO_CASE)
    behaviour = old + torch.tensor([[0.0, 0.0, 0.0, 0.0, -math.log(4), 0.0, 0.0]], dtype=torch.float64)
    loss, metrics = ppo_clip_loss(logprobs, old, adv, mask, behaviour_logprobs=behaviour, behaviour_weight_cap=3.0)
    # the r=0.5, A=+1 token has weight 4 > 3: it leaves the sum, not the denominator
    assert loss.item() == pytest.approx((-1.1 - 1.2 + 0.8 + 0 + 2.0 + 6.0) / 6, abs=1e-12)
    assert metrics["behaviour_dropped_frac"] == pytest.approx(1 / 6, abs=1e-12)
    with pytest.raises(ValueError, match="behaviour_weight_cap must be > 1"):
        ppo_clip_loss(logprobs, old, adv, mask, behaviour_logprobs=behaviour, behaviour_weight_cap=1.0)


def test_decoupled_atpo_weights_a_turn_by_its_geometric_mean_weight():
    # two turns of two tokens, split by an observation token; ratios 1 (no clipping)
    mask = torch.tensor([[0, 1, 1, 0, 1, 1]])
    old = torch.full((1, 6), -2.0, dtype=torch.float64)
    logprobs = old.clone().requires_grad_()
    advantages = torch.tensor([[0.0, 1.0, 1.0, 0.0, -1.0, -1.0]], dtype=torch.float64)
    # turn 1: log w = (log 2 + log 8)/2 = log 4; turn 2: log w = (0 + log(1/4))/2 = log(1/2)
    behaviour = old - torch.tensor([[0.0, math.log(2), math.log(8), 0.0, 0.0, -math.log(4)]], dtype=torch.float64)
    weights = behaviour_weights(old, behaviour, mask, segments=None)
    assert weights[0].tolist() == pytest.approx([0, 2, 8, 0, 1, 0.25], abs=1e-12)  # token level without segments
    loss, metrics = atpo_loss(logprobs, old, advantages, mask, behaviour_logprobs=behaviour)
    # seq-mean-token-mean over one row: (−1·4 −1·4 +1·0.5 +1·0.5)/4
    assert loss.item() == pytest.approx((-4 - 4 + 0.5 + 0.5) / 4, abs=1e-12)
    assert metrics["behaviour_weight_mean"] == pytest.approx((4 + 4 + 0.5 + 0.5) / 4, abs=1e-12)
    assert grad_of(loss, logprobs) == pytest.approx([0, -1, -1, 0, 0.125, 0.125], abs=1e-12)


def test_decoupled_loss_rejects_misaligned_behaviour_logprobs():
    logprobs, old, adv, mask = case(*PPO_CASE)
    with pytest.raises(ValueError, match="behaviour_logprobs has shape"):
        ppo_clip_loss(logprobs, old, adv, mask, behaviour_logprobs=old[:, :3])
