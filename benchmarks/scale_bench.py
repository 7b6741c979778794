"""Scale-out benchmark: rollout workers on the real model, a simulated cluster, and the weight sync.

    python -m benchmarks.scale_bench [--json PATH] [--parts real,simulated,sync] [--workers 1,8,32,64]

(a) Real model on CPU. The same ``multihop-qa`` prompts (the ``cpu-demo`` preset's AT²PO trees
    on the embedded SmolLM2-135M, the same rollout seed) rolled out by one process (today's
    ``agents train``), by one rollout worker, and by two (one core each), twice each in
    turn (median); rollout tokens per second and their ratio to the single process, and steps
    per hour (rollout + the trainer's update of those trees, measured once in this process, +
    the weight sync to the workers).
(b) Simulated cluster. Rollout workers whose engine is a scripted one answering each turn after
    ``tokens × per-token latency``, 4 prompts of a four-turn toy environment per worker, at 1, 8,
    32 and 64 workers on this machine. Ideal throughput is M times one worker's alone; the table
    gives the fraction the driver reaches, the driver's CPU seconds per step, and each worker's
    memory (PSS, the median over the workers).
(c) Weight sync. SmolLM2-135M's float32 weights through Ray's object store to two workers: put,
    load and total seconds, bytes, the share of a cpu-demo step it takes (from (a)), and the time
    projected at the measured bandwidth for the bfloat16 weights of 4B and 14B models.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import agentenv
from agentenv.wrappers import TokenEnv
from agents.models import DEFAULT_MODEL, load_tokenizer
from agents.rollout.strategies import Chain
from agents.run.cluster.rollout_workers import RolloutPool, WorkerSpec
from agents.run.cluster.runtime import cpu_share, ensure_ray
from agents.run.config import build, resolve

# Eight training prompts of multihop-qa (the first 50 are held out): four a worker at M = 2, so that each
# engine still batches several trees and one long tree does not decide the step alone.
REAL_TASKS = list(range(60, 68))
REAL_SEED = 7
REAL_ROUNDS = 2  # rollouts of the same prompts per layout, in turn; the table gives the median
SIM_PROMPTS_PER_WORKER = 4
# 200-token turns at 20 ms per token (a 4B model on a GPU): 4 s a turn. The papers' turns are longer (up to
# 6192 response tokens over at most 6 tool calls); shorter turns make the workers' own CPU per turn, which
# on this 2-core machine all workers share, look like the driver's cost.
SIM_TOKENS, SIM_TOKEN_LATENCY_S = 200, 0.02
SIM_TURNS = 4
PROJECTED = {"Qwen3-4B": 4.02e9, "Qwen3-14B": 14.8e9}  # parameters; bfloat16 weights (2 bytes each)


def table(title: str, header: list[str], rows: list[list[Any]]) -> str:
    """A plain-text table under ``title``: the header, then the rows (floats to 3 significant digits)."""
    cells = [header] + [[f"{v:.3g}" if isinstance(v, float) else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header))]
    lines = [title, "  ".join(h.ljust(w) for h, w in zip(cells[0], widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells[1:]]
    return "\n".join(lines)


# -- (a) the real model -------------------------------------------------------------------------


def _real_config():
    return resolve(preset_name="cpu-demo", values={"algo": "at2po", "env": "multihop-qa", "model": DEFAULT_MODEL})


async def _real(results: dict[str, Any]) -> None:
    from agents.run.backends import LocalRollout, run_engine
    from agents.run.steps import rollout_step
    from agents.training.trainer import Trainer

    config = _real_config()
    parts = build(config)
    tokenizer = load_tokenizer(config.model)
    rows: dict[str, dict[str, Any]] = {}

    async def measure(name: str, rollout: Any) -> None:
        start = time.perf_counter()
        prompts = await rollout.rollout(REAL_TASKS, REAL_SEED)
        seconds = time.perf_counter() - start
        tokens = sum(prompt.tokens for prompt in prompts)
        row = rows.setdefault(name, {"rollout_s_runs": [], "tokens": float(tokens)})
        row["rollout_s_runs"].append(seconds)
        print(f"  {name}: {tokens} tokens in {seconds:.1f} s", flush=True)

    env = TokenEnv(agentenv.make(config.env, **config.env_kwargs), tokenizer)
    layouts: dict[str, Any] = {
        "single process": LocalRollout(env, run_engine(config, parts.tree.rollout), tokenizer, parts)
    }
    ensure_ray("local", processes=3)
    for workers in (1, 2):  # each worker's torch threads: its share of the 2 cores (oversubscribing is ~5x slower)
        spec = WorkerSpec(
            config, agentenv.spec(config.env), parts.learner.strategy, parts.tree, threads=max(1, 2 // workers)
        )
        layouts[f"{workers} rollout worker{'s' * (workers > 1)}"] = RolloutPool(spec, workers, cpus=1)
    for rollout in layouts.values():
        await rollout.rollout(REAL_TASKS[:1], REAL_SEED + 1)  # warm-up: first forward passes, caches
    for _ in range(REAL_ROUNDS):  # alternating, so that the machine's load changes hit every layout alike
        for name, rollout in layouts.items():
            await measure(name, rollout)
    pool = layouts.pop("2 rollout workers")
    for rollout in layouts.values():
        await rollout.close()
    for row in rows.values():
        row["rollout_s"] = statistics.median(row["rollout_s_runs"])
        row["tokens_per_s"] = row["tokens"] / row["rollout_s"]
    # One trainer update of such a batch (the same in every layout: the trainer runs in the driver).
    paths, metrics = await rollout_step(pool, parts, REAL_TASKS, REAL_SEED, config.budget_reward, lambda _: None)
    trainer = Trainer(config.model, dataclasses.replace(parts.trainer, progress=False))
    trainer.engine = pool
    record = await trainer.step(paths, metrics)
    update_s, sync_s = record["time/old_logprobs_s"] + record["time/update_s"], record["time/sync_s"]
    await pool.close()
    single = rows["single process"]
    lines = []
    for name, row in rows.items():
        row["ratio_to_single"] = row["tokens_per_s"] / single["tokens_per_s"]
        row["steps_per_hour"] = 3600 / (row["rollout_s"] + update_s + (0 if name == "single process" else sync_s))
        lines.append(
            [name, row["tokens"], row["rollout_s"], row["tokens_per_s"], row["ratio_to_single"], row["steps_per_hour"]]
        )
    results["real"] = {"rows": rows, "update_s": update_s, "sync_s": sync_s, "tasks": REAL_TASKS}
    print(
        table(
            f"(a) real model on CPU: {len(REAL_TASKS)} cpu-demo AT2PO prompts; update {update_s:.1f} s, sync {sync_s:.2f} s",
            ["layout", "tokens", "rollout s", "tokens/s", "x single", "steps/h"],
            lines,
        )
    )


# -- (b) the simulated cluster ----------------------------------------------------------------


class FewTurns(agentenv.Env):
    """A toy environment: SIM_TURNS turns, then a reward of 1 (the simulation's work is the engine's latency)."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.turns = 0
        return "Say something a few times.", {}

    def step(self, action):
        self.turns += 1
        done = self.turns == SIM_TURNS
        return "again", float(done), done, False, {}


