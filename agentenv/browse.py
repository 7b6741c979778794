"""The ``browse`` tool: open a web page and read it as text, one page at a time.

:class:`Browser` fetches with aiohttp and turns what comes back into an observation. What it
does with each kind of response:

================================  ==========================================================
scheme other than http(s)         refused
private, loopback, link-local     refused (literal IPs, and every address a host name resolves
or reserved address               to, on every redirect hop) unless ``allow_private_urls=True``;
                                  the environment's own ``aliases`` (its offline web) are trusted:
                                  exactly the (scheme, host, port) each alias names, no other port
                                  of that host, on every redirect hop too
redirects                         followed up to ``max_redirects``, each hop checked, then
                                  "too many redirects"; a ``Location`` that is not a URL refused
HTTP error status                 "HTTP 404 Not Found: URL"
PDF                               refused with a message (not read)
images, archives, octet-stream,   refused as binary (by content type before reading, or by
bytes that are not text           sniffing the first bytes)
body larger than ``max_bytes``    cut there (huge or endless responses); the note says so
body still arriving at            cut there (slow drip); the note says so; nothing received at
``timeout``                       all is a timeout
server silent                     ``connect_timeout`` / ``read_timeout``, then "timed out"
charset                           UTF-8 when the bytes are valid UTF-8, else the declared one
                                  (header, then ``<meta>``), else detected (charset-normalizer)
HTML                              readable text by trafilatura (Markdown, links kept); broken
                                  pages go through lxml's forgiving parser; pages trafilatura
                                  finds nothing in fall back to lxml's plain text
more than ``max_elements``        cut there before extraction (a table cell counts once per
HTML elements                     column and row it spans); table rows wider than 100 columns
                                  are split into rows of 100; the note says so
extraction still running at       stopped; the page's plain text (without links) instead; the
``timeout``                       note says so
long text                         split into pages of ``page_chars``; ``page=N`` reads page N,
                                  ``find=`` lists the matches with their page numbers
================================  ==========================================================

Every failure is a :class:`BrowseError` whose message is the observation the model reads.

Every fetched document is cached (by the URL asked for) in a :class:`~agentenv.web_search.ResultCache`
shared by all forks of the environment, so the branches of a tree read the same page.
"""

from __future__ import annotations

import asyncio
import codecs
import ctypes
import functools
import ipaddress
import re
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

import aiohttp
import charset_normalizer
import lxml.etree
import lxml.html
import trafilatura
from aiohttp.abc import ResolveResult
from aiohttp.resolver import ThreadedResolver
from yarl import URL

from agentenv.tools import Tool, ToolError, tool
from agentenv.web_search import ResultCache

__all__ = [
    "BrowseError",
    "Browser",
    "Document",
    "UnsafeURLError",
    "browse_tool",
    "check_url",
    "html_to_text",
    "is_public_address",
    "split_pages",
]

DEFAULT_CONNECT_TIMEOUT = 5.0  # seconds to open the connection
DEFAULT_READ_TIMEOUT = 10.0  # seconds of silence from the server before giving up
DEFAULT_TIMEOUT = 20.0  # seconds for a whole fetch, redirects and body included
DEFAULT_MAX_BYTES = 2_000_000  # bytes of body read at most
DEFAULT_MAX_REDIRECTS = 5
# HTML elements handed to the extractor at most. trafilatura costs ~40 µs and ~2 KB an element
# (more on some shapes: justext's rescue is quadratic in short paragraphs), so 2 MB of bare <p>
# took 20 s and 1.15 GB. 20,000 elements (a long Wikipedia article) extract in under a second;
# the hostile shapes that take longer are stopped at the deadline.
DEFAULT_MAX_ELEMENTS = 20_000
# A table row wider than this is split into rows of this width before extraction: trafilatura
# renders at most 100 columns, and its cell loop calls len() on the row (O(width)) for every cell,
# quadratic in the width (one row of 10^5 cells: 26 s).
MAX_ROW_COLUMNS = 100
# Seconds the HTML extraction is given even when the fetch used the whole timeout, so that a page
# cut at the deadline is still read; past it the page's plain text is shown instead.
MIN_EXTRACT_TIME = 0.5
DEFAULT_PAGE_CHARS = 4000  # one page of text; fits the default 6000-character observation
FIND_CONTEXT = 120  # characters shown on each side of a find-in-page match
FIND_MAX_MATCHES = 10
MAX_TITLE_CHARS = 200
USER_AGENT = "Mozilla/5.0 (compatible; agentenv-browse/0.1; +https://pypi.org/project/agentenv/)"

