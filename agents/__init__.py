"""Learners, engines and the rollout loop for LLM agents that use tools over many turns.

The names below are imported on first use, so ``import agents`` stays light::

    from agents import Episode, RolloutConfig, run_episodes, evaluate
"""

import importlib

_LAZY = {
    "Episode": "agents.rollout",
    "RolloutConfig": "agents.rollout",
    "Trajectory": "agents.rollout",
    "TurnRecord": "agents.rollout",
    "episodes_for": "agents.rollout",
    "run_episode": "agents.rollout",
    "run_episodes": "agents.rollout",
    "stream_episodes": "agents.rollout",
    "take_turn": "agents.rollout",
    "EvalReport": "agents.eval.evaluation",
    "evaluate": "agents.eval.evaluation",
    "pass_at_k": "agents.eval.evaluation",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'agents' has no attribute {name!r}")
