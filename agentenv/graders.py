"""Answer grading: SQuAD-normalised exact match, F1 and cover-EM over several gold answers,
mathematical equivalence (math-verify), and extraction of the final answer from a model's
``<answer>…\\boxed{…}…</answer>``.

The normalisation is SQuAD's (Rajpurkar et al. 2016, the official evaluation script) as used by
the QA agent-RL papers: lower-case, drop punctuation, drop the articles a/an/the, collapse spaces.

Two word-level F1s (``f1=`` of :func:`f1_score` and :func:`grade`):

- ``"squad"``: SQuAD v1.1's F1, the metric of NQ, TriviaQA, PopQA, Bamboogle and MuSiQue
  (MuSiQue's own ``metrics/answer.py`` differs only where an answer normalises to nothing).
- ``"hotpotqa"``: the official HotpotQA script's (``hotpot_evaluate_v1.py``, ``f1_score``), also
  2WikiMultihopQA's (``2wikimultihop_evaluate_v1.1.py``), FlashRAG's and the ATPO/ARPO reward
  code's: 0 when the prediction or the gold normalises to ``yes``, ``no`` or ``noanswer`` and the
  two differ. :data:`DATASET_F1` says which shipped dataset uses which, :data:`FORMAT_F1` which
  data-file format implies which.

Two cover-EMs: :func:`cover_exact_match` (FlashRAG's ``Sub_ExactMatch`` and Search-R1's
``subem_check``: the normalised gold is a substring of the normalised prediction) and
:func:`token_cover_exact_match` (the gold's words appear as whole words). Neither lets a gold that
normalises to nothing match.

Two box rules (``box=``): ``"lenient"`` reads the last ``\\boxed{…}``, ``\\boxed {…}`` or
``\\fbox{…}``; ``"papers"`` reads the answer exactly as the ATPO/ARPO reward code does
(:func:`extract_boxed`).

Math grading is bounded wherever it runs. Answers whose numbers would be far too large
(``\\boxed{9^{9^{9^{9}}}}``, ``(10^6)!``) are refused before sympy sees them. On the main thread
math-verify's own limits apply (5 s per step, by SIGALRM); on any other thread, where SIGALRM
cannot reach, the grading runs in a worker process that is killed after :data:`MATH_TIMEOUT`
seconds. Either way a refused or timed-out answer grades as not equal, and
:attr:`Grade.math_detail` says why.

This file is also the worker process's program (see :class:`_MathWorker`): it must import only
the standard library at the top.
"""

from __future__ import annotations

import atexit
import importlib
import json
import logging
import math
import os
import re
import select
import string
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, get_args

__all__ = [
    "BOX_RULES",
    "DATASET_F1",
    "F1_VARIANTS",
    "FORMAT_F1",
    "HOTPOTQA_SPECIAL_ANSWERS",
    "MATH_TIMEOUT",
    "BoxRule",
    "F1Variant",
    "Grade",
    "cover_exact_match",
    "dataset_f1",
    "exact_match",
    "extract_answer",
    "extract_boxed",
    "f1_score",
    "format_f1",
    "grade",
    "math_equal",
    "normalize_answer",
    "prepare_math_grading",
    "token_cover_exact_match",
]

F1Variant = Literal["squad", "hotpotqa"]
F1_VARIANTS: tuple[F1Variant, ...] = get_args(F1Variant)
BoxRule = Literal["lenient", "papers"]
BOX_RULES: tuple[BoxRule, ...] = get_args(BoxRule)

#: Answers that HotpotQA's official F1 credits only when matched exactly (``hotpot_evaluate_v1.py``).
HOTPOTQA_SPECIAL_ANSWERS = frozenset({"yes", "no", "noanswer"})

