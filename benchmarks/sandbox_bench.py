"""Sandbox latency: first run, per-call overhead and fork(), beside the obvious alternatives.

    python -m benchmarks.sandbox_bench [--json PATH] [--repeats N]

* first run: a new ``LocalSandbox`` and its first call, cold (called at once) and warm (called
  after the container had 2 s to import, as it has while the model writes its first turn),
  beside a fresh interpreter that runs the same call with the same imports (``python -c``);
* per-call overhead: a call that does nothing, beside a fresh interpreter per call;
* fork: ``fork()`` of a session holding about 100 MB (a numpy array, sympy results), beside
  replaying the episode's calls into an already started sandbox (replay's best case);
* DockerSandbox, where a Docker engine runs: first run, per call, and its fork() (a replay
  into a new container); otherwise the reason it was skipped.

Timing is wall clock on this machine; ratios are what to compare across machines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

from sandboxes import DockerSandbox, LocalSandbox, SandboxError
from sandboxes.docker_sandbox import DEFAULT_IMAGE, connect

EPISODE = (  # the calls of an episode that leaves about 100 MB in the session
    "import numpy as np\nimport sympy as sp",
    "rng = np.random.default_rng(0)\nsamples = rng.standard_normal((3200, 4096))",  # 105 MB
    "means, stds = samples.mean(axis=0), samples.std(axis=0)\nfloat(means.mean())",
    "x = sp.symbols('x')\nroots = sp.solve(x**3 - 6*x**2 + 11*x - 6, x)\nroots",
    "top = np.sort(samples[:, :64], axis=0)[-5:]\ntop.shape",
)
FIRST_CALL = "import numpy as np, sympy as sp\nprint(int(np.arange(10).sum()), sp.Integer(2)**10)"


def _ms(samples: list[float]) -> dict[str, float]:
    ordered = sorted(samples)
    return {
        "p50_ms": 1e3 * statistics.median(ordered),
        "p90_ms": 1e3 * ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))],
        "n": len(ordered),
    }


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _fresh_interpreter(code: str) -> None:
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def _checked(box: LocalSandbox | DockerSandbox, code: str) -> None:
    result = box.run(code, timeout=120)
    if not result.ok:
        raise RuntimeError(f"benchmark call failed: {result.render()}")


def _rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) / 1024


def first_run(repeats: int) -> dict[str, object]:
    cold, warm = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        with LocalSandbox() as box:
            _checked(box, FIRST_CALL)
            cold.append(time.perf_counter() - start)
        with LocalSandbox() as box:
            time.sleep(2.0)  # the model writes its first turn meanwhile
            warm.append(_timed(lambda: _checked(box, FIRST_CALL)))
    fresh = [_timed(lambda: _fresh_interpreter(FIRST_CALL)) for _ in range(repeats)]
    return {"cold": _ms(cold), "warm": _ms(warm), "fresh_interpreter": _ms(fresh), "isolation": box.isolation.mode}


def per_call(repeats: int) -> dict[str, object]:
    with LocalSandbox() as box:
        _checked(box, "pass")
        calls = [_timed(lambda: _checked(box, "pass")) for _ in range(repeats * 10)]
    fresh = [_timed(lambda: _fresh_interpreter("pass")) for _ in range(repeats)]
    return {"sandbox_call": _ms(calls), "fresh_interpreter": _ms(fresh)}


def fork(repeats: int) -> dict[str, object]:
    with LocalSandbox() as box, LocalSandbox() as spare:
        episode = [_timed(lambda c=code: _checked(box, c)) for code in EPISODE]
        rss = _rss_mb(box.pid)
        forks, first_calls, replays = [], [], []
        for _ in range(repeats):
            start = time.perf_counter()
            child = box.fork()
            forks.append(time.perf_counter() - start)
            first_calls.append(_timed(lambda child=child: _checked(child, "float(samples[0, 0])")))
            child.close()
        for _ in range(repeats):
            _checked(spare, "pass")  # started and warm: replay's best case
            replica = spare.fork()  # a fresh interpreter of the warm container
            replays.append(_timed(lambda replica=replica: [_checked(replica, code) for code in EPISODE]))
            replica.close()
    return {
        "fork": _ms(forks),
        "first_call_after_fork": _ms(first_calls),
        "replay": _ms(replays),
        "episode_calls_ms": [round(1e3 * t, 1) for t in episode],
        "interpreter_rss_mb": round(rss, 1),
    }


def docker(repeats: int) -> dict[str, object]:
    try:
        client = connect()
        client.images.get(DEFAULT_IMAGE)
    except Exception as exc:  # no engine, or no image: say which
        return {"skipped": f"{type(exc).__name__}: {exc}"}
    small_episode = EPISODE[:1] if _importable_in_image(client) else ("x = list(range(10**6))",)
    first, calls, forks = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        with DockerSandbox(client=client, preimport=()) as box:
            _checked(box, "1 + 1")
            first.append(time.perf_counter() - start)
            calls += [_timed(lambda: _checked(box, "pass")) for _ in range(10)]
            for code in small_episode:
                _checked(box, code)
            forks.append(_timed(lambda: box.fork().close()))
    return {
        "first_run": _ms(first),
        "per_call": _ms(calls),
        "fork_by_replay": _ms(forks),
        "episode": list(small_episode),
    }


def _importable_in_image(client) -> bool:
    try:
        with DockerSandbox(client=client, preimport=()) as box:
            return box.run("import numpy, sympy").ok
    except SandboxError:
        return False


def run(repeats: int = 5) -> dict[str, object]:
    return {
        "first_run": first_run(repeats),
        "per_call": per_call(repeats),
        "fork": fork(repeats),
        "docker": docker(repeats),
    }


def table(results: dict) -> str:
    first, call, fk = results["first_run"], results["per_call"], results["fork"]
    rows = [
        ("first run, cold (new sandbox + call)", first["cold"], first["fresh_interpreter"]),
        ("first run, warm (sandbox made 2 s before)", first["warm"], first["fresh_interpreter"]),
        ("per-call overhead (`pass`)", call["sandbox_call"], call["fresh_interpreter"]),
        (f"fork() of {fk['interpreter_rss_mb']:.0f} MB session vs replay", fk["fork"], fk["replay"]),
    ]
    lines = [
        f"sandbox isolation: {first['isolation']}",
        f"{'measurement':44} {'sandbox p50':>12} {'p90':>9} {'alternative p50':>16} {'ratio':>7}",
        "-" * 92,
    ]
    for name, ours, other in rows:
        lines.append(
            f"{name:44} {ours['p50_ms']:10.1f}ms {ours['p90_ms']:7.1f}ms "
            f"{other['p50_ms']:14.1f}ms {other['p50_ms'] / ours['p50_ms']:6.1f}x"
        )
    lines.append(
        f"first call in a fork: {fk['first_call_after_fork']['p50_ms']:.1f} ms p50; "
        f"episode calls (ms): {fk['episode_calls_ms']}"
    )
    lines.append(
        "alternatives: fresh `python -c` with the same imports (first run, per call); "
        "replaying the episode into a warm sandbox (fork)"
    )
    dock = results["docker"]
    if "skipped" in dock:
        lines.append(f"DockerSandbox: not measured ({dock['skipped'][:100]})")
    else:
        lines.append(
            f"DockerSandbox: first run {dock['first_run']['p50_ms']:.0f} ms, per call "
            f"{dock['per_call']['p50_ms']:.1f} ms, fork by replay "
            f"{dock['fork_by_replay']['p50_ms']:.0f} ms (p50)"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="also write the results to this JSON file")
    parser.add_argument("--repeats", type=int, default=5, help="samples per measurement")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    results = run(args.repeats)
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
