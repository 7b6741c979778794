"""Evaluation of a policy on registered environments: EM, F1, pass@k and the papers' pooled average.

Each question is posed ``samples`` times through the rollout loop (greedy decoding by default,
as in the papers' evaluations; sampled decoding for pass@k). Scores come from the env's grade
(``info["grade"]``: SQuAD-normalised exact match and word F1 of the final ``\\boxed{}`` answer);
an episode without a grade (an error, a timeout, the token budget) scores 0.

- EM and F1 of an environment: mean over its questions of the mean over their samples.
- pass@k: the unbiased estimator of Chen et al. 2021 (Codex, eq. 1) per question, averaged.
- The pooled average over several environments weighs every question equally (the "average"
  of the AT²PO and AEPO tables), not every environment.
- With a ``judge`` (:class:`agentenv.judge.Judge`, e.g. from :func:`agents.eval.judge.engine_judge`),
  each answer is also judged by an LLM, as AEPO and ARPO score GAIA, HLE, WebWalkerQA and
  xbench: ``judge`` is the mean over questions of the mean verdict over their judged samples,
  and pass@k counts the judge's verdicts. An answer the judge could not decide is *unjudged*:
  counted in ``unjudged``, left out of both (never scored 0). A question with fewer judged
  samples than k is left out of pass@k.
- MuSiQue-Full (questions whose task says ``meta["answerable"]``): EM, F1, pass@k and the judge
  count the answerable questions only, as MuSiQue's ``answer_em``/``answer_f1`` do; its
  answerability metric (``evaluate_v1.0.py``, ``GroupAnswerSufficiencyMetric``) pairs each
  answerable question with its unanswerable twin (same id). A sample predicts "not answerable"
  when its answer normalises to :data:`agentenv.datasets.UNANSWERABLE`; ``suff`` is the share of
  pairs whose two predictions are both right, ``ans_suff_em``/``ans_suff_f1`` the answerable
  twin's EM/F1 where both are right and 0 elsewhere (per pair the mean over sample indices,
  sample s of one twin with sample s of the other); ``pairs`` counts the complete pairs.

Example::

    report = await evaluate(engine, tokenizer, ["multihop-qa", "singlehop-qa"], limit=20)
    print(report.table())
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import agentenv
from agentenv.datasets import UNANSWERABLE, Example
from agentenv.graders import normalize_answer
from agentenv.judge import Judge, Judgement
from agentenv.wrappers import TokenEnv
from agents.engines.base import Engine, SamplingParams
from agents.eval.tables import text_table
from agents.rollout import Episode, RolloutConfig, Trajectory, stream_episodes

__all__ = [
    "GRADERS",
    "EnvResult",
    "EvalReport",
    "QuestionResult",
    "Sample",
    "build_episodes",
    "evaluate",
    "pass_at_k",
    "pass_ks",
    "repeated_answers",
    "sampler_logprob_gap",
    "transcript",
]

POOLED = "average (pooled)"
#: What decides whether a sample is right: the env's grade (exact match), or an LLM judge.
GRADERS = ("em", "judge")
Grader = Literal["em", "judge"]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct: 1 − C(n−c, k) / C(n, k).

    Computed as the product form 1 − Π_{i=n−c+1}^{n} (1 − k/i) (Chen et al. 2021), exact for any n.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))  # Codex eq. 1, stable form


def pass_ks(samples: int) -> list[int]:
    """The k values reported for ``samples`` samples per question: 1, powers of two, and ``samples``."""
    ks = [1]
    while ks[-1] * 2 < samples:
        ks.append(ks[-1] * 2)
    return ks + [samples] if samples > 1 else ks


@dataclass(frozen=True)
class Sample:
    """One episode's score."""

    em: float
    f1: float
    reward: float
    format_ok: bool
    answer: str | None
    status: str
    error: str | None
    turns: int
    tool_calls: int
    action_tokens: int
    response_tokens: int
    judge: str | None = None  # the judge's verdict: "correct", "incorrect", "unjudged"; None when not judged
    judge_detail: str | None = None
    in_results: bool = False  # the answer is in what the episode's tools returned
    equals_example: bool = False  # the answer is the worked example's (the prompt's)
    echoes_question: bool = False  # the answer repeats words of the question (agentenv.tool_env.ECHO_WORDS)

    @property
    def judge_score(self) -> float | None:
        """1.0 or 0.0 when the judge decided, else None (unjudged, or no judge)."""
        return {"correct": 1.0, "incorrect": 0.0}.get(self.judge or "")

    @property
    def predicts_answerable(self) -> bool:
        """MuSiQue's ``predicted_answerable``: False only for an answer that says :data:`UNANSWERABLE`."""
        return self.answer is None or normalize_answer(self.answer) != _UNANSWERABLE

    @classmethod
    def of(cls, trajectory: Trajectory) -> Sample:
        """Score a trajectory from the grade its env reported (none: 0)."""
        grade = trajectory.info.get("grade") or {}
        return cls(
            em=float(grade.get("em", 0.0)),
            f1=float(grade.get("f1", 0.0)),
            reward=trajectory.reward,
            format_ok=bool(grade.get("format_ok", False)),
            answer=grade.get("answer"),
            status=trajectory.status,
            error=trajectory.error,
            turns=len(trajectory.turns),
            tool_calls=int(trajectory.info.get("tool_calls", 0)),
            action_tokens=trajectory.num_action_tokens,
            response_tokens=trajectory.response_length,
            in_results=bool(grade.get("in_results", False)),
            equals_example=bool(grade.get("equals_example", False)),
            echoes_question=bool(grade.get("echoes_question", False)),
        )


