"""The strategy contract: a strategy only decides where the trees of one prompt branch.

The loop (:func:`agents.rollout.strategies.rollout_trees`) owns everything else: it resets the env,
runs every live branch one turn at a time on the engine, records each turn as a
:class:`~agents.rollout.tree.Node`, forks environments, enforces budgets and counts what it spent. A
strategy answers four questions, each with a list of :class:`BranchPoint`:

- :meth:`Strategy.start`: which chains to start once the prompt is known;
- :meth:`Strategy.after_turn`: after a branch's turn, whether to fork extra branches (ARPO, AEPO);
- :meth:`Strategy.next_round`: when no branch is running, what to start next (AT²PO and
  Tree-GRPO expansion rounds, ARPO's refills); an empty list ends the prompt's rollout;
- :meth:`Strategy.finish`: a last edit of the finished trees (Tree-GRPO keeps K leaves).

A :class:`BranchPoint` names the node the new branch hangs under and the **environment state**
its first turn starts from; the loop forks that state, so a branch continues a Python session
or a browsed page exactly where the branch point left it.
"""

from __future__ import annotations

import abc
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import numpy as np

from agentenv.wrappers import TokenEnv
from agents.engines.base import Completion
from agents.rollout.episodes import Trajectory, TurnRecord
from agents.rollout.tree import Node, RolloutTree

__all__ = [
    "Branch",
    "BranchEvent",
    "BranchKind",
    "BranchPoint",
    "Budget",
    "Probe",
    "PromptTrees",
    "Strategy",
    "TreeStats",
    "continue_after",
    "expand",
    "fresh_chain",
    "resample",
]

#: Why a branch starts: an initial ``chain`` from the prompt, a ``refill`` chain started later
#: from the prompt to use left-over budget, or a ``branch`` a strategy forked off an existing path.
BranchKind = Literal["chain", "refill", "branch"]


