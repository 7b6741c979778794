"""No process and no file of a sandbox survives close(), garbage collection, or a crash of
the program that made it — checked on the process table."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys
import textwrap

import pytest

from sandboxes import LocalSandbox, isolation

FAST = ("math",)
# Plain processes started by root need a Python installation that others can read (to run as a
# user of their own); with one that is not (under /root), only the unsafe mode runs them.
PROCESS = "process" if os.geteuid() != 0 or isolation.unreadable_path(sys.executable) is None else "unsafe-process"
MODES = ["bubblewrap", PROCESS]


def _sandbox(mode: str) -> LocalSandbox:
    if mode == "bubblewrap" and not __import__("shutil").which("bwrap"):
        pytest.skip("bubblewrap is not installed (make installs it)")
    return LocalSandbox(isolation=mode, preimport=FAST)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("mode", MODES)
def test_close_leaves_no_process_and_no_file(mode, procs):
    box = _sandbox(mode)
    box.run("import subprocess\nx = 1")
    child = box.fork()
    grandchild = child.fork()
    # A call that is still running, with a process of its own, when we close.
    family = procs.family(box)
    assert len(family) >= 4 + (mode == "bubblewrap")  # (bwrap,) anchor, 3 interpreters
    scratch = box._session.family.scratch_dir
    for sandbox in (grandchild, box, child):
        sandbox.close()
    assert procs.still_there(family) == set()
    assert scratch is None or not os.path.exists(scratch)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("mode", MODES)
def test_closing_a_fork_stops_only_its_interpreter(mode, procs):
    box = _sandbox(mode)
    box.run("x = 'parent'")
    child = box.fork()
    child.run("y = 1")
    child_pid, parent_pid = child.pid, box.pid
    child_process = {(child_pid, procs.stat(child_pid)[2])}
    child.close()
    assert procs.still_there(child_process) == set()
    assert box.pid == parent_pid and box.run("x").value == "'parent'"
    box.close()


def test_garbage_collection_closes_the_sandbox(procs):
    box = LocalSandbox(preimport=FAST)
    box.run("z = 1")
    fork = box.fork()
    family = procs.family(box)
    del box, fork
    gc.collect()
    assert procs.still_there(family) == set()


def test_closing_the_parent_first_keeps_forks_working(procs):
    box = LocalSandbox(preimport=FAST)
    box.run("import subprocess\nvalue = 41")
    fork = box.fork()
    box.close()
    after = fork.run("value + 1")
    assert after.value == "42", after
    family = procs.family(fork)
    fork.close()
    assert procs.still_there(family) == set(), [procs.command(p) for p, _ in family]


def test_forks_survive_their_parent_running_or_closing_right_away():
    # A fork's process is the grandchild of its parent's until the double fork's intermediate
    # has exited; the cleanup after the parent's next call, or its close, must spare it.
    box = LocalSandbox(preimport=FAST)
    box.run("v = [0]")
    for i in range(5):
        fork = box.fork()
        assert box.run("v[0] += 1").ok
        assert fork.run("v").value == f"[{i}]"
        deeper = fork.fork()
        fork.close()
        assert deeper.run("v").value == f"[{i}]"
        deeper.close()
    box.close()


SUPERVISOR = textwrap.dedent("""
    import ctypes, json, os, signal, subprocess, sys, time
    ctypes.CDLL(None).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER: orphans come to us
    host = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE)
    line = host.stdout.readline()
    if not line:
        sys.exit("the host program failed before it reported its processes")
    recorded = [tuple(p) for p in json.loads(line)]
    os.kill(host.pid, signal.SIGKILL)  # the crash
    host.wait()

    def exists(pid, start):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                data = f.read()
        except OSError:
            return False
        return int(data[data.rindex(b")") + 2:].split()[19]) == start

    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:  # reap what the crash left to us
                pass
        except ChildProcessError:
            pass
        left = [p for p in recorded if exists(*p)]
        if not left:
            break
        time.sleep(0.05)
    print(json.dumps({"recorded": len(recorded), "left": left}))
""")

HOST = textwrap.dedent("""
    import json, os, sys, threading, time, warnings
    warnings.simplefilter("ignore")
    sys.path.insert(0, {root!r})
    from sandboxes import LocalSandbox
    box = LocalSandbox(isolation={mode!r}, preimport=("math",))
    box.run("state = 1")
    fork = box.fork()
    threading.Thread(target=fork.run, daemon=True, kwargs=dict(timeout=600, code=(
        "import subprocess, time\\nsubprocess.Popen(['sleep', '300'])\\ntime.sleep(300)"))).start()
    time.sleep(1.5)
    table = {{}}
    for name in filter(str.isdigit, os.listdir("/proc")):
        try:
            data = open(f"/proc/{{name}}/stat", "rb").read()
        except OSError:
            continue
        fields = data[data.rindex(b")") + 2:].split()
        table[int(name)] = (int(fields[1]), int(fields[19]))
    mine, stack = [], [os.getpid()]
    while stack:
        pid = stack.pop()
        stack += [p for p, (ppid, _) in table.items() if ppid == pid]
        if pid != os.getpid():
            mine.append((pid, table[pid][1]))
    print(json.dumps(mine), flush=True)
    time.sleep(600)
""")


@pytest.mark.parametrize("mode", MODES)
def test_a_crash_of_the_caller_leaves_nothing_behind(mode):
    if mode == "bubblewrap" and not __import__("shutil").which("bwrap"):
        pytest.skip("bubblewrap is not installed (make installs it)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    host = HOST.format(root=root, mode=mode)
    out = subprocess.run([sys.executable, "-c", SUPERVISOR, host], capture_output=True, text=True, timeout=120)
    report = json.loads(out.stdout)
    # (bwrap,) anchor, two interpreters, and the sleep of the running call
    assert report["recorded"] >= 4 + (mode == "bubblewrap"), out.stderr
    assert report["left"] == []


def test_a_process_counts_as_dying_from_its_kill_until_it_is_reaped():
    # The host waits for a death notice only for an interpreter that is dying (see died_while_idle).
    import signal

    from sandboxes.local_sandbox import _dying

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert not _dying(child.pid)
        child.send_signal(signal.SIGSTOP)  # stopped: a SIGKILL can stay pending, never a zombie yet
        child.kill()
        assert _dying(child.pid)  # pending, exiting or a zombie: every stage counts
    finally:
        child.kill()
        child.wait()
    assert _dying(child.pid)  # reaped: gone
