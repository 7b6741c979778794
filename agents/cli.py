"""The ``agents`` command. One subcommand per job; each registers its parser in :data:`COMMANDS`.

    agents eval --env multihop-qa --model smollm2-135m --limit 20
    agents eval --env multihop-qa:2wiki,singlehop-qa:nq --samples 4 --temperature 1 --json out.json
    agents eval --env web-research --grader judge --judge-model Qwen2.5-72B-Instruct \
        --judge-engine openai --judge-base-url http://127.0.0.1:8001/v1

``agents eval`` runs the evaluation of :mod:`agents.evaluation` and prints a transcript and the
results table; progress goes to stderr. ``--grader judge`` also has every answer judged by an LLM
(:mod:`agents.judge`), as AEPO and ARPO score their deep-search benchmarks.

    agents train --algo at2po --env multihop-qa --model smollm2-135m --preset cpu-demo --out runs/demo
    agents train --out runs/demo --resume --steps 8
    agents train --algo grpo --config run.yaml --set trainer.lr=1e-5 --set strategy.n=8

``agents train`` runs :func:`agents.train.train` with the configuration of :mod:`agents.config`
and prints the held-out scores before and after training.

    agents sft --data trajectories.jsonl --min-reward 1 --model smollm2-135m --out runs/cold-start

``agents sft`` runs :func:`agents.sft.sft`, supervised fine-tuning on trajectories or chats, and
prints where the final model is.

Building the parser imports neither torch nor transformers (nor agentenv): ``main`` fills in the
options of the one subcommand on its command line, so ``agents --help`` and ``agents train --help``
answer at once, and the subcommand's bad arguments (an unknown ``--env``, a bad ``--set`` or
``--env-arg``) are reported, in one line with exit code 2, before a model loads.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import json
import sys
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Only light imports at the top (tests/test_layout.py lists why the others wait): vLLM's workers
# re-import the main module (``python -m agents`` imports this one), agentenv pulls numba, whose
# objects break vLLM-CPU's start-up scan, and --help must not wait for torch.
from agents.cluster.config import PLACEMENTS
from agents.config import PRESETS, RunParts, TrainConfig, build, effective_config, parse_overrides, resolve
from agents.demonstrations import write_demonstrations
from agents.engines.base import DEFAULT_MAX_NEW_TOKENS, Engine, SamplingParams
from agents.engines.factory import ENGINES, make_engine
from agents.memory_plan import run_plan, set_flags
from agents.models import DEFAULT_MODEL, ModelNotAvailableError, load_tokenizer
from agents.training.reporting import check_report_to

__all__ = ["COMMANDS", "Command", "build_parser", "main", "version"]


def version() -> str:
    """The installed version of the ``agentenv`` distribution, which ships both commands."""
    try:
        return importlib.metadata.version("agentenv")
    except importlib.metadata.PackageNotFoundError:  # a source tree on sys.path that was never installed
        return "unknown (not installed: pip install -e . in the repository gives it its version)"


# -- agents eval ------------------------------------------------------------------------------


def _add_eval(p: argparse.ArgumentParser) -> None:
    from agents.rollout.episodes import DEFAULT_CONCURRENCY, DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_MAX_RESPONSE_TOKENS

    p.description = (
        "Evaluate a model on registered environments through the rollout loop: EM and F1 per "
        "question, the papers' pooled average over several environments, pass@k with --samples."
    )
    p.add_argument(
        "--env",
        required=True,
        help="environment id, or several separated by commas (e.g. multihop-qa:hotpotqa,multihop-qa:2wiki)",
    )
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"model name, local folder or Hugging Face id (default {DEFAULT_MODEL}, embedded, offline)",
    )
    p.add_argument("--engine", choices=ENGINES, default="hf", help="generation engine (default hf)")
    p.add_argument(
        "--env-arg",
        dest="env_args",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an option of agentenv.make for every env, value read as YAML, e.g. example=true or "
        "require_boxed=false (a run's env_kwargs; repeatable)",
    )
    p.add_argument("--limit", type=int, help="the first N questions of each environment (default all)")
    p.add_argument(
        "--samples", type=int, default=1, help="samples per question; > 1 reports pass@k (needs --temperature > 0)"
    )
    p.add_argument(
        "--temperature", type=float, default=0.0, help="0 is greedy decoding, the papers' evaluation (default 0)"
    )
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default 1: off)")
    p.add_argument(
        "--max-new-tokens",
        type=int,
        default=DEFAULT_MAX_NEW_TOKENS,
        help=f"tokens per turn (default {DEFAULT_MAX_NEW_TOKENS})",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=DEFAULT_MAX_PROMPT_TOKENS,
        help=f"longest prompt (default {DEFAULT_MAX_PROMPT_TOKENS}, the papers')",
    )
    p.add_argument(
        "--max-response-tokens",
        type=int,
        default=DEFAULT_MAX_RESPONSE_TOKENS,
        help=f"token budget after the prompt, tool results included (default {DEFAULT_MAX_RESPONSE_TOKENS}, the papers')",
    )
    p.add_argument(
        "--concurrency",
        type=int,
        default=DEFAULT_CONCURRENCY,
        help=f"episodes in flight, also the engine's batch size (default {DEFAULT_CONCURRENCY})",
    )
    p.add_argument("--episode-timeout", type=float, help="seconds per episode before it is recorded as a timeout")
    p.add_argument("--seed", type=int, help="seed of sampled decoding (each episode and turn gets its own)")
    p.add_argument("--device", default="cpu", help="device of --engine hf (default cpu)")
    p.add_argument(
        "--base-url",
        help="server of --engine openai, e.g. http://127.0.0.1:8000/v1 (an API key is read from $OPENAI_API_KEY)",
    )
    p.add_argument("--tokenizer", help="tokenizer name or folder when it differs from --model (e.g. a served model's)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    p.add_argument(
        "--save-trajectories",
        type=Path,
        metavar="PATH",
        help="write every episode as a JSON line (ids, mask, logprobs, reward, text, ...)",
    )
    p.add_argument("--transcripts", type=int, default=1, help="how many episode transcripts to print (default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    _add_judge_options(p)
    p.set_defaults(run=_run_eval)


def _add_judge_options(p: argparse.ArgumentParser) -> None:
    from agentenv.judge import DEFAULT_ATTEMPTS, DEFAULT_TIMEOUT
    from agents.evaluation import GRADERS
    from agents.judge import DEFAULT_JUDGE_MAX_TOKENS

    p.add_argument(
        "--grader",
        choices=GRADERS,
        default="em",
        help="em: the env's grade (exact match, the default); judge: an LLM judge decides each answer too, with the "
        "prompt and verdict rule of ARPO's and AEPO's evaluation (needs --judge-model)",
    )
    judge = p.add_argument_group("the LLM judge (with --grader judge)")
    judge.add_argument(
        "--judge-model", help="the judge model: a name, local folder or Hugging Face id, or a served model"
    )
    judge.add_argument(
        "--judge-engine",
        choices=ENGINES,
        help="engine of the judge model (default: --engine; the same engine is "
        "shared when the judge is the --model itself)",
    )
    judge.add_argument("--judge-base-url", help="server of --judge-engine openai (default --base-url)")
    judge.add_argument("--judge-tokenizer", help="the judge model's tokenizer when it differs from --judge-model")
    judge.add_argument(
        "--judge-max-tokens",
        type=int,
        default=DEFAULT_JUDGE_MAX_TOKENS,
        help=f"tokens the judge may generate per answer (default {DEFAULT_JUDGE_MAX_TOKENS})",
    )
    judge.add_argument(
        "--judge-timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help=f"seconds per judge call before it fails (default {DEFAULT_TIMEOUT:g}; {DEFAULT_ATTEMPTS} tries per answer)",
    )
    judge.add_argument(
        "--judge-cache",
        type=Path,
        metavar="PATH",
        help="a JSONL file of verdicts, keyed by question, gold answers, answer and judge model: read, and appended to",
    )
    judge.add_argument(
        "--judge-unparsable",
        choices=("unjudged", "incorrect"),
        default="unjudged",
        help="a reply that says neither correct nor incorrect: unjudged (default, counted apart) or incorrect (ARPO's)",
    )


def _check_eval_args(args: argparse.Namespace) -> list[str]:
    env_ids = [e.strip() for e in args.env.split(",") if e.strip()]
    if not env_ids:
        raise ValueError("--env needs at least one environment id")
    import agentenv

    for env_id in env_ids:
        agentenv.spec(env_id)  # UnknownEnvError lists the registered ids
    for name in ("limit", "samples", "max_new_tokens", "concurrency", "max_prompt_tokens", "max_response_tokens"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.transcripts < 0:
        raise ValueError(f"--transcripts must be >= 0, got {args.transcripts}")
    if args.samples > 1 and args.temperature == 0:
        raise ValueError(
            f"--samples {args.samples} with greedy decoding repeats one answer; add --temperature 1.0 for pass@k"
        )
    _check_judge_args(args)
    return env_ids


_JUDGE_FLAGS = ("judge_model", "judge_engine", "judge_base_url", "judge_tokenizer", "judge_cache")


def _check_judge_args(args: argparse.Namespace) -> None:
    if args.grader != "judge":
        given = [f"--{name.replace('_', '-')}" for name in _JUDGE_FLAGS if getattr(args, name) is not None]
        if given:
            verb = "applies" if len(given) == 1 else "apply"
            raise ValueError(f"{', '.join(given)} {verb} only with --grader judge (the grader is {args.grader!r})")
        return
    if not args.judge_model:
        raise ValueError(
            "--grader judge needs --judge-model: a local model (e.g. smollm2-135m), or the model a server serves "
            "with --judge-engine openai --judge-base-url URL"
        )
    if args.judge_engine == "openai" and not (args.judge_base_url or args.base_url):
        raise ValueError("a judge on --judge-engine openai needs --judge-base-url (e.g. http://127.0.0.1:8001/v1)")
    if args.judge_max_tokens < 1:
        raise ValueError(f"--judge-max-tokens must be >= 1, got {args.judge_max_tokens}")
    if not args.judge_timeout > 0:
        raise ValueError(f"--judge-timeout must be > 0 seconds, got {args.judge_timeout}")


def _make_judge(args: argparse.Namespace, engine: Engine) -> tuple[Any, Engine | None]:
    """The judge of ``--grader judge``, and its engine when it is not the policy's (to close)."""
    from agents.judge import engine_judge

    kind = args.judge_engine or args.engine
    base_url = args.judge_base_url or args.base_url
    shared = (args.judge_model, kind, base_url, args.judge_tokenizer) == (
        args.model,
        args.engine,
        args.base_url,
        args.tokenizer,
    )
    judge_engine = (
        engine
        if shared
        else make_engine(
            kind,
            args.judge_model,
            concurrency=args.concurrency,
            device=args.device,
            base_url=base_url,
            tokenizer=args.judge_tokenizer,
            seed=args.seed,
        )
    )
    tokenizer = getattr(judge_engine, "tokenizer", None) or load_tokenizer(args.judge_tokenizer or args.judge_model)
    judge = engine_judge(
        judge_engine,
        tokenizer,
        args.judge_model,
        max_new_tokens=args.judge_max_tokens,
        timeout=args.judge_timeout,
        unparsable=args.judge_unparsable,
        max_concurrency=args.concurrency,
        cache_file=args.judge_cache,
    )
    return judge, None if shared else judge_engine


