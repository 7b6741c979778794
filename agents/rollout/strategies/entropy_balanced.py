"""``EntropyBalancedBranching``: AEPO's dynamic entropy-balanced rollout (Dong et al. 2025, arXiv 2510.14545)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass
from typing import Literal

from agents.rollout.strategies.base import Branch, Probe, PromptTrees, require_positive
from agents.rollout.strategies.entropy_branching import SegmentEntropyBranching, clamp01

__all__ = ["EntropyBalancedBranching", "global_samples", "penalized_branch_probability"]


def global_samples(k: int, h_root: float, h_tool: float, beta: float = 0.5) -> int:
    """AEPO's pre-monitoring split: ``m = clamp(⌊k·σ(β·(H_root − H_tool))⌋ + 1, 1, k)`` global chains.

    The other ``k − m`` trajectories are the branch budget: a question that is more uncertain
    than its tool results gets more independent chains, one whose tool results raise the
    uncertainty gets more branching (docs/algorithms/rollout.md eq. 16).
    """
    x = beta * (h_root - h_tool)  # docs/algorithms/rollout.md eq. 16
    # σ(x) without overflow (docs/algorithms/rollout.md eq. 16)
    sigma = 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
    return min(k, max(1, math.floor(k * sigma) + 1))  # docs/algorithms/rollout.md eq. 16


def penalized_branch_probability(
    delta_h: float, consecutive: int, base: float = 0.5, weight: float = 0.2, slope: float = 0.05
) -> float:
    """AEPO's branching probability ``clamp((base + weight·ΔH)·max(0, 1 − slope·l), 0, 1)``, l = ``consecutive``.

    docs/algorithms/rollout.md eq. 17.
    """
    return clamp01((base + weight * delta_h) * max(0.0, 1.0 - slope * consecutive))  # docs/algorithms/rollout.md eq. 17


@dataclass(frozen=True)
class EntropyBalancedBranching(SegmentEntropyBranching):
    """AEPO: ARPO's branching with a per-prompt budget split and a consecutive-branch penalty.

    1. **Pre-monitoring** (per prompt, before any chain): H_root is the segment entropy of a
       short sample of the prompt alone (at most ``question_tokens`` tokens, first ``window``
       measured); H_tool the mean segment entropy over the turns of one probe episode whose
       tools really run (discarded afterwards; H_root when it has no turn). The prompt gets
       :func:`global_samples` ``m`` initial chains and ``k − m`` branches.
    2. **Consecutive-branch penalty**: each copy's probability is
       :func:`penalized_branch_probability` with ``l`` the consecutive branchings so far on this
       path (``penalty_count="path"``); ``"prompt"`` counts as the official code does: every
       branch and refill of the prompt started in earlier steps of this rollout.

    Pre-monitoring tokens count in ``PromptTrees.premonitor_tokens``; the entropies and the
    split are in ``PromptTrees.notes`` (``h_root_topk``, ``h_tool_topk``, ``global_samples``).
    See :class:`~agents.rollout.strategies.entropy_branching.SegmentEntropyBranching` for the rest.
    Formulas and defaults: docs/algorithms/rollout.md "Entropy-balanced branching" (eqs. 15–18).

    Args:
        k: Trajectories per prompt (16; 12 in the deep-search scripts).
        beta: Sharpness of the split's sigmoid (0.5).
        penalty_slope: Penalty per consecutive branching (0.05).
        penalty_count: ``"path"`` or ``"prompt"`` (see above).
        question_tokens: Longest question-only sample (the code's ``initial_entropy_tokens``, 50).
    """

    k: int = 16
    beta: float = 0.5
    penalty_slope: float = 0.05
    penalty_count: Literal["path", "prompt"] = "path"
    question_tokens: int = 50

    def __post_init__(self) -> None:
        super().__post_init__()
        require_positive(self, "k", "question_tokens")
        if self.penalty_count not in ("path", "prompt"):
            raise ValueError(f"penalty_count must be 'path' or 'prompt', got {self.penalty_count!r}")
        for name in ("beta", "penalty_slope"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"EntropyBalancedBranching.{name} must be a finite number >= 0, got {value!r}")

    async def prepare(self, prompt: PromptTrees, probe: Probe) -> None:
        await super().prepare(prompt, probe)
        # The two probes are independent (each has its own seed): run together, they cost the episode's time.
        sample, run = asyncio.ensure_future(probe.sample(self.question_tokens)), asyncio.ensure_future(probe.episode())
        try:
            question, episode = await asyncio.gather(sample, run)
        finally:
            for task in (sample, run):  # when one fails, the other stops too (an episode closes its fork)
                task.cancel()
        h_root = self.entropy(prompt, question.top_logprobs)  # docs/algorithms/rollout.md eq. 12
        entropies = [self.entropy(prompt, turn.top_logprobs) for turn in episode.turns]
        # docs/algorithms/rollout.md eq. 15; H_root when the probe has no turn (the code's fallback)
        h_tool = math.fsum(entropies) / len(entropies) if entropies else h_root
        prompt.notes.update(
            h_root_topk=h_root,
            h_tool_topk=h_tool,
            probe_status=episode.status,
            global_samples=global_samples(self.k, h_root, h_tool, self.beta),
        )

    def rollouts(self, prompt: PromptTrees) -> int:
        return self.k

    @property
    def branches_per_prompt(self) -> int:
        return self.k

    def initial_chains(self, prompt: PromptTrees) -> int:
        return prompt.notes["global_samples"]

    def probability(self, prompt: PromptTrees, branch: Branch, delta_h: float) -> float:
        if self.penalty_count == "path":
            consecutive = branch.notes.get("consecutive", 0)  # l kept per path (docs/algorithms/rollout.md eq. 18)
        else:
            # the code's l: branches and refills started in earlier steps
            # (docs/algorithms/rollout.md "Entropy-balanced branching")
            consecutive = sum(1 for event in prompt.events if event.step < prompt.step)
        return penalized_branch_probability(
            delta_h, consecutive, self.base_probability, self.entropy_weight, self.penalty_slope
        )

    def on_decision(self, prompt: PromptTrees, branch: Branch, copies: int) -> None:
        # l ← l + 1 if the decision made a copy, else l ← 0  (docs/algorithms/rollout.md eq. 18)
        branch.notes["consecutive"] = branch.notes.get("consecutive", 0) + 1 if copies else 0