_UNANSWERABLE = normalize_answer(UNANSWERABLE)


@dataclass
class QuestionResult:
    """All samples of one question.

    ``answerable`` is the task's ``meta["answerable"]`` (MuSiQue-Full; None where the dataset
    does not say); ``grader`` decides what :attr:`correct` and :meth:`pass_at` count.
    """

    env_id: str
    index: int
    id: str | None
    question: str | None
    answers: list[str]
    samples: list[Sample] = field(default_factory=list)
    answerable: bool | None = None
    grader: Grader = "em"

    @property
    def em(self) -> float:
        return statistics.fmean(s.em for s in self.samples)

    @property
    def f1(self) -> float:
        return statistics.fmean(s.f1 for s in self.samples)

    @property
    def judged(self) -> list[float]:
        """The judge's scores of the samples it decided (1.0 or 0.0)."""
        return [score for s in self.samples if (score := s.judge_score) is not None]

    @property
    def judge(self) -> float | None:
        """Mean verdict over the judged samples; None when none was judged."""
        judged = self.judged
        return statistics.fmean(judged) if judged else None

    @property
    def unjudged(self) -> int:
        """Samples the judge could not decide."""
        return sum(s.judge == "unjudged" for s in self.samples)

    @property
    def correct(self) -> int:
        """Samples with exact match 1, or that the judge called correct (``grader="judge"``)."""
        if self.grader == "judge":
            return int(sum(self.judged))
        return sum(s.em == 1.0 for s in self.samples)

    def pass_at(self, k: int) -> float | None:
        """pass@k over the samples (with the judge: the judged ones; None when fewer than k)."""
        n = len(self.judged) if self.grader == "judge" else len(self.samples)
        return pass_at_k(n, self.correct, k) if n >= k else None

    def to_dict(self) -> dict[str, Any]:
        record = {
            "env": self.env_id,
            "index": self.index,
            "id": self.id,
            "question": self.question,
            "answers": self.answers,
            "em": self.em,
            "f1": self.f1,
            "correct": self.correct,
            "samples": [dataclasses.asdict(s) for s in self.samples],
        }
        if self.answerable is not None:
            record["answerable"] = self.answerable
        if self.grader == "judge":
            record.update(judge=self.judge, unjudged=self.unjudged)
        return record


