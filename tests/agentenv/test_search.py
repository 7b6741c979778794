import json

import pytest

import agentenv
from agentenv.datasets import DatasetError, Paragraph, builtin_path, load_examples
from agentenv.search import BM25Search, Passage, format_results, load_corpus, search_tool

CORPUS = [
    Paragraph("Paris", "Paris is the capital and largest city of France."),
    Paragraph("Berlin", "Berlin is the capital of Germany."),
    Paragraph("Rush (band)", "Rush was a Canadian rock band formed in Toronto. Neil Peart was its drummer."),
]


def test_bm25_ranks_and_is_deterministic(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTENV_CACHE", str(tmp_path))
    index = BM25Search(CORPUS)
    hits = index.search_sync("capital of France", topk=2)
    assert [p.title for p in hits] == ["Paris", "Berlin"]
    assert hits[0].score > hits[1].score > 0
    assert index.search_sync("capital of France", topk=2) == hits
    assert index.search_sync("drummer", topk=3) == [
        Passage("Rush (band)", CORPUS[2].text, None, hits_score(index, "drummer"))
    ]
    assert index.search_sync("zebra", topk=3) == []  # nothing scores: no results, not random ones
    assert index.search_sync("the of", topk=3) == []  # only stop words
    assert len(index.search_sync("capital", topk=50)) == 2


def hits_score(index, query):
    return index.search_sync(query, 1)[0].score


def test_index_is_cached_on_disk_by_content(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTENV_CACHE", str(tmp_path))
    first = BM25Search(CORPUS)
    index_dir = tmp_path / "bm25" / first.key
    assert (index_dir / "params.index.json").exists()
    stamp = (index_dir / "params.index.json").stat().st_mtime_ns
    second = BM25Search(CORPUS)  # loads, does not rebuild
    assert (index_dir / "params.index.json").stat().st_mtime_ns == stamp
    assert second.search_sync("Toronto drummer", 3) == first.search_sync("Toronto drummer", 3)
    assert BM25Search(CORPUS[:2]).key != first.key
    assert BM25Search.for_corpus(CORPUS) is BM25Search.for_corpus(list(CORPUS))
    assert sorted(p.name for p in index_dir.iterdir() if not p.name.endswith(".npy")) == [
        ".complete",
        "params.index.json",
        "vocab.index.json",
    ]
    (index_dir / "vocab.index.json").unlink()  # an index that lost a file is built again, not loaded
    third = BM25Search(CORPUS)
    assert (index_dir / "vocab.index.json").is_file() and (index_dir / "params.index.json").stat().st_mtime_ns != stamp
    assert third.search_sync("Toronto drummer", 3) == first.search_sync("Toronto drummer", 3)


def test_passages_without_a_searchable_word_are_refused_with_what_was_given(tmp_path, monkeypatch):
    monkeypatch.setenv("AGENTENV_CACHE", str(tmp_path))
    with pytest.raises(ValueError) as error:
        BM25Search([Paragraph("", "!!! ..."), Paragraph("The", "of the and ?")], cache=False)
    assert str(error.value) == (
        "BM25Search: none of the 2 passages has a searchable word (stop words and punctuation are not), "
        "e.g. passage 0 '': '!!! ...'; give passages with text"
    )


def test_format_results_as_the_papers_do():
    passages = [Passage("A", "one two three four"), Passage("B", "short")]
    assert format_results(passages, max_chars=9) == "Page 1: A\none two …\n\nPage 2: B\nshort"
    assert format_results([]) == "No results found."


async def test_search_tool():
    t = search_tool(BM25Search(CORPUS, cache=False), topk=1)
    assert t.name == "search" and t.primary_parameter == "query"
    assert await t.acall({"query": "German capital"}) == "Page 1: Berlin\nBerlin is the capital of Germany."


def test_load_corpus_formats(tmp_path):
    (tmp_path / "a.jsonl").write_text(
        '{"title": "T", "text": "body"}\n{"id": "1", "contents": "\\"Quoted\\"\\nText here"}\n'
    )
    assert load_corpus(tmp_path / "a.jsonl") == [Paragraph("T", "body"), Paragraph("Quoted", "Text here")]
    (tmp_path / "b.json").write_text(json.dumps([{"title": "T", "text": "x"}]))
    assert load_corpus(tmp_path / "b.json") == [Paragraph("T", "x")]
    (tmp_path / "c.jsonl").write_text('{"title": "T"}\n')
    with pytest.raises(DatasetError, match=r"c.jsonl:1: a corpus row needs `text`"):
        load_corpus(tmp_path / "c.jsonl")


def test_unseen_official_hotpotqa_file_end_to_end(tmp_path):
    """Done-means: an official-format HotpotQA file the project has never seen (a JSON list)."""
    # Official-format records (HotpotQA and 2Wiki share it), written as one JSON list like the
    # official dev file, at a path no environment has loaded.
    rows = [
        json.loads(line)
        for name in ("hotpotqa-official", "2wiki")
        for line in builtin_path(name).read_text().splitlines()
    ]
    path = tmp_path / "hotpot_dev_distractor_unseen.json"
    path.write_text(json.dumps(rows))
    env = agentenv.make("multihop-qa", data=str(path))
    examples = load_examples(path)
    found = 0
    for i, example in enumerate(examples):
        env.reset(options={"index": i})
        obs, *_ = env.step(f"<search>{example.question}</search>")
        gold_titles = {p.title for p in example.paragraphs if p.is_supporting}
        found += any(f": {title}\n" in obs for title in gold_titles)
    assert found / len(examples) >= 0.85, found / len(examples)

    env.reset(options={"index": 0})
    assert env.step("<answer>\\boxed{Rush}</answer>")[1:3] == (1.0, True)
    env.reset(options={"index": 0})
    assert env.step("<answer>\\boxed{Queen}</answer>")[1:3] == (0.0, True)


def test_query_terms_are_bm25s_tokenize_s():
    import random

    import bm25s

    index = BM25Search([Paragraph("Rush", "Neil Peart was the drummer of Rush.")])
    rng = random.Random(0)
    pieces = ["The", " drummers", "'s", " RUNNING", " é", "中文", " 3.14", " x", " __init__", "\n", "-", " a1"]
    queries = [e.question for name in ("nq", "hotpotqa") for e in load_examples(name)][:500]
    queries += ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 12))) for _ in range(300)]
    expected = bm25s.tokenize(queries, stopwords="en", stemmer=index._stemmer, show_progress=False, return_ids=False)
    assert index.query_tokens(queries) == expected
    assert index.query_tokens(["the of a", ""]) == [[], []]
