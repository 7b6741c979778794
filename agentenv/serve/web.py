"""A small offline web over a passage corpus, and the search backend that points into it.

:class:`LocalWeb` turns a corpus into a site: one HTML article per title (its passages as
paragraphs, in corpus order, so the 100-word chunks of a Wikipedia dump become whole articles
again), links from each article to the articles whose titles it mentions, and a search page
(BM25). ``python -m agentenv.serve web --corpus PATH`` serves it; environments serve it
in-process (:meth:`LocalWeb.serve_in_background`).

:class:`LocalWebSearch` is the ``search`` backend over the same corpus whose results carry URLs
into the site, so that search-then-browse works end to end without a network. The URLs use a
fixed base (``http://wiki.local`` by default), the same in every process whatever port the
server got; the browse tool maps that base to the real server (``Browser(aliases=...)``).
"""

from __future__ import annotations

import html
import re
import threading
from collections.abc import Sequence
from typing import ClassVar
from urllib.parse import quote

from aiohttp import web

from agentenv.datasets import Paragraph
from agentenv.search import BM25Search, Passage, SearchBackend
from agentenv.serve.hosting import BackgroundServer

__all__ = ["LOCAL_WEB_URL", "LocalWeb", "LocalWebSearch"]

#: Where the offline web appears to be, in search results and pages shown to the model.
LOCAL_WEB_URL = "http://wiki.local"
SITE_NAME = "Offline Wiki"
SEARCH_RESULTS = 10  # results on the site's search page
SNIPPET_CHARS = 240
MIN_LINK_TITLE_CHARS = 4  # shorter titles ("Oak", "AXN") would link common words and acronyms
_WORD = re.compile(r"\w+")
_DISAMBIGUATION = re.compile(r"\s*\([^)]*\)\s*$")  # "Kiss and Tell (1945 film)" is mentioned as "Kiss and Tell"


def _slug(title: str) -> str:
    return "_".join(title.split())