@dataclass
class EnvResult:
    """The scores of one environment, or the pooled scores of several (``env_id=POOLED``)."""

    env_id: str
    questions: list[QuestionResult]
    samples_per_question: int

    def metrics(self) -> dict[str, float]:
        """EM, F1 and pass@k as fractions; format, error, turn and token statistics; the judge's
        score and unjudged count when judged; MuSiQue's answerability metrics when the questions
        say which are answerable. A metric with nothing to average is NaN."""
        qs, samples = self.questions, [s for q in self.questions for s in q.samples]
        if not qs:
            return {"questions": 0}
        # MuSiQue scores answers on answerable questions only; the others count in the answerability metrics.
        scored = [q for q in qs if q.answerable is not False]
        metrics: dict[str, float] = {
            "questions": len(qs),
            "episodes": len(samples),
            "em": _mean(q.em for q in scored),
            "f1": _mean(q.f1 for q in scored),
        }
        judged = any(q.grader == "judge" for q in qs)
        if judged:
            metrics["judge"] = _mean(score for q in scored if (score := q.judge) is not None)
            metrics["unjudged"] = sum(q.unjudged for q in scored)
        for k in pass_ks(self.samples_per_question):
            metrics[f"pass@{k}"] = _mean(p for q in scored if (p := q.pass_at(k)) is not None)
        metrics.update(
            {
                "format_ok": statistics.fmean(s.format_ok for s in samples),
                "errors": sum(s.status in ("error", "timeout") for s in samples),
                "turns": statistics.fmean(s.turns for s in samples),
                "tool_calls": statistics.fmean(s.tool_calls for s in samples),
                "action_tokens": statistics.fmean(s.action_tokens for s in samples),
                "in_results": statistics.fmean(s.in_results for s in samples),
                "equals_example": statistics.fmean(s.equals_example for s in samples),
                "echoes_question": statistics.fmean(s.echoes_question for s in samples),
                "repeated_answers": statistics.fmean(repeated_answers(qs)),
            }
        )
        if len(scored) < len(qs):
            metrics["unanswerable"] = len(qs) - len(scored)
            metrics.update(answerability(qs))
        return metrics


def repeated_answers(questions: Sequence[QuestionResult]) -> list[bool]:
    """For each sample, in order: is its answer (normalised) also an answer to another of ``questions``?

    A policy that gives one string to every question (a worked example's answer, "yes") scores
    1 on all of them; samples without an answer score 0.
    """
    askers: dict[str, set[int]] = {}
    for i, question in enumerate(questions):
        for sample in question.samples:
            if said := normalize_answer(sample.answer or ""):
                askers.setdefault(said, set()).add(i)
    return [
        len(askers.get(normalize_answer(sample.answer or ""), ())) > 1
        for question in questions
        for sample in question.samples
    ]


def answerability(questions: Sequence[QuestionResult]) -> dict[str, float]:
    """MuSiQue-Full's answerability metric over the answerable/unanswerable pairs of ``questions``.

    MuSiQue's ``GroupAnswerSufficiencyMetric`` (``metrics/group_answer_sufficiency.py`` of
    StonyBrookNLP/musique): a pair is the two rows sharing an id; its sufficiency score is 1 when
    both ``predicted_answerable`` values are right, and its answer score is the answerable row's
    EM/F1 times that. Here sample s of one row meets sample s of the other, and a pair scores the
    mean over s. Returns ``pairs``, ``suff``, ``ans_suff_em``, ``ans_suff_f1`` (NaN without pairs).
    """
    twins: dict[tuple[str, str | None], dict[bool, QuestionResult]] = {}
    for q in questions:
        if q.answerable is not None:
            twins.setdefault((q.env_id, q.id), {})[q.answerable] = q
    suff, em, f1 = [], [], []
    for pair in twins.values():
        if len(pair) < 2:
            continue  # its twin is not among the questions (e.g. cut by --limit)
        answerable, unanswerable = pair[True], pair[False]
        scores = [
            (right, right * a.em, right * a.f1)
            for a, u in zip(answerable.samples, unanswerable.samples)
            for right in [float(a.predicts_answerable and not u.predicts_answerable)]
        ]
        suff.append(statistics.fmean(s for s, _, _ in scores))
        em.append(statistics.fmean(e for _, e, _ in scores))
        f1.append(statistics.fmean(f for _, _, f in scores))
    return {"pairs": len(suff), "suff": _mean(suff), "ans_suff_em": _mean(em), "ans_suff_f1": _mean(f1)}


