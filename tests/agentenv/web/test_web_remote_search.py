"""RemoteSearch against minimal stand-ins of the Search-R1 wire format and its dialects; retries; failures."""

import asyncio
import re
import subprocess
import sys
import textwrap

import msgpack
import pytest
from aiohttp import web

import agentenv
from agentenv.search import Passage
from agentenv.web_search import (
    CachedSearch,
    RemoteSearch,
    ResultCache,
    SearchUnavailable,
    parse_retrieval_response,
)

DOCS = [
    {"id": "7", "contents": '"Neil Peart"\nNeil Peart was the drummer of Rush.'},
    {"id": "9", "contents": '"Rush (band)"\nRush was a Canadian rock band.'},
]


def search_r1_stand_in(requests: list) -> web.Application:
    """Search-R1's /retrieve as its FastAPI server answers: per query, documents with optional scores."""

    async def retrieve(request):
        payload = await request.json()
        requests.append(payload)
        results = []
        for _ in payload["queries"]:
            docs = DOCS[: payload.get("topk") or 3]
            results.append(
                [{"document": d, "score": 0.9 - i / 10} for i, d in enumerate(docs)]
                if payload.get("return_scores")
                else docs
            )
        return web.json_response({"result": results})

    app = web.Application()
    app.router.add_post("/retrieve", retrieve)
    return app


async def test_client_speaks_search_r1(serve):
    requests = []
    url = await serve(search_r1_stand_in(requests))
    client = RemoteSearch(url)
    assert await client.search("who drummed for Rush", 2) == [
        Passage("Neil Peart", "Neil Peart was the drummer of Rush.", None, 0.9),
        Passage("Rush (band)", "Rush was a Canadian rock band.", None, 0.8),
    ]
    assert requests == [{"queries": ["who drummed for Rush"], "topk": 2, "return_scores": True}]
    batch = await client.search_batch(["a", "b", "c"], 1)
    assert [[p.title for p in hits] for hits in batch] == [["Neil Peart"]] * 3
    assert len(requests) == 2  # one request for the batch


def peer_recording_app(peers: list) -> web.Application:
    """Search-R1 results, noting the client's address (host, port) of each request's connection."""

    async def retrieve(request):
        peers.append(request.transport.get_extra_info("peername"))
        payload = await request.json()
        return web.json_response({"result": [[DOCS[0]] for _ in payload["queries"]]})

    app = web.Application()
    app.router.add_post("/retrieve", retrieve)
    return app


async def test_searches_keep_their_connection_alive(serve):
    peers = []
    url = await serve(peer_recording_app(peers))
    client = RemoteSearch(url)
    await client.search("a", 1)
    await client.search_batch(["b", "c"], 1)
    await RemoteSearch(url).search("d", 1)  # another client in this event loop shares the connections
    assert len(peers) == 3 and len(set(peers)) == 1
    await client.aclose()
    await client.search("e", 1)
    assert len(set(peers)) == 2


def test_connections_close_with_their_event_loop():
    # In a fresh interpreter that turns every warning into an error: unclosed sessions would show.
    code = textwrap.dedent(
        """
        import asyncio, copy, pickle
        from aiohttp import web
        from agentenv.serve.hosting import BackgroundServer
        from agentenv.web_search import RemoteSearch

        async def retrieve(request):
            return web.json_response({"result": [[{"title": "T", "text": "x"}]]})

        def app():
            app = web.Application()
            app.router.add_post("/retrieve", retrieve)
            return app

        server = BackgroundServer(app)
        client = RemoteSearch(server.start())
        for _ in range(2):  # two loops, one after the other
            assert asyncio.run(client.search("q", 1))[0].title == "T"
        assert asyncio.run(pickle.loads(pickle.dumps(copy.deepcopy(client))).search("q", 1))[0].text == "x"
        server.stop()
        print("ok")
        """
    )
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-W", "error", "-c", code], capture_output=True, text=True, timeout=60
    )
    # -X dev's asyncio debug mode also notes every callback slower than 0.1 s, which a loaded machine makes.
    slow = re.compile(r"^Executing <.*> took \d+\.\d+ seconds$")
    errors = [line for line in done.stderr.splitlines() if not slow.match(line)]
    assert (done.returncode, done.stdout, errors) == (0, "ok\n", [])


async def test_single_query_dialect_and_msgpack(serve):
    seen = []

    async def retrieve(request):  # a server that takes {"query": ...} in msgpack and answers a flat list
        payload = msgpack.unpackb(await request.read())
        seen.append((request.content_type, payload))
        body = msgpack.packb(
            {"results": [{"title": "Rush", "text": f"about {payload['query']}", "url": "https://x.org/r"}]}
        )
        return web.Response(body=body, content_type="application/x-msgpack")

    app = web.Application()
    app.router.add_post("/api/search", retrieve)
    url = await serve(app)
    client = RemoteSearch(f"{url}/api/search", dialect="query", wire="msgpack")
    assert await client.search("drums", 4) == [Passage("Rush", "about drums", "https://x.org/r")]
    assert seen == [("application/msgpack", {"query": "drums", "topk": 4, "return_scores": True})]
    batch = await client.search_batch(["a", "b"], 1)  # one request per query in this dialect
    assert [hits[0].text for hits in batch] == ["about a", "about b"] and len(seen) == 3


