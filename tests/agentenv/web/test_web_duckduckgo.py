"""The DuckDuckGo backend: parsing of DuckDuckGo's HTML results, rate limits, and failing offline.

Nothing here reaches the internet: the engine's endpoint is pointed at a local server that
answers with recorded pages, and the offline cases go through proxies on 127.0.0.1 that refuse
or never answer.
"""

import asyncio
import socket
import threading
from pathlib import Path

import pytest
from aiohttp import web
from ddgs.engines.duckduckgo import Duckduckgo

import agentenv
from agentenv.search import Passage
from agentenv.web_search import CachedSearch, DuckDuckGoSearch, ResultCache, SearchUnavailable

DATA = Path(__file__).parent / "data"
RESULTS = (DATA / "duckduckgo_html_results.html").read_text()
NO_RESULTS = (DATA / "duckduckgo_html_no_results.html").read_text()
EXPECTED = [
    Passage(
        "Python (programming language) - Wikipedia",
        "Python is a high-level, general-purpose programming language. Its design philosophy emphasizes code "
        "readability with the use of significant indentation.",
        "https://en.wikipedia.org/wiki/Python_(programming_language)",
    ),
    Passage(
        "Welcome to Python.org",
        "The official home of the Python Programming Language — downloads, documentation & news.",
        "https://www.python.org/",
    ),
    Passage(
        "The Python Tutorial — Python 3 documentation",
        "Python is an easy to learn, powerful programming language. It has efficient high-level data structures.",
        "https://docs.python.org/3/tutorial/index.html",
    ),
]


@pytest.fixture
async def duckduckgo(serve, monkeypatch):
    """A local stand-in of html.duckduckgo.com: answers ``statuses`` in turn, then ``page``."""
    state = {"statuses": [], "page": RESULTS, "forms": []}

    async def html_endpoint(request):
        state["forms"].append(dict(await request.post()))
        status = state["statuses"].pop(0) if state["statuses"] else 200
        body = state["page"] if status == 200 else "<html><body>anomaly detected</body></html>"
        return web.Response(text=body, status=status, content_type="text/html")

    app = web.Application()
    app.router.add_post("/html/", html_endpoint)
    url = await serve(app)
    monkeypatch.setattr(Duckduckgo, "search_url", f"{url}/html/")
    monkeypatch.delenv("DDGS_PROXY", raising=False)
    return state


async def test_recorded_results_are_parsed_into_passages(duckduckgo):
    assert await DuckDuckGoSearch().search("python programming language", 10) == EXPECTED  # ad and repeat dropped
    assert duckduckgo["forms"] == [{"q": "python programming language", "b": "", "l": "us-en"}]
    assert await DuckDuckGoSearch(region="uk-en").search("python programming language", 2) == EXPECTED[:2]
    assert duckduckgo["forms"][-1]["l"] == "uk-en"


async def test_no_results_page(duckduckgo):
    duckduckgo["page"] = NO_RESULTS
    assert await DuckDuckGoSearch().search("qwxzvv", 10) == []


async def test_rate_limits_are_retried_with_backoff(duckduckgo):
    duckduckgo["statuses"] = [202, 429]
    assert await DuckDuckGoSearch(backoff=0.01).search("python programming language", 1) == EXPECTED[:1]
    assert len(duckduckgo["forms"]) == 3
    duckduckgo["statuses"] = [202] * 5
    with pytest.raises(SearchUnavailable) as e:
        await DuckDuckGoSearch(retries=1, backoff=0.01).search("python", 1)
    assert str(e.value).startswith("web search (duckduckgo) failed after 2 attempts in ")
    assert str(e.value).endswith(" s: rate limited (HTTP 202)")


async def test_results_are_cached_by_query_and_topk(duckduckgo, tmp_path):
    cache = ResultCache(tmp_path / "results.sqlite")
    backend = CachedSearch(DuckDuckGoSearch(), cache)
    first = await backend.search("python programming language", 3)
    assert first == EXPECTED and await backend.search("python programming language", 3) == first
    assert len(duckduckgo["forms"]) == 1
    await backend.search("python programming language", 2)  # another top-k is another request
    assert len(duckduckgo["forms"]) == 2
    duckduckgo["page"] = NO_RESULTS  # the web changed, but a replay of the recording does not
    replay = CachedSearch(DuckDuckGoSearch(), ResultCache(tmp_path / "results.sqlite", mode="replay"))
    assert await replay.search("python programming language", 3) == EXPECTED
    assert len(duckduckgo["forms"]) == 2


async def test_offline_a_refused_connection_fails_fast_with_a_clear_message(closed_port, monkeypatch):
    monkeypatch.setenv("DDGS_PROXY", f"http://127.0.0.1:{closed_port}")  # never reaches the internet
    backend = DuckDuckGoSearch(timeout=5, retries=1, backoff=0.05)
    with pytest.raises(SearchUnavailable) as e:
        await asyncio.wait_for(backend.search("python", 3), 10)
    assert str(e.value).startswith("web search (duckduckgo) failed after 2 attempts in ")


@pytest.fixture
def silent_proxy():
    """A proxy on 127.0.0.1 that accepts connections and never answers."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted, stop = [], threading.Event()

    def accept():
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except TimeoutError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{listener.getsockname()[1]}"
    stop.set()
    thread.join(2)
    for conn in accepted:
        conn.close()
    listener.close()


async def test_offline_a_silent_network_ends_at_the_timeout(silent_proxy):
    backend = DuckDuckGoSearch(proxy=silent_proxy, timeout=1.5, retries=3)
    with pytest.raises(SearchUnavailable) as e:
        await asyncio.wait_for(backend.search("python", 3), 10)
    assert str(e.value).startswith("web search (duckduckgo) failed after ")
    assert "in 1.5 s: " in str(e.value)


def test_web_research_with_duckduckgo_offline_gives_an_observation(closed_port, monkeypatch, tmp_path):
    monkeypatch.setenv("AGENTENV_CACHE", str(tmp_path))
    monkeypatch.setenv("DDGS_PROXY", f"http://127.0.0.1:{closed_port}")
    env = agentenv.make("web-research", search="duckduckgo")
    assert isinstance(env.backend, CachedSearch) and isinstance(env.backend.backend, DuckDuckGoSearch)
    env.backend.backend.backoff = 0.05  # keep the test short; the default waits 1, 2, 4 s between attempts
    env.reset(options={"index": 0})
    obs, reward, terminated, truncated, info = env.step("<search>Sword Art Online studio</search>")
    assert obs.startswith("Error: web search (duckduckgo) failed after 4 attempts in ")
    assert (reward, terminated, truncated, info["tool_calls"]) == (0.0, False, False, 1)


def test_unknown_engine_is_refused():
    with pytest.raises(ValueError, match=r"unknown ddgs text engine 'altavista'; choose one of \[.*'duckduckgo'"):
        DuckDuckGoSearch(engine="altavista")
