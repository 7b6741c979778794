"""The code that runs inside a sandbox: the anchor, the interpreters and the wire format.

This module uses the standard library only, because it is started as
``python -I -B -c <this file's source> MODE CONFIG`` inside the sandbox (where the project
itself is not importable) and may run in a Docker image with another Python. The host imports
its wire helpers and its process-table helpers, so both sides share one implementation.

Process model of one *family* (one container):

* the **anchor** (PID 1 of the sandbox's PID namespace under bubblewrap, a child subreaper
  without it) imports the warm modules once, never runs user code, forks fresh interpreters
  on request, reaps every process and reports each interpreter's death to the host;
* each **interpreter** holds one Python session (a globals dict) and talks to the host over
  its own ``SOCK_SEQPACKET`` channel; ``fork`` double-forks it, so every interpreter is a direct
  child of the anchor and the copy-on-write child shares nothing later with its parent.

The host ``->`` anchor *control* channel carries one-way commands; the anchor answers on the
interpreter's own channel (it keeps a copy of the interpreter's end), so the host never has to
demultiplex. The kernel attaches the sender's PID to every packet (``SO_PASSCRED``), which
lets the host tell the anchor's notices from anything the (untrusted) interpreter sends.
"""

import ast
import ctypes
import gc
import io
import itertools
import json
import linecache
import math
import os
import resource
import selectors
import shutil
import signal
import socket
import struct
import sys
import time
import traceback
import warnings

# ---------------------------------------------------------------------------------------------
# Wire format
# ---------------------------------------------------------------------------------------------

CHUNK_BYTES = 32 * 1024  # payload per packet; well under the default socket buffer (~208 KiB)
MORE, END = b"M", b"E"  # first byte of a packet: more packets follow / last packet of a message
CREDS = struct.Struct("iII")  # struct ucred: pid, uid, gid
FRAME = struct.Struct(">I")  # length prefix of the stream format (Docker's stdin/stdout)
MAX_FDS_PER_PACKET = 4


def encode(message):
    """One message as JSON bytes (ASCII only, so any code or output survives the trip)."""
    return json.dumps(message, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def decode(data):
    """The message encoded by ``encode``; raises ValueError on anything else."""
    message = json.loads(data.decode("ascii"))
    if not isinstance(message, dict) or not isinstance(message.get("op"), str):
        raise ValueError("a message must be a JSON object with a string 'op'")
    return message


def packets(message):
    """Split an encoded message into packets for a SOCK_SEQPACKET channel."""
    data = encode(message)
    chunks = [data[i : i + CHUNK_BYTES] for i in range(0, len(data), CHUNK_BYTES)] or [b""]
    return [(MORE if i < len(chunks) - 1 else END) + chunk for i, chunk in enumerate(chunks)]


def recv_packet(sock, want_fds=False):
    """Receive one packet: (payload with its flag byte, sender pid or None, fds). b'' at EOF."""
    ancillary = socket.CMSG_SPACE(CREDS.size) + socket.CMSG_SPACE(4 * MAX_FDS_PER_PACKET)
    data, ancdata, _flags, _addr = sock.recvmsg(CHUNK_BYTES + 1, ancillary)
    pid, fds = None, []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
            pid = CREDS.unpack(payload[: CREDS.size])[0]
        elif level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            count = len(payload) // 4
            fds.extend(struct.unpack("%di" % count, payload[: 4 * count]))
    if not want_fds:  # never keep descriptors nobody asked for (a flood would exhaust ours)
        for fd in fds:
            os.close(fd)
        fds = []
    return data, pid, fds


def send_message(sock, message, fds=(), timeout=None):
    """Send a message on a blocking SOCK_SEQPACKET socket, descriptors on its first packet.
    With ``timeout`` (seconds) give up with TimeoutError instead of blocking longer."""
    deadline = None if timeout is None else time.monotonic() + timeout
    for i, packet in enumerate(packets(message)):
        rights = []
        if i == 0 and fds:
            rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("%di" % len(fds), *fds))]
        while True:
            try:
                sock.sendmsg([packet], rights, socket.MSG_DONTWAIT if deadline else 0)
                break
            except BlockingIOError:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise TimeoutError("the receiver is not reading") from None
                poller = selectors.PollSelector()
                poller.register(sock, selectors.EVENT_WRITE)
                poller.select(remaining)
                poller.close()


