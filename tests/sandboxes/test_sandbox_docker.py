"""DockerSandbox: the container configuration and the no-engine error here; the session,
timeout and replay-fork logic against a stand-in engine that runs the container's command as
a local process and speaks Docker's attach protocol; the real engine where one runs."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import uuid

import pytest

from sandboxes import DockerSandbox, Limits, SandboxError
from sandboxes.docker_sandbox import connect, container_config
from sandboxes.limits import SESSION_CPU_SECONDS
from sandboxes.local_sandbox import WORKER_SOURCE


def test_container_config_carries_every_limit():
    limits = Limits(
        memory_bytes=1 << 30,
        max_processes=50,
        file_size_bytes=1 << 20,
        open_files=100,
        output_bytes=4096,
        scratch_bytes=8 << 20,
    )
    config = container_config(limits, "img:1", "python3", ("numpy",))
    command = config.pop("command")
    ulimits = {u["Name"]: (u["Soft"], u["Hard"]) for u in config.pop("ulimits")}
    environment = config.pop("environment")
    assert config == {
        "image": "img:1",
        "stdin_open": True,
        "tty": False,
        "detach": True,
        "init": True,
        "network_mode": "none",
        "read_only": True,
        "tmpfs": {"/scratch": "rw,size=8388608,mode=1777", "/tmp": "rw,size=8388608,mode=1777"},
        "mem_limit": 1 << 30,
        "memswap_limit": 1 << 30,
        "pids_limit": 50,
        "user": "65534:65534",
        "cap_drop": ["ALL"],
        "security_opt": ["no-new-privileges"],
        "working_dir": "/scratch",
        "labels": {"agentenv.sandbox": "1"},
    }
    assert ulimits == {"nofile": (100, 100), "fsize": (1 << 20, 1 << 20), "core": (0, 0)}
    assert environment["HOME"] == environment["TMPDIR"] == "/scratch"
    assert command[:4] == ["python3", "-I", "-B", "-c"] and command[4] == WORKER_SOURCE
    assert command[5] == "stdio"
    assert json.loads(command[6]) == {
        "limits": {
            "memory": 1 << 30,
            "processes": 50,
            "open_files": 100,
            "file_size": 1 << 20,
            "cpu_ceiling": SESSION_CPU_SECONDS,  # a hard limit: the code can lift a call's CPU limit only to it
        },
        "output_bytes": 4096,
        "preimport": ["numpy"],
        "scratch": "/scratch",
    }


def test_without_an_engine_the_error_says_what_to_do(monkeypatch):
    monkeypatch.setenv("DOCKER_HOST", "unix:///nonexistent/docker.sock")
    with pytest.raises(SandboxError, match="needs a running Docker engine.*LocalSandbox"):
        DockerSandbox()
    with pytest.raises(SandboxError, match="needs a running Docker engine"):
        connect()


# --- a stand-in engine -----------------------------------------------------------------------


class _Container:
    """Runs the container's command as a local process; its stdout and stderr reach the
    attach socket in Docker's frames (8-byte header: stream, size)."""

    def __init__(self, config: dict) -> None:
        self.config, self.id = config, uuid.uuid4().hex
        self.attrs = {"State": {"OOMKilled": False}}
        self.ours, self.theirs = socket.socketpair()
        self.scratch = tempfile.mkdtemp(prefix="fake-container-")
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        command = list(self.config["command"])
        settings = json.loads(command[-1])
        settings["scratch"] = self.scratch  # no /scratch tmpfs here
        command[0], command[-1] = sys.executable, json.dumps(settings)
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**self.config["environment"], "HOME": self.scratch, "TMPDIR": self.scratch},
            cwd=self.scratch,
            start_new_session=True,
        )
        for stream, pipe in ((1, self.process.stdout), (2, self.process.stderr)):
            threading.Thread(target=self._frames, args=(stream, pipe), daemon=True).start()
        threading.Thread(target=self._stdin, daemon=True).start()

    def _frames(self, stream: int, pipe) -> None:
        try:
            while chunk := pipe.read1(65536):
                self.ours.sendall(struct.pack(">BxxxL", stream, len(chunk)) + chunk)
            if stream == 1:  # the process ended: so does the attach stream
                self.process.wait()
                self.ours.shutdown(socket.SHUT_WR)
        except (OSError, ValueError):  # removed meanwhile
            pass

    def _stdin(self) -> None:
        try:
            while data := self.ours.recv(65536):
                self.process.stdin.write(data)
                self.process.stdin.flush()
        except (OSError, ValueError):
            pass

    def wait(self, timeout: float) -> dict:
        code = self.process.wait(timeout)
        return {"StatusCode": 128 - code if code < 0 else code}  # as docker's init reports

    def reload(self) -> None:
        pass

    def remove(self, force: bool) -> None:
        assert force
        if self.process is not None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        self.ours.close()
        shutil.rmtree(self.scratch, ignore_errors=True)
        _Engine.removed.append(self.id)


