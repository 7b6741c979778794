"""Which isolation a local sandbox gets, and the bubblewrap command line that gives it.

With bubblewrap (``bwrap``) a sandbox family runs in its own PID, network, IPC, UTS and mount
namespaces, sees the system and the Python installation read-only, and has a size-limited
tmpfs as its only writable place. Without it, the interpreter is an ordinary process with
only the setrlimit limits, a clean environment and (when we are root) a user of its own.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import stat
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Literal

from sandboxes.limits import Limits

Mode = Literal["bubblewrap", "process"]

SCRATCH = "/scratch"  # the writable tmpfs inside a bubblewrap sandbox

# Protections, in the words the start-up message uses.
NETWORK = "no network (own network namespace with loopback only)"
PID_NAMESPACE = "own PID namespace (host processes are invisible and cannot be signalled)"
READ_ONLY = "read-only view of the system and the Python installation only"
NO_HOST_FILES = "no access to the host's home, working directory or /tmp"
PRIVATE_SCRATCH = "private size-limited scratch tmpfs, discarded with the sandbox"
KERNEL_CLEANUP = "the kernel kills every sandbox process when the sandbox's PID 1 exits"
RLIMITS = "setrlimit limits: address space, CPU seconds, processes, file size, open files"
CLEAN_ENV = "clean environment (no host environment variables)"
OWN_USER = "a user id of its own (cannot touch files or processes of other users)"
WALL_CLOCK = "wall-clock timeout that kills the interpreter and all its processes"
OUTPUT_CAP = "output capped per call"

BUBBLEWRAP_PROTECTIONS = (
    NETWORK,
    PID_NAMESPACE,
    READ_ONLY,
    NO_HOST_FILES,
    PRIVATE_SCRATCH,
    KERNEL_CLEANUP,
    RLIMITS,
    CLEAN_ENV,
    OWN_USER,
    WALL_CLOCK,
    OUTPUT_CAP,
)
SAFE_ENVIRONMENT = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    # One thread per BLAS/OpenMP pool: CPU limits and fork() stay predictable.
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MPLBACKEND": "Agg",
}


@dataclasses.dataclass(frozen=True)
class Isolation:
    """What a local sandbox is protected by, and what it is not."""

    mode: Mode
    in_force: tuple[str, ...]
    missing: tuple[str, ...]
    run_as_uid: int | None  # the user the interpreter runs as when we had to choose one

    def describe(self) -> str:
        lines = [f"sandbox isolation: {self.mode}"]
        lines += [f"  in force: {p}" for p in self.in_force]
        lines += [f"  MISSING:  {p}" for p in self.missing]
        return "\n".join(lines)


@functools.cache
def python_prefixes(python: str) -> tuple[str, ...]:
    """The folders an interpreter needs to run: its prefixes and the folder of its binary."""
    if os.path.realpath(python) == os.path.realpath(sys.executable):
        found = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    else:
        query = "import sys; print('\\n'.join({sys.prefix, sys.base_prefix, sys.exec_prefix}))"
        try:
            out = subprocess.run(
                [python, "-I", "-c", query], capture_output=True, text=True, timeout=30, check=True
            ).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            raise ValueError(
                f"python={python!r} cannot be run ({exc}); pass the path of a working Python 3 interpreter"
            ) from exc
        found = set(out.split())
    found.add(str(Path(os.path.realpath(python)).parent.parent))
    return tuple(sorted(p for p in found if p and p != "/usr" and not p.startswith("/usr/")))


def readable_by_everyone(path: str) -> bool:
    """Whether a user without any privilege can reach and read ``path`` (every folder on the
    way searchable by others, the file readable by others)."""
    target = Path(os.path.realpath(path))
    for folder in reversed(target.parents):
        if not os.stat(folder).st_mode & stat.S_IXOTH:
            return False
    return bool(os.stat(target).st_mode & stat.S_IROTH)


def sandbox_uid() -> int:
    """A user id nobody else uses, so RLIMIT_NPROC counts this sandbox's processes only."""
    return 1_000_000_000 + int.from_bytes(os.urandom(4), "big") % 1_000_000_000


