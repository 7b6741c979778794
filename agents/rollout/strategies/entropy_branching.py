"""``EntropyBranching``: ARPO's entropy-adaptive branching (Dong et al. 2025, arXiv 2507.19849).

Also the machinery it shares with AEPO (:mod:`agents.rollout.strategies.entropy_balanced`): the segment
entropy estimated from top-k log-probs, the branching decision after a turn, and refills.
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from agents.rollout.episodes import TurnRecord
from agents.rollout.strategies.base import (
    Branch,
    BranchPoint,
    Probe,
    PromptTrees,
    Strategy,
    continue_after,
    fresh_chain,
    require_positive,
    resample,
)
from agents.rollout.tree import Node

__all__ = [
    "SEGMENT_ENTROPY",
    "EntropyBranching",
    "SegmentEntropyBranching",
    "branch_probability",
    "clamp01",
    "segment_entropy",
]

#: Where ARPO and AEPO write a turn's segment entropy: ``node.info[SEGMENT_ENTROPY]``. The name
#: says which estimate it is: top-k log-probs of the segment's first tokens, normalised by ln|V|.
SEGMENT_ENTROPY = "segment_entropy_topk"


def segment_entropy(
    top_logprobs: Sequence[Sequence[tuple[int, float]]],
    vocab_size: int,
    window: int = 20,
    reduce: Literal["sum", "mean"] = "sum",
) -> float:
    """ARPO's and AEPO's entropy of a segment, estimated from the sampler's top-k log-probs.

    For each of the segment's first ``window`` tokens, ``−Σ_j p_j·log p_j`` over its top-k
    log-probs ``log p_j`` (not renormalised, as in the official code); then the sum over those
    tokens (``"sum"``, the code's) or their mean (``"mean"``, which does not favour long
    segments), divided by ``ln|V|``. An empty segment has entropy 0 (docs/algorithms/rollout.md eq. 12).
    """
    if vocab_size < 2:
        raise ValueError(f"vocab_size must be >= 2 to normalise by ln|V|, got {vocab_size!r}")
    if reduce not in ("sum", "mean"):
        raise ValueError(f"reduce must be 'sum' or 'mean', got {reduce!r}")
    # −Σ_j p_{t,j}·log p_{t,j} over the first w tokens (docs/algorithms/rollout.md eq. 12)
    per_token = [-math.fsum(math.exp(logprob) * logprob for _, logprob in top) for top in top_logprobs[:window]]
    if not per_token:
        return 0.0
    # docs/algorithms/rollout.md eq. 12: the window's sum (reduce="sum"), or its mean (reduce="mean")
    total = math.fsum(per_token) if reduce == "sum" else math.fsum(per_token) / len(per_token)
    return total / math.log(vocab_size)  # H / ln|V|  (docs/algorithms/rollout.md eq. 12)


def branch_probability(delta_h: float, base: float = 0.5, weight: float = 0.2) -> float:
    """ARPO's branching probability ``clamp(base + weight·ΔH, 0, 1)`` (docs/algorithms/rollout.md eq. 14)."""
    return clamp01(base + weight * delta_h)  # docs/algorithms/rollout.md eq. 14