def test_response_parsing_is_tolerant_but_says_what_is_wrong():
    assert parse_retrieval_response([["plain string doc\nwith text"]]) == [[Passage("plain string doc", "with text")]]
    assert parse_retrieval_response({"result": [[{"title": "T", "contents": "body"}]]}) == [[Passage("T", "body")]]
    assert parse_retrieval_response({"result": [[], []]}, 2) == [[], []]
    with pytest.raises(SearchUnavailable, match="the retrieval server answered 1 result lists for 2 queries"):
        parse_retrieval_response({"result": [[]]}, 2)
    with pytest.raises(
        SearchUnavailable, match=r"the retrieval server's answer has no result list: \"\{'detail': 'x'\}\""
    ):
        parse_retrieval_response({"detail": "x"})
    with pytest.raises(SearchUnavailable, match="the retrieval server returned a document that is not an object: 42"):
        parse_retrieval_response({"result": [[42]]})


def flaky_app(statuses: list[int], requests: list, headers=None) -> web.Application:
    """Answers each status in turn (an error body), then Search-R1 results."""

    async def retrieve(request):
        requests.append(await request.json())
        if len(requests) <= len(statuses):
            status = statuses[len(requests) - 1]
            return web.json_response({"error": "busy, try later"}, status=status, headers=headers or {})
        return web.json_response({"result": [[DOCS[0]]]})

    app = web.Application()
    app.router.add_post("/retrieve", retrieve)
    return app


async def test_rate_limits_and_server_errors_are_retried_with_backoff(serve):
    requests = []
    url = await serve(flaky_app([503, 429, 502], requests))
    hits = await RemoteSearch(url, backoff=0.01).search("q", 1)
    assert [h.title for h in hits] == ["Neil Peart"] and len(requests) == 4
    requests.clear()
    url = await serve(flaky_app([429], requests, headers={"Retry-After": "0"}))
    assert len(await RemoteSearch(url, backoff=30).search("q", 1)) == 1  # Retry-After 0 beats the 30 s backoff
    requests.clear()
    url = await serve(flaky_app([503] * 10, requests))
    with pytest.raises(SearchUnavailable) as e:
        await RemoteSearch(url, retries=2, backoff=0.01).search("q", 1)
    assert str(e.value).startswith(f"the retrieval server at {url}/retrieve failed after 3 attempts in ")
    assert str(e.value).endswith(" s: HTTP 503 Service Unavailable") and len(requests) == 3


async def test_client_errors_are_not_retried(serve):
    requests = []
    url = await serve(flaky_app([400], requests))
    with pytest.raises(SearchUnavailable) as e:
        await RemoteSearch(url, backoff=0.01).search("q", 1)
    assert str(e.value) == (
        f"the retrieval server at {url}/retrieve refused the request: HTTP 400 Bad Request: busy, try later"
    )
    assert len(requests) == 1


async def test_unreachable_and_hanging_servers_fail_within_the_timeout(serve, closed_port):
    with pytest.raises(SearchUnavailable) as e:
        await asyncio.wait_for(RemoteSearch(f"http://127.0.0.1:{closed_port}", backoff=0.01).search("q", 1), 5)
    message = str(e.value)
    assert message.startswith(
        f"the retrieval server at http://127.0.0.1:{closed_port}/retrieve failed after 4 attempts in "
    )
    assert f"ClientConnectorError: Cannot connect to host 127.0.0.1:{closed_port}" in message

    async def hang(request):
        await asyncio.sleep(30)

    app = web.Application()
    app.router.add_post("/retrieve", hang)
    url = await serve(app)
    with pytest.raises(SearchUnavailable) as e:
        await asyncio.wait_for(RemoteSearch(url, timeout=0.5).search("q", 1), 5)
    assert (
        str(e.value)
        == f"the retrieval server at {url}/retrieve failed after 1 attempt in 0.5 s: no answer within 0.5 s"
    )


def test_client_arguments_are_checked():
    with pytest.raises(
        ValueError, match=r"a retrieval server URL must be http\(s\)://host\[:port\]\[/path\], got 'localhost:8000'"
    ):
        RemoteSearch("localhost:8000")
    with pytest.raises(ValueError, match="dialect must be 'queries' or 'query', got 'q'"):
        RemoteSearch("http://h", dialect="q")
    with pytest.raises(ValueError, match="wire must be 'json' or 'msgpack', got 'xml'"):
        RemoteSearch("http://h", wire="xml")


def test_qa_env_searches_a_retrieval_server_by_url(tmp_path, monkeypatch):
    from agentenv.serve.hosting import BackgroundServer

    monkeypatch.setenv("AGENTENV_CACHE", str(tmp_path))
    requests = []
    server = BackgroundServer(lambda: search_r1_stand_in(requests))
    url = server.start()
    try:
        env = agentenv.make("singlehop-qa:nq", search=url, topk=1)
        assert isinstance(env.backend, CachedSearch) and isinstance(env.backend.backend, RemoteSearch)
        env.reset(options={"index": 0})
        assert env.step("<search>Rush drummer</search>")[0] == "Page 1: Neil Peart\nNeil Peart was the drummer of Rush."
        again = agentenv.make("singlehop-qa:nq", search=url, topk=1)  # a later run: answered from the disk cache
        again.reset(options={"index": 0})
        assert again.step("<search>Rush drummer</search>")[0].startswith("Page 1: Neil Peart")
        assert len(requests) == 1
    finally:
        server.stop()
    with pytest.raises(ValueError, match="unknown search backend 'bing': use 'local'"):
        agentenv.make("singlehop-qa:nq", search="bing")


def test_an_unreachable_backend_is_an_observation(closed_port):
    backend = CachedSearch(RemoteSearch(f"http://127.0.0.1:{closed_port}", retries=1, backoff=0.01), ResultCache())
    env = agentenv.make("multihop-qa", search=backend)
    env.reset(options={"index": 0})
    obs, reward, terminated, truncated, info = env.step("<search>anything</search>")
    assert obs.startswith(
        f"Error: the retrieval server at http://127.0.0.1:{closed_port}/retrieve failed after 2 attempts"
    )
    assert (reward, terminated, truncated, info["tool_calls"]) == (0.0, False, False, 1)