#: The F1 of each shipped dataset's official evaluation; a dataset not listed uses ``"squad"``.
DATASET_F1: dict[str, F1Variant] = {
    "hotpotqa": "hotpotqa",  # hotpotqa/hotpot, hotpot_evaluate_v1.py
    "hotpotqa-official": "hotpotqa",
    "2wiki": "hotpotqa",  # Alab-NII/2wikimultihop, 2wikimultihop_evaluate_v1.1.py (adapted from HotpotQA's)
    "multihop": "hotpotqa",  # HotpotQA's 500 first, then 2Wiki's, then MuSiQue's (agentenv.datasets.POOLED_DATASETS)
}

#: The F1 that a data file's format implies (:func:`agentenv.datasets.detect_format`); a format not
#: listed uses ``"squad"``. Only the official HotpotQA format names its benchmark: HotpotQA's and
#: 2WikiMultihopQA's releases share it, and both official scripts apply the yes/no rule. IRCoT's
#: format holds HotpotQA, 2Wiki and MuSiQue alike, so it implies nothing.
FORMAT_F1: dict[str, F1Variant] = {"hotpotqa": "hotpotqa"}

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lower-case, strip punctuation, articles and extra whitespace."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def dataset_f1(dataset: str | None) -> F1Variant:
    """The F1 that ``dataset``'s official evaluation computes (see :data:`DATASET_F1`); ``"squad"`` if unknown."""
    return DATASET_F1.get(dataset or "", "squad")


def format_f1(data_format: str) -> F1Variant:
    """The F1 that a data file in ``data_format`` is graded with (see :data:`FORMAT_F1`); ``"squad"`` if unknown."""
    return FORMAT_F1.get(data_format, "squad")


def exact_match(prediction: str, golds: Iterable[str]) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
    pred = normalize_answer(prediction)
    return float(any(pred == normalize_answer(g) for g in golds))


def cover_exact_match(prediction: str, golds: Iterable[str]) -> float:
    """1.0 if any normalised gold answer is a substring of the normalised prediction, else 0.0.

    FlashRAG's cover-EM (``Sub_ExactMatch``) and Search-R1's ``subem_check``: a plain substring
    test, so ``"Obama"`` covers ``"Obamacare"`` and ``"Indiana"`` covers ``"“Indiana”"`` (curly
    quotes are not ASCII punctuation and survive normalisation). Unlike theirs, a gold that
    normalises to the empty string (``"The"``) matches nothing: ``"" in text`` is always true.
    """
    pred = normalize_answer(prediction)
    return float(any(gold in pred for gold in map(normalize_answer, golds) if gold))


def token_cover_exact_match(prediction: str, golds: Iterable[str]) -> float:
    """1.0 if any normalised gold answer occurs in the normalised prediction as whole words, else 0.0.

    Stricter than :func:`cover_exact_match`: ``"Obama"`` does not cover ``"Obamacare"``, nor
    ``"Indiana"`` the word ``"“indiana”"``. A gold that normalises to nothing matches nothing.
    """
    pred = f" {normalize_answer(prediction)} "
    return float(any(f" {gold} " in pred for gold in map(normalize_answer, golds) if gold))


def f1_score(prediction: str, golds: Iterable[str], *, f1: F1Variant = "squad", given: str = "") -> float:
    """Word-level F1 of the normalised prediction against the best-matching gold answer.

    Args:
        f1: ``"squad"`` (SQuAD v1.1) or ``"hotpotqa"``, which also scores 0 against a gold when
            either side normalises to one of :data:`HOTPOTQA_SPECIAL_ANSWERS` and they differ
            (``"yes, it is"`` against ``"yes"``: 0, where SQuAD's F1 is 0.5).
        given: Text whose words earn nothing (the question): they are left out of the prediction
            and of each gold before counting, so repeating the question scores 0; a gold made of
            given words only (``"Who is older, A or B?"``: ``"B"``) counts only if matched exactly.
    """
    if f1 not in F1_VARIANTS:
        raise ValueError(f"unknown F1 {f1!r}; choose one of {list(F1_VARIANTS)}")
    pred = normalize_answer(prediction)
    known = set(normalize_answer(given).split())  # F1_new of docs/algorithms/rewards.md "Reward hacking" when given
    pred_tokens = [word for word in pred.split() if word not in known]
    best = 0.0
    for gold in golds:
        gold_normal = normalize_answer(gold)
        # hotpotqa/hotpot hotpot_evaluate_v1.py f1_score: a yes/no answer is right or wrong, never partly right.
        if f1 == "hotpotqa" and pred != gold_normal and HOTPOTQA_SPECIAL_ANSWERS & {pred, gold_normal}:
            continue
        gold_tokens = [word for word in gold_normal.split() if word not in known]
        if not gold_tokens:  # only given words (or none): right or wrong as a whole
            best = max(best, float(bool(gold_normal) and pred == gold_normal))
            continue
        common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
        if common == 0:
            continue
        precision, recall = common / len(pred_tokens), common / len(gold_tokens)
        best = max(best, 2 * precision * recall / (precision + recall))
    return best