def recv_message(sock, want_fds=False):
    """Receive a whole message from a blocking SOCK_SEQPACKET socket: (message, fds), or
    (None, []) at end of file."""
    buffer, all_fds = [], []
    while True:
        data, _pid, fds = recv_packet(sock, want_fds)
        all_fds.extend(fds)
        if not data:
            for fd in all_fds:
                os.close(fd)
            return None, []
        buffer.append(data[1:])
        if data[:1] == END:
            return decode(b"".join(buffer)), all_fds


# ---------------------------------------------------------------------------------------------
# Process table (inside a PID namespace this lists only the sandbox's own processes)
# ---------------------------------------------------------------------------------------------


def process_table(proc="/proc"):
    """{pid: (parent pid, state letter)} of every process visible in ``proc``."""
    table = {}
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open("%s/%s/stat" % (proc, name), "rb") as f:
                stat = f.read()
        except OSError:  # exited while we looked
            continue
        fields = stat[stat.rindex(b")") + 2 :].split()  # the command name may contain spaces
        table[int(name)] = (int(fields[1]), fields[0].decode())
    return table


def descendants(root, table):
    """Every pid below ``root`` in ``table`` (children first), ``root`` excluded."""
    children = {}
    for pid, (ppid, _state) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, stack = [], list(children.get(root, []))
    while stack:
        pid = stack.pop()
        found.append(pid)
        stack.extend(children.get(pid, []))
    return found


def kill_tree(root, include_root, spare=(), proc="/proc"):
    """SIGKILL ``root``'s descendants (and ``root`` itself if asked), skipping ``spare`` and
    the subtrees under them, until none is left alive. Repeats because a process may fork
    while we look; each round kills what the last one missed. Returns how many were killed."""
    killed, deadline = 0, time.monotonic() + 30.0
    for _round in itertools.count():
        table = process_table(proc)
        spared = set()
        for pid in spare:
            spared.add(pid)
            spared.update(descendants(pid, table))
        targets = [p for p in descendants(root, table) if p not in spared]
        if include_root and root in table:
            targets.append(root)
        alive = [p for p in targets if table[p][1] not in "ZX"]
        if not alive or time.monotonic() > deadline:
            return killed
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
                killed += 1
            except ProcessLookupError:
                pass
        time.sleep(min(0.01, 0.0002 * _round))  # let the kernel deliver before we look again


def reap_children():
    """Collect every exited child without blocking: [(pid, exit code or -signal)]."""
    reaped = []
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return reaped
        if pid == 0:
            return reaped
        reaped.append((pid, os.waitstatus_to_exitcode(status)))


# ---------------------------------------------------------------------------------------------
# Small pieces of Linux that the standard library does not wrap
# ---------------------------------------------------------------------------------------------

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38


def prctl(option, value):
    libc = ctypes.CDLL(None, use_errno=True)
    zero = ctypes.c_ulong(0)  # full-width zeros: prctl is variadic and checks unused arguments
    if libc.prctl(ctypes.c_int(option), ctypes.c_ulong(value), zero, zero, zero) != 0:
        raise OSError(ctypes.get_errno(), "prctl(%d) failed" % option)


CLONE_PARENT = 0x00008000
SYS_CLONE = {"x86_64": 56, "aarch64": 220}.get(os.uname().machine)


