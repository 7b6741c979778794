"""DockerSandbox: the same persistent session in a Docker container, through the docker SDK.

One long-lived container per sandbox runs ``_worker`` in its ``stdio`` mode (one interpreter
that reads requests on stdin and answers on stdout) with no network, a read-only root, a
tmpfs scratch folder, a non-root user, no capabilities, and the memory, process and file limits
of ``Limits``.

``fork()`` **replays** the session's calls into a new container. Committing the container
(``docker commit``) is not an option: it saves the file system, not the interpreter's memory,
and our scratch is a tmpfs that a commit does not even include. Replay costs a container
start plus the time the calls took, and gives the same state only when the calls are
deterministic (seed your random generators); ``LocalSandbox`` forks with ``os.fork`` instead.
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import time
import weakref
from collections.abc import Iterable
from typing import Any

import docker
import docker.errors
from docker.types import Ulimit

from sandboxes import _worker
from sandboxes.base import Sandbox, SandboxError
from sandboxes.isolation import SAFE_ENVIRONMENT
from sandboxes.limits import Limits
from sandboxes.local_sandbox import DEFAULT_PREIMPORT, WORKER_SOURCE
from sandboxes.result import KilledBy, Result, killed_by_exit_code, killed_result, result_from_reply

DEFAULT_IMAGE = "python:3.11-slim"  # needs numpy/sympy installed to pre-import them
SCRATCH = "/scratch"
DOCKER_FRAME = struct.Struct(">BxxxL")  # the attach stream's header: stream id, payload size
STARTUP_SECONDS = 120.0


class _Expired(Exception):
    """A deadline passed."""


def connect() -> docker.DockerClient:
    """A client for the local Docker engine, or a SandboxError that says what to do."""
    try:
        client = docker.from_env()
        client.ping()
    except Exception as exc:  # docker raises several unrelated types for "no engine"
        raise SandboxError(
            f"DockerSandbox needs a running Docker engine, and none answered ({exc}). Start "
            "Docker (or set DOCKER_HOST), or use sandboxes.LocalSandbox"
        ) from None
    return client


def container_config(limits: Limits, image: str, python: str, preimport: Iterable[str]) -> dict[str, Any]:
    """Keyword arguments of ``client.containers.create`` for one sandbox container."""
    config = {
        "limits": limits.rlimits(),
        "output_bytes": limits.output_bytes,
        "preimport": list(preimport),
        "scratch": SCRATCH,
    }
    return {
        "image": image,
        "command": [python, "-I", "-B", "-c", WORKER_SOURCE, "stdio", json.dumps(config)],
        "stdin_open": True,
        "tty": False,
        "detach": True,
        "init": True,  # a real PID 1 reaps and forwards signals; the interpreter is not PID 1
        "network_mode": "none",
        "read_only": True,
        "tmpfs": {
            SCRATCH: f"rw,size={limits.scratch_bytes},mode=1777",
            "/tmp": f"rw,size={limits.scratch_bytes},mode=1777",
        },
        "mem_limit": limits.memory_bytes,
        "memswap_limit": limits.memory_bytes,  # no swap beyond the memory limit
        "pids_limit": limits.max_processes,
        "ulimits": [
            Ulimit(name="nofile", soft=limits.open_files, hard=limits.open_files),
            Ulimit(name="fsize", soft=limits.file_size_bytes, hard=limits.file_size_bytes),
            Ulimit(name="core", soft=0, hard=0),
        ],
        "user": "65534:65534",
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "environment": {**SAFE_ENVIRONMENT, "HOME": SCRATCH, "TMPDIR": SCRATCH},
        "working_dir": SCRATCH,
        "labels": {"agentenv.sandbox": "1"},
    }


class _AttachStream:
    """Our messages over a container's attach socket, whose output Docker splits into frames
    of stdout (our messages) and stderr (kept for error messages)."""

    def __init__(self, attached: Any, max_message_bytes: int) -> None:
        self.sock: socket.socket = getattr(attached, "_sock", attached)  # the raw socket
        self.attached = attached  # keeps the HTTP response (and so the socket) alive
        self.max_message_bytes = max_message_bytes
        self.stdout, self.stderr = b"", b""

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()

    def send(self, message: dict) -> None:
        data = _worker.encode(message)
        self.sock.settimeout(None)
        self.sock.sendall(_worker.FRAME.pack(len(data)) + data)

    def _read_exactly(self, n: int, deadline: float) -> bytes | None:
        data = b""
        while len(data) < n:
            self.sock.settimeout(max(0.001, deadline - time.monotonic()))
            try:
                chunk = self.sock.recv(n - len(data))
            except TimeoutError:
                raise _Expired from None
            if not chunk:
                return None
            data += chunk
        return data

    def receive(self, deadline: float) -> dict | None:
        """The next message; None when the container's output ended."""
        while True:
            if len(self.stdout) >= _worker.FRAME.size:
                size = _worker.FRAME.unpack(self.stdout[: _worker.FRAME.size])[0]
                if size > self.max_message_bytes:
                    raise ValueError("message too large")
                end = _worker.FRAME.size + size
                if len(self.stdout) >= end:
                    body, self.stdout = self.stdout[_worker.FRAME.size : end], self.stdout[end:]
                    return _worker.decode(body)
            header = self._read_exactly(DOCKER_FRAME.size, deadline)
            if header is None:
                return None
            stream, size = DOCKER_FRAME.unpack(header)
            payload = self._read_exactly(size, deadline) if size else b""
            if payload is None:
                return None
            if stream == 1:
                self.stdout += payload
            else:
                self.stderr = (self.stderr + payload)[-4096:]