REDIRECT_STATUS = {301, 302, 303, 307, 308}
HTML_TYPES = {"text/html", "application/xhtml+xml"}
PDF_TYPES = {"application/pdf", "application/x-pdf"}
TEXT_TYPES = {
    "application/json",
    "application/ld+json",
    "application/xml",
    "application/javascript",
    "application/rss+xml",
    "application/atom+xml",
}


class BrowseError(ToolError):
    """The page could not be read; the message (the observation) says why."""


class UnsafeURLError(BrowseError):
    """The URL's scheme or address is not allowed (SSRF protection)."""


@dataclass(frozen=True, slots=True)
class Document:
    """A fetched page as text."""

    url: str  # where it was found (after redirects), as the model knows it
    title: str
    text: str
    note: str = ""  # what was cut, if anything


# -- SSRF protection -------------------------------------------------------------------------


# IPv6 forms that carry an IPv4 address in their last 32 bits (besides ::ffff:0:0/96, mapped, and
# 2002::/16, 6to4, which ipaddress decodes): a socket or a translator may deliver them to that address.
_IPV4_IN_LOW_BITS = (
    ipaddress.IPv6Network("::/96"),  # IPv4-compatible (deprecated): ::127.0.0.1
    ipaddress.IPv6Network("::ffff:0:0:0/96"),  # IPv4-translated (SIIT): ::ffff:0:127.0.0.1
    ipaddress.IPv6Network("64:ff9b::/96"),  # NAT64 well-known prefix: 64:ff9b::127.0.0.1
)
# Local-use NAT64 (RFC 8215): translated inside some network, never global (Python 3.11 says it is).
_LOCAL_NAT64 = ipaddress.IPv6Network("64:ff9b:1::/48")


def _embedded_ipv4(ip: ipaddress.IPv6Address) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv4-in-IPv6 form (mapped, compatible, translated, NAT64, 6to4) stands for."""
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if any(ip in network for network in _IPV4_IN_LOW_BITS):
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def is_public_address(address: str) -> bool:
    """Whether an IP address is globally routable (not private, loopback, link-local, reserved...).

    An IPv6 address that embeds an IPv4 address (``::ffff:127.0.0.1``, ``::127.0.0.1``,
    ``64:ff9b::10.0.0.1``, ``2002:7f00:1::``...) is judged by the IPv4 address it embeds.
    """
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # drop an IPv6 zone index
    if isinstance(ip, ipaddress.IPv6Address):
        if ip in _LOCAL_NAT64:
            return False
        embedded = _embedded_ipv4(ip)
        if embedded is not None:
            ip = embedded
    return ip.is_global and not ip.is_multicast


def check_url(url: str, *, allow_private: bool = False) -> URL:
    """The parsed URL, or :class:`UnsafeURLError` if it is not http(s) or names a non-public IP.

    Host names are checked when they are resolved (see :class:`_GuardedResolver`).
    """
    try:
        parsed = URL(url)
    except (ValueError, TypeError):
        raise BrowseError(f"{url!r} is not a valid URL") from None
    if parsed.scheme not in ("http", "https"):
        scheme = f"{parsed.scheme}:" if parsed.scheme else "a relative address"
        raise UnsafeURLError(f"only http:// and https:// URLs can be opened, not {scheme} ({url})")
    if not parsed.host:
        raise BrowseError(f"{url!r} has no host name")
    if allow_private:
        return parsed
    try:
        public = is_public_address(parsed.host)
    except ValueError:
        if _NUMERIC_HOST.fullmatch(parsed.host):  # 2130706433, 0x7f.1: resolvers read these as IPs
            raise UnsafeURLError(
                f"{url} uses a numeric address form ({parsed.host}) that is not a canonical IP "
                "address; write the address in dotted form"
            ) from None
        return parsed  # a host name: checked address by address when it is resolved
    if not public:
        raise UnsafeURLError(
            f"{url} points to the private or local address {parsed.host}; only public web addresses can be opened"
        )
    return parsed


_NUMERIC_HOST = re.compile(r"(0x[0-9a-f]+|[0-9]+)(\.(0x[0-9a-f]*|[0-9]+))*\.?", re.IGNORECASE)


class _PrivateAddress(OSError):
    """Raised from the resolver so aiohttp aborts the connection; turned into UnsafeURLError."""


class _GuardedResolver(ThreadedResolver):
    """Resolves a host name and refuses it if any of its addresses is not public.

    It trusts no name: the environment's own servers (alias targets) are fetched through another
    session, chosen by their exact origin, so trusting a name here would open every port of it.
    """

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        hosts = await super().resolve(host, port, family)
        for h in hosts:
            if not is_public_address(h["host"]):
                raise _PrivateAddress(f"{host} resolves to the private or local address {h['host']}")
        return hosts


# -- turning bytes into text -----------------------------------------------------------------

_META_CHARSET = re.compile(rb"""<meta[^>]+charset\s*=\s*["']?\s*([A-Za-z0-9_.:-]+)""", re.IGNORECASE)


