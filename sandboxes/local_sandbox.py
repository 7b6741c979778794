"""LocalSandbox: a persistent Python session in a bubblewrap container, forked by ``os.fork``.

A *family* is one container (see ``_worker`` for the processes inside): a sandbox and all the
forks made from it share it, each with its own interpreter process and channel. The family
ends when its last sandbox closes; its anchor then exits, and being PID 1 of the sandbox's
PID namespace, takes every remaining process with it. If this process dies instead, the
anchor sees the control channel close and does the same.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import math
import os
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import warnings
import weakref
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sandboxes import _worker, cgroup
from sandboxes._driver import Operation, Wait, adrive, drive
from sandboxes.base import Sandbox, SandboxError
from sandboxes.isolation import SAFE_ENVIRONMENT, SCRATCH, Isolation, bubblewrap_argv, choose
from sandboxes.limits import CPU_MARGIN_SECONDS, Limits
from sandboxes.result import KilledBy, Result, killed_by_exit_code, killed_result, result_from_reply

DEFAULT_PREIMPORT = ("math", "fractions", "itertools", "collections", "numpy", "sympy")
STARTUP_SECONDS = 120.0  # a cold container imports numpy and sympy from disk first
CONTROL_SECONDS = 10.0  # the anchor never runs user code; it answers within milliseconds
WORKER_SOURCE = Path(_worker.__file__).read_text()


class _Expired(Exception):
    """A deadline passed."""


class _ProtocolError(Exception):
    """A packet that is not our protocol, from the process ``args[0]``."""


class _Died(Exception):
    """The anchor reports that the interpreter exited with code ``args[0]`` (None: never ran)."""


class _FamilyDied(Exception):
    """The container is gone."""


class _PeerClosed(Exception):
    """Nobody holds the other end of a channel any more."""


class _Channel:
    """Our end of a SOCK_SEQPACKET socket; the kernel stamps each packet with its sender."""

    def __init__(self, sock: socket.socket, max_message_bytes: int) -> None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        sock.setblocking(False)
        self.sock, self.max_message_bytes = sock, max_message_bytes
        self._partial: dict[int | None, list[bytes]] = {}

    def close(self) -> None:
        self.sock.close()

    def send(self, message: dict, fds: Iterable[int] = (), deadline: float | None = None) -> Operation[None]:
        rights = (
            [(socket.SOL_SOCKET, socket.SCM_RIGHTS, b"".join(fd.to_bytes(4, sys.byteorder, signed=True) for fd in fds))]
            if fds
            else []
        )
        for i, packet in enumerate(_worker.packets(message)):
            while True:
                try:
                    self.sock.sendmsg([packet], rights if i == 0 else [])
                    break
                except BlockingIOError:
                    if not (yield Wait(self.sock.fileno(), True, deadline)):
                        raise _Expired from None
                except OSError as exc:  # the other end is gone
                    raise _PeerClosed(str(exc)) from None

    def receive(self, deadline: float | None) -> Operation[tuple[int | None, dict] | None]:
        """The next whole message and its sender's pid; None at end of file."""
        while True:
            try:
                data, pid, _fds = _worker.recv_packet(self.sock)
            except BlockingIOError:
                if not (yield Wait(self.sock.fileno(), False, deadline)):
                    raise _Expired from None
                continue
            except OSError:
                return None
            if not data:
                return None
            chunks = self._partial.setdefault(pid, [])
            chunks.append(data[1:])
            if sum(map(len, chunks)) > self.max_message_bytes:
                del self._partial[pid]
                raise _ProtocolError(pid)
            if data[:1] == _worker.END:
                del self._partial[pid]
                try:
                    return pid, _worker.decode(b"".join(chunks))
                except ValueError:
                    raise _ProtocolError(pid) from None


