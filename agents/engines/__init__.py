"""Generation engines: token-id prompts in, sampled token ids with their log-probs out.

``Engine`` is the one interface (see :mod:`agents.engines.base` for the exact contract);
``HFEngine`` runs a transformers model in-process, ``VLLMEngine`` vLLM's in-process async engine,
``OpenAIEngine`` talks to an OpenAI-compatible completions server, and ``ScriptedEngine`` replays
scripted completions for tests and benchmarks. ``make_engine`` builds one of :data:`ENGINES` by
name (:mod:`agents.engines.factory`). Engines whose dependencies are heavy are imported on first use.
"""

import importlib

from agents.engines.base import Completion, Engine, FinishReason, SamplingParams
from agents.engines.factory import ENGINES, make_engine

__all__ = [
    "ENGINES",
    "Completion",
    "Engine",
    "FinishReason",
    "HFEngine",
    "OpenAIEngine",
    "SamplingParams",
    "ScriptedEngine",
    "VLLMEngine",
    "make_engine",
]

_LAZY = {
    "HFEngine": "agents.engines.hf",
    "VLLMEngine": "agents.engines.vllm",
    "OpenAIEngine": "agents.engines.openai",
    "ScriptedEngine": "agents.engines.scripted",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'agents.engines' has no attribute {name!r}")