@dataclass(frozen=True)
class BranchPoint:
    """Where a new branch starts.

    Attributes:
        tree: Index of the tree in :attr:`PromptTrees.trees`.
        parent: The node the branch's first turn hangs under (the root for a chain).
        env: The environment state the first turn starts from; the loop forks it, so it must
            be exactly the state that produced ``obs_ids`` after ``parent``.
        obs_ids: The observation between ``parent``'s action and the first turn (empty after
            the prompt).
        kind: See :data:`BranchKind`.
        source: The node whose score or entropy made the strategy branch (diagnostics), if any.
        notes: The new path's strategy notes (see :attr:`Branch.notes`).
    """

    tree: int
    parent: Node
    env: TokenEnv
    obs_ids: Sequence[int] = ()
    kind: BranchKind = "chain"
    source: Node | None = None
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class Branch:
    """A running branch: one path of a tree being extended turn by turn.

    Attributes:
        number: Order in which the prompt's branches started (0, 1, …); seeds derive from it.
        tree: Index of its tree.
        kind: How it started (see :data:`BranchKind`).
        parent: The node its next turn hangs under (its last turn once it has one).
        obs_ids: The observation its next turn follows.
        env: Its own environment, positioned after ``ids``.
        ids: The running context: prompt, then every observation and action of the path.
        turns: Turns this branch has taken (its first turn is turn 0).
        tool_calls: Tool calls on the whole path so far (prefix included).
        reward: Sum of the path's step rewards so far.
        last: Its most recent turn, ``None`` before the first.
        notes: The strategy's notes about this path (ARPO's first-segment entropy, AEPO's
            consecutive-branch count); a branch forked off this path starts with a copy.
    """

    number: int
    tree: int
    kind: BranchKind
    parent: Node
    obs_ids: list[int]
    env: TokenEnv
    ids: list[int]
    turns: int = 0
    tool_calls: int = 0
    reward: float = 0.0
    last: Node | None = None
    notes: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Budget:
    """Caps on what one prompt's rollout may spend; ``None`` is no cap.

    Attributes:
        leaves: Branches started (each ends in at most one leaf); branch points past it are refused.
        tool_calls: Tool calls, all branches together. A turn runs at most one tool, so a step
            runs at most as many turns as calls remain; when none remain the open branches end.
        tokens: Sampled tokens, all branches and pre-monitoring samples together. Each turn may
            sample at most what is left (allotted to branches in order); when nothing is left
            the open branches end.

    A branch ended by a budget becomes a leaf with ``info["status"] == "budget"`` and the
    path's reward so far (unless its last turn already has branches below it, then it is dropped).
    """

    leaves: int | None = None
    tool_calls: int | None = None
    tokens: int | None = None

    def __post_init__(self) -> None:
        for name in ("leaves", "tool_calls", "tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"Budget.{name} must be a positive int or None, got {value!r}")


@dataclass(frozen=True)
class BranchEvent:
    """One branch a strategy started after the initial chains (a refill or a fork).

    Attributes:
        tree: Index of the tree.
        step: The loop step at which it started (1 = after the first turns).
        kind: ``"refill"`` or ``"branch"``.
        depth: Depth of the node it hangs under (0 = the prompt).
        source_entropy: H(n) of the node that made the strategy branch, if there is one.
        pool_median: Median H(n) over the prompt's turns that had not ended their episode when
            it started (the nodes a strategy could have branched on), if there are any.
    """

    tree: int
    step: int
    kind: BranchKind
    depth: int
    source_entropy: float | None = None
    pool_median: float | None = None

    @property
    def high_entropy(self) -> bool | None:
        """Whether the source's H(n) is above the pool's median (``None`` without a source)."""
        if self.source_entropy is None or self.pool_median is None:
            return None
        return self.source_entropy > self.pool_median


@dataclass
class TreeStats:
    """What the loop spent on one tree (pruned branches included).

    Attributes:
        turns: Turns sampled.
        tokens: Action tokens sampled.
        context_tokens: Context tokens the engine was given to sample them (the sum over turns of
            the prompt-so-far length): what an engine without prefix caching computes again
            each turn, and a branch shares with its source only through such a cache.
        tool_calls: Tool calls made (from the env's ``info["tool_calls"]`` counter).
        forks: Environment forks made (branch starts and per-turn states).
        fork_seconds: Wall time spent inside ``fork()``.
        errors: ``"ExceptionType: message"`` of each turn that failed (its branch was abandoned).
        budget_cuts: Branches ended by a :class:`Budget`.
        dropped: Branches ended by a budget or an error without a leaf of their own.
    """

    turns: int = 0
    tokens: int = 0
    context_tokens: int = 0
    tool_calls: int = 0
    forks: int = 0
    fork_seconds: float = 0.0
    errors: list[str] = field(default_factory=list)
    budget_cuts: int = 0
    dropped: int = 0


@dataclass(eq=False)
class PromptTrees:
    """The rollout trees of one prompt: what a strategy sees while they grow, and the result.

    Attributes:
        index: Position of the prompt in the batch.
        key: The episode's key.
        trees: The trees (one, or ``trees_per_prompt`` for Tree-GRPO); their roots share the
            reset environment as ``root.env``.
        info: The env's reset info (question, answers, …).
        rng: The strategy's random generator for this prompt (seeded from the rollout seed).
        stats: What each tree cost, aligned with ``trees``.
        events: Every refill and branch started, in order.
        step: Loop steps so far (a step = one turn of every running branch).
        started: Branches started so far.
        refused: Branch points refused by ``Budget.leaves``.
        premonitor_tokens: Tokens sampled before the trees (AEPO's pre-monitoring).
        notes: The strategy's own notes about this prompt (e.g. AEPO's entropies and split).
        budget_exhausted: Names of the budgets that ran out.
        error: ``"ExceptionType: message"`` when the prompt could not be rolled out at all.
        seconds: Wall time of the whole prompt.
        metrics: Per-tree diagnostics (:func:`agents.rollout.diagnostics.tree_metrics`), filled at the end.
    """

    index: int
    key: Any
    trees: list[RolloutTree]
    rng: np.random.Generator
    info: dict[str, Any] = field(default_factory=dict)
    stats: list[TreeStats] = field(default_factory=list)
    events: list[BranchEvent] = field(default_factory=list)
    step: int = 0
    started: int = 0
    refused: int = 0
    premonitor_tokens: int = 0
    notes: dict[str, Any] = field(default_factory=dict)
    budget_exhausted: list[str] = field(default_factory=list)
    error: str | None = None
    seconds: float = 0.0
    metrics: list[dict[str, float]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.stats:
            self.stats = [TreeStats() for _ in self.trees]

    @property
    def leaves(self) -> list[Node]:
        """Every leaf of every tree."""
        return [leaf for tree in self.trees for leaf in tree.leaves()]

    @property
    def tokens(self) -> int:
        """Tokens sampled for this prompt: every tree's turns plus pre-monitoring."""
        return sum(stats.tokens for stats in self.stats) + self.premonitor_tokens

    @property
    def tool_calls(self) -> int:
        """Tool calls made for this prompt's trees."""
        return sum(stats.tool_calls for stats in self.stats)

    def open_turns(self) -> list[Node]:
        """The turns of all trees that did not end their episode (nodes a strategy may branch on)."""
        return [node for tree in self.trees for node in tree.nodes() if not node.terminal]

    def entropy_median(self) -> float | None:
        """Median H(n) of :meth:`open_turns`, ``None`` when there are none."""
        entropies = [node.entropy for node in self.open_turns()]
        return statistics.median(entropies) if entropies else None


class Probe(Protocol):
    """Pre-monitoring samples a strategy may draw in :meth:`Strategy.prepare`; none of them enters the trees.

    The loop that runs the strategy implements it; their tokens count in
    :attr:`PromptTrees.premonitor_tokens` and in the token budget.
    """

    @property
    def vocab_size(self) -> int | None:
        """The engine's vocabulary size, when it tells."""

    async def sample(self, max_new_tokens: int) -> Completion:
        """One completion of the prompt alone, stopping at the env's stop strings."""

    async def episode(self) -> Trajectory:
        """One whole episode of the prompt's task on a fork of the env (its tools really run)."""


class Strategy(abc.ABC):
    """Decides where the trees of one prompt branch; see the module docstring for the protocol.

    A strategy object holds only hyper-parameters: the same object serves every prompt of a
    batch concurrently, so per-prompt notes go in :attr:`PromptTrees.notes` and per-path notes
    in :attr:`Branch.notes`. Randomness comes only from :attr:`PromptTrees.rng`.
    """

    #: Whether every turn's starting state must be kept as ``node.env`` (to resample a turn later).
    keeps_turn_states: bool = False

    @property
    def trees_per_prompt(self) -> int:
        """How many trees each prompt grows."""
        return 1

    @property
    def logprobs_topk(self) -> int:
        """Top log-probs each turn must come with (0: none)."""
        return 0

    @property
    def branches_per_prompt(self) -> int | None:
        """The branches one prompt's rollout starts (each ends in at most one leaf), when known before it
        starts; ``None``: not known. It sizes the rollout's progress bar."""
        return None

    async def prepare(self, prompt: PromptTrees, probe: Probe) -> None:
        """Look at the prompt before any chain starts (AEPO's pre-monitoring); default: nothing."""

    @abc.abstractmethod
    def start(self, prompt: PromptTrees) -> list[BranchPoint]:
        """The chains to start once the prompt is known."""

    def after_turn(
        self, prompt: PromptTrees, branch: Branch, node: Node, turn: TurnRecord, ended: bool
    ) -> list[BranchPoint]:
        """Branches to fork after ``branch`` recorded ``node`` (``ended``: its episode is over)."""
        return []

    def next_round(self, prompt: PromptTrees) -> list[BranchPoint]:
        """What to start when no branch is running; an empty list ends the rollout."""
        return []

    def finish(self, prompt: PromptTrees) -> None:
        """Edit the finished trees (e.g. keep K leaves); default: nothing."""


def fresh_chain(prompt: PromptTrees, tree: int, kind: BranchKind = "chain", source: Node | None = None) -> BranchPoint:
    """A new chain from the prompt of tree ``tree`` (its first turn is a child of the root)."""
    root = prompt.trees[tree].root
    return BranchPoint(tree, root, _state_of(root), (), kind, source)


def resample(tree: int, node: Node, notes: dict[str, Any] | None = None) -> BranchPoint:
    """A sibling of ``node``: its turn sampled again from exactly the context ``node`` saw."""
    if node.parent is None:
        raise ValueError("the root is the prompt; resample a turn, or start a fresh_chain")
    return BranchPoint(tree, node.parent, _state_of(node), tuple(node.obs_ids), "branch", node, dict(notes or {}))


def expand(tree: int, node: Node) -> BranchPoint:
    """A new child of ``node``: a new next turn after ``node``'s action and its observation.

    The state after ``node``'s action is the starting state of any of its children; the first
    one's is used. Expanding the root starts a new chain.
    """
    if node.parent is None:
        return BranchPoint(tree, node, _state_of(node), (), "branch", None)
    if not node.children:
        raise ValueError(f"node {node.id} has no next turn, so the state after its action is unknown")
    first = node.children[0]
    return BranchPoint(tree, node, _state_of(first), tuple(first.obs_ids), "branch", node)


def continue_after(branch: Branch, node: Node, notes: dict[str, Any] | None = None) -> BranchPoint:
    """A copy of ``branch``'s path that continues after ``node`` (its latest turn), resampled independently."""
    if branch.last is not node:
        raise ValueError(f"node {node.id} is not the latest turn of branch {branch.number}")
    return BranchPoint(branch.tree, node, branch.env, tuple(branch.obs_ids), "branch", node, dict(notes or {}))


def _state_of(node: Node) -> TokenEnv:
    if node.env is None:
        raise ValueError(
            f"node {node.id} keeps no environment state; strategies that resample turns set "
            "keeps_turn_states = True so that the loop keeps one per turn"
        )
    return node.env


def require_positive(strategy: object, *names: str) -> None:
    """Check that the named hyper-parameters of ``strategy`` are positive ints."""
    for name in names:
        value = getattr(strategy, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{type(strategy).__name__}.{name} must be a positive int, got {value!r}")