class _Engine:
    removed: list[str] = []

    def __init__(self) -> None:
        self.created: list[_Container] = []
        self.containers, self.api = self, self

    def create(self, **config) -> _Container:
        self.created.append(_Container(config))
        return self.created[-1]

    def attach_socket(self, container_id: str, params: dict) -> socket.socket:
        assert params == {"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
        return next(c for c in self.created if c.id == container_id).theirs


@pytest.fixture
def engine():
    return _Engine()


def test_session_state_output_and_errors(engine):
    with DockerSandbox(client=engine, preimport=()) as box:
        assert box.run("x = 2\nprint('hi')").stdout == "hi\n"
        assert box.run("x * 21").value == "42"
        r = box.run("1/0")
        assert r.error_type == "ZeroDivisionError" and r.error.endswith("division by zero\n")
    assert engine.created[0].id in _Engine.removed  # close() removes the container


def test_timeout_restarts_the_container_and_reports_lost_state(engine):
    with DockerSandbox(client=engine, preimport=()) as box:
        box.run("x = 1")
        r = box.run("while True:\n    pass", timeout=1)
        assert (r.timed_out, r.killed_by) == (True, "timeout")
        after = box.run("'x' in globals()")
        assert (after.value, after.state_lost) == ("False", True)
        assert len(engine.created) == 2 and engine.created[0].id in _Engine.removed


def test_exit_and_signal_are_read_from_the_container_status(engine):
    with DockerSandbox(client=engine, preimport=()) as box:
        assert box.run("import os\nos._exit(4)").notes == (
            "the Python process exited with status 4; the Python session was lost",
        )
        r = box.run("import os, signal\nos.kill(os.getpid(), signal.SIGSEGV)")
        assert r.killed_by == "signal" and "SIGSEGV" in r.render()


def test_fork_replays_the_session_into_a_new_container(engine):
    with DockerSandbox(client=engine, preimport=()) as box:
        box.run("import random\nrandom.seed(3)\nxs = [random.random() for _ in range(3)]")
        box.run("xs.append(len(xs))")
        with box.fork() as child:
            assert len(engine.created) == 2
            assert child.run("xs").value == box.run("xs").value
            child.run("xs.append('child')")
            assert box.run("xs[-1]").value == "3"
            assert child.run("xs[-1]").value == "'child'"


def test_fork_after_a_kill_starts_fresh_and_says_so(engine):
    with DockerSandbox(client=engine, preimport=()) as box:
        box.run("x = 1")
        box.run("while True:\n    pass", timeout=1)
        with box.fork() as child:
            r = child.run("'x' in globals()")
            assert (r.value, r.state_lost) == ("False", True)


def test_output_cap_and_bad_arguments(engine):
    with DockerSandbox(Limits(output_bytes=100), client=engine, preimport=()) as box:
        r = box.run("print('y' * 1000)")
        assert (len(r.stdout), r.truncated) == (100, True)
        with pytest.raises(ValueError, match="timeout"):
            box.run("1", timeout=-1)
    with pytest.raises(ValueError, match="image"):
        DockerSandbox(image="", client=engine)
    with pytest.raises(SandboxError, match="closed"):
        box.run("1")


async def test_arun_uses_the_same_session(engine):
    with DockerSandbox(client=engine, preimport=()) as box:
        await box.arun("y = 5")
        assert (await box.arun("y + 1")).value == "6"


# --- the real engine -------------------------------------------------------------------------


def _engine_or_skip():
    try:
        client = connect()
        client.images.get("python:3.11-slim")
    except Exception as exc:
        pytest.skip(f"no Docker engine with python:3.11-slim here ({type(exc).__name__})")
    return client


def test_real_engine_session_isolation_and_fork():
    client = _engine_or_skip()
    with DockerSandbox(client=client, preimport=()) as box:
        box.run("v = [1]")
        assert box.run("v").value == "[1]"
        assert box.run("import socket\nsocket.create_connection(('1.1.1.1', 53), 2)").error
        assert box.run("open('/etc/evil', 'w')").error_type in ("OSError", "PermissionError")
        with box.fork() as child:
            child.run("v.append(2)")
            assert (box.run("v").value, child.run("v").value) == ("[1]", "[1, 2]")
        r = box.run("while True:\n    pass", timeout=2)
        assert r.killed_by == "timeout" and box.run("1").state_lost
