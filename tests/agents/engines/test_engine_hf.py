"""HFEngine internals: the sampler's exact numbers, batching of concurrent requests, requests that
join a running batch, cancellation, a model shared with the trainer, weight updates, the prefix
cache."""

import asyncio
import gc
import math
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F

from agents.engines import HFEngine, SamplingParams, cpu_kernels
from agents.engines.base import BatchStats
from agents.engines.cpu_kernels import (
    CPU_GQA_ATTENTION,
    WeightFirstLinear,
    _sdpa_cpu_gqa,
    pack_linear_layers,
    packed_linear_supported,
)
from agents.engines.hf import shared_prefix_order
from agents.engines.kv_cache import GROWTH, PREFIX_CACHE_BYTES, PrefixCache, SlotCache, _SlotLayer, kv_bytes_per_token
from agents.engines.sampling import sample_next_tokens
from agents.models import CPU_BFLOAT16_VARIABLE, DEFAULT_MODEL, cpu_compute_dtype, load_model, load_tokenizer

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0]])


def log_softmax(values):
    total = math.log(sum(math.exp(v) for v in values))
    return [v - total for v in values]


def sample(params, logits=LOGITS, seed=0):
    rows = logits.expand(len(params), -1)
    return sample_next_tokens(
        rows, params, [torch.Generator().manual_seed(seed * 1000 + row) for row in range(len(params))]
    )


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
    assert nucleus.entropies.item() == pytest.approx(
        -sum(math.exp(v) * v for v in log_softmax([2, 1, 0, -1])), abs=1e-6
    )


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
    return [
        tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, return_dict=False)
        for q in questions
    ]


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
    assert engine.stats.decode_rows == generated - 8  # each request's first token comes from its prefill


def test_batch_stats_give_a_rollouts_engine_usage():
    before = BatchStats(decode_passes=10, generated_tokens=50, decode_rows=40, prefill_seconds=1.0, largest_batch=4)
    now = BatchStats(decode_passes=30, generated_tokens=170, decode_rows=140, prefill_seconds=2.0, decode_seconds=5.0)
    now.largest_batch = 6
    counts = now.since(before)
    assert (counts.decode_passes, counts.decode_rows, counts.largest_batch) == (20, 100, 6)
    assert counts.usage(8.0) == {
        "engine/busy_frac": 0.75,  # (1 s prefill + 5 s decode) of 8 s
        "engine/prefill_frac": 1 / 6,  # 1 s prefill of 6 busy seconds
        "engine/mean_rows": 5.0,  # 100 rows over 20 passes
        "engine/busy_tokens_per_s": 20.0,  # 120 tokens over 6 busy seconds
    }
    both = counts.plus(BatchStats(decode_passes=5, decode_rows=5, largest_batch=9))
    assert (both.decode_passes, both.decode_rows, both.largest_batch) == (25, 105, 9)
    assert BatchStats().usage(0.0) == {
        "engine/busy_frac": 0.0,
        "engine/prefill_frac": 0.0,
        "engine/mean_rows": 0.0,
        "engine/busy_tokens_per_s": 0.0,
    }


@pytest.mark.slow
async def test_requests_joining_together_beyond_the_prefill_budget_take_several_passes(model, tokenizer, prompts):
    longest = max(len(p) for p in prompts)
    one_pass = HFEngine(model=model, tokenizer=tokenizer, batch_window_s=0.05, prefix_cache_tokens=0)
    # Two rows of at most `longest` positions a pass: four prompts in two passes.
    pairs = HFEngine(
        model=model, tokenizer=tokenizer, batch_window_s=0.05, prefix_cache_tokens=0, max_prefill_tokens=2 * longest
    )
    # Fewer positions than any prompt: each goes alone.
    alone = HFEngine(model=model, tokenizer=tokenizer, batch_window_s=0.05, prefix_cache_tokens=0, max_prefill_tokens=1)
    try:
        results = []
        for engine in (one_pass, pairs, alone):
            results.append(await asyncio.gather(*(engine.generate(p, greedy(6)) for p in prompts)))
        assert [e.stats.prefill_passes for e in (one_pass, pairs, alone)] == [1, 2, 4]
        assert pairs.stats.largest_batch == alone.stats.largest_batch == 4  # every row decodes in one batch
        for chunked in results[1:]:
            assert [c.token_ids for c in chunked] == [c.token_ids for c in results[0]]
            assert [c.logprobs for c in chunked] == [pytest.approx(c.logprobs, abs=1e-4) for c in results[0]]
        with pytest.raises(ValueError, match="max_prefill_tokens must be >= 1"):
            HFEngine(model=model, tokenizer=tokenizer, max_prefill_tokens=0)
    finally:
        for engine in (one_pass, pairs, alone):
            await engine.close()


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


