"""Tools from MCP servers (Model Context Protocol): a server's tools as typed agentenv tools.

    tools = mcp_tools(MCPStdioServer("python", ["notes_server.py"]), fork="replay")
    env = agentenv.make("multihop-qa", tools=tools)

:func:`mcp_tools` connects to the server (the official ``mcp`` SDK's client, over stdio or
streamable HTTP), lists its tools and returns one :class:`~agentenv.tools.Tool` per server tool:
the server's name, description and input JSON schema (as ``parameters``; the server validates
the arguments). Calling it calls the server's tool, and the text of the result is the
observation. An error result, a lost connection (the server process exited), a timeout or a
server that cannot be reached raises :class:`~agentenv.tools.ToolError` naming the server, the
tool and what happened: the model reads it as the observation, and ``step`` never raises.

Sessions: the tools of one :func:`mcp_tools` call share one client session per episode, opened
at the first call (the listing's session serves the first episode), replaced at the next
episode once a call has used it, and closed by the environment's ``close()``. Sessions live on
one background event loop (a daemon thread), so the tools work from any caller: the sync
``step``, an async rollout loop, ``asyncio.run``. A new session starts from a fresh server state
only where the server keeps its state per session (a stdio server does: one process per session).

Forking: the server's state lives outside the environment, so the tools declare what a fork
does with it (``fork=``, required; also the tools' ``fork_policy``, which
:func:`agentenv.testing.check_env` reads):

- ``"replay"``: the fork opens its own session at its first call and first replays, in order,
  the calls this episode sent before the branch point. The branch then sees the server as the
  parent left it when the server keeps its state per session and answers the same calls the
  same way.
- ``"share"``: forks call the same session, so branches see each other's effects (a warning says
  so at the first fork). For read-only servers, or state meant to be shared.
- ``"refuse"``: ``fork()`` raises, naming the tool and these options.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import sys
import threading
import warnings
from collections.abc import Coroutine, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO, TypeVar, get_args

from agentenv.tools import Tool, ToolError

if TYPE_CHECKING:  # the SDK takes a second to import: it is loaded at the first connection
    from mcp import Client
    from mcp.types import CallToolResult, Implementation
    from mcp.types import Tool as ServerTool

__all__ = ["ForkPolicy", "MCPHttpServer", "MCPStdioServer", "mcp_tools"]

#: What forking an environment does with the server's session (see the module docstring).
ForkPolicy = Literal["replay", "share", "refuse"]

DEFAULT_TIMEOUT_S = 30.0  # per call
DEFAULT_CONNECT_TIMEOUT_S = 60.0  # a stdio server may first install itself (npx, uvx)

T = TypeVar("T")


@dataclass(frozen=True)
class MCPStdioServer:
    """An MCP server run as a subprocess, spoken to over its stdin and stdout (one process per session).

    Attributes:
        command: The executable (``"python"``, ``"npx"``, ``"uvx"``, a path).
        args: Its arguments.
        env: Environment variables, over the SDK's safe default (``HOME``, ``PATH``, …; not the
            whole environment).
        cwd: Its working directory (default: this process's).
        name: What observations call the server (default: the name it gives, else the command).
    """

    command: str
    args: Sequence[str] = ()
    env: Mapping[str, str] | None = None
    cwd: str | Path | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.args, str):
            raise TypeError(f"args is a sequence of arguments, got the string {self.args!r}: pass [{self.args!r}]")


@dataclass(frozen=True)
class MCPHttpServer:
    """An MCP server at a streamable-HTTP endpoint, such as ``http://127.0.0.1:8000/mcp``.

    Attributes:
        url: The endpoint.
        name: What observations call the server (default: the name it gives, else the URL).
    """

    url: str
    name: str | None = None


def mcp_tools(
    server: MCPStdioServer | MCPHttpServer | str,
    *,
    fork: ForkPolicy,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    connect_timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S,
) -> list[Tool]:
    """Connect to an MCP server and return its tools, as :class:`~agentenv.tools.Tool` objects.

    Give the tools of one call to one environment (its forks get theirs as ``fork`` says); call
    it again for another environment.

    Args:
        server: An :class:`MCPStdioServer`, an :class:`MCPHttpServer`, or the ``http(s)://`` URL
            of a streamable-HTTP endpoint.
        fork: ``"replay"``, ``"share"`` or ``"refuse"``: what forking the environment does with
            the server's session (see :mod:`agentenv.mcp_client`).
        timeout_s: Seconds a call may take; past them it is cancelled and the observation says so.
        connect_timeout_s: Seconds to start the server (stdio) or reach it (HTTP) and open a session.

    Raises:
        ConnectionError: The server could not be reached or could not list its tools.
    """
    if fork not in get_args(ForkPolicy):
        raise ValueError(f"fork must be one of {', '.join(map(repr, get_args(ForkPolicy)))}, got {fork!r}")
    if timeout_s <= 0 or connect_timeout_s <= 0:
        raise ValueError(f"timeouts must be > 0, got timeout_s={timeout_s!r}, connect_timeout_s={connect_timeout_s!r}")
    spec = MCPHttpServer(server) if isinstance(server, str) else server
    if isinstance(spec, MCPHttpServer) and not spec.url.startswith(("http://", "https://")):
        raise ValueError(f"an MCP server URL starts with http:// or https://, got {spec.url!r}")
    if not isinstance(spec, MCPStdioServer | MCPHttpServer):
        raise TypeError(f"server must be an MCPStdioServer, an MCPHttpServer or a URL, got {server!r}")

    group = _Server(spec, fork, timeout_s, connect_timeout_s)
    session = _Session(group)
    try:
        listed, info = _submit(session.list_tools()).result()
    except ToolError as e:
        session.release(wait=True)
        raise ConnectionError(str(e)) from None
    if spec.name is None and info is not None and info.name:
        group.label = info.name
    branch = _Branch(group, session)
    return [
        Tool(t.name, t.description or t.title or t.name, _parameters(t), _MCPCall(t.name, branch), stateful=True)
        for t in listed
    ]


def _parameters(server_tool: ServerTool) -> dict[str, Any]:
    # The server's schema as it is; Tool.primary_parameter and the XML parser read its "properties".
    schema = server_tool.input_schema
    return schema if "properties" in schema else {**schema, "properties": {}}


class _Server:
    """What the tools of one :func:`mcp_tools` call share: the server, its label, the timeouts, the fork policy."""

    def __init__(
        self, spec: MCPStdioServer | MCPHttpServer, fork: ForkPolicy, timeout_s: float, connect_timeout_s: float
    ) -> None:
        self.spec = spec
        self.fork = fork
        self.timeout_s = timeout_s
        self.connect_timeout_s = connect_timeout_s
        if isinstance(spec, MCPStdioServer):
            self.label = spec.name or " ".join([spec.command, *spec.args])
        else:
            self.label = spec.name or spec.url
        self.warned_share = False

    def client(self) -> Client:
        from mcp import Client, StdioServerParameters
        from mcp.client.stdio import stdio_client

        if isinstance(self.spec, MCPHttpServer):
            return Client(self.spec.url, read_timeout_seconds=self.timeout_s)
        params = StdioServerParameters(
            command=self.spec.command,
            args=list(self.spec.args),
            env=dict(self.spec.env) if self.spec.env is not None else None,
            cwd=self.spec.cwd,
        )
        # The SDK's default errlog is the sys.stderr of its import, which may be a stream without a
        # file descriptor (pytest's capture, some notebooks) that the subprocess cannot inherit.
        return Client(stdio_client(params, errlog=_server_stderr()), read_timeout_seconds=self.timeout_s)

    def error(self, tool: str | None, what: str) -> ToolError:
        where = f"MCP server `{self.label}`" + (f", tool `{tool}`" if tool else "")
        return ToolError(f"{where}: {what}")


def _server_stderr() -> TextIO:
    """Where a stdio server's stderr goes: this process's stderr, or the original one when the current
    stream has no file descriptor."""
    try:
        sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both OSError and ValueError
        return sys.__stderr__ or sys.stderr
    return sys.stderr


class _Session:
    """The server session of one episode (and of its forks, under ``fork="share"``), opened at its first call.

    Its coroutines run on the background loop; ``fork`` and ``release`` are called from the environment's side.
    """

    def __init__(self, server: _Server, calls: tuple[tuple[str, dict[str, Any]], ...] = (), lost: bool = False) -> None:
        self.server = server
        self.calls = calls  # under fork="replay": the calls sent this episode, in order, for forks to replay
        self.lost = lost  # the connection dropped (the server exited): no more calls this episode
        self.used = False  # a call was sent, so the server's state may have changed
        self.users = 1  # branches holding it (more than one only under fork="share")
        self._client: Client | None = None
        self._owner: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()
        self._opening = asyncio.Lock()

    @property
    def fresh(self) -> bool:
        """Nothing happened in it yet: a new episode can keep it."""
        return not (self.used or self.calls or self.lost) and self.users == 1

    def fork(self, tool: str) -> _Session:
        """The session a fork of the environment uses, as the fork policy says."""
        if self.server.fork == "refuse":
            raise RuntimeError(
                f"the MCP tool `{tool}` of server `{self.server.label}` was made with fork='refuse': the server's "
                "state cannot be copied, so this environment cannot be forked. Make the tools with "
                "mcp_tools(..., fork='replay') to give each fork its own session that replays the episode's "
                "calls, or fork='share' to let forks share one session."
            )
        if self.server.fork == "share":
            if not self.server.warned_share:
                self.server.warned_share = True
                warnings.warn(
                    f"the MCP tools of server `{self.server.label}` were made with fork='share': forks of the "
                    "environment share one server session, so branches see each other's effects",
                    stacklevel=2,
                )
            self.users += 1
            return self
        return _Session(self.server, self.calls, self.lost)

    def release(self, *, wait: bool) -> None:
        """A branch stops using the session; the last one closes it (``wait``: until the server is gone)."""
        self.users -= 1
        if self.users == 0:
            closing = _submit(self._aclose())
            if wait:
                closing.result()

    async def call(self, tool: str, arguments: dict[str, Any]) -> str:
        """Call ``tool`` with ``arguments``: the result's text, or :class:`ToolError` saying what went wrong."""
        if self.lost:
            raise self.server.error(
                tool,
                "not called: the connection to the server was lost earlier in this episode "
                "(it reconnects at the next episode)",
            )
        client = await self._connected(tool)
        if self.server.fork == "replay":
            self.calls = (*self.calls, (tool, arguments))  # before the call: even a failing one may change the state
        self.used = True
        result = await self._send(client, tool, arguments)
        text = _text(result)
        if result.is_error:
            raise self.server.error(tool, f"the tool reported an error: {text}")
        return text

    async def list_tools(self) -> tuple[list[ServerTool], Implementation | None]:
        """The server's tools (every page of the listing) and the name and version it gives."""
        client = await self._connected(None)
        tools: list[ServerTool] = []
        cursor: str | None = None
        try:
            while True:
                page = await client.list_tools(cursor=cursor)
                tools += page.tools
                cursor = page.next_cursor
                if cursor is None:
                    return tools, client.server_info
        except Exception as e:
            raise self.server.error(None, f"could not list the tools: {_describe(e)}") from None

    async def _connected(self, tool: str | None) -> Client:
        async with self._opening:  # one connection, even when forks sharing the session call at once
            if self._client is None:
                self._client = await self._connect(tool)
                for name, arguments in self.calls:  # a fork under "replay": rebuild the state at the branch point
                    try:
                        await self._send(self._client, name, arguments)
                    except ToolError:
                        if self.lost:
                            raise self.server.error(
                                tool,
                                f"the connection to the server was lost while replaying this episode's call of "
                                f"`{name}` for a fork (it reconnects at the next episode)",
                            ) from None
            return self._client

    async def _connect(self, tool: str | None) -> Client:
        ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
        self._owner = asyncio.create_task(self._own(ready))
        try:
            return await asyncio.wait_for(asyncio.shield(ready), self.server.connect_timeout_s)
        except TimeoutError:
            self._owner.cancel()
            raise self.server.error(
                tool, f"could not connect to the server within {self.server.connect_timeout_s:g} s"
            ) from None
        except asyncio.CancelledError:
            self._owner.cancel()  # the caller gave up: leave no session opening behind
            raise
        except Exception as e:  # the owner could not open it: no such command, refused connection, bad handshake
            raise self.server.error(tool, f"could not connect to the server: {_describe(e)}") from None

    async def _own(self, ready: asyncio.Future[Client]) -> None:
        # The SDK's transports are anyio task groups, which the task that enters them must exit: this task
        # holds the session open for the calls (each its own task) until it is closed.
        try:
            async with self.server.client() as client:
                ready.set_result(client)
                await self._stop.wait()
        except Exception as e:
            if not ready.done():
                ready.set_exception(e)
            # Otherwise the session failed while open (the calls report it) or while closing (it is over anyway).

    async def _send(self, client: Client, tool: str, arguments: dict[str, Any]) -> CallToolResult:
        from mcp import MCPError
        from mcp.types import CONNECTION_CLOSED, REQUEST_TIMEOUT

        if self._owner is None or self._owner.done():  # the transport failed since the last call
            raise self._lose(tool)
        try:
            return await client.call_tool(tool, arguments)
        except MCPError as e:
            if e.code == CONNECTION_CLOSED:
                raise self._lose(tool) from None
            if e.code == REQUEST_TIMEOUT:
                raise self.server.error(
                    tool, f"no answer within {self.server.timeout_s:g} s; the call was cancelled"
                ) from None
            raise self.server.error(tool, f"the server answered with error {e.code}: {e.message}") from None
        except Exception as e:
            raise self.server.error(tool, f"the call failed: {_describe(e)}") from None

    def _lose(self, tool: str) -> ToolError:
        self.lost = True
        self._stop.set()  # the owner shuts the transport down (and reaps the server's process)
        return self.server.error(
            tool,
            "the connection to the server was lost (the server process exited or closed the connection); "
            "its tools are unavailable until the next episode",
        )

    async def _aclose(self) -> None:
        self._stop.set()
        if self._owner is not None:
            await asyncio.wait([self._owner])  # the SDK bounds the shutdown (a stuck server is killed)
        self._client = self._owner = None


class _Branch:
    """The session an environment's tools of one server use: shared by those tools, forked with the environment."""

    def __init__(self, server: _Server, session: _Session) -> None:
        self.server = server
        self.session = session
        self._child: _Branch | None = None  # the fork being handed out to this environment's tools
        self._claimed: set[str] = set()  # the tools that took it

    def fork_for(self, tool: str) -> _Branch:
        """The branch of a fork of the environment, as one of its tools asks for it.

        The environment forks its tools one at a time, and the tools of one server must land on one
        branch: a tool that already took the current fork starts the next one.
        """
        if self._child is None or tool in self._claimed:
            self._child = _Branch(self.server, self.session.fork(tool))
            self._claimed = set()
        self._claimed.add(tool)
        return self._child

    def reset(self) -> None:
        """A new episode: a fresh session, unless the current one is still untouched."""
        if not self.session.fresh:
            self.session.release(wait=False)
            self.session = _Session(self.server)

    def close(self) -> None:
        self.session.release(wait=True)
        self.session = _Session(self.server)  # never opened: a second close() costs nothing


class _MCPCall:
    """The callable behind one MCP tool: calls it in the session of the environment's current episode."""

    def __init__(self, name: str, branch: _Branch) -> None:
        self.name = name  # the tool's name on the server
        self.branch = branch

    @property
    def fork_policy(self) -> ForkPolicy:
        """How forks treat the server's state (see :mod:`agentenv.mcp_client`)."""
        return self.branch.server.fork

    async def __call__(self, **arguments: Any) -> str:
        return await asyncio.wrap_future(_submit(self.branch.session.call(self.name, arguments)))

    def fork(self) -> _MCPCall:
        return _MCPCall(self.name, self.branch.fork_for(self.name))

    def reset(self) -> None:
        self.branch.reset()

    def close(self) -> None:
        self.branch.close()


def _text(result: CallToolResult) -> str:
    from mcp.types import EmbeddedResource, TextContent, TextResourceContents

    parts = []
    for block in result.content:
        if isinstance(block, TextContent):
            parts.append(block.text)
        elif isinstance(block, EmbeddedResource) and isinstance(block.resource, TextResourceContents):
            parts.append(block.resource.text)
        else:  # images, audio, links: the text model cannot read them, but it learns they came
            parts.append(f"[{block.type} content]")
    return "\n".join(parts)


def _describe(error: BaseException) -> str:
    while isinstance(error, BaseExceptionGroup) and len(error.exceptions) == 1:  # anyio wraps task failures
        error = error.exceptions[0]
    return f"{type(error).__name__}: {error}"


_loop: asyncio.AbstractEventLoop | None = None
_loop_lock = threading.Lock()


def _submit(coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
    """Run ``coro`` on the background loop of every MCP session (a daemon thread started at first use).

    One loop for all: a session must stay on the loop it was opened on, while the sync ``step`` runs
    each call as a new task and callers may drive one environment from several loops.
    """
    global _loop
    with _loop_lock:
        if _loop is None:
            _loop = asyncio.new_event_loop()
            threading.Thread(target=_loop.run_forever, name="agentenv-mcp", daemon=True).start()
    return asyncio.run_coroutine_threadsafe(coro, _loop)
