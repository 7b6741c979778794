"""Wrappers that change how an environment is seen (token ids instead of text)."""

from agentenv.wrappers.token_env import TokenEnv

__all__ = ["TokenEnv"]
