"""The browse tool against a real server of pathological pages on 127.0.0.1."""

import asyncio
import socket

import pytest
from aiohttp import web
from aiohttp.resolver import ThreadedResolver

import agentenv
from agentenv.browse import (
    BrowseError,
    Browser,
    UnsafeURLError,
    browse_tool,
    check_url,
    decode_text,
    is_public_address,
    split_pages,
)

ARTICLE = """<!DOCTYPE html><html><head><title>Eiffel Tower</title></head><body>
<nav><a href="/">Home</a> | <a href="/about">About</a></nav>
<article><h1>Eiffel Tower</h1>
<p>The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named after the
engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889.</p>
<p>It was the tallest man-made structure in the world until the <a href="/chrysler">Chrysler Building</a> was
finished in New York City in 1930.</p>
</article><footer>Copyright 2024</footer></body></html>"""

FRENCH = "Le café est très apprécié à Paris. Les élèves étudient à l'université près de la gare. " * 6
RUSSIAN = "Москва — столица России, крупнейший по численности населения город страны. " * 6
PARAGRAPH = "Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu. " * 6  # 408 characters
LONG = (
    "<html><head><title>Long</title></head><body><article>"
    + "".join(f"<p>Section {i}. {PARAGRAPH}</p>" for i in range(40))
    + "<p>The needle is here.</p></article></body></html>"
)
CAP = 200_000  # the browser's byte cap in these tests
ENDLESS_CHUNKS = 10_000  # the endless stream gives up after this many 64 KiB chunks (far past the cap)


def html(text: str, **kwargs) -> web.Response:
    return web.Response(text=text, content_type="text/html", **kwargs)


async def stream(request: web.Request, chunks, *, content_type="text/html", pause=0.0) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": content_type})
    await response.prepare(request)
    for chunk in chunks:
        try:
            await response.write(chunk)
        except ConnectionError:
            break  # the browser hung up, as it should
        await asyncio.sleep(pause)
    return response


def pathological_app() -> web.Application:
    async def article(request):
        return html(ARTICLE)

    async def long(request):
        return html(LONG)

    async def huge(request):
        paragraphs = "".join(f"<p>{i}. {PARAGRAPH}</p>" for i in range(13_000))  # 5.5 MB
        return html(f"<html><head><title>Huge</title></head><body><article>{paragraphs}</article></body></html>")

    async def endless(request):
        return await stream(request, (b"<p>" + b"spam " * 13_000 + b"</p>" for _ in range(ENDLESS_CHUNKS)))

    async def drip(request):
        return await stream(request, (b"x" for _ in range(1000)), content_type="text/plain", pause=0.05)

    async def silent(request):
        await asyncio.sleep(30)
        return html(ARTICLE)

    async def redirect_loop(request):
        raise web.HTTPFound("/loop")

    async def chain(request):
        n = int(request.match_info["n"])
        raise web.HTTPFound(f"/chain/{n - 1}" if n > 0 else "/article")

    async def to_private(request):
        raise web.HTTPFound("http://10.0.0.1/admin")

    async def to_file(request):
        raise web.HTTPFound("file:///etc/passwd")

    async def binary(request):
        return web.Response(body=bytes(range(256)) * 40, content_type="application/octet-stream")

    async def png(request):
        return web.Response(body=b"\x89PNG\r\n\x1a\n" + bytes(100), content_type="image/png")

    async def pdf(request):
        return web.Response(body=b"%PDF-1.7\n1 0 obj\n<< >>\nendobj\n", content_type="application/pdf")

    async def pdf_as_html(request):
        return web.Response(body=b"%PDF-1.4\n%\xe2\xe3\xcf\xd3\n", content_type="text/html")

    async def nul_text(request):
        return web.Response(body=b"hello\x00\x01\x02world" * 10, content_type="text/plain")

    async def wrong_charset(request):  # says UTF-8, is Windows-1252
        body = f"<html><body><article><p>{FRENCH}</p></article></body></html>".encode("cp1252")
        return web.Response(body=body, headers={"Content-Type": "text/html; charset=utf-8"})

    async def meta_charset(request):  # no charset in the header; the page's <meta> says windows-1251
        body = (
            f'<html><head><meta charset="windows-1251"><title>Москва</title></head>'
            f"<body><article><p>{RUSSIAN}</p></article></body></html>"
        ).encode("cp1251")
        return web.Response(body=body, headers={"Content-Type": "text/html"})

    async def broken(request):
        return html(
            "<html><head><title>Broken</title><body><div><p>Unclosed paragraph about "
            "<b>lighthouses <i>and their keepers<p>Second &amp broken &nosuch; entity</div></span></table>"
            "<p><<>> stray </td> brackets"
        )

    async def unclosed_title(request):  # a browser shows the rest of the page as the title
        return html("<html><head><title>Start " + "of a very long title " * 20 + "</head><body><p>Never shown</p>")

    async def script_only(request):
        return html(
            "<html><head><script>var x = 1;</script></head><body><script>document.write('hi')</script></body></html>"
        )

    async def empty(request):
        return html("")

    async def plain(request):
        return web.Response(text="Line one.\r\nLine two.", content_type="text/plain")

    async def server_error(request):
        raise web.HTTPInternalServerError()

    async def cut_short(request):  # promises 10,000 bytes, sends a sentence, hangs up
        response = web.StreamResponse(headers={"Content-Type": "text/plain", "Content-Length": "10000"})
        await response.prepare(request)
        await response.write(b"The beginning of a story.")
        await asyncio.sleep(0.05)
        request.transport.close()
        return response

    app = web.Application()
    for path, handler in {
        "/article": article,
        "/long": long,
        "/huge": huge,
        "/endless": endless,
        "/drip": drip,
        "/silent": silent,
        "/loop": redirect_loop,
        "/chain/{n}": chain,
        "/to-private": to_private,
        "/to-file": to_file,
        "/binary": binary,
        "/png": png,
        "/pdf": pdf,
        "/pdf-as-html": pdf_as_html,
        "/nul-text": nul_text,
        "/wrong-charset": wrong_charset,
        "/meta-charset": meta_charset,
        "/broken": broken,
        "/script-only": script_only,
        "/unclosed-title": unclosed_title,
        "/empty": empty,
        "/plain": plain,
        "/error": server_error,
        "/cut-short": cut_short,
    }.items():
        app.router.add_get(path, handler)
    return app


