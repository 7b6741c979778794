"""Question answering with a search tool: ``multihop-qa`` and ``singlehop-qa``.

The embedded default runs offline: a BM25 index over the dataset's own paragraphs (multi-hop
sets), or over the pooled paragraphs of the shipped multi-hop sets for datasets without any
(Bamboogle, NQ, TriviaQA, PopQA), or over a user corpus (``corpus=PATH``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, get_args

from agentenv.datasets import (
    UNANSWERABLE,
    Example,
    Paragraph,
    UnanswerableMode,
    file_format,
    load_examples,
    union_corpus,
)
from agentenv.envs.math import PYTHON_OPTIONS
from agentenv.graders import F1_VARIANTS, BoxRule, F1Variant, dataset_f1, format_f1, grade
from agentenv.options import PATH, Option, OptionError, OptionRule, OptionTypeError
from agentenv.python_tool import DEFAULT_TIMEOUT, SandboxKind, python_tool
from agentenv.rewards import RewardScheme, get_reward
from agentenv.search import BM25Search, SearchBackend, load_corpus, search_tool
from agentenv.tool_env import PROMPT_TEMPLATE, ToolEnv
from agentenv.tools import Tool
from agentenv.web_search import CachedSearch, CacheMode, DuckDuckGoSearch, RemoteSearch, ResultCache

__all__ = [
    "DATA_OPTIONS",
    "SEARCH_EXAMPLE",
    "QAEnv",
    "check_search",
    "local_passages",
    "make_search_backend",
    "qa_reward_and_grader",
    "tool_qa",
]

DEFAULT_TOPK = 3  # AT²PO: top-3 passages per search
DEFAULT_RESULT_CHARS = 1000  # each passage cut to about 1000 characters
#: Said after the question when a task list holds MuSiQue-Full's unanswerable rows.
UNANSWERABLE_NOTE = f' If the question cannot be answered from what the tools find, the answer is "{UNANSWERABLE}".'

#: The worked episode that ``example=True`` shows (two searches, then the answer; ``{answer}`` is
#: written as the env grades it, boxed or not). Not a question of any shipped dataset.
SEARCH_EXAMPLE = (
    "Question: In which country was the director of the film Amélie born?\n"
    "<think> I need the director of Amélie first. </think>\n"
    "<search> Amélie film director </search>\n"
    "<result>\nPage 1: Amélie\nAmélie is a 2001 French romantic comedy film directed by Jean-Pierre Jeunet.\n</result>\n"
    "<think> Jean-Pierre Jeunet directed it. Where was he born? </think>\n"
    "<search> Jean-Pierre Jeunet born </search>\n"
    "<result>\nPage 1: Jean-Pierre Jeunet\nJean-Pierre Jeunet (born 3 September 1953 in Roanne, France) is a "
    "French film director.\n</result>\n"
    "<think> He was born in Roanne, France. </think>\n"
    "<answer> {answer} </answer>"
)


def local_passages(examples: Sequence[Example], corpus: str | Path | None) -> list[Paragraph]:
    """The offline corpus: the ``corpus`` file, else the examples' own paragraphs, else the pooled multi-hop ones."""
    if corpus is not None:
        return load_corpus(corpus)
    seen = {(p.title, p.text): p for e in examples for p in e.paragraphs}
    return list(seen.values()) or union_corpus()


def check_search(name: str, search: Any) -> None:
    """Raise :class:`~agentenv.options.OptionError` unless ``search`` is a backend :func:`make_search_backend` can make."""
    if isinstance(search, SearchBackend) or (
        isinstance(search, str) and (search in ("local", "duckduckgo") or search.startswith(("http://", "https://")))
    ):
        return
    raise (OptionError if isinstance(search, str) else OptionTypeError)(
        f"unknown search backend {search!r}: use 'local' (offline BM25), 'duckduckgo', "
        "the http(s):// URL of a retrieval server, or pass a SearchBackend",
        name,
        search,
    )


#: The rules of the data and search options that the QA and web environments share.
DATA_OPTIONS: dict[str, OptionRule] = {
    "dataset": Option(PATH),
    "data": Option(PATH, optional=True),
    "aliases": Option(PATH, optional=True),
    "corpus": Option(PATH, optional=True),
    "search": check_search,
}
_F1_OPTION = Option(choices=F1_VARIANTS, optional=True)


