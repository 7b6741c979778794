"""QA datasets: one loader for the formats the QA agent-RL papers use, format detected per file.

Supported (JSONL, or a JSON list, or a JSON object with a ``data`` list):

=============  ===================================================================================
``hotpotqa``   official HotpotQA / 2WikiMultihopQA: ``question``, ``answer``,
               ``context [[title, [sentences]]]``, ``supporting_facts [[title, i]]``
``ircot``      IRCoT's processed HotpotQA: ``question_text``, ``answers_objects[].spans``,
               ``contexts [{title, paragraph_text, is_supporting}]``
``musique``    MuSiQue: ``question``, ``answer``, ``answer_aliases``,
               ``paragraphs [{title, paragraph_text, is_supporting}]``
``flashrag``   FlashRAG JSONL: ``question``, ``golden_answers``
``plain``      ``{"question": …, "answers": [...]}`` (``answer`` as one string also accepted)
``gsm8k``      GSM8K: ``question``, ``answer`` (the solution; the gold follows ``#### ``)
``math``       MATH / MATH-500: ``problem``, ``answer``, ``solution``, ``subject``, ``level``
=============  ===================================================================================

The shipped benchmark files are under ``agentenv/data/qa`` and ``agentenv/data/math``
(attribution in ``agentenv/data/NOTICE.md``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

__all__ = [
    "BUILTIN_DATASETS",
    "DatasetError",
    "Example",
    "Paragraph",
    "builtin_path",
    "detect_format",
    "load_examples",
    "read_rows",
    "union_corpus",
]


class DatasetError(ValueError):
    """A data file that cannot be read; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Paragraph:
    """One passage of text (a Wikipedia paragraph in the shipped data)."""

    title: str
    text: str
    is_supporting: bool = False


@dataclass(frozen=True, slots=True)
class Example:
    """One question with its gold answers, and the paragraphs that came with it (maybe none)."""

    id: str
    question: str
    answers: tuple[str, ...]
    paragraphs: tuple[Paragraph, ...] = ()
    meta: Mapping[str, Any] = field(default_factory=dict)


DATA_DIR = Path(__file__).parent / "data"
#: Shipped benchmark files: name -> file under agentenv/data.
BUILTIN_DATASETS: dict[str, str] = {
    "hotpotqa": "qa/hotpotqa_dev500.ircot.jsonl",
    "hotpotqa-official": "qa/hotpotqa_dev.official_sample20.jsonl",
    "2wiki": "qa/2wikimultihopqa_dev164.jsonl",
    "musique": "qa/musique_dev200.jsonl",
    "bamboogle": "qa/bamboogle_test.jsonl",
    "nq": "qa/nq_test1k.jsonl",
    "triviaqa": "qa/triviaqa_test1k.jsonl",
    "popqa": "qa/popqa_test1k.jsonl",
    "math500": "math/math500_test.jsonl",
    "gsm8k": "math/gsm8k_test.jsonl",
}
#: The multi-hop sets whose paragraphs, pooled, form the offline corpus for sets without any.
MULTIHOP_DATASETS = ("hotpotqa", "hotpotqa-official", "2wiki", "musique")


def builtin_path(name: str) -> Path:
    """Path of a shipped dataset file by name (see :data:`BUILTIN_DATASETS`)."""
    if name not in BUILTIN_DATASETS:
        raise DatasetError(f"no shipped dataset {name!r}; shipped: {sorted(BUILTIN_DATASETS)}")
    return DATA_DIR / BUILTIN_DATASETS[name]