def decode_text(body: bytes, declared: str | None, *, cut: bool = False) -> str:
    """UTF-8 if the bytes are valid UTF-8, else the declared charset (header, then ``<meta>``), else detected.

    ``cut``: the body was cut short, so a multi-byte character broken at its end is no evidence against UTF-8.
    """
    try:
        return codecs.getincrementaldecoder("utf-8")().decode(body, final=not cut).removeprefix("\ufeff")
    except UnicodeDecodeError:
        pass
    meta = _META_CHARSET.search(body[:4096])
    for charset in (declared, meta.group(1).decode("ascii") if meta else None):
        if charset:
            try:
                return body.decode(charset)
            # a wrong or unknown declaration: detect instead. UnicodeError covers codecs that refuse
            # to decode at all ("undefined"), ValueError a name Python cannot take ("utf-8\0")
            except (ValueError, LookupError):
                continue
    matches = charset_normalizer.from_bytes(body)
    best = matches.best()
    if best is None:
        return body.decode("utf-8", errors="replace")
    # Western text often fits several legacy code pages equally well; the web's usual one is
    # windows-1252 (what WHATWG decodes "latin-1" as), so it wins ties.
    tied = [m for m in matches if (m.chaos, m.coherence) == (best.chaos, best.coherence)]
    return str(next((m for m in tied if m.encoding == "cp1252"), best))


@dataclass(slots=True)
class _Page:
    """A parsed HTML page, bounded for the extractor."""

    tree: lxml.html.HtmlElement
    html: str  # what the extractor reads: the page as served, or the bounded tree re-serialized
    title: str
    note: str  # what was cut, if anything


def _parse_html(html: str, max_elements: int) -> _Page | None:
    """The page parsed by lxml's forgiving parser, cut at ``max_elements`` and its wide rows split; None if
    unparseable.

    Linear in the page's size: lxml parses 2 MB of 500,000 elements in 0.2 s.
    """
    parser = lxml.html.HTMLParser(encoding="utf-8", remove_comments=True)
    try:  # bytes, so that an XML encoding declaration in the page is not an error
        tree = lxml.html.fromstring(html.encode("utf-8", "replace"), parser=parser)
    except (lxml.etree.ParserError, ValueError):
        return None
    title = " ".join((tree.findtext(".//title") or "").split())
    if not title:
        h1 = tree.find(".//h1")
        title = " ".join(h1.text_content().split()) if h1 is not None else ""
    if len(title) > MAX_TITLE_CHARS:  # an unclosed <title> swallows the page, as in browsers
        title = title[:MAX_TITLE_CHARS].rsplit(" ", 1)[0] + " …"
    root = tree.getroottree().getroot()
    cut, split = _truncate(root, max_elements), _split_wide_rows(root)
    if cut or split:
        html = lxml.html.tostring(root, encoding="unicode")
    note = f"the page has more than {max_elements:,} HTML elements; only the first {max_elements:,} were read"
    return _Page(tree, html, title, note if cut else "")