@dataclass(frozen=True, kw_only=True)
class SegmentEntropyBranching(Strategy):
    """What ARPO and AEPO share: after a turn, fork copies of the path with an entropy-driven probability.

    After each turn that does not end its episode (its tool result is appended), the path's
    ``ΔH = H_t − H_initial`` decides, with probability :meth:`probability`, whether to fork
    ``branch_width`` extra copies of the current prefix (tool result included), each continued
    independently on its own fork of the environment, while the prompt has rollouts left. H is
    :func:`segment_entropy`; H_t that of the segment just sampled (the one that made the tool
    call, as the official code measures) and H_initial that of the path's first segment, kept
    per path and per rollout (never carried over from an earlier batch, the reference code's
    stale-baseline defect). When every path has ended with rollouts left, fresh chains from the
    prompt fill them: one at a time, each free to branch (the code's ``refill="one"``), or all at
    once (``refill="all"``). Formulas and defaults: docs/algorithms/rollout.md "Entropy-adaptive branching" (eqs. 12–14).

    ``measure="segment_after"`` follows the papers' wording instead: the segment sampled after
    each tool result is measured, and a branch resamples that segment from the same prefix (a
    sibling on a fork of the state before it).

    Args:
        window: Tokens of a segment whose entropy is measured (20).
        topk: Top log-probs per token asked of the engine (10).
        base_probability: ``a`` in ``a + b·ΔH`` (the code's ``BRANCH_PROBABILITY``, 0.5).
        entropy_weight: ``b`` in ``a + b·ΔH`` (0.2).
        branch_width: Copies tried per decision, each with its own draw (the code's ``beam_size − 1``, 1).
        measure: ``"segment_before"`` (code) or ``"segment_after"`` (papers).
        reduce: How the window's token entropies combine: ``"sum"`` (code) or ``"mean"``.
        refill: ``"one"`` (code) or ``"all"``.
        vocab_size: |V| for the normalisation; default: the engine's ``vocab_size``.
    """

    window: int = 20
    topk: int = 10
    base_probability: float = 0.5
    entropy_weight: float = 0.2
    branch_width: int = 1
    measure: Literal["segment_before", "segment_after"] = "segment_before"
    reduce: Literal["sum", "mean"] = "sum"
    refill: Literal["one", "all"] = "one"
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        require_positive(self, "window", "topk", "branch_width")
        for name, allowed in (
            ("measure", ("segment_before", "segment_after")),
            ("reduce", ("sum", "mean")),
            ("refill", ("one", "all")),
        ):
            if getattr(self, name) not in allowed:
                raise ValueError(f"{type(self).__name__}.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.vocab_size is not None:
            require_positive(self, "vocab_size")

    @property
    def keeps_turn_states(self) -> bool:  # type: ignore[override]
        return self.measure == "segment_after"  # resampling a segment needs the state before it

    @property
    def logprobs_topk(self) -> int:
        return self.topk

    @abc.abstractmethod
    def rollouts(self, prompt: PromptTrees) -> int:
        """Trajectories (leaves) per prompt: initial chains, branches and refills together."""

    @abc.abstractmethod
    def initial_chains(self, prompt: PromptTrees) -> int:
        """Chains started from the prompt at the beginning."""

    @abc.abstractmethod
    def probability(self, prompt: PromptTrees, branch: Branch, delta_h: float) -> float:
        """The probability of each copy at a decision on ``branch`` with entropy change ``delta_h``."""

    def on_decision(self, prompt: PromptTrees, branch: Branch, copies: int) -> None:
        """Called after each decision with the number of copies made; default: nothing."""

    async def prepare(self, prompt: PromptTrees, probe: Probe) -> None:
        vocab = self.vocab_size or probe.vocab_size
        if vocab is None:
            raise ValueError(
                f"{type(self).__name__} normalises entropies by ln|V|: give vocab_size=, or use an "
                "engine with a vocab_size attribute"
            )
        prompt.notes["vocab_size"] = vocab

    def entropy(self, prompt: PromptTrees, top_logprobs: Sequence[Sequence[tuple[int, float]]] | None) -> float:
        """:func:`segment_entropy` of one sample with this strategy's settings."""
        if top_logprobs is None:
            raise ValueError(
                f"{type(self).__name__} needs the top-{self.topk} log-probs of every token; the engine "
                "returned none (use an engine that supports SamplingParams.logprobs_topk)"
            )
        return segment_entropy(top_logprobs, prompt.notes["vocab_size"], self.window, self.reduce)

    def start(self, prompt: PromptTrees) -> list[BranchPoint]:
        return [fresh_chain(prompt, 0) for _ in range(min(self.initial_chains(prompt), self.rollouts(prompt)))]

    def after_turn(
        self, prompt: PromptTrees, branch: Branch, node: Node, turn: TurnRecord, ended: bool
    ) -> list[BranchPoint]:
        h = self.entropy(prompt, turn.top_logprobs)
        node.info[SEGMENT_ENTROPY] = h
        branch.notes.setdefault("h_initial", h)  # the path's first segment, this rollout only
        if self.measure == "segment_before":
            if ended:
                return []

            def point(notes: dict[str, Any]) -> BranchPoint:
                return continue_after(branch, node, notes)
        else:
            if node.parent is None or node.parent.is_root or (branch.kind == "branch" and branch.turns == 1):
                return []  # no tool result before it, or it is itself a resampled segment

            def point(notes: dict[str, Any]) -> BranchPoint:
                return resample(branch.tree, node, notes)

        # ΔH = H_t − H_initial  (docs/algorithms/rollout.md eq. 13)
        return self.decide(prompt, branch, h - branch.notes["h_initial"], point)

    def decide(
        self, prompt: PromptTrees, branch: Branch, delta_h: float, point: Callable[[dict[str, Any]], BranchPoint]
    ) -> list[BranchPoint]:
        """Draw each of ``branch_width`` copies with :meth:`probability` while rollouts remain."""
        probability = self.probability(prompt, branch, delta_h)
        copies = 0
        for _ in range(self.branch_width):
            if prompt.started + copies >= self.rollouts(prompt):
                break
            if (
                prompt.rng.random() < probability
            ):  # each copy with probability p_branch (docs/algorithms/rollout.md eqs. 14, 17)
                copies += 1
        self.on_decision(prompt, branch, copies)
        if branch.last is not None:
            branch.last.info["copies"] = copies
        return [point(dict(branch.notes)) for _ in range(copies)]

    def next_round(self, prompt: PromptTrees) -> list[BranchPoint]:
        left = self.rollouts(prompt) - prompt.started
        if left <= 0:
            return []
        return [fresh_chain(prompt, 0, kind="refill") for _ in range(1 if self.refill == "one" else left)]


@dataclass(frozen=True)
class EntropyBranching(SegmentEntropyBranching):
    """ARPO: ``N`` global chains, then entropy-driven copies up to ``n`` trajectories per prompt.

    The probability of each copy is :func:`branch_probability`:
    ``clamp(base_probability + entropy_weight·ΔH, 0, 1)`` (docs/algorithms/rollout.md eq. 14). See
    :class:`SegmentEntropyBranching` for the rest and the other hyper-parameters.

    Args:
        n: Trajectories per prompt (``ROLLOUT_N``, 16).
        N: Initial global chains (``INITIAL_ROLLOUTS``, 8).
    """

    n: int = 16
    N: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive(self, "n", "N")

    def rollouts(self, prompt: PromptTrees) -> int:
        return self.n

    @property
    def branches_per_prompt(self) -> int:
        return self.n

    def initial_chains(self, prompt: PromptTrees) -> int:
        return self.N

    def probability(self, prompt: PromptTrees, branch: Branch, delta_h: float) -> float:
        return branch_probability(delta_h, self.base_probability, self.entropy_weight)


def clamp01(value: float) -> float:
    """``value`` clamped to [0, 1], as a probability."""
    return min(1.0, max(0.0, value))