MATH_TIMEOUT = 10.0
"""Seconds one math grading may take off the main thread before its worker process is killed."""

_STEP_TIMEOUT = 5  # math-verify's limit per parse and per comparison, where SIGALRM works
_MAX_DIGITS = 100_000  # a number with more digits than this is refused (100000! has 456,574)
_MAX_NODES = 100_000  # an answer with more parts than this is refused
_WORKERS = 2  # worker processes at most: one slow answer does not hold up all the others
_WORKER_START_TIMEOUT = 120.0  # seconds for a worker to start (it imports sympy)
_WORKER_CPU_SECONDS = 120  # a worker left running by a dead parent stops after this much CPU per answer


def math_equal(prediction: str, golds: Iterable[str], *, timeout: float = MATH_TIMEOUT) -> float:
    """1.0 if the prediction is mathematically equal to any gold answer (math-verify), else 0.0.

    ``\\frac{1}{2}``, ``1/2`` and ``0.5`` are equal; so are ``x^2+1`` and ``1+x^2``. Bounded in time
    (see the module's docstring): an answer that is refused or times out is 0.0; :func:`grade`
    records why in :attr:`Grade.math_detail`.

    Args:
        timeout: Seconds the grading may take when called off the main thread.
    """
    return _math_equal(prediction, list(golds), timeout)[0]


def _math_equal(prediction: str, golds: Sequence[str], timeout: float) -> tuple[float, str | None]:
    """``(1.0 or 0.0, why it is 0.0 without a real comparison, or None)``."""
    if threading.current_thread() is threading.main_thread():
        return _math_equal_here(prediction, golds)
    pool = _math_workers()
    if pool is not None:
        try:
            return pool.grade(prediction, golds, timeout)
        except _WorkerUnavailable as e:
            _disable_math_workers(str(e))
    # No worker process can be started: grade here, where nothing can stop a runaway comparison.
    return _math_equal_here(prediction, golds)


def _math_equal_here(prediction: str, golds: Sequence[str]) -> tuple[float, str | None]:
    """:func:`_math_equal` in this thread: math-verify's own limits apply only on the main thread."""
    math_parse, math_verify = _math_verify()
    # math-verify's timeouts use SIGALRM, which only the main thread receives; elsewhere they are off.
    timeout = _STEP_TIMEOUT if threading.current_thread() is threading.main_thread() else None
    _calls.timeouts = []
    try:
        target = math_parse(f"${prediction}$", parsing_timeout=timeout)
        try:
            refusal = _too_large(target)
        except Exception:  # an expression the check does not know: compare it, as before the check
            refusal = None
        if refusal is not None:
            return 0.0, f"refused: {refusal}"
        if target and any(
            math_verify(math_parse(f"${gold}$", parsing_timeout=timeout), target, timeout_seconds=timeout)
            for gold in golds
        ):
            return 1.0, None
        if _calls.timeouts:
            steps = " and ".join(sorted(set(_calls.timeouts)))
            return 0.0, f"timed out: math-verify gave up {steps} after {_STEP_TIMEOUT} s"
        return 0.0, None
    finally:
        _calls.timeouts = None


