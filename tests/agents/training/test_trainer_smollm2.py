"""The trainer on the real embedded SmolLM2-135M with HFEngine samples: log-prob agreement, learning, sync."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from agents.engines.base import SamplingParams
from agents.engines.hf import HFEngine
from agents.models import load_model, load_tokenizer
from agents.rollout.tree import RolloutTree
from agents.training.trainer import Trainer, TrainerConfig

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Which city is the capital of France? Answer in one sentence."}]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("smollm2-135m")


async def sampled_paths(engine, tokenizer, advantages=(1.0, -1.0)):
    """Two sampled answers to one question (about 45 + 24 tokens each) with the given advantages."""
    prompt = tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    completions = await engine.generate_many(
        [prompt_ids] * 2, [SamplingParams(temperature=1.0, max_new_tokens=24, seed=seed) for seed in (1, 2)]
    )
    tree = RolloutTree(prompt_ids)
    for completion, advantage in zip(completions, advantages):
        leaf = tree.add_turn(
            tree.root,
            action_ids=completion.token_ids,
            sampler_logprobs=completion.logprobs,
            terminal=True,
            reward=advantage,
        )
        leaf.advantage = advantage
    return tree.paths()


def action_logprob_sums(trainer, paths):
    scores = trainer.compute_logprobs(paths)
    return [float(sum(scores[row, t] for t, m in enumerate(path.mask) if m)) for row, path in enumerate(paths)]


async def test_shared_hf_engine_samples_match_the_trainer_and_one_update_moves_them_apart(tokenizer):
    model = load_model("smollm2-135m")
    engine = HFEngine(model, tokenizer, seed=0)
    trainer = Trainer(
        model,
        TrainerConfig(lr=1e-5, micro_batch_size=2, progress=False, report_to=("none",)),
        tokenizer=tokenizer,
        engine=engine,
    )
    try:
        paths = await sampled_paths(engine, tokenizer)
        before = action_logprob_sums(trainer, paths)
        metrics = await trainer.step(paths)
        after = action_logprob_sums(trainer, paths)
        # float32 everywhere: the engine's KV-cached decoding and the trainer's full forward pass
        # agree to rounding error.
        # Every sampled token is compared (24 each unless one hits EOS first, as other CPUs may sample).
        assert metrics["mismatch/tokens"] == sum(sum(path.mask) for path in paths) > 24
        assert metrics["mismatch/max_abs"] < 2e-3
        assert metrics["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
        assert 0 < metrics["policy/entropy"] < 11  # nats; log(49152) ≈ 10.8
        assert after[0] > before[0] and after[1] < before[1]
        assert trainer.shares_weights_with_engine and metrics["time/sync_s"] < 1.0
        # The engine generates with the updated weights without any copy.
        assert engine.model is trainer.model
        again = await engine.generate(paths[0].ids[:10], SamplingParams(temperature=0, max_new_tokens=2))
        assert len(again.token_ids) == 2
    finally:
        await engine.close()


async def test_separate_engine_receives_the_weights_after_the_step(tokenizer):
    engine = HFEngine("smollm2-135m", seed=0)
    trainer = Trainer(
        load_model("smollm2-135m"),
        TrainerConfig(lr=1e-5, old_logprobs="sampler", progress=False, report_to=("none",)),
        tokenizer=tokenizer,
        engine=engine,
    )
    try:
        assert not trainer.shares_weights_with_engine
        paths = await sampled_paths(engine, tokenizer)
        metrics = await trainer.step(paths)
        assert metrics["mismatch/max_abs"] < 2e-3  # the sampler's log-probs were used as π_old
        trained = trainer.model.state_dict()
        served = engine.model.state_dict()
        assert all(torch.equal(served[name], trained[name]) for name in trained)
        assert not torch.equal(
            trained["model.layers.0.mlp.up_proj.weight"],
            load_model("smollm2-135m").state_dict()["model.layers.0.mlp.up_proj.weight"],
        )
    finally:
        await engine.close()
