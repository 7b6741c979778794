"""A long run under faults: AT²PO for 100+ steps on a multi-node Ray cluster while processes are killed and hung.

    python -m benchmarks.soak [--steps 120] [--fault-every 15] [--seed 0] [--checkpoint-every 10]
        [--out DIR] [--json PATH]

**The cluster** is Ray's own on this host (``ray.cluster_utils.Cluster``, as Ray tests itself): a
head and two nodes, each offering one trainer rank's and one rollout worker's resource, joined the
way a user joins a cluster (``RAY_ADDRESS`` and ``cluster.address=auto``). **The run** is
``agents.run.train.train`` with the cpu-demo preset on ``tool-qa`` (search and a sandboxed Python):
2 trainer ranks and 2 rollout workers spread over the two nodes, the search served by a
retrieval server with 2 worker processes (``python -m agentenv.serve retrieval --workers 2``),
a checkpoint every ``--checkpoint-every`` steps (10).

**The engine.** 100+ steps of the embedded 135M model take over an hour on 2 cores and it rarely
calls Python, so the workers' engine is a scripted tool-calling policy (:func:`tool_policy`, given
as ``cluster.worker_engine="benchmarks.soak:tool_policy"``): from each turn's sampling seed it
searches, runs quick Python, runs Python that never ends (the sandbox's time limit must stop it:
a hung tool call), writes a malformed call, or answers. The trainer ranks train a tiny Llama with
SmolLM2's vocabulary on those tokens; the weights still go to every worker after each step.
What is soaked is everything but the model's own generation.

**The faults**, at random times (exponential gaps with mean ``--fault-every`` seconds), in turn
at random: SIGKILL a rollout worker, SIGKILL a sandbox process (an interpreter or its anchor),
SIGKILL a retrieval-server worker, and SIGSTOP a retrieval-server worker for longer than a search
may take (RemoteSearch's 15 s) before SIGCONT: a hung tool call. The policy's Python that never
ends is the other hung tool call, ended by the sandbox's 2 s limit. Every injection is recorded
(time, step, kind, pid; no pid when nothing of that kind was alive).

**Reported**: steps completed, faults by kind, prompts re-run and worker failures (the run's own
``cluster/*`` metrics), turns and prompts that ended in an error (``tree/errors``,
``tree/prompt_errors``, each with its error as the run said it), prompts without a trained
episode (none may be lost), sequences trained each step, and, at every step, the RSS and open
descriptors of the driver, of the rollout workers, of the trainer ranks and of the retrieval
server (with its workers), the processes alive under the driver (the Ray nodes included), the
sandbox processes, ``/dev/shm`` entries and Ray's object-store use. Each series' trend is its
least-squares slope over the second half of the run (the first half includes warm-up: imports,
caches, allocator pools); it is **flat** when the growth that slope gives over the second half is
within the series' tolerance: 5% of its median, or at least 32 MiB of memory, 8 descriptors, 2
processes or objects. Those floors are what one leak a step cannot stay under over 60 steps:
a step's logits alone are ~90 MiB, a leaked sandbox or search connection a step is 60 processes
or descriptors; 5% of a median is allocator and restart noise (a replaced worker starts small
and grows back). The figure draws each series against the step.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agentenv.web_search import DEFAULT_TIMEOUT

SERIES = (
    # name, unit, tolerance floor: what a non-leak may move by over the second half
    ("driver_rss_mib", "MiB", 32.0),
    ("driver_fds", "", 8.0),
    ("rollout_workers_rss_mib", "MiB", 32.0),
    ("rollout_workers_fds", "", 8.0),
    ("trainer_ranks_rss_mib", "MiB", 32.0),
    ("trainer_ranks_fds", "", 8.0),
    ("retrieval_rss_mib", "MiB", 32.0),
    ("retrieval_fds", "", 8.0),
    ("processes", "", 2.0),
    ("sandbox_processes", "", 2.0),
    ("shm_entries", "", 2.0),
    ("object_store_mib", "MiB", 32.0),
    ("object_store_objects", "", 2.0),
)
FAULTS = ("kill_rollout_worker", "kill_sandbox", "kill_retrieval_worker", "hang_retrieval_worker")
# A SIGSTOPped retrieval worker's hang: longer than a search may take (RemoteSearch's timeout), so the searches
# queued on it fail with "no answer" (an observation, as a real hung server gives) and later ones go elsewhere.
HANG_S = DEFAULT_TIMEOUT + 5.0
PER_STEP = (  # the run's metrics kept for each step in the JSON
    "step",
    "batch/sequences",
    "tree/leaves_per_prompt",
    "tree/errors",
    "tree/prompt_errors",
    "tree/tool_calls",
    "rollout/prompts_without_leaves",
    "cluster/worker_failures",
    "cluster/prompts_rerun",
    "cluster/workers_live",
    "async/staleness_max",
    "time/step_s",
)
HEARTBEAT_S = 30.0  # a line at least this often while a step runs long
SEARCH_WORDS = ("river", "capital", "film", "director", "born", "album", "university", "war", "city", "king")


# -- the policy the workers run ------------------------------------------------------------------


def policy_turn(seed: int | None, turn: int, max_tool_calls: int) -> str:
    """The text of turn ``turn`` (0 first) of an episode, chosen by the turn's sampling ``seed``."""
    rng = random.Random(f"{seed}:{turn}")
    if turn >= max_tool_calls or rng.random() < 0.15:
        return f"<answer> {rng.choice(SEARCH_WORDS)} </answer>"
    kind = rng.random()
    if kind < 0.5:  # the number makes each query new, so it reaches the server rather than the result cache
        return f"<search> {' '.join(rng.sample(SEARCH_WORDS, 3))} {rng.randrange(10**9)} </search>"
    if kind < 0.75:
        return f"<python>print(sum(range({rng.randrange(10, 10_000)})))</python>"
    if kind < 0.85:
        return "<python>while True: pass</python>"  # the sandbox's time limit ends it
    if kind < 0.95:
        return "<search> unclosed query"  # a malformed call: an observation saying so
    return "<python>print('x' * 100_000)</python>"  # output the tool truncates


