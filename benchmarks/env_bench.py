"""Environment latency: reset, search step and fork, beside copy.deepcopy as the naive fork.

    python -m benchmarks.env_bench [--json PATH] [--repeats N]

Fork is measured at episode lengths 1 and 50 turns: agentenv's copy-on-write fork should cost
the same at both, a deep copy grows with the history. The deep copy shares the search index
and the dataset (as any sensible naive fork would), so it copies only the episode.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from collections.abc import Callable

import agentenv

EPISODE_LENGTHS = (1, 50)


def _percentiles(samples_ns: list[int]) -> dict[str, float]:
    us = sorted(s / 1e3 for s in samples_ns)
    return {
        "p50_us": statistics.median(us),
        "p99_us": us[min(len(us) - 1, round(0.99 * (len(us) - 1)))],
        "n": len(us),
    }


def _time(fn: Callable[[], object], repeats: int) -> list[int]:
    samples = []
    for _ in range(repeats):
        start = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - start)
    return samples


def run(repeats: int = 500) -> dict[str, object]:
    env = agentenv.make("multihop-qa", max_tool_calls=100, max_turns=100)
    n_tasks = len(env.tasks)
    results: dict[str, object] = {}

    counter = iter(range(10**9))
    results["reset"] = _percentiles(_time(lambda: env.reset(options={"index": next(counter) % n_tasks}), repeats))

    def search_step() -> None:
        i = next(counter) % n_tasks
        env.reset(options={"index": i})
        start = time.perf_counter_ns()
        env.step(f"<search>{env.tasks[i].question}</search>")
        search_samples.append(time.perf_counter_ns() - start)

    search_samples: list[int] = []
    for _ in range(repeats):
        search_step()
    results["search_step"] = _percentiles(search_samples)

    # Whole episodes: reset, three searches, the answer.
    steps, start = 0, time.perf_counter()
    for i in range(repeats // 5):
        env.reset(options={"index": i % n_tasks})
        for q in ("first hop", "second hop", env.tasks[i % n_tasks].question):
            env.step(f"<search>{q}</search>")
        env.step(f"<answer>\\boxed{{{env.tasks[i % n_tasks].answers[0]}}}</answer>")
        steps += 4
    results["steps_per_second"] = steps / (time.perf_counter() - start)

    shared = {id(env.backend): env.backend, id(env.tasks): env.tasks}
    for length in EPISODE_LENGTHS:
        env.reset(options={"index": 0})
        for t in range(length):
            env.step(f"<search>hop {t} of {env.tasks[0].question}</search>")
        fork = _percentiles(_time(env.fork, repeats))
        deep = _percentiles(_time(lambda: copy.deepcopy(env, dict(shared)), max(20, repeats // 10)))
        results[f"fork_at_{length}_turns"] = fork
        results[f"deepcopy_at_{length}_turns"] = deep
        results[f"deepcopy_over_fork_at_{length}_turns"] = deep["p50_us"] / fork["p50_us"]
    return results


def print_table(results: dict[str, object]) -> None:
    print(f"{'operation':<28}{'p50 (µs)':>12}{'p99 (µs)':>12}{'n':>7}")
    rows = ["reset", "search_step"] + [f"{k}_at_{n}_turns" for n in EPISODE_LENGTHS for k in ("fork", "deepcopy")]
    for name in rows:
        r = results[name]
        print(f"{name:<28}{r['p50_us']:>12.1f}{r['p99_us']:>12.1f}{r['n']:>7}")
    print(f"{'steps per second':<28}{results['steps_per_second']:>12.0f}")
    for n in EPISODE_LENGTHS:
        print(f"{f'deepcopy / fork at {n} turns':<28}{results[f'deepcopy_over_fork_at_{n}_turns']:>12.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--repeats", type=int, default=500, help="samples per measurement (default 500)")
    args = parser.parse_args()
    results = run(args.repeats)
    print_table(results)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
