"""Asynchronous training benchmark: steps per hour and idle time at max_staleness η = 0, 1, 4.

    python -m benchmarks.async_bench [--json PATH] [--parts real,simulated] [--etas 0,1,4] [--update-shares 1,0.75,0.5]
        [--engine-batch 8] [--in-flight] [--whole] [--real-steps 3]

Each η ≥ 1 runs with syncs between requests (a sync holds new requests until those in flight
finish) and the update streamed (``stream_update``: each prompt's trees go to the trainer's passes
as they come back); ``--in-flight`` adds a run of it with ``cluster.in_flight_updates`` (a sync
lands between two decode steps and the requests go on), labelled ``η+``, and ``--whole`` one whose
update waits for the whole step (``stream_update=false``), labelled ``η whole``. The engine idle fraction is the time
an engine had no request in flight (``time/engine_idle_s``), the worker idle fraction the time a
worker held no prompt (``time/worker_idle_s``; the engine also idles inside it, through tool calls
and drains before a sync).

(a) Real model on CPU. ``agents train`` with the ``cpu-demo`` preset (AT²PO on ``multihop-qa``,
    the embedded SmolLM2-135M) on one rollout worker process and the trainer in this process, one
    core each, at each η: rollout and update take comparable time there (about half a minute
    each). Steps per hour and the engine's and the trainer's idle fractions over the steady state
    (:func:`_timing`: steps ``max(η) + 2`` … ``max(η) + k + 1`` of ``1 + 2·max(η) + k``, k =
    ``--real-steps``; model loads and the held-out evaluation excluded), and the ratio to the first η. The learning
    check: the held-out reward after the same trees (the same tasks, none dropped) at each η,
    with its 95% interval.
(b) Simulated cluster. ``SIM_WORKERS`` rollout workers whose engine is a scripted one (each turn
    ``SIM_TOKENS`` tokens after tokens × ``SIM_TOKEN_LATENCY_S``, ``--engine-batch`` requests at once,
    8 by default: a worker's share of a step fits its batch)
    on a toy environment whose episodes last 1 to ``SIM_MAX_TURNS`` turns (a long tail: a step
    waits for its longest), and a trainer whose update takes a share of one synchronous rollout
    of a step (the warm-up's; ``--update-shares``, default 1, 0.75 and 0.5; its passes
    ``1 − SIM_OPTIMIZER_SHARE`` of it, spread over the step's paths, and streamed as the real
    trainer's are), then a real weight sync through the pool. The same pipeline code (``agents.run.steps.PipelinedSteps``) drives both.
    Why the engines still idle at η = 1 here: a worker's part of a step ends before the step's
    longest tree, and the bound keeps it from starting a step further ahead until the update on
    the step before is done (see docs/scaling.md, "Asynchronous training").
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import agentenv
from agents.engines.base import Completion, SamplingParams
from agents.engines.scripted import ScriptedEngine
from agents.models import DEFAULT_MODEL
from agents.run.cluster.rollout_workers import RolloutPool, WorkerSpec
from agents.run.cluster.runtime import cpu_share, ensure_ray
from agents.run.config import build, resolve
from benchmarks.scale_bench import table

REAL_MEASURED = 3  # steps measured a run by default (the steady state; see _timing)
REAL_EVAL_QUESTIONS = 48  # held-out questions of the learning check (the cpu-demo preset scores 8)
SIM_WORKERS = 8
SIM_MEASURED = 6
SIM_PROMPTS_PER_STEP = 16  # two a worker
SIM_TOKENS, SIM_TOKEN_LATENCY_S = 100, 0.01  # 1 s a turn
SIM_MAX_TURNS = 6
SIM_BATCH = 8  # requests an engine runs at once: one step's 2 prompts x 4 chains
SIM_PATHS_PER_STEP = SIM_PROMPTS_PER_STEP * 4  # GRPO, 4 chains a prompt
# The optimiser step's share of an update (the rest is the passes over the paths): a model's choice,
# not a measurement; AdamW and the clip go over the weights once, the passes over every token.
SIM_OPTIMIZER_SHARE = 0.1


def _runs(etas: Sequence[int], in_flight: bool, whole: bool) -> list[tuple[str, int, bool, bool]]:
    """(label, η, in-flight loads, streamed update) of each run: every η (its update streamed when η ≥ 1),
    with ``in_flight`` each η ≥ 1 again with them (``η+``), with ``whole`` each η ≥ 1 again with
    the update waiting for the whole step (``η whole``, ``stream_update=false``)."""
    runs = [(str(eta), eta, False, True) for eta in etas]
    runs += [(f"{eta}+", eta, True, True) for eta in etas if eta and in_flight]
    return runs + [(f"{eta} whole", eta, False, False) for eta in etas if eta and whole]


def _run_steps(etas: Sequence[int], measured: int) -> int:
    """Steps a run goes: the pipeline's fill, the ``measured`` steps, and the tail (see :func:`_timing`)."""
    return 1 + 2 * max(etas) + measured


