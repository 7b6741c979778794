"""Unit tests of the pieces both sides share: wire format, process tree, traceback trimming,
output capping, and the choice of isolation and its command line."""

from __future__ import annotations

import os
import socket
import sys
import threading
import warnings
from pathlib import Path

import pytest

from sandboxes import Limits, LocalSandbox, SandboxError, _worker, cgroup, isolation
from sandboxes.limits import SESSION_CPU_SECONDS


def test_messages_are_chunked_and_reassembled():
    big = {"op": "run", "code": "x = '" + "é" * 40000 + "'"}  # escaped: 6 bytes per é
    parts = _worker.packets(big)
    assert len(parts) == 8 and [p[:1] for p in parts] == [b"M"] * 7 + [b"E"]
    assert all(len(p) <= _worker.CHUNK_BYTES + 1 for p in parts)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sender = threading.Thread(target=_worker.send_message, args=(a, big))  # more than a buffer
    sender.start()
    assert _worker.recv_message(b) == (big, [])
    sender.join()
    a.close()
    assert _worker.recv_message(b) == (None, [])


def test_unrequested_descriptors_are_closed():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    r, w = os.pipe()
    _worker.send_message(a, {"op": "x"}, fds=[r])
    _data, _pid, fds = _worker.recv_packet(b)
    assert fds == [] and len(os.listdir("/proc/self/fd")) == len(set(os.listdir("/proc/self/fd")))
    _worker.send_message(a, {"op": "y"}, fds=[w])
    message, fds = _worker.recv_message(b, want_fds=True)
    assert message == {"op": "y"} and len(fds) == 1
    os.close(fds[0])


def test_decode_rejects_anything_but_an_object_with_an_op():
    for data in (b"[1]", b'{"x": 1}', b'{"op": 3}', b"\xff"):
        with pytest.raises(ValueError):
            _worker.decode(data)


def test_descendants_follow_the_parent_links():
    table = {1: (0, "S"), 2: (1, "S"), 3: (2, "R"), 4: (3, "Z"), 5: (1, "S"), 6: (5, "S")}
    assert sorted(_worker.descendants(2, table)) == [3, 4]
    assert sorted(_worker.descendants(1, table)) == [2, 3, 4, 5, 6]
    assert _worker.descendants(6, table) == []


def test_process_table_sees_this_process():
    table = _worker.process_table()
    assert table[os.getpid()][0] == os.getppid()


def test_trim_traceback_keeps_only_cells_in_chained_exceptions():
    namespace: dict = {}
    exec(
        compile(
            "def f():\n    try:\n        1/0\n    except Exception as e:\n        raise KeyError('k') from e\n",
            "<cell 1>",
            "exec",
        ),
        namespace,
    )
    try:
        namespace["f"]()
    except KeyError as exc:
        text = _worker.trim_traceback(exc)
    assert "test_sandbox_worker.py" not in text
    assert text.count('File "<cell 1>"') == 2
    assert "ZeroDivisionError: division by zero" in text and text.endswith("KeyError: 'k'\n")


def test_capped_writer_keeps_the_head_and_counts_the_rest():
    r, w = os.pipe()
    writer = _worker.CappedWriter(w, 10)
    assert writer.write("abcdefgh") == 8 and writer.write("ijklmn") == 6
    os.close(w)
    assert os.read(r, 100) == b"abcdefghij" and (writer.written, writer.dropped) == (10, 4)
    assert _worker.clip("ab\u00e9cd", 3) == ("ab", True)  # never half a character