def _span(cell: lxml.html.HtmlElement, attribute: str) -> int:
    """A cell's colspan or rowspan as trafilatura reads it: 1 unless a number, at most 100."""
    value = cell.get(attribute, "1")
    return min(int(value), MAX_ROW_COLUMNS) if value.isdecimal() else 1


def _truncate(root: lxml.html.HtmlElement, max_elements: int) -> bool:
    """Cut the tree after its first ``max_elements`` elements (document order); whether it was cut.

    A table cell counts once for each column and row it spans: the extractor fills the cells it
    covers, so a page of cells spanning 100 × 100 would otherwise cost 10,000 times its size.
    """
    budget = max_elements
    for element in root.iterdescendants():
        spans = element.tag in ("td", "th")
        budget -= _span(element, "colspan") * _span(element, "rowspan") if spans else 1
        if budget < 0:
            break
    else:
        return False
    # Drop it and everything after it in document order: its later siblings, and its ancestors'
    # tails and later siblings. Slice deletion runs in lxml's C code (a Python loop over 500,000
    # siblings took 1 s).
    node = element.getparent()
    assert node is not None  # a descendant of the root
    del node[node.index(element) :]
    while (parent := node.getparent()) is not None:
        node.tail = None
        del parent[parent.index(node) + 1 :]
        node = parent
    return True


def _split_wide_rows(root: lxml.html.HtmlElement) -> bool:
    """Split table rows wider than ``MAX_ROW_COLUMNS`` columns into rows of that width; whether any was."""
    split = False
    for row in list(root.iter("tr")):
        width, current = 0, row
        for cell in [c for c in row if c.tag in ("td", "th")]:
            span = _span(cell, "colspan")
            if width and width + span > MAX_ROW_COLUMNS:
                current.addnext(lxml.html.Element("tr"))
                current, width, split = current.getnext(), 0, True
            if current is not row:
                current.append(cell)  # moved, with its tail
            width += span
    return split


def _extract(html: str, url: str, links: bool) -> str | None:
    """The page's readable text as Markdown, by trafilatura; None if it finds none.

    It reads the HTML, not the parsed tree, so that the tree is never in two threads at once
    (:class:`Browser` reads the tree's plain text as soon as it stops an overrunning extraction).
    """
    return trafilatura.extract(
        html,
        url=url,
        output_format="markdown",
        include_links=links,
        include_tables=True,
        include_comments=False,
        favor_recall=True,
        deduplicate=False,
    )


class _Stopped(BaseException):
    """Raised inside an extraction thread past its deadline. A BaseException, so that the
    extractor's own ``except Exception`` fallbacks cannot swallow it."""


class _StoppableThread(threading.Thread):
    """Runs ``fn`` and hands its result to an asyncio future; :meth:`stop` ends it early.

    A Python thread cannot be killed, but it can be made to raise: ``PyThreadState_SetAsyncExc``
    raises :class:`_Stopped` in it at its next bytecode. trafilatura's slow paths (its cell loop,
    justext's neighbour search) are Python loops, so it stops within milliseconds; a long C call
    (lxml parsing, 0.2 s for 2 MB) finishes first.
    """

    def __init__(self, fn: Callable[[], Any], future: asyncio.Future[Any]) -> None:
        super().__init__(daemon=True, name="browse-extract")
        self.fn, self.future, self.loop = fn, future, future.get_loop()
        self.lock = threading.Lock()
        self.running = True

    def run(self) -> None:
        try:
            try:
                outcome: tuple[Any, BaseException | None] = (self.fn(), None)
            except Exception as e:
                outcome = (None, e)
            finally:
                # Past this, stop() injects nothing: an exception raised outside these try
                # blocks would escape the thread. Before it, whatever it hits is caught below.
                with self.lock:
                    self.running = False
            self.loop.call_soon_threadsafe(_settle, self.future, *outcome)
        except _Stopped:
            pass
        except RuntimeError:  # the event loop closed meanwhile: nobody waits for the result
            pass

    def stop(self) -> None:
        with self.lock:
            if self.running and self.ident is not None:
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(self.ident), ctypes.py_object(_Stopped))


