"""Progress of the long phases (model loading, rollouts, updates, held-out evaluation), on a terminal and in a log.

On a terminal (or in a notebook) a phase with counts is a tqdm bar with its rate and ETA. Written
to a file or a pipe, each phase prints plain lines instead: one when it starts, one at most every
``interval`` seconds while it runs (:data:`LINE_INTERVAL` by default), and one when it ends::

    rollout step 3: 0/352 leaves
    rollout step 3: 120/352 leaves after 00:29, 4.1 leaves/s, ETA 00:56
    rollout step 3: 352/352 leaves in 01:26, 4.1 leaves/s

A transient phase (``leave=False``: a step's rollout, its update) prints nothing until it has run
``interval`` seconds, then its lines as any other, so that a log holds one line a step (the step's
own note) and a heartbeat while a phase runs long, not three lines for every second-long update.

A phase without counts (loading a model) prints a line when it starts and one with its seconds
when it ends, wherever it writes (:func:`phase`).

``show`` decides whether anything is shown: ``False`` never; ``True`` and ``None`` (the default)
always, as a bar or as lines depending on the stream.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator, Mapping
from time import monotonic
from typing import Any, TextIO

from tqdm.auto import tqdm
from tqdm.autonotebook import tqdm as _chosen

__all__ = ["LINE_INTERVAL", "LogLines", "interactive", "note", "phase", "progress_bar", "transformers_bars"]

#: Seconds between two lines of a phase written to a file or a pipe.
LINE_INTERVAL = 30.0

#: The line streams' bars open now, innermost last (only that one prints between counts), and their lock.
_OPEN: list[LogLines] = []
_LOCK = threading.Lock()

#: Whether this is a notebook's kernel, where tqdm.auto draws a widget (whose output is no terminal).
_NOTEBOOK = _chosen.__module__ == "tqdm.notebook"


def interactive(file: TextIO) -> bool:
    """Whether ``file`` shows a redrawn bar: a terminal, or a notebook's output (tqdm.auto's widget)."""
    isatty = getattr(file, "isatty", None)
    return bool(isatty and isatty()) or (_NOTEBOOK and file in (sys.stdout, sys.stderr))


def progress_bar(
    desc: str,
    total: int | None = None,
    *,
    unit: str = "items",
    initial: int = 0,
    leave: bool = True,
    show: bool | None = None,
    file: TextIO | None = None,
    interval: float | None = None,
) -> tqdm | LogLines:
    """A progress bar of ``total`` ``unit`` (``None``: unknown) named ``desc``, advanced by ``update(n)``.

    Args:
        desc: What the phase is, e.g. ``"rollout step 3"``.
        total: How many units the phase has, or ``None``.
        unit: The units' name, plural (``"leaves"``).
        initial: Where the count starts (a resumed run's steps done).
        leave: Keep the terminal bar on screen once closed; on a line stream, ``False`` makes the phase
            transient: no line until it has run ``interval`` seconds (see the module docstring).
        show: ``False``: nothing; ``True`` or ``None``: a bar on a terminal, lines elsewhere.
        file: The stream (default ``sys.stderr`` at the call).
        interval: Seconds between lines on a stream that is no terminal (default :data:`LINE_INTERVAL`).

    Returns:
        A tqdm bar (disabled when ``show`` is ``False``) or :class:`LogLines`; both have
        ``update``, ``set_postfix``, ``close`` and work as context managers.
    """
    file = sys.stderr if file is None else file
    if show is False:
        return tqdm(disable=True)
    if interactive(file):
        return tqdm(total=total, desc=desc, unit=unit, initial=initial, leave=leave, file=file, dynamic_ncols=True)
    return LogLines(desc, total, unit=unit, initial=initial, leave=leave, file=file, interval=interval)


class LogLines:
    """A progress bar as plain lines, for a stream that is no terminal (see the module docstring).

    Not tqdm with another ``file``: tqdm redraws in place with carriage returns, and moves the
    cursor between nested bars, which a log file keeps as one line of escape codes. Between
    counts, the innermost phase open prints its line again every ``interval`` seconds (from a
    daemon thread), so that a log shows a long wait as one, not as silence: a batch of episodes
    may take minutes before the first ends. With ``leave=False`` the phase is transient: its first
    line waits until it has run ``interval`` seconds, and a phase that never printed prints no end.
    """

    def __init__(
        self,
        desc: str,
        total: int | None,
        *,
        unit: str = "items",
        initial: int = 0,
        leave: bool = True,
        file: TextIO | None = None,
        interval: float | None = None,
    ) -> None:
        self.desc, self.total, self.unit = desc, total, unit
        self.n = self.initial = initial
        self.file = sys.stderr if file is None else file
        self.interval = LINE_INTERVAL if interval is None else interval
        self.postfix: dict[str, Any] = {}
        self.closed = False
        self._stopped = threading.Event()
        # Whether the phase has a line in the log: a transient one only once it has run `interval` seconds.
        self.shown = leave or self.interval <= 0
        with _LOCK:
            _OPEN.append(self)
            self.start = self.printed = monotonic()
            if self.shown:
                self._write(self._line(self.start, first=True))
        if self.interval > 0:
            threading.Thread(target=self._beat, name=f"progress: {desc}", daemon=True).start()

    def update(self, n: int = 1) -> None:
        """Count ``n`` more units; print a line when ``interval`` seconds have passed since the last."""
        with _LOCK:
            if not self.closed:
                self.n += n
                self._due(monotonic())

    def set_postfix(self, ordered_dict: Mapping[str, Any] | None = None, refresh: bool = True, **kwargs: Any) -> None:
        """Numbers shown after the count (``name=value``), as tqdm's ``set_postfix``; they show at the next line."""
        self.postfix = {**(ordered_dict or {}), **kwargs}

    def close(self) -> None:
        """Print the final line: the count, the time the phase took and its rate."""
        with _LOCK:
            if self.closed:
                return
            self.closed = True
            _OPEN.remove(self)
            self._stopped.set()
            if self.shown:
                self._write(self._line(monotonic(), final=True))

    def _beat(self) -> None:
        while not self._stopped.wait(self.interval):
            with _LOCK:
                if not self.closed and _OPEN[-1] is self:
                    self._due(monotonic())

    def _due(self, now: float) -> None:
        if now - self.printed >= self.interval:
            self.printed = now
            self.shown = True
            self._write(self._line(now))

    def _line(self, now: float, first: bool = False, final: bool = False) -> str:
        """``desc: n/total unit[ after|in elapsed][, rate][, ETA …][, name=value …]`` at time ``now``."""
        elapsed = now - self.start
        count = f"{self.n}/{self.total}" if self.total is not None else f"{self.n}"
        head = f"{self.desc}: {count} {self.unit}"
        if not first:
            head += f" {'in' if final else 'after'} {tqdm.format_interval(elapsed)}"
        parts = [head]
        done = self.n - self.initial
        rate = done / elapsed if done > 0 and elapsed > 0 else None
        if rate is not None:
            # seconds per unit below one per second, as tqdm shows it ("s each": a plural unit reads badly after "s/")
            parts.append(f"{rate:.1f} {self.unit}/s" if rate >= 1 else f"{1 / rate:.1f} s each")
            if not final and self.total is not None:
                parts.append(f"ETA {tqdm.format_interval(max(0.0, self.total - self.n) / rate)}")
        parts += [f"{name}={value}" for name, value in self.postfix.items()]
        return ", ".join(parts)

    def _write(self, line: str) -> None:
        print(line, file=self.file, flush=True)

    def __enter__(self) -> LogLines:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def phase(desc: str, *, show: bool | None = None, file: TextIO | None = None) -> Iterator[None]:
    """A phase without counts: a line ``desc`` when it starts and ``desc: done in N s`` when it ends.

    Nothing is printed at the end of a phase that raised: the error says what happened.
    """
    file = sys.stderr if file is None else file
    if show is False:
        yield
        return
    print(desc, file=file, flush=True)
    start = monotonic()
    yield
    print(f"{desc}: done in {monotonic() - start:.1f} s", file=file, flush=True)


@contextlib.contextmanager
def transformers_bars(show: bool | None = None) -> Iterator[None]:
    """transformers' own bars (loading weights, writing shards) inside, where :func:`progress_bar` draws bars.

    On when ``show`` is not ``False`` and stderr is interactive; off otherwise, since their
    carriage returns make one garbled line of a log file.
    """
    from transformers.utils import logging

    off = logging.is_progress_bar_enabled() and (show is False or not interactive(sys.stderr))
    if off:
        logging.disable_progress_bar()
    try:
        yield
    finally:
        if off:
            logging.enable_progress_bar()


def note(line: str) -> None:
    """Print ``line`` on stdout above the terminal's bars (tqdm.write), flushed: in a log file that
    also holds stderr, the notes and the progress lines then stay in the order they happened."""
    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()