@dataclasses.dataclass(frozen=True)
class _Spec:
    """Everything needed to start a family, so a broken one can be replaced."""

    isolation: Isolation
    bwrap: str | None
    python: str
    limits: Limits
    preimport: tuple[str, ...]


class _Family:
    """One container: an anchor process and the interpreters of a sandbox and its forks."""

    def __init__(self, spec: _Spec) -> None:
        self.spec, self.refs, self.dead = spec, 0, False
        self.anchor_pid: int | None = None
        self.scratch_dir: str | None = None
        self.cgroup: cgroup.Cgroup | None = None
        self._sids = itertools.count()
        self._lock = threading.Lock()
        passed: list[int] = []  # descriptors for the anchor, closed here once it has them
        if spec.isolation.cgroup is not None:
            try:
                self.cgroup = cgroup.create(spec.limits, spec.isolation.cgroup)
                passed += self.cgroup.procs_fds()
            except OSError as exc:
                self._remove_cgroup()
                raise SandboxError(
                    f"could not make the sandbox's cgroup under {spec.isolation.cgroup.memory}: {exc}"
                ) from exc
        host_end, anchor_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        config: dict[str, Any] = {
            "control_fd": anchor_end.fileno(),
            "cgroup_fds": list(passed),
            "uid": None,
            "preimport": list(spec.preimport),
            "limits": spec.limits.rlimits(),
            "output_bytes": spec.limits.output_bytes,
        }
        options: dict = {}
        if spec.isolation.mode == "bubblewrap":
            assert spec.bwrap is not None  # choose() returns the bwrap path with this mode
            argv = bubblewrap_argv(spec.bwrap, spec.python, spec.limits)
            config.update(pid1=True, scratch=SCRATCH, uid=spec.isolation.run_as_uid)
            if spec.isolation.block_userns:
                proc_fd = os.open("/proc", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                passed.append(proc_fd)
                config.update(block_userns=True, proc_fd=proc_fd)
        else:
            self.scratch_dir = tempfile.mkdtemp(prefix="sandbox-")
            uid = spec.isolation.run_as_uid
            if uid is not None:
                os.chown(self.scratch_dir, uid, uid)
                options = {"user": uid, "group": uid, "extra_groups": []}
            argv = [spec.python]
            config.update(pid1=False, scratch=self.scratch_dir)
            options.update(
                cwd=self.scratch_dir, env={**SAFE_ENVIRONMENT, "HOME": self.scratch_dir, "TMPDIR": self.scratch_dir}
            )
        argv += ["-I", "-B", "-c", WORKER_SOURCE, "anchor", json.dumps(config)]
        try:
            self.process = subprocess.Popen(
                argv,
                pass_fds=[anchor_end.fileno(), *passed],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                start_new_session=True,
                **options,
            )
        except OSError as exc:
            host_end.close()
            self._remove_scratch()
            self._remove_cgroup()
            raise SandboxError(f"could not start the sandbox with {argv[0]!r}: {exc}") from exc
        finally:
            anchor_end.close()
            for fd in passed:
                os.close(fd)
        self.control = _Channel(host_end, 1 << 20)

    def new_sid(self) -> str:
        return f"s{next(self._sids)}"

    def acquire(self) -> None:
        with self._lock:
            self.refs += 1

    def release(self) -> None:
        with self._lock:
            self.refs -= 1
            last = self.refs == 0
        if last:
            self.shutdown()

    def anchor(self) -> int | None:
        """The anchor's pid as this process sees it, from its first packet ("ready"), which it
        sends before it handles any request; None while it has not arrived."""
        if self.anchor_pid is None and not self.dead:
            try:
                data, pid, _fds = _worker.recv_packet(self.control.sock)
            except BlockingIOError:
                return None
            except OSError:
                data, pid = b"", None
            if not data:
                self.dead = True
                return None
            self.anchor_pid = pid
            failed = _worker.decode(data[1:]).get("failed_imports") or {}
            if failed:
                warnings.warn(
                    "sandbox pre-imports failed (the modules stay unavailable inside): "
                    + "; ".join(f"{k}: {v}" for k, v in failed.items()),
                    RuntimeWarning,
                    stacklevel=2,
                )
        return self.anchor_pid

    def command(self, message: dict, fds: Iterable[int] = ()) -> Operation[None]:
        """Send the anchor a one-way command."""
        try:
            yield from self.control.send(message, fds, time.monotonic() + CONTROL_SECONDS)
        except (_Expired, _PeerClosed):
            self.dead = True
            raise _FamilyDied("the sandbox's anchor stopped answering") from None

    def startup_error(self) -> str:
        """What the container printed before it died, for error messages."""
        try:
            self.process.wait(timeout=CONTROL_SECONDS)
        except subprocess.TimeoutExpired:
            return "the sandbox process is still running"
        stderr = self.process.stderr
        assert stderr is not None  # started with stderr=PIPE
        os.set_blocking(stderr.fileno(), False)
        try:
            text = (stderr.read() or b"").decode("utf-8", "replace").strip()
        except OSError:
            text = ""
        return f"exit status {self.process.returncode}" + (f": {text[-2000:]}" if text else "")

    def shutdown(self) -> None:
        """End the container: closing the control channel makes the anchor exit, and with it
        (as PID 1 of the namespace, or as the subreaper that kills its subtree) everything."""
        self.dead = True
        self.control.close()
        try:
            self.process.wait(timeout=CONTROL_SECONDS)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        assert self.process.stderr is not None  # started with stderr=PIPE
        self.process.stderr.close()
        uid = self.spec.isolation.run_as_uid
        if self.spec.isolation.mode == "process" and uid is not None:
            _kill_user(uid)  # in case the code killed its anchor before we got here
        self._remove_scratch()
        self._remove_cgroup()

    def oom_kills(self) -> int:
        """Processes of this family the kernel has killed for its total memory limit so far."""
        return self.cgroup.oom_kills() if self.cgroup is not None else 0

    def _remove_scratch(self) -> None:
        if self.scratch_dir is not None:
            shutil.rmtree(self.scratch_dir, ignore_errors=True)

    def _remove_cgroup(self) -> None:
        if self.cgroup is not None:
            self.cgroup.remove()
            self.cgroup = None


def _kill_user(uid: int) -> None:
    """SIGKILL every process of ``uid`` (a user id that only one family ever used)."""
    for _round in range(100):
        alive = []
        for name in os.listdir("/proc"):
            with contextlib.suppress(OSError):
                if name.isdigit() and os.stat(f"/proc/{name}").st_uid == uid:
                    alive.append(int(name))
        if not alive:
            return
        for pid in alive:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.001)


