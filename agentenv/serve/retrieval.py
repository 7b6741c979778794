"""A retrieval server over a passage corpus, wire-compatible with Search-R1's ``POST /retrieve``.

Request (JSON, or msgpack with ``Content-Type: application/msgpack``)::

    {"queries": ["what is python?", ...], "topk": 3, "return_scores": true}

(a single ``"query": "..."`` is accepted too). ``topk`` and ``return_scores`` are read as
Search-R1's own server (FastAPI) reads them: ``3``, ``3.0`` and ``"3"`` are 3; a missing, null or
0 ``topk`` is the server's default; a ``topk`` above the corpus size returns every passage that
matches; ``return_scores`` may also be 0/1 or ``"true"``/``"yes"``/``"on"``... Response, in the
request's format::

    {"result": [[{"document": {"id": "0", "contents": "\\"Title\\"\\ntext", "title": "Title",
                               "text": "text"}, "score": 12.3}, ...], ...]}

one list per query, best first (equal scores in corpus order); without ``return_scores`` each
list holds the documents alone. Documents carry Search-R1's ``id`` and ``contents`` as the corpus
file had them (the id's type too; for a ``{title, text}`` corpus, ``contents`` is the quoted title,
a newline and the text, and the id the row's position) and also ``title`` and ``text``.
``GET /health`` reports the index, the batching, and which worker process answered. Bad requests
get HTTP 400 with ``{"error": "..."}`` saying what to fix.

Concurrent requests are micro-batched: the first waiting request opens a window of
``batch_window_ms`` (or until ``max_batch_queries`` queries wait), then all waiting requests are
ranked in one call on the worker thread — each distinct query once, at the largest ``topk`` asked,
each request taking its own share. Rankings are deterministic (see
:func:`agentenv.search.top_k`), so a request gets exactly what it would get alone.
``batch_window_ms=0`` ranks every request on its own. Several processes can serve one port
(``python -m agentenv.serve retrieval --workers N``), each memory-mapping the index cached on disk.

What one request may cost is bounded (:class:`Limits`, each a server option): ``topk``, passages
per request (``topk`` × queries), characters per query and bytes per answer; a request over a
limit gets 400 naming the limit, the value sent and the option that raises it. A request is
ranked in calls of bounded size (:data:`MAX_BATCH_CHARS`), taking turns with the other requests,
so a request of many long queries cannot hold the ranking thread; and what is left of a request
whose client has gone is not ranked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import re
import resource
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgpack
from aiohttp import web

from agentenv.datasets import Paragraph, read_rows, union_corpus
from agentenv.search import BM25Search, Passage, load_corpus
from agentenv.serve.dense import DenseSearch

__all__ = ["CorpusPassages", "DocumentId", "Limits", "RetrievalService", "read_corpus", "worker_app"]

DEFAULT_TOPK = 3  # Search-R1 and AT²PO retrieve 3 passages
MAX_QUERIES = 1024  # queries in one request
MAX_BODY_BYTES = 16 * 1024 * 1024
# The default limits of one request (see Limits). The papers ask for 3 to 10 passages a query;
# 100 is ten times that and still ranks in a few milliseconds.
MAX_TOPK = 100
# 1,024 queries at topk 10, or 102 at topk 100: ~15 MB of wiki-18 passages (~1.4 KB a document).
DEFAULT_MAX_RESULTS = MAX_QUERIES * 10
# Questions and model-written queries run to a few hundred characters; 4,096 characters of
# broad words rank in ~3 ms on the shipped 9,490 passages and ~20 ms on 200,000 (BM25, 2 cores).
DEFAULT_MAX_QUERY_CHARS = 4096
# Twice the largest answer of wiki-18 passages that DEFAULT_MAX_RESULTS allows.
DEFAULT_MAX_RESPONSE_BYTES = 32 * 1024 * 1024
# Query characters in one ranking call, at most (always one query): a full batch of real queries
# (256 of ~60 characters) fits, and 32 K characters of broad words rank in ~15 ms on the shipped
# passages (~140 ms on 200,000); a short query waits about one call per client sending long ones.
MAX_BATCH_CHARS = 32 * 1024
MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack")
EXAMPLE_REQUEST = '{"queries": ["..."], "topk": 3, "return_scores": true}'
# A window of a few milliseconds gathers the requests of concurrent clients at a cost of as much
# latency for a lone client; up to 256 queries keep one batch's ranking (and its wait) short.
DEFAULT_BATCH_WINDOW_MS = 2.0
DEFAULT_MAX_BATCH_QUERIES = 256
MAX_BATCH_WINDOW_MS = 1000.0

Ranking = list[list[tuple[int, float]]]  # per query, (position in the corpus, score), best first
DocumentId = str | int  # a corpus row's ``id``, of the type the file gave it
# Search-R1's server reads "topk" and "return_scores" with pydantic's lax int and bool.
_INTEGER_TEXT = re.compile(r"\s*[+-]?\d+(?:\.0*)?\s*")
_TRUE_TEXT = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE_TEXT = frozenset({"0", "off", "f", "false", "n", "no"})


class CorpusPassages(list[Paragraph]):
    """The passages of a corpus file, with the ``contents`` lines that the rebuilt form would change.

    ``contents[i]`` is row ``i``'s ``contents`` exactly as the file had it, kept only where it
    differs from ``'"title"\\ntext'`` of the parsed passage (a title line without quotes, spaces
    around the text), so that the server answers the line unchanged at little memory cost.
    """

    def __init__(self, passages: Iterable[Paragraph], contents: Mapping[int, str] | None = None) -> None:
        super().__init__(passages)
        self.contents: dict[int, str] = dict(contents or {})


def read_corpus(path: str | Path) -> tuple[CorpusPassages, list[DocumentId]]:
    """Passages (see :func:`agentenv.search.load_corpus`) and their ids.

    An id is the row's ``id`` as the file has it (``"w0"``, or the number ``17``), else the row's
    position as a string. The passages also keep each row's original ``contents`` line
    (:class:`CorpusPassages`), which :class:`RetrievalService` answers as it is.
    """
    passages = load_corpus(path)
    ids: list[DocumentId] = []
    contents: dict[int, str] = {}
    for i, (_, row) in enumerate(read_rows(Path(path))):
        ids.append(row["id"] if isinstance(row, dict) and "id" in row else str(i))
        line = row.get("contents") if isinstance(row, dict) else None
        if isinstance(line, str) and line != _contents(passages[i]):
            contents[i] = line
    return CorpusPassages(passages, contents), ids


@dataclass(frozen=True, slots=True)
class Limits:
    """What one request may ask of the server; a request over a limit gets 400 naming it.

    Args:
        max_topk: ``topk`` at most (``--max-topk``).
        max_results: ``topk`` × queries at most, the passages one answer may hold (``--max-results``).
        max_query_chars: Characters in one query at most (``--max-query-chars``); a query's
            ranking cost grows with its length.
        max_response_bytes: Bytes of one answer at most (``--max-response-bytes``); passages of a
            corpus may be long.
    """

    max_topk: int = MAX_TOPK
    max_results: int = DEFAULT_MAX_RESULTS
    max_query_chars: int = DEFAULT_MAX_QUERY_CHARS
    max_response_bytes: int = DEFAULT_MAX_RESPONSE_BYTES

    def __post_init__(self) -> None:
        for name, value in asdict(self).items():
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a whole number of at least 1, got {value!r}")


def _contents(passage: Paragraph | Passage) -> str:
    """Search-R1's ``contents`` of a passage: the quoted title, a newline, the text (wiki-18's form)."""
    return f'"{passage.title}"\n{passage.text}'


class RetrievalService:
    """An index over a corpus and the aiohttp application that serves it.

    Args:
        passages: The corpus (from :func:`read_corpus`, the file's ``contents`` lines are answered
            as they were).
        ids: One id per passage, a string or a number (default: positions ``"0"``, ``"1"``...).
        index: ``"bm25"`` (bm25s, cached on disk), ``"dense"`` (sentence-transformers, see
            :class:`~agentenv.serve.dense.DenseSearch`), or either index already built over ``passages``.
        topk: Passages per query when a request does not say (at most ``limits.max_topk``).
        model: Dense model folder (default: the bundled all-MiniLM-L6-v2).
        batch_window_ms: How long the first waiting request waits for others to share its
            ranking call; 0 ranks each request on its own.
        max_batch_queries: Queries in one ranking call, at most (a larger request is ranked a chunk per call).
        mmap: Memory-map the index cached on disk (processes serving one corpus share it).
        workers: The number of processes serving the port, as ``GET /health`` reports it.
        limits: What one request may ask (default :class:`Limits`'s defaults).
    """

    def __init__(
        self,
        passages: Sequence[Paragraph | Passage],
        ids: Sequence[DocumentId] | None = None,
        *,
        index: Literal["bm25", "dense"] | BM25Search | DenseSearch = "bm25",
        topk: int = DEFAULT_TOPK,
        model: str | Path | None = None,
        batch_window_ms: float = DEFAULT_BATCH_WINDOW_MS,
        max_batch_queries: int = DEFAULT_MAX_BATCH_QUERIES,
        mmap: bool = False,
        workers: int = 1,
        limits: Limits | None = None,
    ) -> None:
        limits = limits or Limits()
        if not isinstance(index, BM25Search | DenseSearch) and index not in ("bm25", "dense"):
            raise ValueError(f"index must be 'bm25', 'dense' or a built BM25Search or DenseSearch, got {index!r}")
        if ids is not None and len(ids) != len(passages):
            raise ValueError(f"{len(ids)} ids for {len(passages)} passages")
        if not 1 <= topk <= limits.max_topk:
            raise ValueError(f"topk must be between 1 and max_topk ({limits.max_topk}), got {topk}")
        if not 0 <= batch_window_ms <= MAX_BATCH_WINDOW_MS:
            raise ValueError(f"batch_window_ms must be between 0 and {MAX_BATCH_WINDOW_MS:g}, got {batch_window_ms}")
        if max_batch_queries < 1:
            raise ValueError(f"max_batch_queries must be at least 1, got {max_batch_queries}")
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.topk, self.limits = topk, limits
        self.batch_window_ms, self.max_batch_queries, self.workers = batch_window_ms, max_batch_queries, workers
        self.ids: list[DocumentId] = list(ids) if ids is not None else [str(i) for i in range(len(passages))]
        self.contents = dict(passages.contents) if isinstance(passages, CorpusPassages) else {}
        start = time.perf_counter()
        if index == "dense":
            index = DenseSearch(passages, model=model, mmap=mmap)
        elif index == "bm25":
            index = BM25Search(passages, mmap=mmap)
        self.index: BM25Search | DenseSearch = index
        self.kind = "dense" if isinstance(index, DenseSearch) else "bm25"
        self.build_seconds = time.perf_counter() - start
        self.requests = self.rankings = 0  # answered here; fewer rankings than requests when batching
        self._executor: ThreadPoolExecutor | None = None  # made per served application
        self._batcher: _Batcher | None = None

    def retrieve(self, queries: Sequence[str], topk: int) -> list[list[Passage]]:
        """The ``topk`` passages for each query (blocking)."""
        return self.index.search_batch(queries, topk)

    def rank_requests(self, requests: Sequence[tuple[Sequence[str], int]]) -> list[Ranking]:
        """The rankings of several ``(queries, topk)`` requests from one call to the index (blocking).

        Each distinct query is ranked once, at the largest ``topk``; a request takes the first
        ``topk`` of each of its queries, which is its own ranking because ties break by position.
        """
        distinct = list(dict.fromkeys(q for queries, _ in requests for q in queries))
        ranked = dict(zip(distinct, self.index.rank(distinct, max(topk for _, topk in requests))))
        self.rankings += 1
        return [[ranked[q][:topk] for q in queries] for queries, topk in requests]

    def document(self, position: int) -> dict[str, DocumentId]:
        """The passage at ``position`` as Search-R1 returns it, plus ``title`` and ``text``."""
        p = self.index.passages[position]
        contents = self.contents.get(position)
        if contents is None:
            contents = _contents(p)
        return {"id": self.ids[position], "contents": contents, "title": p.title, "text": p.text}

    def health(self) -> dict[str, Any]:
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
        return {
            "status": "ok",
            "index": self.kind,
            "passages": len(self.ids),
            "build_seconds": round(self.build_seconds, 3),
            "peak_rss_mb": round(peak_kib / 1024, 1),
            "batch_window_ms": self.batch_window_ms,
            "max_batch_queries": self.max_batch_queries,
            "requests": self.requests,
            "rankings": self.rankings,
            "queued": self._batcher.queued if self._batcher is not None else 0,
            "abandoned": self._batcher.abandoned if self._batcher is not None else 0,
            "limits": asdict(self.limits),
            "workers": self.workers,
            "pid": os.getpid(),
        }

    # -- HTTP ----------------------------------------------------------------------------------

    def parse_request(self, payload: Any) -> tuple[list[str], int, bool]:
        """``(queries, topk, return_scores)`` from a request body; ValueError says what is wrong.

        A request over one of :attr:`limits` is refused here, before any ranking.
        """
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
        limits = self.limits
        longest = max(range(len(queries)), key=lambda i: len(queries[i]))
        if len(queries[longest]) > limits.max_query_chars:
            raise ValueError(
                f"query {longest} is {len(queries[longest]):,} characters long, over this server's limit of "
                f"{limits.max_query_chars:,} characters per query; send a shorter query "
                "(the server's --max-query-chars raises the limit)"
            )
        topk = _lax_int(payload.get("topk"))
        if topk is None or topk < 0:
            raise ValueError(
                '"topk" must be a whole number of passages like 3 (0 or null: the default), '
                f"got {_shown(payload.get('topk'))}"
            )
        # Search-R1's retrieve_endpoint: `if not request.topk`, so a missing, null or 0 topk is the default.
        topk = topk or self.topk
        if topk > limits.max_topk:
            raise ValueError(
                f'"topk" {topk:,} is over this server\'s limit of {limits.max_topk:,} passages per query; '
                f"ask for at most {limits.max_topk:,} (the server's --max-topk raises the limit)"
            )
        if topk * len(queries) > limits.max_results:
            raise ValueError(
                f"{len(queries):,} queries × topk {topk:,} = {topk * len(queries):,} passages, over this server's "
                f"limit of {limits.max_results:,} passages per request; send fewer queries per request or a "
                "smaller topk (the server's --max-results raises the limit)"
            )
        # Past the corpus size there is nothing more to rank: every passage that matches comes back.
        topk = min(topk, len(self.ids))
        return_scores = _lax_bool(payload.get("return_scores", False))
        if return_scores is None:
            raise ValueError(f'"return_scores" must be true or false, got {_shown(payload.get("return_scores"))}')
        return queries, topk, return_scores

    def answer(self, ranking: Ranking, return_scores: bool) -> list[list[Any]]:
        """The documents of a ranking, as a response's ``result``; ValueError past ``max_response_bytes``.

        The characters of the documents' strings, a lower bound of their encoded size, are counted
        as they are gathered, so an answer over the limit is refused before it is encoded.
        """
        limit, size, document = self.limits.max_response_bytes, 0, self.document
        result: list[list[Any]] = []
        for hits in ranking:
            found = []
            for i, score in hits:
                doc = document(i)
                size += sum(len(v) for v in doc.values() if isinstance(v, str))
                if size > limit:
                    raise ValueError(_response_too_large(limit, f" (reached at query {len(result)} of {len(ranking)})"))
                found.append({"document": doc, "score": score} if return_scores else doc)
            result.append(found)
        return result

    async def handle_retrieve(self, request: web.Request) -> web.Response:
        as_msgpack = request.content_type in MSGPACK_TYPES
        try:
            queries, topk, return_scores = self.parse_request(_decode(await request.read(), as_msgpack))
        except ValueError as e:
            return _error(400, str(e))
        assert self._batcher is not None, "make_app()'s application is not started"
        # Cancelled (raising CancelledError, which aiohttp takes for the client's disconnection)
        # if its client leaves before it is ranked.
        ranking = await self._batcher.rank(queries, topk, lambda: _connected(request))
        self.requests += 1
        try:
            result = self.answer(ranking, return_scores)
            if as_msgpack or any(t in request.headers.get("Accept", "") for t in MSGPACK_TYPES):
                body = msgpack.packb({"result": result})
                content_type = MSGPACK_TYPES[0]
            else:
                body = json.dumps({"result": result}).encode()
                content_type = "application/json"
            if len(body) > self.limits.max_response_bytes:  # escapes and keys the count above left out
                raise ValueError(_response_too_large(self.limits.max_response_bytes))
        except ValueError as e:
            return _error(400, str(e))
        return web.Response(body=body, content_type=content_type)

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
        self._batcher = _Batcher(
            self.rank_requests, self._executor, self.batch_window_ms / 1000, self.max_batch_queries
        )

    async def _stop_worker(self, app: web.Application) -> None:
        # aiohttp has let the requests in flight finish by now, so nothing still waits on a batch.
        if self._batcher is not None:
            await self._batcher.close()
            self._batcher = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None


@dataclass(slots=True, eq=False)
class _Waiting:
    """A request waiting for its ranking, which may come in several chunks."""

    queries: list[str]
    topk: int
    arrived: float  # event-loop time
    ranking: asyncio.Future[Ranking]
    connected: Callable[[], bool]  # whether its client still waits for the answer
    taken: int = 0  # queries handed to ranking calls so far
    ranked: Ranking = field(default_factory=list)  # of the first len(ranked) queries

    @property
    def left(self) -> int:
        """Queries not yet handed to a ranking call."""
        return len(self.queries) - self.taken


class _Batcher:
    """Collects waiting requests and ranks them together, one call at a time, on ``executor``.

    A batch closes ``window`` seconds after its oldest request arrived, or as soon as
    ``max_queries`` queries wait. Requests that arrive while a batch is ranked have waited long
    enough when it is done, so under load batches follow each other with no pause. After a batch
    of one request the next closes at once: a lone client is not kept waiting for company.
    ``window`` 0 ranks one request per call.

    A call holds at most ``max_queries`` queries and :data:`MAX_BATCH_CHARS` characters (and
    always one query). A request over that is ranked a chunk per call, going to the back of the
    queue after each, so the requests behind it wait for one call, not for all of it; and the
    rest of a request whose client has left (or whose handler was cancelled) is dropped.
    """

    def __init__(
        self,
        rank_requests: Callable[[Sequence[tuple[Sequence[str], int]]], list[Ranking]],
        executor: ThreadPoolExecutor,
        window: float,
        max_queries: int,
    ) -> None:
        self.rank_requests, self.executor, self.window, self.max_queries = rank_requests, executor, window, max_queries
        self.abandoned = 0  # requests dropped before they were fully ranked, their client gone
        self._waiting: deque[_Waiting] = deque()
        self.queued = 0  # queries waiting to be ranked
        self._arrived = asyncio.Event()
        self._full = asyncio.Event()
        self._company = False  # whether the last batch held more than one request
        self._task = asyncio.get_running_loop().create_task(self._collect())

    async def rank(self, queries: list[str], topk: int, connected: Callable[[], bool]) -> Ranking:
        """This request's ranking, once every chunk of it is ranked.

        Cancelled if ``connected()`` turns false before then.
        """
        loop = asyncio.get_running_loop()
        waiting = _Waiting(queries, topk, loop.time(), loop.create_future(), connected)
        self._waiting.append(waiting)
        self.queued += len(queries)
        self._arrived.set()
        if self.queued >= self.max_queries:
            self._full.set()
        return await waiting.ranking

    async def _collect(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._arrived.wait()
            left = self._waiting[0].arrived + self.window - loop.time()
            if self._company and left > 0 and self.queued < self.max_queries:
                self._full.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._full.wait(), left)
            batch = self._take()
            if not batch:  # every request that waited was abandoned
                continue
            self._company = len(batch) > 1
            try:
                rankings = await loop.run_in_executor(
                    self.executor, self.rank_requests, [(queries, w.topk) for w, queries in batch]
                )
            except Exception as e:  # each request answers the failure (HTTP 500), as it would alone
                for w, _ in batch:
                    if not w.ranking.done():
                        w.ranking.set_exception(e)
                continue
            for (w, _), ranking in zip(batch, rankings):
                if w.ranking.done():  # its handler may have been cancelled meanwhile
                    continue
                w.ranked.extend(ranking)
                if len(w.ranked) == len(w.queries):
                    w.ranking.set_result(w.ranked)

    def _take(self) -> list[tuple[_Waiting, list[str]]]:
        """The next call's work, oldest request first: ``(request, its next queries)`` pairs.

        A request that would fit a call of its own is never split; one that would not is taken
        as far as the call has room, and what is left of it goes to the back of the queue.
        """
        batch: list[tuple[_Waiting, list[str]]] = []
        later: list[_Waiting] = []  # requests with queries left, behind those that wait now
        queries = chars = 0
        while self._waiting and (self.window > 0 or not batch):
            w = self._waiting.popleft()
            if w.ranking.done() or not w.connected():
                self._drop(w)
                continue
            start = end = w.taken
            while end < len(w.queries) and queries < self.max_queries:
                if queries and chars + len(w.queries[end]) > MAX_BATCH_CHARS:
                    break
                queries, chars, end = queries + 1, chars + len(w.queries[end]), end + 1
            if end == start or (end < len(w.queries) and batch and _fits_one_call(w, start, self.max_queries)):
                self._waiting.appendleft(w)  # the next call takes it, whole if it can
                break
            batch.append((w, w.queries[start:end]))
            w.taken = end
            self.queued -= end - start
            if end < len(w.queries):
                later.append(w)
        self._waiting.extend(later)
        if not self._waiting:
            self._arrived.clear()
        return batch

    def _drop(self, w: _Waiting) -> None:
        """Forget a request whose client left, or whose ranking failed or was cancelled."""
        self.queued -= w.left
        if not w.ranking.done() or w.ranking.cancelled():
            self.abandoned += 1
            w.ranking.cancel()

    async def close(self) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        for w in self._waiting:
            w.ranking.cancel()
        self._waiting.clear()


def _fits_one_call(w: _Waiting, start: int, max_queries: int) -> bool:
    """Whether what is left of ``w`` from query ``start`` on fits one call of its own."""
    return len(w.queries) - start <= max_queries and sum(map(len, w.queries[start:])) <= MAX_BATCH_CHARS


def worker_app(
    corpus: str | None,
    *,
    index: Literal["bm25", "dense"],
    topk: int,
    model: str | None,
    batch_window_ms: float,
    max_batch_queries: int,
    workers: int,
    limits: Limits | None = None,
) -> web.Application:
    """The application of one of ``workers`` server processes (``python -m agentenv.serve retrieval --workers N``).

    The process reads the corpus again (default: the shipped multi-hop paragraphs) and
    memory-maps the index its parent built and cached on disk.
    """
    if index == "dense":
        import torch

        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))  # the workers' encoders share the cores
    passages, ids = read_corpus(corpus) if corpus else (union_corpus(), None)
    service = RetrievalService(
        passages,
        ids,
        index=index,
        topk=topk,
        model=model,
        batch_window_ms=batch_window_ms,
        max_batch_queries=max_batch_queries,
        mmap=True,
        workers=workers,
        limits=limits,
    )
    return service.make_app()


def _lax_int(value: Any) -> int | None:
    """``value`` as pydantic's lax ``int`` (Search-R1's server) reads it; 0 for null; None if it refuses it.

    An int or bool, a float with no fraction, or a string of a whole number (``"3"``, ``"3.0"``).
    """
    if value is None:
        return 0  # Search-R1: null is the default, like 0
    if isinstance(value, int):  # bool included: pydantic reads True as 1
        return int(value)
    if isinstance(value, float) and math.isfinite(value) and value.is_integer():
        return int(value)
    if isinstance(value, str) and _INTEGER_TEXT.fullmatch(value):
        try:
            return int(float(value)) if "." in value else int(value)
        except ValueError:  # more digits than Python converts (4,300): no topk is that large
            return None
    return None


def _lax_bool(value: Any) -> bool | None:
    """``value`` as pydantic's lax ``bool`` (Search-R1's server) reads it; None if it refuses it."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int | float) and value in (0, 1):
        return bool(value)
    if isinstance(value, str):
        lowered = value.lower()
        if lowered in _TRUE_TEXT:
            return True
        if lowered in _FALSE_TEXT:
            return False
    return None


