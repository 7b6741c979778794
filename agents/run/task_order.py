"""The order in which a run trains on its environment's tasks: a seeded permutation after the held-out ones."""

from dataclasses import dataclass

import numpy as np

__all__ = ["TaskOrder"]


@dataclass
class TaskOrder:
    """The order in which a run trains on its environment's tasks, and its position in it.

    An environment with a task list of ``tasks`` entries trains on tasks ``holdout … tasks−1``
    (the first ``holdout`` are held out for evaluation), each epoch in a fresh permutation drawn
    from ``(seed, epoch)``. One without a task list (``tasks=None``) is reset with seeds
    ``holdout, holdout+1, …`` (evaluation uses seeds below ``holdout``).

    Attributes:
        tasks: Size of the task list, or ``None`` for seeded resets.
        holdout: Tasks (or seeds) reserved for evaluation.
        seed: Seeds the permutations.
        epoch: Passes over the tasks completed.
        offset: Position within the current epoch's permutation (or seeds drawn so far).
    """

    tasks: int | None
    holdout: int
    seed: int
    epoch: int = 0
    offset: int = 0

    def __post_init__(self) -> None:
        if self.tasks is not None and self.tasks <= self.holdout:
            raise ValueError(
                f"the environment has {self.tasks} tasks and holdout={self.holdout} keeps them all for "
                "evaluation; lower holdout"
            )

    def take(self, count: int) -> list[int]:
        """The next ``count`` task indices (or reset seeds), crossing into the next epoch when needed."""
        if self.tasks is None:
            start = self.holdout + self.offset
            self.offset += count
            return list(range(start, start + count))
        taken: list[int] = []
        while len(taken) < count:
            order = self._permutation(self.epoch)
            chunk = order[self.offset : self.offset + count - len(taken)]
            taken += chunk
            self.offset += len(chunk)
            if self.offset == len(order):
                self.epoch, self.offset = self.epoch + 1, 0
        return taken

    def position(self) -> dict[str, int]:
        """Where the order stands (stored in checkpoints; ``TaskOrder(..., **position)`` restores it)."""
        return {"epoch": self.epoch, "offset": self.offset}

    def _permutation(self, epoch: int) -> list[int]:
        assert self.tasks is not None  # take() permutes task lists only; seeded resets need no order
        rng = np.random.default_rng(np.random.SeedSequence(self.seed, spawn_key=(epoch,)))
        return [self.holdout + int(i) for i in rng.permutation(self.tasks - self.holdout)]