def namespace_pid(pid: int) -> int:
    """The pid that process ``pid`` has inside its own (innermost) PID namespace."""
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("NSpid:"):
                return int(line.split()[-1])
    return pid


@dataclasses.dataclass(eq=False)
class _Session:
    """Our side of one sandbox's interpreter; kept apart from the sandbox object so that the
    garbage-collection finalizer can close it."""

    family: _Family
    sid: str
    channel: _Channel | None = None
    pid: int | None = None  # the interpreter's pid as we see it, from its hello
    pid_start: int | None = None  # its start time (clock ticks since boot), which tells it from a reused pid
    cells: int = 0  # calls the current interpreter received
    lost: bool = False  # an interpreter with state died; the next call says so

    def reset(self) -> None:
        """Forget the interpreter (it died or was killed)."""
        if self.channel is not None:
            self.channel.close()
        self.lost = self.lost or self.cells > 0
        self.channel, self.pid, self.pid_start, self.cells = None, None, None, 0

    def next(self, deadline: float | None, accept: set[tuple[str, str]]) -> Operation[dict]:
        """The next message from ``("anchor" | "interpreter", op)`` in ``accept``; other messages
        are dropped. Raises _Died when the anchor reports the interpreter's death."""
        while True:
            assert self.channel is not None, "only a spawned session (see spawn) receives"
            try:
                received = yield from self.channel.receive(deadline)
            except _ProtocolError as bad:  # an oversized message: fatal only from our interpreter
                if bad.args[0] == self.pid and any(src == "interpreter" for src, _ in accept):
                    raise
                continue
            if received is None:
                self.family.dead = True
                raise _FamilyDied("the sandbox container stopped")
            sender, message = received
            op = message["op"]
            if sender is not None and sender == self.family.anchor():
                if op == "exit":
                    code = message.get("code")
                    self.reset()
                    raise _Died(code if isinstance(code, int) else None, str(message.get("error") or ""))
                if ("anchor", op) in accept:
                    return message
            elif self.pid is None and op == "hello":
                self.pid = sender
                self.pid_start = _start_time(sender) if sender is not None else None
                if ("interpreter", "hello") in accept:
                    return message
            elif sender == self.pid and ("interpreter", op) in accept:
                return message

    def send(self, message: dict, fds: Iterable[int] = (), deadline: float | None = None) -> Operation[None]:
        """Send the interpreter a request; if it is gone, raise what the anchor says (_Died)."""
        assert self.channel is not None, "only a spawned session (see spawn) is sent requests"
        try:
            yield from self.channel.send(message, fds, deadline)
        except _PeerClosed:
            yield from self.next(time.monotonic() + CONTROL_SECONDS, set())
            raise _FamilyDied("the interpreter's channel closed without a notice") from None

    def died_while_idle(self) -> Operation[bool]:
        """Whether the anchor reported the interpreter's death since its last call (a
        sibling's kill(-1), a thread's os._exit); the session is then reset."""
        if self.channel is None or self.pid is None:
            return False
        # A death can precede its notice: a sibling's kill(-1) returns before the anchor has reaped
        # us and said so. A process already dying is waited for, so the call runs on a fresh one.
        dying = _dying(self.pid) or (self.family.anchor_pid is not None and _dying(self.family.anchor_pid))
        try:
            # accepts nothing: only a death ends it
            yield from self.next(time.monotonic() + (CONTROL_SECONDS if dying else 0.0), set())
        except _Expired:
            return False
        except (_Died, _FamilyDied):
            self.reset()
            return True
        return False

    def spawn(self) -> Operation[None]:
        """Ask the anchor for a fresh interpreter (its hello is awaited by ``ready``)."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.channel = _Channel(ours, _max_message_bytes(self.family.spec.limits))
        self.pid, self.pid_start, self.cells = None, None, 0
        try:
            yield from self.family.command({"op": "spawn", "sid": self.sid}, [theirs.fileno()])
        finally:
            theirs.close()

    def ready(self) -> Operation[None]:
        """Make sure a live interpreter with a known pid serves this session."""
        if self.family.dead:
            self._replace_family()
        if self.pid is None:
            try:
                if self.channel is None:
                    yield from self.spawn()
                yield from self.next(time.monotonic() + STARTUP_SECONDS, {("interpreter", "hello")})
            except _Died as died:
                raise SandboxError(f"the sandbox could not start an interpreter: {died.args[1]}") from None
            except _FamilyDied:
                raise SandboxError(
                    "the sandbox container stopped while starting: " + self.family.startup_error()
                ) from None
            except _Expired:
                raise SandboxError(f"the sandbox did not start within {STARTUP_SECONDS:g} s") from None

    def _replace_family(self) -> None:
        old = self.family
        self.reset()
        self.family = _Family(old.spec)
        self.family.acquire()
        self.sid = self.family.new_sid()
        old.release()

    def kill(self) -> Operation[None]:
        """Stop the interpreter and wait until the anchor has reaped it."""
        try:
            yield from self.family.command({"op": "kill", "sid": self.sid})
            yield from self.next(time.monotonic() + CONTROL_SECONDS, set())
        except _Died:
            return
        except (_Expired, _FamilyDied):
            self.family.dead = True
        self.reset()

    def kill_now(self) -> None:
        """``kill`` for a caller that cannot wait (a cancelled operation)."""
        with contextlib.suppress(Exception):
            drive(self.family.command({"op": "kill", "sid": self.sid}))
        self.reset()


def _dying(pid: int) -> bool:
    """Whether process ``pid`` (a host pid) is gone, a zombie, exiting or has a SIGKILL pending."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open(f"/proc/{pid}/status", "rb") as f:
            status = dict(line.split(b":", 1) for line in f if b":" in line)
    except OSError:
        return True
    fields = stat[stat.rindex(b")") + 2 :].split()  # after "pid (comm) ": state is field 3, flags field 9
    exiting = int(fields[6]) & 0x4  # PF_EXITING
    kill_bit = 1 << (signal.SIGKILL - 1)
    pending = int(status.get(b"SigPnd", b"0").strip(), 16) | int(status.get(b"ShdPnd", b"0").strip(), 16)
    return fields[0] in (b"Z", b"X") or bool(exiting) or bool(pending & kill_bit)


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after "pid (comm)": [0] is the state (field 3)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2 :].split()


