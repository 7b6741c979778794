"""Learning on CPU: AT²PO, AEPO and GRPO at one rollout budget, and the cost of a training step beside TRL.

    python -m benchmarks.learning [--json PATH] [--algos at2po,aepo,grpo] [--steps N] [--eval-questions Q]
                                  [--rollout-tokens T] [--eval-every E] [--out DIR] [--trl-steps S | --no-trl]
                                  [--model M] [--set KEY=VALUE ...] [--preset P] [--seeds 0,1,2]
                                  [--budget-points T1,T2,...] [--holdout N] [--score f1|em|reward] [--config FILE]

**Learning.** Each learner trains the embedded SmolLM2-135M on ``multihop-qa`` with the
``cpu-demo`` preset (2 prompts per step, 6 leaves per prompt for every learner, 2 tool calls, the
AT²PO reward: −1 bad format or no answer, 0 wrong, 1 exact match) from the same initial model,
seed and task order (``--model``: another start, such as the checkpoint of the main job's cold
start; ``--set``: settings over the preset, as ``agents train --set``; ``--before-model``: the
model scored as "before", such as the untrained one that cold start began from). The policy before
training and each learner's policy after ``--steps`` steps are scored on ``--eval-questions``
held-out HotpotQA questions that no run trains on
(greedy decoding, the papers' evaluation), with 95% intervals (Wilson for proportions, normal
for the mean reward). The table lists every held-out score before and after; the plot
(``OUT/learning.png``) draws each learner's training reward per step and the held-out F1,
format adherence and reward. The claim is the direction and its uncertainty: a 135M model on two CPU cores learns
the answer format in a few steps or not at all; the papers' EM gains need their budgets (a 4B
model, 64 prompts × 22 leaves per step, hundreds of steps on GPUs: ``--preset paper``).

**At one rollout budget.** With ``--rollout-tokens T`` every learner trains until its rollouts
have sampled T tokens (``max_rollout_tokens``: dropped prompts of dynamic sampling included;
``--steps`` is then only a cap), so a learner whose steps cost more gets fewer of them. With
``--eval-every E`` each run is also scored after every E steps, and ``OUT/learning.png`` draws
held-out F1 against the tokens sampled so far. The held-out questions are the same for every
policy, so the table of differences is paired (:func:`agents.eval.heldout.paired_difference`): each
learner against the start, and each pair of learners, F1 and EM with bootstrap 95% intervals.

**Seeds and budget points.** With ``--seeds 0,1,2`` every learner runs once a seed (its task order and
sampling; the same start), and with ``--budget-points T1,T2,...`` every run is also scored after the steps at
which its rollouts reach each of those token counts (``eval_at_tokens``; the last point is the budget unless
``--rollout-tokens`` is given). A table then compares, at each point, each learner with the start and each
pair of learners on ``--score``: paired question by question within every seed, and across seeds the mean of
those per-seed differences with a t interval. ``--preset`` (or ``none``) and ``--config FILE`` choose the
settings the runs build on (another environment, its options and sizes) and ``--holdout`` its held-out tasks.

**Throughput.** Seconds per step of each run split into rollout (tree generation with tool
calls), old-log-prob recomputation (the reference policy's too, for GRPO's KL) and update, and
the update's tokens/s (prompt, observation and action tokens through forward and backward).
Beside it TRL's ``GRPOTrainer`` runs ``--trl-steps`` steps on the same model, the same 12
sequences per step (2 prompts × 6 generations, micro-batches of 4), the same prompts and a
completion cap equal to our response budget, with KL 0.001 like our GRPO. TRL is single-turn
(one completion, no tools, HF ``generate`` with one prefill per batch), so its rollout column
is not the same work as ours; the update columns are. TRL is installed for this run only, into
a cache folder (``pip install --no-deps --target``), never into the project's environment,
because its requirements (``datasets``, ``pyarrow``, ``pandas``) are not the product's and pip
must not touch the CPU build of torch; it runs in a subprocess with that folder on its path.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentenv.cache import build_once
from agents.eval.heldout import (
    SCORE_DISPLAY,
    HeldOut,
    Score,
    comparison_table,
    draw_scores,
    evaluate_heldout,
    greedy_rollout,
    paired_difference,
)
from agents.eval.tables import text_table
from agents.models import cache_root, resolve_model
from agents.run.config import TrainConfig, build, resolve
from agents.run.task_order import TaskOrder
from agents.run.train import TrainResult, plot_title, train
from agents.training.metrics import draw_curve, label_axis, save_figure

if TYPE_CHECKING:
    from matplotlib.figure import Figure

ALGOS = ("at2po", "aepo", "grpo")
ALGO_NAMES = {"at2po": "AT²PO", "aepo": "AEPO", "grpo": "GRPO"}  # in the plot's legends
DEFAULT_STEPS = 5
DEFAULT_EVAL_QUESTIONS = 32
DEFAULT_TRL_STEPS = 3
# TRL and what it needs beyond the project's environment, pinned to the versions checked here.
TRL_PACKAGES = (
    "trl==1.16.0",
    "datasets==5.2.0",
    "pyarrow==26.0.1",
    "pandas==3.1.1",
    "multiprocess==0.70.19",
    "xxhash==4.1.0",
)
# (column, metric of agents.run.train's records, unit)
SPLIT = (("rollout s", "time/rollout_s"), ("old log-probs s", "time/old_logprobs_s"), ("update s", "time/update_s"))


def learning_config(
    algo: str,
    steps: int,
    eval_questions: int,
    *,
    model: str | None = None,
    assignments: Sequence[str] = (),
    rollout_tokens: int | None = None,
    eval_every: int = 0,
    preset: str = "cpu-demo",
    seed: int = 0,
    budget_points: Sequence[int] = (),
    holdout: int | None = None,
    config_file: str | None = None,
) -> TrainConfig:
    """The ``preset`` run of ``algo`` with ``seed`` for ``steps`` steps (or until ``rollout_tokens`` tokens are
    sampled, by default the last of ``budget_points``) from ``model`` (default: the embedded one), scored after
    training, every ``eval_every`` steps and at each of ``budget_points`` rollout tokens; ``assignments`` are
    ``--set KEY=VALUE`` strings over it and ``config_file`` (YAML or JSON, as ``agents train --config``) under
    them; ``preset`` ``"none"``: the defaults. Without ``rollout_tokens`` or ``budget_points`` the preset's budget
    stays, and without ``holdout`` its held-out tasks unless fewer than ``eval_questions`` (then
    ``max(50, eval_questions)``)."""
    layers = {"preset_name": None if preset == "none" else preset, "file": config_file, "assignments": assignments}
    if holdout is None:
        holdout = resolve(**layers).holdout
        holdout = holdout if holdout >= eval_questions else max(50, eval_questions)
    budget = rollout_tokens if rollout_tokens is not None else max(budget_points, default=None)
    return resolve(
        **layers,
        values={
            **({"model": model} if model is not None else {}),
            **({"max_rollout_tokens": budget} if budget is not None else {}),
            "algo": algo,
            "seed": seed,
            "steps": steps,
            "eval_at_tokens": tuple(budget_points),
            "eval_questions": eval_questions,
            "holdout": holdout,
            "eval_before": False,
            "eval_every": eval_every,
            "checkpoint_every": steps,
        },
    )


def run_key(algo: str, seed: int, seeds: Sequence[int]) -> str:
    """The name of one run in the results: the learner's, with ``@seed`` when there are several seeds."""
    return algo if len(seeds) == 1 else f"{algo}@{seed}"