def _run_eval(args: argparse.Namespace) -> int:
    from agents.evaluation import evaluate, transcript
    from agents.rollout import RolloutConfig

    env_ids = _check_eval_args(args)
    env_kwargs = parse_overrides(args.env_args, flag="--env-arg", example="require_boxed=false")
    if env_kwargs:  # the registered defaults need no check; given options are checked before the model loads
        _check_env_options(env_ids, env_kwargs, "--env-arg")
    sampling = SamplingParams(
        temperature=args.temperature, top_p=args.top_p, max_new_tokens=args.max_new_tokens, seed=args.seed
    )
    rollout = RolloutConfig(
        sampling=sampling,
        concurrency=args.concurrency,
        episode_timeout=args.episode_timeout,
        max_prompt_tokens=args.max_prompt_tokens,
        max_response_tokens=args.max_response_tokens,
        keep_states=False,
    )
    for path in (args.json, args.save_trajectories):
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
    engine = make_engine(
        args.engine,
        args.model,
        concurrency=args.concurrency,
        device=args.device,
        base_url=args.base_url,
        tokenizer=args.tokenizer,
        seed=args.seed,
    )
    tokenizer = getattr(engine, "tokenizer", None) or load_tokenizer(args.tokenizer or args.model)
    judge, judge_engine = _make_judge(args, engine) if args.grader == "judge" else (None, None)

    async def run() -> Any:
        try:
            return await evaluate(
                engine,
                tokenizer,
                env_ids,
                limit=args.limit,
                samples=args.samples,
                rollout=rollout,
                env_kwargs=env_kwargs,
                on_trajectory=save,
                progress=not args.no_progress,
                judge=judge,
            )
        finally:
            await engine.close()
            if judge_engine is not None:
                await judge_engine.close()

    trajectories_file = args.save_trajectories.open("w", encoding="utf-8") if args.save_trajectories else None

    def save(trajectory) -> None:
        if trajectories_file is not None:
            record = trajectory.to_dict(tokenizer)
            if "judge" in trajectory.info:
                record["judge"] = trajectory.info["judge"]
            trajectories_file.write(json.dumps(record) + "\n")
            trajectories_file.flush()

    try:
        report = asyncio.run(run())
    finally:
        if trajectories_file is not None:
            trajectories_file.close()

    for trajectory in report.trajectories[: args.transcripts]:
        print(f"=== transcript: {trajectory.key[0]} question {trajectory.key[1]} sample {trajectory.key[2]}")
        print(transcript(trajectory, tokenizer))
        print()
    episodes = len(report.trajectories)
    print(
        f"=== {args.model} on {', '.join(env_ids)} ({args.engine}, "
        f"{'greedy' if sampling.greedy else f'temperature {sampling.temperature}'}, {args.samples} sample(s) per "
        f"question, {episodes} episodes in {report.seconds:.1f} s)"
    )
    print(report.table())
    if report.judge is not None:
        _print_judge(report)
    if args.json is not None:
        result = {"model": args.model, "engine": args.engine, "envs": env_ids, "limit": args.limit, **report.to_dict()}
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"results written to {args.json}")
    if args.save_trajectories is not None:
        print(f"{episodes} trajectories written to {args.save_trajectories}")
    return 0