class LocalWeb:
    """An offline website made from a passage corpus (see the module docstring).

    Args:
        passages: The corpus. Passages sharing a title form one article; an untitled passage
            is an article of its own (``passage-<i>``).
    """

    _shared: ClassVar[dict[str, LocalWeb]] = {}
    _shared_lock = threading.Lock()

    def __init__(self, passages: Sequence[Paragraph | Passage]) -> None:
        if not passages:
            raise ValueError("LocalWeb needs at least one passage")
        self.passages = [Passage(p.title, p.text) for p in passages]
        self.articles: dict[str, list[int]] = {}  # slug -> passage indices, in corpus order
        self.titles: dict[str, str] = {}  # slug -> title
        self.slug_of: list[str] = []
        for i, p in enumerate(self.passages):
            slug = _slug(p.title) or f"passage-{i}"
            self.articles.setdefault(slug, []).append(i)
            self.titles.setdefault(slug, p.title or f"Passage {i}")
            self.slug_of.append(slug)
        self._index_of = {(p.title, p.text): i for i, p in reversed(list(enumerate(self.passages)))}
        # A private index: bm25s' stemmer keeps state that two threads (this site's server and an
        # environment) must not share, so all searches go through this instance and its lock.
        self._index = BM25Search(self.passages)
        self._lock = threading.Lock()
        self._mentions: dict[str, list[tuple[tuple[str, ...], str, str]]] | None = None
        self._server: BackgroundServer | None = None

    @classmethod
    def shared(cls, passages: Sequence[Paragraph | Passage]) -> LocalWeb:
        """One site per corpus content in this process (environments over one corpus share it)."""
        key = BM25Search.content_key(passages)
        with cls._shared_lock:
            if key not in cls._shared:
                cls._shared[key] = cls(passages)
            return cls._shared[key]

    def __deepcopy__(self, memo: dict[int, object]) -> LocalWeb:
        return self  # a shared, read-only site

    # -- content -------------------------------------------------------------------------------

    @staticmethod
    def path(slug: str) -> str:
        """The site path of an article."""
        return "/wiki/" + quote(slug, safe="()_,'-.!:")

    def search(self, query: str, topk: int) -> list[tuple[int, float]]:
        """``(passage index, BM25 score)`` of the best passages for ``query``."""
        with self._lock:
            hits = self._index.search_sync(query, topk)
        return [(self._index_of[(h.title, h.text)], float(h.score or 0.0)) for h in hits]

    def _mention_index(self) -> dict[str, list[tuple[tuple[str, ...], str, str]]]:
        # first word -> [(words of the title, the title as written, slug)], longest first
        if self._mentions is None:
            index: dict[str, list[tuple[tuple[str, ...], str, str]]] = {}
            seen: set[str] = set()
            for slug, title in self.titles.items():
                name = _DISAMBIGUATION.sub("", title).strip()
                words = tuple(_WORD.findall(name))
                # "Army (Ellie Goulding song)" must not link every "Army": a disambiguated name needs two words
                too_vague = len(words) < 2 and name != title
                if (
                    len(name) < MIN_LINK_TITLE_CHARS
                    or not words
                    or too_vague
                    or name in seen
                    or not any(c.isupper() for c in name)
                ):
                    continue
                seen.add(name)  # an ambiguous name links to its first article
                index.setdefault(words[0], []).append((words, name, slug))
            for candidates in index.values():
                candidates.sort(key=lambda c: -len(c[0]))
            self._mentions = index
        return self._mentions

    def linked_html(self, text: str, own_slug: str, linked: set[str]) -> str:
        """``text`` as escaped HTML with the first mention of each other article's title linked."""
        mentions = self._mention_index()
        words = list(_WORD.finditer(text))
        out, pos, i = [], 0, 0
        while i < len(words):
            match = None
            for title_words, name, slug in mentions.get(words[i].group(), ()):
                n = len(title_words)
                if (
                    slug != own_slug
                    and slug not in linked
                    and i + n <= len(words)
                    and text[words[i].start() : words[i + n - 1].end()] == name
                ):
                    match = (n, slug)
                    break
            if match is None:
                i += 1
                continue
            n, slug = match
            start, end = words[i].start(), words[i + n - 1].end()
            out.append(html.escape(text[pos:start]))
            out.append(f'<a href="{html.escape(self.path(slug))}">{html.escape(text[start:end])}</a>')
            linked.add(slug)
            pos, i = end, i + n
        out.append(html.escape(text[pos:]))
        return "".join(out)

    def article_html(self, slug: str) -> str | None:
        """The article page, or None if there is no article with that slug."""
        if slug not in self.articles:
            return None
        title = self.titles[slug]
        linked: set[str] = set()
        paragraphs = "\n".join(
            f'<p id="p{n}">{self.linked_html(part, slug, linked)}</p>'
            for n, i in enumerate(self.articles[slug], 1)
            for part in self.passages[i].text.split("\n")
            if part.strip()
        )
        return self._page(title, f"<article>\n<h1>{html.escape(title)}</h1>\n{paragraphs}\n</article>")

    def search_html(self, query: str) -> str:
        """The search page: a form, and the results for ``query`` when given."""
        if not query.strip():
            return self._page("Search", "<h1>Search</h1>\n<p>Type words to look for in the search box above.</p>")
        items = []
        for i, _ in self.search(query, SEARCH_RESULTS):
            p = self.passages[i]
            snippet = p.text if len(p.text) <= SNIPPET_CHARS else p.text[:SNIPPET_CHARS].rsplit(" ", 1)[0] + " …"
            link = html.escape(self.path(self.slug_of[i]))
            items.append(
                f'<li><a href="{link}">{html.escape(self.titles[self.slug_of[i]])}</a>\n'
                f"<p>{html.escape(snippet)}</p></li>"
            )
        body = "\n".join(items) if items else "<li>No articles match these words.</li>"
        return self._page(f"Search: {query}", f"<h1>Search results for {html.escape(query)}</h1>\n<ol>\n{body}\n</ol>")

    def home_html(self) -> str:
        return self._page(
            SITE_NAME,
            f"<h1>{SITE_NAME}</h1>\n<p>An offline encyclopedia of {len(self.articles):,} "
            f"articles. Use the search box to find one.</p>",
        )

    def missing_html(self, slug: str) -> str:
        name = slug.replace("_", " ")
        return self._page(
            "Not found",
            f"<h1>Not found</h1>\n<p>There is no article named {html.escape(name)}. "
            f'Try <a href="/search?q={quote(name)}">searching for it</a>.</p>',
        )

    @staticmethod
    def _page(title: str, main: str) -> str:
        return (
            '<!DOCTYPE html>\n<html lang="en">\n<head><meta charset="utf-8">'
            f"<title>{html.escape(title)} - {SITE_NAME}</title></head>\n<body>\n"
            f'<header><a href="/">{SITE_NAME}</a> <form action="/search"><input name="q" aria-label="Search">'
            "<button>Search</button></form></header>\n"
            f"<main>\n{main}\n</main>\n"
            "<footer>Text from Wikipedia, CC BY-SA 4.0.</footer>\n</body>\n</html>\n"
        )

    # -- serving -------------------------------------------------------------------------------

    def make_app(self) -> web.Application:
        """The site as an aiohttp application: ``/``, ``/wiki/<title>``, ``/search?q=``, ``/health``."""

        def page(text: str, status: int = 200) -> web.Response:
            return web.Response(text=text, status=status, content_type="text/html", charset="utf-8")

        async def home(request: web.Request) -> web.Response:
            return page(self.home_html())

        async def article(request: web.Request) -> web.Response:
            slug = request.match_info["slug"]
            found = self.article_html(slug)
            return page(found) if found is not None else page(self.missing_html(slug), status=404)

        async def search(request: web.Request) -> web.Response:
            return page(self.search_html(request.query.get("q", "")))

        async def health(request: web.Request) -> web.Response:
            return web.json_response({"status": "ok", "articles": len(self.articles), "passages": len(self.passages)})

        app = web.Application()
        app.router.add_get("/", home)
        app.router.add_get("/wiki/{slug:.+}", article)
        app.router.add_get("/search", search)
        app.router.add_get("/health", health)
        return app

    def serve_in_background(self) -> str:
        """Serve the site from a thread of this process (once); returns ``http://127.0.0.1:PORT``."""
        with self._lock:
            if self._server is None:
                self._server = BackgroundServer(self.make_app, name="offline web")
        return self._server.start()


class LocalWebSearch(SearchBackend):
    """BM25 over a :class:`LocalWeb`'s passages; each result carries its article's URL."""

    name = "local-web"

    def __init__(self, site: LocalWeb, base_url: str = LOCAL_WEB_URL) -> None:
        self.site = site
        self.base_url = base_url.rstrip("/")

    def search_sync(self, query: str, topk: int) -> list[Passage]:
        results = []
        for i, score in self.site.search(query, topk):
            p = self.site.passages[i]
            results.append(Passage(p.title, p.text, self.base_url + self.site.path(self.site.slug_of[i]), score))
        return results

    async def search(self, query: str, topk: int) -> list[Passage]:
        return self.search_sync(query, topk)