def _decode(body: bytes, as_msgpack: bool) -> Any:
    """A request body as JSON or msgpack; ValueError says why it cannot be read, never in an empty message."""
    try:
        return msgpack.unpackb(body) if as_msgpack else json.loads(body)
    except (RecursionError, msgpack.StackError):  # json: Python's recursion limit; msgpack: its own
        reason = "nested too deeply"
    except msgpack.FormatError:  # msgpack gives no message
        reason = "a byte that starts no msgpack value"
    except Exception as e:  # whatever the decoder raises, the body is at fault
        reason = str(e) or type(e).__name__
    kind = "msgpack" if as_msgpack else "JSON"
    raise ValueError(f"the request body is not valid {kind} ({reason}); send {EXAMPLE_REQUEST}")


def _connected(request: web.Request) -> bool:
    """Whether the client of ``request`` is still connected (aiohttp drops the transport when it leaves)."""
    transport = request.transport
    return transport is not None and not transport.is_closing()


def _shown(value: Any, limit: int = 80) -> str:
    """``repr(value)`` for an error message, cut to ``limit`` characters: a request's value may be megabytes."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text):,} characters)"


def _response_too_large(limit: int, where: str = "") -> str:
    return (
        f"the answer is over this server's limit of {limit:,} bytes per response{where}; ask for fewer "
        "passages (topk) or fewer queries per request "
        "(the server's --max-response-bytes raises the limit)"
    )


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