def run_name(key: str) -> str:
    """A run's name in tables and legends: ``AT²PO``, or ``AT²PO seed 1``."""
    algo, _, seed = key.partition("@")
    return ALGO_NAMES.get(algo, algo) + (f" seed {seed}" if seed else "")


async def score_initial_policy(config: TrainConfig) -> HeldOut:
    """The untrained model on the held-out questions, as every run would score it at step 0."""
    from agents.engines.hf import HFEngine

    tree = build(config).tree
    engine = HFEngine(config.model, max_batch_size=tree.rollout.concurrency, seed=config.seed)
    try:
        return await evaluate_heldout(
            engine,
            engine.tokenizer,
            config.env,
            questions=config.eval_questions,
            rollout=greedy_rollout(tree),
            step=0,
            env_kwargs=config.env_kwargs,
            budget_reward=config.budget_reward,
            progress=False,
        )
    finally:
        await engine.close()


def step_split(result: TrainResult) -> dict[str, float]:
    """Mean seconds per step of each phase, update tokens/s and sizes, over the run's steps."""
    history = result.history

    def mean(name: str) -> float:
        return statistics.fmean(record[name] for record in history)

    split = {column: mean(metric) for column, metric in SPLIT}
    split["step s"] = sum(split.values())
    split["update tokens/s"] = mean("throughput/update_tokens_per_s")
    split["sequences/step"] = mean("batch/sequences")
    split["tokens/sequence"] = mean("tokens/trained") / split["sequences/step"]
    split["generated tokens/step"] = mean("tokens/generated")
    return split


