"""The offline web: article pages with links, the search page, its server and its search backend."""

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from agentenv.browse import BrowseError, Browser
from agentenv.datasets import Paragraph
from agentenv.serve.hosting import BackgroundServer
from agentenv.serve.web import LOCAL_WEB_URL, LocalWeb, LocalWebSearch

ROOT = Path(__file__).resolve().parents[3]
CORPUS = [
    Paragraph(
        "Kiss and Tell (1945 film)",
        "Kiss and Tell is a 1945 comedy film starring Shirley Temple. Shirley Temple played Corliss Archer.",
    ),
    Paragraph("Shirley Temple", "Shirley Temple was an American actress and diplomat. She starred in Kiss and Tell."),
    Paragraph("Shirley Temple", "As a diplomat she was Chief of Protocol of the United States."),
    Paragraph("Army (Ellie Goulding song)", "Army is a song by Ellie Goulding. The Army marched on."),
    Paragraph("Oak", "An oak is a tree. Oak wood is hard."),
    Paragraph("", "A passage without a title about the Army and Shirley Temple & <friends>."),
]


@pytest.fixture(scope="module")
def site():
    return LocalWeb(CORPUS)


def test_articles_group_passages_by_title(site):
    assert site.articles == {
        "Kiss_and_Tell_(1945_film)": [0],
        "Shirley_Temple": [1, 2],
        "Army_(Ellie_Goulding_song)": [3],
        "Oak": [4],
        "passage-5": [5],
    }
    assert site.path("Kiss_and_Tell_(1945_film)") == "/wiki/Kiss_and_Tell_(1945_film)"
    assert site.path("AC/DC?") == "/wiki/AC%2FDC%3F"


def test_article_links_the_first_mention_of_other_titles(site):
    page = site.article_html("Kiss_and_Tell_(1945_film)")
    assert "<title>Kiss and Tell (1945 film) - Offline Wiki</title>" in page
    assert (
        '<p id="p1">Kiss and Tell is a 1945 comedy film starring <a href="/wiki/Shirley_Temple">Shirley Temple</a>. '
        "Shirley Temple played Corliss Archer.</p>"
    ) in page  # no self-link, one link per target
    shirley = site.article_html("Shirley_Temple")
    assert (
        '<p id="p1">Shirley Temple was an American actress and diplomat. She starred in '
        '<a href="/wiki/Kiss_and_Tell_(1945_film)">Kiss and Tell</a>.</p>\n'
        '<p id="p2">As a diplomat she was Chief of Protocol of the United States.</p>'
    ) in shirley
    # "Army (Ellie Goulding song)" is not linked from every "Army"; "Oak" is too short to link; text is escaped
    assert (
        '<p id="p1">A passage without a title about the Army and <a href="/wiki/Shirley_Temple">Shirley Temple</a>'
        " &amp; &lt;friends&gt;.</p>"
    ) in site.article_html("passage-5")
    assert site.article_html("Nobody") is None


def test_search_page_home_and_missing_pages(site):
    results = site.search_html("Chief of Protocol")
    assert (
        '<li><a href="/wiki/Shirley_Temple">Shirley Temple</a>\n<p>As a diplomat she was Chief of Protocol' in results
    )
    assert "No articles match these words." in site.search_html("zebra")
    assert "Type words to look for" in site.search_html(" ")
    assert "An offline encyclopedia of 5 articles." in site.home_html()
    assert '<a href="/search?q=Nobody%20Here">searching for it</a>' in site.missing_html("Nobody_Here")


def test_search_backend_returns_urls_into_the_site(site):
    hits = LocalWebSearch(site).search_sync("diplomat Chief of Protocol", 2)
    assert [(h.title, h.url) for h in hits] == [("Shirley Temple", f"{LOCAL_WEB_URL}/wiki/Shirley_Temple")] * 2
    assert hits[0].text == CORPUS[2].text and hits[0].score > hits[1].score > 0
    assert LocalWebSearch(site, "http://127.0.0.1:9/").search_sync("Oak", 1)[0].url == "http://127.0.0.1:9/wiki/Oak"


def test_served_in_background_and_browsed_under_its_alias(site):
    url = site.serve_in_background()
    assert site.serve_in_background() == url and url.startswith("http://127.0.0.1:")
    browser = Browser(aliases={LOCAL_WEB_URL: url})

    async def browse():
        article = await browser.read(f"{LOCAL_WEB_URL}/wiki/Kiss_and_Tell_(1945_film)")
        search = await browser.read(f"{LOCAL_WEB_URL}/search?q=diplomat")
        try:
            await browser.read(f"{LOCAL_WEB_URL}/wiki/Nobody")
        except BrowseError as e:
            return article, search, f"Error: {e}"

    article, search, missing = asyncio.run(browse())
    assert article.startswith(
        "Title: Kiss and Tell (1945 film) - Offline Wiki\n"
        f"URL: {LOCAL_WEB_URL}/wiki/Kiss_and_Tell_(1945_film)\nPage 1 of 1\n\n"
    )
    assert f"starring [Shirley Temple]({LOCAL_WEB_URL}/wiki/Shirley_Temple)." in article
    assert f"[Shirley Temple]({LOCAL_WEB_URL}/wiki/Shirley_Temple)" in search
    assert missing == f"Error: HTTP 404 Not Found: {LOCAL_WEB_URL}/wiki/Nobody"


def test_background_server_reports_start_failures_and_stops():
    server = BackgroundServer(lambda: LocalWeb(CORPUS[:1]).make_app(), host="192.0.2.1")  # not this machine's address
    with pytest.raises(RuntimeError, match=r"could not start the server on 192\.0\.2\.1:0: "):
        server.start()
    server = BackgroundServer(lambda: LocalWeb(CORPUS[:1]).make_app())
    url = server.start()

    async def health():
        async with aiohttp.ClientSession() as session, session.get(f"{url}/health") as r:
            return await r.json()

    assert asyncio.run(health()) == {"status": "ok", "articles": 1, "passages": 1}
    server.stop()
    server.stop()
    with pytest.raises(aiohttp.ClientConnectorError):
        asyncio.run(health())


@pytest.mark.slow
def test_cli_serves_the_offline_web(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"title": p.title, "text": p.text}) + "\n" for p in CORPUS[:3]))
    process = subprocess.Popen(
        [sys.executable, "-m", "agentenv.serve", "web", "--corpus", str(corpus), "--port", "0"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "AGENTENV_CACHE": str(tmp_path / "cache")},
    )
    try:
        banner = process.stdout.readline()
        assert banner.startswith("Serving offline web (2 articles) on http://127.0.0.1:"), banner
        url = banner.split(" on ", 1)[1].split()[0]
        obs = asyncio.run(Browser(allow_private_urls=True).read(f"{url}/wiki/Shirley_Temple"))
        assert obs.startswith(f"Title: Shirley Temple - Offline Wiki\nURL: {url}/wiki/Shirley_Temple\nPage 1 of 1\n\n")
        assert "Chief of Protocol" in obs
    finally:
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=20)
    assert process.returncode == 0 and "Stopping offline web (2 articles)" in err
