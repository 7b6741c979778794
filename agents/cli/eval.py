"""``agents eval``: a model on registered environments through the rollout loop (EM, F1, pass@k).

    agents eval --env multihop-qa --model smollm2-135m --limit 20
    agents eval --env multihop-qa:2wiki,singlehop-qa:nq --samples 4 --temperature 1 --json out.json
    agents eval --env web-research --grader judge --judge-model Qwen2.5-72B-Instruct \
        --judge-engine openai --judge-base-url http://127.0.0.1:8001/v1

It runs :func:`agents.eval.evaluation.evaluate` and prints a transcript and the results table; progress
goes to stderr. ``--grader judge`` also has every answer judged by an LLM (:mod:`agents.cli.judge`), as
AEPO and ARPO score their deep-search benchmarks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from agents.cli.judge import add_judge_options, check_judge_args, make_judge, print_judge
from agents.cli.run_settings import check_env_options
from agents.engines.base import DEFAULT_MAX_NEW_TOKENS, SamplingParams
from agents.engines.factory import ENGINES, make_engine
from agents.models import DEFAULT_MODEL, load_tokenizer
from agents.run.config import parse_overrides

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
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
    add_judge_options(p)
    p.set_defaults(run=run)


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
    check_judge_args(args)
    return env_ids


def run(args: argparse.Namespace) -> int:
    from agents.eval.evaluation import evaluate, transcript
    from agents.rollout import RolloutConfig

    env_ids = _check_eval_args(args)
    env_kwargs = parse_overrides(args.env_args, flag="--env-arg", example="require_boxed=false")
    if env_kwargs:  # the registered defaults need no check; given options are checked before the model loads
        check_env_options(env_ids, env_kwargs, "--env-arg")
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
    judge, judge_engine = make_judge(args, engine) if args.grader == "judge" else (None, None)

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
        print_judge(report)
    if args.json is not None:
        result = {"model": args.model, "engine": args.engine, "envs": env_ids, "limit": args.limit, **report.to_dict()}
        args.json.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        print(f"results written to {args.json}")
    if args.save_trajectories is not None:
        print(f"{episodes} trajectories written to {args.save_trajectories}")
    return 0
