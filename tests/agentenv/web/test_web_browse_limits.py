"""The browse tool's limits against hostile pages on 127.0.0.1: extraction bounded and inside the
deadline, aliases that open exactly the origin they name, and every failure a refusal (issue 40)."""

import asyncio
import threading
import time

import pytest
import trafilatura
from aiohttp import web

from agentenv.browse import MAX_ROW_COLUMNS, BrowseError, Browser, decode_text, html_to_text

ARTICLE = (
    "<html><head><title>Eiffel Tower</title></head><body><nav><a href='/'>Home</a></nav><article>"
    "<p>The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France.</p>"
    "</article><footer>Copyright 2024</footer></body></html>"
)


def row_page(cells: int) -> str:
    """One table row of ``cells`` cells: quadratic in trafilatura before rows were split."""
    return "<html><body><table><tr>" + "".join(f"<td>c{i}</td>" for i in range(cells)) + "</tr></table></body></html>"


def hostile_app(other: str = "") -> web.Application:
    """Hostile pages; ``other`` is a second server's base URL that ``/to-other`` redirects to."""

    def page(text: str) -> web.Response:
        return web.Response(text=text, content_type="text/html")

    def redirect(location: str) -> web.Response:  # raw: aiohttp's HTTPFound would refuse a broken Location
        return web.Response(status=302, headers={"Location": location})

    routes = {
        "/article": lambda: page(ARTICLE),
        "/paragraphs": lambda: page("<html><body>" + "".join(f"<p>para {i}" for i in range(30))),
        "/unclosed-p": lambda: page("<html><body>" + "<p>x" * 100_000),  # 400 KB, 100,000 elements
        "/wide-row": lambda: page(row_page(250)),
        "/cells": lambda: page(row_page(100_000)),  # the issue's page: 1 MB, one row of 10^5 cells
        "/spans": lambda: page("<table>" + ("<tr>" + "<td rowspan=100 colspan=100>x</td>" * 3 + "</tr>") * 3),
        "/undefined-charset": lambda: web.Response(
            body=b"Un caf\xe9 pr\xe8s de la gare.", headers={"Content-Type": "text/plain; charset=undefined"}
        ),
        "/to-file": lambda: redirect("file:///etc/passwd"),
        "/to-broken": lambda: redirect("http://[::1"),
        "/to-other": lambda: redirect(f"{other}/article"),
    }
    app = web.Application()
    for path, respond in routes.items():

        async def handler(request: web.Request, respond=respond) -> web.Response:
            return respond()

        app.router.add_get(path, handler)
    return app


@pytest.fixture
async def site(serve):
    return await serve(hostile_app())


def browser(**kwargs) -> Browser:
    options = {"allow_private_urls": True, "connect_timeout": 1.0, "read_timeout": 1.0, "timeout": 2.0}
    return Browser(**{**options, **kwargs})


async def read(b: Browser, url: str, **kwargs) -> str:
    """The observation, or the error message the model would see; never allowed to hang."""
    try:
        return await asyncio.wait_for(b.read(url, **kwargs), timeout=b.timeout + 5)
    except BrowseError as e:
        return f"Error: {e}"


# -- defect 4: extraction bounded and inside the deadline ------------------------------------


async def test_a_page_beyond_max_elements_is_cut_there_with_a_note(site):
    obs = await read(browser(max_elements=20), f"{site}/paragraphs")
    # body, then p 0-18 (the root, html, is not counted): paragraph 19 and all after it are cut
    paragraphs = "\n\n".join(f"para {i}" for i in range(19))
    assert obs == (
        f"Title: {site}/paragraphs\nURL: {site}/paragraphs\n"
        f"Note: the page has more than 20 HTML elements; only the first 20 were read\nPage 1 of 1\n\n{paragraphs}"
    )


def test_the_cut_drops_everything_after_it_in_document_order():
    page = "<html><body><div><p>x<div><p>a<p>b<span>c</span>tail</div>after</div><p>z"
    # body 1, div 2, p 3, div 4, p 5, p 6, span 7, p 8: at 6 the span goes, with its tail and "after"
    assert html_to_text(page, "http://x/", max_elements=6) == (
        "",
        "x\n\na\n\nb",
        "the page has more than 6 HTML elements; only the first 6 were read",
    )
    assert html_to_text(page, "http://x/", max_elements=8)[1:] == ("x\na\nb\nc\ntail\nafter\nz", "")


async def test_unclosed_paragraphs_are_cut_at_the_default_cap(site):
    b = browser(page_chars=100, timeout=30.0)  # a loaded machine must not reach the deadline
    obs = await read(b, f"{site}/unclosed-p")
    assert obs.startswith(
        f"Title: {site}/unclosed-p\nURL: {site}/unclosed-p\n"
        "Note: the page has more than 20,000 HTML elements; only the first 20,000 were read\n"
        "Page 1 of 607; read on with page=2\n\nx\n\nx\n\n"
    ), obs[:300]
    # body, then 19,999 paragraphs (the root, html, is not counted)
    assert (await read(b, f"{site}/unclosed-p", find="x")).split("\n")[3] == (
        '19999 matches for "x" (607 pages), the first 10 shown:'
    )


