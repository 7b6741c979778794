"""Diagnostics of rollout trees: what a strategy's branching produced and what it cost.

:func:`tree_metrics` describes one tree as a flat ``{name: float}`` dict (the loop stores one per
tree in :attr:`agents.rollout.strategies.PromptTrees.metrics`); :func:`rollout_metrics` sums a batch up
under ``tree/…`` names, plus ``tokens/generated`` and ``time/rollout_s``, ready to pass to the
trainer with its step (``trainer.step(paths, rollout_metrics(results, seconds))``).

Per tree:

- ``leaves``; ``turns`` (distinct turns in the tree); ``turns_generated`` (turns sampled,
  pruned ones included);
- ``tokens_generated``: action tokens sampled for the tree, pruned branches included;
  ``chain_tokens``: what ``leaves`` independent chains would sample to produce the same leaves
  (the sum over leaves of the action tokens on each leaf's path); ``token_ratio`` =
  ``tokens_generated / chain_tokens`` (below 1: shared prefixes saved that fraction);
- ``branches``: branches started after the initial chains (refills included), and
  ``branch_depth/<d>``: how many of them hang under a node at depth ``d`` (0 = the prompt);
- ``high_entropy_frac``: of the branches a node caused, the fraction whose node's H(n) was above
  the median H(n) of the turns open at that moment (random branching scores about 0.5);
- ``node_entropy_mean``: mean H(n) over the tree's turns (H(n) = mean negative sampler
  log-prob of the turn's action, the Monte-Carlo estimate of docs/algorithms/index.md eq. 1);
  ``segment_entropy_topk_mean``: mean of ARPO's and AEPO's segment entropy over the turns that
  have one (``node.info["segment_entropy_topk"]``: top-k log-probs of the first tokens over ln|V|,
  docs/algorithms/rollout.md eq. 12);
- ``reward_mean``, ``reward_std`` (population), ``reward_min``, ``reward_max``,
  ``reward_spread`` (max − min) of the leaves;
- ``context_tokens``: context tokens the engine read to sample the tree's turns (see
  :class:`agents.rollout.strategies.TreeStats`);
- ``tool_calls``, ``forks``, ``fork_s`` (seconds spent forking environments), ``errors``.
"""

from __future__ import annotations

import math
import statistics
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from agents.rollout.strategies.entropy_branching import SEGMENT_ENTROPY
from agents.rollout.tree import RolloutTree

if TYPE_CHECKING:
    from agents.rollout.strategies.base import BranchEvent, PromptTrees, TreeStats

__all__ = ["GENERATED_TOKENS", "ROLLOUT_TIME", "rollout_metrics", "tree_metrics"]

#: Seconds the caller spent sampling the batch (engine and environments); the trainer's metrics
#: (:mod:`agents.training.metrics`) take it from the rollout record.
ROLLOUT_TIME = "time/rollout_s"
#: Number of tokens the engine generated for the batch.
GENERATED_TOKENS = "tokens/generated"