@pytest.fixture
async def site(serve):
    return await serve(pathological_app())


def browser(**kwargs) -> Browser:
    options = {
        "allow_private_urls": True,
        "connect_timeout": 1.0,
        "read_timeout": 1.0,
        "timeout": 2.0,
        "max_bytes": CAP,
        "page_chars": 1000,
    }
    return Browser(**{**options, **kwargs})


async def read(b: Browser, url: str, **kwargs) -> str:
    """The observation, or the error message the model would see; never allowed to hang."""
    try:
        return await asyncio.wait_for(b.read(url, **kwargs), timeout=b.timeout + 3)
    except BrowseError as e:
        return f"Error: {e}"


async def test_an_article_becomes_readable_text_with_links(site):
    obs = await read(browser(), f"{site}/article")
    assert obs.startswith(f"Title: Eiffel Tower\nURL: {site}/article\nPage 1 of 1\n\n")
    assert "The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris" in obs
    assert f"[Chrysler Building]({site}/chrysler)" in obs  # links kept, made absolute
    assert "Copyright 2024" not in obs and "About" not in obs  # boilerplate dropped by trafilatura


async def test_long_pages_are_paged_and_searchable(site):
    b = browser()
    first = await read(b, f"{site}/long")
    assert first.startswith(f"Title: Long\nURL: {site}/long\nPage 1 of 20; read on with page=2\n\n")
    last = await read(b, f"{site}/long", page=20)
    assert "Page 20 of 20\n\nSection 38. Alpha" in last and last.endswith("lambda mu.\n\nThe needle is here.")
    assert await read(b, f"{site}/long", page=21) == "Error: page 21 does not exist: this document has 20 pages"
    assert await read(b, f"{site}/long", page=0) == "Error: page 0 does not exist: this document has 20 pages"
    found = await read(b, f"{site}/long", find="NEEDLE")
    assert found.endswith(
        '1 match for "NEEDLE" (20 pages):\n[page 20] …a epsilon zeta eta theta iota kappa lambda mu. Alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu. The needle is here.'
    )
    many = await read(b, f"{site}/long", find="Section")
    assert '40 matches for "Section" (20 pages), the first 10 shown:\n[page 1] Section 0. Alpha' in many
    assert many.count("\n[page ") == 10
    assert (await read(b, f"{site}/long", find="zebra")).endswith('No match for "zebra" in this document (20 pages).')


