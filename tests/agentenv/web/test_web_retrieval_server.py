"""Our retrieval server, spoken to as Search-R1's client speaks to its server; batching; workers; its CLI; dense retrieval."""

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import aiohttp
import msgpack
import numpy as np
import pytest

from agentenv.datasets import Paragraph, load_examples, union_corpus
from agentenv.search import BM25Search
from agentenv.serve.__main__ import main as serve_main
from agentenv.serve.retrieval import RetrievalService, read_corpus
from agentenv.web_search import RemoteSearch

ROOT = Path(__file__).resolve().parents[3]
WIKI_STYLE = [  # Search-R1's wiki-18 rows: an id, and contents whose first line is the quoted title
    {"id": "w0", "contents": '"Paris"\nParis is the capital and largest city of France.'},
    {"id": "w1", "contents": '"Berlin"\nBerlin is the capital of Germany.'},
    {"id": "w2", "contents": '"Rush (band)"\nRush was a Canadian rock band from Toronto. Neil Peart was its drummer.'},
    {"id": "w3", "contents": '"Toronto"\nToronto is the capital city of the Canadian province of Ontario.'},
]


@pytest.fixture
def corpus_file(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTENV_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "wiki.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in WIKI_STYLE))
    return path


@pytest.fixture
async def server(serve, corpus_file):
    passages, ids = read_corpus(corpus_file)
    return await serve(RetrievalService(passages, ids).make_app())


def search_r1_format(documents: list[dict]) -> str:
    """How Search-R1's generation loop renders one query's results for the model."""
    lines = []
    for i, item in enumerate(documents, 1):
        title, _, text = item["document"]["contents"].partition("\n")
        lines.append(f"Doc {i}(Title: {title}) {text}\n")
    return "".join(lines)


async def post(url, payload=None, *, data=None, headers=None):
    async with aiohttp.ClientSession() as session, session.post(url, json=payload, data=data, headers=headers) as r:
        return r.status, await r.json(content_type=None)


def test_read_corpus_keeps_ids_or_numbers_rows(corpus_file, tmp_path):
    passages, ids = read_corpus(corpus_file)
    assert ids == ["w0", "w1", "w2", "w3"]
    assert passages[2] == Paragraph(
        "Rush (band)", "Rush was a Canadian rock band from Toronto. Neil Peart was its drummer."
    )
    plain = tmp_path / "plain.jsonl"
    plain.write_text('{"title": "A", "text": "x"}\n{"title": "B", "text": "y"}\n')
    assert read_corpus(plain)[1] == ["0", "1"]


async def test_a_search_r1_client_reads_our_server(server):
    # the exact request Search-R1's batch_search sends
    status, body = await post(
        f"{server}/retrieve", {"queries": ["capital of France", "drummer of Rush"], "topk": 2, "return_scores": True}
    )
    assert status == 200
    assert search_r1_format(body["result"][0]) == (
        'Doc 1(Title: "Paris") Paris is the capital and largest city of France.\n'
        'Doc 2(Title: "Berlin") Berlin is the capital of Germany.\n'
    )
    assert search_r1_format(body["result"][1]) == (
        'Doc 1(Title: "Rush (band)") Rush was a Canadian rock band from Toronto. Neil Peart was its drummer.\n'
    )
    first = body["result"][0][0]
    assert first["document"] == {
        "id": "w0",
        "contents": '"Paris"\nParis is the capital and largest city of France.',
        "title": "Paris",
        "text": "Paris is the capital and largest city of France.",
    }
    assert first["score"] > body["result"][0][1]["score"] > 0


async def test_without_scores_the_lists_hold_documents(server):
    status, body = await post(f"{server}/retrieve", {"queries": ["Toronto"], "topk": 5, "return_scores": False})
    assert status == 200
    assert [d["id"] for d in body["result"][0]] == ["w3", "w2"]  # only passages that match
    status, body = await post(f"{server}/retrieve", {"query": "Berlin"})  # single-query dialect, default topk
    assert [d["id"] for d in body["result"][0]] == ["w1"]


async def test_msgpack_requests_get_msgpack_answers(server):
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{server}/retrieve",
            data=msgpack.packb({"queries": ["Berlin"], "topk": 1}),
            headers={"Content-Type": "application/msgpack"},
        ) as r,
    ):
        assert r.content_type == "application/msgpack"
        assert msgpack.unpackb(await r.read())["result"][0][0]["id"] == "w1"