def _print_judge(report: Any) -> None:
    """What the judge did and cost, and why answers went unjudged (never silently scored)."""
    j = report.judge
    print(
        f"judge {j['model']}: {j['requests']} answers; {j['calls']} model calls ({j['failed_calls']} failed), "
        f"{j['cached']} from the cache, {j['exact']} identical to a gold answer, {j['no_answer']} without an answer; "
        f"{j['prompt_tokens']} prompt + {j['completion_tokens']} generated tokens in {j['seconds']:.1f} s of calls"
    )
    unjudged = [(q, s) for r in report.envs.values() for q in r.questions for s in q.samples if s.judge == "unjudged"]
    if unjudged:
        question, sample = unjudged[0]
        print(
            f"{len(unjudged)} answers unjudged (left out of judge % and pass@k); first, {question.env_id} "
            f"question {question.index}: {sample.judge_detail}"
        )


# -- agents train -----------------------------------------------------------------------------

# Flags that set a top-level TrainConfig value (argparse dest -> config key); unset flags leave it.
# Flags of the cluster section: argparse name -> ClusterConfig field.
_CLUSTER_FLAGS = {
    "trainer_ranks": "trainer_ranks",
    "rollout_workers": "rollout_workers",
    "tensor_parallel_size": "tensor_parallel_size",
    "placement": "placement",
    "ray_address": "address",
}
_TRAIN_FLAGS = (
    "algo",
    "env",
    "model",
    "engine",
    "device",
    "steps",
    "prompts_per_step",
    "seed",
    "holdout",
    "eval_questions",
    "eval_every",
    "checkpoint_every",
    "keep_checkpoints",
    "max_staleness",
    "dynamic_sampling",
    "max_sampled_prompts",
    "min_round_prompts",
    "max_rollout_tokens",
)
# The names of agents.learners.LEARNERS, written out because importing that module loads torch, which
# `agents train --help` must not wait for. --algo takes any name of LEARNERS (agents.config.build checks
# it before anything loads); tests/agents/test_cli.py checks this list against LEARNERS.
_LEARNER_NAMES = ("at2po", "aepo", "grpo", "tree-grpo", "arpo")
_KEEP_ALL = "all"