# ---- the prefix cache -----------------------------------------------------------------------


def kv_of(ids):
    """Fake KV of one layer whose values are the token ids, so slices show which tokens they hold."""
    values = torch.tensor(ids, dtype=torch.float32)[None, :, None]
    return [(values, -values)]


def test_the_prefix_cache_holds_3_gib_of_kv_by_default(tokenizer):
    from agents.models import tiny_llama

    model = tiny_llama(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    config = model.config  # 2 layers x keys and values x 2 kv heads x head dim 8, in bfloat16: 128 bytes a token
    assert kv_bytes_per_token(config, torch.bfloat16) == config.num_hidden_layers * 2 * 2 * 8 * 2 == 128
    engine = HFEngine(model=model, tokenizer=tokenizer, compute_dtype=torch.bfloat16)
    assert engine.prefix_cache.max_tokens == PREFIX_CACHE_BYTES // 128 == 3 * 2**30 // 128
    assert HFEngine(model=model, tokenizer=tokenizer, prefix_cache_tokens=100).prefix_cache.max_tokens == 100
    with pytest.raises(ValueError, match="prefix_cache_tokens must be >= 0"):
        HFEngine(model=model, tokenizer=tokenizer, prefix_cache_tokens=-1)


def test_prefix_cache_finds_the_longest_common_prefix():
    cache = PrefixCache(max_tokens=100)
    cache.add([1, 2, 3, 4], kv_of([1, 2, 3, 4]))
    cache.add([1, 2, 9], kv_of([1, 2, 9]))
    length, kv = cache.lookup([1, 2, 3, 7, 8], limit=4)
    assert length == 3 and kv[0][0][0, :3, 0].tolist() == [1, 2, 3]
    assert cache.lookup([1, 2, 3, 4, 5], limit=2)[0] == 2  # never more than the limit
    assert cache.lookup([5, 1, 2], limit=3) is None
    assert cache.lookup([1, 2], limit=0) is None
    assert (cache.num_layers, cache.shape) == (1, (1, 1))


def test_prefix_cache_drops_covered_entries_and_the_least_recently_used():
    cache = PrefixCache(max_tokens=10)
    cache.add([1, 2, 3], kv_of([1, 2, 3]))
    cache.add([1, 2, 3, 4, 5], kv_of([1, 2, 3, 4, 5]))  # the next turn of the same episode
    assert len(cache) == 1 and cache.tokens == 5
    cache.add([7, 8, 9], kv_of([7, 8, 9]))
    cache.lookup([1, 2, 3, 4, 5, 6], limit=5)  # [1..5] is now the most recently used
    cache.add([4, 4, 4], kv_of([4, 4, 4]))  # 11 tokens > 10: [7, 8, 9] goes
    assert cache.tokens == 8 and cache.lookup([7, 8, 9, 1], limit=3) is None
    assert cache.lookup([1, 2, 3, 4, 5, 6], limit=5)[0] == 5
    cache.add(list(range(11)), kv_of(list(range(11))))  # larger than the whole cache: not kept
    assert cache.tokens == 8
    cache.clear()
    assert len(cache) == 0 and cache.tokens == 0
    off = PrefixCache(max_tokens=0)
    off.add([1], kv_of([1]))
    assert len(off) == 0


def test_requests_sharing_an_uncached_prefix_wait_for_the_first_of_them():
    system = list(range(100, 180))  # 80 shared tokens
    prompts = [system + [1], system + [2], [7] * 90, system[:40] + [3], [7] * 90 + [4], system + [5]]
    # Prompt 3 shares only 40 tokens (< 64); prompt 4 shares all 90 of prompt 2's.
    assert shared_prefix_order(prompts, [0] * 6) == ([0, 2, 3], [1, 4, 5])
    # What the prefix cache already holds does not count: prompt 1 gains only 80 − 20 = 60 < 64.
    assert shared_prefix_order(prompts[:2], [0, 20]) == ([0, 1], [])
    # The last token is always computed: an 80-token prompt can share at most 79.
    assert shared_prefix_order([system, system], [0, 0], min_shared=79) == ([0], [1])
    assert shared_prefix_order([system, system], [0, 0], min_shared=80) == ([0, 1], [])


@pytest.mark.slow
async def test_concurrent_prompts_of_one_task_prefill_their_shared_prefix_once(model, tokenizer, prompts):
    engine = HFEngine(model=model, tokenizer=tokenizer, batch_window_s=0.05)
    uncached = HFEngine(model=model, tokenizer=tokenizer, prefix_cache_tokens=0)
    question = [{"role": "user", "content": "Say hello in French, then in German, then in Italian. " * 4}]
    task = tokenizer.apply_chat_template(question, add_generation_prompt=True, return_dict=False)
    chains = [task + tokenizer.encode(f" Answer {n}:", add_special_tokens=False) for n in range(4)]
    try:
        together = await asyncio.gather(*(engine.generate(chain, greedy(4)) for chain in chains))
        assert engine.stats.prefill_passes == 2  # the first alone, then the three others on its KV
        shared = [next(i for i, (a, b) in enumerate(zip(chain, chains[0])) if a != b) for chain in chains[1:]]
        assert len(task) <= min(shared) and engine.stats.prefix_cache_hit_tokens == sum(shared)
        alone = [await uncached.generate(chain, greedy(4)) for chain in chains]
        assert [c.token_ids for c in together] == [c.token_ids for c in alone]
        assert [c.logprobs for c in together] == [pytest.approx(c.logprobs, abs=1e-4) for c in alone]
    finally:
        await engine.close()
        await uncached.close()


@pytest.mark.slow
async def test_next_turn_reuses_the_kv_of_the_last_and_gets_the_same_tokens(model, tokenizer, prompts):
    cached = HFEngine(model=model, tokenizer=tokenizer)
    uncached = HFEngine(model=model, tokenizer=tokenizer, prefix_cache_tokens=0)
    observation = tokenizer.encode(
        "<|im_end|>\n<|im_start|>user\nAnd in German?<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False
    )
    try:
        first = await cached.generate(prompts[2], greedy(8))
        assert cached.stats.prefix_cache_hit_tokens == 0
        second_turn = prompts[2] + first.token_ids + observation
        second = await cached.generate(second_turn, greedy(8))
        # All of the first turn's context but its last sampled token, whose KV was never computed.
        assert cached.stats.prefix_cache_hit_tokens == len(prompts[2]) + len(first.token_ids) - 1
        reference = await uncached.generate(second_turn, greedy(8))
        assert uncached.stats.prefix_cache_hit_tokens == 0
        assert second.token_ids == reference.token_ids
        assert second.logprobs == pytest.approx(reference.logprobs, abs=1e-4)
        # Concurrent requests with different cached prefixes share one prefill pass.
        passes = cached.stats.prefill_passes
        both = await asyncio.gather(cached.generate(second_turn, greedy(4)), cached.generate(prompts[3], greedy(4)))
        alone = [await uncached.generate(p, greedy(4)) for p in (second_turn, prompts[3])]
        assert cached.stats.prefill_passes == passes + 1
        assert [c.token_ids for c in both] == [c.token_ids for c in alone]
        assert [c.logprobs for c in both] == [pytest.approx(c.logprobs, abs=1e-4) for c in alone]
        # A weight change empties the cache: the KV was computed with the old weights.
        hits = cached.stats.prefix_cache_hit_tokens
        with cached.forward_lock, torch.no_grad():
            model.model.norm.weight.mul_(1.0)
        await cached.generate(second_turn, greedy(2))
        assert cached.stats.prefix_cache_hit_tokens == hits
    finally:
        await cached.close()
        await uncached.close()


@pytest.mark.slow
async def test_weights_loaded_in_flight_reach_the_running_rows_and_each_token_records_its_version(
    model, tokenizer, prompts
):
    engine = HFEngine(model=model, tokenizer=tokenizer)
    fresh = HFEngine(model=model, tokenizer=tokenizer, prefix_cache_tokens=0)
    name = "model.layers.0.mlp.down_proj.weight"
    original = model.state_dict()[name].clone()
    story = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a long story about a cat."}], add_generation_prompt=True, return_dict=False
    )
    params = greedy(48)
    try:
        alone = await engine.generate(story, params)
        assert alone.token_versions is None and len(alone.token_ids) == 48  # no load in flight yet: no versions
        passes = engine.stats.decode_passes
        running = asyncio.create_task(engine.generate(story, params))
        while engine.stats.decode_passes < passes + 6:
            await asyncio.sleep(0.001)
        await engine.update_weights_in_flight({name: 0.5 * original}, version=1)
        other = await engine.generate(prompts[1], greedy(2))  # prefilled on the new weights while the first runs
        done = await running
        assert other.token_versions == [1] * len(other.token_ids)
        switch = done.token_versions.index(1)
        # the load lands at the next pass: a busy worker does not keep the forward lock from it
        assert 6 <= switch < 16 and done.token_versions == [None] * switch + [1] * (48 - switch)
        assert done.token_ids[:switch] == alone.token_ids[:switch]
        assert done.logprobs[:switch] == pytest.approx(alone.logprobs[:switch], abs=1e-5)
        # Its KV, partly the old weights', was not cached: its next turn is what a fresh engine computes.
        next_turn = story + done.token_ids + tokenizer.encode("<|im_end|>\n", add_special_tokens=False)
        again, reference = await engine.generate(next_turn, greedy(4)), await fresh.generate(next_turn, greedy(4))
        assert again.token_ids == reference.token_ids
        assert again.logprobs == pytest.approx(reference.logprobs, abs=1e-4)
        # The first new token: the new weights over the KV the old ones computed for the tokens before it.
        context = torch.tensor([story + done.token_ids[: switch - 1]])
        with torch.no_grad():
            model.load_state_dict({name: original}, strict=False)
            cache = model(input_ids=context, use_cache=True).past_key_values
            model.load_state_dict({name: 0.5 * original}, strict=False)
            last = torch.tensor([[done.token_ids[switch - 1]]])
            logits = model(input_ids=last, past_key_values=cache, use_cache=True).logits[0, -1]
        expected = torch.log_softmax(logits.float(), -1)[done.token_ids[switch]].item()
        assert done.logprobs[switch] == pytest.approx(expected, abs=1e-4)
        assert (
            abs(done.logprobs[switch] - alone.logprobs[switch]) > 1e-3
            or done.token_ids[switch] != alone.token_ids[switch]
        )
    finally:
        with torch.no_grad():
            model.load_state_dict({name: original}, strict=False)
        await engine.close()
        await fresh.close()