def scripted_engine():
    """The simulated worker's engine: every turn is SIM_TOKENS tokens after SIM_TOKENS × the per-token latency."""
    from agents.engines.scripted import ScriptedEngine

    return ScriptedEngine(lambda ids: list(range(100, 100 + SIM_TOKENS)), latency_s=SIM_TOKENS * SIM_TOKEN_LATENCY_S)


async def _simulated(results: dict[str, Any], counts: list[int]) -> None:
    agentenv.register("scale-bench/few-turns-v0", FewTurns)
    config = resolve(
        values={"algo": "grpo", "env": "scale-bench/few-turns", "model": DEFAULT_MODEL},
        assignments=[f"sampling.max_new_tokens={SIM_TOKENS}", "rollout.max_response_tokens=4096"],
    )
    parts = build(config)
    strategy = Chain(n=4)  # 4 chains a prompt, SIM_TURNS loop steps
    ray = ensure_ray("local", processes=max(counts))
    ray_cpus = ray.cluster_resources()["CPU"]
    rows, per_worker_alone = [], None
    for workers in counts:
        spec = WorkerSpec(config, agentenv.spec(config.env), strategy, parts.tree, engine=scripted_engine)
        pool = RolloutPool(spec, workers, cpus=cpu_share(workers), restarts=0)
        tasks = list(range(workers * SIM_PROMPTS_PER_WORKER))
        await pool.rollout(tasks[:workers], 0)  # warm-up
        pids = [info["pid"] for info in pool.info]
        memory = statistics.median(_pss_mib(pid) for pid in pids)
        times, cpu, worker_cpu = [], [], []
        for repeat in range(3):
            cpu_start, workers_start, start = time.process_time(), _cpu_s(pids), time.perf_counter()
            prompts = await pool.rollout(tasks, repeat)
            times.append(time.perf_counter() - start)
            cpu.append(time.process_time() - cpu_start)
            worker_cpu.append(_cpu_s(pids) - workers_start)
        await pool.close()
        _released(ray_cpus)  # the next pool is placed only once Ray has the killed workers' CPUs back
        tokens = sum(prompt.tokens for prompt in prompts)
        seconds = statistics.median(times)
        throughput = tokens / seconds
        if per_worker_alone is None:
            per_worker_alone = throughput / workers
        fraction = throughput / (workers * per_worker_alone)
        rows.append(
            {
                "workers": workers,
                "prompts": len(tasks),
                "tokens": tokens,
                "seconds": seconds,
                "tokens_per_s": throughput,
                "fraction_of_ideal": fraction,
                "driver_cpu_s": statistics.median(cpu),
                "workers_cpu_s": statistics.median(worker_cpu),
                "worker_pss_mib": memory,
            }
        )
        print(
            f"  {workers} workers: {throughput:.0f} tokens/s, {fraction:.2%} of ideal, {memory:.0f} MiB PSS a worker",
            flush=True,
        )
    results["simulated"] = {
        "rows": rows,
        "tokens_per_turn": SIM_TOKENS,
        "per_token_latency_s": SIM_TOKEN_LATENCY_S,
        "prompts_per_worker": SIM_PROMPTS_PER_WORKER,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
    }
    print(
        table(
            f"(b) simulated cluster: {SIM_PROMPTS_PER_WORKER} prompts x 4 chains x {SIM_TURNS} turns per worker, "
            f"{SIM_TOKENS}-token turns at {SIM_TOKEN_LATENCY_S * 1000:.0f} ms/token",
            [
                "workers",
                "prompts",
                "tokens/s",
                "of ideal",
                "driver CPU s/step",
                "workers CPU s/step",
                "step s",
                "MiB/worker",
            ],
            [
                [
                    r["workers"],
                    r["prompts"],
                    r["tokens_per_s"],
                    r["fraction_of_ideal"],
                    r["driver_cpu_s"],
                    r["workers_cpu_s"],
                    r["seconds"],
                    r["worker_pss_mib"],
                ]
                for r in rows
            ],
        )
    )


