"""Servers: a Search-R1-compatible retrieval server and a local offline web (``python -m agentenv.serve``)."""

from agentenv.serve.dense import DenseSearch
from agentenv.serve.hosting import BackgroundServer, run_until_signal
from agentenv.serve.retrieval import RetrievalService, read_corpus
from agentenv.serve.web import LOCAL_WEB_URL, LocalWeb, LocalWebSearch

__all__ = [
    "LOCAL_WEB_URL",
    "BackgroundServer",
    "DenseSearch",
    "LocalWeb",
    "LocalWebSearch",
    "RetrievalService",
    "read_corpus",
    "run_until_signal",
]
