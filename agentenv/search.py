"""Search backends behind one interface, and the ``search`` tool built on them.

The embedded default is :class:`BM25Search`: a BM25 index (``bm25s``, Snowball stemming, English
stop words) over a passage corpus — the paragraphs that come with a multi-hop QA dataset, or a
user corpus file — built once and cached on disk keyed by a hash of its content.

Rankings are deterministic: best score first, equal scores in corpus order (:func:`top_k`), so
a query answers the same alone or in a batch, and the top 3 are the first 3 of the top 10.

Results are shown to the model as the papers do: the top-k passages, each as
``Page i: title\\ntext``, each truncated to about ``max_chars`` characters.
"""

from __future__ import annotations

import hashlib
import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agentenv.cache import build_once, cache_dir
from agentenv.datasets import DatasetError, Paragraph, read_rows
from agentenv.tools import Tool, tool

__all__ = ["BM25Search", "Passage", "SearchBackend", "format_results", "load_corpus", "search_tool", "top_k"]

_TOKEN_PATTERN = re.compile(r"(?u)\b\w\w+\b")  # bm25s.tokenize's default token_pattern
# Bump when tokenisation or index parameters change, so stale caches are not reused.
_INDEX_VERSION = "bm25s-en-snowball-v1"


@dataclass(frozen=True, slots=True)
class Passage:
    """One search result."""

    title: str
    text: str
    url: str | None = None
    score: float | None = None


class SearchBackend(ABC):
    """Anything that answers a text query with ranked passages."""

    name: str = "search"

    @abstractmethod
    async def search(self, query: str, topk: int) -> list[Passage]:
        """The ``topk`` best passages for ``query``, best first (fewer if fewer match)."""


def format_results(passages: Sequence[Passage], max_chars: int = 1000) -> str:
    """The papers' layout: ``Page i: title\\ntext``, each passage cut to ``max_chars``."""
    if not passages:
        return "No results found."
    pages = []
    for i, p in enumerate(passages, 1):
        text = p.text if len(p.text) <= max_chars else p.text[:max_chars].rsplit(" ", 1)[0] + " …"
        pages.append(f"Page {i}: {p.title}\n{text}")
    return "\n\n".join(pages)


def top_k(scores: np.ndarray, k: int, *, positive: bool = False) -> list[tuple[int, float]]:
    """``(position, score)`` of the ``k`` highest scores, best first, equal scores in position order.

    With ``positive``, only scores above zero count (fewer than ``k`` pairs when fewer are).
    """
    positions = np.flatnonzero(scores > 0) if positive else np.arange(len(scores))
    values = scores[positions]
    if len(values) > k:
        # Keep everything tied with the k-th best, then order by (score, position): the result
        # does not depend on how a partition happens to break ties.
        kth = np.partition(values, len(values) - k)[len(values) - k]
        keep = values >= kth
        positions, values = positions[keep], values[keep]
    order = np.lexsort((positions, -values))[:k]
    return list(zip(positions[order].tolist(), values[order].tolist()))


def _check_index(folder: Path) -> None:
    """Raise unless ``folder`` holds a bm25s index that loads (mapped, so the check reads little)."""
    import bm25s

    bm25s.BM25.load(str(folder), mmap=True, show_progress=False)


