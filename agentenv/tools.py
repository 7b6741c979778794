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

A synchronous tool runs in a worker thread, so a slow or hung call never stalls the event loop
(and with it every other episode); several calls may run at once, so state shared between calls
must be thread-safe. An ``async def`` tool runs on the event loop and must not block it.
"""

from __future__ import annotations

import asyncio
import contextvars
import copy
import inspect
import json
import logging
import os
import queue
import re
import threading
import typing
import warnings
from collections.abc import Callable, Iterable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

import docstring_parser
import pydantic

__all__ = ["Tool", "ToolError", "as_tool", "check_tool_name", "close_tools", "tool"]

logger = logging.getLogger(__name__)

# Sync tool calls that run at once (more wait for a thread): above the rollout loop's default
# concurrency (64), so that calls wait only under far heavier loads. A call that its caller gave
# up on (an episode timeout, a cancelled run) stops counting: hung calls cannot starve the others.
_MAX_TOOL_THREADS = 256
_IDLE_SECONDS = 60.0  # an idle worker thread exits after this long

_Job = tuple[Future[Any], contextvars.Context, Callable[..., Any], dict[str, Any]]

# What a tool may be called: the model writes the name as a tag (<name>…</name>) or a JSON string, so
# no spaces, angle brackets or slashes; MCP's rule for tool names (1 to 128 of these characters).
_TOOL_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


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
        blocking: Deprecated, no effect: every sync ``fn`` runs in a worker thread.
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
        """Validate the arguments, call the tool and return its result as text.

        A sync ``fn`` runs in a worker thread (up to 256 calls at once, the rest wait their turn);
        when the caller is cancelled (an episode timeout), the call is abandoned: its thread
        finishes alone and no longer counts against those 256. An :class:`asyncio.CancelledError`
        that the tool itself raises (not a cancellation of the caller) is a failure of the tool:
        a :class:`ToolError`, whose message becomes the observation.
        """
        kwargs = self.validate(arguments)
        try:
            result = self.fn(**kwargs) if _is_async(self.fn) else await _THREADS.run(self.fn, kwargs)
            if inspect.isawaitable(result):
                result = await result
        except asyncio.CancelledError as error:
            task = asyncio.current_task()
            if task is None or task.cancelling():
                raise  # the caller is being cancelled: that must propagate
            # Left as it is, it would cancel the episode's task and, through it, the whole run.
            raise ToolError(f"the tool `{self.name}` failed: CancelledError: {error}") from error
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


class _ToolThreads:
    """Daemon worker threads for sync tool calls, at most ``size`` of them counted.

    A :class:`~concurrent.futures.ThreadPoolExecutor` (the loop's default executor is one) keeps
    a worker stuck in a hung call forever, and joins it at exit. Here a worker in a call whose
    caller gave up stops counting (a fresh one replaces it when calls are waiting) and exits
    when the call ends; workers are daemons, so a hung one does not hold the process at exit.
    The bookkeeping is the executor's: a call claims an idle worker or starts one, else waits.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._jobs: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._workers = 0  # live workers that count: not in an abandoned call
        self._idle = 0  # workers waiting for a job that no queued job has claimed
        self._backlog = 0  # queued jobs that found no idle worker and no room for a new one
        self._abandoned: set[Future[Any]] = set()  # running calls that nobody waits for any more

    async def run(self, fn: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        """``fn(**kwargs)`` in a worker thread (with the caller's context variables, as ``asyncio.to_thread``)."""
        future: Future[Any] = Future()
        with self._lock:
            if self._idle:
                self._idle -= 1
            elif self._workers < self.size:
                self._start_worker()  # raises RuntimeError when no thread can start (too many hung?)
            else:
                self._backlog += 1
        self._jobs.put((future, contextvars.copy_context(), fn, kwargs))
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._abandon(future, fn)
            raise

    def _abandon(self, future: Future[Any], fn: Callable[..., Any]) -> None:
        if future.cancel():  # still queued: it never runs
            return
        with self._lock:
            if future.done():  # it finished (or raised CancelledError itself): nothing to abandon
                return
            self._abandoned.add(future)
            self._workers -= 1
            if self._backlog:
                try:
                    self._start_worker()  # a replacement for the calls waiting
                    self._backlog -= 1
                except RuntimeError:  # they wait for a busy worker, or time out
                    logger.exception("no worker thread could replace an abandoned tool call")
        logger.warning(
            "a call of the tool %r was abandoned by its caller and runs on in its thread (%d abandoned now)",
            getattr(fn, "__name__", fn),
            len(self._abandoned),
        )

    def _start_worker(self) -> None:
        # Under the lock; the count changes only once start() has not raised.
        threading.Thread(target=self._work, name="agentenv-tool", daemon=True).start()
        self._workers += 1

    def _work(self) -> None:
        while True:
            try:
                job = self._jobs.get(timeout=_IDLE_SECONDS)
            except queue.Empty:
                with self._lock:
                    if self._idle:  # an idle slot nobody claimed: this worker may go
                        self._idle -= 1
                        self._workers -= 1
                        return
                continue  # every idle slot is claimed: a job is on its way
            abandoned = self._call(*job)
            del job  # an idle worker must not keep the last call's arguments and result alive
            if abandoned:
                return
            with self._lock:
                if self._backlog:
                    self._backlog -= 1  # take a waiting job next
                else:
                    self._idle += 1

    def _call(
        self, future: Future[Any], context: contextvars.Context, fn: Callable[..., Any], kwargs: dict[str, Any]
    ) -> bool:
        """Run one job; whether it was abandoned meanwhile (then this thread no longer counts and exits)."""
        if not future.set_running_or_notify_cancel():
            return False
        try:
            result = context.run(fn, **kwargs)
        except BaseException as error:  # delivered to the caller, as a ThreadPoolExecutor does
            future.set_exception(error)
        else:
            future.set_result(result)
        with self._lock:
            if future in self._abandoned:
                self._abandoned.discard(future)
                return True
        return False


_THREADS = _ToolThreads(_MAX_TOOL_THREADS)


def _fresh_threads_after_fork() -> None:
    global _THREADS
    _THREADS = _ToolThreads(_MAX_TOOL_THREADS)  # the parent's workers (and a held lock) are not in the child


os.register_at_fork(after_in_child=_fresh_threads_after_fork)


def _is_async(fn: Callable[..., Any]) -> bool:
    # A callable object is async when its __call__ is a coroutine function (fetched, not a callable() test).
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))  # noqa: B004


