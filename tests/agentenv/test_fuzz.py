"""Fuzzing ``step`` with hostile model output: every registered id, both parsers; and the
retrieval server with hostile requests.

A model can write anything. Whatever it writes, ``step`` returns an observation (never raises)
and returns it quickly (under a second), so one episode can never stall the others on the event
loop. The actions are seeded, so a failure reproduces: the assertion message carries the seed,
the env id and the action's shape. A client can send anything too: the retrieval server answers
every request with 200 or an error that says why, and keeps serving.
"""

from __future__ import annotations

import asyncio
import json
import random
import time

import aiohttp
import msgpack
import pytest

import agentenv
from agentenv.datasets import union_corpus
from agentenv.serve.hosting import BackgroundServer
from agentenv.serve.retrieval import RetrievalService

SEED = 15
ACTIONS_PER_ENV = 55  # × 21 ids × 2 parsers ≈ 2,300 actions
STEP_BUDGET_S = 1.0
PALETTE = "<>/{}[]\"'\\:,=!?$^_ \n\t\x00abcxyz0123456789é中🙂"
TAGS = ("think", "answer", "tool_call", "result", "information", "search", "python", "browse", "boxed")


def _text(rng: random.Random, n: int) -> str:
    return "".join(rng.choice(PALETTE) for _ in range(n))


def _nested_json(depth: int) -> str:
    return "[" * depth + "1" + "]" * depth


def _json_value(rng: random.Random) -> str:
    """Valid and invalid JSON: deep nesting, giant numbers, odd literals, wrong types."""
    return rng.choice(
        [
            lambda: json.dumps(_text(rng, rng.randint(0, 40))),
            lambda: _nested_json(rng.choice([10, 1_000, 5_000, 100_000])),
            lambda: "9" * rng.choice([10, 4_301, 50_000]),
            lambda: "-" + "1" * 5_000 + ".5e99999",
            lambda: rng.choice(["NaN", "Infinity", "-Infinity", "null", "true", "1e400"]),
            lambda: '{"a": 1, "a": 2}',
            lambda: "{" * rng.randint(1, 2_000),
            lambda: '{"x": "' + "\\u" * rng.randint(1, 50) + '"}',
            lambda: _text(rng, rng.randint(1, 60)),
        ]
    )()


def _call(rng: random.Random, env: agentenv.ToolEnv, name: str, argument: str) -> str:
    if env.parser.name == "json":
        body = rng.choice(
            [
                lambda: json.dumps({"name": name, "arguments": {"query": argument, "code": argument, "url": argument}}),
                lambda: '{"name": "' + name + '", "arguments": ' + _json_value(rng) + "}",
                lambda: '{"name": ' + _json_value(rng) + ', "arguments": {}}',
                lambda: _json_value(rng),
            ]
        )()
        return f"<tool_call>{body}</tool_call>"
    if rng.random() < 0.3:
        argument = '{"url": ' + _json_value(rng) + ', "query": ' + _json_value(rng) + "}"
    return f"<{name}>{argument}</{name}>"


def _argument(rng: random.Random, name: str) -> str:
    if name == "browse":  # never the network: refused addresses, bad schemes, names that cannot resolve
        return rng.choice(
            [
                "http://127.0.0.1:1/",
                "http://[::127.0.0.1]/",
                "http://[::ffff:0:10.0.0.1]/",
                "http://[64:ff9b::7f00:1]/",
                "http://[2002:7f00:1::]/",
                "http://0x7f.1/",
                "http://169.254.169.254/latest/meta-data/",
                "file:///etc/passwd",
                "javascript:alert(1)",
                "ftp://fuzz.invalid/",
                "http://",
                "http://fuzz.invalid/" + _text(rng, 20),
                _text(rng, rng.randint(0, 80)),
            ]
        )
    if name == "python":
        return rng.choice(
            ["print(1)", "1/0", "def f(:", "import sys; print(sys.argv)", "x = '" + "a" * 10_000 + "'", _text(rng, 50)]
        )
    return _text(rng, rng.randint(0, 200))


def _answer(rng: random.Random) -> str:
    inner = rng.choice(
        [
            "\\boxed{42}",
            "\\boxed{9^{9^{9^{9}}}}",
            "\\boxed{" * rng.randint(1, 3_000),
            "\\boxed{" + "1" * 5_000 + "}",
            "\\boxed{\\frac{1}{" + "(" * 500 + "}",
            "\\boxed{100000!}",
            _text(rng, rng.randint(0, 300)),
        ]
    )
    return f"<answer>{inner}</answer>"


