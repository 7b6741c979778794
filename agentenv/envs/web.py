"""Web research: search, open pages, answer. ``web-research`` (Bamboogle by default).

Offline by default: ``search="local"`` serves the corpus as a small website (one article per
title, links between articles, a search page; see :class:`~agentenv.serve.web.LocalWeb`) and
searches it with BM25, each result carrying its article's URL under ``http://wiki.local``.

Why a real HTTP server in-process rather than pages served without a socket: the browse tool
then runs exactly the code it runs on the real web (HTTP, redirects, content types, charsets,
timeouts, HTML extraction), so behaviour learned offline carries over, and the same site is what
``python -m agentenv.serve web`` serves. The server runs on a daemon thread on 127.0.0.1 with a
free port, one per corpus per process, shared by every environment and fork over that corpus,
and stops at interpreter exit. URLs shown to the model use the fixed ``http://wiki.local`` base,
which the browser maps to that port, so observations are the same in every process; the mapping
is trusted, while every other private or loopback address stays refused (SSRF protection)
unless ``allow_private_urls=True``.

``search="duckduckgo"`` searches the real web (``ddgs``), and a URL uses a Search-R1-style
retrieval server; both cache results on disk (``cache=``), and browsing then reads the real web,
its pages cached the same way, so branches of a rollout tree see the same results and pages.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import quote_plus

from agentenv.browse import DEFAULT_PAGE_CHARS, DEFAULT_TIMEOUT, Browser, browse_tool
from agentenv.datasets import Example, load_examples
from agentenv.envs.qa import DATA_OPTIONS, local_passages, make_search_backend
from agentenv.options import Option, OptionRule
from agentenv.rewards import get_reward
from agentenv.search import SearchBackend
from agentenv.serve.web import LOCAL_WEB_URL, LocalWeb, LocalWebSearch
from agentenv.tool_env import ToolEnv
from agentenv.tools import Tool, as_tool
from agentenv.web_search import CACHE_MODES, CacheMode, ResultCache, web_search_tool

__all__ = ["WebResearchEnv"]

DEFAULT_TOPK = 10  # AEPO: top-10 web results per search
DEFAULT_SNIPPET_CHARS = 300  # a web search snippet's length; open the page for the rest


class WebResearchEnv(ToolEnv):
    """Answer a question by searching and reading web pages; F1 reward by default.

    Args:
        dataset: A shipped dataset (``bamboogle``, ``nq``, ``triviaqa``, ``popqa``, ``hotpotqa``,
            ``2wiki``, ``musique``); ``data`` (a QA file) overrides it.
        aliases: 2WikiMultihopQA's alias file (``id_aliases.json``), as for ``multihop-qa``.
        corpus: Passages for the offline web (default: the dataset's own paragraphs, else the
            pooled multi-hop paragraphs).
        search: ``"local"`` (the offline web), ``"duckduckgo"`` (the real web), the URL of a
            Search-R1-style retrieval server, or a :class:`~agentenv.search.SearchBackend`.
        cache: Result cache mode for the real web (``use``, ``record``, ``replay``, ``off``).
        topk: Search results per query (AEPO: 10). snippet_chars: each cut to about this length.
        allow_private_urls: Let the model open private and loopback addresses (tests, intranets).
        browse_timeout: Seconds for one page fetch. page_chars: characters per page of text.
        reward: A scheme name or callable; ``"aepo"`` is AEPO's released rule (−1 for a bad
            format, else EM, or F1 + 0.1 when F1 > 0 and every tool of this environment was
            used) with this environment's tools in place of search and python.
        tools: Extra tools besides ``search`` and ``browse``.
        **options: The options of :class:`~agentenv.tool_env.ToolEnv` (``parser``,
            ``max_tool_calls``, ``max_turns``, ``max_obs_chars``, ``require_boxed``, …).
    """

    OPTIONS: ClassVar[Mapping[str, OptionRule]] = {
        **DATA_OPTIONS,
        "cache": Option(choices=CACHE_MODES),
        "topk": Option(int, minimum=1),
        "snippet_chars": Option(int, minimum=1),
        "allow_private_urls": Option(bool),
        "browse_timeout": Option(float, minimum=0, exclusive=True),
        "page_chars": Option(int, minimum=100),  # the Browser's least page
    }

    def __init__(
        self,
        dataset: str = "bamboogle",
        *,
        data: str | Path | None = None,
        aliases: str | Path | None = None,
        corpus: str | Path | None = None,
        search: str | SearchBackend = "local",
        cache: CacheMode = "use",
        topk: int = DEFAULT_TOPK,
        snippet_chars: int = DEFAULT_SNIPPET_CHARS,
        allow_private_urls: bool = False,
        browse_timeout: float = DEFAULT_TIMEOUT,
        page_chars: int = DEFAULT_PAGE_CHARS,
        tools: Sequence[Tool | Callable[..., Any]] = (),
        reward: str | Callable[..., float] = "f1",
        **options: Any,
    ) -> None:
        self.check_options(
            {
                "dataset": dataset,
                "data": data,
                "aliases": aliases,
                "corpus": corpus,
                "search": search,
                "cache": cache,
                "topk": topk,
                "snippet_chars": snippet_chars,
                "allow_private_urls": allow_private_urls,
                "browse_timeout": browse_timeout,
                "page_chars": page_chars,
                "tools": tools,
                "reward": reward,
                **options,
            }
        )
        examples = load_examples(data if data is not None else dataset, aliases=aliases)
        self.site: LocalWeb | None = None
        if search == "local":
            self.site = LocalWeb.shared(local_passages(examples, corpus))
            self.backend: SearchBackend = LocalWebSearch(self.site)
            self.browser = Browser(
                aliases={LOCAL_WEB_URL: self.site.serve_in_background()},
                allow_private_urls=allow_private_urls,
                timeout=browse_timeout,
                page_chars=page_chars,
            )
        else:
            self.backend = make_search_backend(search, examples, corpus, cache=cache)
            self.browser = Browser(
                allow_private_urls=allow_private_urls,
                timeout=browse_timeout,
                page_chars=page_chars,
                cache=ResultCache.default(cache),
            )
        extra = [as_tool(t) for t in tools]
        if reward == "aepo":
            reward = get_reward("aepo", bonus_tools=("search", "browse", *(t.name for t in extra)))
        super().__init__(
            examples,
            [web_search_tool(self.backend, topk=topk, max_chars=snippet_chars), browse_tool(self.browser), *extra],
            reward=reward,
            **options,
        )

    def example_argument(self, tool: Tool, task: Example) -> str:
        """For ``browse``: the page of the best search hit (offline web), or a Wikipedia search."""
        if tool.name != "browse":
            return super().example_argument(tool, task)
        if isinstance(self.backend, LocalWebSearch):
            hits = self.backend.search_sync(task.question, 1)
            return hits[0].url if hits and hits[0].url else LOCAL_WEB_URL + "/"
        return f"https://en.wikipedia.org/w/index.php?search={quote_plus(task.question)}"
