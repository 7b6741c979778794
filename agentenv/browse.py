"""The ``browse`` tool: open a web page and read it as text, one page at a time.

:class:`Browser` fetches with aiohttp and turns what comes back into an observation. What it
does with each kind of response:

================================  ==========================================================
scheme other than http(s)         refused
private, loopback, link-local     refused (literal IPs, and every address a host name resolves
or reserved address               to, on every redirect hop) unless ``allow_private_urls=True``;
                                  the environment's own ``aliases`` (its offline web) are trusted
redirects                         followed up to ``max_redirects``, each hop checked, then
                                  "too many redirects"
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
long text                         split into pages of ``page_chars``; ``page=N`` reads page N,
                                  ``find=`` lists the matches with their page numbers
================================  ==========================================================

Every fetched document is cached (by the URL asked for) in a :class:`~agentenv.web_search.ResultCache`
shared by all forks of the environment, so the branches of a tree read the same page.
"""

from __future__ import annotations

import asyncio
import codecs
import ipaddress
import re
import socket
from collections.abc import Mapping
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


def check_url(
    url: str, *, allow_private: bool = False, trusted: frozenset[tuple[str | None, int | None]] = frozenset()
) -> URL:
    """The parsed URL, or :class:`UnsafeURLError` if it is not http(s) or names a non-public IP.

    Host names are checked when they are resolved (see :class:`_GuardedResolver`); ``trusted``
    ``(host, port)`` pairs (the environment's own servers) are allowed as they are.
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
    if allow_private or (parsed.host, parsed.port) in trusted:
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
    """Resolves a host name and refuses it if any of its addresses is not public."""

    def __init__(self, trusted_hosts: frozenset[str]) -> None:
        super().__init__()
        self.trusted_hosts = trusted_hosts

    async def resolve(
        self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET
    ) -> list[ResolveResult]:
        hosts = await super().resolve(host, port, family)
        if host not in self.trusted_hosts:
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
            except (UnicodeDecodeError, LookupError):
                continue  # a wrong or unknown declaration: detect instead
    matches = charset_normalizer.from_bytes(body)
    best = matches.best()
    if best is None:
        return body.decode("utf-8", errors="replace")
    # Western text often fits several legacy code pages equally well; the web's usual one is
    # windows-1252 (what WHATWG decodes "latin-1" as), so it wins ties.
    tied = [m for m in matches if (m.chaos, m.coherence) == (best.chaos, best.coherence)]
    return str(next((m for m in tied if m.encoding == "cp1252"), best))


def html_to_text(html: str, url: str, *, links: bool = True) -> tuple[str, str]:
    """``(title, text)`` of an HTML page: trafilatura's Markdown, else lxml's plain text."""
    parser = lxml.html.HTMLParser(encoding="utf-8", remove_comments=True)
    try:  # bytes, so that an XML encoding declaration in the page is not an error
        tree = lxml.html.fromstring(html.encode("utf-8", "replace"), parser=parser)
    except (lxml.etree.ParserError, ValueError):
        return "", ""  # nothing parseable: an empty document
    title = " ".join((tree.findtext(".//title") or "").split())
    if not title:
        h1 = tree.find(".//h1")
        title = " ".join(h1.text_content().split()) if h1 is not None else ""
    if len(title) > MAX_TITLE_CHARS:  # an unclosed <title> swallows the page, as in browsers
        title = title[:MAX_TITLE_CHARS].rsplit(" ", 1)[0] + " …"
    text = trafilatura.extract(
        html,
        url=url,
        output_format="markdown",
        include_links=links,
        include_tables=True,
        include_comments=False,
        favor_recall=True,
        deduplicate=False,
    )
    return title, text or _plain_text(tree)


def _plain_text(tree: lxml.html.HtmlElement) -> str:
    for bad in tree.xpath("//script | //style | //noscript | //template | //head"):
        bad.drop_tree()
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
            machine to the model.
        connect_timeout: Seconds to connect. read_timeout: seconds of server silence allowed.
        timeout: Seconds for a whole fetch (redirects and body included).
        max_bytes: Body bytes read at most (the rest is cut, and the observation says so).
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
        page_chars: int = DEFAULT_PAGE_CHARS,
        links: bool = True,
        cache: ResultCache | None = None,
    ) -> None:
        if min(connect_timeout, read_timeout, timeout) <= 0 or max_bytes < 1 or max_redirects < 0 or page_chars < 100:
            raise ValueError("timeouts must be > 0, max_bytes >= 1, max_redirects >= 0 and page_chars >= 100")
        self.allow_private_urls = allow_private_urls
        self.aliases = {URL(k).origin(): URL(v).origin() for k, v in (aliases or {}).items()}
        # the aliases and their targets (the environment's own servers) pass the private-address checks
        self._trusted = frozenset((u.host, u.port) for pair in self.aliases.items() for u in pair)
        self._trusted_names = frozenset(target.host for target in self.aliases.values() if target.host)
        self.connect_timeout, self.read_timeout, self.timeout = connect_timeout, read_timeout, timeout
        self.max_bytes, self.max_redirects, self.page_chars, self.links = max_bytes, max_redirects, page_chars, links
        self.cache = cache if cache is not None else ResultCache()

    def __deepcopy__(self, memo: dict[int, Any]) -> Browser:
        return self  # shared by design: forks read the same pages

    async def open(self, url: str) -> Document:
        """The document at ``url`` (cached); raises :class:`BrowseError` saying what went wrong."""
        url = url.strip().strip("<>\"'")
        check_url(url, allow_private=self.allow_private_urls, trusted=self._trusted)

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

    def _to_fetch(self, url: URL) -> URL:
        target = self.aliases.get(url.origin())
        if target is None:
            return url
        assert target.host is not None  # an origin() has a network location, so a host
        return url.with_scheme(target.scheme).with_host(target.host).with_port(target.port)

    def _to_display(self, url: URL) -> URL:
        for alias, target in self.aliases.items():
            if url.origin() == target:
                assert alias.host is not None  # an origin() has a network location, so a host
                return url.with_scheme(alias.scheme).with_host(alias.host).with_port(alias.explicit_port)
        return url

    async def _fetch(self, url: str) -> Document:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        timeouts = aiohttp.ClientTimeout(total=None, sock_connect=self.connect_timeout, sock_read=self.read_timeout)
        # allow_private_urls opens host names that resolve to private addresses too, not only literal IPs
        resolver = ThreadedResolver() if self.allow_private_urls else _GuardedResolver(self._trusted_names)
        connector = aiohttp.TCPConnector(resolver=resolver, use_dns_cache=False)
        headers = {"User-Agent": USER_AGENT, "Accept": "text/html,application/xhtml+xml,text/plain;q=0.9,*/*;q=0.5"}
        display = URL(url)
        try:
            async with aiohttp.ClientSession(connector=connector, timeout=timeouts, headers=headers) as session:
                for _ in range(self.max_redirects + 1):
                    target = self._to_fetch(
                        check_url(str(display), allow_private=self.allow_private_urls, trusted=self._trusted)
                    )
                    left = deadline - loop.time()
                    if left <= 0:
                        raise TimeoutError
                    response = await asyncio.wait_for(session.get(target, allow_redirects=False), left)
                    try:
                        location = response.headers.get("Location")
                        if response.status in REDIRECT_STATUS and location:
                            display = self._to_display(target.join(URL(location)))
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
        if kind == "html":
            title, text = await asyncio.to_thread(html_to_text, text, url, links=self.links)
        else:
            title, text = "", text.replace("\r\n", "\n").strip()
        return Document(url, title, text, note)

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
