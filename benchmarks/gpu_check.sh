#!/usr/bin/env bash
# The one-GPU path, end to end, on a machine with one NVIDIA GPU: vLLM beside the trainer on the same
# device (colocated memory share, sleep during the update, bfloat16 weight sync), gradient
# checkpointing, token-budget micro-batches and action-only scoring, with the embedded model.
#
#   bash benchmarks/gpu_check.sh [OUT]        # OUT: where logs and results go (default runs/gpu_check)
#
# Needs a Python with the CUDA builds of torch and vLLM (`make GPU=1 venv`, or PYTHON=... for one that
# has them) and this project installed. Prints each check's result; exits non-zero at the first failure.
# What it checks, and what the CPU tests could not:
#   1. the memory plan of the run (agents train --plan) on this device;
#   2. two AT2PO steps of the cpu-demo preset with --engine vllm on the GPU: vLLM starts beside the
#      trainer with the share colocated_memory_share gives it, sleeps through each update, wakes,
#      takes the bfloat16 weights, and the run resumes; the peak allocated memory is compared with
#      the plan's update phase;
#   3. the GPU-sensitive tests of the suite (engine suite, trainer) on CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-runs/gpu_check}
PY=${PYTHON:-.venv/bin/python}
mkdir -p "$OUT"
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
"$PY" -c "import torch, vllm; assert torch.cuda.is_available(); print('torch', torch.__version__, 'vllm', vllm.__version__)" \
  | tee -a "$OUT/gpu.txt"

echo "== 1. memory plan"
"$PY" -m agents train --algo at2po --env multihop-qa --model smollm2-135m --preset cpu-demo --engine vllm \
  --set trainer.gradient_checkpointing=true --set trainer.micro_batch_tokens=1024 --plan | tee "$OUT/plan.txt"

echo "== 2. two steps with vLLM beside the trainer, then a resumed third"
rm -rf "$OUT/run"
"$PY" - "$OUT" <<'EOF' 2>&1 | tee "$OUT/train.log"
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
EOF

echo "== 3. the suite's engine and trainer tests on this machine"
"$PY" -m pytest -q -p no:cacheprovider tests/agents/test_engine_suite.py tests/agents/test_trainer.py \
  tests/agents/test_memory_plan.py 2>&1 | tee "$OUT/tests.log"
echo "all GPU checks passed; results in $OUT"
