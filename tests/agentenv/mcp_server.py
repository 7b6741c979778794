"""A small MCP server for the tests of agentenv.mcp_client: counters, mixed content, a failing tool, a crash, a slow tool.

Run it over stdio (``python mcp_server.py``, one process per session, so each session has its own
counters) or over streamable HTTP (``python mcp_server.py http PORT``, on 127.0.0.1; the counters
are then shared by every session of the process).
"""

from __future__ import annotations

import os
import sys

import anyio
from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.mcpserver.utilities.types import Image
from mcp.types import EmbeddedResource, TextResourceContents

server = MCPServer("agentenv-test", log_level="WARNING")
counters: dict[str, int] = {}


@server.tool()
def incr(key: str, by: int = 1) -> str:
    """Add `by` to the counter `key` and return its new value."""
    counters[key] = counters.get(key, 0) + by
    return f"{key}={counters[key]}"


@server.tool()
def get(key: str) -> str:
    """The value of the counter `key` (0 if it was never incremented)."""
    return f"{key}={counters.get(key, 0)}"


@server.tool()
def media(key: str) -> list[str | Image | EmbeddedResource]:
    """The counter `key` as text, as a picture and as an embedded text resource."""
    note = TextResourceContents(uri=f"memo://{key}", text=f"note on {key}")
    return [
        f"{key}={counters.get(key, 0)}",
        Image(data=b"\x89PNG\r\n", format="png"),
        EmbeddedResource(type="resource", resource=note),
    ]


@server.tool()
def fail(reason: str) -> str:
    """Always fails, with `reason` as the error."""
    raise ToolError(f"refused: {reason}")


@server.tool()
def crash(code: int = 3) -> str:
    """Kill the server process with exit status `code`."""
    os._exit(code)


@server.tool()
async def sleep(seconds: float) -> str:
    """Wait `seconds` seconds, then answer."""
    await anyio.sleep(seconds)
    return f"slept {seconds}"


if __name__ == "__main__":
    if sys.argv[1:2] == ["http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))
    else:
        server.run()
