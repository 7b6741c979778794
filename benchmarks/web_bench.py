"""Search throughput: the retrieval server batching concurrent requests, beside the same server unbatched.

    python -m benchmarks.web_bench [--json PATH] [--sizes 20000 200000] [--clients 1 32 128]
        [--workers N] [--queries 960] [--cold]

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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

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
    import aiohttp

    async with aiohttp.ClientSession() as session, session.get(f"{url}/health") as response:
        return await response.json()


@contextmanager
def server(corpus: Path, env: dict[str, str], *options: str) -> Iterator[str]:
    """A ``python -m agentenv.serve retrieval`` process; yields its URL, stops it with SIGTERM."""
    process = subprocess.Popen(
        [sys.executable, "-m", "agentenv.serve", "retrieval", "--corpus", str(corpus), "--port", "0", *options],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        assert process.stdout is not None
        banner = process.stdout.readline()
        if not banner.startswith("Serving"):
            raise RuntimeError(f"the retrieval server {' '.join(options)} did not start: {banner!r}")
        yield banner.split(" on ", 1)[1].split()[0]
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
        with server(corpus, env, "--batch-window-ms", "0", "--workers", "1") as url:
            health = asyncio.run(_health(url))
            result["build_s"], result["unbatched_peak_rss_mb"] = health["build_seconds"], health["peak_rss_mb"]
            result["unbatched"] = bench_modes(url, queries, clients)
        with server(corpus, env, "--workers", str(workers)) as url:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--sizes", type=int, nargs="+", default=[20_000, 200_000], help="corpus sizes (passages)")
    parser.add_argument("--clients", type=int, nargs="+", default=list(CLIENTS), help="concurrent clients (1 32 128)")
    parser.add_argument("--workers", type=int, default=WORKERS, help=f"batched server processes (default {WORKERS})")
    parser.add_argument("--queries", type=int, default=960, help="queries per measurement (default 960)")
    parser.add_argument("--cold", action="store_true", help="build every index in a fresh cache (times the build)")
    args = parser.parse_args()
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
