"""Running an aiohttp application: in the foreground until a signal, from several worker processes, or on a background thread.

All bind 127.0.0.1 by default and accept ``port=0`` (a free port, reported back), so tests and
environments never collide on a fixed port.
"""

from __future__ import annotations

import asyncio
import atexit
import multiprocessing
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess

from aiohttp import web

__all__ = ["BackgroundServer", "run_until_signal", "serve_workers"]

SHUTDOWN_TIMEOUT = 5.0  # seconds that requests in flight get to finish when the server stops
BACKLOG = 1024  # pending connections: many clients may connect at once (aiohttp: 128)
# Seconds before an idle connection (kept alive, or opened and never used) is closed; aiohttp's
# own default is an hour, so idle clients could hold descriptors all that time. 30 s outlasts the
# clients' pools (agentenv's RemoteSearch keeps idle connections 4 s, aiohttp's client 15 s), so a
# client never sends on a connection the server is closing.
KEEPALIVE_TIMEOUT = 30.0
# A serve_workers worker that dies within this many seconds of starting died young; more young deaths
# in a row than there are workers is a crash loop (a bug, memory exhausted at start), which
# restarting would only repeat. A worker that had been serving is always replaced.
YOUNG_S = 10.0
# Where SO_REUSEPORT balances connections over the sockets that share a port (BSDs give them all to one).
REUSE_PORT = sys.platform == "linux" and hasattr(socket, "SO_REUSEPORT")


def _bound_port(runner: web.AppRunner) -> int:
    return runner.addresses[0][1]


async def run_until_signal(
    app: web.Application,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    name: str = "server",
    keepalive_timeout: float = KEEPALIVE_TIMEOUT,
) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, then stop gracefully (requests in flight finish).

    Prints ``Serving <name> on http://HOST:PORT`` once listening (the real port when ``port=0``).
    A connection idle for ``keepalive_timeout`` seconds is closed.
    """
    runner = web.AppRunner(
        app, shutdown_timeout=SHUTDOWN_TIMEOUT, handle_signals=False, keepalive_timeout=keepalive_timeout
    )
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await web.TCPSite(runner, host, port, backlog=BACKLOG).start()
        print(f"Serving {name} on http://{host}:{_bound_port(runner)} (Ctrl-C to stop)", flush=True)
        await stop.wait()
        print(f"Stopping {name}: finishing requests in flight", file=sys.stderr, flush=True)
    finally:
        await runner.cleanup()


def serve_workers(
    make_app: Callable[[], web.Application],
    workers: int,
    *,
    host: str = "127.0.0.1",
    port: int = 0,
    name: str = "server",
    keepalive_timeout: float = KEEPALIVE_TIMEOUT,
) -> int:
    """Serve ``make_app()`` from ``workers`` processes on one port until SIGINT or SIGTERM; returns an exit status.

    The parent binds the port (so ``port=0`` and a taken port are settled once) and starts each
    worker with the ``spawn`` method: a fresh interpreter that calls ``make_app`` (so it must
    pickle: a module-level function or a ``functools.partial`` of one) and serves the port. On
    Linux each worker listens on a socket of its own bound with ``SO_REUSEPORT``, and the kernel
    spreads connections evenly over them; elsewhere the workers accept from the parent's
    listening socket, whichever is idle first. Prints ``Serving <name> on http://HOST:PORT`` once every worker listens. A signal is passed
    on to the workers as SIGTERM, which each answers as :func:`run_until_signal` does; a worker
    whose parent died stops too. A connection idle for ``keepalive_timeout`` seconds is closed.

    A worker that dies (killed, out of memory) is replaced on the same port, with a line on
    stderr, as gunicorn does; the requests it held fail and are retried by the clients
    (:class:`~agentenv.web_search.RemoteSearch` retries a dropped connection). More than
    ``workers`` deaths in a row of workers younger than :data:`YOUNG_S` seconds is a crash loop:
    the server stops. Returns 0, or 1 when a worker failed to start or the workers crash-looped.
    """
    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    # OSError (a taken port, a foreign address): the caller reports it.
    if REUSE_PORT:  # bound, never listening: it holds the port for the workers and gets no connections
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind((host, port))
    else:
        sock = socket.create_server((host, port), family=family, backlog=BACKLOG)
    bound = sock.getsockname()[1]
    shared = None if REUSE_PORT else sock
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    context = multiprocessing.get_context("spawn")
    processes: dict[Connection, BaseProcess] = {}  # by the parent's end of a pipe to the worker

    def start_worker() -> Connection:
        ours, theirs = context.Pipe()
        process = context.Process(
            target=_worker, args=(make_app, host, bound, shared, theirs, keepalive_timeout), name=f"{name} worker"
        )
        process.start()
        theirs.close()
        processes[ours] = process
        return ours

    failure: str | None = None
    try:
        failure = _await_workers({conn: processes[conn] for conn in [start_worker() for _ in range(workers)]}, stop)
        if failure is None and not stop.is_set():
            print(f"Serving {name} on http://{host}:{bound} (Ctrl-C to stop)", flush=True)
            failure = _supervise(processes, start_worker, stop, workers, name)
        if failure is None:
            print(f"Stopping {name}: finishing requests in flight", file=sys.stderr, flush=True)
        else:
            print(f"error: {name}: {failure}", file=sys.stderr, flush=True)
    finally:
        sock.close()  # held until now: replacements bind the same port
        for worker in processes.values():
            if worker.is_alive():
                worker.terminate()  # SIGTERM: a graceful stop
        for worker in processes.values():
            worker.join(SHUTDOWN_TIMEOUT + 5)
            if worker.is_alive():
                worker.kill()
                worker.join()
        for ours in processes:
            ours.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0 if failure is None else 1


def _supervise(
    processes: dict[Connection, BaseProcess],
    start_worker: Callable[[], Connection],
    stop: threading.Event,
    workers: int,
    name: str,
) -> str | None:
    """Replace each worker that dies until ``stop``; what ended the server early (a crash loop), or None."""
    born = {conn: time.monotonic() for conn in processes}
    young_deaths = 0  # in a row
    while not stop.is_set():
        if not wait([p.sentinel for p in processes.values()], timeout=0.2):  # short: to notice a signal
            continue
        for conn, process in list(processes.items()):
            if process.is_alive():
                continue
            process.join()
            conn.close()
            del processes[conn]
            young_deaths = young_deaths + 1 if time.monotonic() - born.pop(conn) < YOUNG_S else 0
            said = f"worker {process.pid} exited with status {process.exitcode}"
            if young_deaths > workers:
                return (
                    f"{said}: {young_deaths} workers in a row died within {YOUNG_S:g} s of starting, a crash loop; "
                    "look at the workers' errors above"
                )
            print(f"{name}: {said}; starting another", file=sys.stderr, flush=True)
            conn = start_worker()
            born[conn] = time.monotonic()
            failure = _await_workers({conn: processes[conn]}, stop)
            if failure is not None:
                return failure
    return None


def _await_workers(starting: dict[Connection, BaseProcess], stop: threading.Event) -> str | None:
    """Wait until each worker reports that it listens; what went wrong, or None."""
    while starting and not stop.is_set():
        for conn in wait(list(starting), timeout=0.2):  # short: to notice a signal
            assert isinstance(conn, Connection)
            try:
                error = conn.recv()
            except EOFError:  # it died before it could report
                process = starting[conn]
                process.join(1)
                return f"worker {process.pid} exited with status {process.exitcode} while starting"
            if error is not None:
                return f"a worker failed to start: {error}"
            del starting[conn]
    return None


def _worker(
    make_app: Callable[[], web.Application],
    host: str,
    port: int,
    shared: socket.socket | None,
    parent: Connection,
    keepalive_timeout: float,
) -> None:
    """A worker process of :func:`serve_workers`: build the application, serve the port until SIGTERM."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops the workers
    try:
        app = make_app()
    except Exception as e:
        parent.send(f"{type(e).__name__}: {e}")
        sys.exit(1)
    asyncio.run(_serve_worker(app, host, port, shared, parent, keepalive_timeout))


