"""``agents train``: a learner on an environment, from the defaults, a preset, a file, flags and ``--set``.

    agents train --algo at2po --env multihop-qa --model smollm2-135m --preset cpu-demo --out runs/demo
    agents train --out runs/demo --resume --steps 8
    agents train --algo grpo --config run.yaml --set trainer.lr=1e-5 --set strategy.n=8

It runs :func:`agents.run.train.train` with the configuration of :mod:`agents.run.config` and prints the
held-out scores before and after training.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agents.cli.config_flags import add_config_flags, given_fields
from agents.cli.run_settings import check_run_env
from agents.engines.factory import ENGINES
from agents.run.cluster.config import PLACEMENTS, ClusterConfig
from agents.run.config import PRESETS, RunParts, TrainConfig, build, effective_config, resolve
from agents.run.memory_plan import run_plan, set_flags
from agents.training.reporting import check_report_to

__all__ = ["add_arguments", "run"]


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


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of ``agents train``: one for each top-level field of :class:`TrainConfig` and the cluster
    section's most used fields, their help and defaults generated from the config classes
    (:mod:`agents.cli.config_flags`), and the command's own (where settings come from, the run folder)."""
    p.description = (
        "Train a policy with rollout trees, credit assignment and a policy loss. Settings come from the "
        "defaults (the papers' budgets), then --preset, then --config FILE, then the flags, then --set; "
        "the effective configuration is saved as OUT/config.json."
    )
    presets = {name: preset["common"] for name, preset in PRESETS.items()}

    def config_flags(group: argparse._ArgumentGroup, names: Sequence[str]) -> None:
        add_config_flags(
            group,
            TrainConfig,
            names,
            types={"keep_checkpoints": _keep_count},
            choices={"engine": ENGINES},
            metavars={"algo": "NAME", "keep_checkpoints": "N", "max_staleness": "ETA"},
            presets=presets,
        )

    what = p.add_argument_group("what to train, and where the settings come from")
    config_flags(what, ("algo", "env", "model", "engine", "device"))
    what.add_argument(
        "--preset",
        choices=list(PRESETS),
        help="Paper: the AT2PO tables' setting; cpu-demo: a few minutes on 2 CPU cores with the embedded model; "
        "cpu-arithmetic: python-math:arithmetic from a cold start (default: none, the papers' budgets).",
    )
    what.add_argument(
        "--config", type=Path, metavar="FILE", help="A YAML or JSON config file (the layout of config.json)."
    )
    what.add_argument(
        "--set",
        dest="assignments",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="Any setting by its dotted name, e.g. trainer.lr=1e-5, strategy.K=3, loss.eps_high=0.28, "
        "sampling.max_new_tokens=256, env_kwargs.reward=f1 (repeatable).",
    )
    schedule = p.add_argument_group("how long, on which tasks, and when it evaluates and checkpoints")
    config_flags(schedule, _SCHEDULE_FIELDS)
    _add_train_folder(p.add_argument_group("the run folder, and the flags that print instead of training"))
    cluster = p.add_argument_group("scale-out (the cluster section; default: one process, no Ray)")
    add_config_flags(
        cluster,
        ClusterConfig,
        _CLUSTER_FIELDS,
        dest_prefix="cluster.",
        flags={"address": "--ray-address"},
        choices={"placement": PLACEMENTS},
    )
    config_flags(cluster, ("max_staleness", "stream_update"))
    p.add_argument("--no-progress", action="store_true", help="No progress bars.")
    p.set_defaults(run=run)


# TrainConfig's fields of the schedule group, in the order --help lists them.
_SCHEDULE_FIELDS = (
    "steps",
    "prompts_per_step",
    "dynamic_sampling",
    "max_sampled_prompts",
    "min_round_prompts",
    "max_rollout_tokens",
    "budget_reward",
    "seed",
    "holdout",
    "eval_questions",
    "eval_before",
    "eval_every",
    "eval_at_tokens",
    "checkpoint_every",
    "keep_checkpoints",
)
# ClusterConfig's fields with a flag; the others (resources, strategies, restarts, buckets) take --set cluster.X.
_CLUSTER_FIELDS = ("trainer_ranks", "rollout_workers", "tensor_parallel_size", "placement", "address")


def _add_train_folder(group: argparse._ArgumentGroup) -> None:
    """Where the run goes and reports, resuming it, and the flags that print instead of training."""
    group.add_argument("--out", type=Path, help="The run folder (default runs/ALGO-ENV-TIME).")
    # The trainer section's two reporting fields, whose TrainerConfig documents its fields in comments.
    group.add_argument(
        "--report-to",
        nargs="+",
        metavar="NAME",
        help="Where metrics go besides OUT/metrics.jsonl: tensorboard (OUT/tensorboard/), wandb (Weights & Biases, "
        "files in OUT/wandb/; WANDB_MODE=offline needs no network), several at once, or none "
        "(default tensorboard; trainer.report_to).",
    )
    group.add_argument(
        "--wandb-project",
        metavar="NAME",
        help="The W&B project (default $WANDB_PROJECT, else agentenv); the W&B run is named after the run folder.",
    )
    group.add_argument(
        "--resume",
        action="store_true",
        help="Continue the run in --out from its newest intact checkpoint (a damaged one is skipped, with a note).",
    )
    group.add_argument(
        "--print-config",
        action="store_true",
        help="Print the effective configuration and exit (after checking it, the environment's options included).",
    )
    group.add_argument(
        "--plan",
        action="store_true",
        help="Print the estimated memory per device (trainer weights, gradients, optimizer, activations, engine) "
        "and whether the run fits, then exit.",
    )
    group.add_argument(
        "--device-memory",
        type=float,
        metavar="GIB",
        help="With --plan: the GPU's memory in GiB (default: the CUDA device here, if any).",
    )


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


def run(args: argparse.Namespace) -> int:
    if args.resume and args.out is None:
        raise ValueError("--resume needs --out, the folder of the run to continue")
    # A flag named after a TrainConfig field sets it; an unset one leaves it to the preset, file or default.
    values = given_fields(args, TrainConfig)
    if values.get("keep_checkpoints") == _KEEP_ALL:
        values["keep_checkpoints"] = None  # the config's "every checkpoint"
    cluster = given_fields(args, ClusterConfig, "cluster.")
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
        from agents.run.folder import saved_config  # loads torch (checkpoints)

        base = saved_config(args.out)
    config = resolve(
        base=base,
        preset_name=args.preset,
        file=args.config,
        values=values,
        assignments=args.assignments,
    )
    check_run_env(config)  # before anything loads
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
    from agents.eval.heldout import comparison_table
    from agents.run.train import train

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