@functools.cache
def bubblewrap_works(bwrap: str) -> bool:
    """Whether ``bwrap`` can create the namespaces we use on this machine (a container may
    forbid them even where bubblewrap is installed)."""
    argv = [bwrap, *namespace_options(), "--ro-bind", "/", "/", "--", "/bin/true"]
    try:
        return subprocess.run(argv, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def namespace_options() -> list[str]:
    options = [
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup-try",
        "--as-pid-1",
        "--new-session",
        "--hostname",
        "sandbox",
    ]
    if os.geteuid() == 0:
        # Privileged bubblewrap: the anchor keeps only what it needs to switch to its own user.
        return options + ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    return options + ["--unshare-user", "--disable-userns"]


def bubblewrap_argv(bwrap: str, python: str, limits: Limits) -> list[str]:
    """The bubblewrap command line that starts ``python`` in a fresh sandbox."""
    argv = [bwrap, *namespace_options(), "--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):  # merged /usr: keep the symlink
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    for path in ("/etc/ld.so.cache", "/etc/ld.so.conf", "/etc/ld.so.conf.d", "/etc/localtime", "/etc/alternatives"):
        argv += ["--ro-bind-try", path, path]
    made: set[Path] = set()
    for prefix in python_prefixes(python):
        for parent in reversed(Path(prefix).parents[:-1]):  # searchable, but otherwise empty
            if parent not in made:
                made.add(parent)
                argv += ["--perms", "0755", "--dir", str(parent)]
        argv += ["--ro-bind", prefix, prefix]
    argv += [
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--size",
        str(limits.scratch_bytes),
        "--perms",
        "1777",
        "--tmpfs",
        SCRATCH,
        "--size",
        str(limits.scratch_bytes),
        "--perms",
        "1777",
        "--tmpfs",
        "/dev/shm",
        "--chdir",
        SCRATCH,
        "--clearenv",
    ]
    if Path("/tmp") not in made:  # (a Python installed under /tmp keeps its folder there)
        argv += ["--symlink", SCRATCH, "/tmp"]
    for name, value in SAFE_ENVIRONMENT.items():
        argv += ["--setenv", name, value]
    argv += ["--setenv", "HOME", SCRATCH, "--setenv", "TMPDIR", SCRATCH, "--", python]
    return argv


_warned: set[str] = set()


def choose(isolation: str, python: str) -> tuple[Isolation, str | None]:
    """The isolation for ``isolation`` in {"auto", "bubblewrap", "process"} and the bwrap path.

    "auto" uses bubblewrap where it works and otherwise warns, once per process, naming the
    protections that remain."""
    if isolation not in ("auto", "bubblewrap", "process"):
        raise ValueError(f"isolation must be 'auto', 'bubblewrap' or 'process', got {isolation!r}")
    bwrap = shutil.which("bwrap") if isolation != "process" else None
    if bwrap and bubblewrap_works(bwrap):
        uid = sandbox_uid() if os.geteuid() == 0 else None
        return Isolation("bubblewrap", BUBBLEWRAP_PROTECTIONS, (), uid), bwrap
    if isolation == "bubblewrap":
        raise RuntimeError(
            "isolation='bubblewrap' but "
            + ("bubblewrap cannot create namespaces here" if bwrap else "bwrap is not installed")
            + "; install it (Debian/Ubuntu: apt-get install bubblewrap) or pass isolation='auto'"
        )
    in_force = [RLIMITS, CLEAN_ENV, WALL_CLOCK, OUTPUT_CAP]
    missing = [NETWORK, PID_NAMESPACE, READ_ONLY, NO_HOST_FILES, PRIVATE_SCRATCH, KERNEL_CLEANUP]
    uid = None
    if os.geteuid() == 0 and all(map(readable_by_everyone, (python, *python_prefixes(python)))):
        uid = sandbox_uid()
        in_force.append(OWN_USER)
    else:
        missing.append(OWN_USER + (" — running as root: the code can lift its own limits" if os.geteuid() == 0 else ""))
    chosen = Isolation("process", tuple(in_force), tuple(missing), uid)
    if isolation == "auto" and "process" not in _warned:
        _warned.add("process")
        warnings.warn(
            "bubblewrap (bwrap) is not usable, so sandboxes run as plain processes. "
            "Install it (apt-get install bubblewrap) for full isolation.\n" + chosen.describe(),
            RuntimeWarning,
            stacklevel=3,
        )
    return chosen, None
