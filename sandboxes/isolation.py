"""Which isolation a local sandbox gets, and the bubblewrap command line that gives it.

With bubblewrap (``bwrap``) a sandbox family runs in its own PID, network, IPC, UTS and mount
namespaces, sees the system and the Python installation read-only, and has a size-limited
tmpfs as its only writable place. Without it, the interpreter is an ordinary process with
only the setrlimit limits, a clean environment and (when we are root) a user of its own; it
never runs model code as root unless asked to with ``isolation="unsafe-process"``. Where a
cgroup can be made (``sandboxes.cgroup``), the memory and processes of a family are capped as
a whole in either mode.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import shutil
import stat
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Literal

from sandboxes import _worker, cgroup
from sandboxes.limits import CPU_MARGIN_SECONDS, SESSION_CPU_SECONDS, Limits, human_bytes

Mode = Literal["bubblewrap", "process"]
CHOICES = ("auto", "bubblewrap", "process", "unsafe-process")

SCRATCH = "/scratch"  # the writable tmpfs inside a bubblewrap sandbox
INSTALL_HINT = "install bubblewrap (Debian/Ubuntu: apt-get install bubblewrap)"

# Protections, in the words the start-up message uses.
NETWORK = "no network (own network namespace with loopback only)"
PID_NAMESPACE = "own PID namespace (host processes are invisible and cannot be signalled)"
READ_ONLY = "read-only view of the system and the Python installation only"
NO_HOST_FILES = "no access to the host's home, working directory or /tmp"
PRIVATE_SCRATCH = "private size-limited scratch tmpfs, discarded with the sandbox"
KERNEL_CLEANUP = "the kernel kills every sandbox process when the sandbox's PID 1 exits"
NO_USERNS = "no user namespace (nor, without capabilities, any other namespace) can be created inside"
RLIMITS = "setrlimit limits: address space, CPU seconds, processes, file size, open files"
HARD_RLIMITS = "the code cannot raise those limits (hard limits set, no capabilities)"
CPU_PER_CALL = (
    f"CPU seconds per call: SIGXCPU at the limit, SIGKILL at most {CPU_MARGIN_SECONDS + 1} s later "
    "(a hard limit the host sets before each call)"
)
CPU_CEILING = (
    "a hard CPU limit per call: raising a hard limit between calls needs CAP_SYS_RESOURCE, which this "
    f"process lacks, so the code can lift a call's CPU limit up to the interpreter's hard ceiling of "
    f"{SESSION_CPU_SECONDS} s (the wall-clock timeout still ends every call)"
)
CAP_SYS_RESOURCE = 24
CLEAN_ENV = "clean environment (no host environment variables)"
OWN_USER = "a user id of its own (cannot touch files or processes of other users)"
AS_ROOT = (
    "a user of its own: the code runs AS ROOT (without capabilities, but owning what root owns: "
    "it can read /etc/shadow and change the Python installation)"
)
SHARED_NPROC = "a process limit of its own: RLIMIT_NPROC counts every process of the user running it"
WALL_CLOCK = "wall-clock timeout that kills the interpreter and all its processes"
OUTPUT_CAP = "output capped per call"
SECCOMP = "a system-call filter (seccomp): the kernel's whole system-call interface is reachable"

SAFE_ENVIRONMENT = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    # One thread per BLAS/OpenMP pool: CPU limits and fork() stay predictable.
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "MPLBACKEND": "Agg",
}


def memory_cap(limits: Limits, version: int) -> str:
    """The protection a family cgroup gives, in the start-up message's words."""
    return (
        f"memory of the sandbox and its forks together capped at {human_bytes(limits.total_memory_bytes)}, "
        f"at most {limits.max_processes} processes (a cgroup v{version} of its own)"
    )


def no_memory_cap(limits: Limits) -> str:
    """What is missing without a family cgroup, and the bound that remains."""
    total = limits.max_processes * limits.memory_bytes
    return (
        "a cap on the memory of the sandbox and its forks together (no writable cgroup with the memory and "
        f"pids controllers here): only {limits.max_processes} processes x {human_bytes(limits.memory_bytes)} "
        f"of address space = {human_bytes(total)}"
    )


