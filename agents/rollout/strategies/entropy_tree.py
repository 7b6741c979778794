"""``EntropyTree``: AT²PO's entropy-guided tree search (Zong et al. 2026, arXiv 2601.04767)."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from agents.rollout.strategies.base import BranchPoint, PromptTrees, Strategy, fresh_chain, require_positive, resample
from agents.rollout.tree import Node, RolloutTree

__all__ = ["EntropyTree"]


@dataclass(frozen=True)
class EntropyTree(Strategy):
    """``M`` chains from the prompt, then ``L`` rounds that each resample the ``K`` best-scored turns.

    A round scores every turn n that did not end its episode (it called a tool; answers never
    qualify) once, ``score(n) = H(n) − alpha·|siblings(n)|`` with H(n) the node entropy (mean
    negative sampler log-prob of n's action), takes the ``K`` best, and for each creates a
    **sibling** of n: n's turn resampled from exactly the context n saw, on a fork of the
    environment state n started from, then rolled out to the end. One tree of
    ``M + L·K`` leaves per prompt (22 by default).

    As the official code does, the prompt itself is a candidate too, with H = 0 and
    ``|children| − 1`` as its sibling count (choosing it starts a new chain); ties keep
    breadth-first order; when there are fewer than ``K`` candidates the ranking repeats from the
    top, so the leaf count stays ``M + L·K``. ``root_candidate=False`` scores turns only (the
    paper's wording), and a round may then add fewer than ``K`` branches.
    Formulas and defaults: docs/algorithms/rollout.md "Entropy-guided tree" (eqs. 9–11).

    Args:
        M: Initial chains.
        L: Expansion rounds.
        K: Branches per round.
        alpha: Weight of the sibling penalty.
        root_candidate: Whether the prompt competes with the turns (the official code's behaviour).
    """

    M: int = 10
    L: int = 2
    K: int = 6
    alpha: float = 0.05
    root_candidate: bool = True

    keeps_turn_states = True  # a sibling of n starts from the state n started from

    def __post_init__(self) -> None:
        require_positive(self, "M", "L", "K")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha >= 0):
            raise ValueError(f"EntropyTree.alpha must be a finite number >= 0, got {self.alpha!r}")

    @property
    def branches_per_prompt(self) -> int:
        return self.M + self.L * self.K  # at most, without root_candidate

    def start(self, prompt: PromptTrees) -> list[BranchPoint]:
        return [fresh_chain(prompt, 0) for _ in range(self.M)]

    def next_round(self, prompt: PromptTrees) -> list[BranchPoint]:
        done = prompt.notes.get("rounds", 0)
        if done >= self.L:
            return []
        prompt.notes["rounds"] = done + 1
        return [
            fresh_chain(prompt, 0, kind="branch", source=node) if node.is_root else resample(0, node)
            for node in self.select(prompt.trees[0])
        ]

    def scores(self, tree: RolloutTree) -> list[tuple[Node, float]]:
        """Every candidate with its score, in breadth-first order (children in creation order)."""
        scored = []
        if self.root_candidate:
            # H(root) = 0  (docs/algorithms/rollout.md eq. 10)
            scored.append((tree.root, 0.0 - self.alpha * max(0, len(tree.root.children) - 1)))
        queue = deque(tree.root.children)
        while queue:
            node = queue.popleft()
            queue.extend(node.children)
            if not node.terminal and node.env is not None:
                # H(n) − α·|siblings(n)|  (docs/algorithms/rollout.md eq. 9)
                scored.append((node, node.entropy - self.alpha * len(node.siblings)))
        return scored

    def select(self, tree: RolloutTree) -> list[Node]:
        """The ``K`` nodes to resample this round: the best scores first (see the class docstring)."""
        ranked = [node for node, _ in sorted(self.scores(tree), key=lambda pair: -pair[1])]  # stable: ties stay BFS
        if not ranked:
            return []
        # K per round, the ranking repeated when short: |leaves| = M + L·K  (docs/algorithms/rollout.md eq. 11)
        return [ranked[i % len(ranked)] for i in range(self.K)]