def make_search_backend(
    search: str | SearchBackend, examples: Sequence[Example], corpus: str | Path | None, *, cache: CacheMode = "use"
) -> SearchBackend:
    """The backend for ``search=``.

    ``"local"`` (BM25 over :func:`local_passages`, the default), ``"duckduckgo"`` (the real web
    through ``ddgs``), the ``http(s)://`` URL of a Search-R1-style retrieval server, or a
    :class:`SearchBackend` as it is. The remote ones keep their results in the on-disk
    :class:`~agentenv.web_search.ResultCache` in mode ``cache`` (``use``, ``record``, ``replay``, ``off``).
    """
    check_search("search", search)
    if isinstance(search, SearchBackend):
        return search
    if search == "local":
        return BM25Search.for_corpus(local_passages(examples, corpus))
    remote = DuckDuckGoSearch() if search == "duckduckgo" else RemoteSearch(search)
    return CachedSearch(remote, ResultCache.default(cache))


def qa_reward_and_grader(
    reward: str | Callable[..., float],
    *,
    require_boxed: bool = True,
    f1: F1Variant | None = None,
    dataset: str | None = None,
    data_format: str | None = None,
) -> tuple[Callable[..., float], Callable[..., Any]]:
    """The reward callable and the matching grader of a QA environment.

    The grader reads the answer with the scheme's box rule and computes the F1 named by ``f1``,
    else the scheme's (HotpotQA's for the papers' schemes, as their code computes it for every
    dataset), else the one that ``data_format`` (the format detected in a user's data file)
    implies (:func:`agentenv.graders.format_f1`: HotpotQA's for the official HotpotQA/2Wiki
    format), else the dataset's own (:func:`agentenv.graders.dataset_f1`: HotpotQA's for
    ``hotpotqa`` and ``2wiki``, SQuAD's for the rest). With
    ``require_boxed=False`` (Search-R1's ``<answer> Beijing </answer>``) a papers' scheme keeps
    its metric and bonus but drops its format rules (box, ``<think>`` pair, one ``<answer>``),
    which Search-R1's reward does not have.
    """
    _F1_OPTION("f1", f1)
    fn = get_reward(reward)
    box: BoxRule = "lenient"
    scheme_f1: F1Variant | None = None
    if isinstance(fn, RewardScheme):
        if not require_boxed:
            fn = dataclasses.replace(fn, require_think=False, single_answer=False, call_tags=(), box="lenient")
        box, scheme_f1 = fn.box, fn.f1
    variant = f1 or scheme_f1 or (format_f1(data_format) if data_format is not None else dataset_f1(dataset))
    if isinstance(fn, RewardScheme) and fn.question_words == "ignore":
        fn = dataclasses.replace(fn, f1=variant)  # it recomputes F1: the grader's
    return fn, functools.partial(grade, require_boxed=require_boxed, box=box, f1=variant)


