"""Rollout trees beside independent chains, with the embedded model on CPU.

    python -m benchmarks.tree_bench [--json PATH] [--prompts N] [--max-new-tokens T]
                                    [--max-response-tokens R] [--max-tool-calls C]
                                    [--envs ID,ID] [--strategies NAME,NAME]

For each environment and each strategy at its paper's budget (AT²PO's EntropyTree 10 + 2·6 = 22
leaves, Tree-GRPO's RandomTree 2 trees × 3 leaves, ARPO's EntropyBranching 16, AEPO's
EntropyBalancedBranching 16), the same prompts are rolled out by the strategy and by ``Chain``
with the same number of leaves, one after the other on one HFEngine (SmolLM2-135M, float32,
requests of concurrent branches batched). Reported per run:

- leaves per prompt; generated tokens per leaf (pre-monitoring included) and its ratio to Chain;
- prompt tokens the engine prefilled per leaf (those its prefix cache did not hold), beside
  Chain's: a branch must reuse the KV of the prefix it shares, never compute it again; every
  run starts with the prefix cache empty;
- rows per decode pass (how full the engine's batches were) and wall time (the whole batch of
  prompts), beside Chain's;
- environment forks made and the seconds spent in ``fork()``;
- the fraction of prompts whose leaves' rewards are not all equal (groups with a learning
  signal), beside Chain's.

Eight prompts by default (``--prompts``): enough that the engine's batch (32 rows) is full for a
tree as for chains, as it is at the papers' 64 prompts. A tree's rounds are sequential by
definition (a round picks its nodes from the finished tree), so with one or two prompts its
engine batches are a third as full as the chains' and the comparison measures latency, not
throughput (at 2 prompts on python-math: 11.5 rows per decode pass beside 29.4).

Limits are small so that the run fits on two cores: short turns (``--max-new-tokens``), a short
response budget per path, two tool calls per episode (``--max-tool-calls``; AT²PO's budget is 6).
An episode has at most ``max_tool_calls + 2`` turns, and the path budget must leave room for
three or more: when paths end after one or two, the only turns a tree can branch on are first
turns, whose branches share nothing but the prompt (tokens per leaf then equal Chain's). A
branch from turn d of a D-turn path generates turns d … D again, so the deeper the paths, the
fewer tokens a leaf costs (at 22 leaves with branch points spread evenly over the non-final
turns: 0.86 of Chain's at 4 turns, 0.80 at 8). Sampling is at temperature 1 with a
fixed rollout seed. The small model rarely solves these tasks, so rewards are mostly equal; the
signal fractions are reported as measured.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from typing import Any

import agentenv
from agentenv import TokenEnv
from agents.engines import HFEngine, SamplingParams
from agents.models import DEFAULT_MODEL
from agents.rollout import Episode, RolloutConfig
from agents.rollout.diagnostics import rollout_metrics
from agents.rollout.strategies import (
    Chain,
    EntropyBalancedBranching,
    EntropyBranching,
    EntropyTree,
    RandomTree,
    Strategy,
)
from agents.rollout.tree_loop import TreeConfig, rollout_trees

#: The strategies at their papers' budgets, with the number of leaves per prompt that budget gives.
STRATEGIES: dict[str, tuple[Strategy, int]] = {
    "EntropyTree (AT2PO)": (EntropyTree(), 10 + 2 * 6),
    "RandomTree (Tree-GRPO)": (RandomTree(), 2 * 3),
    "EntropyBranching (ARPO)": (EntropyBranching(), 16),
    "EntropyBalancedBranching (AEPO)": (EntropyBalancedBranching(), 16),
}
#: Environment options: two tool calls per episode (so at most four turns; ``--max-tool-calls``
#: changes it), the papers' rewards; one short search result, so that a run fits on two cores.
ENVS: dict[str, dict[str, Any]] = {
    "multihop-qa": {"max_tool_calls": 2, "reward": "at2po", "topk": 1, "result_chars": 300},
    "python-math": {"max_tool_calls": 2},
}


async def measure(
    engine: HFEngine, env_id: str, env: TokenEnv, strategy: Strategy, config: TreeConfig, prompts: int
) -> dict:
    """Roll the first ``prompts`` tasks of ``env`` out under ``strategy``; a summary of the batch."""
    episodes = [Episode(env.fork(), options={"index": index}) for index in range(prompts)]
    engine.prefix_cache.clear()  # no run reuses the KV of the run before it
    before = dataclasses.replace(engine.stats)
    start = time.perf_counter()
    results = await rollout_trees(engine, episodes, strategy, config)
    seconds = time.perf_counter() - start
    after = engine.stats
    for episode in episodes:
        episode.env.close()
    record = rollout_metrics(results, seconds)
    print(
        f"{env_id} {strategy}: {record['tokens/generated']:.0f} tokens in {seconds:.0f} s", file=sys.stderr, flush=True
    )
    leaves = sum(len(prompt.leaves) for prompt in results)
    stats = [stats for prompt in results for stats in prompt.stats]
    return {
        "leaves_per_prompt": record["tree/leaves_per_prompt"],
        "tokens_per_leaf": record.get("tree/tokens_per_leaf", float("nan")),
        "tokens": record["tokens/generated"],
        "context_tokens_per_leaf": sum(s.context_tokens for s in stats) / max(1, leaves),
        "prefilled_tokens_per_leaf": (
            (after.prompt_tokens - before.prompt_tokens)
            - (after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens)
        )
        / max(1, leaves),
        "rows_per_decode_pass": (after.generated_tokens - before.generated_tokens)
        / max(1, after.decode_passes - before.decode_passes),
        "engine_prefill_seconds": after.prefill_seconds - before.prefill_seconds,
        "engine_decode_seconds": after.decode_seconds - before.decode_seconds,
        "turns_per_prompt": sum(s.turns for s in stats) / prompts,
        "tool_calls_per_prompt": sum(s.tool_calls for s in stats) / prompts,
        "seconds": seconds,
        "forks": sum(s.forks for s in stats),
        "fork_seconds": sum(s.fork_seconds for s in stats),
        "signal_frac": record.get("tree/signal_frac", 0.0),
        "reward_mean": sum(leaf.reward for prompt in results for leaf in prompt.leaves) / max(1, leaves),
        "errors": sum(len(s.errors) for s in stats) + record["tree/prompt_errors"],
        # what went wrong, so a run's branch errors can be told apart afterwards
        "error_messages": [error for s in stats for error in s.errors]
        + [prompt.error for prompt in results if prompt.error is not None],
    }


async def run(
    prompts: int,
    max_new_tokens: int,
    max_response_tokens: int,
    envs: list[str],
    strategies: list[str],
    json_path: str | None = None,
    max_tool_calls: int | None = None,
) -> dict[str, Any]:
    """Measure every (env, strategy) pair; prints each row as it is done (and rewrites ``json_path``).

    ``max_tool_calls`` replaces every env's own limit of ``ENVS`` when given.
    """
    options = {
        env_id: {**ENVS[env_id], **({} if max_tool_calls is None else {"max_tool_calls": max_tool_calls})}
        for env_id in envs
    }
    engine = HFEngine(DEFAULT_MODEL, max_batch_size=32, seed=0)
    turns = RolloutConfig(
        sampling=SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens), max_response_tokens=max_response_tokens
    )
    config = TreeConfig(rollout=turns, seed=0)
    results: dict[str, Any] = {
        "config": {
            "model": DEFAULT_MODEL,
            "prompts": prompts,
            "max_new_tokens": max_new_tokens,
            "max_response_tokens": max_response_tokens,
            "temperature": 1.0,
            "seed": 0,
            "envs": options,
        },
        "rows": [],
    }
    print_header(results["config"])
    try:
        for env_id in envs:
            env = TokenEnv(agentenv.make(env_id, **options[env_id]), engine.tokenizer)
            chains: dict[int, dict] = {}  # Chain runs by leaf count, shared by strategies with equal budgets
            for name in strategies:
                strategy, leaves = STRATEGIES[name]
                tree = await measure(engine, env_id, env, strategy, config, prompts)
                if leaves not in chains:
                    chains[leaves] = await measure(engine, env_id, env, Chain(leaves), config, prompts)
                row = {
                    "env": env_id,
                    "strategy": name,
                    "chain_leaves": leaves,
                    "tree": tree,
                    "chain": chains[leaves],
                    "tokens_per_leaf_ratio": tree["tokens_per_leaf"] / chains[leaves]["tokens_per_leaf"],
                    "seconds_ratio": tree["seconds"] / chains[leaves]["seconds"],
                }
                results["rows"].append(row)
                print_row(row)
                if json_path:
                    with open(json_path, "w") as f:
                        json.dump(results, f, indent=2)
            env.close()
    finally:
        await engine.close()
    print_legend()
    return results


def print_header(config: dict[str, Any]) -> None:
    print(
        f"{config['model']} on CPU, {config['prompts']} prompts per env, turns of at most "
        f"{config['max_new_tokens']} tokens, {config['max_response_tokens']} tokens per path"
    )
    print(
        f"{'env':<12}{'strategy':<33}{'leaves':>7}{'tok/leaf':>9}{'chain':>7}{'ratio':>7}{'prefill':>8}"
        f"{'chain':>7}{'rows':>6}{'chain':>6}{'wall s':>8}{'chain':>7}{'ratio':>6}{'forks':>7}{'fork ms':>9}"
        f"{'signal':>8}{'chain':>7}{'errors':>7}",
        flush=True,
    )


def print_row(row: dict[str, Any]) -> None:
    tree, chain = row["tree"], row["chain"]
    print(
        f"{row['env']:<12}{row['strategy']:<33}{tree['leaves_per_prompt']:>7.1f}{tree['tokens_per_leaf']:>9.1f}"
        f"{chain['tokens_per_leaf']:>7.1f}{row['tokens_per_leaf_ratio']:>7.2f}"
        f"{tree['prefilled_tokens_per_leaf']:>8.0f}{chain['prefilled_tokens_per_leaf']:>7.0f}"
        f"{tree['rows_per_decode_pass']:>6.1f}{chain['rows_per_decode_pass']:>6.1f}{tree['seconds']:>8.1f}"
        f"{chain['seconds']:>7.1f}{row['seconds_ratio']:>6.2f}{tree['forks']:>7d}{1e3 * tree['fork_seconds']:>9.1f}"
        f"{tree['signal_frac']:>8.2f}{chain['signal_frac']:>7.2f}{int(tree['errors'] + chain['errors']):>7d}",
        flush=True,
    )


def print_legend() -> None:
    print(
        "leaves: per prompt; tok/leaf: generated tokens per leaf (tree, then Chain with as many leaves) and "
        "their ratio;\nprefill: prompt tokens the engine computed per leaf (not from its prefix cache); rows: "
        "rows per decode pass;\nwall s: the batch (tree, Chain, ratio); forks and fork ms: the tree's env "
        "forks; signal: fraction of prompts whose leaf rewards differ."
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--prompts", type=int, default=8, help="tasks per environment (default 8)")
    parser.add_argument("--max-new-tokens", type=int, default=24, help="tokens per turn (default 24)")
    parser.add_argument(
        "--max-response-tokens",
        type=int,
        default=320,
        help="tokens per root-to-leaf path, tool results included (default 320)",
    )
    parser.add_argument(
        "--max-tool-calls", type=int, help="tool calls per episode in every env (default: 2, as in ENVS)"
    )
    parser.add_argument("--envs", default=",".join(ENVS), help=f"comma-separated, from {', '.join(ENVS)}")
    parser.add_argument(
        "--strategies", default=",".join(STRATEGIES), help=f"comma-separated, from: {'; '.join(STRATEGIES)}"
    )
    args = parser.parse_args()
    envs = [name.strip() for name in args.envs.split(",") if name.strip()]
    strategies = [name.strip() for name in args.strategies.split(",") if name.strip()]
    unknown = [name for name in envs if name not in ENVS] + [name for name in strategies if name not in STRATEGIES]
    if unknown:
        parser.error(
            f"unknown env or strategy {unknown}; choose envs from {list(ENVS)} and strategies from {list(STRATEGIES)}"
        )
    if args.prompts < 1 or args.max_new_tokens < 1 or args.max_response_tokens < 1:
        parser.error("--prompts, --max-new-tokens and --max-response-tokens must be >= 1")
    if args.max_tool_calls is not None and args.max_tool_calls < 0:
        parser.error(f"--max-tool-calls must be >= 0, got {args.max_tool_calls}")
    asyncio.run(
        run(
            args.prompts,
            args.max_new_tokens,
            args.max_response_tokens,
            envs,
            strategies,
            args.json,
            args.max_tool_calls,
        )
    )


if __name__ == "__main__":
    main()