_calls = threading.local()  # .timeouts: math-verify's timeouts during this thread's current grading


class _QuietMathVerify(logging.Filter):
    """Keeps math-verify's warnings out of the logs, and notes its timeouts for the grade.

    It warns on every call made with its timeouts off, and on a timeout with the whole answer.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            return True
        message = str(record.msg)
        timeouts = getattr(_calls, "timeouts", None)
        if timeouts is not None and message.startswith("Timeout during "):
            timeouts.append(message.removeprefix("Timeout during ").split(":")[0].replace("comparison", "comparing"))
        return False


def _math_verify() -> tuple[Any, Any]:
    """math-verify's ``parse`` and ``verify``, its logging routed through :class:`_QuietMathVerify`."""
    # Imported here: math-verify pulls in sympy (~1 s, ~60 MiB), which only math grading needs.
    from math_verify import parse, verify

    global _quiet
    with _quiet_lock:
        if _quiet is None:
            _quiet = _QuietMathVerify()
            for name in ("math_verify.grader", "math_verify.parser", "math_verify.utils"):
                logger = logging.getLogger(name)
                logger.setLevel(logging.WARNING)  # not ERROR, to see the timeouts: the filter drops the rest
                logger.addFilter(_quiet)
    return parse, verify


def prepare_math_grading() -> None:
    """Import math-verify and grade one answer now (~1 s), so the first graded episode does not
    stall its event loop for as long (math environments call it when made)."""
    math_equal("\\frac{1}{2}", ["0.5"])


_quiet: _QuietMathVerify | None = None
_quiet_lock = threading.Lock()
# Nothing of math-verify's but errors is logged (its own loggers get _QuietMathVerify once imported).
logging.getLogger("math_verify").setLevel(logging.ERROR)


def _too_large(parsed: Iterable[object]) -> str | None:
    """Why sympy must not evaluate these parsed expressions (a number far too large), or None.

    An upper bound on the digits of every number in each expression, from its tree: ``b^e`` has
    about ``|e|·digits(b)`` digits, ``n!`` about ``n·log10(n)``. Nothing is evaluated.
    """
    sympy: Any = importlib.import_module("sympy")  # untyped; here only once math-verify has loaded it

    growing = (
        sympy.factorial,
        sympy.factorial2,
        sympy.subfactorial,
        sympy.gamma,
        sympy.RisingFactorial,
        sympy.FallingFactorial,
        sympy.binomial,
        sympy.fibonacci,
        sympy.lucas,
        sympy.catalan,
        sympy.bell,
    )

    def children(node: object) -> tuple[object, ...]:
        if isinstance(node, sympy.MatrixBase):
            return tuple(node)
        return node.args if isinstance(node, sympy.Basic) else ()

    def log10(value: int) -> float:
        return math.log10(abs(value)) if abs(value) > 1 else 0.0

    def digits(node: object, args: list[float]) -> float:
        if isinstance(node, sympy.Rational):  # Integers too
            return max(log10(int(node.p)), log10(int(node.q)))
        if isinstance(node, sympy.Float):
            value = abs(float(node))
            return math.log10(value) if value > 1 else 0.0
        if isinstance(node, sympy.NumberSymbol):
            return 1.0
        if isinstance(node, sympy.Pow):
            base, exponent = args
            return 0.0 if base == 0 else math.inf if exponent > 300 else 10**exponent * base
        if isinstance(node, growing):
            n = max(args, default=0.0)
            return math.inf if n > 300 else 10**n * max(1.0, n)
        if isinstance(node, sympy.Mul):
            return sum(args)
        if isinstance(node, sympy.Add):
            return max(args, default=0.0) + math.log10(max(1, len(args)))
        return max(args, default=0.0)

    for expr in parsed:
        if isinstance(expr, str):
            continue
        bounds: dict[int, float] = {}
        stack: list[tuple[object, bool]] = [(expr, False)]
        nodes = 0
        while stack:
            node, ready = stack.pop()
            if not ready:
                nodes += 1
                if nodes > _MAX_NODES:
                    return f"the answer has more than {_MAX_NODES:,} parts"
                stack.append((node, True))
                stack.extend((child, False) for child in children(node))
                continue
            bound = digits(node, [bounds[id(child)] for child in children(node)])
            if bound > _MAX_DIGITS:
                size = "far more" if math.isinf(bound) else f"about {bound:.2g}"
                return f"it has a number of {size} digits; numbers of over {_MAX_DIGITS:,} digits are not compared"
            bounds[id(node)] = bound
    return None


