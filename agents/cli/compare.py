"""``agents compare``: two held-out evaluations of the same questions, question by question (paired intervals)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Compare two held-out evaluations of the same questions, saved in run folders, question by question: "
        "each score before and after, and the mean difference with a paired bootstrap 95% interval."
    )
    p.add_argument(
        "before", help="RUN (its last held-out evaluation) or RUN@STEP (after STEP steps; 0: before training)"
    )
    p.add_argument("after", help="the same, for the evaluation compared with it")
    p.add_argument("--labels", nargs=2, metavar=("BEFORE", "AFTER"), help="column names (default: the two arguments)")
    p.add_argument("--json", type=Path, metavar="PATH", help="write the numbers as JSON")
    p.add_argument(
        "--summary",
        metavar="SCORE",
        help="print one line for this score (f1, em, format_ok, reward, tool_calls) instead of the table",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from agents.eval.heldout import paired_line, paired_table, read_evaluation

    before, after = read_evaluation(args.before), read_evaluation(args.after)
    labels = tuple(args.labels) if args.labels else (args.before, args.after)
    table, numbers = paired_table(before, after, labels)
    print(paired_line(numbers, args.summary, labels, before.questions) if args.summary else table)
    if args.json is not None:
        report = {"before": args.before, "after": args.after, "questions": before.questions, "scores": numbers}
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0
