"""``python -m agentenv.serve``: the retrieval server and the offline web.

    python -m agentenv.serve retrieval --corpus wiki-18.jsonl [--index bm25|dense] [--port 8000]
    python -m agentenv.serve web --corpus passages.jsonl [--port 8080]

Without ``--corpus`` both serve the pooled paragraphs of the shipped multi-hop QA sets.
``--port 0`` picks a free port; the first line printed says where the server listens.
SIGINT or SIGTERM stops it gracefully.
"""

from __future__ import annotations

import argparse
import asyncio
import sys

from agentenv.datasets import DatasetError, union_corpus
from agentenv.search import load_corpus
from agentenv.serve.hosting import run_until_signal
from agentenv.serve.retrieval import DEFAULT_TOPK, MAX_TOPK, RetrievalService, read_corpus
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
    retrieval.add_argument("--index", choices=("bm25", "dense"), default="bm25", help="retriever (default bm25)")
    retrieval.add_argument(
        "--topk",
        type=int,
        default=DEFAULT_TOPK,
        help=f"passages per query when a request does not say (default {DEFAULT_TOPK})",
    )
    retrieval.add_argument("--model", help="dense model folder (default: the bundled all-MiniLM-L6-v2)")
    args = parser.parse_args(argv)
    if args.server == "retrieval" and not 1 <= args.topk <= MAX_TOPK:
        parser.error(f"--topk must be between 1 and {MAX_TOPK}")

    try:
        if args.server == "retrieval":
            passages, ids = read_corpus(args.corpus) if args.corpus else (union_corpus(), None)
            print(f"Indexing {len(passages):,} passages ({args.index})…", file=sys.stderr, flush=True)
            service = RetrievalService(passages, ids, index=args.index, topk=args.topk, model=args.model)
            print(f"Index ready in {service.build_seconds:.1f} s", file=sys.stderr, flush=True)
            app, name = service.make_app(), f"retrieval ({args.index}, {len(passages):,} passages)"
        else:
            site = LocalWeb(load_corpus(args.corpus) if args.corpus else union_corpus())
            app, name = site.make_app(), f"offline web ({len(site.articles):,} articles)"
    except (DatasetError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        asyncio.run(run_until_signal(app, host=args.host, port=args.port, name=name))
    except OSError as e:  # the port is taken, or the address is not this machine's
        print(f"error: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