async def test_a_wide_table_row_is_split_into_rows_of_100_columns(site):
    obs = await read(browser(page_chars=10_000), f"{site}/wide-row")
    rows = obs.split("\n\n", 1)[1].splitlines()
    assert [row.strip("| ").split(" | ") for row in rows] == [
        [f"c{i}" for i in range(start, min(start + MAX_ROW_COLUMNS, 250))] for start in (0, 100, 200)
    ]


async def test_the_issue_page_of_one_row_of_100000_cells_is_cut_and_split(site):
    obs = await read(browser(page_chars=10_000, timeout=30.0), f"{site}/cells")
    assert obs.startswith(
        f"Title: {site}/cells\nURL: {site}/cells\n"
        "Note: the page has more than 20,000 HTML elements; only the first 20,000 were read\nPage 1 of 18; "
    ), obs[:300]
    first_row = obs.split("\n\n", 1)[1].splitlines()[0]
    assert first_row.strip("| ").split(" | ") == [f"c{i}" for i in range(MAX_ROW_COLUMNS)]


async def test_spanning_cells_count_for_the_cells_they_cover(site):
    # each cell covers 100 × 100 cells (trafilatura fills them all): the second is past 10,000
    obs = await read(browser(max_elements=15_000), f"{site}/spans")
    assert "Note: the page has more than 15,000 HTML elements; only the first 15,000 were read\n" in obs


async def test_an_extraction_past_the_deadline_is_stopped_for_the_plain_text(site, monkeypatch):
    finished = []

    def stuck_extract(*args, **kwargs):  # an extractor stuck in a Python loop, as trafilatura on hostile pages
        end = time.perf_counter() + 2.0
        while time.perf_counter() < end:
            pass
        finished.append(True)

    monkeypatch.setattr(trafilatura, "extract", stuck_extract)
    obs = await read(browser(timeout=0.3), f"{site}/article")
    assert obs == (
        f"Title: Eiffel Tower\nURL: {site}/article\nNote: extracting the text did not finish within the 0.3 s "
        "timeout; the page is shown as plain text, without links\nPage 1 of 1\n\n"
        "Home\nThe Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France.\nCopyright 2024"
    )
    await asyncio.sleep(2.5)  # past the end of the loop, had it run on
    assert finished == []  # stopped, not left running
    assert not [t for t in threading.enumerate() if t.name == "browse-extract"]


# -- defect 5: an alias opens exactly the origin it names -------------------------------------


async def test_an_alias_to_a_host_name_opens_only_that_port_and_scheme(serve):
    other = await serve(hostile_app())
    other_port = other.rsplit(":", 1)[1]
    target = await serve(hostile_app(other=f"http://localhost:{other_port}"))
    port = target.rsplit(":", 1)[1]
    b = browser(allow_private_urls=False, aliases={"http://wiki.test": f"http://localhost:{port}"})
    assert (await read(b, "http://wiki.test/article")).startswith(
        "Title: Eiffel Tower\nURL: http://wiki.test/article\n"
    )
    assert (await read(b, f"http://localhost:{port}/article")).startswith(  # the target itself
        f"Title: Eiffel Tower\nURL: http://localhost:{port}/article\n"
    )
    refused = (
        "Error: localhost resolves to the private or local address 127.0.0.1; only public web addresses can be opened"
    )
    assert await read(b, f"http://localhost:{other_port}/article") == refused  # another port of the same name
    assert await read(b, "http://wiki.test/to-other") == refused  # redirected there
    assert await read(b, f"https://localhost:{port}/article") == refused  # another scheme on the same port


# -- defect 6: every failure is a BrowseError with the refusal --------------------------------


async def test_redirects_to_other_schemes_and_broken_urls_are_refusals(site):
    aliased = browser(allow_private_urls=False, aliases={"http://wiki.test": site})
    for b, base in ((browser(), site), (aliased, "http://wiki.test")):
        assert await read(b, f"{base}/to-file") == (
            "Error: only http:// and https:// URLs can be opened, not file: (file:///etc/passwd)"
        )
        assert await read(b, f"{base}/to-broken") == (
            f"Error: {base}/to-broken redirected to 'http://[::1', which is not a valid URL"
        )


async def test_an_undecodable_declared_charset_is_detected_instead(site):
    obs = await read(browser(), f"{site}/undefined-charset")
    assert obs.endswith("Page 1 of 1\n\nUn café près de la gare.")
    for charset in ("undefined", "utf-8\x00", "rot13", "no-such-charset"):
        assert decode_text("Un café près de la gare.".encode("cp1252"), charset) == "Un café près de la gare."
