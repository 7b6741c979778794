"""Our retrieval server, spoken to as Search-R1's client speaks to its server; its CLI; dense retrieval."""

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import msgpack
import pytest

from agentenv.datasets import Paragraph
from agentenv.serve.__main__ import main as serve_main
from agentenv.serve.retrieval import RetrievalService, read_corpus
from agentenv.web_search import RemoteSearch

ROOT = Path(__file__).resolve().parents[2]
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
        ({"queries": ["q"], "topk": 0}, '"topk" must be an integer from 1 to 100, got 0'),
        ({"queries": ["q"], "topk": 101}, '"topk" must be an integer from 1 to 100, got 101'),
        ({"queries": ["q"], "topk": "3"}, "\"topk\" must be an integer from 1 to 100, got '3'"),
        ({"queries": ["q"], "topk": True}, '"topk" must be an integer from 1 to 100, got True'),
        ({"queries": ["q"], "return_scores": "yes"}, "\"return_scores\" must be true or false, got 'yes'"),
    ],
)
async def test_bad_requests_get_clear_errors(server, payload, error):
    assert await post(f"{server}/retrieve", payload) == (400, {"error": error})


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
    with pytest.raises(ValueError, match="topk must be between 1 and 100, got 0"):
        RetrievalService([Paragraph("A", "a")], topk=0)


def start_cli(*args: str, cache: Path) -> tuple[subprocess.Popen, str]:
    """``python -m agentenv.serve ARGS --port 0``: the process and the URL from its first line."""
    process = subprocess.Popen(
        [sys.executable, "-m", "agentenv.serve", *args, "--port", "0"],
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


@pytest.mark.slow
def test_cli_serves_and_stops_gracefully(corpus_file, tmp_path):
    process, url = start_cli("retrieval", "--corpus", str(corpus_file), "--topk", "1", cache=tmp_path / "cache")
    try:
        hits = asyncio.run(RemoteSearch(url).search("Ontario province", 3))
        assert [h.title for h in hits] == ["Toronto"]
        default_topk = asyncio.run(post(f"{url}/retrieve", {"queries": ["capital"]}))[1]
        assert len(default_topk["result"][0]) == 1
    finally:
        code, err = stop_cli(process)
    assert code == 0
    assert (
        "Indexing 4 passages (bm25)…" in err
        and "Stopping retrieval (bm25, 4 passages): finishing requests in flight" in err
    )


def test_cli_reports_bad_corpus_and_arguments(tmp_path, capsys):
    assert serve_main(["retrieval", "--corpus", str(tmp_path / "none.jsonl")]) == 2
    assert capsys.readouterr().err == f"error: no such corpus file: {tmp_path / 'none.jsonl'}\n"
    with pytest.raises(SystemExit) as e:
        serve_main(["retrieval", "--topk", "0"])
    assert e.value.code == 2 and "--topk must be between 1 and 100" in capsys.readouterr().err


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

    url = await serve(RetrievalService(passages, index=dense).make_app())
    status, body = await post(f"{url}/retrieve", {"queries": ["vehicle", "weather"], "topk": 1, "return_scores": True})
    assert [r[0]["document"]["title"] for r in body["result"]] == ["Cars", "Rain"]
    assert 0 < body["result"][0][0]["score"] <= 1  # cosine similarity