def _released(cpus: float, patience_s: float = 60.0) -> None:
    """Wait until Ray reports ``cpus`` CPUs free again (a killed actor's are returned a moment later)."""
    import ray

    deadline = time.monotonic() + patience_s
    while ray.available_resources().get("CPU", 0.0) < cpus - 1e-9 and time.monotonic() < deadline:
        time.sleep(0.5)  # nothing else runs on the driver between two pools


def _cpu_s(pids: list[int]) -> float:
    """User and system CPU seconds the processes ``pids`` have used so far."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime and stime (fields 14 and 15 of proc(5))
    return total / ticks


def _pss_mib(pid: int) -> float:
    """A process's proportional set size (its private memory plus its share of shared pages), in MiB."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no Pss line in /proc/{pid}/smaps_rollup")


# -- (c) the weight sync ------------------------------------------------------------------------


async def _sync(results: dict[str, Any]) -> None:
    from agents.models import load_model
    from agents.run.cluster.weight_sync import put_buckets

    config = _real_config()
    parts = build(config)
    ensure_ray("local", processes=3)
    spec = WorkerSpec(config, agentenv.spec(config.env), parts.learner.strategy, parts.tree)
    pool = RolloutPool(spec, 2, cpus=cpu_share(3))
    model = load_model(config.model)
    state = model.state_dict()
    reports = []
    for _ in range(3):
        start = time.perf_counter()
        refs, size = put_buckets(state, 256 * 2**20)
        put_s = time.perf_counter() - start
        report = await pool.load_buckets(refs, size, put_s)
        reports.append(report)
    digests = await pool.digests()
    await pool.close()
    best = min(reports, key=lambda r: r.put_s + r.load_s)
    total = best.put_s + best.load_s
    bandwidth = best.bytes / total
    step_s = None
    real = results.get("real")
    if real:
        row = real["rows"]["2 rollout workers"]
        step_s = row["rollout_s"] + real["update_s"] + total
    projected = {name: 2 * params / bandwidth for name, params in PROJECTED.items()}
    results["sync"] = {
        "bytes": best.bytes,
        "buckets": best.buckets,
        "put_s": best.put_s,
        "load_s": best.load_s,
        "total_s": total,
        "bandwidth_gb_s": bandwidth / 1e9,
        "share_of_cpu_demo_step": None if step_s is None else total / step_s,
        "projected_s": projected,
        "digests_equal": len(set(digests)) == 1,
    }
    rows = [["SmolLM2-135M fp32 → 2 workers", best.bytes / 1e9, best.put_s, best.load_s, total]]
    rows += [
        [f"{name} bf16 (projected)", 2 * params / 1e9, "", "", projected[name]] for name, params in PROJECTED.items()
    ]
    share = "" if step_s is None else f"; {total / step_s:.1%} of a cpu-demo step"
    print(
        table(
            f"(c) weight sync through the object store at {bandwidth / 1e9:.2f} GB/s{share}",
            ["weights", "GB", "put s", "load s", "total s"],
            rows,
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--parts", default="real,simulated,sync", help="which of real, simulated, sync to run")
    parser.add_argument("--workers", default="1,8,32,64", help="(b)'s worker counts")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    parts = args.parts.split(",")
    results: dict[str, Any] = {
        "command": "python -m benchmarks.scale_bench " + " ".join(sys.argv[1:]),
        "cores": os.cpu_count(),
        "load_average": list(os.getloadavg()),
    }
    started = time.perf_counter()
    if "real" in parts:
        asyncio.run(_real(results))
    if "sync" in parts:
        asyncio.run(_sync(results))
    if "simulated" in parts:
        asyncio.run(_simulated(results, [int(n) for n in args.workers.split(",")]))
    results["seconds"] = time.perf_counter() - started
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