def _timing(history: list[dict[str, float]], measured: int, fill: int) -> dict[str, Any]:
    """Steps per hour and idle fractions over steps ``fill + 2`` … ``fill + measured + 1`` of a run.

    The steady state, the same steps at every η, with ``fill = max(η)``: steps 1 … η + 1 start
    together on the first weights and share the engines (so the engines idle through the first
    update: there is no later step they may start), and a run's last η steps have no later steps
    to roll out while the trainer works on them, so each run goes ``1 + 2·max(η) + measured``
    steps and only the ``measured`` steps between the fill and the tail count.
    """
    window = history[1 + fill : 1 + fill + measured]
    cycle = sum(record["time/cycle_s"] for record in window)
    return {
        "steps": len(window),
        "seconds": cycle,
        "steps_per_hour": 3600 * len(window) / cycle,
        "engine_idle": sum(record["time/engine_idle_s"] for record in window) / cycle,
        "worker_idle": sum(record["time/worker_idle_s"] for record in window) / cycle,
        "trainer_idle": sum(record["time/trainer_idle_s"] for record in window) / cycle,
        "staleness_mean": statistics.fmean(record["async/staleness_mean"] for record in window),
        "trees_dropped": sum(record["async/trees_dropped"] for record in history),
        "per_step": [
            {name: value for name, value in record.items() if name.startswith(("time/", "async/"))}
            for record in history
        ],
    }


def _pace_heads(etas: Sequence[int]) -> list[str]:
    return ["steps/h", f"× η={etas[0]}", "engine idle", "worker idle", "trainer idle"]


def _pace(row: dict[str, Any]) -> list[float]:
    """A run's steps per hour, its ratio to the first η's, and its idle fractions (the columns of :func:`_pace_heads`)."""
    return [row[name] for name in ("steps_per_hour", "ratio", "engine_idle", "worker_idle", "trainer_idle")]


# -- (a) the real model -------------------------------------------------------------------------


