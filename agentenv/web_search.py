"""Remote search backends and the result cache that makes them repeatable.

- :class:`RemoteSearch` — a client for Search-R1-style retrieval servers (``POST /retrieve``),
  tolerant of the dialects in use: a ``queries`` list or a single ``query``, JSON or msgpack,
  ``result`` or ``results``, documents as ``{id, contents}`` or ``{title, text}``, with or
  without scores.
- :class:`DuckDuckGoSearch` — the real web through the ``ddgs`` package's DuckDuckGo engine.
- :class:`ResultCache` and :class:`CachedSearch` — results kept in memory and on disk (SQLite),
  keyed by backend, query and top-k. Every fork of an episode holds the same cache object, so
  the branches of a rollout tree see the same results, and a second run costs nothing. Modes:
  ``use`` (read, fetch what is missing), ``record`` (fetch everything again and store it),
  ``replay`` (never fetch: a miss is an error; deterministic tests), ``off``.

Both backends retry with exponential backoff on rate limits and transient failures, inside one
overall ``timeout``; when the backend cannot be reached they raise :class:`SearchUnavailable`,
whose message becomes the model's observation.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sqlite3
import threading
import time
import weakref
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import aiohttp
import msgpack
from yarl import URL

from agentenv.cache import cache_dir
from agentenv.search import Passage, SearchBackend
from agentenv.tools import Tool, ToolError, tool

__all__ = [
    "CacheMiss",
    "CacheMode",
    "CachedSearch",
    "DuckDuckGoSearch",
    "RemoteSearch",
    "ResultCache",
    "SearchUnavailable",
    "format_web_results",
    "parse_retrieval_response",
    "web_search_tool",
]

T = TypeVar("T")
CacheMode = Literal["use", "record", "replay", "off"]
CACHE_MODES: tuple[str, ...] = ("use", "record", "replay", "off")

DEFAULT_TIMEOUT = 15.0  # seconds for one search, retries included
DEFAULT_RETRIES = 3
DEFAULT_BACKOFF = 0.5  # first pause between attempts; doubles each time
MAX_RETRY_AFTER = 10.0  # never wait longer than this for a server's Retry-After
RETRYABLE_STATUS = {408, 425, 429, 500, 502, 503, 504}


class SearchUnavailable(ToolError):
    """The search backend could not answer (unreachable, timing out, rate limiting)."""


class CacheMiss(ToolError):
    """Replay mode found no recorded result for a request."""


# -- the result cache ------------------------------------------------------------------------


class ResultCache:
    """JSON results by ``(namespace, key)``, in memory and optionally in a SQLite file.

    One instance is meant to be shared: by every fork of an environment (forks copy references
    to it, ``copy.deepcopy`` returns it as is) and, through the file, by later runs and other
    processes. The first result stored for a key wins, so two branches racing on the same
    query still end up seeing one answer.

    Args:
        path: SQLite file; ``None`` keeps results in memory only.
        mode: ``use``, ``record``, ``replay`` or ``off`` (see the module docstring).
    """

    def __init__(self, path: str | Path | None = None, *, mode: CacheMode = "use") -> None:
        if mode not in CACHE_MODES:
            raise ValueError(f"unknown cache mode {mode!r}; choose one of {', '.join(CACHE_MODES)}")
        if mode == "replay" and path is not None and not Path(path).is_file():
            raise FileNotFoundError(
                f"cache mode 'replay' needs a recording, and {path} does not exist; make one first with mode='record'"
            )
        self.path = Path(path) if path is not None else None
        self.mode = mode
        self._memory: dict[tuple[str, str], str] = {}
        self._lock = threading.Lock()
        self._db: sqlite3.Connection | None = None

    @classmethod
    def default(cls, mode: CacheMode = "use") -> ResultCache:
        """The cache file shared by all web searches: ``$AGENTENV_CACHE/web/results.sqlite``."""
        return cls(cache_dir("web") / "results.sqlite", mode=mode)

    def __deepcopy__(self, memo: dict[int, Any]) -> ResultCache:
        return self  # shared by design: forks must see the same results

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            assert self.path is not None
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = sqlite3.connect(self.path, check_same_thread=False, timeout=30)
            db.execute("PRAGMA journal_mode=WAL")  # readers in other processes never block a writer
            db.execute(
                "CREATE TABLE IF NOT EXISTS results (namespace TEXT, key TEXT, value TEXT, "
                "stored REAL, PRIMARY KEY (namespace, key))"
            )
            db.commit()
            self._db = db
        return self._db

    def get(self, namespace: str, key: Any) -> Any | None:
        """The stored result, or None (in ``record`` mode only results stored by this instance count)."""
        k = (namespace, _key_text(key))
        with self._lock:
            if k in self._memory:
                return json.loads(self._memory[k])
            if self.path is None or self.mode in ("record", "off"):
                return None
            row = self._connection().execute("SELECT value FROM results WHERE namespace = ? AND key = ?", k).fetchone()
            if row is None:
                return None
            self._memory[k] = row[0]
            return json.loads(row[0])

    def put(self, namespace: str, key: Any, value: Any) -> Any:
        """Store ``value`` unless a result is already stored for the key; returns the one kept."""
        k = (namespace, _key_text(key))
        text = json.dumps(value, ensure_ascii=False, sort_keys=True)
        with self._lock:
            if k in self._memory:
                return json.loads(self._memory[k])
            if self.path is not None:
                db = self._connection()
                # record overwrites what older runs stored; use keeps whichever process stored first
                verb = "INSERT OR REPLACE" if self.mode == "record" else "INSERT OR IGNORE"
                db.execute(f"{verb} INTO results VALUES (?, ?, ?, ?)", (*k, text, time.time()))
                db.commit()
                text = db.execute("SELECT value FROM results WHERE namespace = ? AND key = ?", k).fetchone()[0]
            self._memory[k] = text
            return json.loads(text)

    async def fetch(self, namespace: str, key: Any, compute: Callable[[], Awaitable[Any]]) -> Any:
        """The cached result for the key, computing and storing it when missing (per the mode)."""
        if self.mode == "off":
            return await compute()
        found = self.get(namespace, key)
        if found is not None:
            return found
        if self.mode == "replay":
            where = self.path or "memory"
            raise CacheMiss(
                f"no recorded result for {namespace} {_key_text(key)} in {where} (replay mode); "
                "record it first with cache mode 'record' or 'use'"
            )
        return self.put(namespace, key, await compute())

    def close(self) -> None:
        with self._lock:
            if self._db is not None:
                self._db.close()
                self._db = None


def _key_text(key: Any) -> str:
    return key if isinstance(key, str) else json.dumps(key, ensure_ascii=False, sort_keys=True)


class CachedSearch(SearchBackend):
    """A backend whose results are cached by ``(backend key, query, topk)``."""

    def __init__(self, backend: SearchBackend, cache: ResultCache, *, key: str | None = None) -> None:
        self.backend = backend
        self.cache = cache
        self.name = backend.name
        self.key = key or getattr(backend, "cache_key", None) or type(backend).__name__

    async def search(self, query: str, topk: int) -> list[Passage]:
        async def compute() -> list[dict[str, Any]]:
            return [_passage_dict(p) for p in await self.backend.search(query, topk)]

        rows = await self.cache.fetch("search", [self.key, query, topk], compute)
        return [Passage(r["title"], r["text"], r.get("url"), r.get("score")) for r in rows]


def _passage_dict(p: Passage) -> dict[str, Any]:
    return {"title": p.title, "text": p.text, "url": p.url, "score": p.score}


# -- retries ---------------------------------------------------------------------------------


class _Retryable(Exception):
    """A failure worth another attempt (rate limit, 5xx, connection error)."""

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


async def _with_retries(
    attempt: Callable[[float], Awaitable[T]], *, what: str, timeout: float, retries: int, backoff: float
) -> T:
    """``attempt(seconds_left)`` until it succeeds, at most ``1 + retries`` times within ``timeout``.

    Pauses ``backoff * 2**i`` between attempts (or the server's ``Retry-After``, capped); raises
    :class:`SearchUnavailable` naming the last failure when every attempt failed or time ran out.
    """
    loop = asyncio.get_running_loop()
    start = loop.time()
    deadline = start + timeout
    last, attempts = "no attempt was made", 0
    for i in range(retries + 1):
        left = deadline - loop.time()
        if left <= 0:
            break
        attempts += 1
        try:
            return await asyncio.wait_for(attempt(left), left)
        except TimeoutError:
            last = f"no answer within {timeout:g} s"
            break
        except _Retryable as e:
            last = str(e)
            pause = min(e.retry_after, MAX_RETRY_AFTER) if e.retry_after is not None else backoff * 2**i
            if i < retries and loop.time() + pause < deadline:
                await asyncio.sleep(pause)
            elif i < retries:
                break  # the pause would overrun the time budget
    plural = "s" if attempts != 1 else ""
    raise SearchUnavailable(f"{what} failed after {attempts} attempt{plural} in {loop.time() - start:.1f} s: {last}")


def _retry_after(headers: Any) -> float | None:
    value = headers.get("Retry-After")
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: fall back to exponential backoff


# -- a Search-R1-style retrieval server ------------------------------------------------------

MSGPACK_TYPES = ("application/msgpack", "application/x-msgpack")
# Idle connections are dropped before servers drop them (uvicorn, which serves Search-R1's
# retriever, after 5 s), so a search never lands on a connection the server is closing.
KEEPALIVE_SECONDS = 4.0


class RemoteSearch(SearchBackend):
    """Client of a Search-R1-style retrieval server (``POST /retrieve``).

    Args:
        url: The server; ``http://host:port`` gets ``/retrieve`` appended, a URL with a path is
            used as it is.
        dialect: ``"queries"`` sends ``{"queries": [...], "topk", "return_scores"}`` (Search-R1,
            verl, our server); ``"query"`` sends one ``{"query": "...", ...}`` per request.
        wire: ``"json"`` or ``"msgpack"`` request bodies (responses are read in either format,
            by their content type).
        timeout: Seconds for one search, all attempts included.
        retries: Further attempts after a rate limit, a 5xx answer or a connection failure.
        backoff: First pause between attempts in seconds (doubles; ``Retry-After`` wins).

    Connections are kept alive between searches: every client in a process shares one
    connection pool per event loop (an environment may be stepped from several), closed when
    that loop shuts down (``asyncio.run`` and :func:`agentenv.core.run_sync`'s runner do) or by
    :meth:`aclose`; a forked process opens its own.
    """

    name = "retrieval"

    def __init__(
        self,
        url: str,
        *,
        dialect: Literal["queries", "query"] = "queries",
        wire: Literal["json", "msgpack"] = "json",
        timeout: float = DEFAULT_TIMEOUT,
        retries: int = DEFAULT_RETRIES,
        backoff: float = DEFAULT_BACKOFF,
    ) -> None:
        parsed = URL(url)
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"a retrieval server URL must be http(s)://host[:port][/path], got {url!r}")
        if dialect not in ("queries", "query"):
            raise ValueError(f"dialect must be 'queries' or 'query', got {dialect!r}")
        if wire not in ("json", "msgpack"):
            raise ValueError(f"wire must be 'json' or 'msgpack', got {wire!r}")
        if timeout <= 0 or retries < 0 or backoff < 0:
            raise ValueError("timeout must be > 0, retries >= 0 and backoff >= 0")
        self.url = str(parsed.with_path("/retrieve")) if parsed.path in ("", "/") else url
        self.dialect, self.wire = dialect, wire
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.cache_key = f"retrieval:{self.url}"

    async def aclose(self) -> None:
        """Close the running event loop's pooled connections (a later search opens new ones)."""
        await _SESSIONS.close()

    async def search(self, query: str, topk: int) -> list[Passage]:
        return (await self.search_batch([query], topk))[0]

    async def search_batch(self, queries: Sequence[str], topk: int) -> list[list[Passage]]:
        """Results for several queries: one request in the ``queries`` dialect, one each otherwise."""
        if self.dialect == "query" and len(queries) != 1:
            return list(await asyncio.gather(*(self.search(q, topk) for q in queries)))
        if self.dialect == "queries":
            payload: dict[str, Any] = {"queries": list(queries), "topk": topk, "return_scores": True}
        else:
            payload = {"query": queries[0], "topk": topk, "return_scores": True}

        async def attempt(seconds_left: float) -> list[list[Passage]]:
            return await self._post(payload, len(queries), seconds_left)

        return await _with_retries(
            attempt,
            what=f"the retrieval server at {self.url}",
            timeout=self.timeout,
            retries=self.retries,
            backoff=self.backoff,
        )

    async def _post(self, payload: dict[str, Any], n_queries: int, seconds_left: float) -> list[list[Passage]]:
        if self.wire == "msgpack":
            body, content_type = msgpack.packb(payload), MSGPACK_TYPES[0]
        else:
            body, content_type = json.dumps(payload).encode(), "application/json"
        headers = {"Content-Type": content_type, "Accept": f"{content_type}, application/json"}
        session = await _SESSIONS.get()
        try:
            async with session.post(
                self.url, data=body, headers=headers, timeout=aiohttp.ClientTimeout(total=seconds_left)
            ) as response:
                raw = await response.read()
                if response.status in RETRYABLE_STATUS:
                    raise _Retryable(f"HTTP {response.status} {response.reason}", _retry_after(response.headers))
                decoded = _decode(raw, response.content_type)
                if response.status != 200:
                    detail = (decoded.get("error") or decoded.get("detail")) if isinstance(decoded, dict) else None
                    raise SearchUnavailable(
                        f"the retrieval server at {self.url} refused the request: HTTP "
                        f"{response.status} {response.reason}" + (f": {detail}" if detail else "")
                    )
        except aiohttp.ClientError as e:
            raise _Retryable(f"{type(e).__name__}: {e}") from None
        return parse_retrieval_response(decoded, n_queries)


class _LoopSessions:
    """One :class:`aiohttp.ClientSession` per event loop (and process), closed when its loop shuts down.

    Held here rather than by the clients, so that a client that is garbage collected never
    leaves an open session behind.
    """

    def __init__(self) -> None:
        self.pid = os.getpid()
        # The loop's session and the async generator whose ``finally`` closes it: the loop closes
        # its async generators when it shuts down (``loop.shutdown_asyncgens``).
        self.by_loop: weakref.WeakKeyDictionary[
            asyncio.AbstractEventLoop, tuple[aiohttp.ClientSession, AsyncGenerator[None, None]]
        ] = weakref.WeakKeyDictionary()

    async def get(self) -> aiohttp.ClientSession:
        if self.pid != os.getpid():  # forked: the parent's connections are not ours to use
            self.pid, self.by_loop = os.getpid(), weakref.WeakKeyDictionary()
        loop = asyncio.get_running_loop()
        found = self.by_loop.get(loop)
        if found is not None and not found[0].closed:
            return found[0]
        # No cap on connections (limit=0), as with a session per search before: the server queues, not us.
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_SECONDS)
        session = aiohttp.ClientSession(connector=connector)
        closer = _close_at_shutdown(session)
        self.by_loop[loop] = (session, closer)
        await anext(closer)
        return session

    async def close(self) -> None:
        found = self.by_loop.pop(asyncio.get_running_loop(), None)
        if found is not None:
            await found[1].aclose()


async def _close_at_shutdown(session: aiohttp.ClientSession) -> AsyncGenerator[None, None]:
    try:
        yield
    finally:
        await session.close()


_SESSIONS = _LoopSessions()


def _decode(raw: bytes, content_type: str) -> Any:
    try:
        if content_type in MSGPACK_TYPES:
            return msgpack.unpackb(raw)
        return json.loads(raw) if raw.strip() else None
    except (ValueError, msgpack.UnpackException):
        return raw.decode("utf-8", "replace")[:200]


def parse_retrieval_response(data: Any, n_queries: int = 1) -> list[list[Passage]]:
    """Passages per query from any Search-R1-style response body.

    Accepts ``{"result": [...]}`` or ``{"results": [...]}`` or a bare list; per query a list of
    ``{"document": doc, "score": s}`` or of docs; a doc is ``{"id", "contents"}`` (first line the
    title, quotes stripped), ``{"title", "text"}``, or a string. A flat list of docs answers one query.
    """
    results = data.get("result", data.get("results")) if isinstance(data, dict) else data
    if not isinstance(results, list):
        raise SearchUnavailable(f"the retrieval server's answer has no result list: {str(data)[:200]!r}")
    if n_queries == 1 and results and not isinstance(results[0], list):
        results = [results]  # the single-query dialect: one flat list
    if len(results) != n_queries:
        raise SearchUnavailable(f"the retrieval server answered {len(results)} result lists for {n_queries} queries")
    return [[_passage(item) for item in per_query] for per_query in results]


def _passage(item: Any) -> Passage:
    score = None
    if isinstance(item, dict) and "document" in item:
        score = item.get("score")
        item = item["document"]
    if isinstance(item, str):
        item = {"contents": item}
    if not isinstance(item, dict):
        raise SearchUnavailable(f"the retrieval server returned a document that is not an object: {item!r:.200}")
    if "title" in item:
        title, text = str(item["title"]), str(item.get("text", item.get("contents", "")))
    else:  # Search-R1's wiki-18 rows: the first line of contents is the quoted title
        title, _, text = str(item.get("contents", item.get("text", ""))).partition("\n")
        title = title.strip().strip('"')
    return Passage(title, text.strip(), item.get("url"), float(score) if score is not None else None)


# -- DuckDuckGo ------------------------------------------------------------------------------

RATE_LIMIT_STATUS = {202, 403, 429}  # DuckDuckGo answers 202 with a challenge page when it throttles


class DuckDuckGoSearch(SearchBackend):
    """Web search through the ``ddgs`` package's engines (DuckDuckGo's HTML endpoint by default).

    The engine's HTTP status is checked on every attempt, so rate limiting (DuckDuckGo answers
    202 or 429) is retried with backoff rather than read as "no results".

    Args:
        engine: A ``ddgs`` text engine: ``duckduckgo`` (default), ``bing``, ``brave``, ``mojeek``...
        region: ``ddgs`` region code.
        safesearch: ``on``, ``moderate`` or ``off``.
        proxy: An http/https/socks5 proxy URL (default: the ``DDGS_PROXY`` environment variable).
        timeout: Seconds for one search, all attempts included.
        retries: Further attempts after a rate limit or a network failure.
        backoff: First pause between attempts in seconds (doubles each time).
    """

    name = "duckduckgo"

    def __init__(
        self,
        *,
        engine: str = "duckduckgo",
        region: str = "us-en",
        safesearch: str = "moderate",
        proxy: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        retries: int = DEFAULT_RETRIES,
        backoff: float = 1.0,
    ) -> None:
        from ddgs.engines import ENGINES  # imported on use: it pulls in an HTTP stack

        if engine not in ENGINES["text"]:
            raise ValueError(f"unknown ddgs text engine {engine!r}; choose one of {sorted(ENGINES['text'])}")
        if timeout <= 0 or retries < 0 or backoff < 0:
            raise ValueError("timeout must be > 0, retries >= 0 and backoff >= 0")
        self.engine_class = ENGINES["text"][engine]
        self.engine, self.region, self.safesearch = engine, region, safesearch
        self.proxy = proxy or os.environ.get("DDGS_PROXY")
        self.timeout, self.retries, self.backoff = timeout, retries, backoff
        self.cache_key = f"ddgs:{engine}:{region}:{safesearch}"

    async def search(self, query: str, topk: int) -> list[Passage]:
        async def attempt(seconds_left: float) -> list[Passage]:
            # ddgs is synchronous; its own timeout ends the worker thread soon after we give up.
            return await asyncio.to_thread(self._search_once, query, topk, math.ceil(seconds_left))

        return await _with_retries(
            attempt,
            what=f"web search ({self.engine})",
            timeout=self.timeout,
            retries=self.retries,
            backoff=self.backoff,
        )

    def _search_once(self, query: str, topk: int, timeout: int) -> list[Passage]:
        from ddgs.exceptions import DDGSException

        engine = self.engine_class(proxy=self.proxy, timeout=timeout)
        payload = engine.build_payload(
            query=query, region=self.region, safesearch=self.safesearch, timelimit=None, page=1
        )
        field = "params" if engine.search_method == "GET" else "data"
        try:
            response = engine.http_client.request(engine.search_method, engine.search_url, **{field: payload})
        except DDGSException as e:
            raise _Retryable(str(e)) from None
        if response.status_code in RATE_LIMIT_STATUS:
            raise _Retryable(f"rate limited (HTTP {response.status_code})")
        if response.status_code != 200:
            raise _Retryable(f"HTTP {response.status_code}")
        results = engine.post_extract_results(engine.extract_results(response.text))
        return self.passages(results, topk)

    @staticmethod
    def passages(results: Sequence[Any], topk: int) -> list[Passage]:
        """``ddgs`` text results (``title``, ``href``, ``body``) as passages, de-duplicated by URL."""
        seen, passages = set(), []
        for r in results:
            if not r.href or r.href in seen:
                continue
            seen.add(r.href)
            passages.append(Passage(r.title, r.body, r.href))
        return passages[:topk]


# -- the tool --------------------------------------------------------------------------------


def format_web_results(passages: Sequence[Passage], max_chars: int = 300) -> str:
    """``Page i: title``, its URL when it has one, then the snippet cut to ``max_chars``."""
    if not passages:
        return "No results found."
    pages = []
    for i, p in enumerate(passages, 1):
        text = p.text if len(p.text) <= max_chars else p.text[:max_chars].rsplit(" ", 1)[0] + " …"
        url = f"\nURL: {p.url}" if p.url else ""
        pages.append(f"Page {i}: {p.title}{url}\n{text}")
    return "\n\n".join(pages)


def web_search_tool(backend: SearchBackend, *, topk: int = 10, max_chars: int = 300) -> Tool:
    """The ``search`` tool for web research: results with their URLs, to open with ``browse``."""

    async def search(query: str) -> str:
        """Search the web; each result shows a title, its URL and a snippet.

        Args:
            query: What to search for.
        """
        return format_web_results(await backend.search(query, topk), max_chars)

    return tool(search)
