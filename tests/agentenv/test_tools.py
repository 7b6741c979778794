import asyncio
import contextvars
import multiprocessing
import threading
import time

import pytest

import agentenv.tools
from agentenv import ToolError, tool
from agentenv.tools import _ToolThreads


@tool
def lookup(term: str, limit: int = 3) -> str:
    """Look a term up in the glossary.

    Args:
        term: The word to look up.
        limit: How many senses to return.
    """
    return f"{term}:{limit}"


def test_schema_from_signature_and_docstring():
    assert lookup.name == "lookup"
    assert lookup.description == "Look a term up in the glossary."
    assert lookup.schema == {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a term up in the glossary.",
            "parameters": {
                "type": "object",
                "properties": {
                    "term": {"type": "string", "description": "The word to look up."},
                    "limit": {"type": "integer", "description": "How many senses to return.", "default": 3},
                },
                "required": ["term"],
            },
        },
    }
    assert lookup.primary_parameter == "term"
    assert lookup.stateful is False


async def test_call_validates_and_coerces():
    assert await lookup.acall({"term": "fork"}) == "fork:3"
    assert await lookup.acall({"term": "fork", "limit": "5"}) == "fork:5"  # lenient, as models write numbers
    with pytest.raises(ToolError, match=r"invalid arguments for `lookup`: term: Field required"):
        await lookup.acall({})
    with pytest.raises(ToolError, match=r"limit: Input should be a valid integer"):
        await lookup.acall({"term": "x", "limit": "many"})
    with pytest.raises(ToolError, match=r"bogus: Extra inputs are not permitted"):
        await lookup.acall({"term": "x", "bogus": 1})


async def test_async_function_tool_and_non_string_results():
    @tool
    async def add(a: int, b: int) -> dict:
        """Add two numbers."""
        await asyncio.sleep(0)
        return {"sum": a + b}

    assert await add.acall({"a": 2, "b": 3}) == '{"sum": 5}'


async def test_blocking_tool_runs_in_a_worker_thread():
    seen = []

    with pytest.warns(DeprecationWarning, match=r"blocking=\.\.\.\) is deprecated and has no effect"):

        @tool(blocking=True)
        def where() -> str:
            """Report the thread."""
            seen.append(threading.current_thread() is threading.main_thread())
            return "ok"

    assert await where.acall({}) == "ok"
    assert seen == [False] and where.blocking is True  # kept as given, for code that reads it


REQUEST = contextvars.ContextVar("REQUEST", default="none")


async def test_every_sync_tool_runs_in_a_tool_thread_with_the_callers_context():
    seen = []

    @tool
    def where() -> str:
        """Report the thread."""
        seen.append((threading.current_thread().name, REQUEST.get()))
        return "ok"

    REQUEST.set("episode-7")
    assert await where.acall({}) == "ok"
    assert seen == [("agentenv-tool", "episode-7")]  # not the loop's thread, nor its default executor


async def test_a_cancelled_error_raised_by_a_tool_is_a_tool_error():
    @tool
    def sync_fails() -> str:
        """Fail."""
        raise asyncio.CancelledError("its own")

    @tool
    async def async_fails() -> str:
        """Fail."""
        raise asyncio.CancelledError("its own")

    for failing in (sync_fails, async_fails):
        with pytest.raises(ToolError, match=rf"^the tool `{failing.name}` failed: CancelledError: its own$"):
            await failing.acall({})


async def test_cancelling_the_caller_of_a_tool_propagates_and_abandons_a_sync_call():
    started, release, finished = threading.Event(), threading.Event(), threading.Event()

    @tool
    def hangs() -> str:
        """Hang until released."""
        started.set()
        release.wait(10)
        finished.set()
        return "late"

    @tool
    async def async_hangs() -> str:
        """Hang."""
        started.set()
        await asyncio.Event().wait()
        return "never"

    try:
        for hanging in (hangs, async_hangs):
            started.clear()
            call = asyncio.create_task(hanging.acall({}))
            while not started.is_set():
                await asyncio.sleep(0.001)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):  # not a ToolError: the caller was cancelled
                await call
        assert not finished.is_set()  # the abandoned thread runs on, unwaited for
    finally:
        release.set()
    assert finished.wait(5)