async def _real(results: dict[str, Any], etas: list[int], in_flight: bool, whole: bool, measured: int) -> None:
    import torch

    from agents.run.train import train

    torch.set_num_threads(1)  # the trainer's core; the worker gets the other (agents.run.train gives it 2 // 2)
    rows = {}
    steps = _run_steps(etas, measured)
    with tempfile.TemporaryDirectory() as folder:
        for label, eta, loads_in_flight, streamed in _runs(etas, in_flight, whole):
            config = resolve(
                preset_name="cpu-demo",
                values={
                    "algo": "at2po",
                    "env": "multihop-qa",
                    "model": DEFAULT_MODEL,
                    "steps": steps,
                    "max_staleness": eta,
                    "stream_update": streamed,
                    "eval_before": False,
                    "eval_every": steps,
                    "eval_questions": REAL_EVAL_QUESTIONS,
                    "checkpoint_every": steps,
                },
                assignments=[
                    "cluster.rollout_workers=1",
                    f"cluster.in_flight_updates={str(loads_in_flight).lower()}",
                    "trainer.old_logprobs=recompute",
                    "trainer.report_to=[none]",
                ],
            )
            start = time.perf_counter()
            result = await train(config, Path(folder) / f"eta{label}", progress=False, log=lambda note: None)
            row = _timing(result.history, measured, fill=max(etas))
            row["wall_s"] = time.perf_counter() - start
            row["rollout_s"] = statistics.fmean(record["time/rollout_s"] for record in result.history)
            row["update_s"] = statistics.fmean(record["time/update_s"] for record in result.history)
            score = result.heldout[-1].scores["reward"]
            row["heldout_reward"] = [score.mean, score.low, score.high]
            row["heldout_questions"] = result.heldout[-1].questions
            rows[label] = row
            print(f"  η={label}: {row['steps_per_hour']:.1f} steps/h, held-out reward {score}", flush=True)
    base = rows[str(etas[0])]["steps_per_hour"]
    for row in rows.values():
        row["ratio"] = row["steps_per_hour"] / base
    results["real"] = {"rows": rows, "steps": steps, "measured": measured}
    print(
        table(
            f"(a) cpu-demo AT²PO on 1 rollout worker + 1 trainer, one core each: steps {max(etas) + 2}-"
            f"{max(etas) + measured + 1} of {steps}",
            [
                "η",
                *_pace_heads(etas),
                "rollout s",
                "update s",
                "staleness",
                "held-out reward [95%]",
            ],
            [
                [
                    eta,
                    *_pace(r),
                    r["rollout_s"],
                    r["update_s"],
                    r["staleness_mean"],
                    "{:.3f} [{:.3f}, {:.3f}]".format(*r["heldout_reward"]),
                ]
                for eta, r in rows.items()
            ],
        )
    )


# -- (b) the simulated cluster ------------------------------------------------------------------


class LongTail(agentenv.Env):
    """A toy environment whose episode lasts 1 to SIM_MAX_TURNS turns (drawn from the reset seed)."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.turns, self.length = 0, int(self.np_random.integers(1, SIM_MAX_TURNS + 1))
        return "Say something a few times.", {}

    def step(self, action):
        self.turns += 1
        done = self.turns == self.length
        return "again", float(done) * self.length / SIM_MAX_TURNS, done, False, {}


class SimulatedEngine(ScriptedEngine):
    """Every turn is SIM_TOKENS tokens after SIM_TOKENS × the per-token latency, at most SIM_BATCH at once
    (an engine's batch: a request beyond it waits, so two steps in flight share the engine's throughput);
    a sync loads nothing. Loads in flight are supported: a turn's tokens come evenly over its latency,
    and each has the version of the last load before it."""

    supports_inflight_updates = True

    def __init__(self, batch: int = SIM_BATCH) -> None:
        super().__init__(lambda ids: list(range(100, 100 + SIM_TOKENS)), latency_s=SIM_TOKENS * SIM_TOKEN_LATENCY_S)
        self.batch = asyncio.Semaphore(batch)
        self.max_batch_size = batch  # the worker's gate lets this many in, older steps' first
        self.loads: list[tuple[float, int]] = []  # (time, version) of each load in flight

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        async with self.batch:
            start = time.perf_counter()
            completion = await super().generate(prompt_ids, params)
        if self.loads:
            every = self.latency_s / len(completion.token_ids)
            completion.token_versions = [
                self._version_at(start + every * (i + 1)) for i in range(len(completion.token_ids))
            ]
        return completion

    def _version_at(self, moment: float) -> int | None:
        return next((version for when, version in reversed(self.loads) if when <= moment), None)

    async def update_weights(self, state_dict: Any) -> None:
        pass  # a simulated model has no weights: the sync still travels through the object store and the gate

    async def update_weights_in_flight(self, state_dict: Any, version: int) -> None:
        self.loads.append((time.perf_counter(), version))


@dataclasses.dataclass(frozen=True)
class _SimulatedEngines:
    """Builds a worker's SimulatedEngine (what Ray sends the workers; a functools.partial of the class does not pickle)."""

    batch: int

    def __call__(self) -> SimulatedEngine:
        return SimulatedEngine(self.batch)


