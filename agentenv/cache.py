"""Where agentenv keeps things it builds once (search indexes, converted models)."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_dir"]


def cache_dir(*parts: str) -> Path:
    """``$AGENTENV_CACHE/<parts>`` (default ``~/.cache/agentenv``), created if missing."""
    root = Path(os.environ.get("AGENTENV_CACHE") or Path.home() / ".cache" / "agentenv")
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path
