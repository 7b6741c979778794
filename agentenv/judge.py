"""An LLM judge: a model decides whether a predicted answer matches the gold answers.

AEPO and ARPO score their deep-search benchmarks (GAIA, HLE, WebWalkerQA, xbench) this way, not
by exact match. The prompt and the verdict rule here are those of their evaluation code,
``evaluation/src/llm_evaluator_sds.py`` of RUC-NLPIR/ARPO (the repository of both papers' code;
``dongguanting/ARPO`` holds the same file):

- The prompt (:data:`JUDGE_PROMPT`) is sent as one user message; the gold answers fill
  ``{labeled_answer}`` as ARPO's data files give them to it: one answer as its text, several
  as a Python list (:func:`format_golds`).
- The verdict (:func:`parse_verdict`): the text inside ``<judgment>…</judgment>`` if the reply
  has both tags, else the whole reply; it is *correct* if it contains "correct" and none of
  "incorrect", "wrong", "not correct" (case-insensitive), *incorrect* if it contains one of those.
- ARPO also counts an answer right, without regard to the reply, when it equals the gold string
  after the MATH normalisation (``is_equiv``). Here an answer identical to a gold answer (surrounding
  whitespace aside) is correct without asking the model (``exact_shortcut``); every other answer
  goes to the model.

Where this judge differs from that code, on purpose:

- A failure is *unjudged*, never a silent verdict: an exception of the model call or a timeout
  after ``attempts`` tries (ARPO: 3 tries, then the ``is_equiv`` fallback), or a reply that says
  neither "correct" nor "wrong" (ARPO: incorrect; ``unparsable="incorrect"`` does the same).
  Unjudged results are counted apart (:class:`JudgeStats`) and never cached.
- No answer (a bad format) is incorrect without a call (ARPO judges the output's last lines).

Verdicts are cached by (question, gold answers, answer, judge model), in memory and, with
``cache_file``, in a JSONL file that later runs read back (its lines are for one prompt; lines
written under another prompt are ignored). Identical requests in flight share one call.

The judge knows no engine: it asks through ``ask(prompt) -> reply``, an async function (the reply
a string, or a :class:`JudgeReply` that also counts tokens). ``agents.eval.judge.engine_judge``
makes one from any engine of ``agents.engines`` (a local model, a vLLM or OpenAI-compatible
server).
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Literal, get_args

from agentenv.datasets import Example

__all__ = [
    "DEFAULT_ATTEMPTS",
    "DEFAULT_TIMEOUT",
    "JUDGE_PROMPT",
    "Judge",
    "JudgeReply",
    "JudgeReward",
    "JudgeStats",
    "Judgement",
    "UnjudgedError",
    "Verdict",
    "format_golds",
    "parse_verdict",
]

logger = logging.getLogger(__name__)

# Reproduced word for word from EVALUATION_PROMPT in evaluation/src/llm_evaluator_sds.py of
# RUC-NLPIR/ARPO (ARPO's and AEPO's evaluation): the judge model's verdicts depend on its wording.
JUDGE_PROMPT = (
    "Given a Question and its Golden Answer, verify whether the Predicted Answer is correct. The prediction is "
    "correct if it fully aligns with the meaning and key information of the Golden Answer. Respond with "
    '"Correct" if the prediction is correct and "Incorrect" otherwise.\n'
    "Golden Answer may have multiple options, and matching any one of them is considered correct.\n"
    "\n"
    "Question: {question}\n"
    "Golden Answer: {labeled_answer}\n"
    "Predicted Answer: {pred_answer}\n"
)
_PLACEHOLDERS = ("question", "labeled_answer", "pred_answer")

DEFAULT_ATTEMPTS = 3  # ARPO's retry_limit: tries of one model call before the answer is unjudged
DEFAULT_TIMEOUT = 300.0  # seconds per model call (the OpenAI engine's request limit)
_NEGATIVE = ("incorrect", "wrong", "not correct")  # ARPO's words that make a reply incorrect

Verdict = Literal["correct", "incorrect", "unjudged"]
Source = Literal["judge", "exact", "no answer"]
Unparsable = Literal["unjudged", "incorrect"]


@dataclass(frozen=True, slots=True)
class JudgeReply:
    """What the judge model said, with the tokens the call cost (0 where unknown)."""

    text: str
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True, slots=True)
class Judgement:
    """The judge's decision on one answer.

    ``verdict`` is ``"correct"``, ``"incorrect"`` or ``"unjudged"`` (the judge failed: no
    verdict, counted apart, never a 0). ``source`` says who decided: ``"judge"`` (the model),
    ``"exact"`` (identical to a gold answer, no call) or ``"no answer"`` (nothing to judge, no
    call). ``reply`` is the model's text, ``detail`` why it is what it is (for unjudged: the
    error, the timeout or the unparsable reply), ``cached`` whether it came from the cache.
    """

    verdict: Verdict
    source: Source
    reply: str | None = None
    detail: str | None = None
    cached: bool = False

    @property
    def correct(self) -> bool | None:
        """True or False; None when unjudged."""
        return None if self.verdict == "unjudged" else self.verdict == "correct"

    @property
    def score(self) -> float | None:
        """1.0 correct, 0.0 incorrect, None unjudged."""
        return None if self.verdict == "unjudged" else float(self.verdict == "correct")

    def as_dict(self) -> dict[str, object]:
        """The fields as a JSON-ready dict."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class JudgeStats:
    """What a :class:`Judge` did and what it cost.

    ``requests`` answers were judged: ``no_answer`` without an answer, ``exact`` identical to a
    gold, ``cached`` from the cache (or sharing a call in flight), the rest by the model, which
    took ``calls`` calls (retries included) of which ``failed_calls`` raised or timed out.
    ``correct``, ``incorrect`` and ``unjudged`` count the results; ``prompt_tokens`` and
    ``completion_tokens`` the tokens of the calls, ``seconds`` their summed duration.
    """

    requests: int = 0
    no_answer: int = 0
    exact: int = 0
    cached: int = 0
    calls: int = 0
    failed_calls: int = 0
    correct: int = 0
    incorrect: int = 0
    unjudged: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    seconds: float = 0.0

    def as_dict(self) -> dict[str, float]:
        """The counters as a dict."""
        return asdict(self)