def _mean(values: Any) -> float:
    values = list(values)
    return statistics.fmean(values) if values else math.nan


@dataclass
class EvalReport:
    """Results per environment and pooled; the trajectories in episode order.

    ``grader`` is what decided right and wrong (``"em"`` or ``"judge"``); ``judge`` names the
    judge model and holds its :class:`~agentenv.judge.JudgeStats` for this evaluation (calls,
    cache hits, tokens, seconds) when there was one.
    """

    envs: dict[str, EnvResult]
    samples: int
    sampling: SamplingParams
    trajectories: list[Trajectory]
    seconds: float = 0.0
    grader: Grader = "em"
    judge: dict[str, Any] | None = None

    @property
    def pooled(self) -> EnvResult:
        """Every question of every environment, each weighing the same (the papers' average)."""
        return EnvResult(POOLED, [q for r in self.envs.values() for q in r.questions], self.samples)

    def rows(self) -> list[tuple[str, dict[str, float]]]:
        """(name, metrics) per environment, then the pooled average when there are several."""
        rows = [(env_id, result.metrics()) for env_id, result in self.envs.items()]
        if len(self.envs) > 1:
            rows.append((POOLED, self.pooled.metrics()))
        return rows

    def table(self) -> str:
        """The results table: EM, F1, pass@k in percent, and episode statistics (the judge's
        score and unjudged count, and MuSiQue's answerability metrics, where there are any); last,
        where the answers came from: found in the tool results, the worked example's, or one also
        given to another question."""
        ks = pass_ks(self.samples)
        rows = self.rows()
        judged = any("judge" in m for _, m in rows)
        paired = any("pairs" in m for _, m in rows)
        head = [
            "env",
            "questions",
            "EM %",
            "F1 %",
            *(["judge %", "unjudged"] if judged else []),
            *(f"pass@{k} %" for k in ks if self.samples > 1),
            *(["Suff %", "AnsSuff EM %", "AnsSuff F1 %"] if paired else []),
            "format ok %",
            "errors",
            "turns",
            "tool calls",
            "action tok",
            "in results %",
            "= example %",
            "echoes q %",
            "repeated %",
        ]
        body = []
        for name, m in rows:
            if "episodes" not in m:
                continue  # an environment without questions
            body.append(
                [
                    name,
                    f"{m['questions']:d}",
                    _percent(m["em"]),
                    _percent(m["f1"]),
                    *([_percent(m["judge"]), f"{m['unjudged']:d}"] if judged else []),
                    *(_percent(m[f"pass@{k}"]) for k in ks if self.samples > 1),
                    *(_percent(m.get(key, math.nan)) for key in ("suff", "ans_suff_em", "ans_suff_f1") if paired),
                    f"{100 * m['format_ok']:.1f}",
                    f"{m['errors']:d}",
                    f"{m['turns']:.2f}",
                    f"{m['tool_calls']:.2f}",
                    f"{m['action_tokens']:.1f}",
                    *(
                        f"{100 * m[key]:.1f}"
                        for key in ("in_results", "equals_example", "echoes_question", "repeated_answers")
                    ),
                ]
            )
        return text_table(head, body)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the sampling setup, metrics per environment and pooled, per-question scores
        (a metric with nothing to average, NaN in :meth:`rows`, is null)."""
        record: dict[str, Any] = {
            "samples": self.samples,
            "sampling": dataclasses.asdict(self.sampling),
            "seconds": self.seconds,
            "grader": self.grader,
            "results": {
                name: {key: None if isinstance(v, float) and math.isnan(v) else v for key, v in metrics.items()}
                for name, metrics in self.rows()
            },
            "questions": [q.to_dict() for r in self.envs.values() for q in r.questions],
        }
        if self.judge is not None:
            record["judge"] = self.judge
        return record


def _percent(value: float) -> str:
    return "-" if math.isnan(value) else f"{100 * value:.2f}"


def build_episodes(
    env_id: str,
    tokenizer: Any,
    *,
    limit: int | None,
    samples: int,
    env_kwargs: Mapping[str, Any] | None = None,
    token_env_kwargs: Mapping[str, Any] | None = None,
) -> list[Episode]:
    """Episodes for the first ``limit`` questions of ``env_id``, ``samples`` each, on forks of one env.

    An env with a task list (the QA envs) is reset with ``options={"index": i}``; any other is
    reset with ``seed=i`` for ``i < limit`` (then ``limit`` is required).
    """
    env = TokenEnv(agentenv.make(env_id, **dict(env_kwargs or {})), tokenizer, **dict(token_env_kwargs or {}))
    tasks = env.tasks
    if tasks is not None:
        count = len(tasks) if limit is None else min(limit, len(tasks))
        return [
            Episode(env.fork(), options={"index": i}, key=(env_id, i, s)) for i in range(count) for s in range(samples)
        ]
    if limit is None:
        raise ValueError(f"{env_id!r} has no task list to go through; pass limit (--limit N) to run N seeded episodes")
    return [Episode(env.fork(), seed=i, key=(env_id, i, s)) for i in range(limit) for s in range(samples)]


async def evaluate(
    engine: Engine,
    tokenizer: Any,
    env_ids: Sequence[str],
    *,
    limit: int | None = None,
    samples: int = 1,
    rollout: RolloutConfig | None = None,
    env_kwargs: Mapping[str, Any] | None = None,
    on_trajectory: Callable[[Trajectory], None] | None = None,
    progress: bool = True,
    judge: Judge | None = None,
) -> EvalReport:
    """Evaluate ``engine`` on the environments ``env_ids``.

    Args:
        engine: The policy.
        tokenizer: Its tokenizer (chat template applied to prompts, observations tokenised).
        env_ids: Registered environment ids (``agentenv.make``); all run in one concurrent pool.
        limit: The first ``limit`` questions of each environment (all when ``None``).
        samples: Samples per question (``> 1`` needs a temperature above 0 and gives pass@k).
        rollout: Loop settings; default greedy decoding with the papers' token limits. Env
            states are not kept (evaluation never branches).
        env_kwargs: Overrides passed to every ``agentenv.make``.
        on_trajectory: Called with each trajectory as soon as its episode ends (e.g. to append
            it to a JSONL file); with a judge, once its answer is judged, the
            :class:`~agentenv.judge.Judgement` in ``info["judge"]``.
        progress: Show the progress (episodes, rate, ETA, running EM) on stderr: a tqdm bar on a
            terminal, a line every 30 s elsewhere (:func:`agents.progress.progress_bar`).
        judge: An LLM judge (``grader="judge"``): each answer is judged while the other episodes
            run, and the judge's verdicts decide ``judge`` and pass@k. Only for environments
            with a task list (questions and gold answers).
    """
    from agents.progress import progress_bar

    rollout = dataclasses.replace(rollout or RolloutConfig(sampling=SamplingParams(temperature=0)), keep_states=False)
    _check_request(env_ids, limit, samples, rollout, judge)
    episodes = [
        e
        for env_id in env_ids
        for e in build_episodes(env_id, tokenizer, limit=limit, samples=samples, env_kwargs=env_kwargs)
    ]
    collected = _Collected(_task_lists(episodes, judge), judge, on_trajectory)
    judge_before = judge.stats.as_dict() if judge is not None else {}  # a judge may serve several evaluations
    start = time.perf_counter()
    try:
        with progress_bar("eval", len(episodes), unit="episodes", show=progress) as bar:
            async for trajectory in stream_episodes(engine, episodes, rollout):
                episodes[trajectory.index].env.close()  # its fork may hold tools with processes (sandboxes)
                collected.add(trajectory)
                bar.update(1)
                bar.set_postfix(
                    EM=f"{100 * collected.correct / len(collected.trajectories):.1f}%",
                    errors=collected.failed,
                    refresh=False,
                )
        await asyncio.gather(*collected.judging)
    finally:
        for pending in collected.judging:
            pending.cancel()  # only those still running: an interrupted evaluation leaves no call behind
    judge_record = None
    if judge is not None:
        judge_record = {"model": judge.model, **{k: v - judge_before[k] for k, v in judge.stats.as_dict().items()}}
    return EvalReport(
        collected.results(env_ids, samples),
        samples,
        rollout.sampling,
        sorted(collected.trajectories, key=lambda t: t.index),
        seconds=time.perf_counter() - start,
        grader=collected.grader,
        judge=judge_record,
    )


def _check_request(
    env_ids: Sequence[str], limit: int | None, samples: int, rollout: RolloutConfig, judge: Judge | None
) -> None:
    """Refuse an evaluation that cannot run or would measure nothing, saying why."""
    if not env_ids:
        raise ValueError("evaluate needs at least one environment id")
    if samples < 1:
        raise ValueError(f"samples must be >= 1, got {samples}")
    if limit is not None and limit < 1:
        raise ValueError(f"limit must be >= 1 (or None for every question), got {limit}")
    if samples > 1 and rollout.sampling.greedy:
        raise ValueError(
            f"samples={samples} with greedy decoding would repeat one answer {samples} times; "
            "set a temperature above 0 (e.g. --temperature 1.0) for pass@k"
        )
    if len(set(env_ids)) != len(env_ids):
        raise ValueError(f"an environment id is listed twice: {list(env_ids)}")
    if judge is not None and not isinstance(judge, Judge):
        raise TypeError(f"judge must be an agentenv.judge.Judge (see agents.eval.judge.engine_judge), got {judge!r}")


def _task_lists(episodes: Sequence[Episode], judge: Judge | None) -> dict[str, Sequence[Example] | None]:
    """Each environment's task list (``None``: it has none, which a judge refuses)."""
    tasks: dict[str, Sequence[Example] | None] = {}
    for episode in episodes:
        env_id = episode.key[0]
        if env_id not in tasks:
            tasks[env_id] = episode.env.tasks
            if judge is not None and tasks[env_id] is None:
                raise ValueError(
                    f"the judge compares answers with gold answers, and {env_id!r} has no task list of questions "
                    "and answers; judge a QA environment (e.g. multihop-qa, web-research) or grade by EM"
                )
    return tasks