def fork_sibling():
    """Fork a child whose parent is our parent (clone with CLONE_PARENT): one copy of the
    address space instead of the two of a double fork. Wrapped like ``os.fork`` (fork hooks,
    import lock). Only for a single-threaded process: unlike glibc's fork() it cannot reset
    locks that another thread might hold in the child."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    null = ctypes.c_void_p(None)  # no new stack (the child continues on a copy of ours), no tids
    ctypes.pythonapi.PyOS_BeforeFork()
    pid = libc.syscall(
        ctypes.c_long(SYS_CLONE), ctypes.c_ulong(CLONE_PARENT | signal.SIGCHLD), null, null, null, ctypes.c_ulong(0)
    )
    if pid == 0:
        ctypes.pythonapi.PyOS_AfterFork_Child()
    else:
        ctypes.pythonapi.PyOS_AfterFork_Parent()
    if pid < 0:
        raise OSError(ctypes.get_errno(), "clone failed")
    return pid


CLONE_NEWUSER = 0x10000000
PR_CAPBSET_DROP, PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 24, 47, 4
CAPABILITY_VERSION_3 = 0x20080522


def unshare(flags):
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(ctypes.c_int(flags)) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, "unshare(0x%x): %s" % (flags, os.strerror(errno)))


def block_user_namespaces(uid, proc_fd):
    """Move into a user namespace of our own, where ``uid`` is itself and no further user
    namespace can be created (and, without capabilities there, no namespace of any kind).

    This is bubblewrap's --disable-userns for privileged bubblewrap, which cannot use it: it
    needs --unshare-user, whose map, written by root, makes the sandbox's user the host's root
    (so RLIMIT_NPROC no longer applies). We are root here, still in the host's user namespace:
    a helper that stays there writes the id maps of ours (only a writer in the parent namespace
    may map another id), and the limit of 0 is written through ``proc_fd``, the host's /proc
    (the sandbox's /proc/sys is read-only). Call ``drop_capabilities`` after switching users."""
    go_r, go_w = os.pipe()
    helper = os.fork()
    if helper == 0:
        code = 1
        try:
            os.close(go_w)
            if os.read(go_r, 1) == b"1":
                for name in ("uid_map", "gid_map"):
                    fd = os.open("/proc/%d/%s" % (os.getppid(), name), os.O_WRONLY)
                    try:
                        os.write(fd, b"%d %d 1\n" % (uid, uid))
                    finally:
                        os.close(fd)
                code = 0
        finally:
            os._exit(code)
    os.close(go_r)
    try:
        unshare(CLONE_NEWUSER)
        os.write(go_w, b"1")
    finally:
        os.close(go_w)  # a helper that read nothing exits with 1
        status = os.waitpid(helper, 0)[1]
    if os.waitstatus_to_exitcode(status) != 0:
        raise OSError("could not map user %d into the sandbox's user namespace" % uid)
    fd = os.open("sys/user/max_user_namespaces", os.O_WRONLY, dir_fd=proc_fd)
    try:
        os.write(fd, b"0")
    finally:
        os.close(fd)


def drop_capabilities():
    """Clear every capability set and the bounding set. Needed in a user namespace of our own:
    its root is not mapped, so switching to another user does not drop them by itself."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in range(64):
        if libc.prctl(ctypes.c_int(PR_CAPBSET_DROP), ctypes.c_ulong(cap), *[ctypes.c_ulong(0)] * 3) != 0:
            break  # EINVAL past the last capability; EPERM where we hold none (nothing to drop)
    try:
        prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    except OSError:  # kernels before 4.3 have no ambient capabilities
        pass
    header = (ctypes.c_uint32 * 2)(CAPABILITY_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()  # effective, permitted, inheritable, twice (64 bits): all zero
    if libc.capset(header, data) != 0:
        raise OSError(ctypes.get_errno(), "capset failed")
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(("CapEff:", "CapPrm:", "CapInh:")) and int(line.split()[1], 16):
                raise OSError("capabilities remain after dropping them: %s" % line.strip())


def join_cgroups(fds):
    """Join the family's cgroup(s): "0" written to a cgroup.procs descriptor moves the writer
    (the kernel checks the rights of whoever opened it: the host)."""
    for fd in fds:
        try:
            os.write(fd, b"0")
        finally:
            os.close(fd)


def set_limits(limits):
    """Apply the sandbox's setrlimit limits to this process (inherited by its children), soft
    and hard alike, so the code cannot raise them again.
    ``limits``: {"memory": bytes, "processes": n, "open_files": n, "file_size": bytes,
    "cpu_ceiling": seconds}. The CPU limit's soft value is set per call (``Interpreter.run``)."""
    for name, value in (
        ("RLIMIT_AS", limits.get("memory")),
        ("RLIMIT_NPROC", limits.get("processes")),
        ("RLIMIT_NOFILE", limits.get("open_files")),
        ("RLIMIT_FSIZE", limits.get("file_size")),
        ("RLIMIT_CPU", limits.get("cpu_ceiling")),
        ("RLIMIT_CORE", 0),  # a crash must not leave a core file behind
    ):
        if value is not None:
            resource.setrlimit(getattr(resource, name), (value, value))


def limit_cpu(cpu):
    """Allow this call ``cpu`` more CPU seconds: SIGXCPU at the soft limit, SIGKILL at the hard
    one. Only the soft limit moves here (up to the hard limit): an unprivileged process cannot
    raise a hard limit, so the host sets it for each call where it may (CAP_SYS_RESOURCE), and
    otherwise it is the interpreter's life-long ceiling (``set_limits``)."""
    soft = math.ceil(cpu_seconds_used() + cpu)
    try:
        hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
        if hard != resource.RLIM_INFINITY:
            soft = min(soft, hard)
        resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
    except (ValueError, OSError):
        pass


def cpu_seconds_used():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------------------------------------
# The interpreter: one persistent Python session
# ---------------------------------------------------------------------------------------------


class CappedWriter(io.TextIOBase):
    """sys.stdout / sys.stderr during a run: writes through to a file descriptor until
    ``limit`` bytes, then only counts, so a flood costs neither memory nor the session."""

    def __init__(self, fd, limit):
        self._fd, self._limit, self.written, self.dropped = fd, limit, 0, 0

    @property
    def encoding(self):
        return "utf-8"

    def writable(self):
        return True

    def fileno(self):
        return self._fd

    def write(self, text):
        data = str(text).encode("utf-8", "backslashreplace")
        keep = data[: max(0, self._limit - self.written)]
        self.dropped += len(data) - len(keep)
        while keep:
            n = os.write(self._fd, keep)
            self.written += n
            keep = keep[n:]
        return len(text)


class Output:
    """A memfd behind a standard file descriptor: collects everything written to the fd
    (also by C code and child processes) and is emptied after each run."""

    def __init__(self, target_fd, name):
        self.target_fd = target_fd
        self.fd = os.memfd_create(name, 0)  # non-inheritable; dup2 below makes the copy inheritable
        os.dup2(self.fd, target_fd)

    def take(self, limit):
        """(text of at most ``limit`` bytes, whether more was written); empties the file."""
        try:
            size = os.fstat(self.fd).st_size
            data = os.pread(self.fd, min(size, limit), 0)
            os.ftruncate(self.fd, 0)
            os.lseek(self.fd, 0, os.SEEK_SET)  # shares the offset with target_fd
        except OSError:  # the user closed or replaced it; report nothing rather than fail
            return "", False
        return data.decode("utf-8", "replace"), size > limit


def trim_traceback(exc):
    """The exception as the user should see it: only frames of the user's cells."""
    te = traceback.TracebackException(type(exc), exc, exc.__traceback__)
    pending, seen = [te], set()
    while pending:
        node = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        node.stack = traceback.StackSummary.from_list(
            [frame for frame in node.stack if frame.filename.startswith("<cell ")]
        )
        pending.extend(n for n in (node.__cause__, node.__context__) if n is not None)
    return "".join(te.format())


def clip(text, limit):
    """(text cut to ``limit`` UTF-8 bytes, whether it was cut)."""
    data = text.encode("utf-8", "backslashreplace")
    if len(data) <= limit:
        return text, False
    return data[:limit].decode("utf-8", "ignore"), True


class Interpreter:
    """One Python session. ``channel`` sends and receives messages to and from the host."""

    def __init__(self, channel, output_bytes, sid):
        self.channel, self.output_bytes, self.sid = channel, output_bytes, sid
        self.namespace = {"__name__": "__main__", "__builtins__": __builtins__}
        self.cells = 0
        self.forking = set()  # intermediates of our double forks that we have not reaped yet
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        self.stdout, self.stderr = Output(1, "stdout"), Output(2, "stderr")

    def serve(self):
        """Answer requests until the host goes away."""
        while True:
            message, fds = self.channel.recv()
            if message is None:
                os._exit(0)
            self.reap()  # processes killed after the previous run
            op = message.get("op")
            try:
                if op == "run":
                    reply = self.run(str(message.get("code", "")), float(message.get("cpu", 10)))
                elif op == "fork" and fds:
                    reply = self.fork(str(message.get("sid")), fds[0])
                else:
                    reply = {"op": "error", "error": "unknown request %r" % (op,)}
            except Exception as exc:  # a failure of ours, not of the user's code
                reply = {"op": "error", "error": "%s: %s" % (type(exc).__name__, exc)}
            if reply is not None:  # a fork child has switched channels and says hello itself
                self.channel.send(reply)

    def run(self, code, cpu):
        start = time.monotonic()
        self.cells += 1
        name = "<cell %d>" % self.cells
        linecache.cache[name] = (len(code), None, code.splitlines(True), name)
        out, err = CappedWriter(1, self.output_bytes), CappedWriter(2, self.output_bytes)
        saved = sys.stdout, sys.stderr
        sys.stdout, sys.stderr = out, err
        value = error = error_type = None
        limit_cpu(cpu)  # CPU seconds for this run on top of what the session already used
        try:
            tree = ast.parse(code, filename=name)
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            exec(compile(tree, name, "exec"), self.namespace)
            if last is not None:
                result = eval(compile(ast.Expression(last.value), name, "eval"), self.namespace)
                if result is not None:
                    value = repr(result)
        except BaseException as exc:  # SystemExit and KeyboardInterrupt too: the session stays
            error_type = type(exc).__name__
            try:
                error = trim_traceback(exc)
            except BaseException:  # a hostile __str__ must not take the session down
                error = error_type + "\n"
        finally:
            sys.stdout, sys.stderr = saved
        try:  # processes do not outlive the call; forks on their way to the anchor do
            kill_tree(os.getpid(), include_root=False, spare=self.forking)
            self.reap()
        except OSError:  # e.g. no file descriptor left to read /proc; the anchor cleans up too
            pass
        stdout, stdout_cut = self.stdout.take(self.output_bytes)
        stderr, stderr_cut = self.stderr.take(self.output_bytes)
        value, value_cut = clip(value, self.output_bytes) if value is not None else (None, False)
        error, error_cut = clip(error, self.output_bytes) if error is not None else (None, False)
        return {
            "op": "result",
            "stdout": stdout,
            "stderr": stderr,
            "value": value,
            "error": error,
            "error_type": error_type,
            "truncated": bool(stdout_cut or stderr_cut or value_cut or error_cut or out.dropped or err.dropped),
            "seconds": time.monotonic() - start,
        }

    def reap(self):
        for pid, _code in reap_children():
            self.forking.discard(pid)

    def fork(self, sid, fd):
        """Make a copy of this interpreter that is the anchor's child, not ours; None in the
        child. Single-threaded we clone as our parent's child; otherwise we double-fork and
        nobody waits for the intermediate (tearing down its copy of the address space takes
        longer than the forks), which we reap later."""
        if SYS_CLONE is not None and len(os.listdir("/proc/self/task")) == 1:
            try:
                pid = fork_sibling()
            except OSError as exc:
                os.close(fd)
                return {"op": "error", "error": "fork failed: %s" % exc}
            if pid == 0:
                try:
                    self.become_fork(sid, fd)
                except BaseException:
                    os._exit(70)
                return None
            os.close(fd)
            return {"op": "forked"}
        try:
            pid = os.fork()
        except OSError as exc:
            os.close(fd)
            return {"op": "error", "error": "fork failed: %s" % exc}
        if pid == 0:
            try:
                try:
                    grandchild = os.fork()
                except OSError as exc:
                    send_message(socket.socket(fileno=fd), {"op": "error", "error": str(exc)})
                    os._exit(1)
                if grandchild != 0:
                    os._exit(0)
                self.become_fork(sid, fd)
            except BaseException:
                os._exit(70)
            return None
        os.close(fd)
        self.forking.add(pid)
        return {"op": "forked"}

    def become_fork(self, sid, fd):
        os.dup2(fd, self.channel.fileno())  # replaces (and so closes) the parent's channel
        os.close(fd)
        os.setpgid(0, 0)
        parent_sid, self.sid = self.sid, sid
        enter_scratch(sid, copy_from=parent_sid)
        os.close(self.stdout.fd)
        os.close(self.stderr.fd)
        self.stdout, self.stderr = Output(1, "stdout"), Output(2, "stderr")
        if ANCHOR_PID != 1:  # as PID 1 of our namespace, the anchor's exit kills us anyway
            watch_anchor()
        self.channel.send({"op": "hello"})


def enter_scratch(sid, copy_from=None):
    """Make <scratch>/<sid> the working, home and temp folder of this interpreter; for a fork,
    a copy of the parent's folder ``copy_from`` (a sid), at the same relative working folder."""
    root = os.environ["SANDBOX_SCRATCH"]
    path = os.path.join(root, sid)
    shutil.rmtree(path, ignore_errors=True)
    relative = "."
    if copy_from is not None:
        source = os.path.join(root, copy_from)
        try:
            relative = os.path.relpath(os.getcwd(), source)
        except OSError:  # the working folder was deleted
            pass
        if relative.startswith(".."):
            relative = "."
        try:
            shutil.copytree(source, path, symlinks=True)
        except OSError:  # a file the code made unreadable; the fork gets what could be copied
            pass
    os.makedirs(path, exist_ok=True)
    os.chdir(path)
    if os.path.isdir(relative):
        os.chdir(relative)
    os.environ["HOME"] = os.environ["TMPDIR"] = path


ANCHOR_PID = None


def watch_anchor():
    """Die with the anchor: wait until we are its child (the intermediate of a double fork
    has exited), then ask for SIGKILL when it goes away."""
    deadline = time.monotonic() + 10.0
    while os.getppid() != ANCHOR_PID:
        if time.monotonic() > deadline:  # adopted by someone else: the anchor is gone
            os._exit(0)
        time.sleep(0.0002)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != ANCHOR_PID:
        os._exit(0)


class PacketChannel:
    """A blocking SOCK_SEQPACKET channel (local sandboxes)."""

    def __init__(self, sock):
        self.sock = sock

    def fileno(self):
        return self.sock.fileno()

    def send(self, message, fds=()):
        send_message(self.sock, message, fds)

    def recv(self):
        return recv_message(self.sock, want_fds=True)


class StreamChannel:
    """Length-prefixed messages on two file descriptors (a Docker container's stdin/stdout)."""

    def __init__(self, read_fd, write_fd):
        self.read_fd, self.write_fd = read_fd, write_fd

    def fileno(self):
        return self.read_fd

    def _read_exactly(self, n):
        data = b""
        while len(data) < n:
            chunk = os.read(self.read_fd, n - len(data))
            if not chunk:
                return None
            data += chunk
        return data

    def send(self, message, fds=()):
        data = encode(message)
        data = FRAME.pack(len(data)) + data
        while data:
            data = data[os.write(self.write_fd, data) :]

    def recv(self):
        header = self._read_exactly(FRAME.size)
        if header is None:
            return None, []
        body = self._read_exactly(FRAME.unpack(header)[0])
        return (None, []) if body is None else (decode(body), [])


# ---------------------------------------------------------------------------------------------
# The anchor: warm imports, fresh interpreters, reaping, death notices
# ---------------------------------------------------------------------------------------------


def drop_privileges(uid):
    """Become ``uid`` (a user of its own, so RLIMIT_NPROC counts this sandbox alone)."""
    os.setgroups([])
    os.setresgid(uid, uid, uid)
    os.setresuid(uid, uid, uid)


def warm_imports(names):
    """Import the pre-import list; returns the names that failed with why."""
    failed = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            try:
                __import__(name)
            except BaseException as exc:  # a broken package must not stop the sandbox
                failed[name] = "%s: %s" % (type(exc).__name__, exc)
    return failed


def ignore_signals():
    """Ignore every signal we may (the anchor must not die of a KeyboardInterrupt someone sent
    it); returns the previous handlers, which interpreters restore."""
    previous = {}
    for sig in signal.valid_signals():
        if sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGCHLD):
            continue
        try:
            previous[sig] = signal.signal(sig, signal.SIG_IGN)
        except (OSError, ValueError):  # signals the runtime reserves
            pass
    return previous


