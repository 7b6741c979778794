"""Browsing hostile pages: how long one ``browse`` step takes, against its timeout, and its memory.

    python -m benchmarks.browse_bench [--json PATH] [--timeout 5] [--cases cells unclosed-p ...]

Each page is served on 127.0.0.1 and opened through ``env.step`` of ``web-research``
(``allow_private_urls=True``, ``browse_timeout=--timeout``), as issue 40 measured it, each case in
a fresh interpreter so that its peak memory is its own. The pages:

- ``article``: a short article, the ordinary case;
- ``cells``: the issue's page, one table row of 10^5 cells (1 MB);
- ``unclosed-p``: 2 MB of unclosed ``<p>`` (500,000 paragraphs);
- ``spans``: 20,000 cells each spanning 100 × 100;
- ``tables``: 2 MB of one-cell tables (trafilatura's paragraph rescue is quadratic in them).

The table gives the step's seconds, the budget (``browse_timeout`` + 1 s), the peak resident memory
of the process, and the observation's note.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

PAGES = {
    "article": lambda: (
        "<html><head><title>Article</title></head><body><article>"
        + "<p>The Eiffel Tower is a wrought-iron lattice tower in Paris. </p>" * 20
        + "</article></body></html>"
    ),
    "cells": lambda: "<html><body><table><tr>" + "<td>x</td>" * 100_000 + "</tr></table></body></html>",
    "unclosed-p": lambda: "<html><body>" + "<p>x" * 500_000,
    "spans": lambda: (
        "<html><body><table>"
        + ("<tr>" + "<td rowspan=100 colspan=100>x</td>" * 100 + "</tr>") * 200
        + "</table></body></html>"
    ),
    "tables": lambda: "<html><body>" + "<table><tr><td>x</td></tr></table>" * 57_000,
}


def serve(body: bytes) -> str:
    """Serve ``body`` as text/html on 127.0.0.1 from a daemon thread; its URL."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Type", "text/html; charset=utf-8")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/page"


def run_case(name: str, timeout: float) -> dict[str, Any]:
    """One browse step on the page ``name``, in this process."""
    import agentenv

    html = PAGES[name]().encode()
    url = serve(html)
    env = agentenv.make("web-research", allow_private_urls=True, browse_timeout=timeout)
    env.reset(options={"index": 0})
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    observation = env.step(f"<browse>{url}</browse>")[0]
    seconds = time.perf_counter() - start
    note = next((line[6:] for line in observation.splitlines()[:4] if line.startswith("Note: ")), "")
    env.close()
    return {
        "case": name,
        "page_bytes": len(html),
        "step_s": round(seconds, 2),
        "budget_s": timeout + 1,
        "within_budget": seconds <= timeout + 1,
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "rss_before_mb": round(rss_before),
        "note": note,
        "observation_chars": len(observation),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", nargs="+", default=list(PAGES), choices=list(PAGES))
    parser.add_argument("--timeout", type=float, default=5.0, help="browse_timeout (the issue measured 5)")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in this process (the child's job)
    args = parser.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.timeout)))
        return
    rows = []
    print(f"{'case':<11} {'page':>9} {'step s':>7} {'budget':>7} {'peak RSS':>9}  note")
    for name in args.cases:
        child = [sys.executable, "-m", "benchmarks.browse_bench", "--case", name, "--timeout", str(args.timeout)]
        done = subprocess.run(child, capture_output=True, text=True, check=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append(row)
        print(
            f"{name:<11} {row['page_bytes'] / 1e6:>7.2f}MB {row['step_s']:>7.2f} {row['budget_s']:>7.1f} "
            f"{row['peak_rss_mb']:>7}MB  {row['note'] or '-'}",
            flush=True,
        )
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
