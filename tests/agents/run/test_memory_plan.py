"""The memory plan: parameter counts from a config, the papers' runs on 80 and 141 GB, estimates against measured peaks."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from agents.run.config import build, resolve
from agents.run.memory_plan import GIB, KNOWN_SHAPES, ModelShape, memory_plan, model_shape, run_plan
from agents.training.trainer_config import TrainerConfig

ROOT = Path(__file__).resolve().parents[3]
SMALL = {
    "vocab_size": 32000,
    "hidden_size": 256,
    "intermediate_size": 688,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@pytest.mark.parametrize("tied", [True, False])
def test_the_parameter_count_of_a_shape_is_the_model_s(tied):
    llama = LlamaForCausalLM(LlamaConfig(**SMALL, tie_word_embeddings=tied))
    shape = ModelShape.from_config(llama.config.to_dict())
    assert shape.parameters == sum(p.numel() for p in llama.parameters())
    qwen = Qwen3ForCausalLM(Qwen3Config(**SMALL, head_dim=96, tie_word_embeddings=tied))
    shape = ModelShape.from_config(qwen.config.to_dict())
    assert shape.qk_norm and shape.head_dim == 96
    assert shape.parameters == sum(p.numel() for p in qwen.parameters())
    assert KNOWN_SHAPES["Qwen/Qwen3-4B"].parameters == 4_022_468_096  # the published 4.0B


def paper_plan(model: str, gib: float):
    config = resolve(preset_name="paper", values={"algo": "at2po", "engine": "vllm", "model": model})
    return run_plan(config, build(config), device_gib=gib)


def test_qwen3_4b_at_the_paper_s_setting_fits_80_and_141_gb_with_checkpointing_and_token_micro_batches():
    for gib in (80, 141):
        plan, settings = paper_plan("Qwen/Qwen3-4B", gib)
        assert plan.fits and settings == {}  # the preset's checkpointing and token micro-batches
        p = KNOWN_SHAPES["Qwen/Qwen3-4B"].parameters
        assert plan.parts["trainer weights"] == 4 * p and plan.parts["optimizer state"] == 8 * p
        assert plan.parts["engine weights"] == 2 * p and plan.engine_sleeps
        assert plan.update_peak < 0.9 * gib * GIB  # the update has room; vLLM takes the rest for its KV cache
    as_configured = memory_plan(
        KNOWN_SHAPES["Qwen/Qwen3-4B"],
        trainer=TrainerConfig(),
        engine="vllm",
        engine_kwargs={},
        concurrency=64,
        max_tokens=8192,
        on_gpu=True,
        device_bytes=80 * GIB,
    )
    assert not as_configured.fits  # 4 x 8k tokens of every layer's activations: ~140 GiB


def test_qwen3_14b_needs_lora_on_141_gb_and_a_bfloat16_base_as_well_on_80():
    plan, settings = paper_plan("Qwen/Qwen3-14B", 141)
    assert plan.fits and settings == {"lora_rank": 16}  # besides the preset's checkpointing and token budget
    plan, settings = paper_plan("Qwen/Qwen3-14B", 80)  # float32 weights (55 GiB) and vLLM's (28) are too much
    assert plan.fits and settings == {"lora_rank": 16, "base_dtype": "bfloat16"}
    assert plan.parts["trainer weights"] == 2 * KNOWN_SHAPES["Qwen/Qwen3-14B"].parameters


def test_agents_train_plan_prints_the_table_and_the_settings_it_needs(capsys):
    from agents.cli import main

    plan = ["train", "--algo", "at2po", "--preset", "paper", "--engine", "vllm", "--model", "Qwen/Qwen3-4B"]
    plan += ["--plan", "--device-memory", "80"]
    code = main(plan)
    out = capsys.readouterr().out
    assert code == 0 and "device 80 GiB: fits" in out and "optimizer state" in out and "it fits with" not in out
    code = main([*plan, "--set", "trainer.gradient_checkpointing=false"])
    out = capsys.readouterr().out
    assert "it fits with: --set trainer.gradient_checkpointing=true\n" in out  # the preset sets the token budget


MEASURE = """
import asyncio, json, random, sys
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from agents.rollout.tree import RolloutTree
from agents.training.trainer import Trainer
from agents.training.trainer_config import TrainerConfig

model, settings, length, n = json.loads(sys.argv[1])
if isinstance(model, dict):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**model, tie_word_embeddings=True)).eval()
trainer = Trainer(model, TrainerConfig(progress=False, report_to=("none",), old_logprobs="sampler", **settings))
rng, vocab, paths = random.Random(0), trainer.model.config.vocab_size, []
for i in range(n):
    tree = RolloutTree([rng.randrange(vocab) for _ in range(32)])
    actions = [rng.randrange(vocab) for _ in range(length - 32)]
    tree.add_turn(tree.root, action_ids=actions, sampler_logprobs=[-1.0] * len(actions), terminal=True, reward=float(i % 2))
    for node in tree.nodes():
        node.advantage = 1.0 if i % 2 else -1.0
    paths += tree.paths()
with open("/proc/self/statm") as f:
    before = int(f.read().split()[1]) * 4096  # resident, weights loaded
