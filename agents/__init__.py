"""Learners, engines and the rollout loop for LLM agents that use tools over many turns."""