class _Collected:
    """The questions, samples and trajectories of an evaluation, added as the episodes end.

    With a judge, each answerable question's answer is judged in a task of ``judging`` while the
    other episodes run; ``on_trajectory`` gets a trajectory once it is final (judged, if it is to be).
    """

    def __init__(
        self,
        tasks: Mapping[str, Sequence[Example] | None],
        judge: Judge | None,
        on_trajectory: Callable[[Trajectory], None] | None,
    ) -> None:
        self.tasks, self.judge, self.on_trajectory = tasks, judge, on_trajectory
        self.grader: Grader = "judge" if judge is not None else "em"
        self.questions: dict[tuple[str, int], QuestionResult] = {}
        self.slots: dict[tuple[str, int], dict[int, Sample]] = {}  # each question's samples by sample number
        self.trajectories: list[Trajectory] = []
        self.judging: list[asyncio.Task[None]] = []
        self.correct = self.failed = 0

    def add(self, trajectory: Trajectory) -> None:
        """Record one ended episode: its question, its sample, and its answer to judge."""
        env_id, index, number = trajectory.key
        sample = Sample.of(trajectory)
        env_tasks = self.tasks[env_id]
        task = env_tasks[index] if env_tasks is not None else None
        answerable = task.meta.get("answerable") if task is not None else None
        self.questions.setdefault(
            (env_id, index),
            QuestionResult(
                env_id,
                index,
                trajectory.info.get("id"),
                trajectory.info.get("question"),
                list(trajectory.info.get("answers") or []),
                answerable=answerable if isinstance(answerable, bool) else None,
                grader=self.grader,
            ),
        )
        self.slots.setdefault((env_id, index), {})[number] = sample
        self.trajectories.append(trajectory)
        # The judge scores answerable questions only (the others count in MuSiQue's answerability).
        if self.judge is not None and task is not None and answerable is not False:
            self.judging.append(asyncio.ensure_future(self._judged(trajectory, task)))
        elif self.on_trajectory is not None:
            self.on_trajectory(trajectory)
        self.correct += sample.em == 1.0
        self.failed += not trajectory.ok

    async def _judged(self, trajectory: Trajectory, task: Example) -> None:
        """Judge one answer, then record the verdict with the sample and the trajectory."""
        assert self.judge is not None
        env_id, index, number = trajectory.key
        sample = self.slots[env_id, index][number]
        verdict: Judgement = await self.judge.judge(task.question, task.answers, sample.answer)
        self.slots[env_id, index][number] = dataclasses.replace(
            sample, judge=verdict.verdict, judge_detail=verdict.detail
        )
        trajectory.info["judge"] = verdict.as_dict()
        if self.on_trajectory is not None:
            self.on_trajectory(trajectory)

    def results(self, env_ids: Sequence[str], samples: int) -> dict[str, EnvResult]:
        """Each environment's questions in task order, each with its samples in sample order."""
        for key, question in self.questions.items():
            question.samples = [self.slots[key][number] for number in sorted(self.slots[key])]
        return {
            env_id: EnvResult(
                env_id,
                sorted((q for (e, _), q in self.questions.items() if e == env_id), key=lambda q: q.index),
                samples,
            )
            for env_id in env_ids
        }