class Anchor:
    def __init__(self, config, oom=None):
        self.config, self.oom = config, oom
        self.default_handlers = ignore_signals()
        self.control = socket.socket(fileno=config["control_fd"])
        self.channels = {}  # sid -> socket: our copy of the interpreter's end of its channel
        self.pids = {}  # sid -> pid of the live interpreter
        self.unclaimed_exits = {}  # pid -> exit code of children that no sid claimed (yet)
        self.pending_forks = 0

    def notify(self, sid, message, close=False):
        channel = self.channels.get(sid)
        if channel is None:
            return
        try:
            send_message(channel, message, timeout=2.0)
        except OSError:  # the host closed its end or stopped reading (TimeoutError included)
            pass
        if close:
            channel.close()
            del self.channels[sid]

    def spawn(self, sid, fd):
        self.channels[sid] = socket.socket(fileno=fd)
        if self.oom is not None:
            self.oom.set(b"1000")  # inherited by the child; ours is restored right after
        try:
            pid = os.fork()
        except OSError as exc:
            pid = None
            self.notify(sid, {"op": "exit", "code": None, "error": "spawn failed: %s" % exc}, close=True)
        if pid == 0:
            if self.oom is not None:
                self.oom.close()  # the anchor's own score: not for the interpreter to change
            self.become_interpreter(sid)
        if self.oom is not None:
            self.oom.set(self.oom.own)
        if pid is None:
            return
        self.pids[sid] = pid

    def become_interpreter(self, sid):
        """In the child of ``spawn``: keep only our channel (as fd 3) and serve it."""
        global ANCHOR_PID
        try:
            ANCHOR_PID = os.getppid()
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for sig, handler in self.default_handlers.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
            keep = self.channels.pop(sid).detach()
            for other in [self.control, *self.channels.values()]:
                other.detach()  # their fds go with closerange below, never twice
            if keep != 3:
                os.dup2(keep, 3)
            os.closerange(4, os.sysconf("SC_OPEN_MAX"))
            os.setpgid(0, 0)
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            set_limits(self.config["limits"])
            enter_scratch(sid)
            interpreter = Interpreter(PacketChannel(socket.socket(fileno=3)), self.config["output_bytes"], sid)
            interpreter.channel.send({"op": "hello"})
            interpreter.serve()
        except BaseException:
            traceback.print_exc()
        os._exit(70)

    def adopt(self, sid, pid, fd):
        """Take responsibility for an interpreter made by ``fork`` (the host read its pid)."""
        self.pending_forks = max(0, self.pending_forks - 1)
        self.channels[sid] = socket.socket(fileno=fd)
        if pid in self.unclaimed_exits:
            self.notify(sid, {"op": "exit", "code": self.unclaimed_exits.pop(pid)}, close=True)
            return
        if pid in self.pids.values() or not self.is_fork(pid):
            self.notify(sid, {"op": "exit", "code": None, "error": "not a fork of this sandbox"}, close=True)
            return
        self.pids[sid] = pid

    def is_fork(self, pid):
        """Whether ``pid`` is our child, or still the grandchild of an interpreter through the
        intermediate process of its double fork."""
        table = process_table()
        parent = table.get(pid, (None, ""))[0]
        return parent == os.getpid() or table.get(parent, (None, ""))[0] in self.pids.values()

    def kill_orphans(self):
        """Kill processes that left an interpreter's tree (re-parented to us) — unless a fork
        is in flight, whose child would look exactly like one."""
        if self.pending_forks:
            return
        kill_tree(os.getpid(), include_root=False, spare=list(self.pids.values()))

    def others(self, sid):
        """The other interpreters, which a kill below ``sid`` must spare: a fork may still be
        the grandchild of the interpreter it was made from."""
        return [pid for other, pid in self.pids.items() if other != sid]

    def cleanup(self, sid):
        pid = self.pids.get(sid)
        if pid is not None:
            kill_tree(pid, include_root=False, spare=self.others(sid))
        self.kill_orphans()
        self.reap()
        self.notify(sid, {"op": "cleaned"})

    def kill(self, sid):
        pid = self.pids.get(sid)
        if pid is None:
            self.notify(sid, {"op": "exit", "code": None}, close=True)
            return
        kill_tree(pid, include_root=True, spare=self.others(sid))
        self.kill_orphans()
        self.reap()

    def reap(self):
        claimed = {pid: sid for sid, pid in self.pids.items()}
        for pid, code in reap_children():
            sid = claimed.get(pid)
            if sid is None:
                self.unclaimed_exits[pid] = code
                while len(self.unclaimed_exits) > 4096:
                    self.unclaimed_exits.pop(next(iter(self.unclaimed_exits)))
                continue
            del self.pids[sid]
            self.kill_orphans()  # what it left running is ours now
            shutil.rmtree(os.path.join(self.config["scratch"], sid), ignore_errors=True)
            self.notify(sid, {"op": "exit", "code": code}, close=True)

    def handle(self, message, fds):
        op, sid = message.get("op"), str(message.get("sid"))
        if op == "spawn" and fds:
            self.spawn(sid, fds[0])
        elif op == "adopt" and fds:
            self.adopt(sid, int(message["pid"]), fds[0])
        elif op == "fork_begin":
            self.pending_forks += 1
            self.notify(sid, {"op": "fork_ready"})  # the host has the interpreter fork only after this
        elif op == "fork_abort":
            self.pending_forks = max(0, self.pending_forks - 1)
        elif op == "cleanup":
            self.cleanup(sid)
        elif op == "kill":
            self.kill(sid)
        else:
            for fd in fds:
                os.close(fd)

    def shutdown(self):
        """The host closed the control channel (or died): nothing of ours may outlive it."""
        kill_tree(os.getpid(), include_root=False)
        reap_children()
        if not self.config["pid1"]:  # under bubblewrap the scratch is a tmpfs that dies with us
            shutil.rmtree(self.config["scratch"], ignore_errors=True)
        os._exit(0)

    def serve(self):
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        selector = selectors.DefaultSelector()
        selector.register(self.control, selectors.EVENT_READ)
        selector.register(wake_r, selectors.EVENT_READ)
        while True:
            for key, _events in selector.select():
                if key.fileobj is self.control:
                    try:
                        message, fds = recv_message(self.control, want_fds=True)
                    except (OSError, ValueError):
                        message, fds = None, []
                    if message is None:
                        self.shutdown()
                    self.handle(message, fds)
                else:
                    os.read(wake_r, 4096)
            self.reap()