class UnjudgedError(RuntimeError):
    """The judge could not decide (its :class:`Judgement` is in ``judgement``)."""

    def __init__(self, judgement: Judgement) -> None:
        super().__init__(f"the judge could not decide: {judgement.detail}")
        self.judgement = judgement


def format_golds(golds: Sequence[str]) -> str:
    """The gold answers as the prompt's ``{labeled_answer}``: one as its text, several as a list.

    ARPO's evaluation fills the prompt with ``str.format`` from its data files, where GAIA's gold
    is a string and the QA sets' golds are lists: ``34689``, ``['New York City', 'NYC']``.
    """
    return golds[0] if len(golds) == 1 else str(list(golds))


def parse_verdict(reply: str, *, unparsable: Unparsable = "unjudged") -> tuple[Verdict, str | None]:
    """The verdict of a judge's reply and, when it is not a plain one, why.

    ARPO's rule (``llm_evaluator_sds.py``): the text between ``<judgment>`` and ``</judgment>``
    when both occur (the first of each, as ``str.index`` finds them), else the whole reply;
    "incorrect", "wrong" or "not correct" in it make it incorrect, else "correct" in it makes it
    correct. A reply with none of these is unjudged, or incorrect (ARPO's reading) with
    ``unparsable="incorrect"``.
    """
    if unparsable not in get_args(Unparsable):
        raise ValueError(f"unparsable must be 'unjudged' or 'incorrect', got {unparsable!r}")
    text = reply.strip()
    if "<judgment>" in reply and "</judgment>" in reply:
        start = reply.index("<judgment>") + len("<judgment>")
        text = reply[start : reply.index("</judgment>")].strip()  # empty when the tags are out of order
    lowered = text.lower()
    if any(word in lowered for word in _NEGATIVE):
        return "incorrect", None
    if "correct" in lowered:
        return "correct", None
    shown = text if len(text) <= 120 else text[:117] + "..."
    if unparsable == "incorrect":
        return "incorrect", f"unparsable verdict read as incorrect (as ARPO does): {shown!r}"
    return "unjudged", f"unparsable verdict: the reply says neither 'correct' nor 'incorrect'/'wrong': {shown!r}"


_Key = tuple[str, tuple[str, ...], str, str]  # question, gold answers, answer, judge model


