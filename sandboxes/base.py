"""The contract every sandbox backend fulfils."""

from __future__ import annotations

import abc
import asyncio
import contextlib
import math
from collections.abc import Iterator
from types import TracebackType
from typing import TYPE_CHECKING

from sandboxes.limits import Limits
from sandboxes.result import Result


class SandboxError(RuntimeError):
    """The sandbox itself failed (could not start, was closed, lost its container); sandboxed
    code failing is never an exception, it is a ``Result``."""


class Sandbox(abc.ABC):
    """A stateful, isolated Python interpreter.

    * ``run(code)`` executes ``code`` in one persistent session: variables, imports and
      functions survive between calls. Errors, timeouts and limit kills come back in the
      ``Result``; after a kill the next call starts a fresh session and says so.
    * ``await arun(code)`` is the same without blocking the event loop.
    * ``fork()`` returns an independent sandbox whose session starts as an exact copy of this
      one; later calls on either never affect the other, and closing one never closes the other.
    * ``close()`` (or leaving a ``with`` block, or garbage collection) ends the sandbox: no
      process and no file of it survives. Calls on a closed sandbox raise ``SandboxError``.

    One call at a time per sandbox; use ``fork()`` for parallel branches.
    """

    if TYPE_CHECKING:  # read-only for callers; a backend stores it (DockerSandbox) or derives it (LocalSandbox)

        @property
        def limits(self) -> Limits:
            """The limits every call runs under."""

    _busy: bool = False  # a call is running (one at a time per sandbox)

    @abc.abstractmethod
    def run(self, code: str, timeout: float = 10.0) -> Result:
        """Execute ``code``; ``timeout`` is wall-clock seconds, after which the interpreter is
        killed (``Result.timed_out``)."""

    async def arun(self, code: str, timeout: float = 10.0) -> Result:
        """``run`` without blocking the event loop (this default uses a worker thread)."""
        return await asyncio.to_thread(self.run, code, timeout)

    @abc.abstractmethod
    def fork(self) -> Sandbox:
        """An independent copy of this sandbox, session state included."""

    @abc.abstractmethod
    def close(self) -> None:
        """Stop the interpreter and remove everything it left. Idempotent."""

    @property
    @abc.abstractmethod
    def closed(self) -> bool:
        """Whether ``close()`` was called."""

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def _check_call(self, code: str, timeout: float) -> None:
        """Reject bad arguments and calls on a closed sandbox with a clear message."""
        if self.closed:
            raise SandboxError(f"{type(self).__name__} is closed; create a new one or fork() an open one")
        if not isinstance(code, str):
            raise TypeError(f"code must be a str of Python source, got {type(code).__name__}")
        if (
            isinstance(timeout, bool)
            or not isinstance(timeout, (int, float))
            or not math.isfinite(timeout)
            or timeout <= 0
        ):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")

    @contextlib.contextmanager
    def _one_call(self) -> Iterator[None]:
        """Hold the sandbox for one call; a second concurrent call is refused, not interleaved."""
        if self._busy:
            raise SandboxError(
                "this sandbox is already running a call; run one call at a time "
                "per sandbox and fork() it for parallel branches"
            )
        self._busy = True
        try:
            yield
        finally:
            self._busy = False
