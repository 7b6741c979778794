"""agents.training.forward: how a step's batch is split and packed, and what one pass returns."""

import pytest
import torch

from agents.models import tiny_llama
from agents.rollout.tree import TrainingPath
from agents.training.batch import collate
from agents.training.forward import PolicyForward
from agents.training.trainer_config import TrainerConfig

CPU = torch.device("cpu")


def forward(rank: int = 0, world_size: int = 1, **overrides) -> PolicyForward:
    return PolicyForward(TrainerConfig(**overrides), CPU, torch.float32, rank, world_size)


def path(ids: list[int], actions: int) -> TrainingPath:
    """A path whose last ``actions`` tokens are the policy's."""
    n = len(ids)
    mask = [0] * (n - actions) + [1] * actions
    return TrainingPath(ids, mask, [0.5] * n, [-1.0] * n, [0] * n, [1.0] * n, 1.0, None)


def test_micro_batches_by_token_budget_hold_at_most_that_many_padded_tokens():
    lengths = torch.tensor([18, 21, 13, 6, 30, 50, 5])
    groups = forward(micro_batch_size=4, micro_batch_tokens=40, packing="padded").micro_batches(
        torch.arange(7), lengths
    )
    # 18+21 -> 2 x 21 = 42 > 40 splits; 21, 13 -> 42 again; 13, 6 -> 26; +30 -> 90; 50 alone; 5.
    assert [g.tolist() for g in groups] == [[0], [1], [2, 3], [4], [5], [6]]
    by_count = forward(micro_batch_size=2, packing="padded").micro_batches(
        torch.arange(5), torch.ones(5, dtype=torch.long)
    )
    assert [g.tolist() for g in by_count] == [[0, 1], [2, 3], [4]]


def test_tree_micro_batches_count_each_shared_prefix_once():
    # Three paths sharing their first 6 tokens, 8 tokens each: packed, 6 + 2 + 2 + 2 = 12 tokens.
    shared = [1, 2, 3, 4, 5, 6]
    batch = collate([path(shared + [7, 8], 2), path(shared + [9, 10], 2), path(shared + [11, 12], 2)], pad_id=0)
    lengths = batch.attention_mask.sum(-1)
    tree = forward(packing="tree", micro_batch_tokens=12)
    assert [g.tolist() for g in tree.micro_batches(torch.arange(3), lengths, batch.ids)] == [[0, 1, 2]]
    # Padded, the same budget holds one path of 8 tokens at a time.
    padded = forward(packing="padded", micro_batch_tokens=12)
    assert [g.tolist() for g in padded.micro_batches(torch.arange(3), lengths)] == [[0], [1], [2]]
    plan = tree.plan(batch)
    assert [m.tokens_forwarded for m in plan.micro_batches] == [12]


def test_a_plan_splits_mini_batches_in_order_and_gives_a_short_rank_a_filler_pass():
    batch = collate([path([1, 2, 3], 1), path([4, 5], 1), path([6, 7, 8, 9], 2)], pad_id=0)
    plan = forward(micro_batch_size=1, packing="padded").plan(batch, mini_batches=2)
    assert [m.rows.tolist() for m in plan.mini_batches] == [[0, 1], [2]]
    assert [m.width for m in plan.micro_batches] == [3, 2, 4]  # each trimmed to its longest path
    assert [(m.rows.tolist(), real) for m, real in plan.scoring] == [([0], True), ([1], True), ([2], True)]
    # Rank 1 of 2: micro-batches 1 of the first mini-batch; none of the second, so a filler that counts for nothing.
    second = forward(1, 2, micro_batch_size=1, packing="padded").plan(batch, mini_batches=2)
    assert [[(m.rows.tolist(), real) for m, real in mini.passes] for mini in second.mini_batches] == [
        [([1], True)],
        [([0], False)],
    ]
    with pytest.raises(ValueError, match="mini_batches=4 but the batch has only 3 sequences"):
        forward().plan(batch, mini_batches=4)


@pytest.mark.parametrize("packing", ["padded", "flat", "tree"])
def test_a_pass_gives_each_action_tokens_logprob_and_zero_elsewhere(packing):
    model = tiny_llama(0)
    paths = [path([1, 2, 3, 4, 5, 6], 3), path([1, 2, 3, 7], 1)]
    batch = collate(paths, pad_id=0)
    policy = forward(packing=packing)
    scores = policy.score(model, batch, policy.plan(batch))
    for row, p in enumerate(paths):
        with torch.no_grad():
            expected = model(input_ids=torch.tensor([p.ids])).logits[0, :-1].log_softmax(-1)
        targets = torch.tensor(p.ids[1:])
        direct = expected[torch.arange(len(targets)), targets]
        action = torch.tensor(p.mask[1:], dtype=torch.bool)
        torch.testing.assert_close(scores[row, 1 : len(p.ids)][action], direct[action], atol=1e-5, rtol=0)
        assert (scores[row, 1 : len(p.ids)][~action] == 0).all() and (scores[row, len(p.ids) :] == 0).all()