class QAEnv(ToolEnv):
    """Answer a question, searching as needed; graded against the gold answers.

    Args:
        dataset: A shipped dataset name (``hotpotqa``, ``2wiki``, ``musique``, ``bamboogle``,
            ``nq``, ``triviaqa``, ``popqa``, ``hotpotqa-official``).
        data: A QA file in any supported format; overrides ``dataset``.
        aliases: 2WikiMultihopQA's alias file (``id_aliases.json``): gold answers gain their
            entity's aliases, as in the official evaluation (see :func:`~agentenv.datasets.load_examples`).
        unanswerable: MuSiQue-Full's unanswerable rows: ``"skip"`` (default) or ``"include"``
            (posed with the gold ``"unanswerable"``; the prompt then says that this answer is allowed).
        corpus: A passage file (JSONL/JSON of ``{title, text}`` or ``{id, contents}``) to search
            instead of the dataset's paragraphs.
        search: ``"local"``, ``"duckduckgo"``, a retrieval server URL or a
            :class:`~agentenv.search.SearchBackend` (see :func:`make_search_backend`).
        topk: Passages per search (AT²PO: 3).
        result_chars: Each passage cut to about this many characters.
        tools: Extra tools besides ``search``.
        reward: A scheme name (default ``"em"``) or a callable; the papers' schemes (``at2po``,
            ``aepo``, ``arpo``) bring their format rules and F1 (see :func:`qa_reward_and_grader`).
        f1: The grade's F1, ``"squad"`` or ``"hotpotqa"`` (default: the scheme's, else the
            dataset's official one; for a ``data`` file, the one its detected format implies:
            ``hotpotqa`` for the official HotpotQA/2Wiki format, else ``squad``).
        example: ``True`` shows :data:`SEARCH_EXAMPLE` before the question (one-shot prompting
            for small models), a string shows that episode instead; ``False`` (default) none.
        **options: The options of :class:`~agentenv.tool_env.ToolEnv` (``parser``,
            ``max_tool_calls``, ``max_turns``, ``max_obs_chars``, ``require_boxed``, ``grader``, …);
            a ``grader`` given here is used as it is.
    """

    OPTIONS: ClassVar[Mapping[str, OptionRule]] = {
        **DATA_OPTIONS,
        "unanswerable": Option(choices=get_args(UnanswerableMode)),
        "topk": Option(int, minimum=1),
        "result_chars": Option(int, minimum=1),
        "f1": _F1_OPTION,
        "example": Option((bool, str), optional=True),
    }

    def __init__(
        self,
        dataset: str = "hotpotqa",
        *,
        data: str | Path | None = None,
        aliases: str | Path | None = None,
        unanswerable: UnanswerableMode = "skip",
        corpus: str | Path | None = None,
        search: str | SearchBackend = "local",
        topk: int = DEFAULT_TOPK,
        result_chars: int = DEFAULT_RESULT_CHARS,
        tools: Sequence[Tool | Callable[..., Any]] = (),
        reward: str | Callable[..., float] = "em",
        f1: F1Variant | None = None,
        example: bool | str = False,
        **options: Any,
    ) -> None:
        self.check_options(
            {
                "dataset": dataset,
                "data": data,
                "aliases": aliases,
                "unanswerable": unanswerable,
                "corpus": corpus,
                "search": search,
                "topk": topk,
                "result_chars": result_chars,
                "tools": tools,
                "reward": reward,
                "f1": f1,
                "example": example,
                **options,
            }
        )
        require_boxed = options.get("require_boxed", True)
        examples = load_examples(data if data is not None else dataset, aliases=aliases, unanswerable=unanswerable)
        # A user's file is graded as its format implies, not as the shipped `dataset` it replaces.
        reward_fn, grader = qa_reward_and_grader(
            reward,
            require_boxed=require_boxed,
            f1=f1,
            dataset=dataset,
            data_format=file_format(data) if data is not None else None,
        )
        options.setdefault("grader", grader)
        if any(e.meta.get("answerable") is False for e in examples):
            template = options.get("prompt_template", PROMPT_TEMPLATE)
            options["prompt_template"] = template.replace("{question}", "{question}" + UNANSWERABLE_NOTE, 1)
        self.backend = make_search_backend(search, examples, corpus)
        if example is True:
            example = SEARCH_EXAMPLE.format(answer="\\boxed{France}" if require_boxed else "France")
        super().__init__(
            examples,
            [search_tool(self.backend, topk=topk, max_chars=result_chars), *tools],
            reward=reward_fn,
            example=example or None,
            **options,
        )


def tool_qa(
    dataset: str = "hotpotqa",
    *,
    sandbox: SandboxKind = "local",
    timeout: float = DEFAULT_TIMEOUT,
    isolation: str | None = None,
    preimport: Sequence[str] | None = None,
    reward: str | Callable[..., float] = "aepo",
    tools: Sequence[Tool | Callable[..., Any]] = (),
    **kwargs: Any,
) -> QAEnv:
    """Multi-hop QA with both ``search`` and ``python``, as in ARPO/AEPO.

    The default reward is AEPO's released one (``"aepo"``, see :mod:`agentenv.rewards`): −1 for a
    bad format, else EM, but F1 + 0.1 when F1 > 0 and both tools were used; ``"aepo-paper"`` is
    the paper's wording (F1, + 0.1 when right with both tools) and ``"arpo"`` ARPO's code (F1,
    + 0.1 when F1 > 0 with both tools). ``sandbox``, ``timeout``, ``isolation`` and ``preimport`` are the
    ``python`` tool's (see :class:`~agentenv.python_tool.PythonSession`); other arguments as in
    :class:`QAEnv`.
    """
    own = {"sandbox": sandbox, "timeout": timeout, "isolation": isolation, "preimport": preimport}
    # Every option first, QAEnv's too: a bad one must not wait for the sandbox's isolation probe.
    QAEnv.check_options(
        {"dataset": dataset, "reward": reward, "tools": tools, **own, **kwargs},
        extra={name: PYTHON_OPTIONS[name] for name in own},
    )
    python = python_tool(sandbox, timeout=timeout, isolation=isolation, preimport=preimport)
    return QAEnv(dataset, tools=[python, *tools], reward=reward, **kwargs)
