"""What one call of sandboxed code produced."""

from __future__ import annotations

import dataclasses
from typing import Literal

from sandboxes.limits import Limits, human_bytes

KilledBy = Literal["timeout", "cpu", "file_size", "memory", "exit", "signal", "protocol", "sandbox"]
"""Why the interpreter was killed: ``timeout`` (wall clock), ``cpu`` (CPU seconds),
``file_size`` (RLIMIT_FSIZE), ``memory`` (the container's memory limit, or a local sandbox's
cgroup limit on it and its forks together; in-process allocation failures are ordinary
``MemoryError`` errors instead), ``exit`` (the code ended the process, e.g.
``os._exit``), ``signal`` (another signal, e.g. a segfault), ``protocol`` (the interpreter broke
the sandbox protocol, e.g. code overwrote the worker) or ``sandbox`` (the whole container died)."""


@dataclasses.dataclass(frozen=True)
class Result:
    """The outcome of ``Sandbox.run``. Texts are capped at ``Limits.output_bytes`` each."""

    stdout: str = ""
    stderr: str = ""
    value: str | None = None  # repr() of the trailing expression, as the Python REPL prints it
    error: str | None = None  # the exception, traceback trimmed to the user's code
    error_type: str | None = None  # e.g. "ZeroDivisionError"
    timed_out: bool = False
    killed_by: KilledBy | None = None  # set when the interpreter died; its state is then lost
    wall_time: float = 0.0  # seconds from sending the code to receiving the result
    truncated: bool = False  # some output was cut at Limits.output_bytes
    state_lost: bool = False  # this call ran in a fresh interpreter: earlier state is gone
    notes: tuple[str, ...] = ()  # sentences for the model: limits hit, restarts

    @property
    def ok(self) -> bool:
        """The code ran to its end without an exception."""
        return self.error is None and self.killed_by is None

    def render(self) -> str:
        """The tool observation an LLM sees: output, value, error, then the sandbox's notes."""
        parts = [text.rstrip("\n") for text in (self.stdout, self.stderr) if text]
        if self.value is not None:
            parts.append(self.value)
        if self.error:
            parts.append(self.error.rstrip("\n"))
        parts.extend(f"[{note}]" for note in self.notes)
        return "\n".join(parts) if parts else "[no output]"


_size = human_bytes


STATE_LOST_NOTE = "the Python session was restarted before this call: earlier variables, imports and functions are gone"


def killed_by_exit_code(code: int | None) -> KilledBy:
    """Classify how an interpreter ended: an exit code, or minus the signal that killed it."""
    import signal

    if code is None:
        return "sandbox"
    if code >= 0:
        return "exit"
    by_signal: dict[int, KilledBy] = {-signal.SIGXCPU: "cpu", -signal.SIGXFSZ: "file_size"}
    return by_signal.get(code, "signal")


def _kill_note(
    killed_by: KilledBy, limits: Limits, timeout: float, exit_code: int | None, total_memory: bool = False
) -> str:
    """The sentence that tells the model why its interpreter died."""
    lost = "; the Python session was lost"
    if killed_by == "timeout":
        return f"killed: the call exceeded its wall-clock timeout of {timeout:g} s{lost}"
    if killed_by == "cpu":
        return f"killed: the call used more than {limits.cpu_for(timeout):g} CPU seconds{lost}"
    if killed_by == "file_size":
        return f"killed: a file grew beyond the limit of {_size(limits.file_size_bytes)}{lost}"
    if killed_by == "memory" and total_memory:
        return (
            f"killed: the sandbox's processes together exceeded their memory limit of "
            f"{_size(limits.total_memory_bytes)}{lost}"
        )
    if killed_by == "memory":
        return f"killed: the sandbox exceeded its memory limit of {_size(limits.memory_bytes)}{lost}"
    if killed_by == "exit":
        return f"the Python process exited with status {exit_code}{lost}"
    if killed_by == "signal":
        import signal

        name = signal.Signals(-exit_code).name if exit_code and exit_code < 0 else "a signal"
        return f"the Python process was killed by {name}{lost}"
    if killed_by == "protocol":
        return f"the Python process broke the sandbox protocol and was stopped{lost}"
    return f"the sandbox stopped{lost}"


def killed_result(
    killed_by: KilledBy,
    *,
    limits: Limits,
    timeout: float,
    wall_time: float,
    state_lost: bool,
    exit_code: int | None = None,
    total_memory: bool = False,
) -> Result:
    """The result of a call whose interpreter died. ``total_memory``: a "memory" kill was for
    the limit on all of a local sandbox's processes together (``Limits.total_memory_bytes``)."""
    notes = (STATE_LOST_NOTE,) if state_lost else ()
    return Result(
        timed_out=killed_by == "timeout",
        killed_by=killed_by,
        wall_time=wall_time,
        state_lost=state_lost,
        notes=notes + (_kill_note(killed_by, limits, timeout, exit_code, total_memory),),
    )


def _text(reply: dict, key: str, limit: int) -> str | None:
    value = reply.get(key)  # the reply comes from sandboxed code: trust no type and no size
    return value[:limit] if isinstance(value, str) else None


def result_from_reply(reply: dict, *, limits: Limits, wall_time: float, state_lost: bool, oom_kills: int = 0) -> Result:
    """The result of a call that finished, from the interpreter's reply. ``oom_kills``: processes
    the kernel killed during the call for the sandbox's total memory limit."""
    cap = limits.output_bytes
    error_type = _text(reply, "error_type", 200)
    truncated = reply.get("truncated") is True
    notes = [STATE_LOST_NOTE] if state_lost else []
    if error_type == "MemoryError":
        notes.append(f"memory limit: {_size(limits.memory_bytes)} of address space")
    if oom_kills:
        notes.append(
            f"memory limit: the sandbox's processes together exceeded {_size(limits.total_memory_bytes)}; "
            f"the kernel killed {oom_kills} of them"
        )
    if truncated:
        notes.append(f"output truncated to {_size(cap)}")
    return Result(
        stdout=_text(reply, "stdout", cap) or "",
        stderr=_text(reply, "stderr", cap) or "",
        value=_text(reply, "value", cap),
        error=_text(reply, "error", cap),
        error_type=error_type,
        wall_time=wall_time,
        truncated=truncated,
        state_lost=state_lost,
        notes=tuple(notes),
    )
