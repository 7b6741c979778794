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

What a server declares enters the prompt capped: at most ``max_tools`` tools (the listing stops
there), each description cut to ``max_description_chars`` and a tool whose input schema is over
``max_schema_chars`` (as JSON) left out, with one warning that says what was capped; a tool name
must be 1 to 128 ASCII letters, digits, ``_``, ``-`` or ``.`` (the model writes it as a tag), else
:func:`mcp_tools` raises ``ValueError`` naming it. Listing the tools has ``connect_timeout_s`` and
at most :data:`MAX_LIST_PAGES` pages, so that endless pagination fails instead of hanging.

Sessions: the tools of one :func:`mcp_tools` call share one client session per episode, opened
at the first call (the listing's session serves the first episode), replaced at the next
episode once a call has used it, and closed by the environment's ``close()`` (or by a ``make()``
that rejects the environment). A call that times out closes its session too: a server stuck on
one call (a huge result still arriving) would hold up every later call of the episode, so the next
call opens a new session, which under ``fork="replay"`` first replays the episode's earlier calls.
A stdio server runs in a process group of its own, killed whole when its session closes: no
process it started outlives the session, whether the server exited, crashed or hung. Sessions live on
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
import json
import os
import signal
import sys
import threading
import warnings
from collections.abc import AsyncIterator, Coroutine, Mapping, Sequence
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TextIO, TypeVar, get_args

from agentenv.tools import Tool, ToolError, check_tool_name

if TYPE_CHECKING:  # the SDK takes a second to import: it is loaded at the first connection
    from anyio.abc import ByteReceiveStream, ByteSendStream, Process
    from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
    from mcp import Client
    from mcp.client._transport import TransportStreams
    from mcp.shared.message import SessionMessage
    from mcp.types import CallToolResult
    from mcp.types import Tool as ServerTool

__all__ = ["ForkPolicy", "MCPHttpServer", "MCPStdioServer", "mcp_tools"]

#: What forking an environment does with the server's session (see the module docstring).
ForkPolicy = Literal["replay", "share", "refuse"]

