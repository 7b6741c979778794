"""Search throughput: the retrieval server batching concurrent requests, beside the same server unbatched.

    python -m benchmarks.web_bench [--json PATH] [--sizes 20000 200000] [--clients 1 32 128]
        [--workers N] [--queries 960] [--cold]
    python -m benchmarks.web_bench --limits [--json PATH] [--seconds 10] [--server-root DIR]

For each corpus size (the shipped multi-hop paragraphs, 9,490 of them, repeated with distinct
ids) it starts two real ``python -m agentenv.serve retrieval`` processes over the same corpus:

- unbatched, the alternative: ``--batch-window-ms 0 --workers 1``, every request ranked on its own;
- batched: the default batch window, ``--workers N`` processes sharing the memory-mapped index
  (default: half the CPUs, at most 4, since the clients need CPU too).

Each serves 1, 32 and 128 concurrent clients (each client sends one query, waits for the
answer, sends the next), then one client sending 32 queries per request; the table gives
queries per second, p50 and p99 latency per request, and the ratio batched/unbatched. The
in-process index answering one query at a time is measured too. The clients are
:class:`agentenv.web_search.RemoteSearch`, as environments use it, all in the benchmark's process
(so the numbers include its cost, on the same machine). Queries are real questions (NQ and HotpotQA), top-3 passages
each.

The index is built once per corpus and kept in the agentenv cache, so a second run skips the
build (about a minute at 200k passages on 2 cores); ``--cold`` uses a fresh cache to time it.
The unbatched server builds (or loads) the index; its time and peak memory come from ``GET /health``.

``--limits`` measures instead what hostile requests cost one default server (the shipped
passages, one worker), and its load: the 17 KB amplification request (128 broad queries at topk
10⁹) and the largest request the limits allow, each with its time, answer size and the server's
memory (from ``/proc``); how long a one-word query from another client waits while requests of
maximum-length queries are ranked (two clients each sending 1,024 queries of 4,096 characters)
and behind one 10 MB query; the server's CPU time after a client of such a request leaves; when
an idle connection is closed; and 64 clients for ``--seconds`` (1 to 4 real questions a request,
topk 1 to 5), every answer checked against the in-process index. ``--server-root DIR`` runs the
server from another checkout (``git archive COMMIT agentenv | tar -x -C DIR``), for a before.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import aiohttp

from agentenv.cache import cache_dir
from agentenv.datasets import load_examples, union_corpus
from agentenv.search import BM25Search, load_corpus
from agentenv.web_search import RemoteSearch

TOPK = 3  # passages per query, as AT²PO and Search-R1
CLIENTS = (1, 32, 128)
PER_REQUEST = 32  # queries per request in the client-side batching mode
WORKERS = min(4, max(1, (os.cpu_count() or 1) // 2))  # batched server processes; the clients need CPU too
WARMUP = 64  # queries sent to each server before measuring
ROOT = Path(__file__).resolve().parents[1]


def make_corpus(size: int) -> list[dict[str, str]]:
    """``size`` rows of Search-R1's ``{id, contents}``: the shipped paragraphs, repeated with distinct ids."""
    base = union_corpus()
    return [
        {"id": f"{i}", "contents": f'"{base[i % len(base)].title}"\n{base[i % len(base)].text}'} for i in range(size)
    ]


def questions(n: int) -> list[str]:
    pool = [e.question for name in ("nq", "hotpotqa") for e in load_examples(name)]
    return [pool[i % len(pool)] for i in range(n)]


def _stats(latencies_s: list[float], queries: int, elapsed_s: float) -> dict[str, float]:
    ms = sorted(x * 1e3 for x in latencies_s)
    return {
        "qps": queries / elapsed_s,
        "p50_ms": statistics.median(ms),
        "p99_ms": ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))],
        "requests": len(ms),
    }


def bench_local(index: BM25Search, queries: list[str]) -> dict[str, float]:
    latencies = []
    start = time.perf_counter()
    for q in queries:
        t = time.perf_counter()
        index.search_sync(q, TOPK)
        latencies.append(time.perf_counter() - t)
    return _stats(latencies, len(queries), time.perf_counter() - start)


async def bench_server(url: str, queries: list[str], *, clients: int, batch: int = 1) -> dict[str, float]:
    client = RemoteSearch(url, timeout=120)
    requests = iter([queries[i : i + batch] for i in range(0, len(queries), batch)])
    latencies: list[float] = []

    async def worker() -> None:
        for chunk in requests:  # the workers share one iterator: each request is sent once
            t = time.perf_counter()
            await client.search_batch(chunk, TOPK)
            latencies.append(time.perf_counter() - t)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    return _stats(latencies, len(queries), time.perf_counter() - start)