# -- TRL --------------------------------------------------------------------------------------


def trl_folder() -> Path:
    """Where TRL and its requirements are installed for this benchmark (outside the project's venv)."""
    return cache_root().parent / "benchmarks" / TRL_PACKAGES[0].replace("==", "-")


def install_trl() -> Path:
    """Install :data:`TRL_PACKAGES` without dependencies into :func:`trl_folder` (once); returns it."""

    def install(folder: Path) -> None:
        done = subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(folder), *TRL_PACKAGES],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(f"pip could not install {' '.join(TRL_PACKAGES)}: {done.stderr.strip()[-400:]}")

    def check(folder: Path) -> None:  # every package's metadata at its pinned version
        for package in TRL_PACKAGES:
            name, version = package.split("==")
            if not (folder / f"{name.replace('-', '_')}-{version}.dist-info" / "RECORD").is_file():
                raise FileNotFoundError(f"{folder} holds no {package}")

    return build_once(trl_folder(), install, check, record="\n".join(TRL_PACKAGES) + "\n")


def trl_job(config: TrainConfig, steps: int) -> dict[str, Any]:
    """What the TRL run gets: the model, our first ``steps`` batches of prompts, and our sizes."""
    import agentenv

    parts = build(config)
    env = agentenv.make(config.env, **config.env_kwargs)
    order = TaskOrder(len(env.tasks), config.holdout, config.seed)
    prompts = []
    for index in order.take(steps * config.prompts_per_step):
        text, info = env.reset(options={"index": index})
        prompts.append({"prompt": text, "answers": list(info["answers"])})
    env.close()
    micro, leaves = parts.trainer.micro_batch_size, parts.learner.strategy.n  # GRPO: Chain(n)
    return {
        "model": str(resolve_model(config.model)),
        "prompts": prompts,
        "steps": steps,
        "num_generations": leaves,
        "per_device_train_batch_size": micro,
        "gradient_accumulation_steps": config.prompts_per_step * leaves // micro,
        "max_completion_length": parts.tree.rollout.max_response_tokens,
        "temperature": parts.tree.rollout.sampling.temperature,
        "learning_rate": parts.trainer.lr,
        "beta": 0.001,  # GRPO's KL coefficient, as in our GRPO
        "epsilon": 0.2,
        "seed": config.seed,
    }


def run_trl(job: dict[str, Any], timeout_s: float) -> dict[str, Any]:
    """Run :func:`trl_worker` in a subprocess with TRL on its path; its per-step timings."""
    folder = install_trl()
    with tempfile.TemporaryDirectory(prefix="trl-bench-") as tmp:
        job_path, result_path = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job))
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(folder), str(Path(__file__).resolve().parents[1])]),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TOKENIZERS_PARALLELISM": "false",
            "PYTHONWARNINGS": "ignore",
        }
        done = subprocess.run(
            [sys.executable, "-m", "benchmarks.learning", "--trl-worker", str(job_path), str(result_path)],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )
        if done.returncode != 0 or not result_path.is_file():
            raise RuntimeError(f"the TRL run failed (exit {done.returncode}): {done.stderr.strip()[-600:]}")
        return json.loads(result_path.read_text())