def _keep_count(text: str) -> int | str:
    """``--keep-checkpoints``: a count >= 1, or ``all`` (every checkpoint stays)."""
    if text == _KEEP_ALL:
        return text
    try:
        count = int(text)
    except ValueError:
        count = 0
    if count < 1:
        raise argparse.ArgumentTypeError(
            f"takes a number >= 1 (the newest checkpoint always stays) or {_KEEP_ALL!r}, got {text!r}"
        )
    return count


def _add_train(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Train a policy with rollout trees, credit assignment and a policy loss. Settings come from the "
        "defaults (the papers' budgets), then --preset, then --config FILE, then the flags, then --set; "
        "the effective configuration is saved as OUT/config.json."
    )
    _add_train_what(p)
    _add_train_schedule(p)
    _add_train_folder(p)
    _add_train_cluster(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(run=_run_train)


def _add_train_what(p: argparse.ArgumentParser) -> None:
    """What to train on what: the learner, environment, model and engine, and where the settings come from."""
    p.add_argument(
        "--algo", metavar="NAME", help=f"the learner: {', '.join(_LEARNER_NAMES)} (default {TrainConfig.algo})"
    )
    p.add_argument("--env", help=f"environment id (default {TrainConfig.env}; agentenv list shows them)")
    p.add_argument("--model", help=f"model name, local folder or Hugging Face id (default {DEFAULT_MODEL})")
    p.add_argument(
        "--engine",
        choices=ENGINES,
        help="generation engine: hf shares the trainer's model, vllm gets the weights after every step (default hf; "
        "openai serves a model it cannot change, so it is for agents eval only)",
    )
    p.add_argument(
        "--preset",
        choices=list(PRESETS),
        help="paper: the AT2PO tables' setting; cpu-demo: a few minutes on 2 CPU cores with the embedded model; "
        "cpu-arithmetic: python-math:arithmetic from a cold start (default: none, the papers' budgets)",
    )
    p.add_argument("--config", type=Path, metavar="FILE", help="a YAML or JSON config file (the layout of config.json)")
    p.add_argument(
        "--set",
        dest="assignments",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any setting by its dotted name, e.g. trainer.lr=1e-5, strategy.K=3, loss.eps_high=0.28, "
        "sampling.max_new_tokens=256, env_kwargs.reward=f1 (repeatable)",
    )


def _add_train_schedule(p: argparse.ArgumentParser) -> None:
    """How long the run trains, on which tasks, and when it evaluates and checkpoints."""
    demo = PRESETS["cpu-demo"]["common"]

    def default(name: str) -> str:
        return f"default {getattr(TrainConfig, name)}; --preset cpu-demo: {demo[name]}"

    p.add_argument("--steps", type=int, help=f"rollout batches to train on ({default('steps')})")
    p.add_argument("--prompts-per-step", type=int, help=f"prompts per rollout batch ({default('prompts_per_step')})")
    p.add_argument(
        "--dynamic-sampling",
        action="store_const",
        const=True,
        help="replace each prompt whose leaves all score the same (advantage 0) by the next task, until the "
        "step has --prompts-per-step with signal (DAPO; default off)",
    )
    p.add_argument(
        "--max-sampled-prompts",
        type=int,
        metavar="N",
        help="the most prompts a step rolls out under --dynamic-sampling (default 3 × --prompts-per-step)",
    )
    p.add_argument(
        "--min-round-prompts",
        type=int,
        metavar="N",
        help="the fewest prompts a round of --dynamic-sampling rolls out at once, the order's next tasks after the "
        "step's (fills the engine's batches; default 1: only what the signal rate asks)",
    )
    p.add_argument(
        "--max-rollout-tokens",
        type=int,
        metavar="N",
        help="end the run after the step at which the tokens sampled so far reach N, or after --steps, whichever "
        "is first (a rollout budget: learners compared at equal tokens; default: --steps only)",
    )
    p.add_argument("--seed", type=int, help=f"seed of the task order and the rollouts (default {TrainConfig.seed})")
    p.add_argument("--holdout", type=int, help=f"the env's first N tasks are never trained on ({default('holdout')})")
    p.add_argument(
        "--eval-questions",
        type=int,
        help=f"held-out questions evaluated before, during and after ({default('eval_questions')})",
    )
    p.add_argument(
        "--eval-every",
        type=int,
        help=f"evaluate every N steps (0: before and after only; default {TrainConfig.eval_every})",
    )
    p.add_argument(
        "--checkpoint-every",
        type=int,
        help=f"checkpoint every N steps and after the last ({default('checkpoint_every')})",
    )
    p.add_argument(
        "--keep-checkpoints",
        type=_keep_count,
        metavar="N",
        help="keep the newest N intact checkpoints, removing older ones as new ones come (each is the model and "
        f"its optimiser state: 1.6 GB for the embedded model); {_KEEP_ALL} keeps every one "
        f"(default {TrainConfig.keep_checkpoints})",
    )


def _add_train_folder(p: argparse.ArgumentParser) -> None:
    """Where the run goes and reports, resuming it, and the flags that print instead of training."""
    p.add_argument("--device", help="device of the trainer's model (default: cuda if present, else cpu)")
    p.add_argument("--out", type=Path, help="the run folder (default runs/ALGO-ENV-TIME)")
    p.add_argument(
        "--report-to",
        nargs="+",
        metavar="NAME",
        help="where metrics go besides OUT/metrics.jsonl: tensorboard (OUT/tensorboard/), wandb (Weights & Biases, "
        "files in OUT/wandb/; WANDB_MODE=offline needs no network), several at once, or none "
        "(default tensorboard; trainer.report_to)",
    )
    p.add_argument(
        "--wandb-project",
        metavar="NAME",
        help="the W&B project (default $WANDB_PROJECT, else agentenv); the W&B run is named after the run folder",
    )
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run in --out from its newest intact checkpoint (a damaged one is skipped, with a note)",
    )
    p.add_argument(
        "--print-config",
        action="store_true",
        help="print the effective configuration and exit (after checking it, the environment's options included)",
    )
    p.add_argument(
        "--plan",
        action="store_true",
        help="print the estimated memory per device (trainer weights, gradients, optimizer, activations, engine) "
        "and whether the run fits, then exit",
    )
    p.add_argument(
        "--device-memory",
        type=float,
        metavar="GIB",
        help="with --plan: the GPU's memory in GiB (default: the CUDA device here, if any)",
    )


