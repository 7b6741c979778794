"""``Chain``: n independent trajectories per prompt (the GRPO, DAPO and GSPO baselines)."""

from __future__ import annotations

from dataclasses import dataclass

from agents.rollout.strategies.base import BranchPoint, PromptTrees, Strategy, fresh_chain, require_positive

__all__ = ["Chain"]


@dataclass(frozen=True)
class Chain(Strategy):
    """``n`` independent chains from the prompt, never branched: one tree whose root has ``n`` children.

    docs/algorithms/rollout.md "Chain" (eq. 6).

    Args:
        n: Trajectories per prompt (16 in the GRPO baselines of AT²PO, ARPO and AEPO).
    """

    n: int = 16

    def __post_init__(self) -> None:
        require_positive(self, "n")

    @property
    def branches_per_prompt(self) -> int:
        return self.n

    def start(self, prompt: PromptTrees) -> list[BranchPoint]:
        return [fresh_chain(prompt, 0) for _ in range(self.n)]  # |leaves| = n  (docs/algorithms/rollout.md eq. 6)
