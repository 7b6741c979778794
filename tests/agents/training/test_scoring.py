"""agents.training.scoring: the shift, the temperature and the entropy, against hand-computed values."""

import math

import pytest
import torch

from agents.training.scoring import score_logits, score_positions, score_states, score_tokens


def test_the_logits_at_t_minus_1_score_token_t_at_the_samplers_temperature():
    # One row, vocabulary 2: logits (0, ln 3) give p = (1/4, 3/4) at T = 1 and (1/10, 9/10) at T = 0.5.
    logits = torch.tensor([[[0.0, math.log(3)], [0.0, math.log(3)], [5.0, 5.0]]])
    ids = torch.tensor([[1, 1, 0]])
    logprobs, entropies = score_tokens(logits, ids, 1.0, entropy=True)
    assert logprobs.shape == (1, 2)  # token 0 has no score; the last logits score nothing
    torch.testing.assert_close(logprobs, torch.tensor([[math.log(3 / 4), math.log(1 / 4)]]))
    h = -(0.25 * math.log(0.25) + 0.75 * math.log(0.75))  # eq. 3's H of (1/4, 3/4)
    torch.testing.assert_close(entropies, torch.tensor([[h, h]]))
    cooled, none = score_tokens(logits, ids, 0.5)
    assert none is None
    torch.testing.assert_close(cooled, torch.tensor([[math.log(9 / 10), math.log(1 / 10)]]))


def test_the_entropy_carries_a_gradient_only_when_asked():
    logits = torch.randn(1, 4, 7, requires_grad=True)
    ids = torch.randint(0, 7, (1, 4))
    assert not score_tokens(logits, ids, entropy=True)[1].requires_grad
    assert score_tokens(logits, ids, entropy=True, entropy_grad=True)[1].requires_grad
    assert score_tokens(logits, ids)[0].requires_grad


def test_score_positions_equals_score_tokens_at_the_chosen_tokens():
    torch.manual_seed(0)
    head = torch.nn.Linear(8, 11, bias=False)
    hidden = torch.randn(2, 5, 8)
    ids = torch.randint(0, 11, (2, 5))
    positions = torch.tensor([[0, 1], [0, 4], [1, 2], [1, 3]])
    full, full_entropy = score_tokens(head(hidden), ids, 0.7, entropy=True)
    chosen, chosen_entropy = score_positions(hidden, head, ids, positions, 0.7, entropy=True, chunk_size=3)
    expected = full[positions[:, 0], positions[:, 1] - 1]  # score_tokens' column t - 1 is token t
    torch.testing.assert_close(chosen, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(chosen_entropy, full_entropy[positions[:, 0], positions[:, 1] - 1], atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="columns >= 1"):
        score_positions(hidden, head, ids, torch.tensor([[0, 0]]))


def test_chunks_recomputed_in_the_backward_pass_give_the_unchunked_gradients():
    torch.manual_seed(1)
    head = torch.nn.Linear(6, 9, bias=False)
    targets = torch.randint(0, 9, (7,))
    grads = []
    for chunk in (7, 2):
        states = torch.randn(7, 6, generator=torch.Generator().manual_seed(2)).requires_grad_()
        head.zero_grad()
        logprobs, entropies = score_states(states, head, targets, entropy=True, entropy_grad=True, chunk_size=chunk)
        (logprobs.sum() + entropies.sum()).backward()
        grads.append((states.grad.clone(), head.weight.grad.clone(), logprobs.detach()))
    for whole, chunked in zip(grads[0], grads[1], strict=True):
        torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-5)


def test_no_positions_give_empty_scores():
    head = torch.nn.Linear(4, 5, bias=False)
    logprobs, entropies = score_states(torch.zeros(0, 4), head, torch.zeros(0, dtype=torch.long), entropy=True)
    assert logprobs.shape == entropies.shape == (0,)
    assert score_states(torch.zeros(0, 4), head, torch.zeros(0, dtype=torch.long))[1] is None


def test_bfloat16_logits_are_scored_in_float32():
    logits = torch.tensor([[0.0, 1.0, 2.0]], dtype=torch.bfloat16)
    logprobs, _ = score_logits(logits, torch.tensor([2]))
    assert logprobs.dtype == torch.float32
    torch.testing.assert_close(logprobs, torch.log_softmax(torch.tensor([[0.0, 1.0, 2.0]]), -1)[:, 2])