async def _health(url: str) -> dict[str, Any]:
    async with aiohttp.ClientSession() as session, session.get(f"{url}/health") as response:
        return await response.json()


@contextmanager
def server(corpus: Path | None, env: dict[str, str], *options: str, root: Path = ROOT) -> Iterator[tuple[str, int]]:
    """A ``python -m agentenv.serve retrieval`` process of the checkout at ``root`` (default corpus:
    the shipped passages); yields its URL and pid, stops it with SIGTERM."""
    corpus_option = ["--corpus", str(corpus)] if corpus is not None else []
    process = subprocess.Popen(
        [sys.executable, "-m", "agentenv.serve", "retrieval", *corpus_option, "--port", "0", *options],
        cwd=root,
        env={**env, "PYTHONPATH": str(root)},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stdout is not None
        banner = process.stdout.readline()
        if not banner.startswith("Serving"):
            raise RuntimeError(f"the retrieval server {' '.join(options)} did not start: {banner!r}")
        yield banner.split(" on ", 1)[1].split()[0], process.pid
    finally:
        process.terminate()
        process.wait(timeout=30)


def bench_modes(url: str, queries: list[str], clients: tuple[int, ...]) -> dict[str, dict[str, float]]:
    asyncio.run(bench_server(url, queries[:WARMUP], clients=8))
    modes = {f"clients_{n}": asyncio.run(bench_server(url, queries, clients=n)) for n in clients}
    modes[f"per_request_{PER_REQUEST}"] = asyncio.run(bench_server(url, queries, clients=1, batch=PER_REQUEST))
    return modes


@contextmanager
def cache_at(path: Path | None) -> Iterator[dict[str, str]]:
    """The environment of this process (and of the servers) with ``AGENTENV_CACHE`` at ``path``, if given."""
    previous = os.environ.get("AGENTENV_CACHE")
    if path is not None:
        os.environ["AGENTENV_CACHE"] = str(path)
    try:
        yield dict(os.environ)
    finally:
        if previous is None:
            os.environ.pop("AGENTENV_CACHE", None)
        else:
            os.environ["AGENTENV_CACHE"] = previous


def bench_size(size: int, queries: list[str], *, clients: tuple[int, ...], workers: int, cold: bool) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp, cache_at(Path(tmp) / "cache" if cold else None) as env:
        corpus = Path(tmp) / "corpus.jsonl"
        corpus.write_text("".join(json.dumps(r) + "\n" for r in make_corpus(size)))
        passages = load_corpus(corpus)  # exactly what the servers index, so their cached index is found
        cached = (cache_dir("bm25") / BM25Search.content_key(passages) / "params.index.json").exists()
        result: dict[str, Any] = {
            "passages": size,
            "workers": workers,
            "cpus": os.cpu_count(),
            "load_average_before": os.getloadavg()[0],
            "index_was_cached": cached,
        }
        with server(corpus, env, "--batch-window-ms", "0", "--workers", "1") as (url, _):
            health = asyncio.run(_health(url))
            result["build_s"], result["unbatched_peak_rss_mb"] = health["build_seconds"], health["peak_rss_mb"]
            result["unbatched"] = bench_modes(url, queries, clients)
        with server(corpus, env, "--workers", str(workers)) as (url, _):
            result["batched"] = bench_modes(url, queries, clients)
            health = asyncio.run(_health(url))
            result["batch_window_ms"], result["batched_peak_rss_mb"] = health["batch_window_ms"], health["peak_rss_mb"]
        start = time.perf_counter()
        index = BM25Search(passages)
        result["load_cached_s"] = time.perf_counter() - start
        result["local_sequential"] = bench_local(index, queries)
    result["batched_over_unbatched"] = {
        mode: result["batched"][mode]["qps"] / result["unbatched"][mode]["qps"] for mode in result["batched"]
    }
    return result


def print_table(results: list[dict[str, Any]]) -> None:
    print(
        f"{'passages':>9}  {'mode':<30}{'unbatched q/s':>14}{'p50':>7}{'p99 ms':>8}{'batched q/s':>13}{'p50':>7}{'p99 ms':>8}{'ratio':>8}"
    )
    for r in results:
        for mode, ratio in r["batched_over_unbatched"].items():
            label = (
                f"{mode.split('_')[1]} concurrent clients"
                if mode.startswith("clients")
                else f"1 client, {PER_REQUEST} queries/request"
            )
            u, b = r["unbatched"][mode], r["batched"][mode]
            print(
                f"{r['passages']:>9,}  {label:<30}{u['qps']:>14.0f}{u['p50_ms']:>7.1f}{u['p99_ms']:>8.1f}"
                f"{b['qps']:>13.0f}{b['p50_ms']:>7.1f}{b['p99_ms']:>8.1f}{ratio:>7.2f}x"
            )
        local = r["local_sequential"]
        build = (
            f"index load {r['build_s']:.1f} s (cached)"
            if r["index_was_cached"]
            else f"index build {r['build_s']:.1f} s (cold)"
        )
        print(
            f"{'':>9}  in-process index, one query at a time: {local['qps']:.0f} q/s, p50 {local['p50_ms']:.2f} ms; {build}; "
            f"peak memory {r['unbatched_peak_rss_mb']:.0f} MB unbatched, {r['batched_peak_rss_mb']:.0f} MB per batched worker"
        )
    r = results[0]
    print(
        f"(unbatched: --batch-window-ms 0 --workers 1; batched: --batch-window-ms {r['batch_window_ms']:g} "
        f"--workers {r['workers']}; latency is per request; {r['cpus']} CPUs, load average {r['load_average_before']:.1f} "
        "before the run, clients on the same machine)"
    )


# -- hostile requests and load: --limits ---------------------------------------------------------

LOAD_CLIENTS = 64
IDLE_WAIT_S = 40.0  # past the server's default keep-alive timeout (30 s): "open" means never closed
PROBE_EVERY_S = 0.05  # how often the one-word client asks while a hostile request is ranked
SERVER_ERROR_CHARS = 160  # of an error message, in the results


def broad_queries(n: int, chars: int) -> list[str]:
    """``n`` distinct queries of ``chars`` characters made of the shipped passages' commonest words.

    Each matches most passages: the costliest queries to rank and to answer.
    """
    counts = Counter(w for p in union_corpus() for w in re.findall(r"[a-z]{4,}", p.text.lower()))
    words = [w for w, _ in counts.most_common(300)]
    queries = []
    for i in range(n):
        text, j = "", i
        while len(text) < chars:
            text += words[j % len(words)] + " "
            j += 1
        queries.append(text[:chars])
    return queries


def server_memory(pid: int) -> dict[str, float]:
    """The server's resident memory now and at its peak (``/proc/PID/status``), in MB."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024, "peak_rss_mb": int(fields["VmHWM"].split()[0]) / 1024}


def server_cpu_s(pid: int) -> float:
    """User and system CPU seconds the server has used (``/proc/PID/stat``)."""
    stat = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")


async def timed_post(session: aiohttp.ClientSession, url: str, payload: dict[str, Any]) -> dict[str, Any]:
    """Status, seconds, answer bytes and error of one request."""
    start = time.perf_counter()
    async with session.post(f"{url}/retrieve", json=payload) as response:
        body = await response.read()
    result: dict[str, Any] = {
        "status": response.status,
        "seconds": time.perf_counter() - start,
        "request_bytes": len(json.dumps(payload)),
        "response_bytes": len(body),
    }
    if response.status != 200:
        result["error"] = json.loads(body).get("error", "")[:SERVER_ERROR_CHARS]
    return result


async def one_word_waits(session: aiohttp.ClientSession, url: str, hostile: list[dict[str, Any]]) -> dict[str, Any]:
    """The hostile requests, each from a client of its own, and a one-word query asked every
    :data:`PROBE_EVERY_S` meanwhile (from 0.1 s after they were sent): how long it waited."""
    tasks = [asyncio.create_task(timed_post(session, url, payload)) for payload in hostile]
    await asyncio.sleep(0.1)  # the hostile requests are read and being ranked
    waits = []
    while not all(t.done() for t in tasks):
        waits.append((await timed_post(session, url, {"queries": ["capital"], "topk": 3}))["seconds"])
        await asyncio.sleep(PROBE_EVERY_S)
    answers = await asyncio.gather(*tasks)
    return {
        "hostile": answers[0],
        "hostile_clients": len(hostile),
        "one_word_asked": len(waits),
        "one_word_max_ms": max(waits, default=0) * 1e3,
        "one_word_p50_ms": statistics.median(waits) * 1e3 if waits else 0.0,
    }


async def cpu_after_leaving(url: str, pid: int, payload: dict[str, Any], *, after_s: float = 5.0) -> dict[str, Any]:
    """Server CPU seconds in the ``after_s`` after the client of ``payload`` left (0.3 s after sending it)."""

    async def send(session: aiohttp.ClientSession) -> None:
        async with session.post(f"{url}/retrieve", json=payload) as response:
            await response.read()

    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(send(session))
        await asyncio.sleep(0.3)
        task.cancel()  # the client leaves: its connection is closed
    left = server_cpu_s(pid)
    await asyncio.sleep(after_s)
    return {"server_cpu_s_after_leaving": server_cpu_s(pid) - left, "over_s": after_s}


def watch_idle(url: str) -> Callable[[], float | None]:
    """Opens a connection, asks ``/health`` on it, and watches it; the returned function waits
    until :data:`IDLE_WAIT_S` after it opened and gives the seconds until the server closed it (None: open)."""
    host, port = url.removeprefix("http://").split(":")
    sock = socket.create_connection((host, int(port)))
    opened = time.monotonic()
    sock.sendall(b"GET /health HTTP/1.1\r\nHost: bench\r\n\r\n")
    closed: list[float] = []

    def wait_for_close() -> None:
        sock.settimeout(IDLE_WAIT_S)
        with contextlib.suppress(OSError), sock:
            while sock.recv(65536):
                pass
            closed.append(time.monotonic() - opened)

    watcher = threading.Thread(target=wait_for_close, daemon=True)
    watcher.start()

    def result() -> float | None:
        watcher.join(IDLE_WAIT_S + 5)
        return closed[0] if closed else None

    return result


async def load(url: str, seconds: float) -> dict[str, Any]:
    """:data:`LOAD_CLIENTS` clients for ``seconds``: queries/s, latency per request, and answers that differ
    from the in-process index's over the same passages (which the server indexes by default)."""
    pool = questions(2_000)
    index = BM25Search(union_corpus())
    expected = {q: [str(i) for i, _ in hits] for q, hits in zip(pool, index.rank(pool, 5))}
    latencies: list[float] = []
    counts = {"queries": 0, "answers": 0, "mismatches": 0}

    async def client(session: aiohttp.ClientSession, seed: int, deadline: float) -> None:
        rng = random.Random(seed)
        while time.perf_counter() < deadline:
            queries, topk, scores = rng.sample(pool, rng.randint(1, 4)), rng.randint(1, 5), rng.random() < 0.5
            start = time.perf_counter()
            async with session.post(
                f"{url}/retrieve", json={"queries": queries, "topk": topk, "return_scores": scores}
            ) as r:
                result = (await r.json())["result"]
            latencies.append(time.perf_counter() - start)
            for q, docs in zip(queries, result, strict=True):
                ids = [(d["document"] if scores else d)["id"] for d in docs]
                counts["mismatches"] += ids != expected[q][:topk]
                counts["answers"] += 1
            counts["queries"] += len(queries)

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        start = time.perf_counter()
        deadline = start + seconds
        await asyncio.gather(*(client(session, seed, deadline) for seed in range(LOAD_CLIENTS)))
        elapsed = time.perf_counter() - start
    return {
        **_stats(latencies, counts["queries"], elapsed),
        **counts,
        "clients": LOAD_CLIENTS,
        "seconds": elapsed,
    }


async def hostile_requests(url: str, pid: int) -> dict[str, Any]:
    """Each hostile request's answer, with the server's memory after it."""
    amplification = {"queries": broad_queries(128, 130), "topk": 10**9}  # 17 KB
    at_the_cap = {"queries": broad_queries(102, 130), "topk": 100}  # 10,200 passages: the most allowed
    longest = broad_queries(1024, 4096)  # the most queries of the longest length allowed (4 MB)
    result: dict[str, Any] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as session:
        for name, payload in (("amplification_17kb", amplification), ("at_the_cap", at_the_cap)):
            result[name] = {**await timed_post(session, url, payload), **server_memory(pid)}
        async with session.post(f"{url}/retrieve", data=b"[" * 100_000 + b"]" * 100_000) as r:
            result["nested_json_1e5"] = {"status": r.status, "error": (await r.json())["error"][:SERVER_ERROR_CHARS]}
        async with session.post(f"{url}/retrieve", data=b"\xc1", headers={"Content-Type": "application/msgpack"}) as r:
            result["msgpack_0xc1"] = {"status": r.status, "error": (await r.json())["error"][:SERVER_ERROR_CHARS]}
        result["behind_two_longest_requests"] = await one_word_waits(
            session, url, [{"queries": longest, "topk": 3}] * 2
        )
        result["behind_a_10mb_query"] = await one_word_waits(
            session, url, [{"queries": [broad_queries(1, 10_000_000)[0]], "topk": 3}]
        )
    result["client_leaves"] = await cpu_after_leaving(url, pid, {"queries": longest, "topk": 3})
    result["memory_at_end"] = server_memory(pid)
    return result


def bench_limits(seconds: float, root: Path) -> dict[str, Any]:
    """Hostile requests, then the load, on one default server run from ``root``."""
    with cache_at(None) as env, server(None, env, root=root) as (url, pid):
        closed_after = watch_idle(url)
        result: dict[str, Any] = {
            "server_root": str(root),
            "cpus": os.cpu_count(),
            "load_average_before": os.getloadavg()[0],
            "passages": asyncio.run(_health(url))["passages"],
            "memory_at_start": server_memory(pid),
        }
        result.update(asyncio.run(hostile_requests(url, pid)))
        result["load"] = asyncio.run(load(url, seconds))
        result["idle_connection_closed_after_s"] = closed_after()
    return result


def print_limits(r: dict[str, Any]) -> None:
    """The table of :func:`bench_limits`."""
    print(f"retrieval server from {r['server_root']}: {r['passages']:,} passages, 1 worker, {r['cpus']} CPUs")
    print(f"{'request':<40}{'status':>7}{'seconds':>9}{'answer MB':>11}{'server RSS MB':>15}{'peak MB':>9}")
    for name in ("amplification_17kb", "at_the_cap"):
        a = r[name]
        print(
            f"{name:<40}{a['status']:>7}{a['seconds']:>9.2f}{a['response_bytes'] / 1e6:>11.1f}"
            f"{a['rss_mb']:>15.0f}{a['peak_rss_mb']:>9.0f}"
        )
    for name in ("nested_json_1e5", "msgpack_0xc1"):
        print(f"{name:<40}{r[name]['status']:>7}  {r[name]['error'][:90]!r}")
    for name in ("behind_two_longest_requests", "behind_a_10mb_query"):
        w = r[name]
        print(
            f"one-word query {name.replace('_', ' ')}: waited at most {w['one_word_max_ms']:.0f} ms "
            f"(p50 {w['one_word_p50_ms']:.0f} ms, {w['one_word_asked']} asked); the hostile request: "
            f"HTTP {w['hostile']['status']} in {w['hostile']['seconds']:.2f} s"
        )
    gone = r["client_leaves"]
    print(
        f"server CPU in the {gone['over_s']:g} s after the client of 1,024 × 4,096 characters left: "
        f"{gone['server_cpu_s_after_leaving']:.2f} s"
    )
    idle = r["idle_connection_closed_after_s"]
    print("idle connection: " + (f"closed after {idle:.1f} s" if idle else f"still open after {IDLE_WAIT_S:g} s"))
    ld = r["load"]
    print(
        f"load: {ld['clients']} clients, {ld['seconds']:.0f} s: {ld['qps']:,.0f} queries/s, p50 {ld['p50_ms']:.1f} ms, "
        f"p99 {ld['p99_ms']:.1f} ms per request, {ld['mismatches']} mismatches in {ld['answers']:,} answers "
        f"(load average before {r['load_average_before']:.1f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--sizes", type=int, nargs="+", default=[20_000, 200_000], help="corpus sizes (passages)")
    parser.add_argument("--clients", type=int, nargs="+", default=list(CLIENTS), help="concurrent clients (1 32 128)")
    parser.add_argument("--workers", type=int, default=WORKERS, help=f"batched server processes (default {WORKERS})")
    parser.add_argument("--queries", type=int, default=960, help="queries per measurement (default 960)")
    parser.add_argument("--cold", action="store_true", help="build every index in a fresh cache (times the build)")
    parser.add_argument("--limits", action="store_true", help="hostile requests and 64 clients' load, instead")
    parser.add_argument("--seconds", type=float, default=10.0, help="--limits: seconds of load (default 10)")
    parser.add_argument(
        "--server-root", type=Path, default=ROOT, help="--limits: the checkout the server runs from (default this one)"
    )
    args = parser.parse_args()
    if args.limits:
        limits = bench_limits(args.seconds, args.server_root.resolve())
        print_limits(limits)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(limits, f, indent=2)
        return
    queries = questions(args.queries)
    results = [
        bench_size(size, queries, clients=tuple(args.clients), workers=args.workers, cold=args.cold)
        for size in args.sizes
    ]
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
