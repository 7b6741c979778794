"""Answer grading: SQuAD-normalised exact match, F1 and cover-EM over several gold answers,
mathematical equivalence (math-verify), and extraction of the final answer from a model's
``<answer>…\\boxed{…}…</answer>``.

The normalisation is SQuAD's (Rajpurkar et al. 2016, the official evaluation script) as used by
the QA agent-RL papers: lower-case, drop punctuation, drop the articles a/an/the, collapse spaces.
"""

from __future__ import annotations

import logging
import re
import string
import threading
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass

__all__ = [
    "Grade",
    "cover_exact_match",
    "exact_match",
    "extract_answer",
    "extract_boxed",
    "f1_score",
    "grade",
    "math_equal",
    "normalize_answer",
]

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower-case, strip punctuation, articles and extra whitespace."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, golds: Iterable[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def cover_exact_match(prediction: str, golds: Iterable[str]) -> float:
    """1.0 if any normalised gold answer occurs in the normalised prediction (FlashRAG's cover-EM)."""
    pred = f" {normalize_answer(prediction)} "
    return float(any(f" {normalize_answer(g)} " in pred for g in golds if normalize_answer(g)))


def f1_score(prediction: str, golds: Iterable[str]) -> float:
    """Word-level F1 of the normalised prediction against the best-matching gold answer."""
    pred_tokens = normalize_answer(prediction).split()
    best = 0.0
    for gold in golds:
        gold_tokens = normalize_answer(gold).split()
        common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
        if common == 0:
            continue
        precision, recall = common / len(pred_tokens), common / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


def math_equal(prediction: str, golds: Iterable[str]) -> float:
    """1.0 if the prediction is mathematically equal to any gold answer (math-verify), else 0.0.

    ``\\frac{1}{2}``, ``1/2`` and ``0.5`` are equal; so are ``x^2+1`` and ``1+x^2``.
    """
    # Imported here: math-verify pulls in sympy (~1 s, ~60 MiB), which only math grading needs.
    from math_verify import parse as math_parse
    from math_verify import verify as math_verify

    # math-verify's timeouts use SIGALRM, which only the main thread receives; elsewhere they are off.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    target = math_parse(f"${prediction}$", parsing_timeout=timeout)
    if not target:
        return 0.0
    return float(
        any(
            math_verify(math_parse(f"${gold}$", parsing_timeout=timeout), target, timeout_seconds=timeout)
            for gold in golds
        )
    )


# math-verify logs a warning on every call made with its timeouts off; once is enough to know.
logging.getLogger("math_verify").setLevel(logging.ERROR)


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{…}`` (or ``\\fbox{…}``), braces balanced; None if absent."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[begin:i].strip()
        i += 1
    return None  # unbalanced: the box was never closed


def extract_answer(response: str | None, *, require_boxed: bool = True) -> str | None:
    """The final answer inside an ``<answer>`` tag's content.

    With ``require_boxed`` (the papers' format) it is the last ``\\boxed{}``; without, the boxed
    value if there is one, else the whole content. None means a bad format.
    """
    if response is None:
        return None
    boxed = extract_boxed(response)
    if boxed is not None or require_boxed:
        return boxed
    return response.strip() or None


@dataclass(frozen=True, slots=True)
class Grade:
    """How one final answer scores against the gold answers."""

    answer: str | None
    format_ok: bool
    em: float
    f1: float
    cover_em: float
    math_equal: float | None = None  # graded only when asked (math tasks)

    def as_dict(self) -> dict[str, object]:
        """The fields as a dict (``math_equal`` only where it was graded)."""
        fields = asdict(self)
        if fields["math_equal"] is None:
            del fields["math_equal"]
        return fields


def grade(response: str | None, golds: Iterable[str], *, require_boxed: bool = True, math: bool = False) -> Grade:
    """Grade the content of an ``<answer>`` tag (None: the model gave no answer).

    With ``math=True`` the grade also holds ``math_equal`` (mathematical equivalence).
    """
    golds = list(golds)
    answer = extract_answer(response, require_boxed=require_boxed)
    if answer is None:
        return Grade(None, False, 0.0, 0.0, 0.0, 0.0 if math else None)
    return Grade(
        answer,
        True,
        exact_match(answer, golds),
        f1_score(answer, golds),
        cover_exact_match(answer, golds),
        math_equal(answer, golds) if math else None,
    )
