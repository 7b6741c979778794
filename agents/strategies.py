"""Rollout strategies and the loop that grows their trees, importable by their short path.

The homes are :mod:`agents.rollout.strategies` (the contract and the papers' strategies) and
:mod:`agents.rollout.tree_loop` (:func:`rollout_trees`, :class:`TreeConfig`).
"""

from agents.rollout.strategies import *  # noqa: F403
from agents.rollout.strategies import __all__ as _strategies
from agents.rollout.tree_loop import TreeConfig, rollout_trees

__all__ = [*_strategies, "TreeConfig", "rollout_trees"]
