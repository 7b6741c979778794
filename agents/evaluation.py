"""Evaluation of a policy on registered environments: EM, F1, pass@k and the papers' pooled average.

Each question is posed ``samples`` times through the rollout loop (greedy decoding by default,
as in the papers' evaluations; sampled decoding for pass@k). Scores come from the env's grade
(``info["grade"]``: SQuAD-normalised exact match and word F1 of the final ``\\boxed{}`` answer);
an episode without a grade (an error, a timeout, the token budget) scores 0.

- EM and F1 of an environment: mean over its questions of the mean over their samples.
- pass@k: the unbiased estimator of Chen et al. 2021 (Codex, eq. 1) per question, averaged.
- The pooled average over several environments weighs every question equally (the "average"
  of the AT²PO and AEPO tables), not every environment.

Example::

    report = await evaluate(engine, tokenizer, ["multihop-qa", "singlehop-qa"], limit=20)
    print(report.table())
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import agentenv
from agentenv.wrappers import TokenEnv
from agents.engines.base import Engine, SamplingParams
from agents.rollout import Episode, RolloutConfig, Trajectory, stream_episodes

__all__ = [
    "EnvResult",
    "EvalReport",
    "QuestionResult",
    "Sample",
    "build_episodes",
    "evaluate",
    "pass_at_k",
    "pass_ks",
    "sampler_logprob_gap",
    "transcript",
]

POOLED = "average (pooled)"


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
        )


@dataclass
class QuestionResult:
    """All samples of one question."""

    env_id: str
    index: int
    id: str | None
    question: str | None
    answers: list[str]
    samples: list[Sample] = field(default_factory=list)

    @property
    def em(self) -> float:
        return statistics.fmean(s.em for s in self.samples)

    @property
    def f1(self) -> float:
        return statistics.fmean(s.f1 for s in self.samples)

    @property
    def correct(self) -> int:
        """Samples with exact match 1."""
        return sum(s.em == 1.0 for s in self.samples)

    def pass_at(self, k: int) -> float:
        return pass_at_k(len(self.samples), self.correct, k)

    def to_dict(self) -> dict[str, Any]:
        return {
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


@dataclass
class EnvResult:
    """The scores of one environment, or the pooled scores of several (``env_id=POOLED``)."""

    env_id: str
    questions: list[QuestionResult]
    samples_per_question: int

    def metrics(self) -> dict[str, float]:
        """EM, F1 and pass@k as fractions; format, error, turn and token statistics."""
        qs, samples = self.questions, [s for q in self.questions for s in q.samples]
        if not qs:
            return {"questions": 0}
        metrics: dict[str, float] = {
            "questions": len(qs),
            "episodes": len(samples),
            "em": statistics.fmean(q.em for q in qs),
            "f1": statistics.fmean(q.f1 for q in qs),
        }
        for k in pass_ks(self.samples_per_question):
            metrics[f"pass@{k}"] = statistics.fmean(q.pass_at(k) for q in qs)
        metrics.update(
            {
                "format_ok": statistics.fmean(s.format_ok for s in samples),
                "errors": sum(s.status in ("error", "timeout") for s in samples),
                "turns": statistics.fmean(s.turns for s in samples),
                "tool_calls": statistics.fmean(s.tool_calls for s in samples),
                "action_tokens": statistics.fmean(s.action_tokens for s in samples),
            }
        )
        return metrics


@dataclass
class EvalReport:
    """Results per environment and pooled; the trajectories in episode order."""

    envs: dict[str, EnvResult]
    samples: int
    sampling: SamplingParams
    trajectories: list[Trajectory]
    seconds: float = 0.0

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
        """The results table: EM, F1, pass@k in percent, and episode statistics."""
        ks = pass_ks(self.samples)
        head = [
            "env",
            "questions",
            "EM %",
            "F1 %",
            *(f"pass@{k} %" for k in ks if self.samples > 1),
            "format ok %",
            "errors",
            "turns",
            "tool calls",
            "action tok",
        ]
        body = []
        for name, m in self.rows():
            body.append(
                [
                    name,
                    f"{m['questions']:d}",
                    f"{100 * m['em']:.2f}",
                    f"{100 * m['f1']:.2f}",
                    *(f"{100 * m[f'pass@{k}']:.2f}" for k in ks if self.samples > 1),
                    f"{100 * m['format_ok']:.1f}",
                    f"{m['errors']:d}",
                    f"{m['turns']:.2f}",
                    f"{m['tool_calls']:.2f}",
                    f"{m['action_tokens']:.1f}",
                ]
            )
        widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head))]
        lines = [
            "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
            for row in [head, *body]
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the sampling setup, metrics per environment and pooled, per-question scores."""
        return {
            "samples": self.samples,
            "sampling": dataclasses.asdict(self.sampling),
            "seconds": self.seconds,
            "results": {name: metrics for name, metrics in self.rows()},
            "questions": [q.to_dict() for r in self.envs.values() for q in r.questions],
        }


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
    tasks = getattr(env, "tasks", None)
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
            it to a JSONL file).
        progress: Show a progress bar (episodes, rate, ETA, running EM) on stderr.
    """
    from tqdm.auto import tqdm

    rollout = dataclasses.replace(rollout or RolloutConfig(sampling=SamplingParams(temperature=0)), keep_states=False)
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

    episodes = [
        e
        for env_id in env_ids
        for e in build_episodes(env_id, tokenizer, limit=limit, samples=samples, env_kwargs=env_kwargs)
    ]
    questions: dict[tuple[str, int], QuestionResult] = {}
    trajectories: list[Trajectory] = []
    start = time.perf_counter()
    correct = failed = 0
    with tqdm(
        total=len(episodes), desc="eval", unit="episode", file=sys.stderr, disable=not progress, dynamic_ncols=True
    ) as bar:
        async for trajectory in stream_episodes(engine, episodes, rollout):
            env_id, index, _ = trajectory.key
            sample = Sample.of(trajectory)
            question = questions.setdefault(
                (env_id, index),
                QuestionResult(
                    env_id,
                    index,
                    trajectory.info.get("id"),
                    trajectory.info.get("question"),
                    list(trajectory.info.get("answers") or []),
                ),
            )
            question.samples.append(sample)
            trajectories.append(trajectory)
            episodes[trajectory.index].env.close()  # its fork may hold tools with processes (sandboxes)
            if on_trajectory is not None:
                on_trajectory(trajectory)
            correct += sample.em == 1.0
            failed += not trajectory.ok
            bar.update(1)
            bar.set_postfix(EM=f"{100 * correct / len(trajectories):.1f}%", errors=failed, refresh=False)
    trajectories.sort(key=lambda t: t.index)
    envs = {
        env_id: EnvResult(
            env_id, sorted((q for (e, _), q in questions.items() if e == env_id), key=lambda q: q.index), samples
        )
        for env_id in env_ids
    }
    return EvalReport(envs, samples, rollout.sampling, trajectories, seconds=time.perf_counter() - start)


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
        ids, mask, logprobs = trajectory.ids, trajectory.mask, trajectory.logprobs
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
