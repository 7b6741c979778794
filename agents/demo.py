"""``make demo``: the embedded model answers a few ``multihop-qa`` questions through the real loop.

    python -m agents.demo [--limit N] [--max-new-tokens T]

SmolLM2-135M-Instruct (embedded, offline, CPU) runs in :class:`~agents.engines.hf.HFEngine`;
the rollout loop drives all episodes concurrently over token-level ``multihop-qa`` envs (HotpotQA
with offline BM25 search). The demo prints one transcript and the score table, then checks
token-in-token-out: a fresh forward pass of the same model over each saved episode reproduces
the sampler's log-probs of every action token.

A 135M model rarely follows the search-and-answer protocol, so expect EM near 0: the demo shows
the machinery, not a trained agent.
"""

from __future__ import annotations

import argparse
import asyncio

from agents.engines.base import SamplingParams
from agents.engines.hf import HFEngine
from agents.evaluation import EvalReport, evaluate, sampler_logprob_gap, transcript
from agents.models import DEFAULT_MODEL
from agents.rollout import RolloutConfig

ENV_ID = "multihop-qa"
# Small enough to finish in a few minutes on 2 CPU cores (the papers allow 6192 response tokens).
DEMO_LIMIT, DEMO_MAX_NEW_TOKENS, DEMO_MAX_RESPONSE_TOKENS = 4, 64, 512
EXACT_TOLERANCE = 1e-3  # float32 sampler vs. forward pass, the bound


async def run(limit: int, max_new_tokens: int, max_response_tokens: int) -> tuple[EvalReport, HFEngine]:
    engine = HFEngine(DEFAULT_MODEL, max_batch_size=limit)
    rollout = RolloutConfig(sampling=SamplingParams(temperature=0, max_new_tokens=max_new_tokens),
                            concurrency=limit, max_response_tokens=max_response_tokens, keep_states=False)
    try:
        report = await evaluate(engine, engine.tokenizer, [ENV_ID], limit=limit, rollout=rollout)
    finally:
        await engine.close()
    return report, engine


def main() -> None:
    parser = argparse.ArgumentParser(description="The embedded model answering multihop-qa questions through the rollout loop.")
    parser.add_argument("--limit", type=int, default=DEMO_LIMIT, help=f"questions (default {DEMO_LIMIT})")
    parser.add_argument("--max-new-tokens", type=int, default=DEMO_MAX_NEW_TOKENS,
                        help=f"tokens per turn (default {DEMO_MAX_NEW_TOKENS})")
    parser.add_argument("--max-response-tokens", type=int, default=DEMO_MAX_RESPONSE_TOKENS,
                        help=f"token budget per episode after the prompt (default {DEMO_MAX_RESPONSE_TOKENS})")
    args = parser.parse_args()
    if min(args.limit, args.max_new_tokens, args.max_response_tokens) < 1:
        parser.error("--limit, --max-new-tokens and --max-response-tokens must be >= 1")

    print(f"{DEFAULT_MODEL} (HFEngine, CPU, greedy) on {args.limit} {ENV_ID} questions, all episodes concurrently")
    report, engine = asyncio.run(run(args.limit, args.max_new_tokens, args.max_response_tokens))
    first = report.trajectories[0]
    print(f"\n=== transcript of question {first.key[1]}")
    print(transcript(first, engine.tokenizer))
    tokens = sum(t.num_action_tokens for t in report.trajectories)
    print(f"\n=== scores ({len(report.trajectories)} episodes, {tokens} sampled tokens in {report.seconds:.1f} s, "
          f"{tokens / report.seconds:.1f} tokens/s)")
    print(report.table())

    gap, count = sampler_logprob_gap(engine.model, report.trajectories)
    print(f"\n=== token-in-token-out: a fresh forward pass over the saved ids reproduces the sampler's "
          f"log-probs of {count} action tokens within {gap:.2e} (bound {EXACT_TOLERANCE:g})")
    if gap > EXACT_TOLERANCE:
        raise SystemExit(f"demo check failed: log-prob gap {gap:.2e} > {EXACT_TOLERANCE:g}")


if __name__ == "__main__":
    main()
