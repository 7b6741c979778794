"""``agents eval --grader judge``: the LLM judge's options, their checks, and the judge they build."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from agents.engines.base import Engine
from agents.engines.factory import ENGINES, make_engine
from agents.models import load_tokenizer

__all__ = ["add_judge_options", "check_judge_args", "make_judge", "print_judge"]


def add_judge_options(p: argparse.ArgumentParser) -> None:
    from agentenv.judge import DEFAULT_ATTEMPTS, DEFAULT_TIMEOUT
    from agents.eval.evaluation import GRADERS
    from agents.eval.judge import DEFAULT_JUDGE_MAX_TOKENS

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


_JUDGE_FLAGS = ("judge_model", "judge_engine", "judge_base_url", "judge_tokenizer", "judge_cache")


def check_judge_args(args: argparse.Namespace) -> None:
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


def make_judge(args: argparse.Namespace, engine: Engine) -> tuple[Any, Engine | None]:
    """The judge of ``--grader judge``, and its engine when it is not the policy's (to close)."""
    from agents.eval.judge import engine_judge

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


def print_judge(report: Any) -> None:
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