class _Holder:
    """The current container of a DockerSandbox, for the garbage-collection finalizer."""

    container: Any = None
    stream: _AttachStream | None = None

    def remove(self) -> None:
        if self.stream is not None:
            self.stream.close()
        if self.container is not None:
            with contextlib.suppress(docker.errors.DockerException, OSError):
                self.container.remove(force=True)  # kills it; its tmpfs goes with it
        self.container, self.stream = None, None


class DockerSandbox(Sandbox):
    """A persistent, isolated Python session in a Docker container (same contract as
    ``LocalSandbox``). ``fork()`` replays this session's calls into a new container.

    ``image`` must provide ``python`` (and numpy/sympy to pre-import them); ``client`` is a
    ``docker.DockerClient`` (default: ``docker.from_env()``).
    """

    limits: Limits

    def __init__(
        self,
        limits: Limits | None = None,
        *,
        image: str = DEFAULT_IMAGE,
        python: str = "python3",
        preimport: Iterable[str] = DEFAULT_PREIMPORT,
        client: docker.DockerClient | None = None,
    ) -> None:
        limits = Limits() if limits is None else limits
        if not isinstance(limits, Limits):
            raise TypeError(f"limits must be a sandboxes.Limits, got {type(limits).__name__}")
        if not isinstance(image, str) or not image:
            raise ValueError(f"image must be a Docker image name, got {image!r}")
        self.limits, self._image, self._python = limits, image, python
        self._preimport = tuple(preimport)
        self._client = connect() if client is None else client
        self._config = container_config(limits, image, python, self._preimport)
        self._holder = _Holder()
        self._finalizer = weakref.finalize(self, _Holder.remove, self._holder)
        self._calls: list[tuple[str, float]] = []  # this session's calls, for fork()
        self._lost, self._busy = False, False
        self._start()

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def close(self) -> None:
        self._finalizer()

    def _start(self) -> None:
        try:
            container = self._client.containers.create(**self._config)
            attached = self._client.api.attach_socket(
                container.id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
            )
            container.start()
        except docker.errors.ImageNotFound:
            raise SandboxError(
                f"Docker image {self._image!r} is not available; `docker pull "
                f"{self._image}` or pass image=... with Python inside"
            ) from None
        except docker.errors.DockerException as exc:
            raise SandboxError(f"could not start the sandbox container: {exc}") from None
        self._holder.container = container
        self._holder.stream = _AttachStream(attached, 6 * 4 * self.limits.output_bytes + (1 << 20))

    def _exit_reason(self) -> tuple[KilledBy, int | None]:
        """Why the container's interpreter ended: (killed_by, exit code or -signal)."""
        container = self._holder.container
        try:
            status = container.wait(timeout=10)["StatusCode"]
            container.reload()
        except (docker.errors.DockerException, OSError, KeyError):
            return "sandbox", None
        if container.attrs.get("State", {}).get("OOMKilled"):
            return "memory", status
        code = -(status - 128) if status > 128 else status  # the init reports 128 + signal
        return killed_by_exit_code(code), code

    def run(self, code: str, timeout: float = 10.0) -> Result:
        self._check_call(code, timeout)
        with self._one_call():
            return self._run(code, float(timeout))

    def _run(self, code: str, timeout: float) -> Result:
        if self._holder.container is None:
            self._start()
        state_lost, self._lost = self._lost, False
        start = time.monotonic()
        killed_by: KilledBy | None = None
        exit_code: int | None = None
        reply: dict | None = None
        stream = self._holder.stream
        assert stream is not None  # _start() attaches it with the container; remove() drops both
        try:
            stream.send({"op": "run", "code": code, "cpu": self.limits.cpu_for(timeout)})
            reply = stream.receive(start + timeout)
            if reply is None:
                killed_by, exit_code = self._exit_reason()
            elif reply.get("op") != "result":
                killed_by = "protocol"
        except _Expired:
            killed_by = "timeout"
        except ValueError:
            killed_by = "protocol"
        except OSError:
            killed_by = "sandbox"
        wall_time = time.monotonic() - start
        if killed_by is not None:
            self._holder.remove()  # the next call starts a fresh container
            self._lost, self._calls = True, []
            return killed_result(
                killed_by,
                limits=self.limits,
                timeout=timeout,
                wall_time=wall_time,
                state_lost=state_lost,
                exit_code=exit_code,
            )
        self._calls.append((code, timeout))
        assert reply is not None  # a None reply sets killed_by
        return result_from_reply(reply, limits=self.limits, wall_time=wall_time, state_lost=state_lost)

    def fork(self) -> DockerSandbox:
        """A new container with this session's calls replayed into it (see the module doc)."""
        if self.closed:
            raise SandboxError("DockerSandbox is closed; fork() an open sandbox")
        with self._one_call():
            child = DockerSandbox(
                self.limits, image=self._image, python=self._python, preimport=self._preimport, client=self._client
            )
            try:
                for code, timeout in self._calls:
                    replayed = child.run(code, timeout)
                    if replayed.killed_by is not None:
                        raise SandboxError("fork() could not replay the session: " + replayed.notes[-1])
            except BaseException:
                child.close()
                raise
            child._lost = self._lost
            return child