def _add_train_cluster(p: argparse.ArgumentParser) -> None:
    """The cluster section's flags: trainer ranks, rollout workers, placement, asynchronous steps."""
    cluster = p.add_argument_group("scale-out (the cluster section; default: one process)")
    cluster.add_argument("--trainer-ranks", type=int, help="trainer processes, one FSDP2 group (default 1)")
    cluster.add_argument("--rollout-workers", type=int, help="Ray actors that each own an engine (default 0)")
    cluster.add_argument("--tensor-parallel-size", type=int, help="GPUs of each rollout worker's vLLM (default 1)")
    cluster.add_argument("--placement", choices=PLACEMENTS, help="colocated (default) or split GPUs")
    cluster.add_argument(
        "--max-staleness",
        type=int,
        metavar="ETA",
        help="asynchronous training: roll out up to ETA steps ahead of the trainer (needs --rollout-workers; "
        "default 0, synchronous)",
    )
    cluster.add_argument(
        "--ray-address", help="local (default: start Ray here) or auto (join the cluster of `ray start`)"
    )


def _check_env_options(env_ids: Sequence[str], env_kwargs: Mapping[str, Any], source: str) -> None:
    """Make each environment with ``env_kwargs`` once (then close it), so that a bad option is reported in one
    line before any model loads; ``source`` says where the options came from."""
    import agentenv

    for env_id in env_ids:
        try:
            agentenv.make(env_id, **env_kwargs).close()
        except (TypeError, ValueError) as error:
            options = ", ".join(f"{name}={value!r}" for name, value in env_kwargs.items())
            raise ValueError(f"{env_id} with the options {options} (from {source}): {error}") from None


def _cpu_budget_warning(config: TrainConfig, parts: RunParts) -> str:
    """What the papers' budget, which a run without --preset gets, costs on a CPU, against the cpu-demo's."""
    demo = PRESETS["cpu-demo"]["common"]
    trees, demo_trees = config.steps * config.prompts_per_step, demo["steps"] * demo["prompts_per_step"]
    tokens, demo_tokens = parts.tree.rollout.max_response_tokens, demo["rollout"]["max_response_tokens"]
    return (
        f"warning: no --preset and no GPU here, so this is the papers' budget on the CPU: {config.steps} steps of "
        f"{config.prompts_per_step} prompts, {trees:,} rollout trees ({trees / demo_trees:,.0f}x the {demo_trees} of "
        f"--preset cpu-demo, which take minutes on two cores), responses of up to {tokens} tokens "
        f"({tokens / demo_tokens:.0f}x the demo's {demo_tokens}) and {config.eval_questions} held-out questions "
        "before and after. For a first run add --preset cpu-demo; --print-config shows every value"
    )


