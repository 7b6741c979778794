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
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

from agents.cli.run_settings import check_run_env
from agents.engines.factory import ENGINES
from agents.models import DEFAULT_MODEL
from agents.run.cluster.config import PLACEMENTS
from agents.run.config import PRESETS, RunParts, TrainConfig, build, effective_config, resolve
from agents.run.memory_plan import run_plan, set_flags
from agents.training.reporting import check_report_to

__all__ = ["add_arguments", "run"]


# Flags of the cluster section: argparse name -> ClusterConfig field.
_CLUSTER_FLAGS = {
    "trainer_ranks": "trainer_ranks",
    "rollout_workers": "rollout_workers",
    "tensor_parallel_size": "tensor_parallel_size",
    "placement": "placement",
    "ray_address": "address",
}


# The names of agents.learners.LEARNERS, written out because importing that module loads torch, which
# `agents train --help` must not wait for. --algo takes any name of LEARNERS (agents.run.config.build checks
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


def add_arguments(p: argparse.ArgumentParser) -> None:
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
    p.set_defaults(run=run)


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
    fields = {field.name for field in dataclasses.fields(TrainConfig)}
    values: dict[str, Any] = {name: value for name, value in vars(args).items() if name in fields and value is not None}
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
