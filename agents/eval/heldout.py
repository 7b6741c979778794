"""Evaluation on held-out questions during training: scores with confidence intervals, their log and plot.

A training run keeps the first ``holdout`` tasks of its environment out of training and scores
the policy on them before training, every ``eval_every`` steps and after the last step:
greedy decoding, no tree, the papers' evaluation (:func:`agents.eval.evaluation.evaluate`). Each
score comes with a 95% confidence interval over the questions: the Wilson interval for a
proportion (EM, format adherence), the normal interval of a mean otherwise (F1, reward), kept
inside the score's range (F1's [0, 1]), so that a change between two evaluations can be told
from noise.

Results go to ``heldout/metrics.jsonl`` in the run folder (and to the run's reporters:
TensorBoard under ``heldout/tensorboard/``, the run's W&B run as ``heldout/em``, …), one record per
evaluation with ``em``, ``em_low``, ``em_high``, … (see :data:`SCORES`), and are drawn into
``heldout.png``; each question's scores go to ``heldout/questions.jsonl``, one line per evaluation.

Two evaluations of the same questions (two checkpoints, before and after a stage) are compared
question by question: :func:`paired_difference` is the mean of the differences with a bootstrap
95% interval, far narrower than two independent intervals when the questions' difficulty varies
more than the change (``agents compare RUN_A RUN_B`` prints it for every score).
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from agentenv.tool_env import ECHO_WORDS
from agents.engines.base import Engine, SamplingParams
from agents.eval.evaluation import evaluate, repeated_answers
from agents.eval.tables import text_table
from agents.rollout import RolloutConfig
from agents.rollout.tree_loop import TreeConfig
from agents.training.metrics import FRACTION, Display, MetricsLog, label_axis, save_figure

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.container import ErrorbarContainer
    from matplotlib.figure import Figure

    from agents.run.config import TrainConfig

__all__ = [
    "PAIRED_SCORES",
    "SCORES",
    "SCORE_DISPLAY",
    "HeldOut",
    "HeldOutEvaluation",
    "HeldOutLog",
    "Score",
    "comparison_table",
    "draw_scores",
    "evaluate_heldout",
    "greedy_rollout",
    "heldout_request",
    "interval",
    "paired_difference",
    "paired_line",
    "paired_table",
    "read_evaluation",
]

#: The scores of a held-out evaluation and how they are read from each episode.
SCORES: dict[str, str] = {
    "em": "exact match of the final answer",
    "f1": "word F1 of the final answer",
    "format_ok": "answer given in the required format",
    "reward": "the environment's reward (the training reward)",
    "tool_calls": "tool calls in the episode",
    "in_results": "answer found in what the episode's tools returned",
    "equals_example": "answer equal to the worked example's (copied from the prompt)",
    "echoes_question": f"answer repeating the question ({ECHO_WORDS} consecutive words of it)",
    "repeated": "answer also given to another held-out question",
}
#: How each score is drawn in ``heldout.png``: the panel's title, the unit and the score's range,
#: which its interval stays inside (the reward's is the reward scheme's, not known here).
SCORE_DISPLAY: dict[str, Display] = {
    "em": Display("exact match", "fraction of questions", FRACTION),
    "f1": Display("word F1", "mean F1 (0 to 1)", FRACTION),
    "format_ok": Display("answer format followed", "fraction of questions", FRACTION),
    "reward": Display("reward", "mean reward"),
    "tool_calls": Display("tool calls", "mean per episode", (0.0, math.inf)),
    "in_results": Display("answer in tool results", "fraction of questions", FRACTION),
    "equals_example": Display("answer = worked example's", "fraction of questions", FRACTION),
    "echoes_question": Display("answer repeats the question", "fraction of questions", FRACTION),
    "repeated": Display("answer given to another question", "fraction of questions", FRACTION),
}
PANELS_PER_ROW = 3  # of heldout.png: nine scores, three rows
Z_95 = 1.959963984540054  # two-sided 95% quantile of the standard normal
#: The scores :func:`paired_table` compares (the others describe where answers came from).
PAIRED_SCORES = ("f1", "em", "format_ok", "reward", "tool_calls")
BOOTSTRAP_RESAMPLES = 10_000  # Efron & Tibshirani's order for a 95% interval's end points
QUESTIONS_FILE = "questions.jsonl"  # in the run folder's heldout/


@dataclass(frozen=True)
class Score:
    """A mean over questions with its 95% confidence interval ``[low, high]``."""

    mean: float
    low: float
    high: float

    def __str__(self) -> str:
        return f"{self.mean:.3f} [{self.low:.3f}, {self.high:.3f}]"


def interval(values: Sequence[float], bounds: tuple[float, float] | None = None) -> Score:
    """The mean of ``values`` with a 95% confidence interval.

    Values that are all 0 or 1 are a proportion: Wilson score interval (Wilson 1927), which
    stays inside [0, 1] and is not empty at 0 or 1. Otherwise the normal interval
    ``mean ± z·s/√n`` with the sample standard deviation ``s``, clipped to ``bounds``, the range
    the values can take (F1's [0, 1]): the mean cannot leave it, but the symmetric normal
    interval does near its ends (F1 0.06 over 8 questions: [-0.06, 0.18]). A single value's
    interval is the whole of ``bounds`` (unbounded without them).
    """
    n = len(values)
    if n == 0:
        raise ValueError("a confidence interval needs at least one value")
    mean = math.fsum(values) / n
    if all(v in (0.0, 1.0) for v in values):
        # Wilson: (p + z²/2n ± z·√(p(1−p)/n + z²/4n²)) / (1 + z²/n)
        z2 = Z_95 * Z_95
        centre = (mean + z2 / (2 * n)) / (1 + z2 / n)
        half = Z_95 * math.sqrt(mean * (1 - mean) / n + z2 / (4 * n * n)) / (1 + z2 / n)
        # It holds the mean; at 0 or 1, rounding can put centre - half a hair above it (1e-17 at n = 48).
        return Score(mean, min(mean, max(0.0, centre - half)), max(mean, min(1.0, centre + half)))
    half = Z_95 * statistics.stdev(values) / math.sqrt(n) if n > 1 else math.inf  # mean ± z·s/√n
    low, high = bounds if bounds is not None else (-math.inf, math.inf)
    return Score(mean, max(low, mean - half), min(high, mean + half))


@dataclass(frozen=True)
class HeldOut:
    """The held-out scores of the policy after ``step`` training steps (0: before training)."""

    step: int
    questions: int
    scores: dict[str, Score]
    seconds: float
    per_question: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    tasks: list[int] = dataclasses.field(default_factory=list)

    def record(self) -> dict[str, float]:
        """Flat numbers for :class:`~agents.training.metrics.MetricsLog`: ``em``, ``em_low``, ``em_high``, …"""
        record = {"questions": float(self.questions), "seconds": self.seconds}
        for name, score in self.scores.items():
            record.update({name: score.mean, f"{name}_low": score.low, f"{name}_high": score.high})
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, float]) -> HeldOut:
        """The inverse of :meth:`record` (a record read back from ``metrics.jsonl``)."""
        scores = {
            name: Score(record[name], record[f"{name}_low"], record[f"{name}_high"])
            for name in SCORES
            if name in record
        }
        return cls(int(record["step"]), int(record["questions"]), scores, float(record["seconds"]))


def greedy_rollout(tree: TreeConfig) -> RolloutConfig:
    """The evaluation's rollout for a run that trains with ``tree``: the same limits, greedy, no tree."""
    sampling = SamplingParams(temperature=0.0, max_new_tokens=tree.rollout.sampling.max_new_tokens)
    return dataclasses.replace(tree.rollout, sampling=sampling, keep_states=False)


def heldout_request(config: TrainConfig, tree: TreeConfig, step: int, *, progress: bool = True) -> dict[str, Any]:
    """The arguments of :func:`evaluate_heldout` but its engine and tokenizer, for a run of ``config``
    whose rollouts use ``tree``: the env's first ``eval_questions`` tasks with the run's options, greedy
    within the tree's limits, an episode cut by the budget scored as training scores it."""
    return {
        "env_id": config.env,
        "questions": config.eval_questions,
        "rollout": greedy_rollout(tree),
        "step": step,
        "env_kwargs": config.env_kwargs,
        "budget_reward": config.budget_reward,
        "progress": progress,
    }


async def evaluate_heldout(
    engine: Engine,
    tokenizer: Any,
    env_id: str,
    *,
    questions: int,
    rollout: RolloutConfig,
    step: int,
    env_kwargs: Mapping[str, Any] | None = None,
    budget_reward: float | None = None,
    progress: bool = True,
) -> HeldOut:
    """Score the engine's policy on the first ``questions`` tasks of ``env_id`` (one greedy sample each).

    ``budget_reward`` is the reward of an episode cut by the token budget, as training gives it
    (``TrainConfig.budget_reward``); ``None`` keeps the environment's (0 for an unfinished episode).
    """
    report = await evaluate(
        engine, tokenizer, [env_id], limit=questions, rollout=rollout, env_kwargs=env_kwargs, progress=progress
    )
    questions_asked = report.envs[env_id].questions
    samples = [sample for question in questions_asked for sample in question.samples]
    rewards = [budget_reward if budget_reward is not None and s.status == "budget" else s.reward for s in samples]
    columns = {
        "em": [s.em for s in samples],
        "f1": [s.f1 for s in samples],
        "format_ok": [float(s.format_ok) for s in samples],
        "reward": rewards,
        "tool_calls": [float(s.tool_calls) for s in samples],
        "in_results": [float(s.in_results) for s in samples],
        "equals_example": [float(s.equals_example) for s in samples],
        "echoes_question": [float(s.echoes_question) for s in samples],
        "repeated": [float(r) for r in repeated_answers(questions_asked)],
    }
    scores = {name: interval(values, SCORE_DISPLAY[name].bounds) for name, values in columns.items()}
    tasks = [question.index for question in questions_asked for _ in question.samples]
    return HeldOut(step, len(samples), scores, report.seconds, columns, tasks)


class HeldOutLog:
    """The held-out evaluations of a run: ``heldout/metrics.jsonl``, the reporters and ``heldout.png``.

    Args:
        out_dir: The run folder (``None``: keep them in memory).
        resume_step: Continuing a run from this step: evaluations after it are dropped.
        report_to: Reporters besides the JSONL file (see :class:`~agents.training.metrics.MetricsLog`):
            TensorBoard under ``heldout/tensorboard/``; W&B in the run folder's W&B run, the one the
            trainer's metrics go to in this process, as ``heldout/...``.
        wandb_project: The W&B project (``None``: ``$WANDB_PROJECT``, else ``agentenv``).
    """

    def __init__(
        self,
        out_dir: str | Path | None,
        *,
        resume_step: int | None = None,
        report_to: str | Sequence[str] = ("tensorboard",),
        wandb_project: str | None = None,
    ) -> None:
        self.out_dir = None if out_dir is None else Path(out_dir)
        self._log = MetricsLog(
            None if self.out_dir is None else self.out_dir / "heldout",
            resume_step=resume_step,
            report_to=report_to,
            run_dir=self.out_dir,
            wandb_project=wandb_project,
        )
        self.results = [HeldOut.from_record(record) for record in self._log.history]
        self.questions_path = None if self.out_dir is None else self.out_dir / "heldout" / QUESTIONS_FILE
        if self.questions_path is not None and self.questions_path.is_file():
            kept = [] if resume_step is None else _read_lines(self.questions_path)
            kept = [record for record in kept if record["step"] <= (resume_step or 0)]
            self.questions_path.write_text("".join(json.dumps(record) + "\n" for record in kept), encoding="utf-8")

    def add(self, result: HeldOut, *, plot_title: str | None = None) -> None:
        """Record an evaluation and redraw the plot (headed ``plot_title``, e.g. the run's name)."""
        self._log.log(result.step, result.record())
        if self.questions_path is not None and result.per_question:
            line = {"step": result.step, "tasks": result.tasks, **result.per_question}
            with self.questions_path.open("a", encoding="utf-8") as file:
                file.write(json.dumps(line) + "\n")
        self.results.append(result)
        if self.out_dir is not None:
            self.plot(self.out_dir / "heldout.png", title=plot_title)

    def figure(self, *, title: str | None = None) -> Figure:
        """Each score at each evaluated step: a point with its 95% interval, headed ``title``.

        Points, not a line: between two evaluations nothing was measured. Four panels a row; a
        score that an evaluation did not record (a run logged before it existed) has no point there.
        """
        from matplotlib.figure import Figure

        rows = math.ceil(len(SCORE_DISPLAY) / PANELS_PER_ROW)
        figure = Figure(figsize=(4.2 * PANELS_PER_ROW, 3.0 * rows), layout="constrained")
        figure.suptitle(f"{title}: held-out scores, 95% intervals" if title else "held-out scores, 95% intervals")
        for axis, (name, display) in zip(figure.subplots(rows, PANELS_PER_ROW).flat, SCORE_DISPLAY.items()):
            kept = [result for result in self.results if name in result.scores]
            draw_scores(
                axis, [result.step for result in kept], [result.scores[name] for result in kept], display.bounds
            )
            label_axis(axis, display.name, display.unit)
        return figure

    def plot(self, path: str | Path, *, title: str | None = None) -> Path:
        """Draw :meth:`figure` as a PNG at ``path``; returns ``path``."""
        return save_figure(self.figure(title=title), path)

    def close(self) -> None:
        """Close the reporters."""
        self._log.close()


class HeldOutEvaluation:
    """A run's held-out evaluation at a step: :func:`heldout_request` scored by ``evaluate`` (an
    engine here, or a rollout worker), added to ``log`` and its plot, and noted in one line.

    ``agents train`` runs it before training, every ``eval_every`` steps and after the last;
    ``agents sft`` before its first step and after its last. Nothing is scored when the run's
    ``eval_questions`` is 0.
    """

    def __init__(
        self,
        config: TrainConfig,
        tree: TreeConfig,
        evaluate: Callable[[dict[str, Any]], Awaitable[HeldOut]],
        log: HeldOutLog,
        progress: bool | None,
        note: Callable[[str], None],
        plot_title: str,
    ) -> None:
        self.config, self.tree, self.evaluate, self.log, self.note = config, tree, evaluate, log, note
        self.plot_title = plot_title
        self.progress = progress is not False  # None: shown, as a bar or as lines (agents.progress)

    async def run(self, step: int) -> None:
        if not self.config.eval_questions:
            return
        result = await self.evaluate(heldout_request(self.config, self.tree, step, progress=self.progress))
        self.log.add(result, plot_title=self.plot_title)
        scores = ", ".join(f"{name} {score}" for name, score in result.scores.items())
        self.note(f"step {step}: held-out ({result.questions} questions of {self.config.env}) {scores}")


def draw_scores(
    axis: Axes,
    x: Sequence[float],
    scores: Sequence[Score],
    bounds: tuple[float, float] | None,
    **style: Any,
) -> ErrorbarContainer:
    """Draw ``scores`` at ``x`` as points with capped 95% interval bars, unconnected.

    With ``bounds`` (a proportion's [0, 1]) the y-axis shows the whole range, so that scores of
    panels and of runs compare at a glance. ``style`` goes to ``Axes.errorbar`` (``color``, ``label``).
    """
    means = [score.mean for score in scores]
    errors = [[m - s.low for m, s in zip(means, scores)], [s.high - m for m, s in zip(means, scores)]]
    container = axis.errorbar(x, means, yerr=errors, fmt="o", capsize=4, **style)
    if bounds is not None and math.isfinite(bounds[1] - bounds[0]):
        margin = 0.05 * (bounds[1] - bounds[0])  # points and caps at 0 or 1 stay clear of the frame
        axis.set_ylim(bounds[0] - margin, bounds[1] + margin)
    return container


def comparison_table(results: Sequence[HeldOut], labels: Sequence[str] | None = None) -> str:
    """A table of held-out scores, one column per evaluation (e.g. before and after training).

    One row per score of :data:`SCORES`, each cell the mean with its 95% interval: percentages
    for the proportions and F1, the mean for the reward and tool calls; "–" where an evaluation
    did not record the score.
    """
    labels = list(labels) if labels is not None else [f"step {result.step}" for result in results]
    if len(labels) != len(results):
        raise ValueError(f"{len(labels)} labels for {len(results)} results")

    def cell(score: Score | None, display: Display) -> str:
        if score is None:
            return "–"
        if display.bounds == FRACTION:
            return f"{100 * score.mean:.1f} [{100 * score.low:.1f}, {100 * score.high:.1f}]"
        sign = "" if display.bounds is not None and display.bounds[0] >= 0 else "+"  # a reward can be negative
        return f"{score.mean:{sign}.2f} [{score.low:{sign}.2f}, {score.high:{sign}.2f}]"

    head = ["held-out score", *labels]
    body = [["questions", *(str(result.questions) for result in results)]]
    for name, display in SCORE_DISPLAY.items():
        unit = " %" if display.bounds == FRACTION else ""
        body.append([display.name + unit, *(cell(result.scores.get(name), display) for result in results)])
    return text_table(head, body)


def _read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def read_evaluation(spec: str | Path) -> HeldOut:
    """A held-out evaluation saved in a run folder, with each question's scores: ``RUN`` (its last
    evaluation) or ``RUN@STEP`` (the one after ``STEP`` steps; 0 is before training).

    Raises:
        FileNotFoundError: the folder has no held-out evaluation with question scores, or none at ``STEP``.
    """
    text = str(spec)
    folder, _, step_text = text.rpartition("@") if "@" in text else (text, "", "")
    if step_text and not step_text.isdigit():
        raise ValueError(f"{text!r}: the part after @ must be a step number (RUN@STEP), got {step_text!r}")
    path = Path(folder) / "heldout" / QUESTIONS_FILE
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} does not exist: {folder} holds no held-out evaluation with per-question scores (runs of "
            "agents train and agents sft write one when --eval-questions > 0)"
        )
    lines = _read_lines(path)
    step = int(step_text) if step_text else lines[-1]["step"]
    chosen = [line for line in lines if line["step"] == step]
    if not chosen:
        raise FileNotFoundError(f"{path} has no evaluation at step {step}; it has steps {[x['step'] for x in lines]}")
    summary = next(r for r in reversed(_read_lines(Path(folder) / "heldout" / "metrics.jsonl")) if r["step"] == step)
    line = chosen[-1]
    per_question = {name: line[name] for name in SCORES if name in line}
    return dataclasses.replace(HeldOut.from_record(summary), per_question=per_question, tasks=line["tasks"])