class _WorkerUnavailable(RuntimeError):
    """No worker process could be started; the message says why."""


class _MathWorker:
    """A process that runs :func:`_math_equal_here` on its main thread, so math-verify's limits
    work there, and that can be killed when an answer takes too long anyway.

    It speaks JSON lines: the answer and golds in on stdin, ``{"equal", "reason"}`` out on stdout.
    """

    # Runs this file under a name of its own (not imported as agentenv.graders: that would import
    # the whole package), with this process's sys.path so that math-verify is found the same way.
    _BOOT = (
        "import json, runpy, sys; sys.path[:] = json.loads(sys.argv[1]); "
        "runpy.run_path(sys.argv[2], run_name=sys.argv[3])"
    )
    RUN_NAME = "__agentenv_math_worker__"

    def __init__(self) -> None:
        path = [os.fspath(p) for p in sys.path if isinstance(p, str | os.PathLike)]
        command = [sys.executable, "-P", "-c", self._BOOT, json.dumps(path), _THIS_FILE, self.RUN_NAME]
        try:
            # Its own session: a Ctrl-C meant for this process does not reach the worker.
            self._process = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, start_new_session=True
            )
        except OSError as e:
            raise _WorkerUnavailable(f"cannot start {sys.executable}: {e}") from None
        self._pending = b""
        try:
            ready = self._receive(time.monotonic() + _WORKER_START_TIMEOUT)
        except Exception as e:
            self.kill()
            why = f"no word within {_WORKER_START_TIMEOUT:g} s" if isinstance(e, _WorkerTimeout) else e
            raise _WorkerUnavailable(f"the math grading process did not start: {why}") from None
        if ready != {"ready": True}:
            self.kill()
            raise _WorkerUnavailable(f"the math grading process did not start: it said {ready!r}")

    def grade(self, prediction: str, golds: Sequence[str], timeout: float) -> tuple[float, str | None]:
        """Grade one answer; raises :class:`_WorkerTimeout` or :class:`_WorkerExited` (then kill it)."""
        request = json.dumps({"prediction": str(prediction), "golds": [str(g) for g in golds]}) + "\n"
        self._send(request.encode())
        reply = self._receive(time.monotonic() + timeout)
        return float(reply["equal"]), reply["reason"]

    def _send(self, data: bytes) -> None:
        assert self._process.stdin is not None
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._process.stdin.fileno(), view) :]
        except OSError:  # BrokenPipeError: it is gone
            raise self._exited() from None

    def _receive(self, deadline: float) -> Any:
        assert self._process.stdout is not None
        out = self._process.stdout.fileno()
        while b"\n" not in self._pending:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise _WorkerTimeout
            if select.select([out], [], [], remaining)[0]:
                chunk = os.read(out, 1 << 16)
                if not chunk:
                    raise self._exited()
                self._pending += chunk
        line, _, self._pending = self._pending.partition(b"\n")
        return json.loads(line)

    def _exited(self) -> _WorkerExited:
        try:
            return _WorkerExited(f"it exited with status {self._process.wait(timeout=5)}")
        except subprocess.TimeoutExpired:
            return _WorkerExited("it closed its pipes")

    def close(self) -> None:
        """Let it finish (end of input), or kill it after a second."""
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.close()
        try:
            self._process.wait(timeout=1)
        except subprocess.TimeoutExpired:
            self.kill()
        self._process.stdout.close()

    def kill(self) -> None:
        """Stop it now."""
        self._process.kill()
        self._process.wait()
        for pipe in (self._process.stdin, self._process.stdout):
            if pipe is not None:
                pipe.close()

    def forget(self) -> None:
        """In a forked child: drop this process's pipes, leave the worker to the parent."""
        for pipe in (self._process.stdin, self._process.stdout):
            if pipe is not None:
                pipe.close()