async def test_huge_and_endless_pages_are_cut_at_the_size_cap(site):
    note = f"\nNote: the page is larger than {CAP:,} bytes; only the first {CAP:,} were read\n"
    huge = await read(browser(), f"{site}/huge")
    assert huge.startswith(f"Title: Huge\nURL: {site}/huge{note}Page 1 of 238; read on with page=2\n\n0\\. Alpha beta")
    endless = await read(browser(), f"{site}/endless")
    assert endless.startswith(
        f"Title: {site}/endless\nURL: {site}/endless{note}Page 1 of 66; read on with page=2\n\nspam spam"
    )


async def test_slow_drip_is_cut_at_the_timeout(site):
    obs = await read(browser(timeout=1.0), f"{site}/drip")
    assert "\nNote: the server was still sending after 1 s; only the first " in obs
    assert obs.endswith("x" * 5)


async def test_silent_server_times_out(site):
    assert await read(browser(), f"{site}/silent") == f"Error: timed out: {site}/silent stayed silent for more than 1 s"
    slow_total = browser(read_timeout=5.0, timeout=0.5)
    assert await read(slow_total, f"{site}/silent") == f"Error: timed out: {site}/silent did not answer within 0.5 s"


async def test_redirects(site):
    obs = await read(browser(), f"{site}/chain/3")
    assert obs.startswith(f"Title: Eiffel Tower\nURL: {site}/article\n")  # the URL after redirects
    assert await read(browser(), f"{site}/loop") == (
        f"Error: too many redirects: {site}/loop redirected more than 5 times (last to {site}/loop)"
    )
    assert await read(browser(max_redirects=2), f"{site}/chain/3") == (
        f"Error: too many redirects: {site}/chain/3 redirected more than 2 times (last to {site}/chain/0)"
    )
    assert await read(browser(), f"{site}/to-file") == (
        "Error: only http:// and https:// URLs can be opened, not file: (file:///etc/passwd)"
    )


async def test_binary_and_pdf_are_refused(site):
    b = browser()
    assert await read(b, f"{site}/binary") == (
        f"Error: {site}/binary is binary content (application/octet-stream), "
        "not a web page; only HTML and plain-text pages can be read"
    )
    assert await read(b, f"{site}/png") == (
        f"Error: {site}/png is binary content (image/png), not a web page; only HTML and plain-text pages can be read"
    )
    assert await read(b, f"{site}/nul-text") == (
        f"Error: {site}/nul-text is binary content (text/plain), not a web "
        "page; only HTML and plain-text pages can be read"
    )
    for path in ("/pdf", "/pdf-as-html"):
        assert await read(b, f"{site}{path}") == (
            f"Error: {site}{path} is a PDF document, which this browser cannot read; look for an HTML version of it"
        )


async def test_charsets(site):
    wrong = await read(browser(), f"{site}/wrong-charset")
    assert "Le café est très apprécié à Paris. Les élèves étudient à l'université" in wrong
    meta = await read(browser(), f"{site}/meta-charset")
    assert meta.startswith("Title: Москва\n") and "Москва — столица России" in meta


async def test_broken_empty_and_script_only_html(site):
    broken = await read(browser(), f"{site}/broken")
    assert broken == (
        f"Title: Broken\nURL: {site}/broken\nPage 1 of 1\n\nUnclosed paragraph about **lighthouses "
        "*and their keepers***\n\nSecond & broken &nosuch; entity\n\n\\<\\<>> stray brackets"
    )
    unclosed = await read(browser(), f"{site}/unclosed-title")
    assert unclosed.startswith("Title: Start of a very long title of a") and len(unclosed.split("\n")[0]) < 220
    assert unclosed.endswith("The page has no readable text.")
    for path in ("/empty", "/script-only"):
        obs = await read(browser(), f"{site}{path}")
        assert obs.endswith("The page has no readable text.") and "Error" not in obs


