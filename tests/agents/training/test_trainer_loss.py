"""TrainerLoss: the configured loss checked against its signature, its units, and the inputs it is handed."""

import math

import pytest
import torch

from agents.training.losses import TRAINER_INPUTS, gspo_loss, ppo_clip_loss
from agents.training.trainer_config import TrainerConfig
from agents.training.trainer_loss import TrainerLoss

MASK = [[0, 1, 1, 0], [0, 0, 0, 0], [1, 0, 1, 1]]


def config(**overrides) -> TrainerConfig:
    return TrainerConfig(**{"lr": 1e-3, "progress": False, "report_to": ("none",), **overrides})


def recording_loss(calls: list[dict]):
    """A loss taking a hyper-parameter ``scale``, ``turn_ids`` and ``kl_coef``; it records what it is given."""

    def recorded(logprobs, old_logprobs, advantages, mask, *, scale=1.0, turn_ids=None, kl_coef=0.5):
        calls.append({"scale": scale, "turn_ids": turn_ids, "kl_coef": kl_coef})
        return logprobs.sum() * scale, {"scale": scale}

    return recorded


def test_a_loss_named_in_the_config_runs_with_its_defaults_under_the_configured_hyper_parameters():
    loss = TrainerLoss(config(loss="gspo", loss_kwargs={"eps_high": 5e-4}), uses_reference=False)
    assert loss.fn is gspo_loss
    assert (loss.parameters["eps_low"], loss.parameters["eps_high"], loss.parameters["agg"]) == (
        3e-4,
        5e-4,
        "seq-mean-token-mean",
    )


@pytest.mark.parametrize(
    ("name", "loss_kwargs", "token_weighted"),
    [
        ("ppo_clip", {}, True),
        ("ppo_clip", {"agg": "seq-mean-token-mean"}, False),
        ("gspo", {}, False),
        ("gspo", {"agg": "token-mean"}, True),
    ],
)
def test_units_are_action_tokens_under_token_mean_else_one_per_path_that_has_any(name, loss_kwargs, token_weighted):
    loss = TrainerLoss(config(loss=name, loss_kwargs=loss_kwargs), uses_reference=False)
    assert loss.token_weighted is token_weighted
    # a PathBatch's float mask; the empty middle path weighs 0 either way
    units = loss.units(torch.tensor(MASK, dtype=torch.float32))
    assert units.tolist() == ([2, 0, 3] if token_weighted else [1, 0, 1])


def test_the_loss_gets_its_hyper_parameters_and_only_the_trainer_inputs_it_takes():
    calls: list[dict] = []
    loss = TrainerLoss(
        config(loss=recording_loss(calls), loss_kwargs={"scale": 2.0}, kl_coef=0.1), uses_reference=False
    )
    assert not loss.token_weighted  # no agg parameter: one unit per path
    turn_ids = torch.tensor([[0, 1, 1]])
    value, metrics = loss(
        torch.tensor([[1.0, 2.0, 4.0]]),
        torch.zeros(1, 3),
        torch.zeros(1, 3),
        torch.ones(1, 3),
        entropy=torch.ones(1, 3),
        turn_ids=turn_ids,
        ref_logprobs=None,
        behaviour_logprobs=None,
    )
    (call,) = calls
    # kl_coef is the config's, not the loss's default 0.5; no entropy, ref_logprobs or entropy_coef
    assert call["scale"] == 2.0 and call["turn_ids"] is turn_ids and call["kl_coef"] == 0.1
    assert value.item() == 14.0 and metrics == {"scale": 2.0}


