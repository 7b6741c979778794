"""``agents sft``: supervised fine-tuning on trajectories or chats, the cold start before RL.

    agents sft --data trajectories.jsonl --min-reward 1 --model smollm2-135m --out runs/cold-start

It runs :func:`agents.sft.train.sft` and prints where the final model is.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from agents.cli.run_settings import add_run_settings, run_settings
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
    add_run_settings(
        p,
        "its held-out evaluation: with any of these flags the run's held-out questions are scored before the first "
        "step and after the last, as agents train scores them",
    )
    p.set_defaults(run=run)


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


def run(args: argparse.Namespace) -> int:
    if not args.data.is_file():
        raise FileNotFoundError(
            f"--data {args.data}: no such file (a JSONL file of trajectories from agents eval --save-trajectories, "
            "or of chats)"
        )
    from agents.sft.train import SFTConfig, sft

    values = {name: getattr(args, name) for name in _SFT_FLAGS if getattr(args, name) is not None}
    if "report_to" in values:
        values["report_to"] = check_report_to(values["report_to"], "--report-to")
    config = SFTConfig(**values)
    run_flags = (args.env, args.preset, args.config, args.holdout, args.eval_questions)
    heldout = run_settings(args) if args.assignments or any(flag is not None for flag in run_flags) else None
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
