"""Reward schemes: how a graded episode becomes one scalar reward.

Named schemes (``reward="…"`` in ``make``):

==========  ==============================================================================
``em``      exact match of the last ``\\boxed{}`` (0 or 1); no answer scores 0
``f1``      word-level F1 of the answer
``cover_em`` 1 if a gold answer occurs in the answer
``math``    1 if the answer is mathematically equal to the gold (math-verify; needs a math grade)
``at2po``   AT²PO (Zong et al. 2026): EM, and −1 for a bad format (no ``<answer>…\\boxed{}``)
``aepo``    AEPO (Dong et al. 2025): F1, −1 for a bad format, +0.1 when the answer is right
            (EM) and every tool in ``bonus_tools`` was used
==========  ==============================================================================

A custom reward is any callable; it receives only the arguments it names, out of
``answer`` (the extracted final answer or None), ``answers`` (gold list), ``grade``
(:class:`agentenv.graders.Grade`), ``response`` (the raw ``<answer>`` content), ``tool_counts``
(calls per tool name), ``task`` (the dataset example) and ``actions`` (the model's turns).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from agentenv.graders import Grade

__all__ = ["REWARD_SCHEMES", "RewardScheme", "call_reward", "get_reward"]


@dataclass(frozen=True)
class RewardScheme:
    """A metric of the grade, an optional format penalty and an optional tool-use bonus."""

    metric: str = "em"  # "em" | "f1" | "cover_em" | "math_equal"
    format_penalty: float | None = None  # AT²PO and AEPO: -1.0 for a bad format
    bonus: float = 0.0  # AEPO: +0.1
    bonus_tools: tuple[str, ...] = ("search", "python")  # AEPO: both tools used

    def __call__(self, grade: Grade, tool_counts: Mapping[str, int]) -> float:
        if not grade.format_ok:
            return self.format_penalty if self.format_penalty is not None else 0.0
        reward = getattr(grade, self.metric)
        if reward is None:
            raise ValueError(f"the grade has no {self.metric!r}: this environment does not grade it")
        right = grade.math_equal if self.metric == "math_equal" else grade.em
        if self.bonus and right == 1.0 and all(tool_counts.get(t, 0) > 0 for t in self.bonus_tools):
            reward += self.bonus
        return float(reward)


REWARD_SCHEMES: dict[str, RewardScheme] = {
    "em": RewardScheme("em"),
    "f1": RewardScheme("f1"),
    "cover_em": RewardScheme("cover_em"),
    "math": RewardScheme("math_equal"),
    "at2po": RewardScheme("em", format_penalty=-1.0),
    "aepo": RewardScheme("f1", format_penalty=-1.0, bonus=0.1),
}


def get_reward(reward: str | Callable[..., float]) -> Callable[..., float]:
    """A reward callable from a scheme name, or the callable as given."""
    if callable(reward):
        return reward
    try:
        return REWARD_SCHEMES[reward]
    except KeyError:
        raise ValueError(
            f"unknown reward scheme {reward!r}; choose one of {sorted(REWARD_SCHEMES)} or pass a callable"
        ) from None


def call_reward(fn: Callable[..., float], available: Mapping[str, Any]) -> float:
    """Call a reward function with only the arguments it names (verifiers-style)."""
    params = _parameters(fn)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return float(fn(**available))
    missing = [n for n, p in params.items() if n not in available and p.default is p.empty]
    if missing:
        raise TypeError(
            f"reward function {getattr(fn, '__name__', fn)!r} asks for {missing}; "
            f"available arguments are {sorted(available)}"
        )
    return float(fn(**{n: available[n] for n in params if n in available}))


def _parameters(fn: Callable[..., float]) -> Mapping[str, inspect.Parameter]:
    # inspect.signature takes ~0.1 ms, once per graded episode: remembered per function.
    try:
        return _signature_parameters(fn)
    except TypeError:  # an unhashable callable
        return inspect.signature(fn).parameters


@functools.lru_cache(maxsize=256)
def _signature_parameters(fn: Callable[..., float]) -> Mapping[str, inspect.Parameter]:
    return inspect.signature(fn).parameters
