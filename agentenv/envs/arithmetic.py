"""Multi-step integer arithmetic with a Python tool: ``python-math:arithmetic``, the CartPole of tool-use RL.

A question is an expression of 2 to 4 operations (``+``, ``-``, ``*``, parentheses where precedence needs
them) over integers of up to 3 digits, such as ``What is 482 * 37 - (926 + 15)?``, whose value is never
negative. SmolLM2-135M cannot multiply three-digit numbers in its head; with the ``python`` tool the task is a
copy of the expression into ``print(...)`` and of the printed value into the answer, so a learner has
something to learn that a small model can learn on a laptop. The answer is graded exactly: the reward is the
exact match with the value (``reward="em"``), not ``python-math``'s mathematical equivalence, which accepts
the question's own expression as its answer (math-verify evaluates ``\boxed{482 * 37 - (926 + 15)}``) —
a shortcut that a learner finds within a few steps.

The task list is generated, not read: task ``i`` comes from a random generator seeded with ``(seed, i)``, so
it is the same on every machine and there are as many as training wants (:data:`TRAINING_TASKS`). The first
:data:`HELDOUT_TASKS` tasks are a fixed held-out set, drawn from the default distribution with their own seed
whatever the options (so every run, every learner and every cold start is scored on the same 500
questions: ``agents train --set holdout=500``); the tasks after them are drawn with the options' distribution
(``min_operations``, ``max_operations``, ``max_digits``) and ``seed``, and a draw that repeats a held-out
question is drawn again. A narrower distribution makes a cold start that leaves room to learn:
``agents demonstrations --env python-math:arithmetic --set max_operations=2``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, ClassVar, overload

import numpy as np

from agentenv.datasets import Example
from agentenv.envs.math import MathEnv
from agentenv.options import Option, OptionRule
from agentenv.tools import Tool

__all__ = ["HELDOUT_TASKS", "TRAINING_TASKS", "ArithmeticEnv", "ArithmeticTasks", "random_expression"]

#: The fixed held-out questions at the start of every task list.
HELDOUT_TASKS = 500
#: Training tasks after them (more than any run on a CPU can use).
TRAINING_TASKS = 1_000_000
#: Seeds the held-out questions, whatever ``seed`` the training tasks have.
HELDOUT_SEED = 20261206
OPERATORS = ("+", "-", "*")
_PRECEDENCE = {"+": 1, "-": 1, "*": 2}
_ATOM = 3  # a number's precedence: never parenthesised


def random_expression(rng: np.random.Generator, operations: int, max_digits: int) -> tuple[str, int]:
    """A random expression of ``operations`` binary operations over integers of 1 to ``max_digits`` digits, and its value.

    The operations form a random binary tree; a sub-expression is parenthesised where Python's precedence would
    otherwise read it differently, so the text evaluates to the value.
    """

    def build(count: int) -> tuple[str, int, int]:  # text, precedence, value
        if count == 0:
            digits = int(rng.integers(1, max_digits + 1))
            value = int(rng.integers(0 if digits == 1 else 10 ** (digits - 1), 10**digits))
            return str(value), _ATOM, value
        left_count = int(rng.integers(0, count))
        operator = OPERATORS[int(rng.integers(len(OPERATORS)))]
        left, left_precedence, left_value = build(left_count)
        right, right_precedence, right_value = build(count - 1 - left_count)
        precedence = _PRECEDENCE[operator]
        if left_precedence < precedence:
            left = f"({left})"
        if right_precedence < precedence or (right_precedence == precedence and operator == "-"):
            right = f"({right})"
        value = {"+": left_value + right_value, "-": left_value - right_value, "*": left_value * right_value}[operator]
        return f"{left} {operator} {right}", precedence, value

    text, _, value = build(operations)
    return text, value


class ArithmeticTasks(Sequence[Example]):
    """The task list of :class:`ArithmeticEnv`: :data:`HELDOUT_TASKS` fixed held-out questions, then ``training``
    tasks drawn from the given distribution, each made when asked for (see the module docstring)."""

    def __init__(
        self,
        *,
        min_operations: int = 2,
        max_operations: int = 4,
        max_digits: int = 3,
        seed: int = 0,
        training: int = TRAINING_TASKS,
    ) -> None:
        if not 1 <= min_operations <= max_operations:
            raise ValueError(
                f"need 1 <= min_operations <= max_operations, got min_operations={min_operations}, "
                f"max_operations={max_operations}"
            )
        self.min_operations, self.max_operations, self.max_digits = min_operations, max_operations, max_digits
        self.seed, self.training = seed, training
        self._heldout = [self._draw(HELDOUT_SEED, i, 2, 4, 3) for i in range(HELDOUT_TASKS)]
        self._heldout_questions = {example.question for example in self._heldout}

    def __len__(self) -> int:
        return HELDOUT_TASKS + self.training

    @overload
    def __getitem__(self, index: int) -> Example: ...
    @overload
    def __getitem__(self, index: slice) -> list[Example]: ...
    def __getitem__(self, index: int | slice) -> Example | list[Example]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        if not -len(self) <= index < len(self):
            raise IndexError(f"task {index} of {len(self)}")
        index %= len(self)
        if index < HELDOUT_TASKS:
            return self._heldout[index]
        attempt = 0
        while True:  # a training task never repeats a held-out question
            example = self._draw(
                self.seed, index, self.min_operations, self.max_operations, self.max_digits, attempt=attempt
            )
            if example.question not in self._heldout_questions:
                return example
            attempt += 1

    @staticmethod
    def _draw(seed: int, index: int, low: int, high: int, max_digits: int, attempt: int = 0) -> Example:
        rng = np.random.default_rng((seed, index, attempt))
        while True:
            operations = int(rng.integers(low, high + 1))
            expression, value = random_expression(rng, operations, max_digits)
            if value >= 0:  # non-negative answers: EM's normalisation drops a minus sign
                break
        meta = {"expression": expression, "operations": operations}
        return Example(f"arithmetic-{index}", f"What is {expression}?", (str(value),), meta=meta)


class ArithmeticEnv(MathEnv):
    """Evaluate an integer expression with a sandboxed Python session; the answer must be its value, exactly.

    Args:
        min_operations: Fewest operations of a training task's expression (the held-out set has 2 to 4).
        max_operations: Most operations of a training task's expression.
        max_digits: Most digits of a training task's numbers (the held-out set has up to 3).
        seed: Seeds the training tasks (the held-out set has its own).
        preimport: Modules each episode's session has imported: ``math`` only, as integer expressions
            need nothing more (numpy and sympy, MathEnv's default, take ~260 ms of each episode's start).
        reward: ``"em"``: 1 when the boxed answer is the value. ``"math"`` (math-verify's equivalence) is
            gamed: AT²PO seed 2 of benchmarks/results/arithmetic_learning_reward_math.json learned to box
            the expression itself (held-out EM 70.0% → 38.5% after step 3 while that reward read 73.0%).
        **options: The options of :class:`~agentenv.envs.math.MathEnv` (``sandbox``, ``timeout``,
            ``max_tool_calls``, …), but not its data: the tasks are generated.
    """

    OPTIONS: ClassVar[dict[str, OptionRule]] = {
        "min_operations": Option(int, minimum=1),
        "max_operations": Option(int, minimum=1),
        "max_digits": Option(int, minimum=1),
        "seed": Option(int),
    }
    FIXED_OPTIONS: ClassVar[frozenset[str]] = MathEnv.FIXED_OPTIONS | {"data"}

    def __init__(
        self,
        *,
        min_operations: int = 2,
        max_operations: int = 4,
        max_digits: int = 3,
        seed: int = 0,
        preimport: Sequence[str] | None = ("math",),
        reward: str | Callable[..., float] = "em",
        **options: Any,
    ) -> None:
        own = {"min_operations": min_operations, "max_operations": max_operations, "max_digits": max_digits}
        self.check_options({**own, "seed": seed, "preimport": preimport, "reward": reward, **options})
        self.generated = ArithmeticTasks(**own, seed=seed)
        super().__init__(preimport=preimport, reward=reward, **options)

    def load_tasks(self, dataset: str, data: str | Path | None) -> Sequence[Example]:
        return self.generated

    def example_argument(self, tool: Tool, task: Example) -> str:
        if tool.name == "python":
            return f"print({task.meta['expression']})"
        return super().example_argument(tool, task)