def test_bubblewrap_command_line():
    argv = isolation.bubblewrap_argv("/usr/bin/bwrap", "/usr/bin/python3", Limits(scratch_bytes=1 << 20))
    joined = " ".join(argv)
    for flag in (
        "--unshare-pid",
        "--unshare-net",
        "--unshare-ipc",
        "--as-pid-1",
        "--clearenv",
        "--new-session",
        "--ro-bind /usr /usr",
        "--proc /proc",
        "--dev /dev",
        "--size 1048576 --perms 1777 --tmpfs /scratch",
        "--symlink /scratch /tmp",
        "--setenv HOME /scratch",
        "--setenv OPENBLAS_NUM_THREADS 1",
    ):
        assert flag in joined, flag
    assert argv[-2:] == ["--", "/usr/bin/python3"]
    assert ("--disable-userns" in argv) == (os.geteuid() != 0)
    assert "/home" not in joined and os.getcwd() not in joined.replace(".venv", "")


def test_process_mode_says_what_is_missing(monkeypatch):
    monkeypatch.setattr(isolation, "_warned", set())
    monkeypatch.setenv("PATH", "/nonexistent")  # no bwrap to be found
    with pytest.warns(RuntimeWarning, match="bubblewrap .* is not usable") as caught:
        chosen, bwrap = isolation.choose("auto", "/usr/bin/python3")
    assert bwrap is None and chosen.mode == "process"
    message = str(caught[0].message)
    assert "MISSING:  no network" in message and "in force: setrlimit limits" in message
    assert isolation.NETWORK in chosen.missing and isolation.RLIMITS in chosen.in_force
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once per process
        isolation.choose("auto", "/usr/bin/python3")


def test_required_bubblewrap_fails_clearly(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SandboxError, match="bwrap is not installed.*apt-get install bubblewrap"):
        LocalSandbox(isolation="bubblewrap")


@pytest.fixture
def no_bwrap(monkeypatch):
    """As if bubblewrap were not installed, with the warnings of plain processes not yet given."""
    monkeypatch.setattr(isolation.shutil, "which", lambda name, *args, **kwargs: None)
    monkeypatch.setattr(isolation, "_warned", set())


def _unreadable_installation(monkeypatch):
    """As if the Python installation were private to root (under /root, mode 0700)."""
    monkeypatch.setattr(isolation, "unreadable_path", lambda python: "/root/.pyenv")


def test_auto_as_root_without_bubblewrap_refuses_to_run_code_as_root(no_bwrap, monkeypatch):
    _unreadable_installation(monkeypatch)
    with pytest.raises(RuntimeError) as caught:
        isolation.choose("auto", sys.executable, euid=0)
    message = str(caught.value)
    for part in (
        "isolation='auto': bwrap is not installed",
        "'/root/.pyenv' is not readable by other users",
        "Model code must not run as root without isolation",
        "apt-get install bubblewrap",
        "sandbox='docker'",
        "chmod o+rX",
        "isolation='unsafe-process'",
    ):
        assert part in message, part
    monkeypatch.setattr(isolation.os, "geteuid", lambda: 0)  # LocalSandbox decides for us: root
    with pytest.raises(SandboxError, match="must not run as root without isolation"):
        LocalSandbox(isolation="auto")


def test_explicit_process_mode_as_root_needs_the_unsafe_name(no_bwrap, monkeypatch):
    _unreadable_installation(monkeypatch)
    with pytest.raises(RuntimeError, match="^isolation='process': the sandbox would be a plain process run by root"):
        isolation.choose("process", sys.executable, euid=0)


def test_root_with_a_readable_installation_runs_as_a_user_of_its_own(no_bwrap, monkeypatch):
    monkeypatch.setattr(isolation, "unreadable_path", lambda python: None)
    with pytest.warns(RuntimeWarning, match="bubblewrap .* is not usable"):
        chosen, bwrap = isolation.choose("auto", sys.executable, euid=0)
    assert (chosen.mode, bwrap) == ("process", None)
    assert chosen.run_as_uid is not None and chosen.run_as_uid >= 1_000_000_000
    assert isolation.OWN_USER in chosen.in_force and isolation.AS_ROOT not in chosen.missing