for _ in range(2):  # the second step backpropagates with the optimizer state already allocated
    asyncio.run(trainer.step(paths))
# VmHWM, this process's own peak: ru_maxrss would carry the forking parent's (the kernel keeps the
# larger of the old and new address spaces' peaks across exec), and pytest's is gigabytes.
with open("/proc/self/status") as f:
    peak = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
print(json.dumps(peak - before))
"""


@pytest.mark.slow
@pytest.mark.parametrize("model", ["small", "smollm2-135m"])
@pytest.mark.parametrize("checkpointing", [False, True])
def test_the_estimate_is_within_a_quarter_of_the_measured_peak_on_cpu(model, checkpointing):
    from agents.run.memory_plan import model_shape

    settings = {"micro_batch_size": 4, "gradient_checkpointing": checkpointing}
    length, paths = 512, 4
    spec = SMALL if model == "small" else model
    shape = ModelShape.from_config({**SMALL, "tie_word_embeddings": True}) if model == "small" else model_shape(model)
    plan = memory_plan(
        shape,
        trainer=TrainerConfig(**settings),
        engine="hf",
        engine_kwargs={},
        concurrency=1,
        max_tokens=length,
        on_gpu=False,
    )
    # A clean environment (earlier tests' settings must not reach it), and every large block mapped and
    # unmapped on its own, so the peak resident size follows the live tensors, not malloc's free lists.
    env = {name: os.environ[name] for name in ("PATH", "HOME", "HF_HOME", "XDG_CACHE_HOME") if name in os.environ}
    env.update(MALLOC_MMAP_THRESHOLD_="65536", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, json.dumps([spec, settings, length, paths])],
        capture_output=True,
        text=True,
        check=True,
        env=env,
        cwd=ROOT,
    )
    measured = json.loads(run.stdout.strip().splitlines()[-1])
    estimated = plan.update_peak - plan.parts["trainer weights"]  # the weights were resident before the step
    print(
        f"{model} checkpointing={checkpointing}: estimated {estimated / 2**20:.0f} MiB, measured {measured / 2**20:.0f} MiB"
    )
    assert abs(estimated - measured) <= 0.25 * measured


def test_layers_left_out_of_checkpointing_keep_their_activations_in_the_plan():
    shape = model_shape("smollm2-135m")  # 30 layers

    def activations(**trainer) -> float:
        config = TrainerConfig(micro_batch_size=1, **trainer)
        plan = memory_plan(
            shape, trainer=config, engine="hf", engine_kwargs={}, concurrency=1, max_tokens=1000, on_gpu=False
        )
        return plan.parts["activations (largest micro-batch)"]

    none, every = activations(), activations(gradient_checkpointing=True)
    tenth = activations(gradient_checkpointing=True, checkpoint_layers=0.1)  # 3 layers recomputed, 27 kept
    per_layer = none / 30  # a layer's tensors for 1,000 tokens
    assert every == pytest.approx(1000 * 30 * 4 * 576 + per_layer)
    assert tenth == pytest.approx(1000 * 3 * 4 * 576 + 27 * per_layer + per_layer)
    assert every < tenth < none


def test_hfengines_prefix_cache_counts_full_in_the_rollout_phase():
    shape = model_shape("smollm2-135m")  # 30 layers x 3 kv heads x head dim 64

    def plan(**engine_kwargs):
        return memory_plan(
            shape,
            trainer=TrainerConfig(),
            engine="hf",
            engine_kwargs=engine_kwargs,
            concurrency=8,
            max_tokens=1000,
            on_gpu=False,
        )

    default, small = plan(), plan(prefix_cache_tokens=1000)
    assert default.parts["engine prefix cache"] == 3 * GIB
    assert small.parts["engine prefix cache"] == 1000 * 4 * 2 * 30 * 3 * 64  # float32 keys and values
    assert default.rollout_peak - small.rollout_peak == pytest.approx(3 * GIB - 1000 * 4 * 2 * 30 * 3 * 64)


def test_hfengine_in_bfloat16_holds_a_bfloat16_copy_and_a_bfloat16_kv_room():
    shape = model_shape("smollm2-135m")  # 30 layers x 3 kv heads x head dim 64
    per_token = 2 * 30 * 3 * 64  # keys and values

    def plan(cpu_bfloat16: bool, **trainer):
        return memory_plan(
            shape,
            trainer=TrainerConfig(**trainer),
            engine="hf",
            engine_kwargs={},
            concurrency=128,
            max_tokens=1000,
            on_gpu=False,
            cpu_bfloat16=cpu_bfloat16,
        )

    full, half = plan(False), plan(True)
    # The room: 128 rows as long as the longest (1,000 positions) plus GROWTH (256) spare columns.
    assert full.parts["engine KV cache"] == 4 * per_token * 128 * 1256
    assert half.parts["engine KV cache"] == 2 * per_token * 128 * 1256
    assert full.parts["engine weights"] == 0  # generates with the trainer's float32 model itself
    assert half.parts["engine weights"] == 2 * shape.parameters  # its bfloat16 copy
    assert plan(True, lora_rank=8, base_dtype="bfloat16").parts["engine weights"] == 0  # bfloat16 already
