"""Resource limits of a sandbox, the same for every backend."""

from __future__ import annotations

import dataclasses
import math

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30

# RLIMIT_CPU: the hard limit is this much above the per-call soft limit, so code that ignores
# SIGXCPU (sent at the soft limit) is killed by SIGKILL at the hard one.
CPU_MARGIN_SECONDS = 1
# Where nothing may raise a hard limit between calls (the host is not root), the hard CPU
# limit of an interpreter is this ceiling for its whole life instead of one per call.
SESSION_CPU_SECONDS = 3600


def human_bytes(n: int) -> str:
    """``n`` bytes in the largest binary unit that fits, e.g. "2 GiB"."""
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} bytes"


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one sandboxed interpreter may use. Each field names the mechanism behind it.

    The wall-clock timeout is per call (``Sandbox.run(code, timeout=...)``), not a limit here.
    """

    memory_bytes: int = 2 * GiB  # address space per process (RLIMIT_AS); the default
    cpu_seconds: float | None = None  # CPU seconds per call (RLIMIT_CPU); None: the call's timeout
    max_processes: int = 128  # processes of one sandbox and its forks (RLIMIT_NPROC, Docker pids)
    file_size_bytes: int = 64 * MiB  # largest file the code may write (RLIMIT_FSIZE)
    open_files: int = 256  # open file descriptors per process (RLIMIT_NOFILE)
    output_bytes: int = 64 * KiB  # stdout, stderr, value and error kept per call; the default
    scratch_bytes: int = 256 * MiB  # size of the private scratch tmpfs (bubblewrap and Docker)
    # Memory of a local sandbox and its forks together (a cgroup's limit, where one can be made;
    # ``sandbox.isolation.describe()`` says whether it is in force). Docker: memory_bytes per container.
    total_memory_bytes: int = 4 * GiB

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.name == "cpu_seconds" and value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"Limits.{field.name} must be a number, got {value!r}")
            if not math.isfinite(value) or value <= 0:
                raise ValueError(f"Limits.{field.name} must be a positive finite number, got {value!r}")
            if field.name != "cpu_seconds" and not isinstance(value, int):
                raise TypeError(f"Limits.{field.name} must be an int, got {value!r}")
        if self.memory_bytes < 256 * MiB:
            raise ValueError(
                f"Limits.memory_bytes={self.memory_bytes} is too small for a Python interpreter "
                "with numpy loaded; use at least 256 MiB (268435456)"
            )
        if self.total_memory_bytes < 256 * MiB:
            raise ValueError(
                f"Limits.total_memory_bytes={self.total_memory_bytes} is too small for an anchor and an "
                "interpreter with numpy loaded; use at least 256 MiB (268435456)"
            )
        if self.max_processes < 4:
            raise ValueError(
                "Limits.max_processes must be at least 4 (the anchor, an interpreter, "
                f"and room for forks), got {self.max_processes}"
            )

    def cpu_for(self, timeout: float) -> float:
        """CPU seconds allowed to a call with this wall-clock timeout."""
        return self.cpu_seconds if self.cpu_seconds is not None else timeout

    def rlimits(self) -> dict[str, int]:
        """The setrlimit values the sandbox worker applies (see ``_worker.set_limits``)."""
        return {
            "memory": self.memory_bytes,
            "processes": self.max_processes,
            "open_files": self.open_files,
            "file_size": self.file_size_bytes,
            "cpu_ceiling": SESSION_CPU_SECONDS,
        }