DEFAULT_TIMEOUT_S = 30.0  # per call
DEFAULT_CONNECT_TIMEOUT_S = 60.0  # a stdio server may first install itself (npx, uvx); listing has as long again
#: Tools of one server in the prompt: the OpenAI API's own limit of functions per request. Unbounded,
#: a server's 10,000 tools made a 507 k-character prompt.
DEFAULT_MAX_TOOLS = 128
#: A tool's description in the prompt: about 500 tokens, room for a paragraph of use and the
#: arguments. Unbounded, one 10 MB description made a 10.5 M-character prompt.
DEFAULT_MAX_DESCRIPTION_CHARS = 2048
#: A tool's input schema in the prompt (as JSON): a dozen documented arguments with nested objects.
#: A tool over it is left out (a cut schema is no schema). With the two above, a server adds at most
#: 128 × (2,048 + 4,096) characters to the prompt.
DEFAULT_MAX_SCHEMA_CHARS = 4096
#: Pages of ``tools/list`` read before giving up. The listing stops once it has more than ``max_tools``
#: tools, so only pages with (almost) no tools reach this: a server whose next cursor never ends.
MAX_LIST_PAGES = 1000
#: Seconds a stdio server has to exit once its stdin is closed (the spec's shutdown) before its
#: process group is killed; a session closed after a timeout has its group killed at once.
SHUTDOWN_GRACE_S = 2.0

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
    max_tools: int = DEFAULT_MAX_TOOLS,
    max_description_chars: int = DEFAULT_MAX_DESCRIPTION_CHARS,
    max_schema_chars: int = DEFAULT_MAX_SCHEMA_CHARS,
) -> list[Tool]:
    """Connect to an MCP server and return its tools, as :class:`~agentenv.tools.Tool` objects.

    Give the tools of one call to one environment (its forks get theirs as ``fork`` says); call
    it again for another environment.

    Args:
        server: An :class:`MCPStdioServer`, an :class:`MCPHttpServer`, or the ``http(s)://`` URL
            of a streamable-HTTP endpoint.
        fork: ``"replay"``, ``"share"`` or ``"refuse"``: what forking the environment does with
            the server's session (see :mod:`agentenv.mcp_client`).
        timeout_s: Seconds a call may take; past them it is cancelled, its session closed (the next
            call opens a new one) and the observation says so.
        connect_timeout_s: Seconds to start the server (stdio) or reach it (HTTP) and open a
            session; listing its tools has as long again.
        max_tools: The server's first ``max_tools`` tools are used (default 128).
        max_description_chars: A longer description is cut to this many characters (default 2,048).
        max_schema_chars: A tool whose input schema, as JSON, is longer is left out (default 4,096).

    A capped listing warns once, saying what was capped.

    Raises:
        ConnectionError: The server could not be reached or could not list its tools (within
            ``connect_timeout_s``, in at most :data:`MAX_LIST_PAGES` pages).
        ValueError: The server declares a tool name that the model cannot write as a tag.
    """
    if fork not in get_args(ForkPolicy):
        raise ValueError(f"fork must be one of {', '.join(map(repr, get_args(ForkPolicy)))}, got {fork!r}")
    if timeout_s <= 0 or connect_timeout_s <= 0:
        raise ValueError(f"timeouts must be > 0, got timeout_s={timeout_s!r}, connect_timeout_s={connect_timeout_s!r}")
    if min(max_tools, max_description_chars, max_schema_chars) < 1:
        raise ValueError(
            f"the caps must be >= 1, got max_tools={max_tools!r}, max_description_chars={max_description_chars!r}, "
            f"max_schema_chars={max_schema_chars!r}"
        )
    spec = MCPHttpServer(server) if isinstance(server, str) else server
    if isinstance(spec, MCPHttpServer) and not spec.url.startswith(("http://", "https://")):
        raise ValueError(f"an MCP server URL starts with http:// or https://, got {spec.url!r}")
    if not isinstance(spec, MCPStdioServer | MCPHttpServer):
        raise TypeError(f"server must be an MCPStdioServer, an MCPHttpServer or a URL, got {server!r}")

    group = _Server(spec, fork, timeout_s, connect_timeout_s)
    session = _Session(group)
    try:
        listed = _submit(session.list_tools(max_tools)).result()
        shown = _for_prompt(listed, group.label, max_tools, max_description_chars, max_schema_chars)
    except ToolError as e:
        session.release(wait=True)  # the server's process group with it
        raise ConnectionError(str(e)) from None
    except ValueError:
        session.release(wait=True)
        raise
    if not shown:  # no tool will hold the session, so nothing would close it
        session.release(wait=True)
        return []
    branch = _Branch(group, session)
    return [
        Tool(name, description, parameters, _MCPCall(name, branch), stateful=True)
        for name, description, parameters in shown
    ]


def _for_prompt(
    listed: Sequence[ServerTool], label: str, max_tools: int, max_description_chars: int, max_schema_chars: int
) -> list[tuple[str, str, dict[str, Any]]]:
    """The name, description and parameters of each tool that enters the prompt, capped (one warning says how).

    Raises ``ValueError`` for a name the model cannot write as a tag.
    """
    capped: list[str] = []
    if len(listed) > max_tools:
        capped.append(f"it lists more than {max_tools} tools; the first {max_tools} are used (max_tools)")
    shown, cut, left_out = [], [], []
    for server_tool in listed[:max_tools]:
        try:
            check_tool_name(server_tool.name)
        except ValueError as e:
            raise ValueError(f"MCP server `{label}`: {e}") from None
        parameters = _parameters(server_tool)
        if len(json.dumps(parameters, ensure_ascii=False)) > max_schema_chars:
            left_out.append(f"`{server_tool.name}`")
            continue
        description = server_tool.description or server_tool.title or server_tool.name
        if len(description) > max_description_chars:
            cut.append(f"`{server_tool.name}`")
            description = description[: max_description_chars - 1] + "…"
        shown.append((server_tool.name, description, parameters))
    if cut:
        capped.append(
            f"the descriptions of {', '.join(cut)} are cut to {max_description_chars} characters (max_description_chars)"
        )
    if left_out:
        capped.append(
            f"{', '.join(left_out)} {'is' if len(left_out) == 1 else 'are'} left out: an input schema over "
            f"{max_schema_chars} characters (max_schema_chars)"
        )
    if capped:
        warnings.warn(
            f"MCP server `{label}`: what enters the prompt is capped: {'; '.join(capped)}. "
            "mcp_tools(max_tools=, max_description_chars=, max_schema_chars=) raise the caps",
            stacklevel=3,
        )
    return shown


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

    def client(self) -> tuple[Client, _StdioTransport | None]:
        """A new client of the server, and its stdio transport (``None`` over HTTP), to kill its process group."""
        from mcp import Client

        if isinstance(self.spec, MCPHttpServer):
            return Client(self.spec.url, read_timeout_seconds=self.timeout_s), None
        transport = _StdioTransport(self.spec)
        return Client(transport.open(), read_timeout_seconds=self.timeout_s), transport

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


