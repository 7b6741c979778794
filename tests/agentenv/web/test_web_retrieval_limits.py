"""What one request may cost the retrieval server: limits that answer 400 naming themselves, long
requests taking turns, abandoned work dropped, undecodable bodies, idle connections closed.

Every test talks to a real server on 127.0.0.1. How fast the limits answer, and the server's
memory under the largest requests, are measured by ``python -m benchmarks.web_bench --limits``.
"""

import asyncio
import json
import socket
import threading
from urllib.parse import urlsplit

import aiohttp
import msgpack
import pytest

from agentenv.serve.hosting import BackgroundServer
from agentenv.serve.retrieval import Limits, RetrievalService, read_corpus

WIKI_STYLE = [
    {"id": "w0", "contents": '"Paris"\nParis is the capital and largest city of France.'},
    {"id": "w1", "contents": '"Berlin"\nBerlin is the capital of Germany.'},
    {"id": "w2", "contents": '"Rush (band)"\nRush was a Canadian rock band from Toronto. Neil Peart was its drummer.'},
    {"id": "w3", "contents": '"Toronto"\nToronto is the capital city of the Canadian province of Ontario.'},
]
LONGEST = ("capital " * 512)[:4096]  # a query of the default --max-query-chars, matching 3 passages
EXAMPLE = '{"queries": ["..."], "topk": 3, "return_scores": true}'


@pytest.fixture
def corpus(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTENV_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "wiki.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in WIKI_STYLE))
    return read_corpus(path)


@pytest.fixture
async def server(serve, corpus):
    return await serve(RetrievalService(*corpus).make_app())


async def post(url, payload=None, *, data=None, headers=None):
    async with aiohttp.ClientSession() as session, session.post(url, json=payload, data=data, headers=headers) as r:
        return r.status, await r.json(content_type=None)


async def health(url: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/health") as r:
        return await r.json()


# -- limits ------------------------------------------------------------------------------------

TOPK_OVER = "\"topk\" {} is over this server's limit of 100 passages per query; ask for at most 100 (the server's --max-topk raises the limit)"


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        ({"queries": ["capital"], "topk": 101}, TOPK_OVER.format("101")),
        ({"queries": ["capital"], "topk": "1e9"}, None),  # not a whole number: the usual topk error
        # the amplification request: 128 broad queries at topk 10⁹ (a 17 KB body) made a 1.1 GB answer
        ({"queries": [f"capital city {i}" for i in range(128)], "topk": 10**9}, TOPK_OVER.format("1,000,000,000")),
        (
            {"queries": ["capital"] * 128, "topk": 100},
            "128 queries × topk 100 = 12,800 passages, over this server's limit of 10,240 passages per request; "
            "send fewer queries per request or a smaller topk (the server's --max-results raises the limit)",
        ),
        (
            {"queries": ["Paris", LONGEST + "s"]},
            "query 1 is 4,097 characters long, over this server's limit of 4,096 characters per query; "
            "send a shorter query (the server's --max-query-chars raises the limit)",
        ),
        (
            {"queries": ["q"], "topk": "9" * 5000},  # more digits than int() reads: refused, and cut when shown
            '"topk" must be a whole number of passages like 3 (0 or null: the default), got \''
            + "9" * 79
            + "… (5,002 characters)",
        ),
    ],
)
async def test_a_request_over_a_limit_gets_400_naming_it(server, payload, error):
    status, body = await post(f"{server}/retrieve", payload)
    assert status == 400
    if error is None:
        assert body["error"].startswith('"topk" must be a whole number of passages like 3')
    else:
        assert body == {"error": error}


async def test_requests_at_the_limits_are_answered(server):
    status, body = await post(f"{server}/retrieve", {"queries": [LONGEST] * 102, "topk": 100})
    assert status == 200 and len(body["result"]) == 102
    assert [d["id"] for d in body["result"][0]] == ["w1", "w0", "w3"]  # the 3 passages that match
    assert (await health(server))["limits"] == {
        "max_topk": 100,
        "max_results": 10_240,
        "max_query_chars": 4096,
        "max_response_bytes": 32 * 1024 * 1024,
    }


async def test_the_limits_are_the_servers_to_set(serve, corpus):
    limits = Limits(max_topk=1000, max_results=2000, max_query_chars=10)
    url = await serve(RetrievalService(*corpus, topk=500, limits=limits).make_app())
    status, body = await post(f"{url}/retrieve", {"queries": ["capital"]})  # the default topk, 500
    assert status == 200 and len(body["result"][0]) == 3
    assert (await post(f"{url}/retrieve", {"queries": ["capital"] * 5}))[1] == {
        "error": "5 queries × topk 500 = 2,500 passages, over this server's limit of 2,000 passages per request; "
        "send fewer queries per request or a smaller topk (the server's --max-results raises the limit)"
    }
    assert (await post(f"{url}/retrieve", {"query": "capital city"}))[1]["error"].startswith(
        "query 0 is 12 characters long, over this server's limit of 10 characters per query"
    )
    with pytest.raises(ValueError, match=r"topk must be between 1 and max_topk \(1000\), got 1001"):
        RetrievalService(*corpus, topk=1001, limits=limits)
    with pytest.raises(ValueError, match="max_results must be a whole number of at least 1, got 0"):
        Limits(max_results=0)


