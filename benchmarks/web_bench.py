"""Search throughput: the local BM25 index and the retrieval server, concurrent clients beside a sequential one.

    python -m benchmarks.web_bench [--json PATH] [--sizes 20000 200000] [--queries 320]

For each corpus size (the shipped multi-hop paragraphs, 9,490 of them, repeated with distinct
ids) it measures:

- the index build: the retrieval server (a real ``python -m agentenv.serve retrieval`` process)
  builds it cold; its time and the server's peak resident memory come from ``GET /health``;
- queries per second and p50/p99 latency of the in-process index, one query at a time;
- the server with one sequential client (the obvious alternative), with 32 concurrent clients,
  and with one client sending batches of 32 queries per request; the ratios to the sequential
  client are the speed-ups.

The clients are :class:`agentenv.web_search.RemoteSearch`, as environments use it. Queries are
real questions (NQ and HotpotQA), top-3 passages each.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from agentenv.datasets import load_examples, union_corpus
from agentenv.search import BM25Search, load_corpus
from agentenv.web_search import RemoteSearch

TOPK = 3  # passages per query, as AT²PO and Search-R1
CONCURRENCY = 32  # concurrent clients, or queries per batched request
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


async def bench_server(url: str, queries: list[str], *, clients: int, batch: int) -> dict[str, float]:
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


async def _health(url: str) -> dict[str, float]:
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(f"{url}/health") as response:
        return await response.json()


def bench_size(size: int, queries: list[str]) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        rows = make_corpus(size)
        corpus.write_text("".join(json.dumps(r) + "\n" for r in rows))
        env = {**os.environ, "AGENTENV_CACHE": str(Path(tmp) / "cache")}  # cold: nothing cached yet
        server = subprocess.Popen(
            [sys.executable, "-m", "agentenv.serve", "retrieval", "--corpus", str(corpus), "--port", "0"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        try:
            banner = server.stdout.readline()
            if not banner.startswith("Serving"):
                raise RuntimeError(f"the retrieval server did not start: {banner!r}")
            url = banner.split(" on ", 1)[1].split()[0]
            health = asyncio.run(_health(url))
            result: dict[str, object] = {
                "passages": size,
                "build_s": health["build_seconds"],
                "server_peak_rss_mb": health["peak_rss_mb"],
            }
            passages = load_corpus(corpus)  # exactly what the server indexed, so its cached index is found
            previous = os.environ.get("AGENTENV_CACHE")
            os.environ["AGENTENV_CACHE"] = env["AGENTENV_CACHE"]  # the in-process index loads what the server built
            try:
                start = time.perf_counter()
                index = BM25Search(passages)
                result["load_cached_s"] = time.perf_counter() - start
            finally:
                if previous is None:
                    del os.environ["AGENTENV_CACHE"]
                else:
                    os.environ["AGENTENV_CACHE"] = previous
            result["local_sequential"] = bench_local(index, queries)
            result["server_sequential"] = asyncio.run(bench_server(url, queries, clients=1, batch=1))
            result["server_concurrent"] = asyncio.run(bench_server(url, queries, clients=CONCURRENCY, batch=1))
            result["server_batched"] = asyncio.run(bench_server(url, queries, clients=1, batch=CONCURRENCY))
        finally:
            server.terminate()
            server.wait(timeout=30)
    sequential = result["server_sequential"]["qps"]  # type: ignore[index]
    result["concurrent_over_sequential"] = result["server_concurrent"]["qps"] / sequential  # type: ignore[index]
    result["batched_over_sequential"] = result["server_batched"]["qps"] / sequential  # type: ignore[index]
    return result


def print_table(results: list[dict[str, object]]) -> None:
    print(f"{'passages':>9}  {'mode':<34}{'queries/s':>10}{'p50 ms':>9}{'p99 ms':>9}{'vs seq':>8}")
    labels = {
        "local_sequential": "local index, one at a time",
        "server_sequential": "server, 1 sequential client",
        "server_concurrent": f"server, {CONCURRENCY} concurrent clients",
        "server_batched": f"server, {CONCURRENCY} queries per request",
    }
    for r in results:
        base = r["server_sequential"]["qps"]  # type: ignore[index]
        for key, label in labels.items():
            s = r[key]  # type: ignore[index]
            ratio = f"{s['qps'] / base:>7.2f}x" if key.startswith("server") else ""
            print(f"{r['passages']:>9,}  {label:<34}{s['qps']:>10.0f}{s['p50_ms']:>9.1f}{s['p99_ms']:>9.1f}{ratio}")
        print(
            f"{'':>9}  index build {r['build_s']:.1f} s (cold), load from cache {r['load_cached_s']:.1f} s, "
            f"server peak memory {r['server_peak_rss_mb']:.0f} MB"
        )
    print(f"(latency is per request: one query, or {CONCURRENCY} in the batched mode)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--sizes", type=int, nargs="+", default=[20_000, 200_000], help="corpus sizes (passages)")
    parser.add_argument("--queries", type=int, default=320, help="queries per measurement (default 320)")
    args = parser.parse_args()
    queries = questions(args.queries)
    results = [bench_size(size, queries) for size in args.sizes]
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