class _StdioTransport:
    """The stdio transport of one session: the server in a process group of its own, killed whole at the end.

    The SDK's stdio transport kills the server's process tree only when the server outlives its
    grace period, so a server that exits (or crashed) leaves the processes it started running
    under PID 1; and it reads a line in time quadratic in its length (10 MB took 3.4 s, 60 MB 99 s).
    """

    def __init__(self, spec: MCPStdioServer) -> None:
        self.spec = spec
        self.pid: int | None = None  # the server's, and its process group's (a session leader's pid is its group's)

    @asynccontextmanager
    async def open(self) -> AsyncIterator[TransportStreams]:
        """Start the server and carry messages to and from it; on exit, end its whole process group."""
        import anyio
        from mcp.client.stdio import get_default_environment
        from mcp.shared.message import SessionMessage

        process = await anyio.open_process(
            [self.spec.command, *self.spec.args],
            env=get_default_environment() | dict(self.spec.env or {}),
            stderr=_server_stderr(),
            cwd=self.spec.cwd,
            start_new_session=True,
        )
        self.pid = process.pid
        assert process.stdin is not None and process.stdout is not None  # opened with pipes
        received, messages = anyio.create_memory_object_stream[SessionMessage | Exception](0)
        requests, to_send = anyio.create_memory_object_stream[SessionMessage](0)
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(_read_messages, process.stdout, received)
                tasks.start_soon(_write_messages, process.stdin, to_send, received)
                try:
                    yield messages, requests
                finally:
                    with anyio.CancelScope(shield=True):  # a cancelled caller must not leave the group alive
                        await self._stop(process)
                    tasks.cancel_scope.cancel()  # a process that left the group may still hold the pipes
        finally:
            for stream in (received, messages, requests, to_send):
                await stream.aclose()

    def kill(self) -> None:
        """Kill the server's process group: the server and every process it started that stayed in it."""
        if self.pid is not None:
            with suppress(ProcessLookupError, PermissionError):  # gone already; or a member we may not signal
                os.killpg(self.pid, signal.SIGKILL)

    async def _stop(self, process: Process) -> None:
        import anyio

        assert process.stdin is not None
        with suppress(OSError, anyio.BrokenResourceError, anyio.ClosedResourceError):
            await process.stdin.aclose()  # the spec's shutdown: stdin closed, then time to exit
        with anyio.move_on_after(SHUTDOWN_GRACE_S):
            # Polled: process.wait() also waits for the end of stdout, which a child holding the pipe delays.
            while process.returncode is None:  # noqa: ASYNC110
                await anyio.sleep(0.01)
        self.kill()  # the children too, whether the server exited by itself or not
        with anyio.move_on_after(SHUTDOWN_GRACE_S):  # a kill lands asynchronously: closed means gone
            while _group_alive(process.pid):  # noqa: ASYNC110  # no event tells when a group is empty
                await anyio.sleep(0.01)
        with anyio.move_on_after(SHUTDOWN_GRACE_S):  # reaped, pipes closed; bounded: a process may have left the group
            await process.aclose()