def anchor_main(config):
    join_cgroups(config.get("cgroup_fds") or ())  # first: everything we start inherits it
    oom = OomScore()  # opened while we may still write our own /proc files
    if config.get("block_userns"):
        try:
            block_user_namespaces(config["uid"], config["proc_fd"])
        finally:
            os.close(config["proc_fd"])  # the host's /proc: nothing below may keep it
    if config.get("uid") is not None:
        drop_privileges(config["uid"])
    drop_capabilities()
    prctl(PR_SET_NO_NEW_PRIVS, 1)  # nothing below may gain privileges through exec
    prctl(PR_SET_DUMPABLE, 0)  # no ptrace or /proc/<pid>/mem access between interpreters
    if not config["pid1"]:
        prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans come to us, not to the host's init
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    os.environ["SANDBOX_SCRATCH"] = config["scratch"]
    anchor = Anchor(config, oom)
    failed = warm_imports(config["preimport"])
    gc.freeze()  # what we imported is shared by every interpreter: keep the GC off its pages
    send_message(anchor.control, {"op": "ready", "failed_imports": failed})
    anchor.serve()


def probe_userns_main(config):
    """Exit 0 if ``block_user_namespaces`` works here and leaves no way to make a user
    namespace (the host checks this once before it relies on it, running these functions
    alone: see ``isolation.userns_blockable``)."""
    try:
        block_user_namespaces(config["uid"], config["proc_fd"])
        os.close(config["proc_fd"])
        drop_privileges(config["uid"])
        drop_capabilities()
    except OSError as exc:
        sys.exit("cannot block user namespaces: %s" % exc)
    try:
        unshare(CLONE_NEWUSER)
    except OSError:
        sys.exit(0)
    sys.exit("a user namespace could still be created")