async def test_plain_text_http_errors_and_broken_connections(site, closed_port):
    assert (await read(browser(), f"{site}/plain")).endswith("Page 1 of 1\n\nLine one.\nLine two.")
    assert await read(browser(), f"{site}/error") == f"Error: HTTP 500 Internal Server Error: {site}/error"
    assert await read(browser(), f"{site}/nowhere") == f"Error: HTTP 404 Not Found: {site}/nowhere"
    cut = await read(browser(), f"{site}/cut-short")
    assert "Note: the connection broke off after 25 bytes" in cut and cut.endswith("The beginning of a story.")
    assert await read(browser(), f"http://127.0.0.1:{closed_port}/") == (
        f"Error: could not connect to 127.0.0.1:{closed_port} (Connect call failed ('127.0.0.1', {closed_port}))"
    )


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("file:///etc/passwd", "only http:// and https:// URLs can be opened, not file: (file:///etc/passwd)"),
        ("ftp://example.com/x", "only http:// and https:// URLs can be opened, not ftp: (ftp://example.com/x)"),
        ("javascript:alert(1)", "only http:// and https:// URLs can be opened, not javascript: (javascript:alert(1))"),
        ("/relative/path", "only http:// and https:// URLs can be opened, not a relative address (/relative/path)"),
        (
            "http://127.0.0.1:8000/",
            "http://127.0.0.1:8000/ points to the private or local address 127.0.0.1; only public web addresses can be opened",
        ),
        (
            "http://10.1.2.3/",
            "http://10.1.2.3/ points to the private or local address 10.1.2.3; only public web addresses can be opened",
        ),
        (
            "http://169.254.169.254/latest/meta-data",
            "http://169.254.169.254/latest/meta-data points to the private or local address 169.254.169.254; only public web addresses can be opened",
        ),
        (
            "http://[::1]:8000/",
            "http://[::1]:8000/ points to the private or local address ::1; only public web addresses can be opened",
        ),
        (
            "http://[::ffff:127.0.0.1]/",
            "http://[::ffff:127.0.0.1]/ points to the private or local address ::ffff:7f00:1; only public web addresses can be opened",
        ),
        # IPv6 forms that embed a private or loopback IPv4 address are judged by that address
        (
            "http://[::127.0.0.1]/",  # IPv4-compatible
            "http://[::127.0.0.1]/ points to the private or local address ::7f00:1; only public web addresses can be opened",
        ),
        (
            "http://[::ffff:0:127.0.0.1]/",  # IPv4-translated
            "http://[::ffff:0:127.0.0.1]/ points to the private or local address ::ffff:0:7f00:1; only public web addresses can be opened",
        ),
        (
            "http://[64:ff9b::10.0.0.1]/",  # NAT64
            "http://[64:ff9b::10.0.0.1]/ points to the private or local address 64:ff9b::a00:1; only public web addresses can be opened",
        ),
        (
            "http://[64:ff9b::127.0.0.1]:8000/",  # NAT64
            "http://[64:ff9b::127.0.0.1]:8000/ points to the private or local address 64:ff9b::7f00:1; only public web addresses can be opened",
        ),
        (
            "http://[64:ff9b:1::8.8.8.8]/",  # local-use NAT64: never global, whatever it embeds
            "http://[64:ff9b:1::8.8.8.8]/ points to the private or local address 64:ff9b:1::808:808; only public web addresses can be opened",
        ),
        (
            "http://[2002:7f00:1::1]/",  # 6to4 of 127.0.0.1
            "http://[2002:7f00:1::1]/ points to the private or local address 2002:7f00:1::1; only public web addresses can be opened",
        ),
        (
            "http://[2002:a9fe:a9fe::]/latest/meta-data",  # 6to4 of 169.254.169.254
            "http://[2002:a9fe:a9fe::]/latest/meta-data points to the private or local address 2002:a9fe:a9fe::; only public web addresses can be opened",
        ),
        (
            "http://0.0.0.0/",
            "http://0.0.0.0/ points to the private or local address 0.0.0.0; only public web addresses can be opened",
        ),
        (
            "http://2130706433/",
            "http://2130706433/ uses a numeric address form (2130706433) that is not a canonical IP address; write the address in dotted form",
        ),
        (
            "http://0x7f.1/",
            "http://0x7f.1/ uses a numeric address form (0x7f.1) that is not a canonical IP address; write the address in dotted form",
        ),
    ],
)
async def test_unsafe_urls_are_refused_before_any_connection(url, message):
    with pytest.raises(UnsafeURLError) as e:
        check_url(url)
    assert str(e.value) == message
    assert await read(browser(allow_private_urls=False), url) == f"Error: {message}"


def test_ipv6_forms_embedding_a_public_ipv4_address_stay_public():
    for address in ("::ffff:8.8.8.8", "::8.8.8.8", "::ffff:0:8.8.8.8", "64:ff9b::8.8.8.8", "2002:808:808::1"):
        assert is_public_address(address), address
    assert is_public_address("2606:4700:4700::1111") and not is_public_address("fe80::1%eth0")


async def test_host_names_are_checked_when_resolved(site):
    port = site.rsplit(":", 1)[1]
    assert await read(browser(allow_private_urls=False), f"http://localhost:{port}/article") == (
        "Error: localhost resolves to the private or local address 127.0.0.1; only public web addresses can be opened"
    )