def _group_alive(pgid: int) -> bool:
    """Whether process group ``pgid`` has a member left (an unreaped one counts)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # a member we may not signal (it changed its user): one is there
        pass
    return True


async def _read_messages(
    stdout: ByteReceiveStream, received: MemoryObjectSendStream[SessionMessage | Exception]
) -> None:
    """Each line of the server's stdout as a message, in time linear in its length."""
    import anyio

    pending: list[bytes] = []  # the start of a line that is still arriving
    async with received:
        with suppress(anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):  # the session ended
            async for chunk in stdout:
                *lines, rest = chunk.split(b"\n")
                for line in lines:
                    message = b"".join([*pending, line])
                    pending = []
                    if message.strip():
                        await received.send(_message(message))
                if rest:
                    pending.append(rest)


def _message(line: bytes) -> SessionMessage | Exception:
    """A JSON-RPC message, or the error that the session reports for a line that is not one."""
    from mcp.shared.message import SessionMessage
    from mcp.types import jsonrpc_message_adapter

    try:
        return SessionMessage(jsonrpc_message_adapter.validate_json(line, by_name=False))
    except ValueError as e:
        return e


async def _write_messages(
    stdin: ByteSendStream,
    to_send: MemoryObjectReceiveStream[SessionMessage],
    received: MemoryObjectSendStream[SessionMessage | Exception],
) -> None:
    """The session's messages to the server's stdin, one JSON line each."""
    import anyio

    try:
        async with to_send:
            async for message in to_send:
                line = message.message.model_dump_json(by_alias=True, exclude_unset=True) + "\n"
                await stdin.send(line.encode())
    except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
        await received.aclose()  # the server stopped reading: the session sees the connection end


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
        self._owner: asyncio.Task[None] | None = None  # holds the connection open (see _own)
        self._transport: _StdioTransport | None = None
        self._stop = asyncio.Event()  # set: the owner closes the connection
        self._retired: set[asyncio.Task[None]] = set()  # owners of connections given up after a timeout
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
        call = (tool, arguments)
        if self.server.fork == "replay":
            self.calls = (*self.calls, call)  # before the call: even a failing one may change the state
        self.used = True
        try:
            result = await self._send(client, tool, arguments)
        except _NoAnswer as e:
            # Never answered: what it did is unknown, and replaying it would likely hang the next session too.
            self.calls = tuple(c for c in self.calls if c is not call)
            if not e.timed_out:
                raise self.server.error(
                    tool, "not answered: its session was closed after another call got no answer in time; call again"
                ) from None
            replayed = (
                f", which first replays the {len(self.calls)} earlier calls of this episode" if self.calls else ""
            )
            raise self.server.error(
                tool,
                f"no answer within {self.server.timeout_s:g} s; the call was cancelled and its session closed "
                f"(a server stuck on it would hold up every later call); the next call opens a new session{replayed}",
            ) from None
        text = _text(result)
        if result.is_error:
            raise self.server.error(tool, f"the tool reported an error: {text}")
        return text

    async def list_tools(self, max_tools: int) -> list[ServerTool]:
        """The server's tools: every page of the listing, or pages up to more than ``max_tools`` tools.

        The listing has ``connect_timeout_s`` and :data:`MAX_LIST_PAGES` pages, so that a server
        whose pagination never ends fails it (with memory bounded by the tools kept).
        """
        client = await self._connected(None)
        info = client.server_info
        if self.server.spec.name is None and info is not None and info.name:
            self.server.label = info.name  # what observations and errors call the server from now on
        tools: list[ServerTool] = []
        cursor: str | None = None
        try:
            async with asyncio.timeout(self.server.connect_timeout_s):
                for _ in range(MAX_LIST_PAGES):
                    page = await client.list_tools(cursor=cursor)
                    tools += page.tools
                    cursor = page.next_cursor
                    if cursor is None or len(tools) > max_tools:
                        return tools
        except TimeoutError:
            raise self.server.error(
                None, f"could not list the tools within {self.server.connect_timeout_s:g} s"
            ) from None
        except Exception as e:
            raise self.server.error(None, f"could not list the tools: {_describe(e)}") from None
        raise self.server.error(
            None,
            f"could not list the tools: the listing did not end within {MAX_LIST_PAGES} pages "
            f"(the server gives a next cursor every time; {len(tools)} tools so far)",
        )

    async def _connected(self, tool: str | None) -> Client:
        async with self._opening:  # one connection, even when forks sharing the session call at once
            if self._client is None:
                self._client = client = await self._connect(tool)
                for name, arguments in self.calls:  # rebuild the state: a fork, or a session after a timeout
                    try:
                        await self._send(client, name, arguments)
                    except _NoAnswer:
                        raise self.server.error(
                            tool,
                            f"not called: replaying this episode's call of `{name}` in a new session got no answer "
                            f"within {self.server.timeout_s:g} s, so that session was closed too (the next call "
                            "tries again)",
                        ) from None
                    except ToolError:
                        if self.lost:
                            raise self.server.error(
                                tool,
                                f"the connection to the server was lost while replaying this episode's call of "
                                f"`{name}` for a fork (it reconnects at the next episode)",
                            ) from None
            return self._client

    async def _connect(self, tool: str | None) -> Client:
        client, self._transport = self.server.client()
        ready: asyncio.Future[Client] = asyncio.get_running_loop().create_future()
        self._owner = asyncio.create_task(self._own(client, ready, self._stop))
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

    @staticmethod
    async def _own(client: Client, ready: asyncio.Future[Client], stop: asyncio.Event) -> None:
        # The SDK's transports are anyio task groups, which the task that enters them must exit: this task
        # holds the session open for the calls (each its own task) until it is closed.
        try:
            async with client:
                ready.set_result(client)
                await stop.wait()
        except Exception as e:
            if not ready.done():
                ready.set_exception(e)
            # Otherwise the session failed while open (the calls report it) or while closing (it is over anyway).

    async def _send(self, client: Client, tool: str, arguments: dict[str, Any]) -> CallToolResult:
        from mcp import MCPError
        from mcp.types import CONNECTION_CLOSED, REQUEST_TIMEOUT

        if client is not self._client:  # closed after another call's timeout, while this one waited
            raise _NoAnswer(timed_out=False)
        if self._owner is None or self._owner.done():  # the transport failed since the last call
            raise self._lose(tool)
        try:
            return await client.call_tool(tool, arguments)
        except MCPError as e:
            if e.code == REQUEST_TIMEOUT:
                self._retire()
                raise _NoAnswer(timed_out=True) from None
            if e.code == CONNECTION_CLOSED:
                if client is not self._client:  # closed by another call's timeout, not lost
                    raise _NoAnswer(timed_out=False) from None
                raise self._lose(tool) from None
            raise self.server.error(tool, f"the server answered with error {e.code}: {e.message}") from None
        except Exception as e:
            raise self.server.error(tool, f"the call failed: {_describe(e)}") from None

    def _retire(self) -> None:
        """Give the connection up (after a timeout): its server is killed, and the next call opens a new one."""
        if self._transport is not None:
            self._transport.kill()  # at once: it did not answer, and its state is given up anyway
        self._stop.set()
        if self._owner is not None:
            self._retired.add(self._owner)  # close() waits for it
            self._owner.add_done_callback(self._retired.discard)
        self._client = self._owner = self._transport = None
        self._stop = asyncio.Event()

    def _lose(self, tool: str) -> ToolError:
        self.lost = True
        self._stop.set()  # the owner shuts the transport down (and kills the server's process group)
        return self.server.error(
            tool,
            "the connection to the server was lost (the server process exited or closed the connection); "
            "its tools are unavailable until the next episode",
        )

    async def _aclose(self) -> None:
        self._stop.set()
        owners = {*self._retired} | ({self._owner} if self._owner is not None else set())
        if owners:
            await asyncio.wait(owners)  # each kills its server's process group (see _StdioTransport)
        self._client = self._owner = self._transport = None


class _NoAnswer(Exception):
    """A call got no answer: it timed out (its session was given up), or another call's timeout closed its session."""

    def __init__(self, *, timed_out: bool) -> None:
        super().__init__()
        self.timed_out = timed_out


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
