"""The GPU check on a bare machine, run on this CPU: benchmarks/gpu_bench.py --smoke and gpu_check.sh --bare --smoke.

On a GPU the same code runs at full size (docs/benchmarks.md "The GPU check on a bare machine");
here every section must run with tiny shapes and record a status, and the bare mode of
gpu_check.sh must skip what needs vLLM or Ray with a message.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import gpu_bench

ROOT = Path(__file__).resolve().parents[2]


def test_a_bfloat16_kernel_may_err_twice_as_much_as_padded_bfloat16_and_float32_only_by_rounding():
    exact = {"logprob_max_abs": 2e-5, "loss_rel": 1e-7, "grad_rel": 5e-7}
    assert gpu_bench._verdict(exact, "float32", None) == "ok"
    assert gpu_bench._verdict({**exact, "grad_rel": 2e-3}, "float32", None).startswith("FAILED: grad_rel 2.00e-03")
    padded16 = {"logprob_max_abs": 0.1, "loss_rel": 1e-3, "grad_rel": 0.02}
    within = {"logprob_max_abs": 0.2, "loss_rel": 2e-3, "grad_rel": 0.05}
    assert gpu_bench._verdict(within, "bfloat16", padded16) == "ok"
    verdict = gpu_bench._verdict({**within, "logprob_max_abs": float("nan")}, "bfloat16", padded16)
    assert verdict.startswith("FAILED: logprob_max_abs nan")
    assert gpu_bench._verdict({**exact, "loss_rel": None, "grad_rel": None}, "float32", None) == "ok"  # forward only


@pytest.mark.slow
def test_the_smoke_run_records_every_section_with_a_status(tmp_path):
    out = tmp_path / "gpu_bench.json"
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_bench", "--smoke", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    sections = results["sections"]
    assert list(sections) == list(gpu_bench.SECTIONS)
    assert all(section["status"].startswith(("ok", "skipped")) for section in sections.values()), {
        name: section["status"] for name, section in sections.items()
    }
    kernels = sections["kernels"]["rows"]
    for kernel in gpu_bench.KERNELS:  # every kernel, on both shapes, has a verdict
        assert len([row for row in kernels if row["layout"] == f"tree/{kernel}"]) >= 2
    assert all(row["verdict"].startswith(("ok", "skipped")) for row in kernels)
    layouts = sections["qwen3_4b"]["layouts"]
    assert list(layouts) == ["padded", *(f"tree/{kernel}" for kernel in gpu_bench.KERNELS)]
    assert layouts["padded"]["status"] == "ok" and layouts["tree/per-path"]["tokens_forwarded_vs_padded"] < 1
    assert [row["requests"] for row in sections["engine"]["rows"]] == [1, 4]
    assert len(sections["train"]["steps"]) == 3 and sections["train"]["checkpoints"][-1] == "step_000003"
    assert sections["nccl"]["world_size"] == 1
    assert "summary" in done.stdout and "a. kernels" in done.stdout


@pytest.mark.slow
def test_the_bare_mode_skips_vllm_and_ray_and_runs_the_benchmark(tmp_path):
    shadow = tmp_path / "shadow"  # vllm and ray that do not import, as on the bare GPU machine
    for name in ("vllm", "ray"):
        (shadow / name).mkdir(parents=True)
        (shadow / name / "__init__.py").write_text(f"raise ImportError('{name} is not installed here')\n")
    env = {
        **os.environ,
        "PYTHONPATH": str(shadow),
        "PYTHON": sys.executable,
        "GPU_CHECK_WHEELS": str(tmp_path / "no-wheels"),  # this Python has the packages the wheels bring
        "GPU_BENCH_ARGS": "--sections nccl",
    }
    out = tmp_path / "check"
    done = subprocess.run(
        ["bash", "benchmarks/gpu_check.sh", "--smoke", str(out)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "vllm does not import" in done.stdout and "bare mode" in done.stdout
    assert (out / "train.log").read_text() == "skipped: vllm not installed\n"
    assert (out / "workers.log").read_text() == "skipped: vllm not installed\nskipped: ray not installed\n"
    assert "update phase (trainer)" in (out / "plan.txt").read_text()
    assert json.loads((out / "gpu_bench.json").read_text())["sections"]["nccl"]["status"] == "ok"
    assert "all bare-mode GPU checks passed" in done.stdout