def test_non_root_auto_falls_back_to_plain_processes_with_a_warning(no_bwrap):
    with pytest.warns(RuntimeWarning, match="bubblewrap .* is not usable") as caught:
        chosen, bwrap = isolation.choose("auto", sys.executable, euid=1000)
    assert (chosen.mode, bwrap, chosen.run_as_uid) == ("process", None, None)
    assert "MISSING:  a user id of its own" in str(caught[0].message)
    assert not chosen.cpu_hard_per_call and isolation.CPU_CEILING in chosen.missing


@pytest.mark.skipif(os.geteuid() != 0, reason="runs code as root: only root can")
def test_unsafe_process_runs_as_root_without_capabilities(no_bwrap, monkeypatch):
    _unreadable_installation(monkeypatch)
    with pytest.warns(RuntimeWarning, match="AS ROOT"):
        box = LocalSandbox(isolation="unsafe-process", preimport=())
    try:
        assert (box.isolation.mode, box.isolation.run_as_uid) == ("process", None)
        assert isolation.AS_ROOT in box.isolation.missing
        r = box.run("import os\nos.geteuid(), open('/proc/self/status').read()")
        euid, status = eval(r.value)
        caps = dict(line.split(":", 1) for line in status.splitlines())
        assert euid == 0 and int(caps["CapEff"], 16) == 0 and int(caps["CapBnd"], 16) == 0
    finally:
        box.close()


def test_isolation_for_answers_without_starting_a_sandbox(no_bwrap):
    with pytest.raises(SandboxError, match="isolation='bubblewrap' but bwrap is not installed"):
        LocalSandbox.isolation_for("bubblewrap")
    with pytest.raises(ValueError, match="'auto', 'bubblewrap', 'process' or 'unsafe-process', got 'vm'"):
        LocalSandbox.isolation_for("vm")


