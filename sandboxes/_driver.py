"""Run one sandbox operation either blocking or on an asyncio event loop.

An operation is a generator that does its own non-blocking I/O and yields a ``Wait`` whenever
a socket is not ready; the driver answers True when it is, False when the deadline passed.
Writing each operation once as a generator keeps ``run`` and ``arun`` the same code.
"""

from __future__ import annotations

import asyncio
import dataclasses
import select
import time
from collections.abc import Generator
from typing import TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Wait:
    fd: int
    writable: bool  # wait until writable (else readable)
    deadline: float | None  # time.monotonic() value; None waits without end


Operation = Generator[Wait, bool, T]


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def drive(operation: Operation[T]) -> T:
    """Run ``operation`` to its end, blocking this thread while it waits."""
    try:
        wait = next(operation)
        while True:
            poller = select.poll()
            poller.register(wait.fd, select.POLLOUT if wait.writable else select.POLLIN)
            remaining = _remaining(wait.deadline)
            ready = bool(poller.poll(None if remaining is None else remaining * 1000))
            wait = operation.send(ready)
    except StopIteration as stop:
        return stop.value
    except BaseException:
        operation.close()
        raise


async def adrive(operation: Operation[T]) -> T:
    """Run ``operation`` to its end on the running event loop, never blocking it."""
    loop = asyncio.get_running_loop()
    try:
        wait = next(operation)
        while True:
            ready_future = loop.create_future()

            def wake(future: asyncio.Future = ready_future) -> None:
                if not future.done():
                    future.set_result(True)

            (loop.add_writer if wait.writable else loop.add_reader)(wait.fd, wake)
            try:
                await asyncio.wait_for(ready_future, _remaining(wait.deadline))
                ready = True
            except TimeoutError:
                ready = False
            finally:
                (loop.remove_writer if wait.writable else loop.remove_reader)(wait.fd)
            wait = operation.send(ready)
    except StopIteration as stop:
        return stop.value
    except BaseException:  # cancellation included: the operation cleans up its interpreter
        operation.close()
        raise
