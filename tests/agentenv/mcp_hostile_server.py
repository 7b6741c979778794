"""Hostile MCP servers for the tests of agentenv.mcp_client, written with the ``mcp`` SDK's low-level server.

``python mcp_hostile_server.py MODE TOKEN [NAME]`` serves over stdio; TOKEN is not read, it only marks
the process so that a test finds it (and only it) among the running ones. The modes:

- ``hang``: ``incr``/``get`` counters, ``hang`` (blocks the server's event loop, as a server still
  busy with a huge result does: no later call of the session is answered), ``spawn`` (starts a
  ``sleep`` child and returns its pid) and ``big`` (a result of ``n`` characters).
- ``answer``: a tool named ``answer`` (which an environment reserves) and ``spawn``; a ``sleep``
  child is started at start-up, so a test can see whether the server's whole group ends.
- ``endless``: ``tools/list`` never ends; page ``i`` holds the one tool ``tool_i``.
- ``empty-pages``: ``tools/list`` never ends and its pages hold no tools.
- ``slow-pages``: as ``empty-pages``, each page after half a second.
- ``flood``: a tool with a 100,000-character description, one whose input schema has 2,000
  properties, and an ordinary one.
- ``name``: one tool, named NAME.
- ``none``: no tools.
- ``random``: a listing drawn from the seed NAME: up to 300 tools over pages of random sizes, odd
  names among them, descriptions of up to 100,000 characters, schemas of up to 600 properties.
"""

from __future__ import annotations

import random
import subprocess
import sys
import time
from typing import Any

import anyio
import mcp.types as types
from mcp.server.lowlevel import Server
from mcp.server.stdio import stdio_server

MODE = sys.argv[1]
OBJECT: dict[str, Any] = {"type": "object", "properties": {}}
KEY = {"type": "object", "properties": {"key": {"type": "string"}}, "required": ["key"]}
counters: dict[str, int] = {}
children: list[subprocess.Popen[bytes]] = []  # kept, so that they are not reaped and stay in the group


def _tool(name: str, description: str = "A tool.", schema: dict[str, Any] | None = None) -> types.Tool:
    return types.Tool(name=name, description=description, input_schema=schema or OBJECT)


def _spawn() -> int:
    children.append(subprocess.Popen(["sleep", "600"]))
    return children[-1].pid


TOOLS = {
    "hang": [_tool("incr", schema=KEY), _tool("get", schema=KEY), _tool("hang"), _tool("spawn"), _tool("big")],
    "answer": [_tool("answer"), _tool("spawn")],
    "flood": [
        _tool("long", "x" * 100_000),
        _tool("wide", schema={"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(2000)}}),
        _tool("ok", "An ordinary tool."),
    ],
    "name": [_tool(sys.argv[3] if len(sys.argv) > 3 else "")],
    "none": [],
}


def _random_listing(seed: str) -> list[list[types.Tool]]:
    """Pages of tools for mode ``random``: writable names, but for one in some listings."""
    rng = random.Random(seed)
    count = rng.choice([0, 3, 40, 300])
    odd = rng.randrange(count) if count and rng.random() < 0.3 else None  # one listing in three names one badly
    tools = []
    for i in range(count):
        name = rng.choice(["", "a b", "<x>", "a/b", "é", "x" * 129]) if i == odd else f"t{i}"
        properties = {f"p{j}": {"type": "string"} for j in range(rng.choice([0, 3, 600]))}
        description = "d" * rng.choice([0, 10, 3000, 100_000])
        tools.append(_tool(name, description, {"type": "object", "properties": properties}))
    pages, start = [], 0
    while start < len(tools) or not pages:
        size = rng.choice([0, 1, 7, 100])
        pages.append(tools[start : start + size])
        start += size
    return pages


async def list_tools(ctx: Any, params: types.PaginatedRequestParams | None) -> types.ListToolsResult:
    page = int(params.cursor) if params is not None and params.cursor else 0
    if MODE == "endless":
        return types.ListToolsResult(tools=[_tool(f"tool_{page}")], next_cursor=str(page + 1))
    if MODE == "random":
        pages = _random_listing(sys.argv[3])
        return types.ListToolsResult(tools=pages[page], next_cursor=str(page + 1) if page + 1 < len(pages) else None)
    if MODE in ("empty-pages", "slow-pages"):
        if MODE == "slow-pages":
            await anyio.sleep(0.5)
        return types.ListToolsResult(tools=[], next_cursor=str(page + 1))
    return types.ListToolsResult(tools=TOOLS[MODE])


async def call_tool(ctx: Any, params: types.CallToolRequestParams) -> types.CallToolResult:
    arguments = params.arguments or {}
    if params.name == "incr":
        counters[arguments["key"]] = counters.get(arguments["key"], 0) + 1
    if params.name in ("incr", "get"):
        text = f"{arguments['key']}={counters.get(arguments['key'], 0)}"
    elif params.name == "hang":
        time.sleep(600)  # noqa: ASYNC251  # on the event loop: the server stops answering, as a wedged one does
        text = "woke"
    elif params.name == "spawn":
        text = str(_spawn())
    elif params.name == "big":
        text = "x" * int(arguments["n"])
    else:
        text = f"called {params.name}"
    return types.CallToolResult(content=[types.TextContent(type="text", text=text)])


async def main() -> None:
    if MODE == "answer":
        _spawn()
    server = Server("hostile", on_list_tools=list_tools, on_call_tool=call_tool)
    async with stdio_server() as (read_stream, write_stream):
        await server.run(read_stream, write_stream, server.create_initialization_options())


if __name__ == "__main__":
    anyio.run(main)
