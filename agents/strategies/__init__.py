"""Rollout strategies: where the trees of a prompt branch, and the one loop that grows them.

``rollout_trees(engine, episodes, strategy, TreeConfig(...))`` grows every prompt's trees
concurrently on one engine; a strategy only decides where to branch:

- :class:`Chain` ``(n=16)``: independent chains (GRPO, DAPO, GSPO);
- :class:`RandomTree` ``(M=2, N=2, L=1, K=3)``: Tree-GRPO's random expansion;
- :class:`EntropyTree` ``(M=10, L=2, K=6, alpha=0.05)``: AT²PO's entropy-guided tree (22 leaves);
- :class:`EntropyBranching` ``(n=16, N=8)``: ARPO's entropy-adaptive branching;
- :class:`EntropyBalancedBranching` ``(k=16)``: AEPO's pre-monitoring split and consecutive-branch penalty.

Every branch resumes from a fork of the environment at its branch point (``env.fork()``), so
stateful tools branch correctly. The exact rules are in ``ALGORITHMS.md``; each class says
where the official code and the papers differ and which one is the default.
"""

from agents.strategies.base import (
    Branch,
    BranchEvent,
    BranchPoint,
    Budget,
    PromptTrees,
    Strategy,
    TreeStats,
    continue_after,
    expand,
    fresh_chain,
    resample,
)
from agents.strategies.chain import Chain
from agents.strategies.entropy_balanced import EntropyBalancedBranching, global_samples, penalized_branch_probability
from agents.diagnostics import SEGMENT_ENTROPY
from agents.strategies.entropy_branching import (
    EntropyBranching,
    SegmentEntropyBranching,
    branch_probability,
    segment_entropy,
)
from agents.strategies.entropy_tree import EntropyTree
from agents.strategies.loop import Probe, TreeConfig, rollout_trees
from agents.strategies.random_tree import RandomTree

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
    "TreeConfig",
    "TreeStats",
    "branch_probability",
    "continue_after",
    "expand",
    "fresh_chain",
    "global_samples",
    "penalized_branch_probability",
    "resample",
    "rollout_trees",
    "segment_entropy",
]
