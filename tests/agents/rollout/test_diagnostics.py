"""Tree diagnostics on hand-built trees: exact numbers."""

import math

import numpy as np
import pytest

from agents.rollout.diagnostics import SEGMENT_ENTROPY, rollout_metrics, tree_metrics
from agents.rollout.strategies import BranchEvent, PromptTrees, TreeStats
from agents.rollout.tree import RolloutTree
from agents.training.metrics import GENERATED_TOKENS, ROLLOUT_TIME


def worked_tree() -> RolloutTree:
    """Turn a (H 0.3) with leaves a1 (r 1, 3 tokens) and a2 (r 0, 1 token); turn b (H 0.1) answers (r 0.5)."""
    tree = RolloutTree([1, 2, 3])
    a = tree.add_turn(tree.root, action_ids=[10, 11], sampler_logprobs=[-0.2, -0.4], info={SEGMENT_ENTROPY: 0.25})
    tree.add_turn(a, obs_ids=[4], action_ids=[12, 13, 14], sampler_logprobs=[-0.5] * 3, terminal=True, reward=1.0)
    tree.add_turn(a, obs_ids=[4], action_ids=[15], sampler_logprobs=[-1.0], terminal=True, reward=0.0)
    tree.add_turn(
        tree.root, action_ids=[16], sampler_logprobs=[-0.1], terminal=True, reward=0.5, info={SEGMENT_ENTROPY: 0.75}
    )
    return tree


def test_tree_metrics_of_a_hand_built_tree():
    events = [
        BranchEvent(0, 1, "branch", depth=1, source_entropy=0.3, pool_median=0.2),
        BranchEvent(0, 2, "branch", depth=1, source_entropy=0.1, pool_median=0.2),
        BranchEvent(0, 3, "refill", depth=0),
    ]
    metrics = tree_metrics(worked_tree(), events=events)
    assert metrics == pytest.approx(
        {
            "leaves": 3.0,
            "turns": 4.0,
            "turns_generated": 4.0,
            "tokens_generated": 7.0,  # 2 + 3 + 1 + 1 tokens in the tree
            "chain_tokens": 9.0,  # (2 + 3) + (2 + 1) + 1: three chains would repeat turn a
            "token_ratio": 7 / 9,
            "node_entropy_mean": (0.3 + 0.5 + 1.0 + 0.1) / 4,
            "segment_entropy_topk_mean": 0.5,  # over the two turns that have one
            "branches": 3.0,
            "branch_depth/0": 1.0,
            "branch_depth/1": 2.0,
            "high_entropy_frac": 0.5,  # 0.3 > 0.2 yes, 0.1 > 0.2 no; the refill has no source
            "reward_mean": 0.5,
            "reward_std": math.sqrt(1 / 6),  # population std of (1, 0, 0.5)
            "reward_min": 0.0,
            "reward_max": 1.0,
            "reward_spread": 1.0,
        }
    )


def test_tree_metrics_count_what_the_loop_spent_beyond_the_tree():
    stats = TreeStats(
        turns=6, tokens=12, context_tokens=40, tool_calls=2, forks=5, fork_seconds=0.25, errors=["RuntimeError: x"]
    )
    metrics = tree_metrics(worked_tree(), stats)
    assert (metrics["turns_generated"], metrics["tokens_generated"]) == (6.0, 12.0)  # pruned turns included
    assert metrics["token_ratio"] == pytest.approx(12 / 9)
    assert (
        metrics["context_tokens"],
        metrics["tool_calls"],
        metrics["forks"],
        metrics["fork_s"],
        metrics["errors"],
    ) == (40.0, 2.0, 5.0, 0.25, 1.0)
    assert metrics["branches"] == 0.0 and "high_entropy_frac" not in metrics


def test_an_empty_tree_has_no_reward_or_ratio_metrics():
    metrics = tree_metrics(RolloutTree([1]))
    assert metrics == {
        "leaves": 0.0,
        "turns": 0.0,
        "turns_generated": 0.0,
        "tokens_generated": 0.0,
        "chain_tokens": 0.0,
        "branches": 0.0,
    }


def prompt_with(tree: RolloutTree, stats: TreeStats, premonitor: int = 0) -> PromptTrees:
    prompt = PromptTrees(
        index=0, key=None, trees=[tree], rng=np.random.default_rng(0), stats=[stats], premonitor_tokens=premonitor
    )
    prompt.metrics = [tree_metrics(tree, stats)]
    return prompt


def test_rollout_metrics_sum_up_a_batch():
    same = RolloutTree([1])
    for _ in range(2):
        same.add_turn(same.root, action_ids=[5], sampler_logprobs=[-0.5], terminal=True, reward=1.0)
    varied = prompt_with(worked_tree(), TreeStats(turns=4, tokens=7, tool_calls=1, forks=3, fork_seconds=0.5))
    flat = prompt_with(same, TreeStats(turns=2, tokens=2, tool_calls=3, forks=2, fork_seconds=0.25), premonitor=5)
    failed = PromptTrees(index=2, key=None, trees=[], rng=np.random.default_rng(0), error="ValueError: bad")

    record = rollout_metrics([varied, flat, failed], seconds=4.0)
    assert record["tree/leaves"] == 2.5  # mean over trees: (3 + 2) / 2
    assert record["tree/tokens_generated"] == 4.5
    assert record["tree/token_ratio"] == pytest.approx((7 / 9 + 1.0) / 2)
    assert (record["tree/tool_calls"], record["tree/forks"], record["tree/fork_s"]) == (4.0, 5.0, 0.75)  # sums
    assert record["tree/leaves_per_prompt"] == pytest.approx(5 / 3)
    assert record["tree/signal_frac"] == 0.5  # the all-equal prompt gives no learning signal
    assert record["tree/tokens_per_leaf"] == (7 + 2 + 5) / 5  # pre-monitoring tokens count
    assert record["tree/prompt_errors"] == 1.0
    assert (record[GENERATED_TOKENS], record[ROLLOUT_TIME]) == (14.0, 4.0)
    assert ROLLOUT_TIME not in rollout_metrics([varied])