def tool_policy() -> Any:
    """The rollout workers' engine (``cluster.worker_engine="benchmarks.soak:tool_policy"``)."""
    from agents.engines.base import Completion, SamplingParams
    from agents.engines.scripted import ScriptedEngine, ScriptedTurn
    from agents.models import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    marker = "<|im_start|>assistant"

    class ToolPolicy(ScriptedEngine):
        """Turns by :func:`policy_turn`; accepts the trainer's weights (the soak counts the loads)."""

        def __init__(self) -> None:
            super().__init__(self._turn, tokenizer=tokenizer, eos_token_ids=[tokenizer.eos_token_id])
            self.seed: int | None = None
            self.loads = 0

        def _turn(self, ids: list[int]) -> ScriptedTurn:
            turn = tokenizer.decode(ids).count(marker) - 1  # assistant turns before this one
            text = policy_turn(self.seed, turn, max_tool_calls=3)
            n = len(tokenizer.encode(text, add_special_tokens=False))
            return ScriptedTurn(text=text, logprobs=-1.0, token_entropies=0.7, top_logprobs=[[(0, -0.5)]] * n)

        async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
            self.seed = params.seed  # read by _turn before the first await, so concurrent requests do not mix
            return await super().generate(prompt_ids, params)

        async def update_weights(self, state_dict: Any) -> None:
            self.loads += 1

    return ToolPolicy()


# -- resources -------------------------------------------------------------------------------------


def _tree(root: Any) -> list[Any]:
    import psutil

    try:
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _sum(processes: Sequence[Any], measure: Callable[[Any], float]) -> float:
    import psutil

    total = 0.0
    for process in processes:
        try:
            total += measure(process)
        except psutil.Error:  # it ended while we looked
            pass
    return total