def trl_grpo_config(job: dict[str, Any], output_dir: str) -> Any:
    """The job's ``GRPOConfig``: our run's batch, sampling and optimiser settings, on the CPU, nothing saved."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=output_dir,
        max_steps=job["steps"],
        per_device_train_batch_size=job["per_device_train_batch_size"],
        gradient_accumulation_steps=job["gradient_accumulation_steps"],
        num_generations=job["num_generations"],
        max_completion_length=job["max_completion_length"],
        temperature=job["temperature"],
        learning_rate=job["learning_rate"],
        lr_scheduler_type="constant",
        weight_decay=0.01,
        max_grad_norm=1.0,
        beta=job["beta"],
        epsilon=job["epsilon"],
        loss_type="grpo",
        use_cpu=True,
        bf16=False,
        report_to="none",
        logging_steps=1,
        save_strategy="no",
        seed=job["seed"],
        shuffle_dataset=False,
        include_num_input_tokens_seen="all",
        disable_tqdm=True,
    )


def trl_worker(job_path: str, result_path: str) -> None:
    """In the subprocess: ``GRPOTrainer`` for the job's steps, timing generation, scoring and update."""
    import pyarrow
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOTrainer

    from agentenv.graders import grade
    from agentenv.parsers import get_parser
    from agentenv.rewards import REWARD_SCHEMES

    job = json.loads(Path(job_path).read_text())
    parser = get_parser("xml")
    phases: dict[str, float] = {"generate": 0.0, "prepare": 0.0}

    class TimedGRPOTrainer(GRPOTrainer):
        """GRPOTrainer that adds up the seconds of generation and of preparing each batch."""

        def _generate(self, prompts):
            start = time.perf_counter()
            try:
                return super()._generate(prompts)
            finally:
                phases["generate"] += time.perf_counter() - start

        def _prepare_inputs(self, generation_batch):
            start = time.perf_counter()
            try:
                return super()._prepare_inputs(generation_batch)
            finally:
                phases["prepare"] += time.perf_counter() - start

    steps: list[dict[str, float]] = []

    class StepTimer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start, self.tokens = time.perf_counter(), state.num_input_tokens_seen
            phases.update(generate=0.0, prepare=0.0)

        def on_step_end(self, args, state, control, **kwargs):
            total = time.perf_counter() - self.start
            steps.append(
                {
                    "step_s": total,
                    "generate_s": phases["generate"],
                    "logprobs_s": phases["prepare"] - phases["generate"],
                    "update_s": total - phases["prepare"],
                    "tokens": float(state.num_input_tokens_seen - self.tokens),
                }
            )

    def at2po_reward(completions, answers, **kwargs):
        """AT²PO's reward of a single-turn answer: −1 bad format, 0 wrong, 1 exact match."""
        rewards = []
        for completion, gold in zip(completions, answers):
            action = parser.parse(completion[0]["content"], {})
            rewards.append(REWARD_SCHEMES["at2po"](grade(action.answer, gold), {}))
        return rewards

    torch.manual_seed(job["seed"])
    tokenizer = AutoTokenizer.from_pretrained(job["model"])
    model = AutoModelForCausalLM.from_pretrained(job["model"], dtype=torch.float32)
    rows = [
        {"prompt": [{"role": "user", "content": row["prompt"]}], "answers": row["answers"]} for row in job["prompts"]
    ]
    # A fixed fingerprint: datasets would hash the Arrow table with dill, which fails on pyarrow 26's types.
    dataset = Dataset(pyarrow.Table.from_pylist(rows), fingerprint="benchmarks.learning")
    with tempfile.TemporaryDirectory(prefix="trl-out-") as out:
        args = trl_grpo_config(job, out)
        trainer = TimedGRPOTrainer(
            model=model,
            processing_class=tokenizer,
            reward_funcs=at2po_reward,
            args=args,
            train_dataset=dataset,
            callbacks=[StepTimer()],
        )
        trainer.train()
    Path(result_path).write_text(
        json.dumps({"steps": steps, "versions": {"trl": __import__("trl").__version__, "torch": torch.__version__}})
    )


def trl_split(result: dict[str, Any]) -> dict[str, float]:
    """TRL's per-step timings in the columns of :func:`step_split` (its first step, warm-up, left out)."""
    steps = result["steps"][1:] or result["steps"]

    def mean(name: str) -> float:
        return statistics.fmean(step[name] for step in steps)

    split = {"rollout s": mean("generate_s"), "old log-probs s": mean("logprobs_s"), "update s": mean("update_s")}
    split["step s"] = mean("step_s")
    split["update tokens/s"] = mean("tokens") / split["update s"]
    return split


# -- tables and plot --------------------------------------------------------------------------


def throughput_table(splits: dict[str, dict[str, float]], trl: dict[str, float] | None) -> str:
    columns = ["rollout s", "old log-probs s", "update s", "step s", "update tokens/s"]
    rows = [[name, *(f"{split[c]:.1f}" for c in columns)] for name, split in splits.items()]
    if trl is not None:
        rows.append(["TRL GRPOTrainer", *(f"{trl[c]:.1f}" for c in columns)])
        for name, split in splits.items():
            rows.append([f"{name} / TRL", *(f"{split[c] / trl[c]:.2f}x" if trl[c] > 0 else "-" for c in columns)])
    return text_table(["run", *columns], rows)


def tokens_at(result: TrainResult) -> dict[int, float]:
    """The rollout tokens a run had sampled after each of its steps (0 at step 0)."""
    spent, total = {0: 0.0}, 0.0
    for record in result.history:
        total += record["sampling/tokens"]
        spent[int(record["step"])] = total
    return spent