TOPK_ERROR = '"topk" must be a whole number of passages like 3 (0 or null: the default), got '


@pytest.mark.parametrize(
    ("payload", "error"),
    [
        ([], 'the request body must be an object like {"queries": ["..."], "topk": 3, "return_scores": true}'),
        (
            {},
            'the request needs "queries" (a list of strings), like {"queries": ["..."], "topk": 3, "return_scores": true}',
        ),
        ({"queries": "Paris"}, '"queries" must be a list of strings'),
        ({"queries": ["ok", 3]}, '"queries" must be a list of strings'),
        ({"queries": []}, '"queries" is empty: send at least one query'),
        ({"queries": ["q"] * 1025}, "1025 queries in one request; send at most 1024 per request"),
        ({"queries": ["q"], "topk": 2.5}, f"{TOPK_ERROR}2.5"),  # Search-R1's pydantic refuses a fraction too
        ({"queries": ["q"], "topk": -1}, f"{TOPK_ERROR}-1"),
        ({"queries": ["q"], "topk": "three"}, f"{TOPK_ERROR}'three'"),
        ({"queries": ["q"], "topk": [3]}, f"{TOPK_ERROR}[3]"),
        ({"queries": ["q"], "return_scores": "maybe"}, "\"return_scores\" must be true or false, got 'maybe'"),
        ({"queries": ["q"], "return_scores": 2}, '"return_scores" must be true or false, got 2'),
    ],
)
async def test_bad_requests_get_clear_errors(server, payload, error):
    assert await post(f"{server}/retrieve", payload) == (400, {"error": error})


@pytest.mark.parametrize(
    ("topk", "found"),
    [
        # Search-R1's QueryRequest (pydantic, `topk: Optional[int]`) reads 2.0, "2" and True as ints
        (2, 2),
        (2.0, 2),
        ("2", 2),
        ("2.0", 2),
        (True, 1),
        # retrieve_endpoint: `if not request.topk: request.topk = config.retrieval_topk` (3 here)
        (0, 3),
        (None, 3),
        (False, 3),
        # past the corpus size (4 passages, 3 of which match "capital"): every match, not an error
        # (up to the server's --max-topk, 100: test_web_retrieval_limits)
        (5, 3),
        (100, 3),
    ],
)
async def test_topk_is_read_as_search_r1s_server_reads_it(server, topk, found):
    status, body = await post(f"{server}/retrieve", {"queries": ["capital"], "topk": topk})
    assert status == 200
    assert [d["id"] for d in body["result"][0]] == ["w1", "w0", "w3"][:found]  # best first


@pytest.mark.parametrize(
    ("flag", "scored"), [(True, True), (1, True), ("yes", True), ("TRUE", True), (0, False), ("off", False)]
)
async def test_return_scores_is_read_as_search_r1s_server_reads_it(server, flag, scored):
    status, body = await post(f"{server}/retrieve", {"queries": ["Berlin"], "return_scores": flag})
    assert status == 200
    assert ("score" in body["result"][0][0]) is scored


