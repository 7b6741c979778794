"""Tools: typed Python callables that the model can call.

A tool is a plain function (sync or async) or an object with state whose ``__call__`` is typed.
Its name, signature and docstring give the schema the model sees::

    @agentenv.tool
    def lookup(term: str, limit: int = 3) -> str:
        '''Look a term up in the glossary.

        Args:
            term: The word to look up.
            limit: How many senses to return.
        '''

Arguments are validated (and leniently coerced, "3" -> 3) with pydantic before the call; a
validation error becomes an observation for the model, never an exception out of ``step``.

An object tool keeps per-episode state. It is forked with the environment that owns it: by its
own ``fork()`` method when it has one, else by ``copy.deepcopy``; its ``reset()`` method, when
it has one, is called at the start of every episode. A tool whose state lives outside the process
(a server's) declares what its forks do with it in a ``fork_policy`` attribute: ``"share"`` (forks
see each other's effects) or ``"refuse"`` (its ``fork()`` raises); :func:`agentenv.testing.check_env`
reads it.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import docstring_parser
import pydantic

__all__ = ["Tool", "ToolError", "as_tool", "tool"]


class ToolError(Exception):
    """Raised by a tool to tell the model something went wrong (its message is the observation)."""


@dataclass(frozen=True)
class Tool:
    """A callable the model can invoke, with the JSON schema it is shown.

    Attributes:
        name: What the model calls it (also the XML tag: ``<name>…</name>``).
        description: The docstring's summary, shown to the model.
        parameters: JSON Schema (an ``object``) of the arguments.
        fn: The callable (a function, or an object with ``__call__`` for stateful tools).
        stateful: Whether ``fn`` holds per-episode state (forked and reset with its env).
        blocking: Run a sync ``fn`` in a worker thread so it cannot block the event loop
            (set it for sync tools doing I/O or long computations).
    """

    name: str
    description: str
    parameters: dict[str, Any]
    fn: Callable[..., Any]
    stateful: bool = False
    blocking: bool = False
    _model: type[pydantic.BaseModel] | None = field(repr=False, compare=False, default=None)

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI-style function schema: ``{"type": "function", "function": {...}}``."""
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

    @property
    def primary_parameter(self) -> str | None:
        """The parameter an XML tag's body fills (``<search>body</search>``): the first one."""
        return next(iter(self.parameters["properties"]), None)

    def validate(self, arguments: Mapping[str, Any]) -> dict[str, Any]:
        """Check and coerce arguments; raises :class:`ToolError` naming what is wrong.

        A tool built from a JSON schema alone (no model, as an MCP server's) passes them on as they
        are: its ``fn`` validates them.
        """
        if not isinstance(arguments, Mapping):
            raise ToolError(f"arguments of `{self.name}` must be a JSON object, got {type(arguments).__name__}")
        if self._model is None:
            return dict(arguments)
        try:
            model = self._model.model_validate(dict(arguments))
        except pydantic.ValidationError as e:
            problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or 'arguments'}: {err['msg']}" for err in e.errors())
            raise ToolError(f"invalid arguments for `{self.name}`: {problems}") from None
        return {name: getattr(model, name) for name in type(model).model_fields}

    async def acall(self, arguments: Mapping[str, Any]) -> str:
        """Validate the arguments, call the tool and return its result as text."""
        kwargs = self.validate(arguments)
        if self.blocking and not _is_async(self.fn):
            result = await asyncio.to_thread(self.fn, **kwargs)
        else:
            result = self.fn(**kwargs)
            if inspect.isawaitable(result):
                result = await result
        return result if isinstance(result, str) else json.dumps(result, ensure_ascii=False, default=str)

    def fork(self) -> Tool:
        """This tool for a forked episode: stateless tools are shared, stateful ones copied."""
        if not self.stateful:
            return self
        fork = getattr(self.fn, "fork", None)
        return replace(self, fn=fork() if callable(fork) else copy.deepcopy(self.fn))

    def reset(self) -> None:
        """Start of an episode: let a stateful tool clear its state."""
        reset = getattr(self.fn, "reset", None)
        if self.stateful and callable(reset):
            reset()


def _is_async(fn: Callable[..., Any]) -> bool:
    # A callable object is async when its __call__ is a coroutine function (fetched, not a callable() test).
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    blocking: bool = False,
) -> Any:
    """Make a :class:`Tool` from a typed function or a stateful callable object.

    Usable bare (``@tool``) or with options (``@tool(name="web_search", blocking=True)``).
    """
    if fn is None:
        return lambda f: tool(f, name=name, description=description, blocking=blocking)
    if isinstance(fn, Tool):
        return fn
    stateful = not (inspect.isfunction(fn) or inspect.ismethod(fn) or inspect.isbuiltin(fn))
    target = fn.__call__ if stateful else fn  # type: ignore[operator]  # mypy#5079: Callable.__call__ "not callable"
    if stateful and not callable(fn):
        raise TypeError(f"a tool must be a function or an object with __call__, got {fn!r}")
    doc = docstring_parser.parse(inspect.getdoc(target) or (inspect.getdoc(type(fn)) if stateful else "") or "")
    param_docs = {p.arg_name: p.description or "" for p in doc.params}
    tool_name = name or (type(fn).__name__ if stateful else fn.__name__)
    summary = description or " ".join(filter(None, [doc.short_description, doc.long_description])).strip()
    if not summary:
        raise TypeError(f"tool `{tool_name}` needs a docstring: it is the description the model sees")

    fields: dict[str, Any] = {}
    hints = _type_hints(target)
    for pname, param in inspect.signature(target).parameters.items():
        if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
            raise TypeError(f"tool `{tool_name}`: *args/**kwargs cannot be described to the model")
        if pname not in hints:
            raise TypeError(f"tool `{tool_name}`: parameter `{pname}` needs a type annotation")
        default = ... if param.default is param.empty else param.default
        fields[pname] = (hints[pname], pydantic.Field(default, description=param_docs.get(pname) or None))
    model = pydantic.create_model(f"{tool_name}_arguments", __config__=pydantic.ConfigDict(extra="forbid"), **fields)
    schema = model.model_json_schema()
    parameters = {
        "type": "object",
        "properties": {k: _strip_titles(v) for k, v in schema.get("properties", {}).items()},
        "required": schema.get("required", []),
    }
    return Tool(tool_name, summary, parameters, fn, stateful=stateful, blocking=blocking, _model=model)


def as_tool(obj: Tool | Callable[..., Any]) -> Tool:
    """A :class:`Tool` as is; a function or callable object through :func:`tool`."""
    return obj if isinstance(obj, Tool) else tool(obj)


def _type_hints(fn: Callable[..., Any]) -> dict[str, Any]:
    try:
        return typing.get_type_hints(fn)
    except Exception:  # unresolved forward references: fall back to raw annotations
        return dict(getattr(fn, "__annotations__", {}))


def _strip_titles(schema: dict[str, Any]) -> dict[str, Any]:
    # pydantic adds a "title" to every property; models are shown only name, type and description.
    return {k: v for k, v in schema.items() if k != "title"}
