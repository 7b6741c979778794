"""Engine throughput at 1, 8 and 32 concurrent requests beside sequential generation, and exactness.

    python -m benchmarks.engine_bench [--engines hf,vllm] [--concurrency 1,8,32] [--new-tokens 48] [--json PATH]

For each engine: the same sampled requests (temperature 1, one seed each) are run one after
another (the sequential baseline, what a loop without batching gets) and then N at a time;
the table gives generated tokens per second and the ratio to sequential. The last column is
the largest difference between the engine's log-probs and a fresh float32 forward pass of a
separately loaded transformers model over the returned ids (the trainer's recomputation).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time

import torch

from agents.engines import Completion, Engine, SamplingParams, make_engine
from agents.models import DEFAULT_MODEL, load_model, load_tokenizer
from agents.training.scoring import score_tokens

QUESTIONS = [
    "What is the capital of France?",
    "Explain photosynthesis in one paragraph.",
    "Write a short poem about autumn.",
    "Who wrote Hamlet, and when?",
    "List three uses of copper.",
    "Why is the sky blue?",
    "Describe a cat to someone who has never seen one.",
    "What is 17 times 23? Show your steps.",
]


def requests(tokenizer, n: int, new_tokens: int, ignore_eos: bool = False) -> list[tuple[list[int], SamplingParams]]:
    """``n`` chat prompts, sampled at temperature 1 with a seed each; ``ignore_eos``: exactly ``new_tokens`` each."""
    out = []
    for i in range(n):
        chat = [{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
        prompt = tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
        params = SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=1000 + i, ignore_eos=ignore_eos)
        out.append((prompt, params))
    return out


async def timed(engine: Engine, batch: list[tuple[list[int], SamplingParams]], concurrent: bool):
    start = time.perf_counter()
    if concurrent:
        done = await asyncio.gather(*(engine.generate(p, s) for p, s in batch))
    else:
        done = [await engine.generate(p, s) for p, s in batch]
    return list(done), time.perf_counter() - start


def logprob_mismatch(model, batch, completions: list[Completion]) -> float:
    """Largest |sampler log-prob − forward-pass log-prob| over all returned tokens (temperature 1)."""
    worst = 0.0
    with torch.no_grad():
        for (prompt, _), completion in zip(batch, completions):
            ids = torch.tensor([prompt + completion.token_ids])
            expected = score_tokens(model(ids).logits, ids)[0][0, len(prompt) - 1 :]  # the completion's tokens
            worst = max(worst, (expected - torch.tensor(completion.logprobs)).abs().max().item())
    return worst


async def concurrent_rate(
    engine: Engine, tokenizer, n: int, new_tokens: int, reference_model, ignore_eos: bool = False
) -> dict:
    """``n`` requests at once on ``engine``: tokens, seconds, tokens/s and the log-prob mismatch to ``reference_model``."""
    batch = requests(tokenizer, n, new_tokens, ignore_eos)
    done, seconds = await timed(engine, batch, concurrent=True)
    tokens = sum(len(c.token_ids) for c in done)
    return dict(
        requests=n,
        tokens=tokens,
        seconds=seconds,
        tokens_per_s=tokens / seconds,
        max_abs_logprob_diff=logprob_mismatch(reference_model, batch, done),
    )


async def bench_engine(
    name: str, concurrency: list[int], new_tokens: int, sequential_requests: int, trainer_model, tokenizer
):
    start = time.perf_counter()
    engine = make_engine(name, DEFAULT_MODEL, concurrency=max(concurrency), max_model_len=2048)
    startup_s = time.perf_counter() - start
    rows = []
    try:
        await engine.generate(*requests(tokenizer, 1, 4)[0])  # warm-up
        batch = requests(tokenizer, sequential_requests, new_tokens)
        done, seconds = await timed(engine, batch, concurrent=False)
        tokens = sum(len(c.token_ids) for c in done)
        sequential_rate = tokens / seconds
        rows.append(
            dict(
                engine=name,
                mode="sequential",
                requests=len(batch),
                tokens=tokens,
                seconds=seconds,
                tokens_per_s=sequential_rate,
                vs_sequential=1.0,
                max_abs_logprob_diff=logprob_mismatch(trainer_model, batch, done),
            )
        )
        for n in concurrency:
            row = await concurrent_rate(engine, tokenizer, n, new_tokens, trainer_model)
            rows.append(
                dict(engine=name, mode=f"{n} concurrent", **row, vs_sequential=row["tokens_per_s"] / sequential_rate)
            )
    finally:
        await engine.close()
    return startup_s, rows


def print_table(rows: list[dict], startup: dict[str, float]) -> None:
    header = f"{'engine':<6} {'mode':<14} {'requests':>8} {'tokens':>7} {'seconds':>8} {'tokens/s':>9} {'× sequential':>13} {'max |Δ logprob|':>16}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['engine']:<6} {r['mode']:<14} {r['requests']:>8} {r['tokens']:>7} {r['seconds']:>8.1f} "
            f"{r['tokens_per_s']:>9.1f} {r['vs_sequential']:>13.2f} {r['max_abs_logprob_diff']:>16.2e}"
        )
    print("start-up: " + ", ".join(f"{name} {seconds:.1f} s" for name, seconds in startup.items()))
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", default="hf,vllm", help="comma-separated: hf, vllm")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated request counts run at once")
    parser.add_argument("--new-tokens", type=int, default=48, help="max new tokens per request")
    parser.add_argument("--sequential-requests", type=int, default=4, help="requests in the sequential baseline")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    tokenizer = load_tokenizer(DEFAULT_MODEL)
    trainer_model = load_model(DEFAULT_MODEL)
    concurrency = [int(n) for n in args.concurrency.split(",")]
    rows, startup = [], {}
    for name in args.engines.split(","):
        startup[name], engine_rows = asyncio.run(
            bench_engine(name, concurrency, args.new_tokens, args.sequential_requests, trainer_model, tokenizer)
        )
        rows += engine_rows
    print_table(rows, startup)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "rows": rows,
                    "startup_s": startup,
                    "new_tokens": args.new_tokens,
                    "cpu_count": os.cpu_count(),
                    "load_average_1min": os.getloadavg()[0],
                },
                f,
                indent=2,
            )


if __name__ == "__main__":  # vLLM spawns its workers; the guard keeps them from rerunning this
    main()
