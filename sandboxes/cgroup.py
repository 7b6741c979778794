"""A cgroup per sandbox family: one memory limit and one process limit for a sandbox and its forks.

setrlimit limits are per process (RLIMIT_AS) or per user (RLIMIT_NPROC), so alone they bound a
family's memory only by ``max_processes × memory_bytes``. Where this process may create a cgroup
with the memory and pids controllers, each family gets one:

* cgroup v2: a sibling of our own cgroup (its parent must already delegate ``memory`` and
  ``pids`` to its children: a child of our own cgroup could not have them, the kernel keeps
  controllers away from cgroups that hold processes), with ``memory.max``, ``memory.swap.max``
  = 0 and ``pids.max``;
* cgroup v1: a child of our cgroup in the memory hierarchy (``memory.limit_in_bytes`` and,
  where swap is accounted, ``memory.memsw.limit_in_bytes``) and one in the pids hierarchy.

The anchor joins it before it starts anything, through ``cgroup.procs`` descriptors that we open
(the kernel checks the opener's rights, so an anchor that has already switched to its own user
can still join), and every process of the family inherits it. Sandboxed code cannot leave it:
moving a process needs write access to ``cgroup.procs`` files owned by us.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import secrets
import signal
import time
from pathlib import Path

from sandboxes.limits import Limits

PREFIX = "agentenv-sandbox-"  # name of our cgroups: PREFIX + <our pid> + "-" + random
REMOVE_SECONDS = 5.0  # how long close() waits for the last processes to leave the cgroup


@dataclasses.dataclass(frozen=True)
class Parents:
    """Where this process can make family cgroups: one folder per hierarchy (one for v2)."""

    version: int  # 2 or 1
    memory: Path  # v2: the parent of every family cgroup; v1: the memory hierarchy's folder
    pids: Path  # v2: the same folder; v1: the pids hierarchy's folder


@dataclasses.dataclass
class Cgroup:
    """The cgroup(s) of one family; ``remove()`` kills what is left in them and deletes them."""

    version: int
    folders: tuple[Path, ...]  # (the v2 cgroup,) or (v1 memory cgroup, v1 pids cgroup)
    _events: int | None = None  # descriptor of the file with the OOM kill count (read twice a call)

    def procs_fds(self) -> list[int]:
        """Write-only descriptors of each folder's ``cgroup.procs``: a process that writes "0"
        to them joins the family's cgroup(s)."""
        fds: list[int] = []
        try:
            for folder in self.folders:
                fds.append(os.open(folder / "cgroup.procs", os.O_WRONLY | os.O_CLOEXEC))
        except OSError:
            for fd in fds:
                os.close(fd)
            raise
        return fds

    def oom_kills(self) -> int:
        """How many processes the kernel killed for exceeding the memory limit so far."""
        try:
            if self._events is None:
                name = "memory.events" if self.version == 2 else "memory.oom_control"
                self._events = os.open(self.folders[0] / name, os.O_RDONLY | os.O_CLOEXEC)
            text = os.pread(self._events, 4096, 0)
        except OSError:
            return 0
        for line in text.splitlines():
            key, _, value = line.partition(b" ")
            if key == b"oom_kill":
                return int(value)
        return 0

    def remove(self) -> None:
        """Kill every process still in the cgroup(s) and delete them (best effort: a cgroup
        that stays busy beyond REMOVE_SECONDS is left behind, empty cgroups are swept later)."""
        if self._events is not None:
            os.close(self._events)
            self._events = None
        deadline = time.monotonic() + REMOVE_SECONDS
        for folder in self.folders:
            while folder.exists():
                try:
                    folder.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:  # EBUSY: processes (or zombies not yet reaped) are still inside
                    if time.monotonic() > deadline:
                        break
                    _kill_members(folder)
                    time.sleep(0.005)


def _kill_members(folder: Path) -> None:
    kill = folder / "cgroup.kill"  # v2 (Linux 5.14+): the kernel kills every member at once
    with contextlib.suppress(OSError):
        if kill.exists():
            kill.write_text("1")
            return
    with contextlib.suppress(OSError):
        for pid in (folder / "cgroup.procs").read_text().split():
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)


def _mounts() -> list[tuple[str, str, str, str]]:
    """(root inside the file system, mount point, fs type, super options) of cgroup mounts."""
    found = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo") as mountinfo:
        for line in mountinfo:
            fields = line.split()
            dash = fields.index("-")
            fstype = fields[dash + 1]
            if fstype in ("cgroup", "cgroup2"):
                found.append((fields[3], fields[4], fstype, fields[dash + 3] if len(fields) > dash + 3 else ""))
    return found


