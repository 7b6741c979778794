"""Probes for the main job's task: how often the untrained embedded model's sampled episodes carry signal.

    python -m benchmarks.demo_probe [--questions 16] [--samples 4] [--json PATH] [--options NAME,NAME]
        [--model PATH] [--temperature T]

RL learns only from groups whose rewards differ: a prompt whose samples all get the same reward
has zero advantages. Before choosing the demo's task, reward and prompt (issue 18), each option
below samples ``--samples`` episodes of SmolLM2-135M (HFEngine, CPU) on ``--questions`` training
questions (the tasks after the cpu-demo's 50 held-out ones), with the cpu-demo's sampling and
limits (temperature 0.6, 48 tokens a turn, 256 response tokens, two tool calls, top-1 passage of
300 characters), and reports per option:

- ``signal``: the share of questions whose samples' rewards are not all equal (what a group
  advantage can learn from), beside the mean reward;
- ``format``, ``searched`` (at least one search call), ``f1>0``, ``em``: shares of episodes;
- ``in passage``: answers found (normalised, as a substring) in a passage the episode retrieved;
- ``= example``: answers equal to the worked example's answer ("France"), and ``distinct``: the
  number of different answers over the number of answered episodes;
- ``nats/token``: the mean negative log-prob of the sampled action tokens under the sampling
  distribution, a Monte Carlo estimate of its entropy: how much room to differ a policy leaves
  its samples (``--model`` a cold-start checkpoint, ``--temperature`` the RL stage's).

These are counts, not timings, so a shared machine changes the time the run takes but not its
numbers (the sampling seed is fixed). The baseline is today's cpu-demo setting, in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

import agentenv
from agentenv import TokenEnv
from agentenv.graders import normalize_answer
from agents.engines import HFEngine, SamplingParams
from agents.models import DEFAULT_MODEL
from agents.rollout import RolloutConfig, episodes_for, run_episodes
from agents.run.config import preset

HOLDOUT = 50  # the cpu-demo's held-out tasks come first; probes use training tasks only
EXAMPLE_ANSWER = "france"  # SEARCH_EXAMPLE's answer (agentenv.envs.qa)

#: name → (environment id, env_kwargs over the cpu-demo's). The cpu-demo's own is the baseline.
OPTIONS: dict[str, tuple[str, dict[str, Any]]] = {
    "cpu-demo": ("multihop-qa", {}),  # the preset's: HotpotQA, AT²PO's released reward (think pair, EM)
    "demo": ("multihop-qa", {"example": False, "reward": "arpo"}),  # make demo's RL stage: ARPO's F1 reward
    "multihop-f1": ("multihop-qa", {"reward": "f1"}),  # partial credit, no format rules
    "nq-f1": ("singlehop-qa:nq", {"reward": "f1"}),
    "triviaqa-f1": ("singlehop-qa:triviaqa", {"reward": "f1"}),
    "triviaqa-f1-top3": ("singlehop-qa:triviaqa", {"reward": "f1", "topk": 3}),
}


def _retrieved_text(trajectory: Any, tokenizer: Any) -> str:
    return normalize_answer(" ".join(tokenizer.decode(turn.obs_ids) for turn in trajectory.turns))


async def probe(
    engine: HFEngine,
    env_id: str,
    env_kwargs: dict[str, Any],
    questions: int,
    samples: int,
    temperature: float | None = None,
) -> dict[str, float]:
    """One option's numbers (see the module docstring); ``temperature`` replaces the cpu-demo's."""
    demo = preset("cpu-demo", "at2po")
    kwargs = {**demo["env_kwargs"], **env_kwargs}
    env = TokenEnv(agentenv.make(env_id, **kwargs), engine.tokenizer)
    temperature = demo["sampling"]["temperature"] if temperature is None else temperature
    config = RolloutConfig(
        sampling=SamplingParams(temperature=temperature, max_new_tokens=48, seed=0),
        max_response_tokens=demo["rollout"]["max_response_tokens"],
        concurrency=32,
    )
    tasks = list(range(HOLDOUT, HOLDOUT + questions))
    start = time.perf_counter()
    try:
        trajectories = await run_episodes(engine, episodes_for(env, tasks, samples=samples), config)
    finally:
        env.close()
    grades = [t.info.get("grade") or {} for t in trajectories]
    answers = [normalize_answer(g["answer"]) for g in grades if g.get("answer")]
    rewards: dict[int, list[float]] = {}
    for trajectory in trajectories:
        rewards.setdefault(trajectory.key[0], []).append(trajectory.reward)
    in_passage = [
        bool(g.get("answer"))
        and normalize_answer(g["answer"]) != ""
        and normalize_answer(g["answer"]) in _retrieved_text(t, engine.tokenizer)
        for t, g in zip(trajectories, grades)
    ]
    n = len(trajectories)
    action_logprobs = [lp for t in trajectories for turn in t.turns for lp in turn.sampler_logprobs]
    return {
        "episodes": n,
        "signal": sum(len(set(r)) > 1 for r in rewards.values()) / len(rewards),
        "mean_reward": sum(t.reward for t in trajectories) / n,
        "format": sum(bool(g.get("format_ok")) for g in grades) / n,
        "searched": sum(int(t.info.get("tool_calls", 0)) > 0 for t in trajectories) / n,
        "f1_positive": sum(float(g.get("f1", 0)) > 0 for g in grades) / n,
        "em": sum(float(g.get("em", 0)) for g in grades) / n,
        "in_passage": sum(in_passage) / n,
        "equals_example": sum(a == EXAMPLE_ANSWER for a in answers) / n,
        "distinct_answers": len(set(answers)) / max(len(answers), 1),
        "nll": -sum(action_logprobs) / max(len(action_logprobs), 1),
        "seconds": time.perf_counter() - start,
    }


def table(results: dict[str, dict[str, float]]) -> str:
    """The results as a text table, the baseline first."""
    columns = [
        ("signal", "signal"),
        ("mean_reward", "reward"),
        ("format", "format"),
        ("searched", "searched"),
        ("f1_positive", "f1>0"),
        ("em", "em"),
        ("in_passage", "in passage"),
        ("equals_example", "= example"),
        ("distinct_answers", "distinct"),
        ("nll", "nats/token"),
    ]
    width = max(len(name) for name in results)
    lines = [f"{'option':<{width}}  " + "  ".join(f"{label:>10}" for _, label in columns)]
    for name, numbers in results.items():
        cells = [f"{numbers[key]:>+10.3f}" if key == "mean_reward" else f"{numbers[key]:>10.2f}" for key, _ in columns]
        lines.append(f"{name:<{width}}  " + "  ".join(cells))
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    names = list(OPTIONS) if args.options is None else args.options.split(",")
    unknown = [name for name in names if name not in OPTIONS]
    if unknown:
        raise SystemExit(f"unknown option {unknown[0]!r}; the options are {', '.join(OPTIONS)}")
    engine = HFEngine(args.model)
    results = {}
    try:
        for name in names:
            env_id, kwargs = OPTIONS[name]
            results[name] = await probe(engine, env_id, kwargs, args.questions, args.samples, args.temperature)
            print(f"{name}: {results[name]['seconds']:.0f} s", file=sys.stderr, flush=True)
    finally:
        await engine.close()
    return {
        "command": "python -m benchmarks.demo_probe " + " ".join(sys.argv[1:]),
        "model": args.model,
        "temperature": args.temperature,
        "questions": args.questions,
        "samples": args.samples,
        "options": {name: {"env": OPTIONS[name][0], "env_kwargs": OPTIONS[name][1], **results[name]} for name in names},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--questions", type=int, default=16, help="training questions per option (default 16)")
    parser.add_argument("--samples", type=int, default=4, help="sampled episodes per question (default 4)")
    parser.add_argument("--options", help="comma-separated option names (default all)")
    parser.add_argument("--model", default=DEFAULT_MODEL, help=f"model name or folder (default {DEFAULT_MODEL})")
    parser.add_argument("--temperature", type=float, help="sampling temperature (default the cpu-demo's, 0.6)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    report = asyncio.run(main_async(args))
    print(table({name: numbers for name, numbers in report["options"].items()}))
    if args.json:
        with open(args.json, "w") as file:
            json.dump(report, file, indent=2)


if __name__ == "__main__":
    main()