@pytest.mark.parametrize(
    ("limit", "where"),
    [
        (50, " (reached at query 0 of 1)"),  # the passages' text alone is over: refused before encoding
        (120, ""),  # the text fits (Berlin's 85 characters), its encoding does not
    ],
)
@pytest.mark.parametrize("wire", ["json", "msgpack"])
async def test_an_answer_over_max_response_bytes_gets_400(serve, corpus, limit, where, wire):
    url = await serve(RetrievalService(*corpus, limits=Limits(max_response_bytes=limit)).make_app())
    payload = {"queries": ["Berlin"], "topk": 1, "return_scores": True}
    if wire == "json":
        status, body = await post(f"{url}/retrieve", payload)
    else:
        headers = {"Content-Type": "application/msgpack"}
        status, body = await post(f"{url}/retrieve", data=msgpack.packb(payload), headers=headers)
    assert status == 400
    assert body == {
        "error": f"the answer is over this server's limit of {limit} bytes per response{where}; ask for fewer "
        "passages (topk) or fewer queries per request (the server's --max-response-bytes raises the limit)"
    }


# -- undecodable bodies ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "content_type", "reason"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "application/json", "JSON (nested too deeply)"),
        (b'{"queries": ' + b"[" * 100_000, "application/json", "JSON (nested too deeply)"),
        (b"\x91" * 100_000 + b"\x01", "application/msgpack", "msgpack (nested too deeply)"),
        (b"\xc1", "application/msgpack", "msgpack (a byte that starts no msgpack value)"),
        (b"\x81\x01\x02", "application/msgpack", "msgpack (int is not allowed for map key when strict_map_key=True)"),
        (b"\x91", "application/x-msgpack", "msgpack (Unpack failed: incomplete input)"),
        (b"\xff\xfe\x00", "application/json", None),  # not UTF-8, -16 or -32: the decoder's own message
    ],
)
async def test_an_undecodable_body_gets_400_saying_why(server, body, content_type, reason):
    status, answer = await post(f"{server}/retrieve", data=body, headers={"Content-Type": content_type})
    assert status == 400
    if reason is None:
        assert answer["error"].startswith("the request body is not valid JSON (")
        assert not answer["error"].startswith("the request body is not valid JSON ()")
    else:
        assert answer == {"error": f"the request body is not valid {reason}; send {EXAMPLE}"}


# -- long requests take turns; abandoned ones are dropped --------------------------------------


class Gated(RetrievalService):
    """Records the queries of each ranking call; the first call waits until ``release`` is set."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[list[str]] = []
        self.started, self.release = threading.Event(), threading.Event()

    def rank_requests(self, requests):
        self.calls.append([q for queries, _ in requests for q in queries])
        if len(self.calls) == 1:
            self.started.set()
            self.release.wait(30)
        return super().rank_requests(requests)


async def wait_for(url: str, key: str, value: int) -> dict:
    """/health once its ``key`` reads ``value`` (the server runs on this event loop)."""
    for _ in range(400):
        state = await health(url)
        if state[key] == value:
            return state
        await asyncio.sleep(0.025)
    raise AssertionError(f"/health never had {key}={value}: {state}")


@pytest.mark.parametrize("batch_window_ms", [0, 2])
async def test_a_short_query_waits_one_chunk_behind_a_long_request(serve, corpus, batch_window_ms):
    service = Gated(*corpus, batch_window_ms=batch_window_ms)
    url = await serve(service.make_app())
    try:
        long = asyncio.create_task(post(f"{url}/retrieve", {"queries": [LONGEST] * 64, "topk": 1}))
        await asyncio.to_thread(service.started.wait, 30)  # its first chunk is being ranked
        short = asyncio.create_task(post(f"{url}/retrieve", {"queries": ["Berlin"], "topk": 1}))
        await wait_for(url, "queued", 64 - 8 + 1)  # a call holds 8 queries of 4,096 characters
    finally:
        service.release.set()
    (status, body), (short_status, short_body) = await asyncio.gather(long, short)
    assert (status, len(body["result"]), short_status) == (200, 64, 200)
    assert short_body["result"][0][0]["id"] == "w1"
    assert [len(c) for c in service.calls[:2]] == [8, 8]  # the long request's chunk in progress, its next
    assert "Berlin" in service.calls[2]  # then the short query, not after the 6 chunks left
    assert sum(len(c) for c in service.calls) == 65


async def test_the_rest_of_a_request_is_dropped_when_its_client_leaves(serve, corpus):
    service = Gated(*corpus)
    url = await serve(service.make_app())
    address = urlsplit(url)
    body = json.dumps({"queries": [LONGEST] * 64}).encode()
    reader, writer = await asyncio.open_connection(address.hostname, address.port)
    try:
        head = f"POST /retrieve HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        writer.write(head.encode() + body)
        await writer.drain()
        await asyncio.to_thread(service.started.wait, 30)
    finally:
        writer.close()  # the client leaves while its first chunk is ranked
        await writer.wait_closed()
    await asyncio.sleep(0.2)  # the server, on this event loop, reads the end of the connection
    service.release.set()
    state = await wait_for(url, "abandoned", 1)
    assert (state["queued"], state["requests"], len(service.calls)) == (0, 0, 1)  # 7 chunks never ranked
    status, answer = await post(f"{url}/retrieve", {"queries": ["Berlin"], "topk": 1})
    assert status == 200 and answer["result"][0][0]["id"] == "w1"


# -- idle connections --------------------------------------------------------------------------


def closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``sock`` within ``seconds`` (what it sends meanwhile is read)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
    except TimeoutError:
        return False
    return True


def test_idle_connections_are_closed(corpus):
    server = BackgroundServer(RetrievalService(*corpus).make_app, keepalive_timeout=0.5, name="retrieval")
    address = urlsplit(server.start())
    try:
        with (
            socket.create_connection((address.hostname, address.port)) as used,
            socket.create_connection((address.hostname, address.port)) as unused,
        ):
            used.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # HTTP/1.1: kept alive after the answer
            assert used.recv(12) == b"HTTP/1.1 200"
            assert closed_within(used, 20)
            assert closed_within(unused, 20)  # opened, never used
    finally:
        server.stop()