def _named(processes: Sequence[Any], prefix: str) -> list[Any]:
    import psutil

    found = []
    for process in processes:
        try:
            if " ".join(process.cmdline()).startswith(prefix):
                found.append(process)
        except psutil.Error:
            pass
    return found


def sandbox_processes(processes: Sequence[Any]) -> list[Any]:
    """The Python sandboxes' interpreters among ``processes`` (children of rollout workers)."""
    import psutil

    found = []
    for process in processes:
        try:
            command = process.cmdline()
            # LocalSandbox's interpreter (python -I -B -c WORKER anchor CONFIG) and the sessions it forks
            if "anchor" in command and "-c" in command and process.name() != "bwrap":
                found.append(process)
        except psutil.Error:
            pass
    return found


class ObjectStore:
    """MiB and objects in Ray's object stores, over the cluster: ``ObjectStore(address)()``.

    Ray's public APIs report this only through the dashboard (off here, as in every run of ours), so
    this asks a raylet directly, as ``ray memory --stats-only`` does, with one connection to the
    cluster's state kept for the run (a new one for each reading would count in the driver's descriptors).
    """

    def __init__(self, address: str) -> None:
        from ray._private.internal_api import get_state_from_address

        self.state = get_state_from_address(address)

    def __call__(self) -> tuple[float, float]:
        from ray._private.internal_api import get_memory_info_reply

        stats = get_memory_info_reply(self.state).store_stats
        return stats.object_store_bytes_used / 2**20, float(stats.num_local_objects)


def retrieval_workers(server_pid: int) -> list[Any]:
    """The retrieval server's worker processes (not its multiprocessing resource tracker)."""
    import psutil

    found = []
    for process in _tree(psutil.Process(server_pid))[1:]:
        try:
            if any("spawn_main" in part for part in process.cmdline()):
                found.append(process)
        except psutil.Error:
            pass
    return found


def _rss_mib(process: Any) -> float:
    return float(process.memory_info().rss) / 2**20


def sample(server_pid: int, store: Callable[[], tuple[float, float]]) -> dict[str, float]:
    """One reading of every series of :data:`SERIES`; ``store`` reads the object store (:class:`ObjectStore`)."""
    import psutil

    driver = psutil.Process()
    everything = _tree(driver)
    workers, ranks = _named(everything, "ray::RolloutWorker"), _named(everything, "ray::_Rank")
    server = _tree(psutil.Process(server_pid))
    store_mib, store_objects = store()
    return {
        "driver_rss_mib": _rss_mib(driver),
        "driver_fds": float(driver.num_fds()),
        "rollout_workers_rss_mib": _sum(workers, _rss_mib),
        "rollout_workers_fds": _sum(workers, lambda p: p.num_fds()),
        "trainer_ranks_rss_mib": _sum(ranks, _rss_mib),
        "trainer_ranks_fds": _sum(ranks, lambda p: p.num_fds()),
        "retrieval_rss_mib": _sum(server, _rss_mib),
        "retrieval_fds": _sum(server, lambda p: p.num_fds()),
        "processes": float(len(everything)),
        "sandbox_processes": float(len(sandbox_processes(everything))),
        "shm_entries": float(len(os.listdir("/dev/shm"))) if os.path.isdir("/dev/shm") else 0.0,
        "object_store_mib": store_mib,
        "object_store_objects": store_objects,
    }


@dataclass(frozen=True)
class Trend:
    """A series' least-squares slope over the second half of the run and whether it is flat."""

    slope_per_100_steps: float
    growth: float  # what the slope adds over the second half
    tolerance: float
    median: float

    @property
    def flat(self) -> bool:
        """Whether the second half's growth is within the tolerance."""
        return self.growth <= self.tolerance


