#!/usr/bin/env bash
# What a bare GPU machine (torch and transformers, no vLLM, no Ray, no package registry) needs from us,
# fetched on a machine that has a registry, into .whl/ (git-ignored), which travels with the working tree
# as an ignored path named to go along (docs/benchmarks.md "The GPU check on a bare machine"):
#
#   bash benchmarks/gpu_wheels.sh [PYTHON_VERSION]     # the GPU machine's Python, default 3.12
#
# - the 12 wheels that let `import agents, agentenv`, `agents train` and the tests run beside that
#   machine's own torch and transformers (/work/shared/GPU.md lists them; ~4 MB), built for Linux x86-64
#   and PYTHON_VERSION (pip download --no-deps --only-binary=:all:, so nothing is built here);
# - .whl/smollm2-135m/: the embedded model's config.json and tokenizer files (~3.4 MB, no weights: its
#   GGUF is 98 MB), from which benchmarks/gpu_bench.py builds the SmolLM2-135M shape with random weights.
#
# benchmarks/gpu_check.sh --bare installs the wheels there with
# `pip install --no-index --no-deps --target DIR .whl/*.whl`.
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION=${1:-3.12}
PY=${PYTHON:-.venv/bin/python}
OUT=.whl
# Exact versions: those checked on the GPU machine (the project's own ranges admit them).
WHEELS=(
  gymnasium==1.4.0 farama-notifications==0.0.6 docstring-parser==0.18.0 pydantic==2.14.4 pydantic-core==2.50.5
  typing-inspection==0.4.5 annotated-types==0.8.0 bm25s==0.3.16 PyStemmer==3.1.0 pytest-asyncio==1.5.0
  docker==7.2.0 orjson==3.13.0
)
[[ $VERSION =~ ^3\.[0-9]+$ ]] || { echo "PYTHON_VERSION must look like 3.12, got '$VERSION'"; exit 2; }
test -x "$PY" || { echo "no Python at $PY: run make venv, or set PYTHON=/path/to/python"; exit 2; }
mkdir -p "$OUT"
# The wheels of another Python version would be installed side by side: start from an empty set.
rm -f "$OUT"/*.whl
# --python-version and --platform fetch wheels for the GPU machine, not this one; cp: CPython's
# compiled wheels (pydantic-core, PyStemmer, orjson); the manylinux tags a glibc 2.28+ machine takes.
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: --python-version "$VERSION" --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$OUT" "${WHEELS[@]}"
count=$(find "$OUT" -maxdepth 1 -type f -name '*.whl' | wc -l)
if [ "$count" -ne "${#WHEELS[@]}" ]; then
  echo "expected ${#WHEELS[@]} wheels in $OUT, found $count:"; ls "$OUT"; exit 1
fi

# The embedded model's config and tokenizer (converted once from its GGUF on this machine; weights left out).
MODEL_DIR=$("$PY" -c 'from agents.models import resolve_model; print(resolve_model("smollm2-135m"))')
rm -rf "$OUT/smollm2-135m"
mkdir -p "$OUT/smollm2-135m"
for file in "$MODEL_DIR"/*; do
  case "$(basename "$file")" in
    *.safetensors | *.bin | agentenv_conversion.json) ;;
    *) cp "$file" "$OUT/smollm2-135m/" ;;
  esac
done
test -f "$OUT/smollm2-135m/config.json" && test -f "$OUT/smollm2-135m/tokenizer.json"

ls -1 "$OUT"/*.whl
echo "$count wheels for Python $VERSION: $(du -ch "$OUT"/*.whl | tail -1 | cut -f1); model shape folder $OUT/smollm2-135m: $(du -sh "$OUT/smollm2-135m" | cut -f1)"
echo "total $(du -sh "$OUT" | cut -f1) in $OUT (git-ignored; name it among the ignored paths that travel)"
