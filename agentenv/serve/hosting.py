"""Running an aiohttp application: in the foreground until a signal, or on a background thread.

Both bind 127.0.0.1 by default and accept ``port=0`` (a free port, reported back), so tests and
environments never collide on a fixed port.
"""

from __future__ import annotations

import asyncio
import atexit
import signal
import sys
import threading
from collections.abc import Callable

from aiohttp import web

__all__ = ["BackgroundServer", "run_until_signal"]

SHUTDOWN_TIMEOUT = 5.0  # seconds that requests in flight get to finish when the server stops


def _bound_port(runner: web.AppRunner) -> int:
    return runner.addresses[0][1]


async def run_until_signal(
    app: web.Application, *, host: str = "127.0.0.1", port: int = 0, name: str = "server"
) -> None:
    """Serve ``app`` until SIGINT or SIGTERM, then stop gracefully (requests in flight finish).

    Prints ``Serving <name> on http://HOST:PORT`` once listening (the real port when ``port=0``).
    """
    runner = web.AppRunner(app, shutdown_timeout=SHUTDOWN_TIMEOUT, handle_signals=False)
    await runner.setup()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await web.TCPSite(runner, host, port).start()
        print(f"Serving {name} on http://{host}:{_bound_port(runner)} (Ctrl-C to stop)", flush=True)
        await stop.wait()
        print(f"Stopping {name}: finishing requests in flight", file=sys.stderr, flush=True)
    finally:
        await runner.cleanup()


class BackgroundServer:
    """An aiohttp application served from a daemon thread with its own event loop.

    ``start()`` returns once the server listens; :attr:`url` is its address. ``stop()`` (also
    run at interpreter exit) shuts it down gracefully. Used to serve the offline web inside the
    process of an environment.
    """

    def __init__(
        self, make_app: Callable[[], web.Application], *, host: str = "127.0.0.1", port: int = 0, name: str = "server"
    ) -> None:
        self.make_app, self.host, self.port, self.name = make_app, host, port, name
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
                self.make_app(), shutdown_timeout=SHUTDOWN_TIMEOUT, handle_signals=False, access_log=None
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