def _trains_on_cpu(config: TrainConfig) -> bool:
    if config.device is not None:
        return str(config.device).startswith("cpu")
    import torch

    return not torch.cuda.is_available()


def _run_train(args: argparse.Namespace) -> int:
    import agentenv

    if args.resume and args.out is None:
        raise ValueError("--resume needs --out, the folder of the run to continue")
    values: dict[str, Any] = {name: getattr(args, name) for name in _TRAIN_FLAGS if getattr(args, name) is not None}
    if values.get("keep_checkpoints") == _KEEP_ALL:
        values["keep_checkpoints"] = None  # the config's "every checkpoint"
    cluster = {field: getattr(args, flag) for flag, field in _CLUSTER_FLAGS.items() if getattr(args, flag) is not None}
    if cluster:
        values["cluster"] = cluster
    trainer: dict[str, Any] = {}
    if args.report_to is not None:
        trainer["report_to"] = list(check_report_to(args.report_to, "--report-to"))
    if args.wandb_project is not None:
        trainer["wandb_project"] = args.wandb_project
    if trainer:
        values["trainer"] = trainer
    base = None
    if args.resume:
        from agents.run_folder import saved_config  # loads torch (checkpoints)

        base = saved_config(args.out)
    config = resolve(
        base=base,
        preset_name=args.preset,
        file=args.config,
        values=values,
        assignments=args.assignments,
    )
    agentenv.spec(config.env)  # an unknown id: UnknownEnvError lists the registered ones, before anything loads
    if config.env_kwargs:
        _check_env_options([config.env], config.env_kwargs, "env_kwargs: --preset, --config or --set env_kwargs.NAME")
    # A run builds its parts itself, before anything else (and on --resume after checking the run's algo,
    # whose sections another learner would reject less clearly), so only what prints them builds them here.
    if args.print_config:
        print(json.dumps(effective_config(config, build(config)).to_dict(), indent=2))
        return 0
    if args.plan:
        plan, settings = run_plan(config, build(config), device_gib=args.device_memory)
        print(f"=== memory plan: {config.model}, {config.algo}, engine {config.engine}")
        print(plan.table())
        flags = set_flags(settings)
        if settings and plan.fits:
            print(f"as configured it does not fit; it fits with: {flags}")
        elif settings:
            print(f"it does not fit, not even with: {flags}; choose a smaller model or a device with more memory")
        return 0 if plan.fits is not False else 1
    if args.preset is None and args.config is None and not args.resume and _trains_on_cpu(config):
        print(_cpu_budget_warning(config, build(config)), file=sys.stderr)
    out = args.out or Path("runs") / f"{config.algo}-{config.env.replace('/', '_')}-{time.strftime('%Y%m%d-%H%M%S')}"
    print(
        f"=== agents train --algo {config.algo} on {config.env} with {config.model} ({config.engine}): "
        f"{config.steps} steps of {config.prompts_per_step} prompts; run folder {out}",
        flush=True,  # before the progress lines on stderr, in a log file of both
    )
    from agents.heldout import comparison_table
    from agents.train import train

    result = asyncio.run(train(config, out, resume=args.resume, progress=False if args.no_progress else None))

    if len(result.heldout) >= 2:
        first, last = result.heldout[0], result.heldout[-1]
        print("\n=== held-out questions (greedy; never trained on), before and after training, 95% intervals")
        print(comparison_table([first, last], [f"before (step {first.step})", f"after (step {last.step})"]))
    elif result.heldout:  # eval_before=false: the model given was scored elsewhere (e.g. by agents sft)
        (last,) = result.heldout
        print("\n=== held-out questions (greedy; never trained on), after training, 95% intervals")
        print(comparison_table([last], [f"after (step {last.step})"]))
    reporters = "".join(f", {name}/" for name in ("tensorboard", "wandb") if (out / name).is_dir())
    print(f"\nrun folder:  {out}  (config.json, metrics.jsonl{reporters}, heldout/)")
    print(f"curves:      {out / 'curves.png'}" + (f", {out / 'heldout.png'}" if result.heldout else ""))
    if result.checkpoint is not None:
        print(f"checkpoint:  {result.checkpoint}")
        print(
            f"evaluate it: agents eval --env {config.env} --model {result.checkpoint / 'model'} "
            f"--limit {max(config.eval_questions, 1)}"
        )
    return 0


# -- agents sft -------------------------------------------------------------------------------