@pytest.mark.parametrize("address", ["::ffff:127.0.0.1", "::127.0.0.1", "64:ff9b::10.0.0.1", "2002:7f00:1::"])
async def test_host_names_resolving_to_embedded_private_addresses_are_refused(monkeypatch, address):
    async def resolve(self, host, port=0, family=socket.AF_INET):
        return [{"hostname": host, "host": address, "port": port, "family": socket.AF_INET6, "proto": 0, "flags": 0}]

    monkeypatch.setattr(ThreadedResolver, "resolve", resolve)
    assert await read(browser(allow_private_urls=False), "http://rebind.test/") == (
        f"Error: rebind.test resolves to the private or local address {address}; "
        "only public web addresses can be opened"
    )


async def test_allow_private_urls_opens_loopback_by_address_and_by_name(site):
    port = site.rsplit(":", 1)[1]
    b = browser(allow_private_urls=True)
    for url in (f"http://127.0.0.1:{port}/article", f"http://localhost:{port}/article"):
        obs = await read(b, url)
        assert obs.startswith(f"Title: Eiffel Tower\nURL: {url}\nPage 1 of 1\n\n"), obs
        assert "The Eiffel Tower is a wrought-iron lattice tower" in obs


async def test_web_research_allow_private_urls_reaches_the_tool(site):
    url = f"http://localhost:{site.rsplit(':', 1)[1]}/article"
    opened = agentenv.make("web-research", allow_private_urls=True)
    await opened.areset(options={"index": 0})
    assert (await opened.astep(f"<browse>{url}</browse>"))[0].startswith(f"Title: Eiffel Tower\nURL: {url}\n")
    default = agentenv.make("web-research")
    await default.areset(options={"index": 0})
    assert (await default.astep(f"<browse>{url}</browse>"))[0] == (
        "Error: localhost resolves to the private or local address 127.0.0.1; only public web addresses can be opened"
    )


async def test_aliases_serve_a_trusted_site_without_opening_others(site, closed_port):
    b = browser(allow_private_urls=False, aliases={"http://site.test": site})
    obs = await read(b, "http://site.test/chain/1")
    assert obs.startswith("Title: Eiffel Tower\nURL: http://site.test/article\n")  # shown under the alias
    assert "[Chrysler Building](http://site.test/chrysler)" in obs
    assert await read(b, "http://site.test/to-private") == (
        "Error: http://10.0.0.1/admin points to the private or local address 10.0.0.1; only public web addresses can be opened"
    )
    assert (await read(b, f"http://127.0.0.1:{closed_port}/")).startswith(
        f"Error: http://127.0.0.1:{closed_port}/ points to the private or local address 127.0.0.1"
    )


async def test_pages_are_cached_so_forks_read_the_same_document(serve):
    served = []

    async def counter(request):
        served.append(1)
        return html(f"<html><body><article><p>{PARAGRAPH} Visit number {len(served)}.</p></article></body></html>")

    app = web.Application()
    app.router.add_get("/counter", counter)
    url = await serve(app) + "/counter"
    b = browser()
    first = await read(b, url)
    assert await read(b, url, page=1) == first and "Visit number 1." in first
    assert len(served) == 1
    assert await read(browser(), url) != first  # another browser (another episode tree) fetches again
    assert len(served) == 2


async def test_browse_tool_schema_and_arguments(site):
    t = browse_tool(browser())
    assert t.name == "browse" and t.primary_parameter == "url"
    assert t.parameters["required"] == ["url"]
    assert set(t.parameters["properties"]) == {"url", "page", "find"}
    obs = await t.acall({"url": f" <{site}/long> ", "page": "2"})
    assert "Page 2 of 20; read on with page=3" in obs


def test_split_pages_and_decode_text():
    assert split_pages("aaaa bbbb\ncccc dddd eeee", 12) == ["aaaa bbbb", "cccc dddd", "eeee"]
    assert split_pages("", 100) == [""]
    assert decode_text("é".encode() + "é".encode()[:1], "latin-1", cut=True) == "é"  # cut mid-character: still UTF-8
    assert decode_text("café".encode("latin-1"), "latin-1") == "café"
    assert decode_text(FRENCH.encode("cp1252"), "no-such-charset") == FRENCH  # unknown charset: detected
    assert decode_text("\ufeffBOM".encode(), None) == "BOM"