async def test_abandoned_calls_stop_counting_against_the_tool_threads():
    threads = _ToolThreads(2)
    release, ran = threading.Event(), []

    def hang() -> str:
        release.wait(10)
        return "late"

    try:
        for _ in range(2):  # both threads hung, then abandoned: their callers time out
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(threads.run(hang, {}), 0.05)
        assert threads._workers == 0 and len(threads._abandoned) == 2
        assert await asyncio.wait_for(threads.run(lambda n: n + 1, {"n": 1}), 1) == 2  # a fresh worker

        blockers = [asyncio.create_task(threads.run(hang, {})) for _ in range(2)]  # both threads busy, awaited
        with pytest.raises(TimeoutError):  # so a call waits; its caller gives up: it never runs
            await asyncio.wait_for(threads.run(lambda: ran.append(1), {}), 0.1)
        waiting = asyncio.create_task(threads.run(lambda: "served", {}))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        blockers[0].cancel()  # abandoned: a fresh worker serves the waiting call while both threads hang
        assert await asyncio.wait_for(waiting, 1) == "served"
    finally:
        release.set()
    assert await blockers[1] == "late"
    for _ in range(100):
        if not threads._abandoned:
            break
        await asyncio.sleep(0.01)
    assert ran == [] and threads._abandoned == set() and threads._workers == 2


async def test_idle_tool_threads_exit(monkeypatch):
    monkeypatch.setattr(agentenv.tools, "_IDLE_SECONDS", 0.05)
    threads = _ToolThreads(4)
    await asyncio.gather(*(threads.run(lambda: time.sleep(0.05), {}) for _ in range(3)))
    assert threads._workers == 3
    for _ in range(100):
        if threads._workers == 0:
            break
        await asyncio.sleep(0.01)
    assert threads._workers == 0 and threads._idle == 0


class Counter:
    """Count up by a step; the count is per-episode state."""

    def __init__(self) -> None:
        self.n = 0

    def __call__(self, step: int = 1) -> str:
        """Add `step` to the counter and report it.

        Args:
            step: How much to add.
        """
        self.n += step
        return str(self.n)

    def reset(self) -> None:
        self.n = 0


async def test_stateful_object_tool_forks_and_resets():
    t = tool(Counter())
    assert (t.name, t.stateful, t.description) == ("Counter", True, "Add `step` to the counter and report it.")
    assert await t.acall({"step": 2}) == "2"
    child = t.fork()
    assert child.fn is not t.fn
    assert await child.acall({}) == "3"
    assert await t.acall({}) == "3"  # the parent did not see the child's call
    t.reset()
    assert await t.acall({}) == "1"
    assert lookup.fork() is lookup  # stateless tools are shared


def test_tool_definition_errors_are_clear():
    def undocumented(x: str) -> str:
        return x

    with pytest.raises(TypeError, match="needs a docstring"):
        tool(undocumented)

    def untyped(x):
        """Doc."""

    with pytest.raises(TypeError, match="parameter `x` needs a type annotation"):
        tool(untyped)

    def variadic(*args: str) -> str:
        """Doc."""

    with pytest.raises(TypeError, match=r"\*args/\*\*kwargs"):
        tool(variadic)


def test_tool_options_override_name_and_description():
    def f(term: str) -> str:
        return term

    named = tool(f, name="glossary", description="Glossary lookup.")
    assert (named.name, named.description, named.blocking) == ("glossary", "Glossary lookup.", False)
    assert tool(named) is named


def _call_in_child(t, conn) -> None:
    conn.send(asyncio.run(asyncio.wait_for(t.acall({"term": "fork"}), 5)))


async def test_sync_tools_work_in_a_forked_child():
    assert await lookup.acall({"term": "x"}) == "x:3"  # the parent has tool threads now, the child none
    parent, child = multiprocessing.Pipe()
    process = multiprocessing.get_context("fork").Process(target=_call_in_child, args=(lookup, child))
    process.start()
    assert parent.poll(10) and parent.recv() == "fork:3"
    process.join(5)
