"""Unit tests of the pieces both sides share: wire format, process tree, traceback trimming,
output capping, and the choice of isolation and its command line."""

from __future__ import annotations

import os
import socket
import sys
import threading
import warnings

import pytest

from sandboxes import Limits, LocalSandbox, SandboxError, _worker, isolation


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


def test_a_python_that_does_not_run_is_rejected():
    with pytest.raises(ValueError, match="python='/bin/false' cannot be run"):
        LocalSandbox(python="/bin/false")


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("mode", ["process", "bubblewrap"])
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