def paired_differences(
    before: HeldOut, results: dict[str, TrainResult], scores: Sequence[str] = ("f1", "em")
) -> tuple[str, dict[str, dict[str, float]]]:
    """``scores``' differences, question by question, of each run's final policy against the start and of each
    pair of learners run with the same seed, with paired bootstrap 95% intervals: the text table and the
    numbers."""
    pairs = [(key, "start") for key in results]
    pairs += [(a, b) for a, b in itertools.combinations(results, 2) if a.partition("@")[2] == b.partition("@")[2]]
    policies = {"start": before, **{key: result.heldout[-1] for key, result in results.items()}}
    rows, numbers = [], {}
    for first, second in pairs:
        diffs = {score: paired_heldout_difference(policies[second], policies[first], score) for score in scores}
        label = f"{run_name(first)} - {'start' if second == 'start' else run_name(second)}"
        rows.append([label.replace(" - ", " − "), *(points_cell(diff) for diff in diffs.values())])
        numbers[label] = {k: v for score, diff in diffs.items() for k, v in score_numbers(score, diff).items()}
    head = ["comparison (same questions)", *(f"{SCORE_DISPLAY[score].name} points [paired 95%]" for score in scores)]
    return text_table(head, rows), numbers


def paired_heldout_difference(before: HeldOut, after: HeldOut, score: str) -> Score:
    """``after − before`` of ``score``, question by question, with its paired bootstrap 95% interval."""
    return paired_difference(before.per_question[score], after.per_question[score])


def points_cell(diff: Score) -> str:
    return f"{100 * diff.mean:+.1f} [{100 * diff.low:+.1f}, {100 * diff.high:+.1f}]"


def score_numbers(score: str, diff: Score) -> dict[str, float]:
    return {score: diff.mean, f"{score}_low": diff.low, f"{score}_high": diff.high}


def heldout_at(result: TrainResult, point: int) -> HeldOut | None:
    """The run's evaluation after the step whose rollouts reached ``point`` tokens (``eval_at_tokens``), or
    ``None`` when the run ended before reaching it."""
    spent = tokens_at(result)
    for held in result.heldout:
        if held.step > 0 and spent[held.step] >= point:
            return held
    return None


def budget_table(
    before: HeldOut, results: dict[str, TrainResult], points: Sequence[int], score: str
) -> tuple[str, dict[str, Any]]:
    """At each rollout-token budget point: each learner against the start and each pair of learners, ``score``
    paired question by question in every seed, and across seeds the mean of those differences with a
    t interval over the seeds (none for one seed). The text table and the numbers."""
    runs = {(algo, seed): result for (algo, _, seed), result in ((k.partition("@"), r) for k, r in results.items())}
    learners = list(dict.fromkeys(algo for algo, _ in runs))
    seeds = list(dict.fromkeys(seed for _, seed in runs))
    comparisons = [(learner, None) for learner in learners] + list(itertools.combinations(learners, 2))
    rows, numbers = [], {}
    for point in points:
        for first, second in comparisons:
            per_seed = []
            for seed in seeds:
                after = heldout_at(runs[first, seed], point)
                other = before if second is None else heldout_at(runs[second, seed], point)
                if after is not None and other is not None:
                    per_seed.append(paired_heldout_difference(other, after, score))
            label = f"{ALGO_NAMES.get(first, first)} - {'start' if second is None else ALGO_NAMES.get(second, second)}"
            across = across_seeds([diff.mean for diff in per_seed])
            rows.append(
                [
                    f"{point:,}",
                    label.replace(" - ", " − "),
                    "; ".join(points_cell(diff) for diff in per_seed) or "not reached",
                    points_cell(across) if across is not None else "-",
                ]
            )
            numbers[f"{point} {label}"] = {
                "per_seed": [score_numbers(score, diff) for diff in per_seed],
                "across_seeds": None if across is None else score_numbers(score, across),
            }
    head = ["tokens", "comparison", f"{SCORE_DISPLAY[score].name} points per seed [paired 95%]", "across seeds [t 95%]"]
    return text_table(head, rows), numbers


def across_seeds(means: Sequence[float]) -> Score | None:
    """The mean of per-seed differences with a t 95% interval over the seeds (``None`` for fewer than two)."""
    if len(means) < 2:
        return None
    from scipy.stats import t  # imported here: scipy is slow to import and only this needs it

    mean = statistics.fmean(means)
    half = float(t.ppf(0.975, len(means) - 1)) * statistics.stdev(means) / len(means) ** 0.5
    return Score(mean, mean - half, mean + half)


