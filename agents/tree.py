"""Rollout trees, importable by their short path; the home is :mod:`agents.rollout.tree`."""

from agents.rollout.tree import *  # noqa: F403
from agents.rollout.tree import __all__  # noqa: F401