@dataclasses.dataclass(frozen=True)
class Isolation:
    """What a local sandbox is protected by, and what it is not."""

    mode: Mode
    in_force: tuple[str, ...]
    missing: tuple[str, ...]
    run_as_uid: int | None  # the user the interpreter runs as when we had to choose one
    cgroup: cgroup.Parents | None = None  # where each family gets its cgroup; None: no total cap
    block_userns: bool = False  # the anchor enters a user namespace of its own (bubblewrap as root)
    cpu_hard_per_call: bool = False  # we (root with CAP_SYS_RESOURCE) set RLIMIT_CPU's hard limit per call

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
    argv = [bwrap, *namespace_options(bwrap), "--ro-bind", "/", "/", "--", "/bin/true"]
    try:
        return subprocess.run(argv, capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


@functools.cache
def bwrap_has_option(bwrap: str, option: str) -> bool:
    """Whether this bubblewrap knows ``option`` (``--disable-userns`` came with 0.8.0)."""
    try:
        out = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return option in out.stdout + out.stderr


def _userns_probe_source() -> str:
    """The worker's code that blocks user namespaces, alone (the whole worker would take about
    twice as long to start), ending in ``_worker.probe_userns_main``."""
    names = ("CLONE_NEWUSER", "PR_CAPBSET_DROP", "PR_CAP_AMBIENT", "PR_CAP_AMBIENT_CLEAR_ALL", "CAPABILITY_VERSION_3")
    functions = (
        _worker.prctl,
        _worker.unshare,
        _worker.block_user_namespaces,
        _worker.drop_privileges,
        _worker.drop_capabilities,
        _worker.probe_userns_main,
    )
    return "\n".join(
        [
            "import ctypes, json, os, sys",
            *(f"{name} = {getattr(_worker, name)!r}" for name in names),
            *(inspect.getsource(function) for function in functions),
            "probe_userns_main(json.loads(sys.argv[1]))",
        ]
    )


@functools.cache
def userns_blockable(bwrap: str, python: str) -> bool:
    """Whether the anchor of a bubblewrap sandbox run by root can enter a user namespace of its
    own in which no further namespace can be made (``_worker.block_user_namespaces``), tried
    once in a real sandbox. It cannot where the host allows no user namespaces."""
    proc_fd = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY)
    try:
        config = json.dumps({"uid": sandbox_uid(), "proc_fd": proc_fd})
        argv = [*bubblewrap_argv(bwrap, python, Limits()), "-I", "-S", "-c", _userns_probe_source(), config]
        return subprocess.run(argv, pass_fds=[proc_fd], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False
    finally:
        os.close(proc_fd)


def namespace_options(bwrap: str) -> list[str]:
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
        # Privileged bubblewrap: the anchor keeps only what it needs to switch to its own user
        # and to map that user into a user namespace of its own (see block_user_namespaces;
        # bubblewrap's --disable-userns would need --unshare-user, which as root maps the
        # sandbox's user onto the host's root).
        return options + ["--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    options.append("--unshare-user")
    if bwrap_has_option(bwrap, "--disable-userns"):
        options.append("--disable-userns")
    return options


def bubblewrap_argv(bwrap: str, python: str, limits: Limits) -> list[str]:
    """The bubblewrap command line that starts ``python`` in a fresh sandbox."""
    argv = [bwrap, *namespace_options(bwrap), "--ro-bind", "/usr", "/usr"]
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


def can_raise_hard_limits() -> bool:
    """Whether this process may raise other processes' hard rlimits (CAP_SYS_RESOURCE, which
    root has on a host but often not in a container)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> CAP_SYS_RESOURCE & 1)
    except (OSError, ValueError):
        pass
    return False


def unreadable_path(python: str) -> str | None:
    """The first of ``python`` and its installation folders that a user of its own could not
    read (so a plain-process sandbox run by root cannot switch to one), or None."""
    for path in (python, *python_prefixes(python)):
        if not readable_by_everyone(path):
            return path
    return None


_warned: set[str] = set()


def choose(
    isolation: str, python: str, limits: Limits | None = None, *, euid: int | None = None
) -> tuple[Isolation, str | None]:
    """The isolation for ``isolation`` (one of CHOICES) and the bwrap path (bubblewrap mode).

    "auto" uses bubblewrap where it works and otherwise plain processes, with a warning (once
    per process) naming the protections that remain; "bubblewrap" requires it. Plain processes
    never run model code as root unless asked to by "unsafe-process": run by root, they need a
    Python installation that a user of their own can read. ``euid``: the user to decide for
    (default: ours; for tests). Raises RuntimeError, naming the fix, where nothing fits."""
    if isolation not in CHOICES:
        raise ValueError(f"isolation must be 'auto', 'bubblewrap', 'process' or 'unsafe-process', got {isolation!r}")
    limits = Limits() if limits is None else limits
    root = (os.geteuid() if euid is None else euid) == 0
    bwrap = shutil.which("bwrap") if isolation in ("auto", "bubblewrap") else None
    if bwrap and bubblewrap_works(bwrap):
        return _bubblewrap(bwrap, python, limits, root), bwrap
    if isolation == "bubblewrap":
        raise RuntimeError(
            f"isolation='bubblewrap' but {_why_not(bwrap)}; {INSTALL_HINT}, use the Docker sandbox "
            "(sandbox='docker'), or pass isolation='auto'"
        )
    unreadable = unreadable_path(python) if root else None
    if unreadable is not None and isolation != "unsafe-process":
        because = f"{_why_not(bwrap)}, so " if isolation == "auto" else ""
        raise RuntimeError(
            f"isolation={isolation!r}: {because}the sandbox would be a plain process run by root, and "
            f"{unreadable!r} is not readable by other users, so it cannot switch to a user of its own. "
            f"Model code must not run as root without isolation: {INSTALL_HINT}, use the Docker sandbox "
            "(sandbox='docker'), make the Python installation readable by others (chmod o+rX on it and on "
            "the folders above it), or, accepting that the code can then read and change what root can, "
            "pass isolation='unsafe-process'"
        )
    chosen = _process(limits, root, own_user=root and unreadable is None)
    as_root = root and chosen.run_as_uid is None
    key = "unsafe-process" if as_root else "process"
    if (isolation == "auto" or as_root) and key not in _warned:
        _warned.add(key)
        headline = (
            "sandboxes run as plain processes AS ROOT (isolation='unsafe-process'): the code can read and "
            "change what root can. "
            if as_root
            else "bubblewrap (bwrap) is not usable, so sandboxes run as plain processes. "
        )
        warnings.warn(
            f"{headline}For full isolation, {INSTALL_HINT}.\n{chosen.describe()}", RuntimeWarning, stacklevel=3
        )
    return chosen, None


def _why_not(bwrap: str | None) -> str:
    return "bubblewrap cannot create namespaces here" if bwrap else "bwrap is not installed"


def _cpu_and_memory(
    limits: Limits, root: bool, in_force: list[str], missing: list[str]
) -> tuple[bool, cgroup.Parents | None]:
    """Add what the CPU limit and the family's memory cap give here; whether the host sets a
    hard CPU limit per call, and where the family cgroups go."""
    per_call = root and can_raise_hard_limits()
    (in_force if per_call else missing).append(CPU_PER_CALL if per_call else CPU_CEILING)
    where = cgroup.parents()
    if where is not None:
        in_force.append(memory_cap(limits, where.version))
    else:
        missing.append(no_memory_cap(limits))  # RLIMIT_NPROC counts this sandbox alone: own uid or userns
    return per_call, where


def _bubblewrap(bwrap: str, python: str, limits: Limits, root: bool) -> Isolation:
    in_force = [NETWORK, PID_NAMESPACE, READ_ONLY, NO_HOST_FILES, PRIVATE_SCRATCH, KERNEL_CLEANUP]
    missing: list[str] = []
    blocked = userns_blockable(bwrap, python) if root else bwrap_has_option(bwrap, "--disable-userns")
    (in_force if blocked else missing).append(NO_USERNS)
    in_force += [RLIMITS, HARD_RLIMITS]
    per_call, where = _cpu_and_memory(limits, root, in_force, missing)
    in_force += [CLEAN_ENV, OWN_USER, WALL_CLOCK, OUTPUT_CAP]
    missing.append(SECCOMP)
    return Isolation(
        "bubblewrap",
        tuple(in_force),
        tuple(missing),
        sandbox_uid() if root else None,
        where,
        block_userns=root and blocked,
        cpu_hard_per_call=per_call,
    )


def _process(limits: Limits, root: bool, own_user: bool) -> Isolation:
    """Plain processes; run by root, as a user of their own where ``own_user`` (else as root,
    which ``choose`` allows only for "unsafe-process")."""
    in_force = [RLIMITS, HARD_RLIMITS]  # the anchor drops every capability, even as root
    missing = [NETWORK, PID_NAMESPACE, READ_ONLY, NO_HOST_FILES, PRIVATE_SCRATCH, KERNEL_CLEANUP, NO_USERNS]
    per_call, where = _cpu_and_memory(limits, root, in_force, missing)
    if where is None and not own_user:
        missing.append(SHARED_NPROC)
    in_force += [CLEAN_ENV, WALL_CLOCK, OUTPUT_CAP]
    if own_user:
        in_force.append(OWN_USER)
    else:
        missing.append(AS_ROOT if root else OWN_USER)
    missing.append(SECCOMP)
    return Isolation(
        "process",
        tuple(in_force),
        tuple(missing),
        sandbox_uid() if own_user else None,
        where,
        cpu_hard_per_call=per_call,
    )
