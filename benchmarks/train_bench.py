"""Training on the packed tree beside the per-path layouts: time, memory and tokens of one training step.

    python -m benchmarks.train_bench [--json PATH] [--shapes at2po,grpo,real] [--scale S]
                                     [--packings tree,padded[,flat]] [--repeats R]

Batches, the same for every layout:

- ``at2po``: the AT²PO paper's tree (M = 10 roots, L = 2 rounds of K = 6 expansions, 22 leaves),
  a prompt of 500 tokens, 4 turns of 128 action + 300 observation tokens (the first turn has no
  observation); each expansion branches off a random turn of a random earlier path and grows a
  new rest of the path;
- ``grpo``: 16 chains of the same shape sharing the prompt;
- ``real``: the trees of 2 prompts rolled out by the embedded model under AT²PO's strategy on
  ``multihop-qa`` (cpu-demo limits: short turns, so shared prefixes are short).

``--scale`` multiplies every synthetic length (1.0: the papers'; the default 0.25 fits two CPU
cores in minutes); the tokens-forwarded ratios of the synthetic shapes are also given at scale 1,
from the packing alone. Token ids are random; the model is SmolLM2-135M in float32.

Each layout (``TrainerConfig.packing``) runs one ``Trainer.step`` per batch (old log-probs
recomputed, one mini-batch, micro-batches of 4 paths or their packed tokens, AT²PO's loss) in
its own process, so that its peak memory (maximum RSS) is its own; the layouts run in turn
``--repeats`` times (3; these machines are shared and a single run can be off by 20%) and the
median is reported. ``flat`` is not run by default: transformers gives a row of packed
sequences one dense mask over the whole row, so it is slower than ``padded`` (1.5× on the AT²PO
shape at scale 0.25, benchmarks/results/train_bench.json, "flat_scale_0.25"). Columns: old-log-prob seconds, update seconds,
peak RSS, tokens forwarded by the update, and each beside ``padded`` (today's default) and
``flat`` (each path whole in one row).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PACKINGS = ("tree", "padded", "flat")
SHAPES = ("at2po", "grpo", "real")
# The papers' shapes (AT²PO: arXiv 2601.04767, sec. 5; its GRPO baseline uses 16 chains).
PROMPT, ACTION, OBSERVATION, TURNS = 500, 128, 300, 4
AT2PO_ROOTS, AT2PO_ROUNDS, AT2PO_EXPANSIONS = 10, 2, 6
GRPO_CHAINS = 16


def _synthetic(shape: str, scale: float, vocab: int, seed: int = 0) -> list[Any]:
    """The training paths of one prompt's tree of ``shape`` (random ids, random advantages)."""
    from agents.rollout.tree import RolloutTree

    rng = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(max(1, round(n * scale)))]

    tree = RolloutTree(ids(PROMPT))

    def grow(node: Any, depth: int) -> None:
        for turn in range(depth, TURNS):
            action = ids(ACTION)
            node = tree.add_turn(
                node,
                obs_ids=ids(OBSERVATION) if turn else [],
                action_ids=action,
                sampler_logprobs=[-rng.uniform(0.1, 3.0) for _ in action],
                terminal=turn == TURNS - 1,
                reward=float(rng.random() < 0.5) if turn == TURNS - 1 else None,
            )
            node.advantage = rng.gauss(0.0, 1.0)

    chains = AT2PO_ROOTS if shape == "at2po" else GRPO_CHAINS
    for _ in range(chains):
        grow(tree.root, 0)
    if shape == "at2po":
        for _ in range(AT2PO_ROUNDS * AT2PO_EXPANSIONS):  # a new rest of the path from a random inner turn
            node = rng.choice([n for n in tree.nodes() if not n.terminal])
            grow(node, node.depth)
    return tree.paths()


async def _real_paths(prompts: int = 2) -> list[Any]:
    """AT²PO's trees of ``prompts`` multihop-qa questions from the embedded model (cpu-demo limits), credited."""
    from agentenv import TokenEnv, make
    from agents.models import load_tokenizer
    from agents.run.backends import LocalRollout, run_engine
    from agents.run.config import build, resolve

    config = resolve(preset_name="cpu-demo", values={"algo": "at2po", "env": "multihop-qa"})
    parts = build(config)
    tokenizer = load_tokenizer(config.model)
    env = TokenEnv(make(config.env, **config.env_kwargs), tokenizer)
    rollout = LocalRollout(env, run_engine(config, parts.tree.rollout), tokenizer, parts)
    try:
        trees = await rollout.rollout(list(range(prompts)), seed=0)
    finally:
        await rollout.close()
    return [path for prompt in trees for path in parts.learner.assign_credit(prompt.trees)]


def _batch(shape: str, scale: float) -> list[Any]:
    from agents.models import DEFAULT_MODEL, load_tokenizer

    if shape == "real":
        return asyncio.run(_real_paths())
    return _synthetic(shape, scale, len(load_tokenizer(DEFAULT_MODEL)))


def _worker(job_path: str, result_path: str) -> None:
    """In a subprocess: one Trainer.step of the job's batch under its packing; times, tokens and peak RSS."""
    import pickle

    import torch

    from agents.learners import AT2PO
    from agents.models import DEFAULT_MODEL
    from agents.training.trainer import Trainer

    job = json.loads(Path(job_path).read_text())
    with open(job["paths"], "rb") as f:
        paths = pickle.load(f)
    torch.manual_seed(0)
    config = AT2PO().trainer_config(
        lr=1e-6, micro_batch_size=4, packing=job["packing"], progress=False, report_to=("none",)
    )
    trainer = Trainer(DEFAULT_MODEL, config)
    metrics = asyncio.run(trainer.step(paths))
    result = {
        "old_logprobs_s": metrics["time/old_logprobs_s"],
        "update_s": metrics["time/update_s"],
        "tokens_forwarded": metrics["batch/tokens_forwarded"],
        "tokens_trained": metrics["tokens/trained"],
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "loss": metrics["policy/loss"],
    }
    Path(result_path).write_text(json.dumps(result))


