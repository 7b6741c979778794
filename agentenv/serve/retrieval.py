"""A retrieval server over a passage corpus, wire-compatible with Search-R1's ``POST /retrieve``.

Request (JSON, or msgpack with ``Content-Type: application/msgpack``)::

    {"queries": ["what is python?", ...], "topk": 3, "return_scores": true}

(a single ``"query": "..."`` is accepted too). Response, in the request's format::

    {"result": [[{"document": {"id": "0", "contents": "\\"Title\\"\\ntext", "title": "Title",
                               "text": "text"}, "score": 12.3}, ...], ...]}

one list per query, best first; without ``return_scores`` each list holds the documents alone.
Documents carry Search-R1's ``id`` and ``contents`` (first line the quoted title) and also
``title`` and ``text``. ``GET /health`` reports the index. Bad requests get HTTP 400 with
``{"error": "..."}`` saying what to fix.
"""

from __future__ import annotations

import asyncio
import json
import resource
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import msgpack
from aiohttp import web

from agentenv.datasets import Paragraph, read_rows
from agentenv.search import BM25Search, Passage, load_corpus
from agentenv.serve.dense import DenseSearch

__all__ = ["RetrievalService", "read_corpus"]

DEFAULT_TOPK = 3  # Search-R1 and AT²PO retrieve 3 passages
MAX_TOPK = 100
MAX_QUERIES = 1024  # queries in one request
MAX_BODY_BYTES = 16 * 1024 * 1024
MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack")
EXAMPLE_REQUEST = '{"queries": ["..."], "topk": 3, "return_scores": true}'


def read_corpus(path: str | Path) -> tuple[list[Paragraph], list[str]]:
    """Passages (see :func:`agentenv.search.load_corpus`) and their ids: a row's ``id``, else its position."""
    passages = load_corpus(path)
    ids = [
        str(row["id"]) if isinstance(row, dict) and "id" in row else str(i)
        for i, (_, row) in enumerate(read_rows(Path(path)))
    ]
    return passages, ids


