"""The result cache: modes, persistence, first result wins, and forks seeing the same results."""

import asyncio
import copy
import sqlite3

import pytest

import agentenv
from agentenv.search import Passage, SearchBackend
from agentenv.web_search import CachedSearch, CacheMiss, ResultCache


class CountingBackend(SearchBackend):
    """A backend whose answers change on every call (as the live web may), counting its calls."""

    name = "counting"

    def __init__(self):
        self.calls = 0

    async def search(self, query, topk):
        self.calls += 1
        return [Passage(f"{query} result", f"answer number {self.calls}", f"https://example.org/{self.calls}")][:topk]


async def compute_value(value):
    return value


async def test_use_mode_stores_on_disk_for_later_runs(tmp_path):
    path = tmp_path / "cache.sqlite"
    cache = ResultCache(path)
    assert await cache.fetch("search", ["k", "q", 3], lambda: compute_value({"a": [1, 2]})) == {"a": [1, 2]}
    assert await cache.fetch("search", ["k", "q", 3], lambda: compute_value("ignored")) == {"a": [1, 2]}
    later = ResultCache(path)  # another run, or another process
    assert later.get("search", ["k", "q", 3]) == {"a": [1, 2]}
    assert later.get("search", ["k", "q", 4]) is None and later.get("page", ["k", "q", 3]) is None
    rows = sqlite3.connect(path).execute("SELECT namespace, key, value FROM results").fetchall()
    assert rows == [("search", '["k", "q", 3]', '{"a": [1, 2]}')]


async def test_record_refetches_and_overwrites_replay_never_fetches(tmp_path):
    path = tmp_path / "cache.sqlite"
    await ResultCache(path).fetch("page", "https://a.org", lambda: compute_value("old"))
    record = ResultCache(path, mode="record")
    assert await record.fetch("page", "https://a.org", lambda: compute_value("new")) == "new"
    assert await record.fetch("page", "https://a.org", lambda: compute_value("newer")) == "new"  # first wins in a run
    replay = ResultCache(path, mode="replay")
    assert await replay.fetch("page", "https://a.org", lambda: compute_value("never")) == "new"
    with pytest.raises(CacheMiss) as e:
        await replay.fetch("page", "https://b.org", lambda: compute_value("never"))
    assert str(e.value) == (
        f"no recorded result for page https://b.org in {path} (replay mode); "
        "record it first with cache mode 'record' or 'use'"
    )
    with pytest.raises(
        FileNotFoundError, match="cache mode 'replay' needs a recording, and .*none.sqlite does not exist"
    ):
        ResultCache(tmp_path / "none.sqlite", mode="replay")
    with pytest.raises(ValueError, match="unknown cache mode 'rw'; choose one of use, record, replay, off"):
        ResultCache(path, mode="rw")


async def test_off_mode_always_computes():
    cache = ResultCache(mode="off")
    assert [await cache.fetch("n", "k", lambda v=v: compute_value(v)) for v in (1, 2)] == [1, 2]


async def test_the_first_result_stored_wins_a_race(tmp_path):
    cache = ResultCache(tmp_path / "c.sqlite")

    async def slow(value, delay):
        await asyncio.sleep(delay)
        return value

    results = await asyncio.gather(
        cache.fetch("n", "k", lambda: slow("fast", 0.01)), cache.fetch("n", "k", lambda: slow("slow", 0.05))
    )
    assert results == ["fast", "fast"]
    other_process = ResultCache(tmp_path / "c.sqlite")
    assert other_process.put("n", "k", "late") == "fast"  # a writer that lost the race gets the stored value


async def test_cached_search_keys_by_backend_query_and_topk():
    backend = CountingBackend()
    cached = CachedSearch(backend, ResultCache())
    first = await cached.search("q", 1)
    assert first == [Passage("q result", "answer number 1", "https://example.org/1")]
    assert await cached.search("q", 1) == first and backend.calls == 1
    await cached.search("q", 2)
    await cached.search("other", 1)
    assert backend.calls == 3
    assert cached.key == "CountingBackend" and cached.name == "counting"


def test_forks_see_the_same_results_and_deepcopy_shares_the_cache():
    backend = CountingBackend()
    env = agentenv.make("multihop-qa", search=CachedSearch(backend, ResultCache()))
    env.reset(options={"index": 0})
    env.step("<think>start</think>")
    a, b = env.fork(), env.fork()
    obs_a = a.step("<search>Shirley Temple</search>")[0]
    obs_b = b.step("<search>Shirley Temple</search>")[0]
    assert obs_a == obs_b == "Page 1: Shirley Temple result\nanswer number 1" and backend.calls == 1
    cache = env.backend.cache
    assert copy.deepcopy(cache) is cache