def test_describe_says_whether_the_total_memory_is_capped(no_bwrap, monkeypatch):
    limits = Limits(memory_bytes=1 << 30, max_processes=16, total_memory_bytes=3 << 30)
    monkeypatch.setattr(isolation.cgroup, "parents", lambda: None)
    chosen, _ = isolation.choose("process", sys.executable, limits, euid=1000)
    assert chosen.cgroup is None
    assert "MISSING:  a cap on the memory of the sandbox and its forks together" in chosen.describe()
    assert "only 16 processes x 1 GiB of address space = 16 GiB" in chosen.describe()
    assert isolation.SHARED_NPROC in chosen.missing  # RLIMIT_NPROC counts all of our own user's processes
    where = isolation.cgroup.Parents(2, Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup"))
    monkeypatch.setattr(isolation.cgroup, "parents", lambda: where)
    chosen, _ = isolation.choose("process", sys.executable, limits, euid=1000)
    assert chosen.cgroup == where
    assert "in force: memory of the sandbox and its forks together capped at 3 GiB, at most 16 processes" in (
        chosen.describe()
    )


def test_cpu_hard_limit_per_call_needs_cap_sys_resource(no_bwrap, monkeypatch):
    monkeypatch.setattr(isolation, "unreadable_path", lambda python: None)
    for capable in (True, False):
        monkeypatch.setattr(isolation, "can_raise_hard_limits", lambda capable=capable: capable)
        chosen, _ = isolation.choose("process", sys.executable, euid=0)
        assert chosen.cpu_hard_per_call is capable
        assert (isolation.CPU_PER_CALL in chosen.in_force) is capable
        assert (isolation.CPU_CEILING in chosen.missing) is not capable


def test_disable_userns_only_where_bubblewrap_knows_it(monkeypatch):
    monkeypatch.setattr(isolation.os, "geteuid", lambda: 1000)
    assert "--disable-userns" in isolation.namespace_options("/usr/bin/bwrap") or not isolation.bwrap_has_option(
        "/usr/bin/bwrap", "--disable-userns"
    )
    monkeypatch.setattr(isolation, "bwrap_has_option", lambda bwrap, option: False)  # bubblewrap < 0.8
    options = isolation.namespace_options("/usr/bin/bwrap")
    assert "--unshare-user" in options and "--disable-userns" not in options
    monkeypatch.setattr(isolation.os, "geteuid", lambda: 0)  # as root: the anchor blocks them itself
    assert "--unshare-user" not in isolation.namespace_options("/usr/bin/bwrap")


def test_limits_of_the_worker_are_hard_limits():
    limits = Limits(cpu_seconds=2).rlimits()
    assert limits["cpu_ceiling"] == SESSION_CPU_SECONDS
    with pytest.raises(ValueError, match="total_memory_bytes=1048576 is too small"):
        Limits(total_memory_bytes=1 << 20)


def test_family_cgroup_files(tmp_path):
    v2 = cgroup.Parents(2, tmp_path, tmp_path)
    made = cgroup.create(Limits(max_processes=9, total_memory_bytes=1 << 30), v2)
    (folder,) = made.folders
    assert folder.parent == tmp_path and folder.name.startswith(f"{cgroup.PREFIX}{os.getpid()}-")
    assert [(folder / name).read_text() for name in ("memory.max", "memory.swap.max", "pids.max")] == [
        str(1 << 30),
        "0",
        "9",
    ]
    (folder / "memory.events").write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 2\n")
    assert made.oom_kills() == 2
    (tmp_path / "memory").mkdir()
    (tmp_path / "pids").mkdir()
    v1 = cgroup.Parents(1, tmp_path / "memory", tmp_path / "pids")
    made = cgroup.create(Limits(max_processes=9, total_memory_bytes=1 << 30), v1)
    memory, pids = made.folders
    assert (memory / "memory.limit_in_bytes").read_text() == str(1 << 30)
    assert (pids / "pids.max").read_text() == "9"
    (memory / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n")
    assert made.oom_kills() == 5


def test_a_python_that_does_not_run_is_rejected():
    with pytest.raises(ValueError, match="python='/bin/false' cannot be run"):
        LocalSandbox(python="/bin/false")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("mode", ["unsafe-process", "bubblewrap"])  # (the broken python is under a private /tmp)
def test_startup_failure_is_reported_with_what_the_sandbox_printed(mode, tmp_path):
    if mode == "bubblewrap" and not isolation.shutil.which("bwrap"):
        pytest.skip("bubblewrap is not installed (make installs it)")
    broken = tmp_path / "python"  # answers the prefix query, then fails to start the worker
    broken.write_text(
        f'#!/bin/sh\ncase "$*" in *"import sys; print"*) exec {sys.executable} '
        "\"$@\";; esac\necho 'broken interpreter' >&2\nexit 3\n"
    )
    broken.chmod(0o755)
    os.chmod(tmp_path, 0o755)
    box = LocalSandbox(isolation=mode, python=str(broken), preimport=())
    with pytest.raises(SandboxError, match="stopped while starting: exit status 3"):
        box.run("1")
    box.close()


@pytest.mark.skipif(
    os.geteuid() != 0 or not (isolation.shutil.which("bwrap") and isolation.bubblewrap_works("/usr/bin/bwrap")),
    reason="blocking user namespaces in the anchor is for bubblewrap run by root",
)
def test_where_user_namespaces_cannot_be_blocked_the_sandbox_says_so_and_runs(monkeypatch):
    isolation.userns_blockable.cache_clear()
    monkeypatch.setattr(isolation, "_userns_probe_source", lambda: "import sys; sys.exit('forbidden here')")
    try:
        assert not isolation.userns_blockable("/usr/bin/bwrap", sys.executable)
        with LocalSandbox(preimport=()) as box:
            assert isolation.NO_USERNS in box.isolation.missing and not box.isolation.block_userns
            r = box.run("import os\nos.getuid() != 0, open('/proc/self/status').read()")
            unprivileged, status = eval(r.value)
            assert unprivileged and "CapEff:\t0000000000000000" in status
    finally:
        isolation.userns_blockable.cache_clear()