class _WorkerTimeout(Exception):
    """No reply before the deadline."""


class _WorkerExited(Exception):
    """The worker process died; the message says how."""


class _MathWorkers:
    """Up to ``size`` worker processes, started when needed; a killed one is replaced on demand."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._idle: list[_MathWorker] = []
        self._started = 0
        self._live: set[_MathWorker] = set()  # idle or busy, for a forked child to let go of
        self._changed = threading.Condition()

    def grade(self, prediction: str, golds: Sequence[str], timeout: float) -> tuple[float, str | None]:
        """:func:`_math_equal` in a worker: not equal, with the reason, when it times out or dies."""
        worker = self._take()
        try:
            result = worker.grade(prediction, golds, timeout)
        except _WorkerTimeout:
            self._drop(worker)
            return 0.0, f"timed out: no result within {timeout:g} s (the grading process was stopped)"
        except _WorkerExited as e:
            self._drop(worker)
            return 0.0, f"failed: the grading process died: {e}"
        except Exception as e:  # a garbled reply: that process cannot be trusted any more
            self._drop(worker)
            return 0.0, f"failed: {type(e).__name__}: {e}"
        except BaseException:  # KeyboardInterrupt mid-answer: the process may still be busy with it
            self._drop(worker)
            raise
        with self._changed:
            self._idle.append(worker)
            self._changed.notify()
        return result

    def _take(self) -> _MathWorker:
        with self._changed:
            while not self._idle and self._started >= self._size:
                self._changed.wait()  # not part of the deadline: the deadline is for this answer alone
            if self._idle:
                return self._idle.pop()
            self._started += 1
        try:
            worker = _MathWorker()  # outside the lock: starting takes a second or more
        except BaseException:
            self._drop(None)
            raise
        self._live.add(worker)
        return worker

    def _drop(self, worker: _MathWorker | None) -> None:
        if worker is not None:
            worker.kill()
            self._live.discard(worker)
        with self._changed:
            self._started -= 1
            self._changed.notify()

    def close(self) -> None:
        """Stop the idle workers (at exit)."""
        with self._changed:
            idle, self._idle = self._idle, []
        for worker in idle:
            worker.close()

    def forget(self) -> None:
        """In a forked child: let go of the parent's workers without touching them.

        The pool is not used again, but must be kept (see ``_forgotten``): a collected ``Popen``
        would warn that its process, the parent's, is still running.
        """
        for worker in list(self._live):
            worker.forget()


_THIS_FILE = os.path.abspath(__file__)
_pool: _MathWorkers | None = None
_pool_lock = threading.Lock()
_forgotten: list[_MathWorkers] = []  # the parent's pools, in a forked child: kept so nothing is collected


def _why_no_workers() -> str | None:
    if os.name != "posix":
        return "worker processes need a POSIX system"
    if not sys.executable:
        return "sys.executable is not set"
    return None if os.path.isfile(_THIS_FILE) else f"{_THIS_FILE} is not a file"


_pool_disabled = _why_no_workers()  # why no worker can be started in this process, if none can
_pool_disabled_said = False


def _math_workers() -> _MathWorkers | None:
    """This process's worker pool, or None where there can be none (then grading runs in-thread)."""
    global _pool
    if _pool_disabled is not None:
        _disable_math_workers(_pool_disabled)
        return None
    with _pool_lock:
        if _pool is None:
            _pool = _MathWorkers(_WORKERS)
            atexit.register(_pool.close)
        return _pool