def _start_time(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[19]) if fields is not None else None


def _limit_cpu(pid: int, start: int | None, cpu: float) -> None:
    """Give interpreter ``pid`` a hard CPU limit for the next call, at most ``CPU_MARGIN_SECONDS``
    + 1 s above a soft one ``cpu`` seconds beyond what it has used. Raising a hard limit needs
    CAP_SYS_RESOURCE, so only a host that has it calls this (``Isolation.cpu_hard_per_call``);
    the interpreter moves only the soft limit, and nothing inside can raise the hard one."""
    fields = _stat_fields(pid)
    if fields is None or (start is not None and int(fields[19]) != start):
        return  # gone, or its pid now belongs to another process: the call finds out
    used = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime
    soft = math.ceil(used + cpu)
    # +1: the interpreter rounds its exact CPU time up, ours is in clock ticks; its soft limit
    # may be one second above ours and must stay below the hard one, or SIGKILL comes first.
    with contextlib.suppress(OSError):
        resource.prlimit(pid, resource.RLIMIT_CPU, (soft, soft + 1 + CPU_MARGIN_SECONDS))


def _max_message_bytes(limits: Limits) -> int:
    return 6 * 4 * limits.output_bytes + (1 << 20)  # four capped texts, JSON-escaped, plus slack


