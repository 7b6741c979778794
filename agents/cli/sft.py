"""``agents sft``: supervised fine-tuning on trajectories or chats, the cold start before RL.

    agents sft --data trajectories.jsonl --min-reward 1 --model smollm2-135m --out runs/cold-start

It runs :func:`agents.sft.train.sft` and prints where the final model is.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from agents.cli.config_flags import add_config_flags, given_fields
from agents.cli.run_settings import add_run_settings, given_run_settings, run_settings
from agents.models import DEFAULT_MODEL
from agents.training.reporting import check_report_to

__all__ = ["add_arguments", "run"]


def add_arguments(p: argparse.ArgumentParser) -> None:
    from agents.sft.train import SFTConfig

    p.description = (
        "Supervised fine-tuning on tool-use examples, the cold start before RL: the mean NLL of the action "
        "(assistant) tokens, with the trainer, metrics and checkpoints of agents train. --data is a JSONL file of "
        'trajectories (agents eval --save-trajectories) or chats ({"messages": [...]}); the final model '
        "folder is what agents eval --model and agents train --model take."
    )
    p.add_argument("--data", type=Path, required=True, metavar="FILE", help="The JSONL file of examples.")
    p.add_argument(
        "--model",
        default=DEFAULT_MODEL,
        help=f"Model name, local folder or Hugging Face id to start from (default {DEFAULT_MODEL}).",
    )
    p.add_argument("--out", type=Path, required=True, metavar="DIR", help="The run folder.")
    add_config_flags(
        p,
        SFTConfig,
        _SFT_FIELDS,
        metavars={"batch_size": "B", "micro_batch_size": "M", "max_tokens": "T", "min_reward": "R"},
    )
    p.add_argument("--no-progress", action="store_true", help="No progress bars.")
    add_run_settings(
        p,
        "its held-out evaluation: with any of these flags the run's held-out questions are scored before the first "
        "step and after the last, as agents train scores them",
    )
    p.set_defaults(run=run)


# SFTConfig's fields with a flag, in the order --help lists them; an unset flag leaves the field's default.
_SFT_FIELDS = (
    "min_reward",
    "epochs",
    "lr",
    "batch_size",
    "micro_batch_size",
    "max_tokens",
    "observations",
    "seed",
    "checkpoint_every",
    "device",
    "report_to",
)


def run(args: argparse.Namespace) -> int:
    if not args.data.is_file():
        raise FileNotFoundError(
            f"--data {args.data}: no such file (a JSONL file of trajectories from agents eval --save-trajectories, "
            "or of chats)"
        )
    from agents.sft.train import SFTConfig, sft

    values = given_fields(args, SFTConfig)
    if "report_to" in values:
        values["report_to"] = check_report_to(values["report_to"], "--report-to")
    config = SFTConfig(**values)
    heldout = run_settings(args) if given_run_settings(args) else None
    print(f"=== agents sft on {args.data} from {args.model}; run folder {args.out}", flush=True)
    progress = False if args.no_progress else None
    result = asyncio.run(sft(args.data, args.model, args.out, config, heldout=heldout, progress=progress))
    reporters = "".join(f", {name}/" for name in ("tensorboard", "wandb") if (args.out / name).is_dir())
    print(f"\nrun folder:  {args.out}  (sft.json, metrics.jsonl{reporters})")
    print(f"curves:      {args.out / 'curves.png'}")
    print(f"final model: {result.model_dir}")
    print(f"RL from it:  agents train --model {result.model_dir} --out RUN ...")
    if len(result.heldout) == 2:
        from agents.eval.heldout import comparison_table

        first, last = result.heldout
        print("\n=== held-out questions (greedy; never trained on), before and after fine-tuning, 95% intervals")
        print(comparison_table([first, last], ["before (step 0)", f"after sft (step {last.step})"]))
    return 0