def _disable_math_workers(reason: str) -> None:
    global _pool_disabled, _pool_disabled_said
    _pool_disabled = reason
    if not _pool_disabled_said:
        _pool_disabled_said = True
        logging.getLogger(__name__).warning(
            "math grading off the main thread has no time limit in this process: %s", reason
        )


def _after_fork_in_child() -> None:
    # The parent's workers and lock belong to the parent; a forked child starts its own.
    global _pool, _pool_lock
    if _pool is not None:
        _pool.forget()
        _forgotten.append(_pool)
    _pool, _pool_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _serve_math_worker() -> None:
    """The worker process's main loop (see :class:`_MathWorker`)."""
    import resource

    replies = os.fdopen(os.dup(sys.stdout.fileno()), "w", encoding="utf-8")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print must not garble the replies

    def reply(message: dict[str, Any]) -> None:
        replies.write(json.dumps(message) + "\n")
        replies.flush()

    _math_verify()  # import sympy before saying ready: the first answer's deadline is for the answer
    reply({"ready": True})
    for line in sys.stdin:
        request = json.loads(line)
        # A last stop if the parent died and cannot kill a runaway answer: SIGXCPU ends the process.
        used = resource.getrusage(resource.RUSAGE_SELF)
        _, hard = resource.getrlimit(resource.RLIMIT_CPU)
        soft = int(used.ru_utime + used.ru_stime) + _WORKER_CPU_SECONDS
        resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))
        try:
            equal, reason = _math_equal_here(request["prediction"], request["golds"])
        except Exception as e:  # grading failed: not equal, and say why
            equal, reason = 0.0, f"failed: {type(e).__name__}: {e}"
        reply({"equal": equal, "reason": reason})


def extract_boxed(text: str, *, box: BoxRule = "lenient") -> str | None:
    """The boxed answer in ``text``, or None if it has none.

    Args:
        box: ``"lenient"``: the content of the last ``\\boxed{…}``, ``\\boxed {…}`` (space
            before the brace) or ``\\fbox{…}``, braces balanced. ``"papers"``: what the
            ATPO/ARPO reward code (``verl/utils/reward_score/deep_research*.py``) grades, which
            is a different rule, kept exact:

            - the text must contain ``\\boxed{`` and a ``}`` (``validate_format``), else None:
              ``\\fbox{x}`` or a lone ``\\boxed {x}`` is no box;
            - if ``\\boxed `` (with a space) occurs, the answer is everything after the last one
              up to the next ``$`` (``last_boxed_only_string``): ``\\boxed{a} or \\boxed {b}``
              grades ``{b}``, whose braces normalisation drops;
            - else the last ``\\boxed`` must open a brace right away (``remove_boxed``), and its
              balanced content is the answer.

    An unclosed last box is None under either rule.
    """
    if box not in BOX_RULES:
        raise ValueError(f"unknown box rule {box!r}; choose one of {list(BOX_RULES)}")
    if box == "papers":
        return _papers_boxed(text)
    opened = [m.end() for m in _LENIENT_BOX.finditer(text)]  # one regex pass: linear in the text
    return _balanced(text, opened[-1]) if opened else None


def _papers_boxed(text: str) -> str | None:
    # ATPO verl/utils/reward_score/deep_research_em.py (and ARPO's deep_research.py): validate_format.
    if "\\boxed{" not in text or "}" not in text:
        return None
    # last_boxed_only_string: a "\boxed " anywhere takes precedence, and runs to the next "$".
    if "\\boxed " in text:
        return text.rsplit("\\boxed ", 1)[1].split("$", 1)[0].strip()
    start = text.rfind("\\boxed")
    if not text.startswith("\\boxed{", start):  # remove_boxed asserts the brace follows at once
        return None
    return _balanced(text, start + len("\\boxed{"))