# ---- the decode path's memory traffic: in-place KV appends, no copies of grouped KV heads -------


def kv(length, seed):
    keys = torch.randn(2, length, 4, generator=torch.Generator().manual_seed(seed))  # [kv heads, length, head dim]
    return [(keys, -keys), (2 * keys, -2 * keys)]  # two layers


def test_slot_cache_rows_join_grow_and_leave_without_touching_the_others():
    cache = SlotCache(num_layers=2, max_rows=8)
    a, b, c = kv(5, 0), kv(3, 1), kv(GROWTH + 10, 2)
    cache.add_rows([a, b])
    assert cache.lengths.tolist() == [5, 3] and cache.width == 5
    # A decode step: row 0 writes its new key at column 5, row 1 at column 3.
    mask, positions = cache.decode_inputs()
    assert mask.tolist() == [[1] * 6, [1, 1, 1, 1, 0, 0]] and positions.tolist() == [[5], [3]]
    new = torch.stack([torch.full((2, 1, 4), 7.0), torch.full((2, 1, 4), 8.0)])  # [rows, heads, 1, dim]
    keys, values = cache.layers[1].update(new, -new)
    assert keys.shape == (2, 2, 6, 4)
    assert torch.equal(keys[0, :, :5], a[1][0]) and torch.equal(keys[0, :, 5], new[0, :, 0])
    assert torch.equal(keys[1, :, :3], b[1][0]) and torch.equal(keys[1, :, 3], new[1, :, 0])
    assert torch.equal(values[1, :, 3], -new[1, :, 0])
    cache.advance()
    assert cache.lengths.tolist() == [6, 4] and cache.get_seq_length() == 6
    assert cache.layers[0].room[0].shape == (2, 2, 5 + GROWTH, 4)  # room for the first rows, plus GROWTH columns
    # Zeros beyond each row's length: attention reads them under the mask, and NaN there would spread.
    assert not cache.layers[0].room[0][1, :, 3:].any()
    # A longer row outgrows it: the room grows to GROWTH columns beyond the need, rows double; the rows stay.
    cache.add_rows([c])
    assert cache.layers[0].room[0].shape == (4, 2, GROWTH + 10 + GROWTH, 4)
    assert not cache.layers[1].room[1][:, :, GROWTH + 10 :].any() and not cache.layers[1].room[1][3].any()
    assert torch.equal(cache.row(1)[1][0], torch.cat([b[1][0], new[1, :, :1].expand(2, 1, 4)], dim=1))
    # Row 0 leaves: the last row (c) moves into its place; row 1 is untouched.
    cache.remove_row(0)
    assert cache.lengths.tolist() == [GROWTH + 10, 4] and cache.width == GROWTH + 10
    assert torch.equal(cache.row(0)[0][0], c[0][0]) and torch.equal(cache.row(0)[1][1], c[1][1])
    assert cache.row(1)[0][0].shape == (2, 4, 4)
    cache.remove_row(1)
    cache.remove_row(0)
    assert cache.num_rows == 0 and cache.width == 0
    cache.add_rows([a])
    cache.release()
    assert cache.num_rows == 0 and all(layer.room is None for layer in cache.slot_layers)


