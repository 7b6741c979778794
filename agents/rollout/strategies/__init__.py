"""Rollout strategies: where the trees of a prompt branch. The loop that grows them is :mod:`agents.rollout.tree_loop`.

``rollout_trees(engine, episodes, strategy, TreeConfig(...))`` grows every prompt's trees
concurrently on one engine; a strategy only decides where to branch:

- :class:`Chain` ``(n=16)``: independent chains (GRPO, DAPO, GSPO);
- :class:`RandomTree` ``(M=2, N=2, L=1, K=3)``: Tree-GRPO's random expansion;
- :class:`EntropyTree` ``(M=10, L=2, K=6, alpha=0.05)``: AT²PO's entropy-guided tree (22 leaves);
- :class:`EntropyBranching` ``(n=16, N=8)``: ARPO's entropy-adaptive branching;
- :class:`EntropyBalancedBranching` ``(k=16)``: AEPO's pre-monitoring split and consecutive-branch penalty.

Every branch resumes from a fork of the environment at its branch point (``env.fork()``), so
stateful tools branch correctly. Each strategy depends only on the contract in
:mod:`agents.rollout.strategies.base`; the exact rules are in docs/algorithms/rollout.md "Rollout strategies",
and each class says where the official code and the papers differ and which one is the default.
"""

from agents.rollout.strategies.base import (
    Branch,
    BranchEvent,
    BranchPoint,
    Budget,
    Probe,
    PromptTrees,
    Strategy,
    TreeStats,
    continue_after,
    expand,
    fresh_chain,
    resample,
)
from agents.rollout.strategies.chain import Chain
from agents.rollout.strategies.entropy_balanced import (
    EntropyBalancedBranching,
    global_samples,
    penalized_branch_probability,
)
from agents.rollout.strategies.entropy_branching import (
    SEGMENT_ENTROPY,
    EntropyBranching,
    SegmentEntropyBranching,
    branch_probability,
    segment_entropy,
)
from agents.rollout.strategies.entropy_tree import EntropyTree
from agents.rollout.strategies.random_tree import RandomTree

__all__ = [
    "SEGMENT_ENTROPY",
    "Branch",
    "BranchEvent",
    "BranchPoint",
    "Budget",
    "Chain",
    "EntropyBalancedBranching",
    "EntropyBranching",
    "EntropyTree",
    "Probe",
    "PromptTrees",
    "RandomTree",
    "SegmentEntropyBranching",
    "Strategy",
    "TreeStats",
    "branch_probability",
    "continue_after",
    "expand",
    "fresh_chain",
    "global_samples",
    "penalized_branch_probability",
    "resample",
    "segment_entropy",
]