def learning_figure(results: dict[str, TrainResult], before: HeldOut, out: Path, score: str = "f1") -> Figure:
    """Each run's training reward per step, held-out ``score`` against the rollout tokens sampled, and the
    held-out scores before and after training; the runs of one learner (its seeds) share a colour.

    The title names the learners, the environment, the model and ``out``, the runs' folder.
    """
    from matplotlib.figure import Figure

    learners = list(dict.fromkeys(key.partition("@")[0] for key in results))
    color = {key: f"C{learners.index(key.partition('@')[0])}" for key in results}
    legend = {key: ALGO_NAMES.get(key.partition("@")[0], key) for key in results}  # once a learner
    labelled: set[str] = set()
    config = next(iter(results.values())).config  # the runs share environment and model
    names = ", ".join(ALGO_NAMES.get(learner, learner) for learner in learners)
    seeded = len(results) > len(learners)  # several seeds a learner: one line a run, names on their side
    figure = Figure(figsize=(21, 5.2 if seeded else 3.6), layout="constrained")
    figure.suptitle(f"{plot_title(names, config, out)}: held-out 95% intervals")
    train_axis, tokens_axis, *score_axes = figure.subplots(1, 5)
    display = SCORE_DISPLAY[score]
    for key, result in results.items():
        spent = tokens_at(result)
        evaluated = [before, *(held for held in result.heldout if held.step > 0)]
        # matplotlib leaves "_"-labels out of legends; None would give draw_curve's default name
        label = f"_{legend[key]}" if legend[key] in labelled else legend[key]
        labelled.add(legend[key])
        tokens = [spent[held.step] for held in evaluated]
        draw_scores(
            tokens_axis,
            tokens,
            [held.scores[score] for held in evaluated],
            display.bounds,
            color=color[key],
            label=label,
        )
        draw_curve(
            train_axis, result.history, "reward/mean", label=label, band_label=None, color=color[key], band=not seeded
        )
    tokens_axis.set_xlabel("rollout tokens sampled")
    tokens_axis.set_ylabel(display.unit)
    tokens_axis.set_title(f"held-out {display.name} against rollout tokens")
    tokens_axis.legend(fontsize="small")
    label_axis(train_axis, "training reward (mean over leaves" + (")" if seeded else " ± std)"), "reward")
    train_axis.legend(fontsize="small")
    join = " · " if seeded else "\n"
    after = {f"{run_name(key)}{join}{result.steps} steps": result.heldout[-1] for key, result in results.items()}
    policies = {f"before{join}training": before, **after}
    colors = ["grey", *color.values()]
    for axis, name in zip(score_axes, dict.fromkeys((score, "format_ok", "reward"))):
        shown = SCORE_DISPLAY[name]
        for x, (heldout, dot) in enumerate(zip(policies.values(), colors)):
            draw_scores(axis, [x], [heldout.scores[name]], shown.bounds, color=dot)
        axis.set_xticks(range(len(policies)), list(policies), rotation=90 if seeded else 0)
        axis.set_xlim(-0.5, len(policies) - 0.5)  # room for the outer labels
        label_axis(axis, f"held-out {shown.name}", shown.unit, steps=False)
    return figure


def plot(results: dict[str, TrainResult], before: HeldOut, path: Path, score: str = "f1") -> Path:
    """:func:`learning_figure` as a PNG at ``path`` (in the runs' folder); returns ``path``."""
    return save_figure(learning_figure(results, before, path.parent, score), path)


# -- main -------------------------------------------------------------------------------------


