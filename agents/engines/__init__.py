"""Generation engines: token-id prompts in, sampled token ids with their log-probs out.

``Engine`` is the one interface (see :mod:`agents.engines.base` for the exact contract);
``HFEngine`` runs a transformers model in-process, ``VLLMEngine`` vLLM's in-process async engine,
``OpenAIEngine`` talks to an OpenAI-compatible completions server, and ``ScriptedEngine`` replays
scripted completions for tests and benchmarks. Engines whose dependencies are heavy are
imported on first use.
"""

from agents.engines.base import Completion, Engine, FinishReason, SamplingParams

__all__ = [
    "Completion",
    "Engine",
    "FinishReason",
    "HFEngine",
    "OpenAIEngine",
    "SamplingParams",
    "ScriptedEngine",
    "VLLMEngine",
]

_LAZY = {
    "HFEngine": "agents.engines.hf",
    "VLLMEngine": "agents.engines.vllm",
    "OpenAIEngine": "agents.engines.openai",
    "ScriptedEngine": "agents.engines.scripted",
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'agents.engines' has no attribute {name!r}")