class OomScore:
    """Our oom_score_adj, through a descriptor opened before we became non-dumpable (which makes
    our /proc files root's). Interpreters start at 1000, so when memory runs out the kernel kills
    an interpreter or what it started, not the anchor that holds the sandbox together."""

    def __init__(self):
        self.fd, self.own = None, b"0"
        try:
            self.fd = os.open("/proc/self/oom_score_adj", os.O_RDWR | os.O_CLOEXEC)
            self.own = os.read(self.fd, 16).strip() or b"0"
        except OSError:  # no /proc/self/oom_score_adj: interpreters keep our score
            self.close()

    def set(self, value):
        if self.fd is not None:
            try:
                os.pwrite(self.fd, value, 0)
            except OSError:
                pass

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def stdio_main(config):
    """A single interpreter speaking the stream format on stdin/stdout (Docker)."""
    read_fd, write_fd = os.dup(0), os.dup(1)
    prctl(PR_SET_DUMPABLE, 0)
    set_limits(config["limits"])
    os.environ["SANDBOX_SCRATCH"] = config["scratch"]
    warm_imports(config["preimport"])
    enter_scratch("session")
    Interpreter(StreamChannel(read_fd, write_fd), config["output_bytes"], "session").serve()


if __name__ == "__main__":
    _config = json.loads(sys.argv[2])
    {"anchor": anchor_main, "stdio": stdio_main}[sys.argv[1]](_config)