def _balanced(text: str, begin: int) -> str | None:
    """The text from ``begin`` to the brace that closes the one just before it, stripped; None if unclosed."""
    depth = 1
    for brace in _BRACE.finditer(text, begin):  # only the braces: a long answer is not walked char by char
        depth += 1 if brace.group() == "{" else -1
        if depth == 0:
            return text[begin : brace.start()].strip()
    return None  # unbalanced: the box was never closed


_BRACE = re.compile(r"[{}]")
_LENIENT_BOX = re.compile(r"\\(?:boxed|fbox)\s*\{")


def extract_answer(response: str | None, *, require_boxed: bool = True, box: BoxRule = "lenient") -> str | None:
    """The final answer inside an ``<answer>`` tag's content.

    With ``require_boxed`` (the papers' format) it is the boxed value (``box`` is the rule, see
    :func:`extract_boxed`); without, the boxed value if there is one, else the whole content.
    None means a bad format.
    """
    if response is None:
        return None
    boxed = extract_boxed(response, box=box)
    if boxed is not None or require_boxed:
        return boxed
    return response.strip() or None


@dataclass(frozen=True, slots=True)
class Grade:
    """How one final answer scores against the gold answers.

    ``f1`` is the F1 the grader was asked for (see :func:`f1_score`); ``cover_em`` is FlashRAG's
    substring cover-EM and ``token_cover_em`` the whole-word one.
    """

    answer: str | None
    format_ok: bool
    em: float
    f1: float
    cover_em: float
    math_equal: float | None = None  # graded only when asked (math tasks)
    # Why math_equal is 0.0 without a real comparison: "refused: …", "timed out: …", "failed: …".
    math_detail: str | None = None
    # Last, with a default: graders that build a Grade by position keep working.
    token_cover_em: float | None = None

    def as_dict(self) -> dict[str, object]:
        """The fields as a dict (``math_equal``, ``math_detail`` and ``token_cover_em`` only where set)."""
        # Every field is a scalar: no deep copy (dataclasses.asdict) needed, once per graded episode.
        return {
            f.name: value
            for f in fields(self)
            if (value := getattr(self, f.name)) is not None or f.name not in _OPTIONAL_FIELDS
        }


_OPTIONAL_FIELDS = frozenset({"math_equal", "math_detail", "token_cover_em"})


def grade(
    response: str | None,
    golds: Iterable[str],
    *,
    require_boxed: bool = True,
    box: BoxRule = "lenient",
    f1: F1Variant = "squad",
    math: bool = False,
    math_timeout: float = MATH_TIMEOUT,
) -> Grade:
    """Grade the content of an ``<answer>`` tag (None: the model gave no answer).

    ``require_boxed`` and ``box`` say how the answer is read (:func:`extract_answer`), ``f1``
    which F1 is computed (:func:`f1_score`). With ``math=True`` the grade also holds
    ``math_equal`` (mathematical equivalence, see :func:`math_equal`; ``math_timeout`` is its
    ``timeout``), and ``math_detail`` when that could not be decided.
    """
    if f1 not in F1_VARIANTS:  # checked before the answer is read: a bad argument fails on every call
        raise ValueError(f"unknown F1 {f1!r}; choose one of {list(F1_VARIANTS)}")
    golds = list(golds)
    answer = extract_answer(response, require_boxed=require_boxed, box=box)
    if answer is None:
        return Grade(None, False, 0.0, 0.0, 0.0, 0.0 if math else None, token_cover_em=0.0)
    equal, detail = _math_equal(answer, golds, math_timeout) if math else (None, None)
    return Grade(
        answer,
        True,
        exact_match(answer, golds),
        f1_score(answer, golds, f1=f1),
        cover_exact_match(answer, golds),
        equal,
        detail,
        token_cover_exact_match(answer, golds),
    )


if __name__ == _MathWorker.RUN_NAME:
    _serve_math_worker()