class RetrievalService:
    """An index over a corpus and the aiohttp application that serves it.

    Args:
        passages: The corpus.
        ids: One id per passage (default: positions ``"0"``, ``"1"``...).
        index: ``"bm25"`` (bm25s, cached on disk), ``"dense"`` (sentence-transformers, see
            :class:`~agentenv.serve.dense.DenseSearch`), or either index already built over ``passages``.
        topk: Passages per query when a request does not say.
        model: Dense model folder (default: the bundled all-MiniLM-L6-v2).
    """

    def __init__(
        self,
        passages: Sequence[Paragraph | Passage],
        ids: Sequence[str] | None = None,
        *,
        index: Literal["bm25", "dense"] | BM25Search | DenseSearch = "bm25",
        topk: int = DEFAULT_TOPK,
        model: str | Path | None = None,
    ) -> None:
        if not isinstance(index, BM25Search | DenseSearch) and index not in ("bm25", "dense"):
            raise ValueError(f"index must be 'bm25', 'dense' or a built BM25Search or DenseSearch, got {index!r}")
        if ids is not None and len(ids) != len(passages):
            raise ValueError(f"{len(ids)} ids for {len(passages)} passages")
        if not 1 <= topk <= MAX_TOPK:
            raise ValueError(f"topk must be between 1 and {MAX_TOPK}, got {topk}")
        self.topk = topk
        self.ids = list(ids) if ids is not None else [str(i) for i in range(len(passages))]
        start = time.perf_counter()
        if index == "dense":
            index = DenseSearch(passages, model=model)
        elif index == "bm25":
            index = BM25Search(passages)
        self.index: BM25Search | DenseSearch = index
        self.kind = "dense" if isinstance(index, DenseSearch) else "bm25"
        self.build_seconds = time.perf_counter() - start
        self._position = {(p.title, p.text): i for i, p in reversed(list(enumerate(passages)))}
        self._executor: ThreadPoolExecutor | None = None  # made per served application

    def retrieve(self, queries: Sequence[str], topk: int) -> list[list[Passage]]:
        """The ``topk`` passages for each query (blocking; the server runs it off the event loop)."""
        if isinstance(self.index, DenseSearch):
            return self.index.search_batch(queries, topk)
        return [self.index.search_sync(q, topk) for q in queries]

    def document(self, p: Passage) -> dict[str, str]:
        """A passage as Search-R1 returns it, plus ``title`` and ``text``."""
        return {
            "id": self.ids[self._position[(p.title, p.text)]],
            "contents": f'"{p.title}"\n{p.text}',
            "title": p.title,
            "text": p.text,
        }

    def health(self) -> dict[str, Any]:
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        return {
            "status": "ok",
            "index": self.kind,
            "passages": len(self.ids),
            "build_seconds": round(self.build_seconds, 3),
            "peak_rss_mb": round(peak_kib / 1024, 1),
        }

    # -- HTTP ----------------------------------------------------------------------------------

    def parse_request(self, payload: Any) -> tuple[list[str], int, bool]:
        """``(queries, topk, return_scores)`` from a request body; ValueError says what is wrong."""
        if not isinstance(payload, dict):
            raise ValueError(f"the request body must be an object like {EXAMPLE_REQUEST}")
        if "queries" in payload:
            queries = payload["queries"]
        elif "query" in payload:
            queries = [payload["query"]] if isinstance(payload["query"], str) else payload["query"]
        else:
            raise ValueError(f'the request needs "queries" (a list of strings), like {EXAMPLE_REQUEST}')
        if not isinstance(queries, list) or not all(isinstance(q, str) for q in queries):
            raise ValueError('"queries" must be a list of strings')
        if not queries:
            raise ValueError('"queries" is empty: send at least one query')
        if len(queries) > MAX_QUERIES:
            raise ValueError(f"{len(queries)} queries in one request; send at most {MAX_QUERIES} per request")
        topk = payload.get("topk")
        topk = self.topk if topk is None else topk
        if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= MAX_TOPK:
            raise ValueError(f'"topk" must be an integer from 1 to {MAX_TOPK}, got {payload.get("topk")!r}')
        return_scores = payload.get("return_scores", False)
        if not isinstance(return_scores, bool):
            raise ValueError(f'"return_scores" must be true or false, got {return_scores!r}')
        return queries, topk, return_scores

    async def handle_retrieve(self, request: web.Request) -> web.Response:
        as_msgpack = request.content_type in MSGPACK_TYPES
        body = await request.read()
        try:
            payload = msgpack.unpackb(body) if as_msgpack else json.loads(body)
        except (ValueError, msgpack.UnpackException) as e:
            kind = "msgpack" if as_msgpack else "JSON"
            return _error(400, f"the request body is not valid {kind} ({e}); send {EXAMPLE_REQUEST}")
        try:
            queries, topk, return_scores = self.parse_request(payload)
        except ValueError as e:
            return _error(400, str(e))
        loop = asyncio.get_running_loop()
        results = await loop.run_in_executor(self._executor, self.retrieve, queries, topk)
        result = [
            [{"document": self.document(p), "score": p.score} if return_scores else self.document(p) for p in passages]
            for passages in results
        ]
        if as_msgpack or any(t in request.headers.get("Accept", "") for t in MSGPACK_TYPES):
            return web.Response(body=msgpack.packb({"result": result}), content_type=MSGPACK_TYPES[0])
        return web.json_response({"result": result})

    async def handle_health(self, request: web.Request) -> web.Response:
        return web.json_response(self.health())

    def make_app(self) -> web.Application:
        """``POST /retrieve`` and ``GET /health``; every error answers JSON ``{"error": ...}``."""
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[_json_errors])
        app.router.add_post("/retrieve", self.handle_retrieve)
        app.router.add_get("/health", self.handle_health)
        app.on_startup.append(self._start_worker)
        app.on_cleanup.append(self._stop_worker)
        return app

    async def _start_worker(self, app: web.Application) -> None:
        # One worker thread: the index is not thread-safe, and the event loop stays free for /health.
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="retrieval")

    async def _stop_worker(self, app: web.Application) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": message}, status=status)


@web.middleware
async def _json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    try:
        return await handler(request)
    except web.HTTPException as e:  # aiohttp's own 404, 405, 413: same JSON shape as ours
        if e.status < 400:
            raise
        hints = {
            404: "the endpoints are POST /retrieve and GET /health",
            405: "use POST for /retrieve and GET for /health",
            413: f"the request body is larger than {MAX_BODY_BYTES:,} bytes; send fewer queries per request",
        }
        detail = f"{e.reason}: {hints[e.status]}" if e.status in hints else e.reason
        return _error(e.status, detail)
    except Exception as e:  # an unexpected failure must answer, not drop the connection
        print(f"retrieval server error on {request.path}: {type(e).__name__}: {e}", file=sys.stderr)
        return _error(500, f"internal error: {type(e).__name__}: {e}")
