"""Reward schemes: how a graded episode becomes one scalar reward.

Named schemes (``reward="…"`` in ``make``):

===================  ============================================================================
``em``               exact match of the last ``\\boxed{}`` (0 or 1); no answer scores 0
``f1``               word-level F1 of the answer (the grader's F1, see :mod:`agentenv.graders`)
``f1_new_words``     F1 over the words the question does not already give: echoing the
                     question scores 0 (a gold of question words only must match exactly)
``cover_em``         1 if a normalised gold is a substring of the answer (FlashRAG, Search-R1)
``token_cover_em``   1 if a normalised gold occurs in the answer as whole words
``math``             1 if the answer equals the gold mathematically (math-verify; a math grade)
``at2po``            AT²PO's released code (ATPO ``deep_research_em.py``): −1 for a bad format,
                     else EM, but F1 + 0.1 when F1 > 0 and both ``search`` and ``python`` ran
``at2po-paper``      AT²PO's paper (App. B.1): −1 for a bad format, else EM
``aepo``             AEPO's released configuration (``AEPO_qwen3_4B.sh`` selects
                     ``deep_research_em.py``): the rule of ``at2po``
``aepo-paper``       AEPO's paper: −1 for a bad format, else F1, + 0.1 when the answer is right
                     (EM) and both tools were used
``arpo``             ARPO's released code (``deep_research.py``): −1 for a bad format, else F1,
                     + 0.1 when F1 > 0 and both tools were used
===================  ============================================================================

The papers' schemes (``at2po``, ``aepo``, ``arpo`` and their ``-paper`` forms) judge the format
as the released ``validate_format`` does, on the model's own turns: a ``<think>…</think>`` pair
(as many ``<think>`` as ``</think>``, at least one); exactly one ``<answer>`` and one
``</answer>``, counting those inside ``<think>`` too; each ``<search>``/``<python>`` closed and
followed by its result; and, through the environment's grader (``box="papers"``, see
:func:`agentenv.graders.extract_boxed`), ``\\boxed{`` in the answer (``\\fbox`` does not count).
Each rule is a field of :class:`RewardScheme`; ``get_reward("at2po", require_think=False)``
makes the lenient variant.

A custom reward is any callable; it receives only the arguments it names, out of
``answer`` (the extracted final answer or None), ``answers`` (gold list), ``grade``
(:class:`agentenv.graders.Grade`), ``response`` (the raw ``<answer>`` content), ``tool_counts``
(calls per tool name), ``task`` (the dataset example) and ``actions`` (the model's turns).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

from agentenv.graders import BOX_RULES, F1_VARIANTS, BoxRule, F1Variant, Grade, f1_score

__all__ = [
    "BONUS_CONDITIONS",
    "REWARD_SCHEMES",
    "BonusCondition",
    "RewardScheme",
    "acall_reward",
    "call_reward",
    "get_reward",
]

BonusCondition = Literal["answer_right", "f1_positive"]
BONUS_CONDITIONS: tuple[BonusCondition, ...] = get_args(BonusCondition)

_METRICS = ("em", "f1", "cover_em", "token_cover_em", "math_equal")
# Between two turns of the model the environment inserted a tool result: the released code's
# tag-order check sees "<result>…</result>" there. Its content is left out (see format_error).
_RESULT_PLACEHOLDER = "\n<result>\n</result>\n"


@dataclass(frozen=True)
class RewardScheme:
    """A metric of the grade, an optional format penalty and an optional tool-use bonus.

    The defaults are the plain rule (no format rules beyond an extracted answer, a bonus only
    when the answer is right); the papers' schemes in :data:`REWARD_SCHEMES` set the rest.

    Args:
        metric: The grade's field that is the reward: ``em``, ``f1``, ``cover_em``,
            ``token_cover_em``, ``math_equal`` (or a field of a grader's own grade).
        format_penalty: The reward of a bad format (None: 0).
        bonus: Added when ``bonus_when`` holds and every tool of ``bonus_tools`` ran at least once.
        bonus_tools: The tools the bonus asks for.
        bonus_when: ``"answer_right"`` (EM, or ``math_equal`` for math, is 1) or
            ``"f1_positive"`` (F1 > 0, as the ATPO/ARPO reward code pays it).
        bonus_metric: The grade's field the bonus is added to (None: ``metric``). ATPO's
            ``deep_research_em`` pays F1 + 0.1 although its reward is otherwise EM.
        zero_without_overlap: Score 0 unless F1 > 0 (the released code's ``elif f1_score > 0``
            branch): differs from ``metric`` alone only when answer and gold both normalise to
            nothing, where EM is 1 and F1 0.
        require_think: A bad format unless the model's turns hold at least one ``<think>`` and as
            many ``</think>``.
        single_answer: A bad format unless the model's turns hold exactly one ``<answer>`` and one
            ``</answer>``.
        answers_in_think: With ``single_answer``, whether ``<answer>`` tags inside a
            ``<think>…</think>`` block count (``"count"``, as the released code counts them) or
            not (``"ignore"``; the environment never ends an episode on such a tag).
        call_tags: Tool tags that must each be closed and followed by a result, in that order.
        box: The box rule the environment's grader should apply (see
            :func:`agentenv.graders.extract_boxed`); :class:`agentenv.envs.qa.QAEnv` applies it.
        f1: The F1 the environment's grader should compute (None: the dataset's own).
        question_words: ``"count"``: the metric as graded; ``"ignore"`` (with the ``f1`` metric):
            the answer's and the gold's words that the question contains earn nothing
            (:func:`agentenv.graders.f1_score` with ``given=`` the question). Plain F1 pays an
            answer that repeats the question for the words it shares with the gold ("New York
            City"), a reward RL finds: under it six AT²PO steps took the demo's 135M policy from
            4% to 37% of sampled answers that repeat the question (docs/algorithms/rewards.md "Reward hacking").
    """

    metric: str = "em"
    format_penalty: float | None = None  # AT²PO, AEPO and ARPO: -1.0 for a bad format
    bonus: float = 0.0  # AEPO and ARPO: +0.1
    bonus_tools: tuple[str, ...] = ("search", "python")  # AEPO and ARPO: both tools used
    bonus_when: BonusCondition = "answer_right"
    bonus_metric: str | None = None
    zero_without_overlap: bool = False
    require_think: bool = False
    single_answer: bool = False
    answers_in_think: Literal["count", "ignore"] = "count"
    call_tags: tuple[str, ...] = ()
    box: BoxRule = "lenient"
    f1: F1Variant | None = None
    question_words: Literal["count", "ignore"] = "count"

    def __post_init__(self) -> None:
        # A metric is any field of the grade (a grader of its own may grade more); a missing one
        # is reported when a grade lacks it.
        for name in ("metric", "bonus_metric"):
            value = getattr(self, name)
            if not (isinstance(value, str) and value) and not (name == "bonus_metric" and value is None):
                raise ValueError(f"{name} must name a field of the grade, such as {list(_METRICS)}, got {value!r}")
        choices: dict[str, tuple[object, ...]] = {
            "bonus_when": BONUS_CONDITIONS,
            "answers_in_think": ("count", "ignore"),
            "box": BOX_RULES,
            "f1": (*F1_VARIANTS, None),
            "question_words": ("count", "ignore"),
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {list(allowed)}, got {getattr(self, name)!r}")
        if self.question_words == "ignore" and (self.metric, self.bonus_metric or "f1") != ("f1", "f1"):
            raise ValueError(
                f"question_words='ignore' recomputes F1 without the question's words, so metric (and bonus_metric) "
                f"must be 'f1'; got metric={self.metric!r}, bonus_metric={self.bonus_metric!r}"
            )

    @property
    def checks_turns(self) -> bool:
        """Whether the format rules read the model's turns (``actions``), not only the answer."""
        return self.require_think or self.single_answer or bool(self.call_tags)

    def format_error(self, actions: Sequence[str]) -> str | None:
        """Why the model's turns break this scheme's format rules, or None if they keep them.

        The rules are those of ``validate_format`` in the ATPO/ARPO reward code
        (``verl/utils/reward_score/deep_research*.py``), applied to the model's own text: each
        tool result is an empty ``<result></result>``, so text inside a result (a web page that
        mentions ``<answer>``) cannot make the format bad, as it can in the released code.
        """
        text = _RESULT_PLACEHOLDER.join(actions)
        if self.require_think:
            opened, closed = text.count("<think>"), text.count("</think>")
            if opened != closed:
                return f"{opened} <think> but {closed} </think>"
            if opened == 0:
                return "no <think>…</think>"
        if self.single_answer:
            counted = text if self.answers_in_think == "count" else _outside_think(text)
            opened, closed = counted.count("<answer>"), counted.count("</answer>")
            if (opened, closed) != (1, 1):
                return f"{opened} <answer> and {closed} </answer>; exactly one of each is allowed"
        for tag in self.call_tags:
            error = _unanswered_call(text, tag)
            if error is not None:
                return error
        return None

    def __call__(
        self, grade: Grade, tool_counts: Mapping[str, int], actions: Sequence[str] | None = None, task: Any = None
    ) -> float:
        """The reward of ``grade``, given the calls per tool, the model's turns and the task.

        ``actions`` is needed when :attr:`checks_turns` (the papers' schemes), ``task`` (its
        ``question`` and ``answers``) when ``question_words="ignore"``; the environment always
        passes both.
        """
        if self.checks_turns and actions is None:
            raise ValueError(
                "this reward scheme checks the format of the model's turns: pass actions= (the turns' texts)"
            )
        if not grade.format_ok or (self.checks_turns and self.format_error(actions or ()) is not None):
            return self.format_penalty if self.format_penalty is not None else 0.0
        reward = _metric(grade, self.metric) if self.question_words == "count" else self._f1_new_words(grade, task)
        if self.zero_without_overlap and not grade.f1 > 0:
            return 0.0
        if self.bonus and self._bonus_earned(grade) and all(tool_counts.get(t, 0) > 0 for t in self.bonus_tools):
            paid_on = self.bonus_metric or self.metric
            return float((reward if paid_on == self.metric else _metric(grade, paid_on)) + self.bonus)
        return float(reward)

    def _f1_new_words(self, grade: Grade, task: Any) -> float:
        if task is None:
            raise ValueError("question_words='ignore' needs the task (its question and answers): pass task=")
        return f1_score(grade.answer or "", task.answers, f1=self.f1 or "squad", given=task.question)

    def _bonus_earned(self, grade: Grade) -> bool:
        if self.bonus_when == "f1_positive":
            return grade.f1 > 0
        right = grade.math_equal if self.metric == "math_equal" else grade.em
        return right == 1.0


def _metric(grade: Grade, name: str) -> float:
    value = getattr(grade, name, None)
    if value is None:
        raise ValueError(f"the grade has no {name!r}: this environment does not grade it")
    return float(value)


def _outside_think(text: str) -> str:
    """``text`` without its complete ``<think>…</think>`` blocks (each from a ``<think>`` to the next ``</think>``)."""
    parts, pos = [], 0
    while (start := text.find("<think>", pos)) >= 0 and (end := text.find("</think>", start)) >= 0:
        parts.append(text[pos:start])
        pos = end + len("</think>")
    parts.append(text[pos:])
    return "".join(parts)


def _unanswered_call(text: str, tag: str) -> str | None:
    """Why a ``<tag>`` in ``text`` lacks its ``</tag>`` and a later ``<result>…</result>``, or None.

    The released ``validate_format``'s loop: from each ``<tag>``, the next ``</tag>``, the next
    ``<result>`` and the ``</result>`` after it must all exist, in that order; the search goes on
    after that ``</result>``.
    """
    pos = 0
    while (start := text.find(f"<{tag}>", pos)) >= 0:
        close = text.find(f"</{tag}>", start)
        result = text.find("<result>", start)
        result_end = text.find("</result>", result) if result >= 0 else -1
        if min(close, result, result_end) < 0:
            return f"a <{tag}> without its </{tag}> and a result after it"
        if not start < close < result < result_end:
            return f"a <{tag}> whose </{tag}> comes after the result"
        pos = result_end
    return None


# The format rules of the released ATPO/ARPO reward code, shared by the papers' schemes:
# validate_format in ATPO verl/utils/reward_score/deep_research_em.py and ARPO deep_research.py,
# last_boxed_only_string/remove_boxed for the box, get_f1_score (HotpotQA's F1) for every dataset.
_PAPERS_FORMAT: dict[str, Any] = {
    "format_penalty": -1.0,
    "require_think": True,
    "single_answer": True,
    "call_tags": ("search", "python"),
    "box": "papers",
    "f1": "hotpotqa",
}

REWARD_SCHEMES: dict[str, RewardScheme] = {
    "em": RewardScheme("em"),
    "f1": RewardScheme("f1"),
    "f1_new_words": RewardScheme("f1", question_words="ignore"),
    "cover_em": RewardScheme("cover_em"),
    "token_cover_em": RewardScheme("token_cover_em"),
    "math": RewardScheme("math_equal"),
    # zzfoutofspace/ATPO ATPO/verl_atpo/verl/utils/reward_score/deep_research_em.py, compute_score,
    # lines 371-382 (selected by ATPO/scripts/ATPO_qwen3_4B.sh line 92): F1 + 0.1 if F1 > 0 and
    # "</search>" and "</python>" occur; elif F1 > 0: EM; else 0.
    "at2po": RewardScheme(
        "em", bonus=0.1, bonus_when="f1_positive", bonus_metric="f1", zero_without_overlap=True, **_PAPERS_FORMAT
    ),
    # AT²PO paper (arXiv 2601.04767), App. B.1, the final reward: EM if the format is valid, else -1.
    "at2po-paper": RewardScheme("em", **_PAPERS_FORMAT),
    # AEPO's released script, zzfoutofspace/ATPO AEPO/scripts/AEPO_qwen3_4B.sh line 72, selects
    # AEPO/verl_aepo_entropy/verl/utils/reward_score/deep_research_em.py: at2po's compute_score.
    "aepo": RewardScheme(
        "em", bonus=0.1, bonus_when="f1_positive", bonus_metric="f1", zero_without_overlap=True, **_PAPERS_FORMAT
    ),
    # AEPO paper (arXiv 2510.14545): F1, +0.1 when the answer is right and both tools were used.
    "aepo-paper": RewardScheme("f1", bonus=0.1, bonus_when="answer_right", **_PAPERS_FORMAT),
    # RUC-NLPIR/ARPO ARPO/verl_arpo_entropy/verl/utils/reward_score/deep_research.py, compute_score,
    # lines 338-349 (selected by ARPO/scripts/ARPO_*.sh): F1 + 0.1 if F1 > 0 and "</search>" and
    # "</python>" occur; else F1.
    "arpo": RewardScheme("f1", bonus=0.1, bonus_when="f1_positive", **_PAPERS_FORMAT),
}


def get_reward(reward: str | Callable[..., float], **changes: Any) -> Callable[..., float]:
    """A reward callable from a scheme name, or the callable as given.

    ``changes`` replace fields of a named scheme (see :class:`RewardScheme`), e.g.
    ``get_reward("at2po", require_think=False)`` for AT²PO's reward without the ``<think>`` rule.
    """
    if callable(reward):
        if changes:
            raise ValueError(f"changes {sorted(changes)} apply to a named scheme, not to a callable reward")
        return reward
    try:
        scheme = REWARD_SCHEMES[reward]
    except KeyError:
        raise ValueError(
            f"unknown reward scheme {reward!r}; choose one of {sorted(REWARD_SCHEMES)} or pass a callable"
        ) from None
    if not changes:
        return scheme
    known = {f.name for f in dataclasses.fields(RewardScheme)}
    unknown = sorted(set(changes) - known)
    if unknown:
        raise ValueError(f"RewardScheme has no field {unknown[0]!r}; its fields are {sorted(known)}")
    return dataclasses.replace(scheme, **changes)


def call_reward(fn: Callable[..., float], available: Mapping[str, Any]) -> float:
    """Call a reward function with only the arguments it names (verifiers-style)."""
    value = fn(**_arguments(fn, available))
    if inspect.isawaitable(value):
        close = getattr(value, "close", None)
        if close is not None:
            close()  # never awaited here: closed, so no "coroutine was never awaited" warning
        raise TypeError(
            f"reward function {getattr(fn, '__name__', fn)!r} is asynchronous: await acall_reward(...) "
            "(an environment's astep does)"
        )
    return float(value)


async def acall_reward(fn: Callable[..., Any], available: Mapping[str, Any]) -> float:
    """:func:`call_reward` for a reward that may be asynchronous (an LLM judge): awaited when it returns an awaitable."""
    value = fn(**_arguments(fn, available))
    if inspect.isawaitable(value):
        value = await value
    return float(value)


def _arguments(fn: Callable[..., Any], available: Mapping[str, Any]) -> Mapping[str, Any]:
    """The arguments of ``available`` that ``fn`` names (all of them for ``**kwargs``)."""
    params = _parameters(fn)
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return available
    missing = [n for n, p in params.items() if n not in available and p.default is p.empty]
    if missing:
        raise TypeError(
            f"reward function {getattr(fn, '__name__', fn)!r} asks for {missing}; "
            f"available arguments are {sorted(available)}"
        )
    return {n: available[n] for n in params if n in available}


def _parameters(fn: Callable[..., float]) -> Mapping[str, inspect.Parameter]:
    # inspect.signature takes ~0.1 ms, once per graded episode: remembered per function.
    try:
        return _signature_parameters(fn)
    except TypeError:  # an unhashable callable
        return inspect.signature(fn).parameters


@functools.lru_cache(maxsize=256)
def _signature_parameters(fn: Callable[..., float]) -> Mapping[str, inspect.Parameter]:
    return inspect.signature(fn).parameters