def tree_metrics(
    tree: RolloutTree, stats: TreeStats | None = None, events: Iterable[BranchEvent] = ()
) -> dict[str, float]:
    """The diagnostics of one tree (see the module docstring).

    Args:
        tree: A finished tree (from the loop, or built by hand).
        stats: What the loop spent on it; without them, the tree's own turns are what was spent.
        events: The branches started in it after the initial chains.
    """
    nodes = tree.nodes()
    leaves = [node for node in nodes if node.terminal]
    tokens_in_tree = sum(len(node.action_ids) for node in nodes)
    chain_tokens = sum(len(node.action_ids) for leaf in leaves for node in leaf.lineage()[1:])
    generated = stats.tokens if stats is not None else tokens_in_tree
    metrics: dict[str, float] = {
        "leaves": float(len(leaves)),
        "turns": float(len(nodes)),
        "turns_generated": float(stats.turns if stats is not None else len(nodes)),
        "tokens_generated": float(generated),
        "chain_tokens": float(chain_tokens),
    }
    if chain_tokens:
        metrics["token_ratio"] = generated / chain_tokens
    if nodes:
        metrics["node_entropy_mean"] = math.fsum(node.entropy for node in nodes) / len(nodes)
    segments = [node.info[SEGMENT_ENTROPY] for node in nodes if SEGMENT_ENTROPY in node.info]
    if segments:
        metrics["segment_entropy_topk_mean"] = math.fsum(segments) / len(segments)
    events = list(events)
    metrics["branches"] = float(len(events))
    for depth, count in sorted(Counter(event.depth for event in events).items()):
        metrics[f"branch_depth/{depth}"] = float(count)
    judged = [event.high_entropy for event in events if event.high_entropy is not None]
    if judged:
        metrics["high_entropy_frac"] = sum(judged) / len(judged)
    rewards = [float(leaf.reward) for leaf in leaves if leaf.reward is not None]
    if rewards:
        metrics["reward_mean"] = math.fsum(rewards) / len(rewards)
        metrics["reward_std"] = statistics.pstdev(rewards)
        metrics["reward_min"] = min(rewards)
        metrics["reward_max"] = max(rewards)
        metrics["reward_spread"] = max(rewards) - min(rewards)
    if stats is not None:
        metrics["context_tokens"] = float(stats.context_tokens)
        metrics["tool_calls"] = float(stats.tool_calls)
        metrics["forks"] = float(stats.forks)
        metrics["fork_s"] = stats.fork_seconds
        metrics["errors"] = float(len(stats.errors))
    return metrics


def rollout_metrics(prompts: Sequence[PromptTrees], seconds: float | None = None) -> dict[str, float]:
    """One flat record for a batch of prompts' trees.

    Keys: ``tree/<name>`` is the mean of each per-tree metric over the trees that have it,
    except counts that add up (``branch_depth/<d>``, ``context_tokens``, ``tool_calls``,
    ``forks``, ``fork_s``, ``errors``, ``branches``), which are summed; and per prompt:

    - ``tree/leaves_per_prompt``, ``tree/tokens_per_leaf`` (all tokens sampled, pre-monitoring
      included, over all leaves);
    - ``tree/signal_frac``: the fraction of prompts whose leaves' rewards are not all equal
      (a group whose rewards are all equal gives every leaf advantage 0: no learning signal);
    - ``tree/prompt_errors``: prompts that could not be rolled out at all;
    - ``tokens/generated``: tokens sampled for the batch; ``time/rollout_s``: ``seconds``, when given.
    """
    summed = {"context_tokens", "tool_calls", "forks", "fork_s", "errors", "branches"}
    totals: dict[str, float] = {}
    counts: Counter[str] = Counter()
    for prompt in prompts:
        for metrics in prompt.metrics:
            for name, value in metrics.items():
                totals[name] = totals.get(name, 0.0) + value
                counts[name] += 1
    record = {
        f"tree/{name}": (total if name in summed or name.startswith("branch_depth/") else total / counts[name])
        for name, total in sorted(totals.items())
    }
    leaves = sum(len(prompt.leaves) for prompt in prompts)
    tokens = sum(prompt.tokens for prompt in prompts)
    if prompts:
        record["tree/leaves_per_prompt"] = leaves / len(prompts)
        with_leaves = [prompt for prompt in prompts if prompt.leaves]
        if with_leaves:
            record["tree/signal_frac"] = sum(
                len({leaf.reward for leaf in prompt.leaves}) > 1 for prompt in with_leaves
            ) / len(with_leaves)
    if leaves:
        record["tree/tokens_per_leaf"] = tokens / leaves
    record["tree/prompt_errors"] = float(sum(prompt.error is not None for prompt in prompts))
    record[GENERATED_TOKENS] = float(tokens)
    if seconds is not None:
        record[ROLLOUT_TIME] = float(seconds)
    return record
