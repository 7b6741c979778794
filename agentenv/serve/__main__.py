"""``python -m agentenv.serve``: the retrieval server and the offline web.

    python -m agentenv.serve retrieval --corpus wiki-18.jsonl [--index bm25|dense] [--port 8000]
        [--workers N] [--batch-window-ms 2] [--max-batch-queries 256] [--max-topk 100]
        [--max-results 10240] [--max-query-chars 4096] [--max-response-bytes 33554432]
        [--keepalive-timeout 30]
    python -m agentenv.serve web --corpus passages.jsonl [--port 8080] [--keepalive-timeout 30]

Without ``--corpus`` both serve the pooled paragraphs of the shipped multi-hop QA sets.
``--port 0`` picks a free port; the first line printed says where the server listens.
SIGINT or SIGTERM stops it gracefully.

The retrieval server ranks concurrent requests together: the first waiting request waits up to
``--batch-window-ms`` for others (``0``: each request on its own). With ``--workers N`` it
builds and caches the index once, then N processes serve the port, each memory-mapping the
index. One worker is the default: each also holds the corpus text and ids, so memory grows
with N, and the clients (rollout workers) usually need the other cores. A worker that dies is
replaced on the same port (a line on stderr; the clients retry the searches it held); more deaths
in a row of workers younger than 10 s than there are workers is a crash loop, which stops the
server with status 1. The ``--max-*`` options
bound what one request may ask (a request over one gets 400 naming it); a connection idle for
``--keepalive-timeout`` seconds is closed.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import sys
from collections.abc import Callable

from aiohttp.web import Application

from agentenv.datasets import DatasetError, union_corpus
from agentenv.search import load_corpus
from agentenv.serve.hosting import KEEPALIVE_TIMEOUT, run_until_signal, serve_workers
from agentenv.serve.retrieval import (
    DEFAULT_BATCH_WINDOW_MS,
    DEFAULT_MAX_BATCH_QUERIES,
    DEFAULT_TOPK,
    MAX_BATCH_WINDOW_MS,
    Limits,
    RetrievalService,
    read_corpus,
    worker_app,
)
from agentenv.serve.web import LocalWeb


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m agentenv.serve", description=__doc__.split("\n\n")[0])
    servers = parser.add_subparsers(dest="server", required=True)
    retrieval = servers.add_parser("retrieval", help="a Search-R1-compatible retrieval server (POST /retrieve)")
    web = servers.add_parser("web", help="the offline web: an HTML article per title, links, a search page")
    for sub, port in ((retrieval, 8000), (web, 8080)):
        sub.add_argument(
            "--corpus", help="JSONL/JSON of {title, text} or {id, contents} (default: the shipped multi-hop paragraphs)"
        )
        sub.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
        sub.add_argument("--port", type=int, default=port, help=f"port (default {port}; 0 picks a free one)")
        sub.add_argument(
            "--keepalive-timeout",
            type=float,
            default=KEEPALIVE_TIMEOUT,
            help=f"seconds before an idle connection is closed (default {KEEPALIVE_TIMEOUT:g})",
        )
    retrieval.add_argument("--index", choices=("bm25", "dense"), default="bm25", help="retriever (default bm25)")
    retrieval.add_argument(
        "--topk",
        type=int,
        default=DEFAULT_TOPK,
        help=f"passages per query when a request does not say (default {DEFAULT_TOPK})",
    )
    retrieval.add_argument("--model", help="dense model folder (default: the bundled all-MiniLM-L6-v2)")
    retrieval.add_argument(
        "--workers", type=int, default=1, help="processes serving the port, sharing one memory-mapped index (default 1)"
    )
    retrieval.add_argument(
        "--batch-window-ms",
        type=float,
        default=DEFAULT_BATCH_WINDOW_MS,
        help=f"how long a request waits for others to rank with (default {DEFAULT_BATCH_WINDOW_MS:g}; 0: no batching)",
    )
    retrieval.add_argument(
        "--max-batch-queries",
        type=int,
        default=DEFAULT_MAX_BATCH_QUERIES,
        help=f"queries ranked together at most (default {DEFAULT_MAX_BATCH_QUERIES})",
    )
    _limit_options(retrieval)
    args = parser.parse_args(argv)
    if args.keepalive_timeout <= 0:
        parser.error("--keepalive-timeout must be above 0")
    limits = _check_retrieval(parser, args) if args.server == "retrieval" else None

    make_app: Callable[[], Application] | None = None  # for worker processes, which build their own
    try:
        if args.server == "retrieval":
            passages, ids = read_corpus(args.corpus) if args.corpus else (union_corpus(), None)
            print(f"Indexing {len(passages):,} passages ({args.index})…", file=sys.stderr, flush=True)
            batching = {"batch_window_ms": args.batch_window_ms, "max_batch_queries": args.max_batch_queries}
            service = RetrievalService(
                passages, ids, index=args.index, topk=args.topk, model=args.model, limits=limits, **batching
            )
            print(f"Index ready in {service.build_seconds:.1f} s", file=sys.stderr, flush=True)
            name = f"retrieval ({args.index}, {len(passages):,} passages)"
            if args.workers == 1:
                app = service.make_app()
            else:  # the index is cached on disk now: each worker maps it and reads the corpus itself
                del service, passages, ids
                make_app = functools.partial(
                    worker_app,
                    args.corpus,
                    index=args.index,
                    topk=args.topk,
                    model=args.model,
                    workers=args.workers,
                    limits=limits,
                    **batching,
                )
                name = f"{name[:-1]}, {args.workers} workers)"
        else:
            site = LocalWeb(load_corpus(args.corpus) if args.corpus else union_corpus())
            app, name = site.make_app(), f"offline web ({len(site.articles):,} articles)"
    except (DatasetError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        where = {"host": args.host, "port": args.port, "name": name, "keepalive_timeout": args.keepalive_timeout}
        if make_app is not None:
            return serve_workers(make_app, args.workers, **where)
        asyncio.run(run_until_signal(app, **where))
    except OSError as e:  # the port is taken, or the address is not this machine's
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


def _check_retrieval(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Limits:
    """The retrieval server's limits from ``args``; a bad option exits with its usage error."""
    try:
        limits = Limits(**{name: getattr(args, name) for name in LIMIT_HELP})
    except ValueError as e:
        parser.error(f"--{str(e).replace('_', '-')}")
    if not 1 <= args.topk <= limits.max_topk:
        parser.error(f"--topk must be between 1 and --max-topk ({limits.max_topk})")
    if args.workers < 1:
        parser.error("--workers must be at least 1")
    if not 0 <= args.batch_window_ms <= MAX_BATCH_WINDOW_MS:
        parser.error(f"--batch-window-ms must be between 0 and {MAX_BATCH_WINDOW_MS:g}")
    if args.max_batch_queries < 1:
        parser.error("--max-batch-queries must be at least 1")
    return limits


LIMIT_HELP = {  # Limits' fields: what one request may ask
    "max_topk": "passages per query a request may ask for",
    "max_results": "passages per request (topk × queries)",
    "max_query_chars": "characters in one query",
    "max_response_bytes": "bytes in one answer",
}


def _limit_options(retrieval: argparse.ArgumentParser) -> None:
    """``--max-topk`` and the other :class:`Limits`, each defaulting to its field's default."""
    defaults = Limits()
    for name, help in LIMIT_HELP.items():
        default = getattr(defaults, name)
        retrieval.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=default, help=f"{help}, at most (default {default})"
        )


if __name__ == "__main__":
    sys.exit(main())