async def learn(
    algos: list[str],
    seeds: list[int],
    steps: int,
    eval_questions: int,
    out: Path,
    *,
    before_model: str | None = None,
    **run: Any,
) -> tuple[HeldOut, dict[str, TrainResult]]:
    """Score the initial policy (or ``before_model``), then train each learner with each seed from the initial
    policy (keys :func:`run_key`); ``run``: :func:`learning_config`'s keywords."""
    start = learning_config(algos[0], steps, eval_questions, seed=seeds[0], **run)
    before = await score_initial_policy(
        start if before_model is None else dataclasses.replace(start, model=before_model)
    )
    print(f"before training: {', '.join(f'{k} {v}' for k, v in before.scores.items())}", flush=True)
    results = {}
    for seed in seeds:
        for algo in algos:
            key, began = run_key(algo, seed, seeds), time.perf_counter()
            config = learning_config(algo, steps, eval_questions, seed=seed, **run)
            results[key] = await train(config, out / key, progress=False, log=print)
            after = results[key].heldout[-1]
            print(
                f"{run_name(key)}: {results[key].steps} steps in {time.perf_counter() - began:.0f} s; after: "
                f"{', '.join(f'{k} {v}' for k, v in after.scores.items())}",
                flush=True,
            )
    return before, results


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.learning``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--algos", default=",".join(ALGOS), help=f"learners, comma-separated (default {','.join(ALGOS)})"
    )
    parser.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS, help=f"training steps per learner (default {DEFAULT_STEPS})"
    )
    parser.add_argument(
        "--eval-questions",
        type=int,
        default=DEFAULT_EVAL_QUESTIONS,
        help=f"held-out questions scored before and after (default {DEFAULT_EVAL_QUESTIONS})",
    )
    parser.add_argument(
        "--rollout-tokens",
        type=int,
        metavar="T",
        help="train each learner until its rollouts sampled T tokens (--steps is then a cap): one rollout budget",
    )
    parser.add_argument(
        "--eval-every", type=int, default=0, metavar="E", help="also score each run after every E steps (default 0)"
    )
    parser.add_argument(
        "--trl-steps",
        type=int,
        default=DEFAULT_TRL_STEPS,
        help=f"TRL GRPOTrainer steps for the throughput comparison (default {DEFAULT_TRL_STEPS})",
    )
    parser.add_argument("--no-trl", action="store_true", help="skip the TRL comparison")
    parser.add_argument(
        "--model", help="start every learner from this model (e.g. a cold start's checkpoint; default the embedded one)"
    )
    parser.add_argument(
        "--before-model",
        metavar="M",
        help="score this model as 'before training' instead of the start (e.g. the untrained model, when --model "
        "is its cold start)",
    )
    parser.add_argument(
        "--set",
        dest="assignments",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting over the cpu-demo preset, as agents train --set (repeatable)",
    )
    parser.add_argument(
        "--preset",
        default="cpu-demo",
        help="the agents train preset the runs build on, or none (default cpu-demo)",
    )
    parser.add_argument("--config", metavar="FILE", help="a YAML or JSON config over the preset, as agents train's")
    parser.add_argument(
        "--seeds", default="0", help="seeds, comma-separated: each learner runs once a seed (default 0)"
    )
    parser.add_argument(
        "--budget-points",
        default="",
        metavar="T1,T2,...",
        help="score every run after the steps that reach these rollout tokens (eval_at_tokens) and compare the "
        "learners there; the last is the budget unless --rollout-tokens says otherwise",
    )
    parser.add_argument(
        "--holdout",
        type=int,
        help="the env's first N tasks, never trained on (default: the preset's, or max(50, --eval-questions) if fewer)",
    )
    parser.add_argument(
        "--score",
        default="f1",
        choices=("f1", "em", "reward"),
        help="the held-out score of the curve and the budget table (default f1)",
    )
    parser.add_argument("--out", type=Path, help="folder for the runs and the plot (default: a temporary folder)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    parser.add_argument("--trl-worker", nargs=2, metavar=("JOB", "RESULT"), help=argparse.SUPPRESS)
    return parser


def measure_trl(args: argparse.Namespace, run: dict[str, Any]) -> tuple[dict[str, float] | None, str]:
    """TRL GRPOTrainer's seconds per step on the same setup (``None`` when skipped or failed), and a note why."""
    if args.no_trl:
        return None, "skipped (--no-trl)"
    try:
        job = trl_job(learning_config("grpo", args.steps, args.eval_questions, **run), args.trl_steps)
        trl_result = run_trl(job, timeout_s=3600)
    except (RuntimeError, subprocess.TimeoutExpired) as error:
        return None, f"not measured: {error}"
    return trl_split(
        trl_result
    ), f"TRL {trl_result['versions']['trl']}, {len(trl_result['steps'])} steps, first left out"


def main() -> None:
    command = parser()
    args = command.parse_args()
    if args.trl_worker:
        trl_worker(*args.trl_worker)
        return
    algos = [a.strip() for a in args.algos.split(",") if a.strip()]
    try:
        seeds = [int(seed) for seed in args.seeds.split(",")]
        points = [int(point) for point in args.budget_points.split(",") if point.strip()]
    except ValueError:
        command.error(
            f"--seeds and --budget-points take integers, comma-separated: {args.seeds!r}, {args.budget_points!r}"
        )
    if min(args.steps, args.eval_questions, args.trl_steps) < 1:
        command.error("--steps, --eval-questions and --trl-steps must be >= 1")
    out = args.out or Path(tempfile.mkdtemp(prefix="learning-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    for key in (run_key(algo, seed, seeds) for seed in seeds for algo in algos):
        if (out / key).exists():
            command.error(f"{out / key} exists; give an empty --out")

    start = time.perf_counter()
    run = {
        "model": args.model,
        "assignments": args.assignments,
        "rollout_tokens": args.rollout_tokens,
        "eval_every": args.eval_every,
        "preset": args.preset,
        "budget_points": points,
        "holdout": args.holdout,
        "config_file": args.config,
    }
    before, results = asyncio.run(
        learn(algos, seeds, args.steps, args.eval_questions, out, before_model=args.before_model, **run)
    )
    learning_seconds = time.perf_counter() - start
    config = next(iter(results.values())).config
    labels = [f"before: {args.before_model}" if args.before_model else "before training"] + [
        f"{run_name(key)}, step {result.steps}" for key, result in results.items()
    ]
    budget = config.max_rollout_tokens
    print(
        f"\n=== held-out {config.env} questions never trained on ({args.eval_questions}, greedy), 95% intervals; "
        f"{len(algos)} learners x {len(seeds)} seeds, {'≤ ' if budget else ''}{args.steps} steps"
        f"{f' or {budget} rollout tokens' if budget else ''} in {learning_seconds / 60:.1f} min"
    )
    print(comparison_table([before] + [result.heldout[-1] for result in results.values()], labels))
    scores = list(dict.fromkeys((args.score, "f1", "em")))
    paired, differences = paired_differences(before, results, scores)
    print("\n=== differences on the same held-out questions, final policies (percentage points)")
    print(paired)
    budget_numbers: dict[str, Any] = {}
    if points:
        table, budget_numbers = budget_table(before, results, points, args.score)
        print(f"\n=== at each rollout budget: {SCORE_DISPLAY[args.score].name}, paired per seed and across seeds")
        print(table)
    longest = max(len(result.history) for result in results.values())
    rows = [
        [run_name(key), f"{tokens_at(result)[result.steps]:.0f}"]
        + [f"{record['reward/mean']:+.2f}" for record in result.history]
        + [""] * (longest - len(result.history))
        for key, result in results.items()
    ]
    print("\n=== rollout tokens sampled, and training reward per step (mean over the step's leaves)")
    print(text_table(["run", "tokens", *(f"step {s}" for s in range(1, longest + 1))], rows))

    splits = {run_name(key): step_split(result) for key, result in results.items()}
    trl, trl_note = measure_trl(args, run)
    print(f"\n=== seconds per training step (mean over steps) and update tokens/s; TRL: {trl_note}")
    print(throughput_table(splits, trl))
    sizes = {
        name: f"{s['sequences/step']:.0f} sequences of {s['tokens/sequence']:.0f} tokens, "
        f"{s['generated tokens/step']:.0f} generated"
        for name, s in splits.items()
    }
    print("per step: " + "; ".join(f"{name} {size}" for name, size in sizes.items()))

    figure = plot(results, before, out / "learning.png", args.score)
    print(f"\nplot: {figure}\nruns: {out}")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "command": "python -m benchmarks.learning " + " ".join(sys.argv[1:]),
                    "env": config.env,
                    "model": args.model,
                    "before_model": args.before_model,
                    "preset": args.preset,
                    "settings": args.assignments,
                    "seeds": seeds,
                    "steps": args.steps,
                    "rollout_tokens": budget,
                    "budget_points": points,
                    "eval_questions": args.eval_questions,
                    "steps_run": {key: result.steps for key, result in results.items()},
                    "tokens_sampled": {key: tokens_at(result) for key, result in results.items()},
                    "heldout": {
                        key: {held.step: held.record() for held in result.heldout} for key, result in results.items()
                    },
                    "paired_differences": differences,
                    "budget_points_differences": budget_numbers,
                    "learning_seconds": learning_seconds,
                    "before": before.record(),
                    "after": {key: result.heldout[-1].record() for key, result in results.items()},
                    "training_reward": {
                        key: [r["reward/mean"] for r in result.history] for key, result in results.items()
                    },
                    "throughput": splits,
                    "trl": trl,
                    "trl_note": trl_note,
                    "plot": str(figure),
                },
                indent=2,
            )
        )
        print(f"results written to {args.json}")


if __name__ == "__main__":
    main()