def test_the_coefficients_of_the_kl_penalty_and_entropy_bonus_come_from_the_config():
    loss = TrainerLoss(config(kl_coef=0.1, entropy_coef=0.01), uses_reference=True)  # ppo_clip: token-mean
    old = torch.tensor([[-1.0, -2.0, -3.0]], dtype=torch.float64)
    d = (-0.5, 0.3)  # log π_ref − log π_θ on the two action tokens
    value, metrics = loss(
        old.clone(),  # ratio 1: the policy term is -A
        old,
        torch.tensor([[0.0, 1.0, 3.0]], dtype=torch.float64),
        torch.tensor([[0, 1, 1]]),
        entropy=torch.tensor([[5.0, 1.0, 2.0]], dtype=torch.float64),
        ref_logprobs=old + torch.tensor([[0.0, *d]], dtype=torch.float64),
        turn_ids=None,
        behaviour_logprobs=None,
    )
    k3 = sum(math.exp(x) - x - 1 for x in d) / 2
    assert value.item() == pytest.approx(-(1 + 3) / 2 + 0.1 * k3 - 0.01 * (1 + 2) / 2, abs=1e-12)
    assert metrics["kl_ref"] == pytest.approx(k3, abs=1e-12) and metrics["entropy"] == 1.5


def test_a_loss_taking_any_keyword_gets_every_trainer_input_and_any_hyper_parameter():
    received: dict = {}

    def open_loss(logprobs, old_logprobs, advantages, mask, **kwargs):
        received.update(kwargs)
        return logprobs.sum(), {}

    # anything goes: an unknown hyper-parameter, a reference and an entropy bonus
    loss = TrainerLoss(
        config(loss=open_loss, loss_kwargs={"tau": 0.7}, kl_coef=0.2, entropy_coef=0.03), uses_reference=True
    )
    assert list(loss.parameters) == ["logprobs", "old_logprobs", "advantages", "mask", *TRAINER_INPUTS, "tau"]
    assert [loss.parameters[name] for name in (*TRAINER_INPUTS, "tau")] == [None] * len(TRAINER_INPUTS) + [0.7]
    ones = torch.ones(1, 2)
    inputs = {"entropy": ones, "turn_ids": ones, "ref_logprobs": ones, "behaviour_logprobs": None}
    loss(ones, ones, ones, ones, **inputs)
    assert received == {"tau": 0.7, **inputs, "kl_coef": 0.2, "entropy_coef": 0.03}


def test_loss_kwargs_may_not_set_what_the_trainer_supplies():
    with pytest.raises(ValueError, match=r"loss_kwargs sets \['entropy', 'turn_ids'\], which the trainer supplies"):
        TrainerLoss(config(loss_kwargs={"turn_ids": None, "entropy": None, "eps_low": 0.1}), uses_reference=False)


def test_an_unknown_hyper_parameter_is_refused_with_the_ones_the_loss_takes():
    with pytest.raises(
        ValueError,
        match=r"^loss gspo_loss has no parameter bogus, eps; it takes eps_low, eps_high, agg, ref_logprobs, kl_coef, "
        r"entropy, entropy_coef, behaviour_logprobs, behaviour_weight_cap$",
    ):
        TrainerLoss(config(loss="gspo", loss_kwargs={"eps": 0.1, "bogus": 1}), uses_reference=False)

    def positional(logprobs, old_logprobs, advantages, mask, /, *, a, b, c, d, e):  # tensors positional-only
        return logprobs.sum(), {}

    with pytest.raises(ValueError, match=r"^loss positional has no parameter z; it takes a, b, c, d, e$"):
        TrainerLoss(config(loss=positional, loss_kwargs={"z": 1}), uses_reference=False)


def test_an_entropy_bonus_needs_a_loss_that_takes_the_entropy_and_its_coefficient():
    def bare(logprobs, old_logprobs, advantages, mask):
        return logprobs.sum(), {}

    TrainerLoss(config(loss=bare), uses_reference=False)  # nothing configured that it cannot apply
    with pytest.raises(
        ValueError, match="^loss bare takes no entropy, entropy_coef, so it cannot apply the configured"
    ):
        TrainerLoss(config(loss=bare, entropy_coef=0.01), uses_reference=False)
    assert TrainerLoss(config(entropy_coef=0.01), uses_reference=False).fn is ppo_clip_loss