def _own_cgroups() -> dict[str, str]:
    """Our cgroup path per hierarchy: {"": v2 path, "memory": v1 path, "pids": v1 path, …}."""
    found: dict[str, str] = {}
    with contextlib.suppress(OSError), open("/proc/self/cgroup") as cgroups:
        for line in cgroups:
            _id, controllers, path = line.rstrip("\n").split(":", 2)
            for controller in controllers.split(",") if controllers else [""]:
                found[controller] = path
    return found


def _folder(mount_root: str, mount_point: str, path: str) -> Path | None:
    """The folder of cgroup ``path`` under a mount of the hierarchy's ``mount_root``."""
    if path != mount_root and not path.startswith(mount_root.rstrip("/") + "/"):
        return None  # our cgroup is outside what is mounted here (e.g. a container's view)
    folder = Path(mount_point) / os.path.relpath(path, mount_root)
    return folder if folder.is_dir() else None


def _v2_parent() -> Path | None:
    own = _own_cgroups().get("")
    for root, point, fstype, _options in _mounts():
        if fstype != "cgroup2" or own is None:
            continue
        folder = _folder(root, point, own)
        if folder is None:
            continue
        # Our own cgroup holds processes, so its children cannot get controllers: use its
        # parent (a sibling of ours), or the root, which is exempt from that rule.
        parent = folder if own == "/" else folder.parent
        try:
            delegated = set((parent / "cgroup.subtree_control").read_text().split())
        except OSError:
            continue
        if {"memory", "pids"} <= delegated and os.access(parent, os.W_OK):
            return parent
    return None


def _v1_parents() -> tuple[Path, Path] | None:
    own = _own_cgroups()
    found: dict[str, Path] = {}
    for root, point, fstype, options in _mounts():
        if fstype != "cgroup":
            continue
        for controller in ("memory", "pids"):
            if controller in options.split(",") and controller in own and controller not in found:
                folder = _folder(root, point, own[controller])
                if folder is not None and os.access(folder, os.W_OK):
                    found[controller] = folder
    return (found["memory"], found["pids"]) if len(found) == 2 else None


def _sweep(parent: Path) -> None:
    """Delete empty family cgroups left by processes that died before they could (rmdir of a
    cgroup that still holds a process fails, so a live family is never touched)."""
    with contextlib.suppress(OSError):
        for folder in parent.iterdir():
            if not folder.name.startswith(PREFIX):
                continue
            owner = folder.name[len(PREFIX) :].split("-", 1)[0]
            if owner.isdigit() and not Path(f"/proc/{owner}").exists():
                with contextlib.suppress(OSError):
                    folder.rmdir()


@functools.cache
def parents() -> Parents | None:
    """Where family cgroups can be made (v2 preferred), checked once by making one; None where
    none can (no writable hierarchy with the memory and pids controllers)."""
    v2 = _v2_parent()
    candidates = [Parents(2, v2, v2)] if v2 is not None else []
    v1 = _v1_parents()
    if v1 is not None:
        candidates.append(Parents(1, *v1))
    for candidate in candidates:
        for folder in {candidate.memory, candidate.pids}:
            _sweep(folder)
        try:
            create(Limits(), candidate).remove()
        except OSError:
            continue
        return candidate
    return None


def create(limits: Limits, where: Parents) -> Cgroup:
    """A new family cgroup with the memory and process limits of ``limits``; raises OSError."""
    name = f"{PREFIX}{os.getpid()}-{secrets.token_hex(6)}"
    memory, pids = where.memory / name, where.pids / name
    made: list[Path] = []
    try:
        for folder in dict.fromkeys((memory, pids)):  # one folder for v2 or co-mounted v1
            folder.mkdir()
            made.append(folder)
        if where.version == 2:
            (memory / "memory.max").write_text(str(limits.total_memory_bytes))
            with contextlib.suppress(FileNotFoundError):  # no swap accounting: no swap to limit
                (memory / "memory.swap.max").write_text("0")
        else:
            (memory / "memory.limit_in_bytes").write_text(str(limits.total_memory_bytes))
            with contextlib.suppress(FileNotFoundError):  # the same, for memory plus swap
                (memory / "memory.memsw.limit_in_bytes").write_text(str(limits.total_memory_bytes))
        (pids / "pids.max").write_text(str(limits.max_processes))
    except OSError:
        Cgroup(where.version, tuple(made)).remove()
        raise
    return Cgroup(where.version, tuple(made))
