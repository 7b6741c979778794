"""Fixtures and process-table helpers for the sandbox tests (read /proc directly, so the
checks do not share code with what they check)."""

from __future__ import annotations

import os
import time
from types import SimpleNamespace

import pytest

from sandboxes import LocalSandbox


def _stat(pid: int) -> tuple[int, str, int] | None:
    """(parent pid, state, start time) of ``pid``, or None if it does not exist."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    return int(fields[1]), fields[0].decode(), int(fields[19])


def process_tree(root: int) -> set[tuple[int, int]]:
    """(pid, start time) of ``root`` and of every process below it."""
    table = {}
    for name in os.listdir("/proc"):
        if name.isdigit() and (st := _stat(int(name))) is not None:
            table[int(name)] = st
    found, stack = set(), [root]
    while stack:
        pid = stack.pop()
        if pid in table:
            found.add((pid, table[pid][2]))
            stack.extend(p for p, st in table.items() if st[0] == pid)
    return found


def still_there(processes: set[tuple[int, int]], wait: float = 5.0) -> set[tuple[int, int]]:
    """Those of ``processes`` that still exist (zombies included) after at most ``wait`` s."""
    deadline = time.monotonic() + wait
    while True:
        left = {(pid, start) for pid, start in processes if (st := _stat(pid)) is not None and st[2] == start}
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.02)


def command(pid: int) -> str:
    """The program name of process ``pid`` (basename of argv[0]); "" if it is gone."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return os.path.basename(f.read().split(b"\0")[0].decode())
    except OSError:
        return ""


def family_processes(box: LocalSandbox) -> set[tuple[int, int]]:
    """Every process of the sandbox's container, from its bubblewrap (or anchor) process."""
    return process_tree(box._session.family.process.pid)


@pytest.fixture
def box():
    sandbox = LocalSandbox(preimport=("math",))  # short: these tests need no numpy or sympy
    yield sandbox
    sandbox.close()


@pytest.fixture
def procs():
    """The process-table helpers above, for test modules (which cannot import conftest)."""
    return SimpleNamespace(
        tree=process_tree, still_there=still_there, family=family_processes, stat=_stat, command=command
    )
