"""HFEngine's memory with many concurrent episodes: peak resident memory against what it holds.

    python -m benchmarks.engine_memory [--json PATH] [--rows 128] [--prompts 16] [--prompt-tokens 700]

The shape of a multihop-qa GRPO rollout at ``rollout.concurrency = rows``: ``prompts`` distinct
prompts of ``prompt-tokens`` tokens, each sampled ``rows / prompts`` times (48 new tokens at
temperature 0.6), then a second turn in which every row goes on with 150 more tokens of
observation. Each setting runs in a fresh interpreter, so that its peak is its own: the default
``max_prefill_tokens`` against one prefill pass for every request that joins at once (the engine
before it had the bound). The table gives each turn's seconds and peak resident memory, the
resident memory after the rollout, and what the engine holds then (the prefix cache's KV; the
model and its bfloat16 copy).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from agents.engines.hf import MAX_PREFILL_TOKENS

#: One setting's run, in a fresh interpreter: prints one JSON line.
RUN = r"""
import asyncio, json, os, random, sys, threading, time
settings = json.loads(sys.argv[1])
from agents.engines.base import SamplingParams
from agents.engines.hf import HFEngine
from agents.engines.kv_cache import kv_bytes_per_token
from agents.models import DEFAULT_MODEL, load_model, load_tokenizer

def rss():
    with open(f"/proc/{os.getpid()}/status") as status:
        return int(status.read().split("VmRSS:")[1].split()[0]) * 1024

model, tokenizer = load_model(DEFAULT_MODEL), load_tokenizer(DEFAULT_MODEL)
engine = HFEngine(model=model, tokenizer=tokenizer, max_batch_size=settings["rows"],
                  max_prefill_tokens=settings["max_prefill_tokens"], seed=0)
rng = random.Random(0)
prompts = [[rng.randrange(100, 40000) for _ in range(settings["prompt_tokens"])] for _ in range(settings["prompts"])]
peak = [0]
def watch():
    while True:
        peak[0] = max(peak[0], rss())
        time.sleep(0.02)
threading.Thread(target=watch, daemon=True).start()
params = SamplingParams(temperature=0.6, max_new_tokens=48, ignore_eos=True)
turns = []
async def turn(batch):
    peak[0] = rss()
    start = time.perf_counter()
    done = await asyncio.gather(*(engine.generate(p, params) for p in batch))
    turns.append({"seconds": time.perf_counter() - start, "peak_bytes": peak[0]})
    return done
async def main():
    first = [prompts[i % len(prompts)] for i in range(settings["rows"])]
    done = await turn(first)
    await turn([p + c.token_ids + [rng.randrange(100, 40000) for _ in range(150)] for p, c in zip(first, done)])
    await engine.close()
start_rss = rss()
asyncio.run(main())
per_token = kv_bytes_per_token(model.config, engine.compute_dtype)
print(json.dumps({"turns": turns, "rss_before_bytes": start_rss, "rss_after_bytes": rss(),
                  "prefix_cache_bytes": engine.prefix_cache.tokens * per_token,
                  "prefill_passes": engine.stats.prefill_passes}))
"""


def run(settings: dict) -> dict:
    result = subprocess.run(
        [sys.executable, "-c", RUN, json.dumps(settings)], capture_output=True, text=True, check=True
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=128, help="concurrent requests (default 128)")
    parser.add_argument("--prompts", type=int, default=16, help="distinct prompts among them (default 16)")
    parser.add_argument("--prompt-tokens", type=int, default=700, help="tokens of each prompt (default 700)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.rows % args.prompts:
        parser.error(f"--rows ({args.rows}) must be a multiple of --prompts ({args.prompts})")
    shape = {"rows": args.rows, "prompts": args.prompts, "prompt_tokens": args.prompt_tokens}
    # One pass for everything that joins at once: a bound no request set here reaches.
    unbounded = 1 << 40
    results = {}
    for name, bound in (("bounded", MAX_PREFILL_TOKENS), ("one pass", unbounded)):
        print(f"running {name} (max_prefill_tokens={bound}) ...", flush=True)
        results[name] = {"max_prefill_tokens": bound, **run({**shape, "max_prefill_tokens": bound})}
    gib = 2**30
    print(f"\n{args.rows} requests, {args.prompts} prompts of {args.prompt_tokens} tokens, two turns")
    print(f"{'prefill':<10} {'passes':>6} {'turn 1 s':>9} {'peak GiB':>9} {'turn 2 s':>9} {'peak GiB':>9} {'after':>7}")
    for name, r in results.items():
        one, two = r["turns"]
        print(
            f"{name:<10} {r['prefill_passes']:>6} {one['seconds']:>9.1f} {one['peak_bytes'] / gib:>9.2f} "
            f"{two['seconds']:>9.1f} {two['peak_bytes'] / gib:>9.2f} {r['rss_after_bytes'] / gib:>7.2f}"
        )
    bounded, whole = results["bounded"], results["one pass"]
    peak = max(t["peak_bytes"] for t in bounded["turns"]) / max(t["peak_bytes"] for t in whole["turns"])
    seconds = sum(t["seconds"] for t in bounded["turns"]) / sum(t["seconds"] for t in whole["turns"])
    held = bounded["prefix_cache_bytes"] / gib
    print(
        f"bounded / one pass: peak memory {peak:.2f}x, time {seconds:.2f}x; the prefix cache holds {held:.2f} GiB after"
    )
    report = {
        "command": "python -m benchmarks.engine_memory " + " ".join(argv or sys.argv[1:]),
        **shape,
        "results": results,
    }
    report["ratios"] = {"peak_bytes": round(peak, 3), "seconds": round(seconds, 3)}
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