def test_read_corpus_keeps_the_contents_line_and_the_id_type(tmp_path):
    rows = [
        {"id": 7, "contents": "Oslo\nOslo is the capital of Norway."},  # a title line without quotes
        {"id": "r1", "contents": '"Rome" \n  Rome is the capital of Italy. '},  # spaces kept
        {"id": 9, "contents": '"Paris"\nParis is in France.'},  # wiki-18's form: nothing kept apart
    ]
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    passages, ids = read_corpus(path)
    assert ids == [7, "r1", 9] and [type(i) for i in ids] == [int, str, int]
    assert passages == [
        Paragraph("Oslo", "Oslo is the capital of Norway."),
        Paragraph("Rome", "Rome is the capital of Italy."),
        Paragraph("Paris", "Paris is in France."),
    ]
    assert passages.contents == {0: rows[0]["contents"], 1: rows[1]["contents"]}
    service = RetrievalService(passages, ids)
    assert [service.document(i)["contents"] for i in range(3)] == [row["contents"] for row in rows]
    assert service.document(0) == {
        "id": 7,
        "contents": "Oslo\nOslo is the capital of Norway.",
        "title": "Oslo",
        "text": "Oslo is the capital of Norway.",
    }
    # a {title, text} corpus has no contents line: it is made in wiki-18's form, ids are positions
    plain = RetrievalService([Paragraph("Bergen", "Bergen is a city in Norway.")])
    assert plain.document(0) == {
        "id": "0",
        "contents": '"Bergen"\nBergen is a city in Norway.',
        "title": "Bergen",
        "text": "Bergen is a city in Norway.",
    }


async def test_the_server_answers_contents_and_ids_as_the_corpus_had_them(serve, tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTENV_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "numbered.jsonl"
    path.write_text('{"id": 7, "contents": "Oslo\\nOslo is the capital of Norway."}\n')
    url = await serve(RetrievalService(*read_corpus(path)).make_app())
    status, body = await post(f"{url}/retrieve", {"queries": ["Norway"], "topk": 1})
    assert status == 200 and body["result"][0][0]["id"] == 7
    assert body["result"][0][0]["contents"] == "Oslo\nOslo is the capital of Norway."  # no quotes added
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{url}/retrieve",
            data=msgpack.packb({"queries": ["Norway"], "topk": 3.0}),
            headers={"Content-Type": "application/msgpack"},
        ) as r,
    ):
        assert msgpack.unpackb(await r.read())["result"][0][0]["id"] == 7  # an int in msgpack too


async def test_malformed_bodies_and_wrong_routes(server):
    status, body = await post(f"{server}/retrieve", data=b"queries=Paris", headers={"Content-Type": "application/json"})
    assert status == 400
    assert body["error"].startswith(
        "the request body is not valid JSON (Expecting value: line 1 column 1 (char 0)); send {"
    )
    async with aiohttp.ClientSession() as session:
        async with session.get(f"{server}/retrieve") as r:
            assert (r.status, await r.json()) == (
                405,
                {"error": "Method Not Allowed: use POST for /retrieve and GET for /health"},
            )
        async with session.get(f"{server}/search") as r:
            assert (r.status, await r.json()) == (
                404,
                {"error": "Not Found: the endpoints are POST /retrieve and GET /health"},
            )
        async with session.post(f"{server}/retrieve", data=b"x" * (17 * 1024 * 1024)) as r:
            assert r.status == 413
            assert (await r.json())["error"].startswith(
                "Request Entity Too Large: the request body is larger than 16,777,216 bytes"
            )
        async with session.get(f"{server}/health") as r:
            health = await r.json()
    assert {k: health[k] for k in ("status", "index", "passages")} == {"status": "ok", "index": "bm25", "passages": 4}
    assert health["peak_rss_mb"] > 0


async def test_our_client_against_our_server(server):
    client = RemoteSearch(server)  # "/retrieve" appended
    assert client.url == f"{server}/retrieve"
    hits = await client.search("Canadian rock band", 1)
    assert [(h.title, h.text) for h in hits] == [("Rush (band)", WIKI_STYLE[2]["contents"].split("\n")[1])]
    batch = await RemoteSearch(f"{server}/retrieve", wire="msgpack").search_batch(["Paris", "Berlin"], 1)
    assert [[h.title for h in hits] for hits in batch] == [["Paris"], ["Berlin"]]


