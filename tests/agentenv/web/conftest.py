"""Fixtures for the web tests: real aiohttp servers on 127.0.0.1, started and stopped by the tests."""

import socket

import pytest
from aiohttp import web


@pytest.fixture
async def serve():
    """``await serve(app)`` -> ``http://127.0.0.1:PORT``; every server is stopped after the test."""
    runners = []

    async def start(app: web.Application) -> str:
        runner = web.AppRunner(app, shutdown_timeout=0.2, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
def closed_port():
    """A port on 127.0.0.1 where nothing listens (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
