"""``RandomTree``: Tree-GRPO's rollout (Ji et al. 2025, arXiv 2509.21240), branching at random."""

from __future__ import annotations

from dataclasses import dataclass

from agents.rollout.strategies.base import BranchPoint, PromptTrees, Strategy, expand, fresh_chain, require_positive

__all__ = ["RandomTree"]


@dataclass(frozen=True)
class RandomTree(Strategy):
    """``M`` trees per prompt, each grown from one chain, expanded at random, cut to ``K`` leaves.

    Each of ``L`` rounds picks, in every tree, ``N`` nodes uniformly with replacement from the
    root and the turns that did not end their episode, and rolls a new chain out of each as a
    new child: from the node's full context after its observation, on a fork of the environment
    state after its action. Finally each tree keeps ``K`` of its leaves drawn at random (all of
    them when it has no more than ``K``) and the rest is pruned. Defaults are the paper's
    (docs/algorithms/rollout.md "Random tree", eqs. 7, 8).

    Args:
        M: Trees per prompt.
        N: Nodes expanded per tree and round.
        L: Expansion rounds.
        K: Leaves kept per tree.
    """

    M: int = 2
    N: int = 2
    L: int = 1
    K: int = 3

    keeps_turn_states = True  # a new child of n starts from the state n's children started from

    def __post_init__(self) -> None:
        require_positive(self, "M", "N", "L", "K")

    @property
    def trees_per_prompt(self) -> int:
        return self.M

    @property
    def branches_per_prompt(self) -> int:
        return self.M * (1 + self.L * self.N)  # before finish() keeps K leaves of each tree

    def start(self, prompt: PromptTrees) -> list[BranchPoint]:
        return [fresh_chain(prompt, tree) for tree in range(self.M)]

    def next_round(self, prompt: PromptTrees) -> list[BranchPoint]:
        done = prompt.notes.get("rounds", 0)
        if done >= self.L:
            return []
        prompt.notes["rounds"] = done + 1
        points = []
        for index, tree in enumerate(prompt.trees):
            # C = {root} ∪ {n : n has children and did not end its episode}  (docs/algorithms/rollout.md eq. 7)
            candidates = [tree.root] + [node for node in tree.nodes() if not node.terminal and node.children]
            for _ in range(self.N):
                # uniform draw from C, with replacement (docs/algorithms/rollout.md eq. 7)
                points.append(expand(index, candidates[int(prompt.rng.integers(len(candidates)))]))
        return points

    def finish(self, prompt: PromptTrees) -> None:
        for tree in prompt.trees:
            leaves = tree.leaves()
            if len(leaves) > self.K:
                # K leaves drawn uniformly without replacement: min(K, 1 + L·N) per tree (docs/algorithms/rollout.md eq. 8)
                kept = sorted(int(i) for i in prompt.rng.choice(len(leaves), size=self.K, replace=False))
                tree.prune([leaves[i] for i in kept])