def test_service_arguments_are_checked():
    with pytest.raises(
        ValueError, match="index must be 'bm25', 'dense' or a built BM25Search or DenseSearch, got 'tfidf'"
    ):
        RetrievalService([Paragraph("A", "a")], index="tfidf")
    with pytest.raises(ValueError, match="2 ids for 1 passages"):
        RetrievalService([Paragraph("A", "a")], ["1", "2"])
    with pytest.raises(ValueError, match=r"topk must be between 1 and max_topk \(100\), got 0"):
        RetrievalService([Paragraph("A", "a")], topk=0)
    with pytest.raises(ValueError, match="batch_window_ms must be between 0 and 1000, got -1"):
        RetrievalService([Paragraph("A", "a")], batch_window_ms=-1)
    with pytest.raises(ValueError, match="max_batch_queries must be at least 1, got 0"):
        RetrievalService([Paragraph("A", "a")], max_batch_queries=0)
    with pytest.raises(ValueError, match="workers must be at least 1, got 0"):
        RetrievalService([Paragraph("A", "a")], workers=0)


# -- rankings and batching --------------------------------------------------------------------


def real_queries(n: int) -> list[str]:
    return [e.question for name in ("nq", "hotpotqa") for e in load_examples(name)][:n]


@pytest.fixture
def tied_index(tmp_path, monkeypatch):
    """BM25 over 1,500 shipped paragraphs, each twice: every match ties with its copy."""
    monkeypatch.setenv("AGENTENV_CACHE", str(tmp_path / "cache"))
    base = union_corpus()[:1500]
    return BM25Search(base + base)


def test_rankings_keep_bm25s_scores_and_break_ties_by_position(tied_index):
    retriever = tied_index.retriever
    for query in real_queries(60):
        tokens = tied_index.query_tokens([query])[0]
        scores = retriever.get_scores_from_ids(retriever.get_tokens_ids(tokens))
        order = np.lexsort((np.arange(len(scores)), -scores))[:10]  # a full sort: best first, then position
        expected = [(int(i), float(scores[i])) for i in order if scores[i] > 0]
        assert tied_index.rank([query], 10) == [expected]
        # bm25s's own top-k (which breaks ties its own way) finds the same scores
        _, top = retriever.retrieve([tokens], k=10, show_progress=False)
        assert sorted(float(s) for s in top[0] if s > 0) == sorted(s for _, s in expected)
    first = tied_index.rank(["Rush drummer"], 2)[0]
    assert first[0][1] == first[1][1] and first[1][0] == first[0][0] + 1500  # a passage, then its copy


def test_a_batch_ranks_each_query_as_it_would_be_ranked_alone(tied_index):
    service = RetrievalService(tied_index.passages, index=tied_index)
    no_tokens = ["", "?!", "the of and", "zzqx unknownwordy"]  # nothing, punctuation, stop words, unknown words
    queries = real_queries(200) + no_tokens
    queries += queries[::10]  # duplicates, in the same request and across requests
    requests = [(queries[i : i + 3], 1 + i % 7) for i in range(0, len(queries), 3)]  # topk 1 to 7
    batched = service.rank_requests(requests)
    assert service.rankings == 1
    assert batched == [[tied_index.rank([q], topk)[0] for q in qs] for qs, topk in requests]
    for (qs, topk), rankings in zip(requests, batched):
        for q, hits in zip(qs, rankings):  # the sequential API, one query at a time
            found = [(p.title, p.text, p.score) for p in tied_index.search_sync(q, topk)]
            assert found == [(tied_index.passages[i].title, tied_index.passages[i].text, s) for i, s in hits]
    assert tied_index.rank(no_tokens, 5) == [[], [], [], []]


