"""HFEngine internals: the sampler's exact numbers, batching of concurrent requests, requests that
join a running batch, cancellation, a model shared with the trainer, weight updates."""

import asyncio
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from agents.engines import HFEngine, SamplingParams
from agents.engines.hf import sample_next_tokens
from agents.models import DEFAULT_MODEL, load_model, load_tokenizer

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0]])


def log_softmax(values):
    total = math.log(sum(math.exp(v) for v in values))
    return [v - total for v in values]


def sample(params, logits=LOGITS, seed=0):
    rows = logits.expand(len(params), -1)
    return sample_next_tokens(rows, params, [torch.Generator().manual_seed(seed * 1000 + row) for row in range(len(params))])


# ---- the sampler, on a 4-token vocabulary ---------------------------------------------------


def test_greedy_takes_argmax_and_reports_temperature_one_logprobs():
    out = sample([SamplingParams(temperature=0, logprobs_topk=2)])
    assert out.token_ids.tolist() == [0]
    assert out.logprobs.item() == pytest.approx(log_softmax([2, 1, 0, -1])[0], abs=1e-6)  # -0.44019
    assert [t for t, _ in out.top_logprobs[0]] == [0, 1]


def test_temperature_scales_logprobs_and_entropy():
    out = sample([SamplingParams(temperature=2.0, return_entropy=True)])
    scaled = log_softmax([1.0, 0.5, 0.0, -0.5])
    assert out.logprobs.item() == pytest.approx(scaled[out.token_ids.item()], abs=1e-6)
    assert out.entropies.item() == pytest.approx(-sum(math.exp(v) * v for v in scaled), abs=1e-6)


def test_top_k_and_top_p_renormalise_over_what_they_keep():
    # top-k 2 keeps tokens 0 and 1: log p(0) = 2 - log(e^2 + e^1) = -0.31326.
    top_k = sample([SamplingParams(top_k=2, logprobs_topk=4)] * 64)
    assert set(top_k.token_ids.tolist()) <= {0, 1}
    assert top_k.top_logprobs[0][0][1] == pytest.approx(-0.313262, abs=1e-6)
    assert top_k.top_logprobs[0][2][1] == -math.inf
    # p(0) = 0.6439 >= 0.5: the nucleus is token 0 alone; at 0.7 it also needs token 1.
    assert sample([SamplingParams(top_p=0.5)] * 32).logprobs.tolist() == [0.0] * 32
    nucleus = sample([SamplingParams(top_p=0.7, logprobs_topk=2, return_entropy=True)])
    assert nucleus.top_logprobs[0][0][1] == pytest.approx(-0.313262, abs=1e-6)
    # Entropy stays that of the full temperature-scaled distribution.
    assert nucleus.entropies.item() == pytest.approx(-sum(math.exp(v) * v for v in log_softmax([2, 1, 0, -1])), abs=1e-6)


def test_rows_keep_their_own_parameters():
    out = sample([SamplingParams(temperature=0), SamplingParams(top_p=0.5), SamplingParams(top_k=1)])
    assert out.token_ids.tolist() == [0, 0, 0]
    assert out.logprobs[0].item() == pytest.approx(-0.440190, abs=1e-6)
    assert out.logprobs[1:].tolist() == [0.0, 0.0]


def test_sampling_follows_the_generator():
    params = [SamplingParams()] * 8
    assert sample(params, seed=3).token_ids.tolist() == sample(params, seed=3).token_ids.tolist()
    draws = torch.cat([sample(params, seed=s).token_ids for s in range(200)])
    frequencies = torch.bincount(draws, minlength=4).float() / draws.numel()
    expected = torch.tensor([math.exp(v) for v in log_softmax([2, 1, 0, -1])])
    assert (frequencies - expected).abs().max() < 0.05  # 1600 draws: 4 standard errors


# ---- the engine on the real model ---------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def model():
    return load_model(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    questions = ["What is 2+2?", "Name a fruit.", "Say hello in French.", "What colour is the sky?"]
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False) for q in questions]


@pytest.fixture
async def engine(model, tokenizer):
    engine = HFEngine(model=model, tokenizer=tokenizer, max_batch_size=8, batch_window_s=0.05)
    yield engine
    await engine.close()


