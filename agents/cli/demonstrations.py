"""``agents demonstrations``: worked episodes of an environment's training tasks, for ``agents sft``."""

from __future__ import annotations

import argparse
from pathlib import Path

from agents.cli.run_settings import add_run_settings, run_settings
from agents.sft.demonstrations import write_demonstrations

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Write the cold start's examples for agents sft: each training task of the RL run's environment played "
        "with the environment's own demo actions (search for the question, answer with the gold answer) through "
        "its real tools, kept when the answer is in what the tools returned. Chats, one per line of OUT."
    )
    p.add_argument("--out", type=Path, required=True, metavar="FILE", help="the JSONL file to write")
    p.add_argument("--limit", type=int, metavar="N", help="play at most N training tasks (default all)")
    add_run_settings(p, "the environment, its options and --holdout (the tasks after the held-out ones are played)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    config = run_settings(args)
    counts = write_demonstrations(
        config.env, args.out, env_kwargs=config.env_kwargs, holdout=config.holdout, limit=args.limit
    )
    print(f"{counts.summary()}; written to {args.out}")
    if counts.written:
        print(f"fine-tune on them: agents sft --data {args.out} --out RUN ...")
    return 0