class Judge:
    """Asks a model whether answers match their gold answers (see the module docstring).

    Args:
        ask: ``async ask(prompt) -> str | JudgeReply``, one call of the judge model.
        model: The judge model's name: part of every cache key.
        prompt: The template, with ``{question}``, ``{labeled_answer}`` and ``{pred_answer}``
            (default ARPO's :data:`JUDGE_PROMPT`).
        timeout: Seconds per call before it counts as failed (None: no limit).
        attempts: Tries per answer when calls raise or time out (ARPO: 3).
        retry_delay: Seconds before try ``n + 1`` is ``retry_delay · n`` (ARPO: 1 s, 2 s).
        exact_shortcut: An answer identical to a gold answer is correct without a call.
        unparsable: What a reply without a verdict is: ``"unjudged"`` (default) or ``"incorrect"``.
        max_concurrency: Calls in flight at most (None: no limit).
        cache_file: A JSONL file of verdicts, read now and appended to as verdicts come.
    """

    def __init__(
        self,
        ask: Callable[[str], Awaitable[str | JudgeReply]],
        model: str,
        *,
        prompt: str = JUDGE_PROMPT,
        timeout: float | None = DEFAULT_TIMEOUT,
        attempts: int = DEFAULT_ATTEMPTS,
        retry_delay: float = 1.0,
        exact_shortcut: bool = True,
        unparsable: Unparsable = "unjudged",
        max_concurrency: int | None = 32,
        cache_file: str | Path | None = None,
    ) -> None:
        if not isinstance(model, str) or not model.strip():
            raise ValueError(f"model must name the judge model (it is part of the cache key), got {model!r}")
        try:
            prompt.format(**dict.fromkeys(_PLACEHOLDERS, ""))
        except (KeyError, IndexError, ValueError) as e:
            raise ValueError(
                f"the judge prompt must be a str.format template using only {{question}}, {{labeled_answer}} and "
                f"{{pred_answer}} (write other braces as {{{{ and }}}}); formatting it failed: {type(e).__name__}: {e}"
            ) from None
        if timeout is not None and not timeout > 0:
            raise ValueError(f"timeout must be > 0 seconds (or None for no limit), got {timeout!r}")
        if attempts < 1:
            raise ValueError(f"attempts must be >= 1, got {attempts!r}")
        if retry_delay < 0:
            raise ValueError(f"retry_delay must be >= 0, got {retry_delay!r}")
        if unparsable not in get_args(Unparsable):
            raise ValueError(f"unparsable must be 'unjudged' or 'incorrect', got {unparsable!r}")
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1 (or None for no limit), got {max_concurrency!r}")
        self.ask = ask
        self.model = model
        self.prompt = prompt
        self.timeout = timeout
        self.attempts = attempts
        self.retry_delay = retry_delay
        self.exact_shortcut = exact_shortcut
        self.unparsable = unparsable
        self.max_concurrency = max_concurrency
        self.stats = JudgeStats()
        self._cache: dict[_Key, Judgement] = {}
        # asyncio primitives belong to one event loop; keep them per loop that uses the judge.
        self._semaphores: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}
        self._in_flight: dict[tuple[asyncio.AbstractEventLoop, _Key], asyncio.Task[Judgement]] = {}
        self._prompt_sha = hashlib.sha256(prompt.encode()).hexdigest()[:16]
        self.cache_file = Path(cache_file) if cache_file is not None else None
        if self.cache_file is not None and self.cache_file.exists():
            self._read_cache(self.cache_file)

    async def judge(self, question: str, golds: Sequence[str], answer: str | None) -> Judgement:
        """Judge ``answer`` (None: the model gave none) against ``golds`` for ``question``."""
        golds = tuple(golds)
        if not golds or not all(isinstance(g, str) for g in golds):
            raise ValueError(f"golds must be a non-empty list of strings, got {golds!r}")
        if not isinstance(question, str):
            raise TypeError(f"question must be a string, got {type(question).__name__}")
        self.stats.requests += 1
        if answer is None or not answer.strip():
            self.stats.no_answer += 1
            return self._count(Judgement("incorrect", "no answer", detail="no answer to judge"))
        if self.exact_shortcut and answer.strip() in {g.strip() for g in golds}:
            self.stats.exact += 1
            return self._count(Judgement("correct", "exact", detail="identical to a gold answer"))
        key: _Key = (question, golds, answer, self.model)
        if key in self._cache:
            self.stats.cached += 1
            return self._count(replace(self._cache[key], cached=True))
        loop = asyncio.get_running_loop()
        task = self._in_flight.get((loop, key))
        shared = task is not None
        if task is None:
            task = loop.create_task(self._decide(key))
            self._in_flight[(loop, key)] = task
            task.add_done_callback(lambda _: self._in_flight.pop((loop, key), None))
        # Shielded: a caller that is cancelled leaves the call running for the others waiting on it.
        judgement = await asyncio.shield(task)
        if shared and judgement.verdict != "unjudged":
            self.stats.cached += 1
            judgement = replace(judgement, cached=True)
        return self._count(judgement)

    async def judge_many(self, items: Iterable[tuple[str, Sequence[str], str | None]]) -> list[Judgement]:
        """Judge ``(question, golds, answer)`` items concurrently, in order."""
        return list(await asyncio.gather(*(self.judge(q, g, a) for q, g, a in items)))

    async def _decide(self, key: _Key) -> Judgement:
        question, golds, answer, _ = key
        prompt = self.prompt.format(question=question, labeled_answer=format_golds(golds), pred_answer=answer)
        failure = ""
        for attempt in range(self.attempts):
            if attempt:
                await asyncio.sleep(self.retry_delay * attempt)
            start = time.perf_counter()
            deadline: asyncio.Timeout | None = None
            try:
                async with self._semaphore():
                    start = time.perf_counter()  # the wait for a slot is neither the call's cost nor its time limit
                    deadline = asyncio.timeout(self.timeout)
                    async with deadline:
                        reply = await self.ask(prompt)
            except TimeoutError as e:
                ours = deadline is not None and deadline.expired()
                failure = f"timed out after {self.timeout:g} s" if ours else f"TimeoutError: {e}"
            except Exception as e:  # any failure of the call is reported, never turned into a verdict
                failure = f"{type(e).__name__}: {e}"
            else:
                self._cost(time.perf_counter() - start, reply)
                text = reply.text if isinstance(reply, JudgeReply) else reply
                if not isinstance(text, str):
                    failure = f"ask() returned {type(text).__name__}, not a string or JudgeReply"
                    self.stats.failed_calls += 1
                    continue
                verdict, detail = parse_verdict(text, unparsable=self.unparsable)
                judgement = Judgement(verdict, "judge", reply=text, detail=detail)
                if verdict != "unjudged":
                    self._remember(key, judgement)
                return judgement
            self.stats.calls += 1
            self.stats.failed_calls += 1
            self.stats.seconds += time.perf_counter() - start
        tries = f"{self.attempts} tries" if self.attempts > 1 else "1 try"
        return Judgement("unjudged", "judge", detail=f"the judge call failed ({tries}); last: {failure}")

    def _semaphore(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        if loop not in self._semaphores:
            self._semaphores[loop] = asyncio.Semaphore(self.max_concurrency or 1 << 30)
        return self._semaphores[loop]

    def _cost(self, seconds: float, reply: str | JudgeReply) -> None:
        self.stats.calls += 1
        self.stats.seconds += seconds
        if isinstance(reply, JudgeReply):
            self.stats.prompt_tokens += reply.prompt_tokens
            self.stats.completion_tokens += reply.completion_tokens

    def _count(self, judgement: Judgement) -> Judgement:
        if judgement.verdict == "correct":
            self.stats.correct += 1
        elif judgement.verdict == "incorrect":
            self.stats.incorrect += 1
        else:
            self.stats.unjudged += 1
        return judgement

    def _remember(self, key: _Key, judgement: Judgement) -> None:
        self._cache[key] = judgement
        if self.cache_file is None:
            return
        question, golds, answer, model = key
        line = {
            "question": question,
            "golds": list(golds),
            "answer": answer,
            "model": model,
            "prompt_sha": self._prompt_sha,
            "verdict": judgement.verdict,
            "reply": judgement.reply,
            "detail": judgement.detail,
        }
        self.cache_file.parent.mkdir(parents=True, exist_ok=True)
        with self.cache_file.open("a", encoding="utf-8") as f:
            f.write(json.dumps(line, ensure_ascii=False) + "\n")

    def _read_cache(self, path: Path) -> None:
        lines = path.read_text(encoding="utf-8").splitlines()
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                key: _Key = (row["question"], tuple(row["golds"]), row["answer"], row["model"])
                judgement = Judgement(row["verdict"], "judge", reply=row["reply"], detail=row["detail"])
                if judgement.verdict not in ("correct", "incorrect"):
                    raise ValueError(f"verdict {judgement.verdict!r}")
            except (ValueError, KeyError, TypeError) as e:
                if lineno == len(lines):  # a run that stopped mid-write: the line is lost, the rest is good
                    logger.warning("%s:%d: an incomplete judge cache line is ignored", path, lineno)
                    continue
                raise ValueError(
                    f"{path}:{lineno}: not a judge cache line ({type(e).__name__}: {e}); "
                    "it was not written by agentenv.judge, or is damaged: delete the file to start afresh"
                ) from None
            if row.get("prompt_sha") == self._prompt_sha:
                self._cache[key] = judgement


class JudgeReward:
    """A reward from a :class:`Judge`: 1.0 correct, 0.0 incorrect, ``format_penalty`` for no answer.

    An async reward callable that names the arguments ``answer``, ``answers`` and ``task`` (see
    :mod:`agentenv.rewards`). An answer the judge cannot decide raises :class:`UnjudgedError`, so
    the episode fails visibly instead of scoring 0.
    """

    def __init__(self, judge: Judge, *, format_penalty: float | None = None) -> None:
        self.judge = judge
        self.format_penalty = format_penalty

    async def __call__(self, answer: str | None, answers: Sequence[str], task: Example) -> float:
        if answer is None and self.format_penalty is not None:
            return self.format_penalty
        judgement = await self.judge.judge(task.question, answers, answer)
        if judgement.score is None:
            raise UnjudgedError(judgement)
        return judgement.score