def greedy(max_new_tokens):
    return SamplingParams(temperature=0, max_new_tokens=max_new_tokens)


@pytest.mark.slow
async def test_concurrent_requests_share_forward_passes(engine, prompts):
    done = await asyncio.gather(*(engine.generate(prompts[i % 4], greedy(6)) for i in range(8)))
    generated = sum(len(c.token_ids) for c in done)
    assert engine.stats.prefill_passes == 1 and engine.stats.largest_batch == 8
    assert engine.stats.decode_passes == max(len(c.token_ids) for c in done) - 1
    assert engine.stats.generated_tokens == generated


@pytest.mark.slow
async def test_requests_joining_a_running_batch_get_the_same_tokens(engine, prompts):
    alone = [await engine.generate(p, greedy(8)) for p in prompts[:3]]
    passes = engine.stats.decode_passes
    first = asyncio.create_task(engine.generate(prompts[0], greedy(8)))
    while engine.stats.decode_passes < passes + 3 and not first.done():  # until it is decoding
        await asyncio.sleep(0.01)
    assert not first.done()
    joined = await asyncio.gather(first, *(engine.generate(p, greedy(8)) for p in prompts[1:3]))
    assert [c.token_ids for c in joined] == [c.token_ids for c in alone]
    assert [c.logprobs for c in joined] == [pytest.approx(c.logprobs, abs=1e-4) for c in alone]


@pytest.mark.slow
async def test_a_cancelled_request_leaves_the_batch(engine, prompts):
    long = asyncio.create_task(engine.generate(prompts[0], SamplingParams(temperature=1.0, max_new_tokens=400, seed=1)))
    while engine.stats.decode_passes < 3 and not long.done():
        await asyncio.sleep(0.01)
    assert not long.done()
    long.cancel()
    with pytest.raises(asyncio.CancelledError):
        await long
    done = await engine.generate(prompts[1], greedy(4))
    assert len(done.token_ids) >= 1
    assert engine.stats.generated_tokens < 100  # the cancelled row stopped decoding


@pytest.mark.slow
async def test_event_loop_stays_free_while_generating(engine, prompts):
    ticks = 0

    async def ticker():
        nonlocal ticks
        while True:
            await asyncio.sleep(0.005)
            ticks += 1

    task = asyncio.create_task(ticker())
    await engine.generate(prompts[2], greedy(12))
    task.cancel()
    assert ticks >= engine.stats.decode_passes  # the loop ran while every forward pass ran


@pytest.mark.slow
async def test_shared_model_weights_are_used_in_place(model, tokenizer, prompts):
    engine = HFEngine(model=model, tokenizer=tokenizer)
    assert engine.model is model
    before = await engine.generate(prompts[0], greedy(3))
    head = model.model.layers[0].mlp.down_proj.weight
    original = head.detach().clone()
    try:
        with engine.forward_lock, torch.no_grad():
            head.mul_(0.0)
        after = await engine.generate(prompts[0], greedy(3))
        assert abs(after.logprobs[0] - before.logprobs[0]) > 1e-3
        await engine.update_weights({"model.layers.0.mlp.down_proj.weight": original})
        restored = await engine.generate(prompts[0], greedy(3))
        assert restored.logprobs == pytest.approx(before.logprobs, abs=1e-6)
        with pytest.raises(KeyError, match="weights the model does not have"):
            await engine.update_weights({"no.such.weight": original})
    finally:
        with torch.no_grad():
            head.copy_(original)
        await engine.close()


async def test_bad_requests_and_closed_engine(model, tokenizer):
    with pytest.raises(ValueError, match="needs tokenizer= as well"):
        HFEngine(model=model)
    engine = HFEngine(model=model, tokenizer=tokenizer)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 49152\)"):
        await engine.generate([49152], SamplingParams())
    with pytest.raises(TypeError, match="params must be a SamplingParams"):
        await engine.generate([1], {"temperature": 0})
    await engine.close()
    with pytest.raises(RuntimeError, match="HFEngine is closed"):
        await engine.generate([1], SamplingParams())