def paired_difference(
    before: Sequence[float], after: Sequence[float], *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = 0
) -> Score:
    """The mean of ``after[i] − before[i]`` over the questions, with a 95% bootstrap interval (BCa,
    Efron 1987, by :func:`scipy.stats.bootstrap`, resampling questions; seeded, so it repeats).

    Pairing removes what the two evaluations share, the questions' own difficulty: at 48 questions
    the independent intervals of the main job's F1 are ±9 points wide, the paired one of a change of
    a few questions a few points. Differences that are all equal (no question changed) have that
    difference as their interval.
    """
    if len(before) != len(after) or not before:
        raise ValueError(
            f"a paired difference needs two equally long, non-empty lists; got {len(before)} and {len(after)}"
        )
    differences = [b - a for a, b in zip(before, after)]
    mean = math.fsum(differences) / len(differences)
    if max(differences) == min(differences):
        return Score(mean, mean, mean)
    from scipy.stats import bootstrap  # imported here: scipy is slow to import and only this needs it

    result = bootstrap(
        (differences,), statistic=np.mean, n_resamples=resamples, confidence_level=0.95, random_state=seed
    )
    low, high = result.confidence_interval
    return Score(mean, min(mean, float(low)), max(mean, float(high)))


def paired_table(
    before: HeldOut, after: HeldOut, labels: tuple[str, str] = ("before", "after")
) -> tuple[str, dict[str, Any]]:
    """Each score of :data:`PAIRED_SCORES` in ``before`` and ``after`` (evaluations of the same questions) and
    their paired difference (:func:`paired_difference`): the text table and the numbers.

    Raises:
        ValueError: the two evaluations asked different questions, or one lacks per-question scores.
    """
    if not before.per_question or not after.per_question:
        raise ValueError("both evaluations need per-question scores (heldout/questions.jsonl)")
    if before.tasks != after.tasks:
        raise ValueError(
            f"the evaluations asked different questions ({len(before.tasks)} and {len(after.tasks)}, "
            f"first {before.tasks[:3]} and {after.tasks[:3]}); compare evaluations of the same held-out set"
        )
    head = ["held-out score", labels[0], labels[1], f"{labels[1]} − {labels[0]} [paired 95%]"]
    body, numbers = [["questions", str(before.questions), str(after.questions), ""]], {}
    for name in PAIRED_SCORES:
        if name not in before.per_question or name not in after.per_question:
            continue
        display = SCORE_DISPLAY[name]
        scale, unit = _scale(name)
        a, b = before.per_question[name], after.per_question[name]
        mean_a, mean_b, diff = statistics.fmean(a), statistics.fmean(b), paired_difference(a, b)
        numbers[name] = {
            labels[0]: mean_a,
            labels[1]: mean_b,
            "difference": diff.mean,
            "difference_low": diff.low,
            "difference_high": diff.high,
        }
        body.append(
            [
                display.name + unit,
                f"{scale * mean_a:.1f}" if scale > 1 else f"{mean_a:.2f}",
                f"{scale * mean_b:.1f}" if scale > 1 else f"{mean_b:.2f}",
                f"{scale * diff.mean:+.1f} [{scale * diff.low:+.1f}, {scale * diff.high:+.1f}]",
            ]
        )
    return text_table(head, body), numbers


def paired_line(numbers: Mapping[str, Any], name: str, labels: tuple[str, str], questions: int) -> str:
    """One line of :func:`paired_table`'s ``numbers``: score ``name`` before, after, and their paired difference."""
    if name not in numbers:
        raise ValueError(f"no paired score {name!r} in both evaluations; they have {', '.join(numbers) or 'none'}")
    scale, unit = _scale(name)
    row = numbers[name]
    points = " points" if scale > 1 else ""
    return (
        f"held-out {SCORE_DISPLAY[name].name}{unit}: {scale * row[labels[0]]:.1f} ({labels[0]}) → "
        f"{scale * row[labels[1]]:.1f} ({labels[1]}), {scale * row['difference']:+.1f}{points} "
        f"[{scale * row['difference_low']:+.1f}, {scale * row['difference_high']:+.1f}] "
        f"(paired 95%, {questions} questions)"
    )


def _scale(name: str) -> tuple[float, str]:
    """How a score is shown: fractions as percentages."""
    return (100.0, " %") if SCORE_DISPLAY[name].bounds == FRACTION else (1.0, "")