def trend(steps: Sequence[float], values: Sequence[float], floor: float) -> Trend:
    """The trend of ``values`` (one a step) over the second half of ``steps``; tolerance: 5% of the median or ``floor``."""
    half = len(steps) // 2
    x, y = np.asarray(steps[half:], float), np.asarray(values[half:], float)
    slope = float(np.polyfit(x, y, 1)[0]) if len(x) >= 2 and np.ptp(x) > 0 else 0.0
    median = float(np.median(y)) if len(y) else 0.0
    growth = slope * float(np.ptp(x)) if len(x) else 0.0
    # rounded: a constant series' slope is 0, not the fit's 1e-13
    return Trend(round(100.0 * slope, 6), round(growth, 6), max(floor, 0.05 * abs(median)), median)


# -- faults ----------------------------------------------------------------------------------------


class FaultInjector(threading.Thread):
    """Injects a fault of a random kind at exponential intervals (mean ``every`` s) until stopped.

    Each is recorded with its time (seconds since ``start_time``), the step in progress (``step()``),
    its kind and the pid it hit (None when nothing of that kind was alive).
    """

    def __init__(self, every: float, seed: int, server_pid: int, step: Callable[[], int], start_time: float) -> None:
        super().__init__(name="fault injector", daemon=True)
        self.every, self.rng, self.server_pid, self.step = every, random.Random(seed), server_pid, step
        self.start_time = start_time
        self.stopped = threading.Event()
        self.events: list[dict[str, Any]] = []

    def run(self) -> None:
        while not self.stopped.wait(self.rng.expovariate(1.0 / self.every)):
            kind = self.rng.choice(FAULTS)
            event: dict[str, Any] = {"t_s": round(time.monotonic() - self.start_time, 1), "step": self.step()}
            event.update(kind=kind, pid=self._inject(kind))
            self.events.append(event)
            print(f"fault: {kind} pid {event['pid']} during step {event['step']}", flush=True)

    def _inject(self, kind: str) -> int | None:
        import psutil

        if kind == "kill_rollout_worker":
            victims = _named(_tree(psutil.Process()), "ray::RolloutWorker")
        elif kind == "kill_sandbox":
            victims = sandbox_processes(_tree(psutil.Process()))
        else:
            victims = retrieval_workers(self.server_pid)
        if not victims:
            return None  # nothing of that kind alive now (no sandbox between tool calls): recorded as such
        victim = self.rng.choice(victims)
        try:
            if kind == "hang_retrieval_worker":
                victim.send_signal(signal.SIGSTOP)
                self.stopped.wait(HANG_S)
                victim.send_signal(signal.SIGCONT)
            else:
                victim.send_signal(signal.SIGKILL)
        except psutil.Error:
            return None
        return victim.pid


# -- the run ---------------------------------------------------------------------------------------