def read_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, decoded row) of a JSONL file; a JSON list counts its items from 1."""
    text = path.read_text(encoding="utf-8")
    first_line = next((line for line in text.splitlines() if line.strip()), "")
    if not text.lstrip().startswith("["):
        try:
            json.loads(first_line)
        except json.JSONDecodeError:
            pass  # not JSONL: a pretty-printed JSON document
        else:
            for lineno, line in enumerate(text.splitlines(), 1):
                if line.strip():
                    try:
                        yield lineno, json.loads(line)
                    except json.JSONDecodeError as e:
                        raise DatasetError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            return
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise DatasetError(f"{path}: a JSON file must hold a list of examples (or {{'data': [...]}})")
    yield from enumerate(data, 1)


def detect_format(row: Mapping[str, Any]) -> str:
    """The format name of one row (see the module docstring)."""
    if "question_text" in row and "contexts" in row:
        return "ircot"
    if "paragraphs" in row and "question" in row:
        return "musique"
    if "context" in row and "question" in row and "answer" in row:
        return "hotpotqa"
    if "golden_answers" in row and "question" in row:
        return "flashrag"
    if "problem" in row and "answer" in row:
        return "math"
    if "question" in row and isinstance(row.get("answer"), str) and "\n#### " in row["answer"]:
        return "gsm8k"
    if "question" in row and ("answers" in row or "answer" in row):
        return "plain"
    raise KeyError(
        f"unrecognised fields {sorted(row)[:8]}; expected one of the formats "
        "hotpotqa, ircot, musique, flashrag or plain ({'question', 'answers'})"
    )


def _as_answers(value: Any) -> tuple[str, ...]:
    answers = (value,) if isinstance(value, str) else tuple(value)
    if not answers or not all(isinstance(a, str) for a in answers):
        raise ValueError(f"gold answers must be a non-empty string or list of strings, got {value!r}")
    return answers


def _hotpotqa(row: Mapping[str, Any], i: int) -> Example:
    supporting = {title for title, _ in row.get("supporting_facts", [])}
    paragraphs = tuple(
        Paragraph(title, " ".join(s.strip() for s in sentences), title in supporting)
        for title, sentences in row["context"]
    )
    return Example(
        str(row.get("_id", i)),
        row["question"],
        _as_answers(row["answer"]),
        paragraphs,
        {k: row[k] for k in ("type", "level") if k in row},
    )


def _ircot(row: Mapping[str, Any], i: int) -> Example:
    answers = tuple(span for obj in row["answers_objects"] for span in obj["spans"])
    paragraphs = tuple(
        Paragraph(c["title"], c["paragraph_text"], bool(c.get("is_supporting"))) for c in row["contexts"]
    )
    return Example(str(row.get("question_id", i)), row["question_text"], _as_answers(answers), paragraphs)


def _musique(row: Mapping[str, Any], i: int) -> Example:
    paragraphs = tuple(
        Paragraph(p["title"], p["paragraph_text"], bool(p.get("is_supporting"))) for p in row["paragraphs"]
    )
    answers = _as_answers([row["answer"], *row.get("answer_aliases", [])])
    return Example(str(row.get("id", i)), row["question"], answers, paragraphs)


def _flashrag(row: Mapping[str, Any], i: int) -> Example:
    meta = {"metadata": row["metadata"]} if "metadata" in row else {}
    return Example(str(row.get("id", i)), row["question"], _as_answers(row["golden_answers"]), (), meta)


def _plain(row: Mapping[str, Any], i: int) -> Example:
    answers = row["answers"] if "answers" in row or "answer" not in row else row["answer"]
    return Example(str(row.get("id", i)), row["question"], _as_answers(answers))


def _gsm8k(row: Mapping[str, Any], i: int) -> Example:
    solution, _, gold = row["answer"].rpartition("\n#### ")
    if not gold.strip():
        raise ValueError("the GSM8K answer has no gold value after '#### '")
    return Example(str(row.get("id", i)), row["question"], (gold.strip().replace(",", ""),), (), {"solution": solution})


def _math(row: Mapping[str, Any], i: int) -> Example:
    meta = {k: row[k] for k in ("solution", "subject", "level") if k in row}
    return Example(str(row.get("unique_id", i)), row["problem"], _as_answers(row["answer"]), (), meta)


_READERS: dict[str, Callable[[Mapping[str, Any], int], Example]] = {
    "hotpotqa": _hotpotqa,
    "ircot": _ircot,
    "musique": _musique,
    "flashrag": _flashrag,
    "plain": _plain,
    "gsm8k": _gsm8k,
    "math": _math,
}


def load_examples(source: str | Path) -> list[Example]:
    """Load a QA file (any supported format) or a shipped dataset by name.

    Raises :class:`DatasetError` naming the file and line of the first bad row.
    """
    path = builtin_path(source) if isinstance(source, str) and source in BUILTIN_DATASETS else Path(source)
    if not path.is_file():
        raise DatasetError(f"no such data file: {path} (shipped datasets: {sorted(BUILTIN_DATASETS)})")
    return list(_load(path.resolve(), path.stat().st_mtime_ns))


@lru_cache(maxsize=32)
def _load(path: Path, mtime_ns: int) -> tuple[Example, ...]:
    examples, fmt = [], None
    for lineno, row in read_rows(path):
        try:
            if not isinstance(row, dict):
                raise ValueError(f"expected a JSON object, got {type(row).__name__}")
            fmt = fmt or detect_format(row)
            example = _READERS[fmt](row, lineno)
            if not isinstance(example.question, str) or not example.question.strip():
                raise ValueError("empty question")
        except (KeyError, TypeError, ValueError) as e:
            detail = f"missing field {e.args[0]!r}" if type(e) is KeyError and fmt else str(e.args[0])
            raise DatasetError(f"{path}:{lineno}: {detail}" + (f" (format detected: {fmt})" if fmt else "")) from None
        examples.append(example)
    if not examples:
        raise DatasetError(f"{path}: no examples")
    return tuple(examples)


def union_corpus(names: Sequence[str] = MULTIHOP_DATASETS) -> list[Paragraph]:
    """The de-duplicated paragraphs of several datasets (default: the shipped multi-hop sets)."""
    seen: dict[tuple[str, str], Paragraph] = {}
    for name in names:
        for example in load_examples(name):
            for p in example.paragraphs:
                seen.setdefault((p.title, p.text), Paragraph(p.title, p.text))
    return list(seen.values())
