import asyncio
import threading

import pytest

from agentenv import ToolError, tool


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

    @tool(blocking=True)
    def where() -> str:
        """Report the thread."""
        seen.append(threading.current_thread() is threading.main_thread())
        return "ok"

    assert await where.acall({}) == "ok"
    assert seen == [False]


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