def _add_sft(p: argparse.ArgumentParser) -> None:
    from agents.sft import SFTConfig

    p.description = (
        "Supervised fine-tuning on tool-use examples, the cold start before RL: the mean NLL of the action "
        "(assistant) tokens, with the trainer, metrics and checkpoints of agents train. --data is a JSONL file of "
        'trajectories (agents eval --save-trajectories) or chats ({"messages": [...]}); the final model '
        "folder is what agents eval --model and agents train --model take."
    )
    p.add_argument("--data", type=Path, required=True, metavar="FILE", help="the JSONL file of examples")
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"model name, local folder or Hugging Face id to start from (default {DEFAULT_MODEL})",
    )
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="the run folder")
    p.add_argument(
        "--min-reward",
        type=float,
        metavar="R",
        help="keep the trajectories whose reward is >= R (e.g. 1: the correct ones; default all)",
    )
    p.add_argument("--epochs", type=int, help=f"passes over the examples (default {SFTConfig.epochs})")
    p.add_argument("--lr", type=float, help=f"AdamW learning rate (default {SFTConfig.lr:g})")
    p.add_argument(
        "--batch-size", type=int, metavar="B", help=f"examples per optimiser step (default {SFTConfig.batch_size})"
    )
    p.add_argument(
        "--micro-batch-size",
        type=int,
        metavar="M",
        help=f"examples per forward/backward pass; memory only (default {SFTConfig.micro_batch_size})",
    )
    p.add_argument(
        "--max-tokens",
        type=int,
        metavar="T",
        help=f"longer examples are dropped and counted (default {SFTConfig.max_tokens}, RL's longest sequence)",
    )
    p.add_argument(
        "--observations",
        choices=("inline", "turn"),
        help="how chats are laid out, as TokenEnv lays out RL's episodes: inline (tool results in the assistant "
        "turn, the default) or turn (every message a turn of the chat template)",
    )
    p.add_argument("--seed", type=int, help=f"seed of each epoch's order (default {SFTConfig.seed})")
    p.add_argument(
        "--checkpoint-every", type=int, metavar="N", help="checkpoint every N steps too (default: after the last only)"
    )
    p.add_argument("--device", help="device of the model (default: cuda if present, else cpu)")
    p.add_argument(
        "--report-to",
        nargs="+",
        metavar="NAME",
        help="where metrics go besides OUT/metrics.jsonl: tensorboard (the default), wandb, several, or none",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    _add_run_settings(
        p,
        "its held-out evaluation: with any of these flags the run's held-out questions are scored before the first "
        "step and after the last, as agents train scores them",
    )
    p.set_defaults(run=_run_sft)


# Flags of agents sft that set an SFTConfig field of the same name; unset flags leave its default.
_SFT_FLAGS = (
    "epochs",
    "lr",
    "batch_size",
    "micro_batch_size",
    "max_tokens",
    "min_reward",
    "observations",
    "seed",
    "checkpoint_every",
    "device",
    "report_to",
)


def _run_sft(args: argparse.Namespace) -> int:
    if not args.data.is_file():
        raise FileNotFoundError(
            f"--data {args.data}: no such file (a JSONL file of trajectories from agents eval --save-trajectories, "
            "or of chats)"
        )
    from agents.sft import SFTConfig, sft

    values = {name: getattr(args, name) for name in _SFT_FLAGS if getattr(args, name) is not None}
    if "report_to" in values:
        values["report_to"] = check_report_to(values["report_to"], "--report-to")
    config = SFTConfig(**values)
    run_flags = (args.env, args.preset, args.config, args.holdout, args.eval_questions)
    heldout = _run_settings(args) if args.assignments or any(flag is not None for flag in run_flags) else None
    print(f"=== agents sft on {args.data} from {args.model}; run folder {args.out}", flush=True)
    progress = False if args.no_progress else None
    result = asyncio.run(sft(args.data, args.model, args.out, config, heldout=heldout, progress=progress))
    reporters = "".join(f", {name}/" for name in ("tensorboard", "wandb") if (args.out / name).is_dir())
    print(f"\nrun folder:  {args.out}  (sft.json, metrics.jsonl{reporters})")
    print(f"curves:      {args.out / 'curves.png'}")
    print(f"final model: {result.model_dir}")
    print(f"RL from it:  agents train --model {result.model_dir} --out RUN ...")
    if len(result.heldout) == 2:
        from agents.heldout import comparison_table

        first, last = result.heldout
        print("\n=== held-out questions (greedy; never trained on), before and after fine-tuning, 95% intervals")
        print(comparison_table([first, last], ["before (step 0)", f"after sft (step {last.step})"]))
    return 0


# -- the RL run a cold start is for (agents demonstrations, agents sft) ---------------------------


def _add_run_settings(p: argparse.ArgumentParser, uses: str) -> None:
    """The settings of the ``agents train`` run that this command prepares, taken as ``agents train`` takes them."""
    group = p.add_argument_group(
        "the RL run this is for",
        f"agents train's settings, resolved as agents train resolves them (defaults, --preset, --config, the "
        f"flags, --set); this command uses {uses}. Give the same ones to agents train.",
    )
    group.add_argument("--env", help=f"environment id (default {TrainConfig.env})")
    group.add_argument("--preset", choices=list(PRESETS), help="cpu-demo or paper, as agents train --preset")
    group.add_argument("--config", type=Path, metavar="FILE", help="a YAML or JSON config file, as agents train's")
    group.add_argument(
        "--set",
        dest="assignments",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting by its dotted name, e.g. env_kwargs.example=false (repeatable)",
    )
    group.add_argument(
        "--holdout", type=int, help=f"the env's first N tasks are never trained on (default {TrainConfig.holdout})"
    )
    group.add_argument("--eval-questions", type=int, help="held-out questions evaluated (0: none)")


def _run_settings(args: argparse.Namespace) -> TrainConfig:
    """The ``agents train`` config that :func:`_add_run_settings`'s flags describe, its env options checked."""
    import agentenv

    values = {
        name: getattr(args, name) for name in ("env", "holdout", "eval_questions") if getattr(args, name) is not None
    }
    config = resolve(preset_name=args.preset, file=args.config, values=values, assignments=args.assignments)
    agentenv.spec(config.env)  # an unknown id: UnknownEnvError lists the registered ones
    if config.env_kwargs:
        _check_env_options([config.env], config.env_kwargs, "env_kwargs: --preset, --config or --set env_kwargs.NAME")
    return config


# -- agents demonstrations ---------------------------------------------------------------------


def _add_demonstrations(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Write the cold start's examples for agents sft: each training task of the RL run's environment played "
        "with the environment's own demo actions (search for the question, answer with the gold answer) through "
        "its real tools, kept when the answer is in what the tools returned. Chats, one per line of OUT."
    )
    p.add_argument("--out", type=Path, required=True, metavar="FILE", help="the JSONL file to write")
    p.add_argument("--limit", type=int, metavar="N", help="play at most N training tasks (default all)")
    _add_run_settings(p, "the environment, its options and --holdout (the tasks after the held-out ones are played)")
    p.set_defaults(run=_run_demonstrations)


def _run_demonstrations(args: argparse.Namespace) -> int:
    config = _run_settings(args)
    counts = write_demonstrations(
        config.env, args.out, env_kwargs=config.env_kwargs, holdout=config.holdout, limit=args.limit
    )
    print(f"{counts.summary()}; written to {args.out}")
    if counts.written:
        print(f"fine-tune on them: agents sft --data {args.out} --out RUN ...")
    return 0


# -- the command --------------------------------------------------------------------------------


# -- agents compare -----------------------------------------------------------------------------


def _add_compare(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Compare two held-out evaluations of the same questions, saved in run folders, question by question: "
        "each score before and after, and the mean difference with a paired bootstrap 95%% interval."
    )
    p.add_argument(
        "before", help="RUN (its last held-out evaluation) or RUN@STEP (after STEP steps; 0: before training)"
    )
    p.add_argument("after", help="the same, for the evaluation compared with it")
    p.add_argument("--labels", nargs=2, metavar=("BEFORE", "AFTER"), help="column names (default: the two arguments)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the numbers as JSON")
    p.set_defaults(run=_run_compare)


def _run_compare(args: argparse.Namespace) -> int:
    from agents.heldout import paired_table, read_evaluation

    before, after = read_evaluation(args.before), read_evaluation(args.after)
    labels = tuple(args.labels) if args.labels else (args.before, args.after)
    table, numbers = paired_table(before, after, labels)
    print(table)
    if args.json is not None:
        report = {"before": args.before, "after": args.after, "questions": before.questions, "scores": numbers}
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


@dataclass(frozen=True)
class Command:
    """One subcommand of ``agents``.

    Attributes:
        name: The word after ``agents``.
        help: Its line in ``agents --help``.
        add_arguments: Gives its parser a description, the options and the handler
            (``set_defaults(run=handler)``; the handler returns the exit code). Called only for the
            subcommand being run, so what its options need is imported only then.
    """

    name: str
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]


