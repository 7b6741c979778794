"""The cold start: supervised fine-tuning before RL.

- :mod:`agents.sft.demonstrations`: worked episodes of the training tasks, written from their gold answers;
- :mod:`agents.sft.train`: :func:`~agents.sft.train.sft`, fine-tuning on trajectories or chats.
"""