def _run(paths_file: str, packing: str) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as folder:
        job, result = Path(folder, "job.json"), Path(folder, "result.json")
        job.write_text(json.dumps({"paths": paths_file, "packing": packing}))
        subprocess.run([sys.executable, "-m", "benchmarks.train_bench", "--worker", str(job), str(result)], check=True)
        return json.loads(result.read_text())


def _forwarded_at_paper_scale(shape: str) -> dict[str, float]:
    """Tokens the update forwards per layout at scale 1, from the packing alone (no model)."""
    from agents.training.batch import collate
    from agents.training.packing import pack_paths

    batch = collate(_synthetic(shape, 1.0, 49152), 0)
    return {
        "tree": float(pack_paths(batch.ids, batch.attention_mask).tokens),
        "flat": float(batch.attention_mask.sum()),
        "padded": float(batch.ids.numel()),
    }


def _call_cost_pairs() -> float:
    """What one causal SDPA call costs besides its work, in query-key pairs (tree attention's CALL_COST_PAIRS).

    Forward and backward at SmolLM2-135M's 9 heads of 64: a 4-token call against the per-pair cost of 1024 tokens.
    """
    import torch
    import torch.nn.functional as F

    def seconds(length: int, repeats: int) -> float:
        q, k, v = (torch.randn(1, 9, length, 64, requires_grad=True) for _ in range(3))
        for _ in range(2):  # warm-up
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        start = time.perf_counter()
        for _ in range(repeats):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
        return (time.perf_counter() - start) / repeats

    call, large = seconds(4, 200), seconds(1024, 5)
    return call / ((large - call) / (1024 * 1025 / 2))


def _table(rows: list[list[Any]], head: list[str]) -> str:
    cells = [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in row] for row in [head, *rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    parser.add_argument("--scale", type=float, default=0.25, help="synthetic lengths × this (1: the papers')")
    parser.add_argument("--packings", default="tree,padded", help=f"of {', '.join(PACKINGS)}")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each layout, in turn (median)")
    parser.add_argument("--worker", nargs=2, metavar=("JOB", "RESULT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(*args.worker)
        return
    import pickle

    shapes = [s for s in args.shapes.split(",") if s]
    packings = [p for p in args.packings.split(",") if p]
    unknown = sorted(set(shapes) - set(SHAPES)) + sorted(set(packings) - set(PACKINGS))
    if unknown:
        parser.error(
            f"unknown shapes or packings {unknown}; shapes: {', '.join(SHAPES)}; packings: {', '.join(PACKINGS)}"
        )
    results: dict[str, Any] = {
        "command": "python -m benchmarks.train_bench " + " ".join(sys.argv[1:]),
        "scale": args.scale,
        "shapes": {},
    }
    results["call_cost_pairs"] = _call_cost_pairs()
    print(f"one SDPA call costs as much as {results['call_cost_pairs']:.0f} query-key pairs besides its work")
    start = time.perf_counter()
    for shape in shapes:
        # Without their leaf nodes, whose environments hold what does not pickle (a search index's stemmer).
        paths = [dataclasses.replace(path, leaf=None) for path in _batch(shape, args.scale)]
        with tempfile.NamedTemporaryFile(suffix=".pkl", delete=False) as f:
            pickle.dump(paths, f)
        runs: dict[str, list[dict[str, Any]]] = {p: [] for p in packings}
        for repeat in range(args.repeats):
            for packing in packings if repeat % 2 == 0 else packings[::-1]:  # alternate who goes first
                runs[packing].append(_run(f.name, packing))
                print(
                    f"  {shape} {packing} #{repeat + 1}: update {runs[packing][-1]['update_s']:.1f} s "
                    f"({time.perf_counter() - start:.0f} s so far)",
                    flush=True,
                )
        Path(f.name).unlink()
        summary = {
            packing: {key: statistics.median(run[key] for run in done) for key in done[0]}
            for packing, done in runs.items()
        }
        entry: dict[str, Any] = {
            "paths": len(paths),
            "tokens": sum(len(p.ids) for p in paths),
            "layouts": summary,
        }
        if shape != "real":
            entry["tokens_forwarded_at_scale_1"] = _forwarded_at_paper_scale(shape)
        results["shapes"][shape] = entry
        rows = []
        for packing, values in summary.items():
            rows.append(
                [
                    packing,
                    values["old_logprobs_s"],
                    values["update_s"],
                    values["peak_rss_gib"],
                    values["tokens_forwarded"],
                    *(
                        values[key] / summary[base][key] if base in summary else "-"
                        for base in ("padded", "flat")
                        for key in ("update_s", "tokens_forwarded")
                    ),
                ]
            )
        print(f"\n{shape}: {len(paths)} paths, {entry['tokens']} tokens (scale {args.scale})")
        print(
            _table(
                rows,
                [
                    "packing",
                    "old log-probs s",
                    "update s",
                    "peak GiB",
                    "tokens fwd",
                    "update / padded",
                    "tokens / padded",
                    "update / flat",
                    "tokens / flat",
                ],
            )
        )
        if shape != "real":
            at_one = entry["tokens_forwarded_at_scale_1"]
            print(f"tokens forwarded at scale 1: tree / flat = {at_one['tree'] / at_one['flat']:.3f}")
        if args.json:  # after every shape, so that an interrupted run keeps what it measured
            args.json.write_text(json.dumps(results, indent=1))
    if args.json:
        print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()