def _close_session(session: _Session) -> None:
    """Finalizer of a LocalSandbox: stop its interpreter and drop its share of the family."""
    family = session.family
    try:
        if family.refs > 1 and session.channel is not None and not family.dead:
            drive(session.kill())
        elif session.channel is not None:
            session.channel.close()
    finally:
        family.release()


class LocalSandbox(Sandbox):
    """A persistent, isolated Python session in a local worker process.

    >>> with LocalSandbox() as box:
    ...     box.run("x = 6 * 7").ok, box.run("x").value
    (True, '42')

    ``isolation``: "auto" (bubblewrap where it works, else plain processes with a warning that
    names what remains), "bubblewrap" (required), "process", or "unsafe-process". Plain processes
    started by root run as a user of their own, which needs a Python installation readable by
    others; where there is none, "auto" and "process" refuse (SandboxError) rather than run model
    code as root, which only "unsafe-process" does. ``python``: the interpreter to run inside
    (default: this one, so the project's packages are importable). ``preimport``: modules the
    container imports once, so that every interpreter has them loaded.
    """

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        isolation: str = "auto",
        python: str | None = None,
        preimport: Iterable[str] = DEFAULT_PREIMPORT,
    ) -> None:
        limits = Limits() if limits is None else limits
        if not isinstance(limits, Limits):
            raise TypeError(f"limits must be a sandboxes.Limits, got {type(limits).__name__}")
        preimport = tuple(preimport)
        if not all(isinstance(name, str) and name for name in preimport):
            raise TypeError(f"preimport must be module names, got {preimport!r}")
        python = python or sys.executable
        chosen, bwrap = self._choose(isolation, python, limits)
        self._attach(_Family(_Spec(chosen, bwrap, python, limits, preimport)))
        with contextlib.suppress(_FamilyDied):  # a failed start is reported by the first call
            drive(self._session.spawn())  # eager: the container warms up while the caller works

    @staticmethod
    def isolation_for(isolation: str = "auto", python: str | None = None, limits: Limits | None = None) -> Isolation:
        """The isolation a ``LocalSandbox(limits, isolation=isolation, python=python)`` would get
        here, without starting one; raises SandboxError where it would (e.g. root without
        bubblewrap), ValueError for an unknown ``isolation``."""
        return LocalSandbox._choose(isolation, python or sys.executable, limits or Limits())[0]

    @staticmethod
    def _choose(isolation: str, python: str, limits: Limits) -> tuple[Isolation, str | None]:
        try:
            return choose(isolation, python, limits)
        except RuntimeError as exc:
            raise SandboxError(str(exc)) from None

    def _attach(self, family: _Family) -> None:
        family.acquire()
        self._session = _Session(family, family.new_sid())
        self._finalizer = weakref.finalize(self, _close_session, self._session)
        self._busy = False

    @property
    def limits(self) -> Limits:
        return self._session.family.spec.limits

    @property
    def isolation(self) -> Isolation:
        """The protections in force for this sandbox."""
        return self._session.family.spec.isolation

    @property
    def pid(self) -> int | None:
        """The process id of the current interpreter (as this process sees it), once known."""
        return self._session.pid

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        self._finalizer()

    def run(self, code: str, timeout: float = 10.0) -> Result:
        self._check_call(code, timeout)
        with self._one_call():
            return drive(self._run(code, float(timeout)))

    async def arun(self, code: str, timeout: float = 10.0) -> Result:
        self._check_call(code, timeout)
        with self._one_call():
            return await adrive(self._run(code, float(timeout)))

    def _run(self, code: str, timeout: float) -> Operation[Result]:
        session, limits = self._session, self.limits
        yield from session.ready()
        if (yield from session.died_while_idle()):
            yield from session.ready()
        state_lost, session.lost = session.lost, False
        cpu = limits.cpu_for(timeout)
        if self.isolation.cpu_hard_per_call and session.pid is not None:
            _limit_cpu(session.pid, session.pid_start, cpu)
        family = session.family
        oom_before = family.oom_kills()
        start = time.monotonic()
        session.cells += 1
        reply: dict | None = None
        killed_by: KilledBy | None = None
        exit_code: int | None = None
        try:
            yield from session.send({"op": "run", "code": code, "cpu": cpu}, deadline=start + timeout)
            reply = yield from session.next(start + timeout, {("interpreter", "result"), ("interpreter", "error")})
            if reply["op"] == "error":  # only code that tampered with the worker gets here
                raise _ProtocolError(session.pid)
        except _Expired:
            killed_by = "timeout"
        except _ProtocolError:
            killed_by = "protocol"
        except _Died as died:
            exit_code = died.args[0]
            killed_by = killed_by_exit_code(exit_code)
            if exit_code == -signal.SIGKILL and family.oom_kills() > oom_before:
                killed_by = "memory"  # the kernel killed it for the family's total memory limit
        except _FamilyDied:
            session.reset()
            killed_by = "memory" if family.oom_kills() > oom_before else "sandbox"
        except GeneratorExit:  # the caller was cancelled mid-call: the session cannot continue
            session.kill_now()
            raise
        wall_time = time.monotonic() - start
        if killed_by in ("timeout", "protocol"):
            yield from session.kill()
        if killed_by is not None:
            session.lost = True
            return killed_result(
                killed_by,
                limits=limits,
                timeout=timeout,
                wall_time=wall_time,
                state_lost=state_lost,
                exit_code=exit_code,
                total_memory=True,
            )
        oom_kills = family.oom_kills() - oom_before
        yield from self._cleanup()
        assert reply is not None  # every path that leaves it unset sets killed_by
        return result_from_reply(reply, limits=limits, wall_time=wall_time, state_lost=state_lost, oom_kills=oom_kills)

    def _cleanup(self) -> Operation[None]:
        """Have the anchor kill what the call left running (processes never outlive a call)."""
        session = self._session
        try:
            yield from session.family.command({"op": "cleanup", "sid": session.sid})
            yield from session.next(time.monotonic() + CONTROL_SECONDS, {("anchor", "cleaned")})
        except _Died:
            pass  # it exited right after answering; the next call reports the lost state
        except (_Expired, _FamilyDied):
            session.family.dead = True
            session.reset()

    def fork(self) -> LocalSandbox:
        """An independent sandbox whose interpreter is an ``os.fork`` of this one (copy-on-write:
        fast whatever the session holds). Its scratch folder is a copy of this one's."""
        if self.closed:
            raise SandboxError("LocalSandbox is closed; fork() an open sandbox")
        with self._one_call():
            parent = self._session
            child = object.__new__(LocalSandbox)
            child._attach(parent.family)
            if parent.family.dead or parent.channel is None or parent.cells == 0:
                # Nothing to copy: a fresh interpreter is the same state, unless the parent's died with the family.
                child._session.lost = parent.lost or parent.cells > 0
                if not parent.family.dead:
                    with contextlib.suppress(_FamilyDied):
                        drive(child._session.spawn())
                return child
            try:
                drive(self._fork_into(child._session))
            except BaseException:
                child.close()
                raise
            return child

    def _fork_into(self, child: _Session) -> Operation[None]:
        parent, family = self._session, self._session.family
        deadline = time.monotonic() + CONTROL_SECONDS
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        child.channel = _Channel(ours, _max_message_bytes(self.limits))
        adopted = False
        try:
            # Until the anchor counts this fork it kills every process it does not know (what finished calls
            # left behind) whenever a sibling's call ends: the child must not exist before it is counted.
            yield from family.command({"op": "fork_begin", "sid": parent.sid})
            yield from parent.next(deadline, {("anchor", "fork_ready")})
            yield from parent.send({"op": "fork", "sid": child.sid}, [theirs.fileno()], deadline)
            reply = yield from parent.next(deadline, {("interpreter", "forked"), ("interpreter", "error")})
            if reply["op"] == "error":
                raise SandboxError(f"fork() failed inside the sandbox: {reply.get('error')}")
            yield from child.next(deadline, {("interpreter", "hello")})
            assert child.pid is not None  # next() records the pid from the hello
            yield from family.command(
                {"op": "adopt", "sid": child.sid, "pid": namespace_pid(child.pid)}, [theirs.fileno()]
            )
            adopted = True
            child.cells = parent.cells
        except _Died:  # the parent's interpreter died: the child has nothing to copy either
            child.reset()
            child.lost = True
        except _Expired:
            raise SandboxError(f"fork() failed: the sandbox did not complete it within {CONTROL_SECONDS:g} s") from None
        except (_ProtocolError, _FamilyDied, OSError) as exc:
            raise SandboxError(f"fork() failed: {type(exc).__name__} {exc}") from None
        finally:
            theirs.close()
            if not adopted:
                # No interpreter of the anchor's serves the child: closing it must not wait for one to be killed.
                child.reset()
                with contextlib.suppress(_FamilyDied):
                    yield from family.command({"op": "fork_abort"})