#: The subcommands, in the order ``agents --help`` lists them.
COMMANDS: list[Command] = [
    Command("eval", "evaluate a model on environments (EM, F1, pass@k)", _add_eval),
    Command("train", "train a learner (AT2PO, AEPO, GRPO, Tree-GRPO, ARPO) on an environment", _add_train),
    Command("sft", "fine-tune a model on tool-use trajectories or chats (a cold start before RL)", _add_sft),
    Command("compare", "compare two held-out evaluations question by question (paired intervals)", _add_compare),
    Command(
        "demonstrations",
        "write worked episodes of an environment's training tasks, for agents sft",
        _add_demonstrations,
    ),
]


def build_parser(commands: Collection[str] | None = None) -> argparse.ArgumentParser:
    """The ``agents`` argument parser: every subcommand of :data:`COMMANDS`, with the options of those
    named in ``commands`` (default: all of them; the others are listed but take no options)."""
    parser = argparse.ArgumentParser(prog="agents", description="Train and evaluate LLM agents that use tools.")
    parser.add_argument("--version", action="version", version=f"agents {version()}")
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help)
        if commands is None or command.name in commands:
            command.add_arguments(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``agents`` command; returns the exit code (2 for bad arguments, with the reason in one line)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    # The first word that is no option names the subcommand (the top level's options take no value).
    named = next((word for word in argv if not word.startswith("-")), None)
    parser = build_parser([named] if named is not None else [])
    args = parser.parse_args(argv)
    from agentenv import UnknownEnvError

    try:
        return args.run(args)
    except (
        ValueError,
        UnknownEnvError,
        ModelNotAvailableError,
        ImportError,
        FileExistsError,
        FileNotFoundError,
    ) as error:
        message = " ".join(str(error).split())  # one line, however the message was wrapped
        parser.exit(2, f"agents {args.command}: error: {message}\n")


if __name__ == "__main__":
    sys.exit(main())