def tool(
    fn: Callable[..., Any] | None = None,
    *,
    name: str | None = None,
    description: str | None = None,
    blocking: bool | None = None,
) -> Any:
    """Make a :class:`Tool` from a typed function or a stateful callable object.

    Usable bare (``@tool``) or with options (``@tool(name="web_search")``). ``blocking`` is
    deprecated and has no effect: every sync tool runs in a worker thread.
    """
    if blocking is not None:
        warnings.warn(
            "tool(blocking=...) is deprecated and has no effect: every sync tool runs in a worker thread "
            "(an `async def` tool runs on the event loop)",
            DeprecationWarning,
            stacklevel=2,
        )
    if fn is None:
        return lambda f: _make_tool(f, name, description, bool(blocking))
    return _make_tool(fn, name, description, bool(blocking))


def _make_tool(fn: Callable[..., Any], name: str | None, description: str | None, blocking: bool) -> Tool:
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


def check_tool_name(name: str) -> None:
    """Raise ``ValueError``, naming ``name``, unless the model can write it: 1 to 128 ASCII letters, digits, ``_-.``."""
    if not isinstance(name, str) or not _TOOL_NAME.fullmatch(name):
        raise ValueError(
            f"tool name {name!r} is not valid: a tool name is 1 to 128 ASCII letters, digits, '_', '-' or '.' "
            "(the model writes it as a tag, <name>…</name>)"
        )


def close_tools(tools: Iterable[Tool | Callable[..., Any]]) -> None:
    """Close the stateful tools that have a ``close()`` (an environment's, when it closes or is never built)."""
    for t in tools:
        # A bare callable is stateful as tool() makes it: an object, not a function.
        fn, stateful = (
            (t.fn, t.stateful)
            if isinstance(t, Tool)
            else (t, not (inspect.isfunction(t) or inspect.ismethod(t) or inspect.isbuiltin(t)))
        )
        close = getattr(fn, "close", None)
        if stateful and callable(close):
            close()


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