def test_bm25_memory_maps_its_cached_index(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTENV_CACHE", str(tmp_path))
    passages = union_corpus()[:300]
    built = BM25Search(passages, mmap=True)  # built, saved, then mapped
    loaded = BM25Search(passages, mmap=True)
    in_memory = BM25Search(passages)
    assert isinstance(built.retriever.scores["data"], np.memmap)
    assert isinstance(loaded.retriever.scores["data"], np.memmap)
    assert not isinstance(in_memory.retriever.scores["data"], np.memmap)
    queries = real_queries(30)
    assert built.rank(queries, 5) == loaded.rank(queries, 5) == in_memory.rank(queries, 5)
    with pytest.raises(ValueError, match="mmap=True maps the index cached on disk: it needs cache=True"):
        BM25Search(passages, cache=False, mmap=True)


async def get_json(url: str) -> dict:
    async with aiohttp.ClientSession() as session, session.get(url) as r:  # a new connection each time
        return await r.json()


async def test_concurrent_requests_share_rankings_and_get_their_own_answers(serve, tied_index):
    service = RetrievalService(tied_index.passages, index=tied_index, batch_window_ms=50)
    batched = await serve(service.make_app())
    alone = await serve(RetrievalService(tied_index.passages, index=tied_index, batch_window_ms=0).make_app())
    queries = real_queries(40)
    payloads = [{"queries": [q], "topk": 1 + i % 5, "return_scores": i % 2 == 0} for i, q in enumerate(queries)]
    payloads += [{"queries": [*queries[:5], "", queries[0]], "topk": 4}, {"query": queries[7]}]
    answers = await asyncio.gather(*(post(f"{batched}/retrieve", p) for p in payloads))
    assert answers == [await post(f"{alone}/retrieve", p) for p in payloads]
    health = await get_json(f"{batched}/health")
    assert health["requests"] == len(payloads) and health["rankings"] < len(payloads) / 4
    assert (health["batch_window_ms"], health["workers"], health["pid"]) == (50, 1, os.getpid())


async def test_a_batch_holds_at_most_max_batch_queries(serve, tied_index):
    sizes = []

    class Recording(RetrievalService):
        def rank_requests(self, requests):
            sizes.append(sum(len(qs) for qs, _ in requests))
            return super().rank_requests(requests)

    url = await serve(
        Recording(tied_index.passages, index=tied_index, batch_window_ms=50, max_batch_queries=4).make_app()
    )
    queries = real_queries(12)
    answers = await asyncio.gather(
        *(post(f"{url}/retrieve", {"queries": [q]}) for q in queries), post(f"{url}/retrieve", {"queries": queries[:6]})
    )
    assert [body["result"][0] for _, body in answers[:6]] == answers[-1][1]["result"]
    assert sum(sizes) == 18 and all(size <= 4 for size in sizes)  # the request of 6 is ranked in chunks


async def test_a_failed_ranking_answers_every_request_of_its_batch(serve, tied_index, monkeypatch):
    url = await serve(RetrievalService(tied_index.passages, index=tied_index, batch_window_ms=50).make_app())

    def unavailable(queries, topk):
        raise RuntimeError("index unavailable")

    monkeypatch.setattr(tied_index, "rank", unavailable)
    answers = await asyncio.gather(*(post(f"{url}/retrieve", {"queries": [q]}) for q in real_queries(5)))
    assert answers == [(500, {"error": "internal error: RuntimeError: index unavailable"})] * 5
    monkeypatch.undo()  # the next batch is served again
    status, body = await post(f"{url}/retrieve", {"queries": ["Rush drummer"], "topk": 1})
    assert status == 200 and len(body["result"][0]) == 1


def start_cli(
    *args: str, cache: Path, python: tuple[str, ...] = ("-m", "agentenv.serve")
) -> tuple[subprocess.Popen, str]:
    """``python -m agentenv.serve ARGS --port 0``: the process and the URL from its first line."""
    process = subprocess.Popen(
        [sys.executable, *python, *args, "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "AGENTENV_CACHE": str(cache)},
    )
    line = process.stdout.readline()  # blocks until the server listens (or exits)
    if not line.startswith("Serving"):
        process.kill()
        raise AssertionError(f"no banner: {line!r} {process.stderr.read()}")
    return process, line.split(" on ", 1)[1].split()[0]


def stop_cli(process: subprocess.Popen) -> tuple[int, str]:
    process.send_signal(signal.SIGTERM)
    try:
        _, err = process.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    return process.returncode, err


LIMITS = ("--max-topk", "5", "--keepalive-timeout", "0.5")


def assert_limits_apply(url: str) -> None:
    """The server started with LIMITS refuses topk 6 and closes an idle connection."""
    status, body = asyncio.run(post(f"{url}/retrieve", {"queries": ["capital"], "topk": 6}))
    assert (status, body["error"]) == (
        400,
        '"topk" 6 is over this server\'s limit of 5 passages per query; ask for at most 5 '
        "(the server's --max-topk raises the limit)",
    )
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=20) as idle:
        assert idle.recv(1) == b""  # closed by the server, never used


@pytest.mark.slow
def test_cli_serves_and_stops_gracefully(corpus_file, tmp_path):
    process, url = start_cli(
        "retrieval", "--corpus", str(corpus_file), "--topk", "1", *LIMITS, cache=tmp_path / "cache"
    )
    try:
        hits = asyncio.run(RemoteSearch(url).search("Ontario province", 3))
        assert [h.title for h in hits] == ["Toronto"]
        default_topk = asyncio.run(post(f"{url}/retrieve", {"queries": ["capital"]}))[1]
        assert len(default_topk["result"][0]) == 1
        assert_limits_apply(url)
    finally:
        code, err = stop_cli(process)
    assert code == 0
    assert (
        "Indexing 4 passages (bm25)…" in err
        and "Stopping retrieval (bm25, 4 passages): finishing requests in flight" in err
    )


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")  # a zombie has exited


def worker_pids(url: str, workers: int) -> set[int]:
    """The pids that answer /health, asked on fresh connections until each worker has answered."""
    pids: set[int] = set()
    for _ in range(200):
        health = asyncio.run(get_json(f"{url}/health"))
        assert health["workers"] == workers
        pids.add(health["pid"])
        if len(pids) == workers:
            break
    return pids


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def listening_children(parent: int, url: str) -> set[int]:
    """The child processes of ``parent`` that hold a socket listening on ``url``'s port (from /proc)."""
    port = f"{int(url.rsplit(':', 1)[1]):04X}"
    listening = {  # /proc/net/tcp rows: local address (hex ip:port), state (0A: LISTEN), ..., inode
        f"socket:[{fields[9]}]"
        for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
        if (fields := line.split())[1].endswith(f":{port}") and fields[3] == "0A"
    }
    children = set()
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if f"PPid:\t{parent}\n" in status.read_text():
                pid = int(status.parent.name)
                if any(os.readlink(fd) in listening for fd in (status.parent / "fd").iterdir()):
                    children.add(pid)
        except OSError:  # a process that ended meanwhile
            continue
    return children


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads process states and sockets from /proc")
@pytest.mark.parametrize("reuse_port", [True, False], ids=["own-sockets", "shared-socket"])
def test_cli_workers_share_the_port_and_stop_together(corpus_file, tmp_path, reuse_port):
    # Without SO_REUSEPORT balancing (not Linux) the workers accept from the parent's socket.
    serve = "import sys, agentenv.serve.hosting as h; h.REUSE_PORT = False; from agentenv.serve.__main__ import main; sys.exit(main())"
    process, url = start_cli(
        "retrieval",
        "--corpus",
        str(corpus_file),
        "--workers",
        "2",
        *LIMITS,
        cache=tmp_path / "cache",
        python=("-m", "agentenv.serve") if reuse_port else ("-c", serve),
    )
    try:
        # Both workers listen on the port. Which one a new connection reaches is the kernel's choice:
        # SO_REUSEPORT spreads fresh connections over the sockets by their addresses; from a shared
        # socket the worker that is idle when it arrives takes it (and asyncio takes all that wait).
        pids = listening_children(process.pid, url)
        assert len(pids) == 2 and process.pid not in pids
        if reuse_port:
            assert worker_pids(url, 2) == pids
        health = asyncio.run(get_json(f"{url}/health"))
        assert health["workers"] == 2 and health["pid"] in pids
        hits = asyncio.run(RemoteSearch(url).search("Ontario province", 3))
        assert [h.title for h in hits] == ["Toronto"]
        assert_limits_apply(url)  # the worker that answers has the options the CLI was given
    finally:
        code, err = stop_cli(process)
    assert code == 0
    assert "Stopping retrieval (bm25, 4 passages, 2 workers): finishing requests in flight" in err
    assert not any(alive(pid) for pid in pids)


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_workers_stop_when_their_parent_dies(corpus_file, tmp_path):
    process, url = start_cli("retrieval", "--corpus", str(corpus_file), "--workers", "2", cache=tmp_path / "cache")
    try:
        pids = worker_pids(url, 2)
    finally:
        process.kill()
        process.communicate()
    deadline = time.monotonic() + 20
    while any(alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in pids)


def replaced(url: str, gone: int, process: subprocess.Popen) -> set[int]:
    """The two workers' pids once ``gone`` has been replaced (empty if the server exited meanwhile)."""
    deadline = time.monotonic() + 60
    while process.poll() is None and time.monotonic() < deadline:
        try:
            pids = worker_pids(url, 2)
        except aiohttp.ClientError:  # the dead worker's connection, or none listening for a moment
            continue
        if len(pids) == 2 and gone not in pids:
            return pids
    return set()


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_a_killed_worker_is_replaced_on_the_port_and_young_deaths_in_a_row_stop_the_server(corpus_file, tmp_path):
    process, url = start_cli("retrieval", "--corpus", str(corpus_file), "--workers", "2", cache=tmp_path / "cache")
    try:
        pids = worker_pids(url, 2)
        for death in range(3):  # more young deaths in a row than workers: a crash loop
            victim = min(pids)
            os.kill(victim, signal.SIGKILL)
            pids = replaced(url, victim, process)
            if death < 2:
                assert len(pids) == 2 and victim not in pids
                hits = asyncio.run(RemoteSearch(url).search("Ontario province", 3))
                assert hits[0].title == "Toronto"  # served as before
        assert process.wait(timeout=30) == 1
    finally:
        code, err = stop_cli(process) if process.poll() is None else (process.returncode, process.stderr.read())
    assert code == 1
    assert err.count("starting another") == 2 and "retrieval (bm25, 4 passages, 2 workers): worker " in err
    assert "3 workers in a row died within 10 s of starting, a crash loop" in err


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads process states from /proc")
def test_searches_in_flight_on_a_killed_worker_are_answered_by_their_retries(corpus_file, tmp_path):
    process, url = start_cli("retrieval", "--corpus", str(corpus_file), "--workers", "2", cache=tmp_path / "cache")
    try:
        victim = min(worker_pids(url, 2))
        os.kill(victim, signal.SIGSTOP)  # its connections wait in its queue, unanswered

        async def searches_through_a_kill() -> tuple[int, list]:
            client = RemoteSearch(url, backoff=0.05)
            # 16 connections at once, spread over the two workers' sockets by the kernel: all 16 on the live
            # one has odds of 1 in 65536
            tasks = [asyncio.create_task(client.search("Ontario province", 3)) for _ in range(16)]
            await asyncio.sleep(1.0)
            waiting = sum(not task.done() for task in tasks)
            os.kill(victim, signal.SIGKILL)  # their connections are reset: each search tries again
            return waiting, await asyncio.gather(*tasks)

        waiting, answers = asyncio.run(searches_through_a_kill())
        assert waiting > 0
        assert [hits[0].title for hits in answers] == ["Toronto"] * 16
        assert len(replaced(url, victim, process)) == 2  # the two live workers, the victim not among them
    finally:
        code, err = stop_cli(process)
    assert code == 0
    assert f"retrieval (bm25, 4 passages, 2 workers): worker {victim} exited with status -9; starting another" in err


def test_cli_workers_report_a_taken_port(corpus_file, capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert serve_main(["retrieval", "--corpus", str(corpus_file), "--workers", "2", "--port", str(port)]) == 1
    assert f"error: cannot listen on 127.0.0.1:{port}: Address already in use" in capsys.readouterr().err


def test_cli_reports_bad_corpus_and_arguments(tmp_path, capsys):
    assert serve_main(["retrieval", "--corpus", str(tmp_path / "none.jsonl")]) == 2
    assert capsys.readouterr().err == f"error: no such corpus file: {tmp_path / 'none.jsonl'}\n"
    for args, error in [
        (["--topk", "0"], "--topk must be between 1 and --max-topk (100)"),
        (["--topk", "5", "--max-topk", "4"], "--topk must be between 1 and --max-topk (4)"),
        (["--max-topk", "0"], "--max-topk must be a whole number of at least 1, got 0"),
        (["--max-response-bytes", "-1"], "--max-response-bytes must be a whole number of at least 1, got -1"),
        (["--keepalive-timeout", "0"], "--keepalive-timeout must be above 0"),
        (["--workers", "0"], "--workers must be at least 1"),
        (["--batch-window-ms", "-1"], "--batch-window-ms must be between 0 and 1000"),
        (["--max-batch-queries", "0"], "--max-batch-queries must be at least 1"),
    ]:
        with pytest.raises(SystemExit) as e:
            serve_main(["retrieval", *args])
        assert e.value.code == 2 and error in capsys.readouterr().err


@pytest.mark.slow
async def test_dense_retrieval_finds_meaning_not_words(serve, tmp_path, monkeypatch):
    from agentenv.serve.dense import DenseSearch

    monkeypatch.setenv("AGENTENV_CACHE", str(tmp_path))
    passages = [
        Paragraph("Cats", "Domestic felines purr and chase mice."),
        Paragraph("Cars", "Automobiles have four wheels and an engine."),
        Paragraph("Rain", "Precipitation falls from clouds as water droplets."),
    ]
    dense = DenseSearch(passages)
    assert not dense.loaded_from_cache and dense.embeddings.shape == (3, 384)
    hits = dense.search_sync("kitten", 2)  # shares no word with the passages
    assert [h.title for h in hits] == ["Cats", "Cars"] and hits[0].score > hits[1].score
    again = DenseSearch(passages)  # embedded once, then read from disk
    assert again.loaded_from_cache and (again.embeddings == dense.embeddings).all()
    [cached] = (tmp_path / "dense").iterdir()
    cached.write_bytes(cached.read_bytes()[:200])  # a file cut short is encoded again, not served
    rebuilt = DenseSearch(passages)
    assert not rebuilt.loaded_from_cache and (rebuilt.embeddings == dense.embeddings).all()
    assert DenseSearch(passages).loaded_from_cache

    service = RetrievalService(passages, index=dense, batch_window_ms=50)
    url = await serve(service.make_app())
    status, body = await post(f"{url}/retrieve", {"queries": ["vehicle", "weather"], "topk": 1, "return_scores": True})
    assert [r[0]["document"]["title"] for r in body["result"]] == ["Cars", "Rain"]
    assert 0 < body["result"][0][0]["score"] <= 1  # cosine similarity

    # concurrent requests are encoded in one forward pass, and answered as each query alone
    queries = ["kitten", "vehicle", "weather", "kitten", "a car in the rain"]
    answers = await asyncio.gather(
        *(post(f"{url}/retrieve", {"queries": [q], "topk": 2, "return_scores": True}) for q in queries)
    )
    for q, (_, body) in zip(queries, answers):
        alone = dense.search_sync(q, 2)
        assert [d["document"]["title"] for d in body["result"][0]] == [h.title for h in alone]
        assert [d["score"] for d in body["result"][0]] == pytest.approx([h.score for h in alone], abs=1e-5)
    assert service.rankings < service.requests == len(queries) + 1
