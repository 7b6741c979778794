"""The rollout side: episodes, rollout trees, the strategies that branch them, the loop that grows them.

Data flows down the modules, each importing only those above it:

- :mod:`agents.rollout.episodes`: one episode, turn by turn, token ids in and out
  (:func:`run_episodes`, :class:`RolloutConfig`, :class:`Trajectory`);
- :mod:`agents.rollout.tree`: :class:`~agents.rollout.tree.RolloutTree`, the turns of one prompt's episodes;
- :mod:`agents.rollout.strategies`: where the trees branch (the strategy contract and the papers' strategies);
- :mod:`agents.rollout.diagnostics`: what a tree cost and produced (``tree/…`` metrics);
- :mod:`agents.rollout.tree_loop`: :func:`~agents.rollout.tree_loop.rollout_trees`, the async loop that
  grows every prompt's trees under a strategy.

Nothing here needs torch; the training side (:mod:`agents.training`) turns trees into tensors.
The episode API is importable from here: ``from agents.rollout import RolloutConfig, run_episodes``.
"""

from agents.rollout.episodes import (
    DEFAULT_MAX_PROMPT_TOKENS,
    DEFAULT_MAX_RESPONSE_TOKENS,
    Episode,
    EpisodeStatus,
    RolloutConfig,
    Trajectory,
    TurnRecord,
    episodes_for,
    run_episode,
    run_episodes,
    stream_episodes,
    take_turn,
    task_episode,
)

__all__ = [
    "DEFAULT_MAX_PROMPT_TOKENS",
    "DEFAULT_MAX_RESPONSE_TOKENS",
    "Episode",
    "EpisodeStatus",
    "RolloutConfig",
    "Trajectory",
    "TurnRecord",
    "episodes_for",
    "run_episode",
    "run_episodes",
    "stream_episodes",
    "take_turn",
    "task_episode",
]