async def _serve_worker(
    app: web.Application,
    host: str,
    port: int,
    shared: socket.socket | None,
    parent: Connection,
    keepalive_timeout: float,
) -> None:
    runner = web.AppRunner(
        app, shutdown_timeout=SHUTDOWN_TIMEOUT, handle_signals=False, keepalive_timeout=keepalive_timeout
    )
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    try:
        if shared is None:
            await web.TCPSite(runner, host, port, backlog=BACKLOG, reuse_port=True).start()
        else:
            await web.SockSite(runner, shared, backlog=BACKLOG).start()
        parent.send(None)
        # The parent never writes: the pipe turns readable (end of file) only when the parent is gone.
        loop.add_reader(parent.fileno(), stop.set)
        await stop.wait()
        loop.remove_reader(parent.fileno())
    finally:
        await runner.cleanup()


class BackgroundServer:
    """An aiohttp application served from a daemon thread with its own event loop.

    ``start()`` returns once the server listens; :attr:`url` is its address. ``stop()`` (also
    run at interpreter exit) shuts it down gracefully. Used to serve the offline web inside the
    process of an environment. A connection idle for ``keepalive_timeout`` seconds is closed.
    """

    def __init__(
        self,
        make_app: Callable[[], web.Application],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        name: str = "server",
        keepalive_timeout: float = KEEPALIVE_TIMEOUT,
    ) -> None:
        self.make_app, self.host, self.port, self.name = make_app, host, port, name
        self.keepalive_timeout = keepalive_timeout
        self.url: str | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def start(self) -> str:
        """Start serving (once); returns the base URL ``http://127.0.0.1:PORT``."""
        with self._lock:
            if self.url is not None:
                return self.url
            ready = threading.Event()
            failure: list[BaseException] = []
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=self._serve, args=(ready, failure), daemon=True, name=f"agentenv-{self.name}"
            )
            self._thread.start()
            ready.wait()
            if failure:
                raise RuntimeError(f"could not start the {self.name} on {self.host}:{self.port}: {failure[0]}")
            atexit.register(self.stop)
            return self.url  # type: ignore[return-value]

    def _serve(self, ready: threading.Event, failure: list[BaseException]) -> None:
        loop = self._loop
        assert loop is not None
        asyncio.set_event_loop(loop)
        runner: web.AppRunner | None = None
        try:
            runner = web.AppRunner(
                self.make_app(),
                shutdown_timeout=SHUTDOWN_TIMEOUT,
                handle_signals=False,
                access_log=None,
                keepalive_timeout=self.keepalive_timeout,
            )
            loop.run_until_complete(runner.setup())
            loop.run_until_complete(web.TCPSite(runner, self.host, self.port).start())
        except BaseException as e:  # reported to start(), which raises it in the caller's thread
            failure.append(e)
            if runner is not None:
                loop.run_until_complete(runner.cleanup())
            loop.close()
            ready.set()
            return
        self._runner = runner
        self.url = f"http://{self.host}:{_bound_port(runner)}"
        ready.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())
        loop.close()

    def stop(self) -> None:
        """Stop serving and join the thread (calling it twice is allowed)."""
        with self._lock:
            if self._thread is None or self._loop is None:
                return
            if self._loop.is_running():
                self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=SHUTDOWN_TIMEOUT + 5)
            self._thread = self._loop = self._runner = None
            self.url = None