def _action(rng: random.Random, env: agentenv.ToolEnv) -> tuple[str, str]:
    """One hostile action and a short name of its shape (for the failure message)."""
    names = [*env.tools, "no_such_tool"]
    shape = rng.choice(["call", "call", "answer", "repeated", "nested", "mixed", "noise", "huge"])
    if shape == "call":
        name = rng.choice(names)
        action = _call(rng, env, name, _argument(rng, name))
    elif shape == "answer":
        action = _answer(rng)
    elif shape == "repeated":  # quadratic for a backtracking tag parser
        tag = rng.choice([*TAGS, *env.tools])
        action = rng.choice([f"<{tag}>", f"</{tag}>", f"<{tag}><{tag}>x</{tag}>"]) * rng.randint(1_000, 30_000)
    elif shape == "nested":
        tag = rng.choice([*TAGS, *env.tools])
        depth = rng.randint(10, 5_000)
        action = f"<{tag}>" * depth + _text(rng, 10) + f"</{tag}>" * rng.randint(0, depth)
    elif shape == "mixed":
        parts = [
            rng.choice([f"<{t}>", f"</{t}>", _text(rng, 5), _json_value(rng)[:200]]) for t in rng.choices(TAGS, k=200)
        ]
        action = "".join(parts)
    elif shape == "noise":
        action = _text(rng, rng.randint(0, 2_000))
    else:  # one megabyte of one of the shapes above
        unit = rng.choice(["<search>", "<think>", "</answer>", "<tool_call>{", "a<b>c</d>", _text(rng, 7)])
        action = (unit * (1_000_000 // len(unit) + 1))[:1_000_000]
    return action, shape


def _reset(env: agentenv.ToolEnv, seed: int) -> None:
    """Reset, and let the episode's Python sandbox finish starting (~0.9 s cold, as
    benchmarks.sandbox_bench measures): in a rollout it starts while the model writes its first
    turn, and its start-up is not the handling of an action that this test times."""
    env.reset(seed=seed)
    python = env.tools.get("python")
    if python is not None:
        python.fn.sandbox.run("pass")


def _fuzz(env_id: str, parser: str, seed: int) -> None:
    rng = random.Random(f"{seed}-{env_id}-{parser}")
    env = agentenv.make(env_id, parser=parser)
    try:
        _reset(env, seed)
        for i in range(ACTIONS_PER_ENV):
            action, shape = _action(rng, env)
            where = (
                f"{env_id} parser={parser} seed={seed} action #{i} ({shape}, {len(action):,} chars: {action[:80]!r})"
            )
            start = time.perf_counter()
            try:
                observation, reward, terminated, truncated, info = env.step(action)
            except Exception as e:
                pytest.fail(f"step raised {type(e).__name__}: {e} on {where}")
            elapsed = time.perf_counter() - start
            assert elapsed < STEP_BUDGET_S, f"step took {elapsed:.2f} s on {where}"
            assert isinstance(observation, str) and isinstance(reward, float), where
            if terminated or truncated:
                _reset(env, seed + i)
    finally:
        env.close()


@pytest.mark.parametrize("parser", ["xml", "json"])
@pytest.mark.parametrize("env_id", sorted(agentenv.registry))
def test_step_never_raises_or_stalls_on_hostile_actions(env_id, parser):
    _fuzz(env_id, parser, SEED)


# -- the retrieval server, fed hostile requests ------------------------------------------------

SERVER_REQUESTS = 150


def _hostile_body(rng: random.Random) -> tuple[bytes, str, str]:
    """``(body, content type, shape)``: bodies that cannot be decoded, and decoded ones over the limits."""
    queries = [_text(rng, rng.randint(0, 40)) for _ in range(rng.randint(1, 40))]
    payload = rng.choice(
        [
            lambda: {"queries": queries, "topk": rng.choice([0, 3, 100, 101, 10**9, -1, "9" * 5_000, 2.5, None])},
            lambda: {"queries": ["capital city " * rng.choice([1, 341, 342, 2_000])], "topk": 3},
            lambda: {"queries": ["the city"] * rng.choice([102, 103, 1_024, 1_025]), "topk": 100},
            lambda: {"query": _text(rng, 30), "return_scores": rng.choice([True, "maybe", 2, [1]])},
            lambda: {"queries": rng.choice([[], "x", [1], [[]], {"a": 1}, None])},
        ]
    )()
    shape = rng.choice(["json", "msgpack", "json-text", "deep-msgpack", "bytes"])
    if shape == "json":
        return json.dumps(payload).encode(), "application/json", shape
    if shape == "msgpack":
        return msgpack.packb(payload), "application/msgpack", shape
    if shape == "json-text":  # deep nesting, giant numbers, odd literals, bad text
        return _json_value(rng).encode("utf-8", "surrogatepass"), "application/json", shape
    if shape == "deep-msgpack":
        return b"\x91" * rng.choice([100, 10_000, 100_000]) + b"\x01", "application/msgpack", shape
    return rng.randbytes(rng.randint(0, 64)), rng.choice(["application/json", "application/msgpack"]), shape


def test_the_retrieval_server_answers_hostile_requests(tmp_path, monkeypatch):
    """Every request gets 200, 400 or 413 with a JSON body (an error says why); the server stays up."""
    monkeypatch.setenv("AGENTENV_CACHE", str(tmp_path))
    server = BackgroundServer(RetrievalService(union_corpus()[:500]).make_app, name="retrieval")
    url = server.start()
    rng = random.Random(f"{SEED}-retrieval")

    async def hostile() -> None:
        async with aiohttp.ClientSession() as session:
            for i in range(SERVER_REQUESTS):
                body, content_type, shape = _hostile_body(rng)
                where = f"request #{i} ({shape}, {len(body):,} bytes: {body[:80]!r})"
                headers = {"Content-Type": content_type}
                async with session.post(f"{url}/retrieve", data=body, headers=headers) as r:
                    raw = await r.read()
                assert r.status in (200, 400, 413), f"HTTP {r.status} {raw[:200]!r} on {where}"
                assert r.status == 200 or json.loads(raw)["error"].strip(), where
            async with session.get(f"{url}/health") as r:
                assert (await r.json())["status"] == "ok"

    try:
        asyncio.run(hostile())
    finally:
        server.stop()


# -- the browse tool, fed hostile pages ----------------------------------------------------------

BROWSE_PAGES = 40


def _hostile_page(rng: random.Random) -> tuple[dict[str, str], bytes, str]:
    """``(headers, body, shape)``: pages that are huge in elements, wide, spanning, undecodable or redirecting."""
    n = rng.choice([1, 100, 5_000, 100_000])
    shape = rng.choice(["row", "unclosed", "spans", "charset", "redirect", "nested"])
    if shape == "row":
        body = "<table><tr>" + "<td>x</td>" * n
    elif shape == "unclosed":
        body = f"<{rng.choice(['p', 'li', 'td', 'tr', 'table', 'div', 'b', 'a href=/x'])}>x" * n
    elif shape == "spans":
        span = rng.choice(["100", "1000000", "-1", "²", "0", "1e9", "99999999999999999999"])
        body = ("<tr>" + f"<td rowspan={span} colspan={span}>x</td>" * 50) * (n // 50 + 1)
    elif shape == "nested":
        body = "<div><table><tr><td>" * min(n, 20_000)
    else:
        body = _text(rng, 200)
    headers = {"Content-Type": "text/html; charset=" + rng.choice(["utf-8", "undefined", "rot13", "base64", "x-no"])}
    if shape == "charset":
        return headers, rng.randbytes(rng.randint(0, 5_000)), shape
    if shape == "redirect":
        location = rng.choice(["file:///etc/passwd", "http://[::1", "http://", "javascript:x", "//", "http://0x7f.1/"])
        return {"Location": location}, b"", shape
    return headers, ("<html><body>" + body)[:2_000_000].encode(), shape


def test_browse_answers_hostile_pages_with_an_observation():
    """Every hostile page gives an observation or the tool's refusal, never a raw exception."""
    rng = random.Random(f"{SEED}-browse")
    pages = {str(i): _hostile_page(rng) for i in range(BROWSE_PAGES)}

    async def page(request: aiohttp.web.Request) -> aiohttp.web.Response:
        headers, body, shape = pages[request.match_info["n"]]
        return aiohttp.web.Response(status=302 if shape == "redirect" else 200, headers=headers, body=body)

    def make_app() -> aiohttp.web.Application:
        app = aiohttp.web.Application()
        app.router.add_get("/{n}", page)
        return app

    server = BackgroundServer(make_app, name="hostile pages")
    url = server.start()
    env = agentenv.make("web-research", allow_private_urls=True, browse_timeout=5)
    try:
        env.reset(seed=SEED)
        for n, (_, body, shape) in pages.items():
            argument = rng.choice(
                [f"{url}/{n}", f'{{"url": "{url}/{n}", "page": 2}}', f'{{"url": "{url}/{n}", "find": "x"}}']
            )
            where = f"page {n} ({shape}, {len(body):,} bytes: {body[:80]!r})"
            observation, *_, truncated, _ = env.step(f"<browse>{argument}</browse>")
            assert isinstance(observation, str), where
            assert "the tool `browse` failed" not in observation, f"{observation[:300]} on {where}"
            if truncated:
                env.reset(seed=SEED)
    finally:
        env.close()
        server.stop()


# -- tool names and MCP servers' listings, hostile (issue 40) -------------------------------------

NAME_PALETTE = "abZ09_-." * 4 + " <>/\"'\\{}\n\té中"
MCP_LISTINGS = 8  # seeds of mcp_hostile_server.py's random mode: about half a second each


def _echo(text: str) -> str:
    return f"echo:{text}"


@pytest.mark.parametrize("parser", ["xml", "json"])
def test_a_tool_name_is_accepted_exactly_when_the_model_can_call_it(parser):
    rng = random.Random(f"{SEED}-names-{parser}")
    task = agentenv.datasets.Example("q", "q?", ("a",))
    parameters = {"type": "object", "properties": {"text": {"type": "string"}}}
    for _ in range(300):
        name = "".join(rng.choice(NAME_PALETTE) for _ in range(rng.choice([0, 1, 3, 8, 128, 129])))
        writable = 1 <= len(name) <= 128 and all(c.isascii() and (c.isalnum() or c in "_-.") for c in name)
        try:
            env = agentenv.ToolEnv([task], [agentenv.Tool(name, "Echo.", parameters, _echo)], parser=parser)
        except ValueError as e:
            assert not writable and repr(name) in str(e), (name, str(e))
            continue
        assert writable, name
        env.reset()
        action = (
            f'<tool_call>{{"name": {json.dumps(name)}, "arguments": {{"text": "x"}}}}</tool_call>'
            if parser == "json"
            else f"<{name}>x</{name}>"
        )
        assert env.step(action)[0] == "echo:x", name


@pytest.mark.parametrize("seed", range(MCP_LISTINGS))
def test_mcp_listings_enter_the_prompt_capped_or_are_refused(seed):
    import sys
    import warnings
    from pathlib import Path

    import psutil

    from agentenv.mcp_client import DEFAULT_MAX_DESCRIPTION_CHARS, DEFAULT_MAX_SCHEMA_CHARS, DEFAULT_MAX_TOOLS

    token = f"fuzz-{SEED}-{seed}-{time.time_ns()}"
    script = str(Path(__file__).with_name("mcp_hostile_server.py"))
    server = agentenv.MCPStdioServer(sys.executable, [script, "random", token, f"{SEED}-{seed}"])
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a capped listing warns; what it keeps is checked below
            tools = agentenv.mcp_tools(server, fork="share")
    except ValueError as e:
        assert str(e).startswith("MCP server `hostile`: tool name "), str(e)
    else:
        assert len(tools) <= DEFAULT_MAX_TOOLS
        for t in tools:
            assert len(t.description) <= DEFAULT_MAX_DESCRIPTION_CHARS, t.name
            assert len(json.dumps(t.parameters, ensure_ascii=False)) <= DEFAULT_MAX_SCHEMA_CHARS, t.name
        if tools:
            env = agentenv.ToolEnv([agentenv.datasets.Example("q", "q?", ("a",))], tools)
            prompt = env.reset()[0]
            assert len(prompt) < DEFAULT_MAX_TOOLS * (DEFAULT_MAX_DESCRIPTION_CHARS + 200) + 2000
            env.close()  # a listing with no tools to show has closed its session itself
    survivors = [p.pid for p in psutil.process_iter(["cmdline"]) if token in (p.info["cmdline"] or [])]
    assert survivors == [], f"seed {seed}: the server outlived close"
