"""QA datasets: one loader for the formats the QA agent-RL papers use, format detected per file.

Supported (JSONL, or a JSON list, or a JSON object with a ``data`` list):

=============  ===================================================================================
``hotpotqa``   official HotpotQA / 2WikiMultihopQA: ``question``, ``answer``,
               ``context [[title, [sentences]]]``, ``supporting_facts [[title, i]]``; 2Wiki rows
               also ``answer_id`` (the answer entity's Wikidata id)
``ircot``      IRCoT's processed HotpotQA: ``question_text``, ``answers_objects[].spans``,
               ``contexts [{title, paragraph_text, is_supporting}]``
``musique``    MuSiQue: ``question``, ``answer``, ``answer_aliases``,
               ``paragraphs [{title, paragraph_text, is_supporting}]``, ``answerable``
``flashrag``   FlashRAG JSONL: ``question``, ``golden_answers``
``plain``      ``{"question": …, "answers": [...]}`` (``answer`` as one string also accepted)
``gsm8k``      GSM8K: ``question``, ``answer`` (the solution; the gold follows ``#### ``)
``math``       MATH / MATH-500: ``problem``, ``answer``, ``solution``, ``subject``, ``level``
=============  ===================================================================================

Gold answers with their aliases, as each benchmark's official evaluation scores them:

- 2WikiMultihopQA (``2wikimultihop_evaluate_v1.1.py`` of Alab-NII/2wikimultihop): the gold is
  the answer together with the ``aliases`` and ``demonyms`` of its entity, looked up by the row's
  ``answer_id`` in the alias file ``id_aliases.json`` (JSONL of ``{"Q_id", "aliases",
  "demonyms"}``). Give that file as ``load_examples(..., aliases=PATH)``; a row that carries
  ``answer_aliases``, or ``aliases``/``demonyms`` itself, has those added without a file.
- MuSiQue: ``answer`` and ``answer_aliases``. MuSiQue-Full pairs every answerable question
  with an unanswerable twin (``answerable: false``, the same ``id``, a supporting paragraph
  removed). Those rows are skipped by default; ``unanswerable="include"`` poses them with the
  gold :data:`UNANSWERABLE` (the reply that predicts "not answerable") and
  ``meta["answerable"] = False``, the twin's answers kept in ``meta["answers_if_answerable"]``.
  MuSiQue's answerability metric, which scores the two rows of a pair together, is computed
  by ``agents.eval.evaluation``.

The shipped benchmark files are under ``agentenv/data/qa`` and ``agentenv/data/math``
(attribution in ``agentenv/data/NOTICE.md``).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, get_args

__all__ = [
    "BUILTIN_DATASETS",
    "POOLED_DATASETS",
    "UNANSWERABLE",
    "DatasetError",
    "Example",
    "Paragraph",
    "UnanswerableMode",
    "builtin_path",
    "detect_format",
    "file_format",
    "load_aliases",
    "load_examples",
    "read_rows",
    "union_corpus",
]

#: The gold answer of an included MuSiQue-Full unanswerable row: answering it (SQuAD-normalised)
#: predicts "not answerable", MuSiQue's ``predicted_answerable: false``.
UNANSWERABLE = "unanswerable"

#: What :func:`load_examples` does with MuSiQue-Full's unanswerable rows.
UnanswerableMode = Literal["skip", "include"]


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
#: Shipped datasets that are several others one after another, in this order: ``multihop`` is
#: HotpotQA's 500, then 2WikiMultihopQA's 164, then MuSiQue's 200 (864 questions). A run's
#: ``holdout`` takes the first rows, so ``holdout=400`` holds out 400 HotpotQA questions and trains
#: on the other 464 (HotpotQA-official's 20 are left out: they may repeat HotpotQA dev questions).
POOLED_DATASETS: dict[str, tuple[str, ...]] = {"multihop": ("hotpotqa", "2wiki", "musique")}


def builtin_path(name: str) -> Path:
    """Path of a shipped dataset file by name (see :data:`BUILTIN_DATASETS`)."""
    if name not in BUILTIN_DATASETS:
        raise DatasetError(f"no shipped dataset {name!r}; shipped: {sorted(BUILTIN_DATASETS)}")
    return DATA_DIR / BUILTIN_DATASETS[name]


def read_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """(line number, decoded row) of a JSONL file; a JSON list counts its items from 1."""
    text = path.read_text(encoding="utf-8")
    if not text.strip():  # else json.loads would call it "not valid JSON"
        raise DatasetError(f"{path}: the file is empty; expected one JSON object per line (JSONL) or a JSON list")
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


def file_format(source: str | Path) -> str:
    """The format of a QA file, or of a shipped dataset by name: its first row's, as :func:`load_examples` reads it.

    Raises :class:`DatasetError` as :func:`load_examples` does for a missing, empty or unreadable file.
    """
    path = builtin_path(source) if isinstance(source, str) and source in BUILTIN_DATASETS else Path(source)
    if not path.is_file():
        raise DatasetError(f"no such data file: {path} (shipped datasets: {sorted(BUILTIN_DATASETS)})")
    return _file_format(path.resolve(), path.stat().st_mtime_ns)


@lru_cache(maxsize=32)
def _file_format(path: Path, mtime_ns: int) -> str:
    lineno, row = next(read_rows(path))
    try:
        if not isinstance(row, dict):
            raise ValueError(f"expected a JSON object, got {type(row).__name__}")
        return detect_format(row)
    except (KeyError, ValueError) as e:
        raise DatasetError(f"{path}:{lineno}: {e.args[0]}") from None


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
    meta = {k: row[k] for k in ("type", "level", "answer_id") if k in row}
    # Aliases a 2Wiki row carries itself: MuSiQue's field name, or the official alias record's.
    carried = [a for key in ("answer_aliases", "aliases", "demonyms") for a in _string_list(row, key)]
    return Example(
        str(row.get("_id", i)),
        row["question"],
        _with_aliases(_as_answers(row["answer"]), carried),
        paragraphs,
        meta,
    )


def _string_list(row: Mapping[str, Any], key: str) -> list[str]:
    """``row[key]`` as a list of strings (absent: empty); anything else is a bad row."""
    value = row.get(key, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"{key!r} must be a list of strings, got {value!r}")
    return value


def _with_aliases(answers: tuple[str, ...], aliases: Sequence[str]) -> tuple[str, ...]:
    """The answers, then the aliases not already among them, in order (the official scripts use sets)."""
    return tuple(dict.fromkeys([*answers, *aliases]))


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
    answers = _as_answers([row["answer"], *_string_list(row, "answer_aliases")])
    meta: dict[str, Any] = {}
    if "answerable" in row:
        answerable = row["answerable"]
        if not isinstance(answerable, bool):
            raise ValueError(f"'answerable' must be true or false, got {answerable!r}")
        meta["answerable"] = answerable
        if not answerable:
            # MuSiQue-Full's contrast row: its paragraphs lack what the answer needs, so the right
            # reply is "not answerable"; the twin's answer must not be graded as this row's gold.
            meta["answers_if_answerable"] = answers
            answers = (UNANSWERABLE,)
    return Example(str(row.get("id", i)), row["question"], answers, paragraphs, meta)


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


def load_examples(
    source: str | Path,
    *,
    aliases: str | Path | None = None,
    unanswerable: UnanswerableMode = "skip",
) -> list[Example]:
    """Load a QA file (any supported format) or a shipped dataset by name.

    Args:
        source: A shipped dataset name (:data:`BUILTIN_DATASETS`, :data:`POOLED_DATASETS`) or a path.
        aliases: 2WikiMultihopQA's alias file (``id_aliases.json``); each row's gold answers
            gain the ``aliases`` and ``demonyms`` of its ``answer_id``, as in the official
            evaluation. Only for files whose rows have an ``answer_id``.
        unanswerable: ``"skip"`` (default) leaves out MuSiQue-Full's ``answerable: false``
            rows; ``"include"`` poses them with the gold :data:`UNANSWERABLE` (see the module
            docstring).

    Raises :class:`DatasetError` naming the file and line of the first bad row.
    """
    if unanswerable not in get_args(UnanswerableMode):
        raise ValueError(
            f"unanswerable must be one of {', '.join(map(repr, get_args(UnanswerableMode)))}, got {unanswerable!r}"
        )
    if isinstance(source, str) and source in POOLED_DATASETS:
        if aliases is not None:
            raise DatasetError(f"aliases= is for one 2WikiMultihopQA file, not the pooled dataset {source!r}")
        return [e for name in POOLED_DATASETS[source] for e in load_examples(name, unanswerable=unanswerable)]
    path = builtin_path(source) if isinstance(source, str) and source in BUILTIN_DATASETS else Path(source)
    if not path.is_file():
        raise DatasetError(f"no such data file: {path} (shipped datasets: {sorted(BUILTIN_DATASETS)})")
    alias_file = None
    if aliases is not None:
        alias_path = Path(aliases)
        if not alias_path.is_file():
            raise DatasetError(f"no such alias file: {alias_path} (2WikiMultihopQA's id_aliases.json)")
        alias_file = (alias_path.resolve(), alias_path.stat().st_mtime_ns)
    return list(_load(path.resolve(), path.stat().st_mtime_ns, alias_file, unanswerable))


def load_aliases(path: str | Path) -> dict[str, tuple[str, ...]]:
    """2WikiMultihopQA's alias file as ``{entity id: aliases then demonyms}``.

    The file (``id_aliases.json`` of the official release) holds one
    ``{"Q_id": …, "aliases": [...], "demonyms": [...]}`` per line; ``demonyms`` may be absent.
    """
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"no such alias file: {path} (2WikiMultihopQA's id_aliases.json)")
    return dict(_aliases(path.resolve(), path.stat().st_mtime_ns))


@lru_cache(maxsize=4)
def _aliases(path: Path, mtime_ns: int) -> tuple[tuple[str, tuple[str, ...]], ...]:
    table: dict[str, tuple[str, ...]] = {}
    for lineno, row in read_rows(path):
        try:
            if not isinstance(row, dict):
                raise ValueError(f"expected a JSON object, got {type(row).__name__}")
            entity = row["Q_id"]
            if not isinstance(entity, str):
                raise ValueError(f"'Q_id' must be a string, got {entity!r}")
            names = [*_string_list(row, "aliases"), *_string_list(row, "demonyms")]
        except KeyError as e:
            raise DatasetError(
                f"{path}:{lineno}: missing field {e.args[0]!r} (an alias row is "
                '{"Q_id": ..., "aliases": [...], "demonyms": [...]})'
            ) from None
        except ValueError as e:
            raise DatasetError(f"{path}:{lineno}: {e.args[0]}") from None
        table[entity] = tuple(dict.fromkeys([*table.get(entity, ()), *names]))
    return tuple(table.items())


@lru_cache(maxsize=32)
def _load(
    path: Path, mtime_ns: int, alias_file: tuple[Path, int] | None, unanswerable: UnanswerableMode
) -> tuple[Example, ...]:
    examples, fmt, skipped = [], None, 0
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
        if example.meta.get("answerable") is False and unanswerable == "skip":
            skipped += 1
            continue
        examples.append(example)
    if not examples:
        why = f" ({skipped} unanswerable rows skipped; pass unanswerable='include' to pose them)" if skipped else ""
        raise DatasetError(f"{path}: no examples{why}")
    if alias_file is not None:
        examples = _add_file_aliases(examples, path, alias_file[0], dict(_aliases(*alias_file)))
    return tuple(examples)


def _add_file_aliases(
    examples: list[Example], path: Path, alias_path: Path, table: Mapping[str, tuple[str, ...]]
) -> list[Example]:
    """2Wiki's official rule: the gold is the answer plus the aliases of the row's ``answer_id``."""
    if not any(e.meta.get("answer_id") is not None for e in examples):
        raise DatasetError(
            f"{alias_path}: an alias file is keyed by 2WikiMultihopQA's answer_id, and no row of {path} has one"
        )
    return [
        replace(e, answers=_with_aliases(e.answers, table[e.meta["answer_id"]]))
        if e.meta.get("answer_id") in table
        else e
        for e in examples
    ]


def union_corpus(names: Sequence[str] = MULTIHOP_DATASETS) -> list[Paragraph]:
    """The de-duplicated paragraphs of several datasets (default: the shipped multi-hop sets)."""
    seen: dict[tuple[str, str], Paragraph] = {}
    for name in names:
        for example in load_examples(name):
            for p in example.paragraphs:
                seen.setdefault((p.title, p.text), Paragraph(p.title, p.text))
    return list(seen.values())