class _SimulatedTrainer:
    """A trainer whose update takes ``update_s`` a step: ``SIM_OPTIMIZER_SHARE`` of it the optimiser
    step, the rest the passes, spread evenly over the step's paths (those :meth:`accumulate` got run
    while the step rolls out, as ``Trainer.accumulate``'s do)."""

    def __init__(self, update_s: float) -> None:
        self.update_s, self.accumulated = update_s, 0

    async def accumulate(self, paths: list[Any]) -> None:
        self.accumulated += len(paths)
        await asyncio.sleep(self._passes_s(len(paths)))

    async def step(self, rest: list[Any]) -> None:
        self.accumulated = 0
        await asyncio.sleep(self._passes_s(len(rest)) + SIM_OPTIMIZER_SHARE * self.update_s)

    def _passes_s(self, paths: int) -> float:
        return (1 - SIM_OPTIMIZER_SHARE) * self.update_s * paths / SIM_PATHS_PER_STEP


async def _simulated(
    results: dict[str, Any], etas: list[int], shares: list[float], batch: int, in_flight: bool, whole: bool
) -> None:
    import torch

    from agents.run.steps import PipelinedSteps
    from agents.run.task_order import TaskOrder

    agentenv.register("async-bench/long-tail-v0", LongTail)
    steps = _run_steps(etas, SIM_MEASURED)
    ensure_ray("local", processes=SIM_WORKERS)
    weights = {"w": torch.zeros(4)}
    runs = _runs(etas, in_flight, whole)
    rows: dict[float, dict[str, Any]] = {share: {} for share in shares}
    rollout_s = None
    for loads_in_flight in dict.fromkeys(loads for _, _, loads, _ in runs):  # one pool of workers per kind of load
        config = resolve(
            values={
                "algo": "grpo",
                "env": "async-bench/long-tail",
                "model": DEFAULT_MODEL,
                "steps": steps,
                "prompts_per_step": SIM_PROMPTS_PER_STEP,
            },
            assignments=[
                f"sampling.max_new_tokens={SIM_TOKENS}",
                "rollout.max_response_tokens=4096",
                "strategy.n=4",
                f"cluster.rollout_workers={SIM_WORKERS}",
                f"cluster.in_flight_updates={str(loads_in_flight).lower()}",
            ],
        )
        parts = build(config)
        spec = WorkerSpec(
            config, agentenv.spec(config.env), parts.learner.strategy, parts.tree, engine=_SimulatedEngines(batch)
        )
        pool = RolloutPool(spec, SIM_WORKERS, cpus=cpu_share(SIM_WORKERS), restarts=0)
        try:
            if rollout_s is None:
                start = time.perf_counter()
                await pool.rollout(
                    list(range(SIM_PROMPTS_PER_STEP)), 0
                )  # warm-up, and a synchronous rollout's duration
                rollout_s = time.perf_counter() - start
            for share in shares:
                for label, eta, loads, streamed in runs:
                    if loads != loads_in_flight:
                        continue
                    config.max_staleness = eta
                    order = TaskOrder(None, holdout=0, seed=0)
                    trainer = _SimulatedTrainer(share * rollout_s)
                    accumulate = trainer.accumulate if eta and streamed else None
                    pipeline = PipelinedSteps(config, parts, pool, order, False, ahead=eta, accumulate=accumulate)
                    history = []
                    for step in range(1, steps + 1):
                        paths, metrics, _ = await pipeline.batch(step)
                        await trainer.step(paths)
                        await pool.update_weights(weights)
                        pipeline.trained(step)
                        history.append(metrics)
                    await pipeline.close()
                    row = rows[share][label] = _timing(history, SIM_MEASURED, fill=max(etas))
                    print(f"  update {share:g} x rollout, η={label}: {row['steps_per_hour']:.0f} steps/h", flush=True)
        finally:
            await pool.close()
    assert rollout_s is not None
    settings: list[dict[str, Any]] = []
    for share in shares:
        base = rows[share][str(etas[0])]["steps_per_hour"]
        for row in rows[share].values():
            row["ratio"] = row["steps_per_hour"] / base
        ordered = {label: rows[share][label] for label, _, _, _ in runs}
        settings.append({"update_share": share, "update_s": share * rollout_s, "rows": ordered})
    results["simulated"] = {
        "settings": settings,
        "workers": SIM_WORKERS,
        "engine_batch": batch,
        "in_flight": in_flight,
        "steps": steps,
        "measured": SIM_MEASURED,
        "prompts_per_step": SIM_PROMPTS_PER_STEP,
        "rollout_s": rollout_s,
        "turn_s": SIM_TOKENS * SIM_TOKEN_LATENCY_S,
        "max_turns": SIM_MAX_TURNS,
    }
    print(
        table(
            f"(b) simulated cluster: {SIM_WORKERS} scripted workers, {SIM_PROMPTS_PER_STEP} prompts x 4 chains of 1-"
            f"{SIM_MAX_TURNS} {SIM_TOKENS * SIM_TOKEN_LATENCY_S:.0f}-s turns a step, {batch} requests an engine at once "
            f"(a synchronous rollout "
            f"{rollout_s:.1f} s), steps {max(etas) + 2}-{max(etas) + SIM_MEASURED + 1} of {steps}",
            [
                "update s",
                "η",
                *_pace_heads(etas),
                "staleness",
                "dropped",
            ],
            [
                [
                    setting["update_s"],
                    eta,
                    *_pace(r),
                    r["staleness_mean"],
                    int(r["trees_dropped"]),
                ]
                for setting in settings
                for eta, r in setting["rows"].items()
            ],
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--parts", default="real,simulated", help="real, simulated, or both (comma-separated)")
    parser.add_argument("--etas", default="0,1,4", help="the max_staleness values, the first the baseline")
    parser.add_argument(
        "--update-shares", default="1,0.75,0.5", help="(b): the simulated update's duration, as shares of a rollout's"
    )
    parser.add_argument(
        "--engine-batch", type=int, default=SIM_BATCH, help="(b): requests a simulated engine runs at once"
    )
    parser.add_argument(
        "--real-steps", type=int, default=REAL_MEASURED, help="(a): steps measured a run, after the pipeline's fill"
    )
    parser.add_argument(
        "--in-flight", action="store_true", help="also run each η >= 1 with cluster.in_flight_updates (label η+)"
    )
    parser.add_argument(
        "--whole",
        action="store_true",
        help="also run each η >= 1 with the update waiting for the whole step (stream_update=false; label 'η whole')",
    )
    args = parser.parse_args()
    parts = args.parts.split(",")
    etas = [int(value) for value in args.etas.split(",")]
    results: dict[str, Any] = {"cores": os.cpu_count(), "load_average": list(os.getloadavg())}
    start = time.perf_counter()
    if "simulated" in parts:
        shares = [float(value) for value in args.update_shares.split(",")]
        asyncio.run(_simulated(results, etas, shares, args.engine_batch, args.in_flight, args.whole))
    if "real" in parts:
        asyncio.run(_real(results, etas, args.in_flight, args.whole, args.real_steps))
    results["seconds"] = time.perf_counter() - start
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1, default=str) + "\n")


if __name__ == "__main__":
    # The imported module's main, not __main__'s: Ray pickles classes of __main__ by value, and the
    # workers need this module's classes by name.
    from benchmarks.async_bench import main as imported_main

    imported_main()
