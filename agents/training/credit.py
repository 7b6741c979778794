"""Credit assignment: from leaf rewards to the advantage each action token is trained with.

Two families, exactly as in docs/algorithms/credit.md "Credit assignment":

- **trajectory-level** (GRPO, Tree-GRPO): one advantage per leaf, broadcast over its whole
  path. :func:`grpo_advantages` and :func:`tree_grpo_advantages` are the formulas on plain
  numbers; :func:`grpo_credit` and :func:`tree_grpo_credit` apply them to the trees of one
  prompt and fill ``leaf.advantage`` (train with ``tree.paths(advantage="leaf")``).
- **turn-wise** (AT²PO): :func:`turnwise_credit` backs values up the tree and gives every turn
  its own advantage, filling ``node.value`` and ``node.advantage`` (train with
  ``tree.paths(advantage="turn")``).

The learners take credit as a callable ``credit(trees) -> paths`` (:data:`Credit`):
:class:`GRPOCredit`, :class:`TreeGRPOCredit` and :class:`TurnwiseCredit` are these functions
with their hyper-parameters, returning the trees' training paths.

Every function is pure arithmetic in float64; none produces NaN for any valid tree (single
children, ties, one leaf, all-equal rewards).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from agents.rollout.tree import Node, RolloutTree, TrainingPath

__all__ = [
    "ADVANTAGES",
    "BACKUPS",
    "Credit",
    "GRPOCredit",
    "TreeGRPOCredit",
    "TurnwiseCredit",
    "grpo_advantages",
    "grpo_credit",
    "tree_grpo_advantages",
    "tree_grpo_credit",
    "turnwise_credit",
]

Backup = Literal["child_softmax", "child_mean", "leaf_mean", "entropy_linear"]
Advantage = Literal["node_value", "value_minus_parent", "value_minus_root", "sum"]

#: How :func:`turnwise_credit` backs values up from the children to a node.
BACKUPS: tuple[str, ...] = ("child_softmax", "child_mean", "leaf_mean", "entropy_linear")
#: How :func:`turnwise_credit` turns values into a turn's advantage.
ADVANTAGES: tuple[str, ...] = ("node_value", "value_minus_parent", "value_minus_root", "sum")


def grpo_advantages(rewards: Sequence[float], eps: float = 1e-6, unbiased: bool = True) -> list[float]:
    """GRPO advantages of one prompt's group: ``A_i = (r_i − mean) / (std + eps)``.

    The spec does not say which std (docs/algorithms/credit.md eqs. 19, 20, 21); the official code (verl's
    ``compute_grpo_outcome_advantage``, which ARPO and AEPO run) uses ``torch.std``, the
    unbiased (n − 1) estimate, and gives a group of one mean 0 and std 1. That is the default;
    ``unbiased=False`` uses the population std (a group of one then gets advantage 0).

    Args:
        rewards: the rewards of the trajectories sampled for one prompt.
        eps: added to the std (verl's ``epsilon``, 1e-6).
        unbiased: Bessel-corrected std (default, the code's) or population std.
    """
    return _zscores(rewards, eps, unbiased)  # docs/algorithms/credit.md eq. 21


def tree_grpo_advantages(rewards_by_tree: Sequence[Sequence[float]], eps: float = 1e-6) -> list[list[float]]:
    """Tree-GRPO advantages of one prompt's M trees (Ji et al. 2025).

    ``A_i = z(r_i within its tree) + z(r_i within all leaves of the prompt)``, each
    ``z = (r − mean) / (std + eps)`` with the unbiased std; a group of one gets mean 0, std 1
    (docs/algorithms/credit.md eq. 22, with z from eqs. 19, 20).

    Args:
        rewards_by_tree: the leaf rewards of each tree of one prompt.
        eps: added to the std.

    Returns:
        The advantages, shaped like ``rewards_by_tree``.
    """
    if not rewards_by_tree:
        raise ValueError("tree_grpo_advantages needs the leaf rewards of at least one tree")
    # docs/algorithms/credit.md eq. 22: the inter-tree term, over all leaves of the prompt
    pooled = _zscores([reward for rewards in rewards_by_tree for reward in rewards], eps, unbiased=True)
    advantages, start = [], 0
    for rewards in rewards_by_tree:
        within_tree = _zscores(rewards, eps, unbiased=True) if rewards else []
        # A_i = z_tree(r_i) + z_prompt(r_i): Tree-GRPO's intra-tree plus inter-tree advantage
        advantages.append([a + b for a, b in zip(within_tree, pooled[start : start + len(rewards)])])
        start += len(rewards)
    return advantages


def grpo_credit(trees: Sequence[RolloutTree], eps: float = 1e-6, unbiased: bool = True) -> None:
    """Fill ``leaf.advantage`` with :func:`grpo_advantages` over all leaves of one prompt's trees."""
    leaves = _leaves_of(trees)
    for leaf, value in zip(leaves, grpo_advantages([_reward(leaf) for leaf in leaves], eps, unbiased)):
        leaf.advantage = value


def tree_grpo_credit(trees: Sequence[RolloutTree], eps: float = 1e-6) -> None:
    """Fill ``leaf.advantage`` with :func:`tree_grpo_advantages` over one prompt's trees."""
    _leaves_of(trees)  # validates
    rewards = [[_reward(leaf) for leaf in tree.leaves()] for tree in trees]
    for tree, values in zip(trees, tree_grpo_advantages(rewards, eps)):
        for leaf, value in zip(tree.leaves(), values):
            leaf.advantage = value


def turnwise_credit(
    tree: RolloutTree,
    backup: Backup = "child_softmax",
    advantage: Advantage = "node_value",
    normalize_leaves: bool = True,
    eps: float = 1e-6,
) -> None:
    """AT²PO turn-wise credit: fill ``node.value`` for every node and ``node.advantage`` per turn.

    The formulas and defaults are docs/algorithms/credit.md "AT²PO turn-wise credit" (eqs. 23–31).

    1. Leaves: ``V_leaf = (r − mean) / (std + eps)`` over the tree's leaves with the population
       std (the official code's default); ``normalize_leaves=False`` keeps ``V_leaf = r``.
    2. Every other node n (the root included) backs up from its children c:

       - ``"child_softmax"`` (default, the code's): ``V_n = Σ_c softmax_c(H(c)) · V_c``, a
         softmax over the children's node entropies at temperature 1;
       - ``"child_mean"``: ``V_n = mean_c V_c``;
       - ``"leaf_mean"``: ``V_n`` = mean of ``V_leaf`` over all leaves below n;
       - ``"entropy_linear"``: ``V_n = Σ_c H(c) / Σ_c' H(c') · V_c`` (one summary's reading of
         the paper); when every child has entropy 0 the weights are uniform.
    3. A turn's advantage:

       - ``"node_value"`` (default, the code's): ``A_n = V_n``;
       - ``"value_minus_parent"``: ``A_n = V_n − V_parent`` (the root is a first turn's parent);
       - ``"value_minus_root"``: ``A_n = V_n − V_root``;
       - ``"sum"``: ``A_n = (V_n − V_parent) + (V_n − V_root)``.

    The root gets a value but no advantage (it is the prompt, never trained).

    Worked example (docs/algorithms/credit.md "Turn-wise worked example"): first turn a with leaves a1 (V = +1, H = 0.4) and a2
    (V = −1, H = 0.6) gives ``V_a = 0.450·1 + 0.550·(−1) = −0.10``.
    """
    if backup not in BACKUPS:
        raise ValueError(f"unknown backup {backup!r}; choose one of {', '.join(BACKUPS)}")
    if advantage not in ADVANTAGES:
        raise ValueError(f"unknown advantage {advantage!r}; choose one of {', '.join(ADVANTAGES)}")
    leaves = _leaves_of([tree])
    for node in tree.nodes():
        if not node.children and not node.terminal:
            raise ValueError(
                f"node {node.id} has no children and did not end its episode: finish it with "
                "node.finish(reward) or drop it with tree.prune(...) before credit assignment"
            )
    rewards = [_reward(leaf) for leaf in leaves]
    # docs/algorithms/credit.md eq. 23
    leaf_values = _zscores(rewards, eps, unbiased=False) if normalize_leaves else rewards
    # V(n) by node id, filled leaves first; each value is also written to node.value.
    values: dict[int, float] = {}
    for leaf, value in zip(leaves, leaf_values):
        leaf.value = values[leaf.id] = value

    # Children before parents: reversed depth-first order. Leaf sums and counts serve leaf_mean.
    leaf_sum = {leaf.id: values[leaf.id] for leaf in leaves}
    leaf_count = {leaf.id: 1 for leaf in leaves}
    for node in [*reversed(tree.nodes()), tree.root]:
        if node.terminal:
            continue
        leaf_sum[node.id] = math.fsum(leaf_sum[child.id] for child in node.children)
        leaf_count[node.id] = sum(leaf_count[child.id] for child in node.children)
        if backup == "leaf_mean":
            values[node.id] = leaf_sum[node.id] / leaf_count[node.id]  # docs/algorithms/credit.md eq. 26
        else:
            # docs/algorithms/credit.md eqs. 24, 25, 27
            values[node.id] = math.fsum(
                w * values[child.id] for w, child in zip(_child_weights(node, backup), node.children)
            )
        node.value = values[node.id]

    root_value = values[tree.root.id]
    for node in tree.nodes():
        assert node.parent is not None  # nodes() lists turns only; the root is the parent of a first turn
        value, parent_value = values[node.id], values[node.parent.id]
        if advantage == "node_value":
            node.advantage = value  # A_n = V_n  (docs/algorithms/credit.md eq. 28)
        elif advantage == "value_minus_parent":
            node.advantage = value - parent_value  # A_n = V_n − V_parent  (docs/algorithms/credit.md eq. 29)
        elif advantage == "value_minus_root":
            node.advantage = value - root_value  # A_n = V_n − V_root  (docs/algorithms/credit.md eq. 30)
        else:
            # sum of the two (docs/algorithms/credit.md eq. 31)
            node.advantage = (value - parent_value) + (value - root_value)


#: ``credit(trees) -> paths``: assign credit over the finished trees of one prompt and return one
#: training path per leaf, its action tokens carrying their advantages.
Credit = Callable[[Sequence[RolloutTree]], list[TrainingPath]]


@dataclass(frozen=True)
class GRPOCredit:
    """GRPO: each leaf's reward z-scored over all leaves of the prompt, broadcast over its path.

    Args:
        eps: Added to the std (verl's ``epsilon``).
        unbiased: Bessel-corrected std, the official code's (see :func:`grpo_advantages`).
    """

    eps: float = 1e-6
    unbiased: bool = True

    def __call__(self, trees: Sequence[RolloutTree]) -> list[TrainingPath]:
        grpo_credit(trees, self.eps, self.unbiased)
        return [path for tree in trees for path in tree.paths(advantage="leaf")]


@dataclass(frozen=True)
class TreeGRPOCredit:
    """Tree-GRPO: z-score within the leaf's tree plus z-score within the prompt, over its path.

    Args:
        eps: Added to each std.
    """

    eps: float = 1e-6

    def __call__(self, trees: Sequence[RolloutTree]) -> list[TrainingPath]:
        tree_grpo_credit(trees, self.eps)
        return [path for tree in trees for path in tree.paths(advantage="leaf")]


@dataclass(frozen=True)
class TurnwiseCredit:
    """AT²PO turn-wise credit: values backed up each tree, every turn trained with its own advantage.

    The arguments are those of :func:`turnwise_credit`; the defaults are the
    official code's (leaves z-scored within the tree, softmax-of-entropy backup, ``A_n = V_n``).
    """

    backup: str = "child_softmax"
    advantage: str = "node_value"
    normalize_leaves: bool = True
    eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.backup not in BACKUPS:
            raise ValueError(f"TurnwiseCredit.backup must be one of {', '.join(BACKUPS)}, got {self.backup!r}")
        if self.advantage not in ADVANTAGES:
            raise ValueError(f"TurnwiseCredit.advantage must be one of {', '.join(ADVANTAGES)}, got {self.advantage!r}")

    def __call__(self, trees: Sequence[RolloutTree]) -> list[TrainingPath]:
        paths = []
        for tree in trees:
            turnwise_credit(tree, self.backup, self.advantage, self.normalize_leaves, self.eps)  # type: ignore[arg-type]
            paths += tree.paths(advantage="turn")
        return paths


def _child_weights(node: Node, backup: str) -> list[float]:
    """Backup weights of a node's children (they sum to 1)."""
    n = len(node.children)
    if backup == "child_mean":
        return [1.0 / n] * n  # docs/algorithms/credit.md eq. 25
    entropies = [child.entropy for child in node.children]
    if backup == "child_softmax":
        # softmax_c(H(c)), shifted by the max for numerical safety (docs/algorithms/credit.md eq. 24)
        top = max(entropies)
        exps = [math.exp(h - top) for h in entropies]
        total = math.fsum(exps)
        return [e / total for e in exps]
    total = math.fsum(entropies)  # entropy_linear: H(c) / Σ H(c')  (docs/algorithms/credit.md eq. 27)
    return [h / total for h in entropies] if total > 0 else [1.0 / n] * n


def _zscores(values: Sequence[float], eps: float, unbiased: bool) -> list[float]:
    """``(v − mean) / (std + eps)``; with ``unbiased`` a group of one gets mean 0, std 1.

    docs/algorithms/credit.md eqs. 19, 20 ("Group z-score").
    """
    values = [float(value) for value in values]
    n = len(values)
    if n == 0:
        raise ValueError("cannot normalise an empty group of rewards")
    if unbiased and n == 1:
        # the code's convention: the unbiased std of one value is undefined (docs/algorithms/credit.md eq. 20)
        mean, std = 0.0, 1.0
    else:
        mean = math.fsum(values) / n
        # docs/algorithms/credit.md eq. 20
        std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1 if unbiased else n))
    return [(v - mean) / (std + eps) for v in values]  # docs/algorithms/credit.md eq. 19


def _leaves_of(trees: Sequence[RolloutTree]) -> list[Node]:
    if isinstance(trees, RolloutTree):
        raise TypeError("pass the trees of one prompt as a sequence, e.g. [tree]")
    leaves = [leaf for tree in trees for leaf in tree.leaves()]
    if not leaves:
        raise ValueError(
            "no finished leaves: credit assignment needs at least one turn marked terminal (node.finish(reward))"
        )
    return leaves


def _reward(leaf: Node) -> float:
    if leaf.reward is None or not math.isfinite(leaf.reward):
        raise ValueError(f"leaf {leaf.id} has reward {leaf.reward!r}; set a finite one with node.finish(reward)")
    return float(leaf.reward)