def start_retrieval_server() -> tuple[subprocess.Popen, str]:
    """``python -m agentenv.serve retrieval --workers 2 --port 0``: the process and its URL."""
    process = subprocess.Popen(
        [sys.executable, "-m", "agentenv.serve", "retrieval", "--workers", "2", "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert process.stdout is not None
    line = process.stdout.readline()
    if not line.startswith("Serving"):
        process.kill()
        raise RuntimeError(f"the retrieval server did not start: {line!r}")
    return process, line.split(" on ", 1)[1].split()[0]


def trainer_model(folder: Path) -> str:
    """A tiny Llama with SmolLM2's vocabulary and tokenizer, saved as a model folder."""
    from agents.models import load_tokenizer, tiny_llama

    tiny_llama(0, vocab_size=49152).save_pretrained(folder)
    load_tokenizer("smollm2-135m").save_pretrained(folder)
    return str(folder)


def run_config(model: str, url: str, args: argparse.Namespace) -> Any:
    """The run: AT²PO, cpu-demo, tool-qa on the server at ``url``, 2 ranks and 2 scripted workers joining by ``auto``."""
    from agents.run.config import resolve

    cluster = {
        "address": "auto",
        "trainer_ranks": 2,
        "rollout_workers": 2,
        "rank_resources": {"trainer": 1},
        "worker_resources": {"rollout": 1},
        "worker_engine": "benchmarks.soak:tool_policy",
        "worker_restarts": 1000,  # the injector kills workers all run long
    }
    return resolve(
        preset_name="cpu-demo",
        values={"algo": "at2po", "env": "tool-qa", "model": model},
        assignments=[
            f"steps={args.steps}",
            f"seed={args.seed}",
            f"checkpoint_every={args.checkpoint_every}",
            "keep_checkpoints=2",
            "eval_questions=0",
            "eval_before=false",
            f"env_kwargs={json.dumps({'search': url, 'timeout': 2.0, 'max_tool_calls': 3, 'topk': 1, 'result_chars': 200, 'example': False, 'require_boxed': False})}",
            f"cluster={json.dumps(cluster)}",
            "trainer.report_to=[none]",
        ],
    )


class Said:
    """stdout, passed through, keeping each ``rollout: … failed …`` note with the step it came in."""

    def __init__(self, stream: Any) -> None:
        self.stream, self.step = stream, 0
        self.errors: list[dict[str, Any]] = []
        self._line = ""

    def write(self, text: str) -> int:
        self._line += text
        *lines, self._line = self._line.split("\n")
        for line in lines:
            if line.startswith("step ") and "/" in line.split()[1]:
                self.step = int(line.split()[1].split("/")[0])
            if line.startswith("rollout: "):
                self.errors.append({"step": self.step + 1, "note": line})  # said during the next step's rollout
        return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


class Steps:
    """The driver's view of the run: a reading of every resource at each step's line, and a heartbeat.

    ``log`` is the run's ``log`` (one line a step); the heartbeat thread says, at least every
    :data:`HEARTBEAT_S` seconds, which step is running and for how long, so a long step is not silence.
    """

    def __init__(self, steps: int, server_pid: int, store: Callable[[], tuple[float, float]]) -> None:
        self.steps, self.server_pid, self.store = steps, server_pid, store
        self.step = 0
        self.readings: list[dict[str, float]] = []
        self.started = self.last = time.monotonic()
        self.stopped = threading.Event()
        self.heartbeat = threading.Thread(target=self._beat, name="soak heartbeat", daemon=True)

    def log(self, line: str) -> None:
        """Print the run's ``line``; at a step's line, read the resources and say the pace."""
        print(line, flush=True)
        if not (line.startswith("step ") and "/" in line.split()[1]):
            return
        self.step, self.last = int(line.split()[1].split("/")[0]), time.monotonic()
        t_s = self.last - self.started
        self.readings.append({"step": float(self.step), "t_s": t_s, **sample(self.server_pid, self.store)})
        rate = self.step / t_s
        print(
            f"soak: step {self.step}/{self.steps}, {rate * 60:.1f} steps/min, ETA "
            f"{(self.steps - self.step) / rate / 60:.1f} min",
            flush=True,
        )

    def _beat(self) -> None:
        while not self.stopped.wait(HEARTBEAT_S):
            quiet = time.monotonic() - self.last
            if quiet >= HEARTBEAT_S:
                print(f"soak: step {self.step + 1}/{self.steps} running for {quiet:.0f} s", flush=True)


def start_cluster() -> Any:
    """A head and two nodes on this host, each node with one trainer rank's and one rollout worker's resource."""
    from ray.cluster_utils import Cluster

    store = 300 * 2**20
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "include_dashboard": False, "object_store_memory": store},
    )
    for _ in range(2):
        cluster.add_node(num_cpus=2, resources={"trainer": 1, "rollout": 1}, object_store_memory=store)
    cluster.wait_for_nodes()
    return cluster