def test_slot_cache_gives_back_columns_when_its_longest_row_leaves():
    # A decode step's attention reads every column of the room: a room left wide by a long row that left
    # would make every later step pay for that row's length.
    cache = SlotCache(num_layers=2, max_rows=8)
    short, long = kv(3, 0), kv(3 * GROWTH, 1)
    cache.add_rows([short, long])
    assert cache.layers[0].room[0].shape[2] == 3 * GROWTH + GROWTH
    cache.remove_row(1)  # 4 x GROWTH columns held, 3 + GROWTH needed: more than twice, so they go
    assert [layer.room[0].shape for layer in cache.slot_layers] == [(2, 2, 3 + GROWTH, 4)] * 2
    assert torch.equal(cache.row(0)[1][0], short[1][0]) and torch.equal(cache.row(0)[1][1], short[1][1])
    assert not cache.layers[0].room[0][0, :, 3:].any()  # zeros past the row, as attention needs
    mask, positions = cache.decode_inputs()
    assert mask.tolist() == [[1, 1, 1, 1]] and positions.tolist() == [[3]]
    # Within twice the need the room stays: rows leaving and joining do not reallocate it each time.
    cache.add_rows([kv(GROWTH // 2, 2)])
    held = cache.layers[0].room[0]
    cache.remove_row(1)
    assert cache.layers[0].room[0] is held


@pytest.mark.slow
async def test_a_finished_batch_frees_its_kv_room_without_the_garbage_collector(engine, prompts):
    # The layers and their cache refer to each other: left to the cyclic collector, which counts Python
    # objects rather than bytes, finished batches' rooms once piled up (3.4 GB each at 128 rows).
    gc.collect()
    gc.disable()
    try:
        await asyncio.gather(*(engine.generate(p, greedy(4)) for p in prompts))
        await asyncio.gather(*(engine.generate(p, greedy(4)) for p in prompts[:2]))
        # Every layer of both batches' caches, reachable or not, holds no room.
        layers = [o for o in gc.get_objects() if isinstance(o, _SlotLayer)]
        assert len(layers) >= 2 * 30 and all(layer.room is None for layer in layers)
    finally:
        gc.enable()


async def test_engine_attention_is_stock_sdpa_without_the_kv_copy(tokenizer):
    stock, switched = load_model(DEFAULT_MODEL), load_model(DEFAULT_MODEL)
    engine = HFEngine(model=switched, tokenizer=tokenizer)
    assert switched.config._attn_implementation == CPU_GQA_ATTENTION
    ids = torch.randint(0, 40000, (3, 20), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(3, 20, dtype=torch.long)
    mask[0, :7] = 0  # left padding: the masked path is the one that changed
    with torch.inference_mode():
        assert torch.equal(
            switched(input_ids=ids, attention_mask=mask).logits[mask.bool()],
            stock(input_ids=ids, attention_mask=mask).logits[mask.bool()],
        )
    # With gradients (the trainer's passes) it is transformers' own sdpa.
    loss = switched(input_ids=ids, attention_mask=mask).logits[mask.bool()].logsumexp(-1).sum()
    loss.backward()
    assert switched.model.layers[0].self_attn.k_proj.weight.grad.abs().sum() > 0
    await engine.close()


@pytest.mark.parametrize("flash", [False, True], ids=["products", "flash"])  # each CPU's kernel, tested on any
@pytest.mark.parametrize("additive", [False, True])
def test_bfloat16_decode_attention_is_grouped_query_attention(additive, flash, monkeypatch):
    monkeypatch.setattr(cpu_kernels, "FLASH_DECODE", flash)
    torch.manual_seed(0)
    rows, heads, kv_heads, width, dim = 5, 9, 3, 40, 64
    query = torch.randn(rows, heads, 1, dim).bfloat16()
    key, value = (torch.randn(rows, kv_heads, width, dim).bfloat16() for _ in "kv")
    allowed = torch.arange(width)[None] < torch.tensor([40, 33, 1, 17, 25])[:, None]  # rows of their own lengths
    mask = allowed[:, None, None, :]
    if additive:
        mask = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
    expected = F.scaled_dot_product_attention(
        query.double(), key.double(), value.double(), attn_mask=allowed[:, None, None, :], enable_gqa=True
    ).transpose(1, 2)
    with torch.inference_mode():
        out, weights = _sdpa_cpu_gqa(torch.nn.Module(), query, key, value, mask, scaling=dim**-0.5)
    assert weights is None and out.dtype == torch.bfloat16 and out.shape == (rows, 1, heads, dim)
    # float32 scores and softmax; bfloat16 probabilities into the second product: a few bfloat16 roundings
    assert (out.double() - expected).abs().max() < 2e-2
    # row 2 sees its one position only: its output is that position's value, per query head's KV head
    assert torch.allclose(out[2, 0].double(), value[2, :, 0].double().repeat_interleave(3, 0), atol=1e-2)
    # The first columns of a wider room (HFEngine's KV cache): the columns past them, here NaN-free junk, are
    # never attended; rows of equal length come without a mask.
    room_keys, room_values = (
        torch.cat([t, torch.full((rows, kv_heads, 24, dim), 7.0).bfloat16()], 2) for t in (key, value)
    )
    with torch.inference_mode():
        wide, _ = _sdpa_cpu_gqa(torch.nn.Module(), query, room_keys[:, :, :width], room_values[:, :, :width], mask)
        unmasked, _ = _sdpa_cpu_gqa(torch.nn.Module(), query, room_keys[:, :, :width], room_values[:, :, :width], None)
    assert (wide.float() - out.float()).abs().max() < 1e-2  # attending a 7.0 would move outputs by units
    everything = F.scaled_dot_product_attention(query.double(), key.double(), value.double(), enable_gqa=True)
    assert (unmasked.double() - everything.transpose(1, 2)).abs().max() < 2e-2


async def test_a_prefill_hands_the_output_layer_contiguous_rows(model, tokenizer, prompts):
    # A strided [rows, 1, hidden] view made torch expand the output layer's weight once per row (6 s at 64 rows).
    seen = []
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda _, args: seen.append(args[0]))
    engine = HFEngine(model=model, tokenizer=tokenizer, batch_window_s=0.05)
    try:
        await asyncio.gather(*(engine.generate(p, greedy(1)) for p in prompts))
    finally:
        hook.remove()
        await engine.close()
    assert engine.stats.prefill_passes == 1
    assert seen[0].shape == (4, 1, 576) and seen[0].is_contiguous()


def test_weight_first_linear_is_the_same_product():
    torch.manual_seed(0)
    x, weight, bias = torch.randn(2, 3, 16), torch.randn(8, 16), torch.randn(8)
    expected = x @ weight.T + bias
    calls = []
    real_mm = torch.mm
    with WeightFirstLinear(max_rows=6):
        torch.mm = lambda a, b: calls.append(a.shape) or real_mm(a, b)  # which operand comes first
        try:
            out = F.linear(x, weight, bias)  # 6 rows: weight first
            no_bias = F.linear(x, weight)
            one_row = F.linear(x[0, :1], weight, bias)  # 1 row and more than max_rows: F.linear itself
            seven_rows = F.linear(torch.cat([x.reshape(6, 16), x[0, :1]]), weight)
        finally:
            torch.mm = real_mm
    assert calls == [(8, 16), (8, 16)]
    assert out.shape == (2, 3, 8) and out.is_contiguous()
    assert torch.allclose(out, expected, atol=1e-5) and torch.allclose(no_bias, expected - bias, atol=1e-5)
    assert torch.allclose(one_row, expected[0, :1], atol=1e-5) and seven_rows.shape == (7, 8)


def test_weight_first_linear_keeps_the_models_logits(tokenizer):
    model = load_model(DEFAULT_MODEL)
    ids = torch.randint(0, 40000, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        stock = model(input_ids=ids).logits
        with WeightFirstLinear():
            weight_first = model(input_ids=ids).logits
    assert (weight_first - stock).abs().max() < 1e-4
    assert torch.equal(weight_first.argmax(-1), stock.argmax(-1))


needs_packed_linear = pytest.mark.skipif(not packed_linear_supported(), reason="torch without oneDNN bfloat16")


@needs_packed_linear
def test_packed_linear_layers_compute_the_same_products_and_pack_again_after_a_change():
    torch.manual_seed(0)
    layer = torch.nn.Linear(64, 32).bfloat16()
    plain = torch.nn.Linear(64, 32).bfloat16()
    plain.load_state_dict(layer.state_dict())
    assert pack_linear_layers(torch.nn.Sequential(layer, torch.nn.Linear(4, 4)), max_rows=6) == 1  # bfloat16 only
    x = torch.randn(2, 3, 64).bfloat16()
    with torch.inference_mode():
        packed, expected = layer(x), plain(x)
        packs = layer.forward.packed
        assert layer(x[0]) is not None and layer.forward.packed is packs  # packed once
        wide = layer(torch.randn(7, 64).bfloat16())  # more than max_rows: F.linear
    assert packed.shape == (2, 3, 32) and packed.dtype == torch.bfloat16 and wide.shape == (7, 32)
    # the same oneDNN products: bit-identical on AVX512-BF16; within a bfloat16 rounding anywhere
    assert torch.allclose(packed.float(), expected.float(), rtol=1e-2, atol=1e-2)
    with torch.no_grad():
        layer.weight.mul_(-1)  # an in-place change (a ComputeCopy refresh, a load) moves the version counter
        plain.weight.mul_(-1)
    with torch.inference_mode():
        assert torch.allclose(layer(x).float(), plain(x).float(), rtol=1e-2, atol=1e-2)
    loss = layer(x.float().bfloat16().requires_grad_()).sum()  # with gradients: F.linear, differentiable
    loss.backward()
    assert layer.weight.grad is not None


@needs_packed_linear
async def test_a_bfloat16_copy_packs_its_linear_layers_and_follows_weight_changes(tokenizer, prompts):
    model = load_model(DEFAULT_MODEL)
    engine = HFEngine(model=model, tokenizer=tokenizer, compute_dtype=torch.bfloat16, prefix_cache_tokens=0)
    try:
        before = await engine.generate(prompts[0], greedy(3))
        assert engine.compute_copy is not None and engine.compute_copy.packed_layers == 30 * 7 + 1  # lm_head too
        with engine.forward_lock, torch.no_grad():
            model.model.layers[3].mlp.down_proj.weight.mul_(3.0)  # the trainer's shared model, changed in place
        after = await engine.generate(prompts[0], greedy(3))
    finally:
        await engine.close()
    fresh = HFEngine(model=model, tokenizer=tokenizer, compute_dtype=torch.bfloat16, prefix_cache_tokens=0)
    try:
        expected = await fresh.generate(prompts[0], greedy(3))
    finally:
        await fresh.close()
    # the copy was refreshed and the changed layer packed again: the old engine computes what a new one does
    assert after.logprobs == expected.logprobs and after.token_ids == expected.token_ids
    assert after.logprobs != before.logprobs


@needs_packed_linear
async def test_a_bfloat16_copy_decodes_with_the_fused_step_and_samples_what_the_forward_pass_does(tokenizer, prompts):
    model = load_model(DEFAULT_MODEL)
    mixed = [
        SamplingParams(temperature=1.0, max_new_tokens=12, seed=1, return_entropy=True),
        greedy(9),
        SamplingParams(temperature=0.7, top_k=40, max_new_tokens=16, seed=2),
        SamplingParams(temperature=1.2, top_p=0.9, max_new_tokens=6, seed=3),
    ]
    results = {}
    for fused in (True, False):
        engine = HFEngine(model=model, tokenizer=tokenizer, compute_dtype=torch.bfloat16, fused_decode=fused)
        try:
            assert (engine.fused_decode is not None) is fused
            results[fused] = await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, mixed)))
        finally:
            await engine.close()
    assert HFEngine(model=model, tokenizer=tokenizer, compute_dtype=torch.float32).fused_decode is None
    for fused, plain in zip(results[True], results[False]):  # rows of different lengths, leaving at different steps
        assert fused.token_ids == plain.token_ids
        assert fused.logprobs == pytest.approx(plain.logprobs, abs=1e-3)  # equal here (AVX512-BF16)
        assert fused.token_entropies == pytest.approx(plain.token_entropies, abs=1e-3)


def test_cpu_compute_dtype_is_detected_and_can_be_forced(monkeypatch):
    monkeypatch.delenv(CPU_BFLOAT16_VARIABLE)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    assert cpu_compute_dtype() == torch.float32  # bfloat16 emulated: slower than float32
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert cpu_compute_dtype() == torch.bfloat16
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert cpu_compute_dtype() == torch.bfloat16
    monkeypatch.setenv(CPU_BFLOAT16_VARIABLE, "0")
    assert cpu_compute_dtype() == torch.float32
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setenv(CPU_BFLOAT16_VARIABLE, "1")
    assert cpu_compute_dtype() == torch.bfloat16
    monkeypatch.setenv(CPU_BFLOAT16_VARIABLE, "yes")
    with pytest.raises(ValueError, match=r"\$AGENTENV_CPU_BFLOAT16='yes': set it to 1 \(bfloat16\), 0"):
        cpu_compute_dtype()


def test_the_cpu_default_follows_the_cpu_and_a_bfloat16_model_keeps_its_dtype(model, tokenizer, monkeypatch):
    monkeypatch.setenv(CPU_BFLOAT16_VARIABLE, "1")  # a CPU with bfloat16 units
    engine = HFEngine(model=model, tokenizer=tokenizer)
    assert engine.compute_dtype == torch.bfloat16 and engine.compute_copy is not None
    monkeypatch.setenv(CPU_BFLOAT16_VARIABLE, "0")  # one without (the suite's setting)
    engine = HFEngine(model=model, tokenizer=tokenizer)
    assert engine.compute_dtype == torch.float32 and engine.compute_copy is None
    half = HFEngine(model=load_model(DEFAULT_MODEL, dtype=torch.bfloat16), tokenizer=tokenizer)
    assert half.compute_dtype == torch.bfloat16 and half.compute_copy is None


async def test_a_float32_model_generates_from_a_bfloat16_copy_with_a_bfloat16_kv_cache(model, tokenizer, prompts):
    # What a float32 trainer model shared with the engine does on a GPU, or a CPU with bfloat16 units, by default.
    exact = HFEngine(model=model, tokenizer=tokenizer)
    half = HFEngine(model=model, tokenizer=tokenizer, compute_dtype=torch.bfloat16)
    try:
        reference = await exact.generate(prompts[0], greedy(4))
        got = await half.generate(prompts[0], greedy(4))
        await half.generate(prompts[0] + got.token_ids, greedy(1))  # the second turn reuses the cached KV
        assert {t.dtype for _, kv in half.prefix_cache._entries.values() for pair in kv for t in pair} == {
            torch.bfloat16
        }
        assert got.token_ids[0] == reference.token_ids[0]
        # bfloat16 keeps 8 significant bits: over SmolLM2's 30 layers the first log-prob moves by about 0.1
        # (0.1001 in one run, depending on the thread count's summation order); a broken cache moves it by nats
        assert abs(got.logprobs[0] - reference.logprobs[0]) < 0.25
        assert next(model.parameters()).dtype == torch.float32  # the model's weights are untouched
        assert half.compute_copy is not None and {p.dtype for p in half.compute_copy.model.parameters()} == {
            torch.bfloat16
        }
    finally:
        await exact.close()
        await half.close()


async def test_after_a_weight_change_concurrent_prompts_still_prefill_their_shared_prefix_once(tokenizer):
    # The prefix cache is emptied when the weights change; it once was emptied after the requests
    # were ordered by it, so that every rollout after a training step prefilled each shared prompt
    # once per request.
    from agents.models import tiny_llama

    model = tiny_llama(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    engine = HFEngine(model=model, tokenizer=tokenizer, batch_window_s=0.2)
    task = list(range(100, 180))
    chains = [task + [200 + n, 300 + n] for n in range(4)]
    try:
        for change in range(2):
            passes, hits = engine.stats.prefill_passes, engine.stats.prefix_cache_hit_tokens
            await asyncio.gather(*(engine.generate(chain, greedy(2)) for chain in chains))
            assert engine.stats.prefill_passes - passes == 2  # the first alone, then the three others on its KV
            assert engine.stats.prefix_cache_hit_tokens - hits == 3 * len(task)
            with torch.no_grad():  # an optimiser step on a shared model: every cached KV is stale
                next(model.parameters()).mul_(1.0 + 1e-3 * (change + 1))
    finally:
        await engine.close()


async def test_one_request_at_a_time_serves_every_queued_request(tokenizer):
    # max_batch_size=1 leaves requests queued while one runs; the worker once waited for a new
    # arrival before taking them, so they hung.
    from agents.models import tiny_llama

    model = tiny_llama(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    engine = HFEngine(model=model, tokenizer=tokenizer, max_batch_size=1, prefix_cache_tokens=0)
    try:
        params = SamplingParams(max_new_tokens=4, seed=1)
        done = await asyncio.wait_for(asyncio.gather(*(engine.generate([1, 2, 3], params) for _ in range(3))), 60)
        assert [c.token_ids for c in done] == [done[0].token_ids] * 3  # alone, each seeded row is the same
        assert engine.stats.largest_batch == 1
    finally:
        await engine.close()