def transcript(trajectory: Trajectory, tokenizer: Any) -> str:
    """A readable episode: the prompt, each turn's model action and env observation, the grade."""

    def decode(ids: Sequence[int]) -> str:
        return tokenizer.decode(list(ids), skip_special_tokens=False)

    parts = [f"--- prompt ({len(trajectory.prompt_ids)} tokens)", decode(trajectory.prompt_ids)]
    for number, turn in enumerate(trajectory.turns, 1):
        stop = f", stopped at {turn.stop_reason!r}" if turn.stop_reason is not None else ""
        parts += [
            f"--- turn {number}: model ({len(turn.action_ids)} tokens, {turn.finish_reason}{stop})",
            decode(turn.action_ids),
        ]
        if turn.obs_ids:
            parts += [f"--- turn {number}: environment ({len(turn.obs_ids)} tokens)", decode(turn.obs_ids)]
    grade = trajectory.info.get("grade") or {}
    ending = f"--- {trajectory.status}: reward {trajectory.reward:g}"
    if grade:
        ending += f", answer {grade.get('answer')!r}, gold {trajectory.info.get('answers')}, EM {grade.get('em'):g}, F1 {grade.get('f1'):.2f}"
    verdict = trajectory.info.get("judge")
    if verdict:
        ending += f", judge {verdict['verdict']}" + (f" ({verdict['detail']})" if verdict.get("detail") else "")
    if trajectory.error:
        ending += f", error: {trajectory.error}"
    return "\n".join([*parts, ending])