async def soak(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The run under faults; returns what it measured."""
    import ray

    from agents.run.cluster.runtime import ensure_ray
    from agents.run.train import train
    from agents.training.metrics import read_jsonl

    # The search results' cache of every process (workers inherit it through the nodes): the run's own, not the user's.
    os.environ["AGENTENV_CACHE"] = str(out / "cache")
    cluster = start_cluster()
    os.environ["RAY_ADDRESS"] = cluster.address  # joined as a user joins a cluster: cluster.address=auto
    server, url = start_retrieval_server()
    ensure_ray("auto")
    steps = Steps(args.steps, server.pid, ObjectStore(cluster.address))
    injector = FaultInjector(args.fault_every, args.seed, server.pid, lambda: steps.step + 1, steps.started)
    said = Said(sys.stdout)
    try:
        config = run_config(trainer_model(out / "model"), url, args)
        injector.start()
        steps.heartbeat.start()
        sys.stdout = said  # the run's notes of failed turns and prompts (agents.run.steps), with their errors
        result = await train(config, out / "run", progress=False, log=steps.log)
    finally:
        sys.stdout = said.stream
        steps.stopped.set()
        injector.stopped.set()
        injector.join(timeout=HANG_S + 5)
        server.send_signal(signal.SIGTERM)
        _, server_err = server.communicate(timeout=30)
        ray.shutdown()
        cluster.shutdown()
    return {
        "steps": result.steps,
        "seconds": time.monotonic() - steps.started,
        "faults": injector.events,
        "records": read_jsonl(out / "run" / "metrics.jsonl"),
        "prompts_per_step": config.prompts_per_step,
        "readings": steps.readings,
        "errors": said.errors,
        "server_restarts": server_err.count("starting another"),
        "server_exit": server.returncode,
    }


def summarise(measured: dict[str, Any]) -> dict[str, Any]:
    """Counts, trends and verdicts from :func:`soak`'s measurements."""
    records, readings = measured["records"], measured["readings"]
    steps = [r["step"] for r in readings]
    trends = {}
    for name, _, floor in SERIES:
        t = trend(steps, [r[name] for r in readings], floor)
        trends[name] = {**t.__dict__, "flat": t.flat}
    faults: dict[str, dict[str, int]] = {}
    for event in measured["faults"]:
        entry = faults.setdefault(event["kind"], {"injected": 0, "no_target": 0})
        entry["injected" if event["pid"] is not None else "no_target"] += 1
    # Each training sequence is a leaf of one prompt's tree: the prompts a step trained on
    trained = [round(r["batch/sequences"] / r["tree/leaves_per_prompt"]) for r in records]
    expected = measured["prompts_per_step"]
    return {
        "steps_completed": measured["steps"],
        "seconds": measured["seconds"],
        "faults": faults,
        "worker_failures": sum(r.get("cluster/worker_failures", 0.0) for r in records),
        "prompts_rerun": sum(r.get("cluster/prompts_rerun", 0.0) for r in records),
        "episode_errors": sum(r.get("tree/errors", 0.0) for r in records),
        "prompts_failed": sum(r.get("tree/prompt_errors", 0.0) for r in records),
        "sequences_per_step": sorted({r["batch/sequences"] for r in records}),
        "prompts_per_step": sorted(set(trained)),
        # above 0: a prompt rolled out on weights older than the trainer's (a worker that missed a sync)
        "staleness_max": max((r.get("async/staleness_max", 0.0) for r in records), default=0.0),
        "prompts_lost": sum(expected - n for n in trained)
        + sum(r.get("rollout/prompts_without_leaves", 0.0) for r in records),
        "error_notes": measured["errors"],
        "retrieval_worker_restarts": measured["server_restarts"],
        "retrieval_server_exit": measured["server_exit"],
        "trends": trends,
        "all_flat": all(t["flat"] for t in trends.values()),
        "per_step": [{key: r.get(key, 0.0) for key in PER_STEP} for r in records],
    }


def plot(
    readings: Sequence[dict[str, float]], trends: dict[str, Any], faults: Sequence[dict[str, Any]], path: Path
) -> None:
    """One panel per series against the step: its readings, the judged second half shaded, the faults as ticks."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    columns = 5
    rows = -(-len(SERIES) // columns)
    figure, axes = plt.subplots(rows, columns, figsize=(4 * columns, 3.2 * rows), constrained_layout=True)
    steps = [r["step"] for r in readings]
    colours = dict(zip(FAULTS, ("tab:red", "tab:orange", "tab:purple", "tab:green")))
    for axis, (name, unit, _) in zip(axes.flat, SERIES):
        axis.axvspan(steps[len(steps) // 2], steps[-1], color="0.93", zorder=0)
        for event in faults:
            if event["pid"] is not None:
                axis.axvline(event["step"] - 0.5, color=colours[event["kind"]], alpha=0.25, linewidth=0.8)
        axis.plot(steps, [r[name] for r in readings], ".", markersize=3, color="black")
        verdict = "flat" if trends[name]["flat"] else "GROWS"
        axis.set_title(f"{name} ({verdict}, {trends[name]['slope_per_100_steps']:+.2g}/100 steps)", fontsize=9)
        axis.set_xlabel("step")
        axis.set_ylabel(unit or "count")
    for axis in list(axes.flat)[len(SERIES) :]:
        axis.axis("off")
    handles = [plt.Line2D([], [], color=c, label=k) for k, c in colours.items()]
    list(axes.flat)[-1].legend(handles=handles, title="faults (during step)", loc="center", fontsize=8)
    figure.suptitle("benchmarks.soak: resources at every step under injected faults (shaded: the judged second half)")
    figure.savefig(path, dpi=110)
    plt.close(figure)


def main(argv: Sequence[str] | None = None) -> None:
    """Run the soak, print its report, write the figure and (``--json``) the results with the command line."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=120, help="training steps (default 120)")
    parser.add_argument("--fault-every", type=float, default=15.0, help="mean seconds between faults (default 15)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the run and of the faults (default 0)")
    parser.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints (default 10)")
    parser.add_argument("--out", type=Path, help="folder for the run (default: a temporary folder)")
    parser.add_argument(
        "--json", type=Path, metavar="PATH", help="write the results as JSON (and the figure beside it)"
    )
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory(prefix="soak-") as scratch:
        out = args.out or Path(scratch)
        out.mkdir(parents=True, exist_ok=True)
        measured = asyncio.run(soak(args, out))
        summary = summarise(measured)
        figure = args.json.with_suffix(".png") if args.json else out / "soak.png"
        plot(measured["readings"], summary["trends"], measured["faults"], figure)
    print_report(summary, figure)
    if args.json:
        command = "python -m benchmarks.soak " + " ".join(sys.argv[1:] if argv is None else argv)
        payload = {
            "command": command,
            **summary,
            "faults_injected": measured["faults"],
            "readings": measured["readings"],
        }
        args.json.write_text(json.dumps(payload, indent=2) + "\n")


def print_report(summary: dict[str, Any], figure: Path) -> None:
    """The counts in a paragraph, then each series' trend and verdict in a table."""
    from agents.eval.tables import text_table

    faults = ", ".join(
        f"{kind} {n['injected']} (+{n['no_target']} with no target alive)" for kind, n in summary["faults"].items()
    )
    print(
        f"\n{summary['steps_completed']} steps in {summary['seconds'] / 60:.1f} min; faults: {faults}; "
        f"worker failures {summary['worker_failures']:.0f}, prompts re-run {summary['prompts_rerun']:.0f}, "
        f"turns failed {summary['episode_errors']:.0f} ({len(summary['error_notes'])} notes), prompts failed "
        f"{summary['prompts_failed']:.0f}, largest staleness {summary['staleness_max']:.0f}, prompts lost {summary['prompts_lost']:.0f}, prompts trained per step "
        f"{summary['prompts_per_step']} (sequences {summary['sequences_per_step']}); retrieval workers replaced "
        f"{summary['retrieval_worker_restarts']}"
    )
    rows = [
        [
            name,
            f"{t['median']:.1f}",
            f"{t['slope_per_100_steps']:+.2f}",
            f"{t['growth']:+.1f}",
            f"{t['tolerance']:.1f}",
            "flat" if t["flat"] else "GROWS",
        ]
        for name, t in summary["trends"].items()
    ]
    print(text_table(["series (2nd half)", "median", "slope / 100 steps", "growth", "tolerance", "verdict"], rows))
    print(f"figure: {figure}")


if __name__ == "__main__":
    main()