def _settle(future: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if future.done():  # given up on (the deadline passed, or the step was cancelled)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)


async def _run_stoppable(fn: Callable[[], Any], timeout: float) -> Any:
    """``fn()`` in a thread; past ``timeout`` seconds the thread is stopped and TimeoutError raised."""
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    thread = _StoppableThread(fn, future)
    thread.start()
    try:
        return await asyncio.wait_for(future, timeout)
    finally:
        thread.stop()  # nothing if it finished; else (timeout, cancellation) its work is not wanted


def html_to_text(
    html: str, url: str, *, links: bool = True, max_elements: int = DEFAULT_MAX_ELEMENTS
) -> tuple[str, str, str]:
    """``(title, text, note)`` of an HTML page: trafilatura's Markdown, else lxml's plain text.

    The page is cut after ``max_elements`` elements first, and ``note`` then says so.
    """
    page = _parse_html(html, max_elements)
    if page is None:
        return "", "", ""  # nothing parseable: an empty document
    return page.title, _extract(page.html, url, links) or _plain_text(page.tree), page.note


# Elements that end a line in the plain text: pages often write their blocks with nothing between them.
_BLOCKS = (
    *("address", "article", "aside", "blockquote", "br", "dd", "div", "dl", "dt", "figcaption", "figure"),
    *("footer", "form", "h1", "h2", "h3", "h4", "h5", "h6", "header", "hr", "li", "main", "nav", "ol", "p"),
    *("pre", "section", "table", "td", "th", "tr", "ul"),
)


def _plain_text(tree: lxml.html.HtmlElement) -> str:
    """The page's text, a line per block, without scripts and styles: lxml's C serializer, linear time."""
    for bad in tree.xpath("//script | //style | //noscript | //template | //head"):
        bad.drop_tree()
    for element in tree.iter(*_BLOCKS):
        element.tail = "\n" + (element.tail or "")
    raw = lxml.html.tostring(tree, method="text", encoding="unicode")
    lines = (" ".join(line.split()) for line in raw.splitlines())
    return "\n".join(line for line in lines if line)


def _kind(media_type: str | None, charset: str | None, head: bytes) -> str:
    """``html``, ``text``, ``pdf`` or ``binary``, from the declared type and the first bytes."""
    if head.startswith(b"%PDF-") or media_type in PDF_TYPES:
        return "pdf"
    wide = (charset or "").lower().startswith(("utf-16", "utf-32"))
    if b"\x00" in head[:1024] and not wide:
        return "binary"
    if media_type in HTML_TYPES:
        return "html"
    if media_type is not None and (media_type.startswith("text/") or media_type in TEXT_TYPES):
        return "text"
    if media_type is None:  # undeclared: sniff
        start = head[:512].lstrip().lower()
        return "html" if start.startswith((b"<!doctype html", b"<html")) or b"<body" in head.lower() else "text"
    return "binary"


def split_pages(text: str, page_chars: int) -> list[str]:
    """Pages of at most ``page_chars`` characters, cut at a line break or space where possible."""
    pages, start = [], 0
    while start < len(text):
        end = start + page_chars
        if end < len(text):
            cut = text.rfind("\n", start + page_chars // 2, end)
            if cut < 0:
                cut = text.rfind(" ", start + page_chars // 2, end)
            end = cut if cut > 0 else end
        pages.append(text[start:end].strip())
        start = end
    return [p for p in pages if p] or [""]


# -- the browser -----------------------------------------------------------------------------


class Browser:
    """Fetches pages and renders them as observations; shared by every fork of an environment.

    Args:
        allow_private_urls: Allow private, loopback and link-local addresses (tests, intranets).
        aliases: ``{"http://wiki.local": "http://127.0.0.1:8123"}``: URLs under a key are fetched
            from the value and shown under the key. Alias targets are trusted even when private,
            which lets an environment serve its own offline web without opening the rest of the
            machine to the model: exactly the (scheme, host, port) a target names is trusted, not
            the other ports of its host, and so on every redirect hop.
        connect_timeout: Seconds to connect. read_timeout: seconds of server silence allowed.
        timeout: Seconds for a whole fetch (redirects, body and HTML extraction included; a page
            cut at the deadline still gets ``MIN_EXTRACT_TIME`` to be extracted).
        max_bytes: Body bytes read at most (the rest is cut, and the observation says so).
        max_elements: HTML elements extracted at most (the rest is cut, and the observation says
            so); bounds the extractor's time and memory.
        max_redirects: Redirect hops followed.
        page_chars: Characters per page of text.
        links: Keep links in the text as Markdown ``[anchor](url)`` (how the model navigates).
        cache: Where documents are kept (default: in memory, for this browser and its forks).
    """

    def __init__(
        self,
        *,
        allow_private_urls: bool = False,
        aliases: Mapping[str, str] | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        read_timeout: float = DEFAULT_READ_TIMEOUT,
        timeout: float = DEFAULT_TIMEOUT,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_redirects: int = DEFAULT_MAX_REDIRECTS,
        max_elements: int = DEFAULT_MAX_ELEMENTS,
        page_chars: int = DEFAULT_PAGE_CHARS,
        links: bool = True,
        cache: ResultCache | None = None,
    ) -> None:
        if min(connect_timeout, read_timeout, timeout) <= 0 or min(max_bytes, max_elements) < 1 or max_redirects < 0:
            raise ValueError("timeouts must be > 0, max_bytes and max_elements >= 1 and max_redirects >= 0")
        if page_chars < 100:
            raise ValueError("page_chars must be >= 100")
        self.allow_private_urls = allow_private_urls
        self.aliases = {URL(k).origin(): URL(v).origin() for k, v in (aliases or {}).items()}
        self._targets = frozenset(self.aliases.values())  # the environment's own servers, by exact origin
        self.connect_timeout, self.read_timeout, self.timeout = connect_timeout, read_timeout, timeout
        self.max_bytes, self.max_redirects, self.max_elements = max_bytes, max_redirects, max_elements
        self.page_chars, self.links = page_chars, links
        self.cache = cache if cache is not None else ResultCache()

    def __deepcopy__(self, memo: dict[int, Any]) -> Browser:
        return self  # shared by design: forks read the same pages

    async def open(self, url: str) -> Document:
        """The document at ``url`` (cached); raises :class:`BrowseError` saying what went wrong."""
        url = url.strip().strip("<>\"'")
        self._to_fetch(url)  # refused before the cache is consulted

        async def compute() -> dict[str, Any]:
            return asdict(await self._fetch(url))

        return Document(**await self.cache.fetch("page", url, compute))

    async def read(self, url: str, page: int = 1, find: str | None = None) -> str:
        """The observation for one ``browse`` call: a page of the document, or the matches of ``find``."""
        doc = await self.open(url)
        pages = split_pages(doc.text, self.page_chars)
        header = f"Title: {doc.title or doc.url}\nURL: {doc.url}\n" + (f"Note: {doc.note}\n" if doc.note else "")
        if not doc.text.strip():
            return header + "The page has no readable text."
        if find is not None and find.strip():
            return header + _find(pages, find.strip())
        if not 1 <= page <= len(pages):
            raise BrowseError(
                f"page {page} does not exist: this document has {len(pages)} page{'s' if len(pages) > 1 else ''}"
            )
        more = f"; read on with page={page + 1}" if page < len(pages) else ""
        return f"{header}Page {page} of {len(pages)}{more}\n\n{pages[page - 1]}"

    # -- fetching ----------------------------------------------------------------------------

    def _to_fetch(self, url: str) -> tuple[URL, bool]:
        """The URL to fetch for ``url`` (as the model sees it), and whether it is one of the trusted
        alias targets; raises :class:`UnsafeURLError` for a URL that may not be opened."""
        origin = check_url(url, allow_private=True).origin()  # a valid http(s) URL with a host
        target = self.aliases.get(origin)
        if target is not None:
            assert target.host is not None  # an origin() has a network location, so a host
            parsed = URL(url)
            return parsed.with_scheme(target.scheme).with_host(target.host).with_port(target.port), True
        if origin in self._targets:
            return URL(url), True
        return check_url(url, allow_private=self.allow_private_urls), False

    def _to_display(self, url: URL) -> URL:
        if not url.absolute or url.scheme not in ("http", "https"):
            return url  # refused by _to_fetch, as written
        for alias, target in self.aliases.items():
            if url.origin() == target:
                assert alias.host is not None  # an origin() has a network location, so a host
                return url.with_scheme(alias.scheme).with_host(alias.host).with_port(alias.explicit_port)
        return url

    def _session(self, trusted: bool) -> aiohttp.ClientSession:
        """A session for the alias targets (``trusted``), or one that refuses private addresses
        (unless ``allow_private_urls``): apart so that trusting a target never trusts its host name."""
        timeouts = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout, sock_read=self.read_timeout)
        # allow_private_urls opens host names that resolve to private addresses too, not only literal IPs
        resolver = ThreadedResolver() if trusted or self.allow_private_urls else _GuardedResolver()
        connector = aiohttp.TCPConnector(resolver=resolver, use_dns_cache=False)
        headers = {"User-Agent": USER_AGENT, "Accept": "text/html,application/xhtml+xml,text/plain;q=0.9,*/*;q=0.5"}
        return aiohttp.ClientSession(connector=connector, timeout=timeouts, headers=headers)

    async def _fetch(self, url: str) -> Document:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        display = URL(url)
        try:
            async with self._session(trusted=True) as trusted_session, self._session(trusted=False) as session:
                for _ in range(self.max_redirects + 1):
                    target, trusted = self._to_fetch(str(display))
                    left = deadline - loop.time()
                    if left <= 0:
                        raise TimeoutError
                    get = (trusted_session if trusted else session).get(target, allow_redirects=False)
                    response = await asyncio.wait_for(get, left)
                    try:
                        location = response.headers.get("Location")
                        if response.status in REDIRECT_STATUS and location:
                            display = self._to_display(_redirect(target, location, str(display)))
                            continue
                        return await self._document(response, str(display), deadline)
                    finally:
                        response.close()
        except BrowseError:
            raise
        except aiohttp.ConnectionTimeoutError:
            raise BrowseError(f"timed out: could not connect to {url} within {self.connect_timeout:g} s") from None
        except aiohttp.ServerTimeoutError:
            raise BrowseError(f"timed out: {url} stayed silent for more than {self.read_timeout:g} s") from None
        except TimeoutError:
            raise BrowseError(f"timed out: {url} did not answer within {self.timeout:g} s") from None
        except aiohttp.ClientConnectorError as e:
            if isinstance(e.os_error, _PrivateAddress):
                raise UnsafeURLError(f"{e.os_error}; only public web addresses can be opened") from None
            if isinstance(e, aiohttp.ClientConnectorDNSError):
                raise BrowseError(
                    f"could not resolve the host name {e.host}: {e.os_error.strerror or e.os_error}"
                ) from None
            raise BrowseError(f"could not connect to {e.host}:{e.port} ({e.os_error.strerror or e.os_error})") from None
        except aiohttp.ClientError as e:
            raise BrowseError(f"could not fetch {url}: {type(e).__name__}: {e}") from None
        raise BrowseError(
            f"too many redirects: {url} redirected more than {self.max_redirects} times (last to {display})"
        )

    async def _document(self, response: aiohttp.ClientResponse, url: str, deadline: float) -> Document:
        if response.status >= 400:
            raise BrowseError(f"HTTP {response.status} {response.reason}: {url}")
        media_type = response.headers.get("Content-Type", "").split(";", 1)[0].strip().lower() or None
        charset = response.charset
        if _kind(media_type, charset, b"") in ("pdf", "binary"):
            raise self._refusal(_kind(media_type, charset, b""), media_type, url)
        body, note = await self._read_body(response, url, deadline)
        kind = _kind(media_type, charset, body[:1024])
        if kind in ("pdf", "binary"):
            raise self._refusal(kind, media_type, url)
        text = decode_text(body, charset, cut=bool(note))
        if kind != "html":
            return Document(url, "", text.replace("\r\n", "\n").strip(), note)
        page = await asyncio.to_thread(_parse_html, text, self.max_elements)
        if page is None:
            return Document(url, "", "", note)  # nothing parseable: an empty document
        left = max(deadline - asyncio.get_running_loop().time(), MIN_EXTRACT_TIME)
        try:
            markdown = await _run_stoppable(functools.partial(_extract, page.html, url, self.links), left)
        except TimeoutError:
            # stopped: the plain text instead (linear time, lxml's C code)
            markdown = None
            page.note = _join_notes(
                page.note,
                f"extracting the text did not finish within the {self.timeout:g} s timeout; "
                "the page is shown as plain text, without links",
            )
        if not markdown:
            markdown = await asyncio.to_thread(_plain_text, page.tree)
        return Document(url, page.title, markdown, _join_notes(note, page.note))

    @staticmethod
    def _refusal(kind: str, media_type: str | None, url: str) -> BrowseError:
        if kind == "pdf":
            return BrowseError(
                f"{url} is a PDF document, which this browser cannot read; look for an HTML version of it"
            )
        return BrowseError(
            f"{url} is binary content ({media_type or 'undeclared type'}), not a web page; "
            "only HTML and plain-text pages can be read"
        )

    async def _read_body(self, response: aiohttp.ClientResponse, url: str, deadline: float) -> tuple[bytes, str]:
        loop = asyncio.get_running_loop()
        chunks: list[bytes] = []
        size, note = 0, ""
        while True:
            left = deadline - loop.time()
            try:
                if left <= 0:
                    raise TimeoutError
                chunk = await asyncio.wait_for(response.content.readany(), left)
            except aiohttp.ServerTimeoutError:
                note = f"the server went silent for {self.read_timeout:g} s after {size:,} bytes"
                break
            except TimeoutError:
                note = f"the server was still sending after {self.timeout:g} s; only the first {size:,} bytes were read"
                break
            except aiohttp.ClientPayloadError:
                note = f"the connection broke off after {size:,} bytes"
                break
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
            if size >= self.max_bytes:
                note = f"the page is larger than {self.max_bytes:,} bytes; only the first {self.max_bytes:,} were read"
                break
        if not chunks and note:
            raise BrowseError(f"could not read {url}: {note}")
        return b"".join(chunks)[: self.max_bytes], note


def _redirect(base: URL, location: str, url: str) -> URL:
    """Where a redirect from ``base`` to ``location`` leads; :class:`BrowseError` if it is no URL."""
    try:
        return base.join(URL(location))
    except ValueError:  # "http://[::1": yarl refuses it (UnicodeError, an IDNA failure, is a ValueError)
        raise BrowseError(f"{url} redirected to {location!r}, which is not a valid URL") from None


def _join_notes(*notes: str) -> str:
    return "; ".join(note for note in notes if note)


def _find(pages: list[str], phrase: str) -> str:
    pattern = re.compile(re.escape(phrase), re.IGNORECASE)
    found = [(number, m) for number, text in enumerate(pages, 1) for m in pattern.finditer(text)]
    total = f"{len(pages)} page{'s' if len(pages) > 1 else ''}"
    if not found:
        return f'No match for "{phrase}" in this document ({total}).'
    lines = [
        f'{len(found)} match{"es" if len(found) > 1 else ""} for "{phrase}" ({total})'
        + (f", the first {FIND_MAX_MATCHES} shown:" if len(found) > FIND_MAX_MATCHES else ":")
    ]
    for number, m in found[:FIND_MAX_MATCHES]:
        text = pages[number - 1]
        start, end = max(0, m.start() - FIND_CONTEXT), min(len(text), m.end() + FIND_CONTEXT)
        snippet = " ".join(text[start:end].split())
        lines.append(f"[page {number}] {'…' if start else ''}{snippet}{'…' if end < len(text) else ''}")
    return "\n".join(lines)


def browse_tool(browser: Browser) -> Tool:
    """The ``browse`` tool over a :class:`Browser`."""

    async def browse(url: str, page: int = 1, find: str | None = None) -> str:
        """Open a web page (http or https) and read its text. Long documents come in pages (the result says how many): for page N write {"url": "...", "page": N} as the argument; to look for a phrase write {"url": "...", "find": "phrase"}.

        Args:
            url: The address of the page.
            page: Which page of a long document to read, from 1.
            find: A phrase to look for; lists where it occurs, with page numbers, instead of reading.
        """
        return await browser.read(url, page=page, find=find)

    return tool(browse)