def sampler_logprob_gap(model: Any, trajectories: Sequence[Trajectory], temperature: float = 1.0) -> tuple[float, int]:
    """Largest |sampler log-prob − a fresh forward pass of ``model``| over all action tokens, and their count.

    The token-in-token-out check: the trainer recomputes log-probs on exactly the saved ids.
    ``temperature`` is the one the trajectories were sampled at (greedy sampling reports
    temperature-1 log-probs, so 1 for greedy runs).
    """
    import torch

    from agents.training.scoring import score_tokens

    gap, count = 0.0, 0
    for trajectory in trajectories:
        ids, mask, logprobs = trajectory.ids, trajectory.mask, trajectory.sampler_logprobs
        positions = [t for t, m in enumerate(mask) if m]
        if not positions:
            continue
        tokens = torch.tensor([ids], device=model.device)
        with torch.inference_mode():
            scores, _ = score_tokens(model(tokens).logits, tokens, temperature)
        fresh = scores[0, [t - 1 for t in positions]].cpu()  # scores[:, t - 1] belongs to token t
        sampled = torch.tensor([logprobs[t] for t in positions], dtype=torch.float32)
        # NaN (a broken sampler) counts as an infinite gap; max() would silently skip it.
        gap = max(gap, (fresh - sampled).abs().nan_to_num(nan=math.inf).max().item())
        count += len(positions)
    return gap, count
