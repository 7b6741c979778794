"""Where agentenv keeps things it builds once (search indexes, converted models), and how it builds them.

A cache that says "done" must hold what it says: :func:`build_once` builds a folder in a temporary
sibling, checks it, writes its marker last and renames it into place; a folder whose marker exists
but whose files fail the check is rebuilt, with one log line saying why.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from filelock import FileLock

__all__ = ["COMPLETE", "build_once", "cache_dir"]

logger = logging.getLogger(__name__)

#: The default marker file of a folder built by :func:`build_once`.
COMPLETE = ".complete"


def cache_dir(*parts: str) -> Path:
    """``$AGENTENV_CACHE/<parts>`` (default ``~/.cache/agentenv``), created if missing."""
    root = Path(os.environ.get("AGENTENV_CACHE") or Path.home() / ".cache" / "agentenv")
    path = root.joinpath(*parts)
    path.mkdir(parents=True, exist_ok=True)
    return path


def build_once(
    target: Path,
    build: Callable[[Path], None],
    check: Callable[[Path], None],
    *,
    marker: str = COMPLETE,
    record: str = "",
) -> Path:
    """Return ``target``, a folder built by ``build(tmp)`` the first time it is asked for.

    ``build`` fills an empty temporary folder beside ``target``; ``check(folder)`` raises (any
    exception, naming what is wrong) unless the folder holds what it should, and runs both on the
    new folder before its ``marker`` file (holding ``record``) is written and the folder renamed
    into place, and on every later call that finds the marker, so a folder that lies is rebuilt.
    A file lock (``target`` + ``.lock``) makes one process build while the others wait; a crash
    leaves no ``target`` behind.
    """
    target = Path(target)
    if _passes(target, check, marker, say=False):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target) + ".lock"):
        if _passes(target, check, marker, say=True):  # another process built it meanwhile
            return target
        if target.exists():  # a failed check (logged), or an older layout without a marker
            doomed = Path(tempfile.mkdtemp(prefix=f".{target.name}.old.", dir=target.parent))
            os.replace(target, doomed / target.name)
            shutil.rmtree(doomed, ignore_errors=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        try:
            build(tmp)
            check(tmp)
            (tmp / marker).write_text(record)
            os.rename(tmp, target)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def _passes(target: Path, check: Callable[[Path], None], marker: str, *, say: bool) -> bool:
    if not (target / marker).is_file():
        return False
    try:
        check(target)
    except Exception as error:  # whatever the check found: the folder is rebuilt
        if say:
            logger.warning("rebuilding %s: its files do not load (%s: %s)", target, type(error).__name__, error)
        return False
    return True