class BM25Search(SearchBackend):
    """BM25 over a fixed list of passages; deterministic; the index is cached on disk.

    Building the same corpus twice (in this process or a later one) reuses the index: in
    memory through :meth:`for_corpus`, on disk under ``$AGENTENV_CACHE/bm25/<content hash>``.

    Args:
        passages: The corpus.
        cache: Keep the index on disk (and reuse one found there).
        mmap: Memory-map the on-disk index instead of reading it into memory, so processes
            serving the same corpus share one copy in the page cache (needs ``cache``).
    """

    name = "bm25"
    _instances: dict[str, BM25Search] = {}
    _lock = threading.Lock()

    def __init__(self, passages: Sequence[Paragraph | Passage], *, cache: bool = True, mmap: bool = False) -> None:
        if not passages:
            raise ValueError("BM25Search needs at least one passage")
        if mmap and not cache:
            raise ValueError("mmap=True maps the index cached on disk: it needs cache=True")
        self.passages = [Passage(p.title, p.text, getattr(p, "url", None)) for p in passages]
        self.key = self.content_key(self.passages)
        # Imported here: bm25s pulls in scipy and numba, which a process that never searches should not load.
        import bm25s
        import Stemmer

        self._stemmer = Stemmer.Stemmer("english")
        self._stopwords: frozenset[str] | None = None
        if not cache:
            self.retriever = self._index()
            return
        built: list[bm25s.BM25] = []

        def build(folder: Path) -> None:
            built.append(self._index())
            built[0].save(str(folder), show_progress=False)

        index_dir = build_once(cache_dir("bm25") / self.key, build, _check_index)
        # The index just built is used as it is, unless the processes sharing it should map one file.
        self.retriever = (
            built[0] if built and not mmap else bm25s.BM25.load(str(index_dir), mmap=mmap, show_progress=False)
        )

    def _index(self):
        import bm25s

        retriever = bm25s.BM25()
        tokens = self._tokenize([f"{p.title}\n{p.text}" for p in self.passages])
        if not tokens.vocab:  # bm25s itself fails with "max() arg is an empty sequence"
            first = self.passages[0]
            raise ValueError(
                f"BM25Search: none of the {len(self.passages)} passages has a searchable word (stop words and "
                f"punctuation are not), e.g. passage 0 {first.title!r}: {first.text[:60]!r}; give passages with text"
            )
        retriever.index(tokens, show_progress=False)
        return retriever

    @classmethod
    def for_corpus(cls, passages: Sequence[Paragraph | Passage]) -> BM25Search:
        """A shared instance per corpus content (environments over one corpus share one index)."""
        key = cls.content_key(passages)
        with cls._lock:
            if key not in cls._instances:
                cls._instances[key] = cls(passages)
            return cls._instances[key]

    @staticmethod
    def content_key(passages: Sequence[Paragraph | Passage]) -> str:
        digest = hashlib.sha256(_INDEX_VERSION.encode())
        for p in passages:
            digest.update(p.title.encode())
            digest.update(b"\x00")
            digest.update(p.text.encode())
            digest.update(b"\x01")
        return digest.hexdigest()[:32]

    def _tokenize(self, texts: list[str]):
        import bm25s

        return bm25s.tokenize(texts, stopwords="en", stemmer=self._stemmer, show_progress=False)

    def query_tokens(self, queries: Sequence[str]) -> list[list[str]]:
        """Each query's terms as the index's ``bm25s.tokenize`` gives them, in order.

        Its steps for a query (lower case, its token pattern, English stop words, the stemmer),
        written out: ``bm25s.tokenize`` builds progress bars even when told not to show them,
        ~0.3 ms a call, more than the scoring on corpora of this size.
        """
        if self._stopwords is None:
            from bm25s.tokenization import STOPWORDS_EN

            self._stopwords = frozenset(STOPWORDS_EN)
        stop, stem = self._stopwords, self._stemmer.stemWords
        return [stem([word for word in _TOKEN_PATTERN.findall(q.lower()) if word not in stop]) for q in queries]

    def rank(self, queries: Sequence[str], topk: int) -> list[list[tuple[int, float]]]:
        """Per query, ``(position, score)`` of the ``topk`` passages with a positive BM25 score (see :func:`top_k`).

        Each query is scored alone, so a query's ranking does not depend on the others in the batch.
        """
        ranked: list[list[tuple[int, float]]] = []
        for tokens in self.query_tokens(queries):
            token_ids = self.retriever.get_tokens_ids(tokens)
            if not token_ids:  # no token, or none in the vocabulary: nothing scores above zero
                ranked.append([])
                continue
            ranked.append(top_k(self.retriever.get_scores_from_ids(token_ids), topk, positive=True))
        return ranked

    def search_batch(self, queries: Sequence[str], topk: int) -> list[list[Passage]]:
        """The ``topk`` passages with a positive BM25 score for each query, best first."""
        return [
            [Passage(self.passages[i].title, self.passages[i].text, self.passages[i].url, s) for i, s in hits]
            for hits in self.rank(queries, topk)
        ]

    def search_sync(self, query: str, topk: int = 3) -> list[Passage]:
        """The ``topk`` passages with a positive BM25 score, best first."""
        return self.search_batch([query], topk)[0]

    async def search(self, query: str, topk: int = 3) -> list[Passage]:
        # A query takes well under a millisecond on corpora of this size: no thread hop needed.
        return self.search_sync(query, topk)


def search_tool(backend: SearchBackend, *, topk: int = 3, max_chars: int = 1000) -> Tool:
    """The ``search`` tool over a backend: top-``topk`` passages formatted as the papers do."""

    async def search(query: str) -> str:
        """Search for passages relevant to a query.

        Args:
            query: What to search for.
        """
        return format_results(await backend.search(query, topk), max_chars)

    return tool(search)


def load_corpus(path: str | Path) -> list[Paragraph]:
    """Passages from a JSONL or JSON file of ``{title, text}`` or Search-R1's ``{id, contents}``.

    In ``contents`` the first line is the title (quotes stripped) and the rest the text.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"no such corpus file: {path}")
    passages = []
    for lineno, row in read_rows(path):
        if isinstance(row, dict) and "contents" in row:
            title, _, body = row["contents"].partition("\n")
            passages.append(Paragraph(title.strip().strip('"'), body.strip()))
        elif isinstance(row, dict) and "text" in row:
            passages.append(Paragraph(str(row.get("title", "")), row["text"]))
        else:
            raise DatasetError(f"{path}:{lineno}: a corpus row needs `text` (and `title`) or `contents`")
    if not passages:
        raise DatasetError(f"{path}: empty corpus")
    return passages
