"""HFEngine's decode path: the same tokens and log-probs as a full forward pass, one host read a
step, the compute-dtype copy of the weights that a GPU generates from, and stop strings found in
a tail window of the text exactly where a search of the whole text finds them."""

import asyncio
import concurrent.futures
import dataclasses
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from torch.overrides import TorchFunctionMode

from agents.engines import HFEngine, SamplingParams
from agents.engines.base import find_stop
from agents.engines.hf import ComputeCopy, _Request, completion_stop
from agents.engines.sampling import RowSampler, sample_next_tokens
from agents.models import DEFAULT_MODEL, load_tokenizer, tiny_llama


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def model(tokenizer):
    # Random weights over SmolLM2's vocabulary: sampled text of every kind of token, multi-byte characters too.
    return tiny_llama(vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id, max_position_embeddings=512)


MIXED = [
    SamplingParams(temperature=1.0, max_new_tokens=12, seed=1, return_entropy=True, logprobs_topk=3),
    SamplingParams(temperature=0, max_new_tokens=7),
    SamplingParams(temperature=0.7, top_k=40, max_new_tokens=20, seed=2),
    SamplingParams(temperature=1.3, top_p=0.9, max_new_tokens=16, seed=3, return_entropy=True),
]
PROMPTS = [[1, 2, 3, 4, 5], [9, 8, 7], [100, 200, 300, 400, 500, 600, 700], [42] * 11]


def reference_completion(model, prompt, params):
    """What each token should be: a full-sequence transformers forward pass per token, sampled alone."""
    ids, logprobs, entropies = list(prompt), [], []
    generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
    for _ in range(params.max_new_tokens):
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids])).logits[:, -1]
        out = sample_next_tokens(logits, [params], [generator or torch.Generator()])
        ids.append(out.token_ids.item())
        logprobs.append(out.logprobs.item())
        if out.entropies is not None:
            entropies.append(out.entropies.item())
    return ids[len(prompt) :], logprobs, entropies


async def test_decode_steps_give_the_tokens_and_logprobs_of_a_full_forward_pass(model, tokenizer):
    # Rows of every kind decode together, leave at different steps (7, 12, 16, 20 tokens) and one joins late.
    engine = HFEngine(model=model, tokenizer=tokenizer, max_batch_size=8, batch_window_s=0.05)
    try:
        first = [engine.generate(p, s) for p, s in zip(PROMPTS[:3], MIXED[:3])]
        tasks = [asyncio.ensure_future(c) for c in first]
        while engine.stats.decode_passes < 3:
            await asyncio.sleep(0.001)
        late = await engine.generate(PROMPTS[3], MIXED[3])
        done = [*(await asyncio.gather(*tasks)), late]
    finally:
        await engine.close()
    assert engine.stats.largest_batch == 4  # the late row joined the running batch
    for completion, prompt, params in zip(done, PROMPTS, MIXED):
        ids, logprobs, entropies = reference_completion(model, prompt, params)
        assert completion.token_ids == ids
        assert completion.logprobs == pytest.approx(logprobs, abs=1e-5)
        if params.return_entropy:
            assert completion.token_entropies == pytest.approx(entropies, abs=1e-5)
    assert [len(c.top_logprobs[0]) for c in done[:1]] == [3]
    assert done[0].top_logprobs[0][0][1] >= done[0].top_logprobs[0][1][1]


def test_a_row_sampler_gives_each_row_what_it_gets_alone():
    logits = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    sampler = RowSampler("cpu")
    sampler.set_rows(MIXED, [torch.Generator().manual_seed(row) for row in range(4)])
    together = sampler.sample(logits)
    host = together.to_host()
    for row, params in enumerate(MIXED):
        alone = sample_next_tokens(logits[row : row + 1], [params], [torch.Generator().manual_seed(row)])
        assert host.token_ids[row] == alone.token_ids.item()
        assert host.logprobs[row] == alone.logprobs.item()
        if params.return_entropy:
            assert host.entropies[row] == alone.entropies.item()
    # The one transfer gives what reading each tensor on its own gives.
    assert host.token_ids == together.token_ids.tolist() and host.logprobs == together.logprobs.tolist()
    assert host.entropies == together.entropies.tolist() and host.top_logprobs == together.top_logprobs
    assert [len(top) for top in host.top_logprobs] == [3] * 4 and isinstance(host.top_logprobs[0][0][0], int)
    # Rows leave: the parameters follow the rows.
    sampler.set_rows(MIXED[1:2], [torch.Generator()])
    assert sampler.sample(logits[1:2]).to_host().token_ids == [logits[1].argmax().item()]
    assert sampler.sampled_rows is not None and sampler.sampled_generators == []


class HostReads(TorchFunctionMode):
    """Records every read of a tensor's values by the host (a wait for the device on a GPU), except while paused."""

    READS = {"tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu", "nonzero"}

    def __init__(self):
        super().__init__()
        self.reads, self.paused = [], False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.paused and getattr(func, "__name__", "") in self.READS:
            self.reads.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_a_decode_step_reads_the_device_once(model, tokenizer):
    # Everything a step does around the model's forward pass (which transformers owns): sampling, bookkeeping,
    # rows leaving, stop strings, the prefix cache, the next pass's inputs.
    engine = HFEngine(model=model, tokenizer=tokenizer, max_batch_size=8)
    params = [*MIXED, SamplingParams(temperature=1.0, max_new_tokens=9, seed=5, stop=("zzz", "\n\n"))]
    requests = [_Request(p, s, concurrent.futures.Future(), None) for p, s in zip([*PROMPTS, [7, 7]], params)]
    for request in requests:
        if request.params.seed is not None:
            request.generator = torch.Generator().manual_seed(request.params.seed)
    forward = engine._forward_model
    reads = HostReads()

    def paused_forward():
        model = forward()

        def call(*args, **kwargs):
            reads.paused = True
            try:
                return model(*args, **kwargs)
            finally:
                reads.paused = False

        return call

    engine._forward_model = paused_forward
    steps = 0
    with torch.inference_mode(), engine._forward_mode():
        batch = engine._join(None, requests)
        while batch is not None:
            with reads:
                batch = engine._step(batch)
            steps += 1
    assert steps == 20 and all(r.future.done() for r in requests)
    assert reads.reads == ["tolist"] * steps


def test_a_compute_copy_holds_the_models_weights_cast_and_follows_their_changes():
    model = tiny_llama()
    copy = ComputeCopy(model, torch.bfloat16)
    weights, cast = dict(model.named_parameters()), dict(copy.model.named_parameters())
    assert weights.keys() == cast.keys()
    assert all(torch.equal(cast[name], weight.detach().to(torch.bfloat16)) for name, weight in weights.items())
    assert {p.dtype for p in cast.values()} == {torch.bfloat16} and not any(p.requires_grad for p in cast.values())
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the model itself is untouched
    # Tied embeddings stay tied; the rotary frequencies stay in float32, as a model loaded in bfloat16 keeps them.
    assert copy.model.lm_head.weight is copy.model.model.embed_tokens.weight
    assert copy.model.model.rotary_emb.inv_freq.dtype == torch.float32
    ids = torch.tensor([[3, 1, 4, 1, 5, 9, 2, 6]])
    with torch.inference_mode():
        exact = model(input_ids=ids).logits
        loaded = tiny_llama().to(torch.bfloat16)  # the same weights, loaded in bfloat16
        loaded.model.rotary_emb.inv_freq = model.model.rotary_emb.inv_freq
        assert torch.equal(copy.model(input_ids=ids).logits, loaded(input_ids=ids).logits)
        assert (copy.model(input_ids=ids).logits.float() - exact).abs().max() < 0.05
    assert not copy.refresh()  # nothing changed
    # An optimiser step in place, then a load: each reaches the copy at the next refresh.
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.add_(0.5)
    assert copy.refresh() and not copy.refresh()
    assert torch.equal(
        copy.model.model.layers[0].mlp.down_proj.weight,
        weights["model.layers.0.mlp.down_proj.weight"].to(torch.bfloat16),
    )
    model.load_state_dict({"model.norm.weight": torch.full((32,), 2.0)}, strict=False)
    assert copy.refresh() and torch.equal(copy.model.model.norm.weight, torch.full((32,), 2.0, dtype=torch.bfloat16))


async def test_the_engine_generates_from_its_compute_copy_after_every_weight_change(model, tokenizer):
    # A float32 model generating in bfloat16 gets a bfloat16 copy; here a float32 copy stands in, so that
    # generating from it must give exactly what the model itself gives, before and after changes.
    assert HFEngine(model=model, tokenizer=tokenizer).compute_copy is None  # CPU default: the model's dtype
    assert HFEngine(model=model, tokenizer=tokenizer, compute_dtype=torch.bfloat16).compute_copy is not None
    own = HFEngine(model=model, tokenizer=tokenizer)
    copied = HFEngine(model=model, tokenizer=tokenizer)
    copied.compute_copy = ComputeCopy(model, torch.float32)
    passes = {"model": 0, "copy": 0}
    hooks = [
        model.register_forward_hook(lambda *_: passes.__setitem__("model", passes["model"] + 1)),
        copied.compute_copy.model.register_forward_hook(lambda *_: passes.__setitem__("copy", passes["copy"] + 1)),
    ]
    name = "model.layers.1.mlp.up_proj.weight"
    original = model.state_dict()[name].clone()
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=4)

    async def both():
        a, b = await own.generate(PROMPTS[0], params), await copied.generate(PROMPTS[0], params)
        assert (a.token_ids, a.logprobs) == (b.token_ids, b.logprobs)
        return a

    try:
        before = await both()
        with copied.forward_lock, torch.no_grad():
            model.get_parameter(name).mul_(3.0)  # an optimiser step on the shared model
        changed = await both()
        assert changed.logprobs != before.logprobs
        await copied.update_weights({name: original})
        assert (await copied.generate(PROMPTS[0], params)).logprobs == before.logprobs
        assert passes["copy"] == 3 * 6 and passes["model"] == 2 * 6  # 6 passes a request; the model ran for `own` only
    finally:
        for hook in hooks:
            hook.remove()
        with torch.no_grad():
            model.get_parameter(name).copy_(original)
        await own.close()
        await copied.close()


def test_the_whole_mask_gives_the_logits_of_the_padding_mask(model, tokenizer):
    # What a GPU engine passes to sdpa instead of the padding mask, checked here on a CPU.
    engine = HFEngine(model=model, tokenizer=tokenizer, prefix_cache_tokens=0)
    logits = {}
    with torch.inference_mode(), engine._forward_mode():
        for whole in (False, True):
            engine._whole_mask = whole
            requests = [_Request(p, SamplingParams(temperature=0), concurrent.futures.Future(), None) for p in PROMPTS]
            batch = engine._join(None, requests)  # rows of 3 to 11 tokens: padding
            logits[whole] = engine._step(batch).logits
    assert (logits[True] - logits[False]).abs().max() < 1e-5


# ---- stop strings in a tail window --------------------------------------------------------------


def full_text_stop(tokenizer, ids, stops):
    """The answer of the whole text's search, as HFEngine computed it before the tail window."""
    text = tokenizer.decode(ids, skip_special_tokens=True)
    match = find_stop(text, stops)
    return None if match is None else (match[0], text[match[1] :])


def first_stops(tokenizer, ids, stops):
    """Each prefix's answer, tail window and whole text, until the first stop."""
    for end in range(1, len(ids) + 1):
        tail, full = completion_stop(tokenizer, ids[:end], stops), full_text_stop(tokenizer, ids[:end], stops)
        assert tail == full, (end, stops)
        if full is not None:
            return end, full
    return None


def test_a_stop_found_in_the_tail_window_is_the_one_the_whole_text_has(tokenizer):
    text = (
        "Le café coûte 3 € — 東京の天気は晴れ 🌤️ and the agent said: <search>who wrote Hamlet</search>\n\n"
        "Then   spaces,\ttabs, emojis 🐍🐍 and naïve façades. " * 3
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = [tokenizer.decode([i]) for i in ids]
    assert any("\ufffd" in piece for piece in pieces)  # characters split over byte tokens
    rng = random.Random(0)
    for _ in range(40):  # stops that span token boundaries, at every depth of the text
        start = rng.randrange(len(text) - 12)
        stops = (text[start : start + rng.randrange(2, 12)], "nowhere at all")
        found = first_stops(tokenizer, ids, stops)
        assert found is not None and found[1][0] == stops[0]
    assert first_stops(tokenizer, ids, ("</search>", "\n\n"))[1] == ("</search>", "")
    # Random ids: special tokens (skipped, no text), lone bytes of multi-byte characters, long tokens.
    found = 0
    for seed in range(20):
        rng = random.Random(seed)
        noise = [rng.randrange(len(tokenizer)) for _ in range(200)]
        stops = tuple({tokenizer.decode(noise[k : k + 3])[1:-1] for k in (60, 150)} - {""})
        found += stops != () and first_stops(tokenizer, noise, stops) is not None
    assert found >= 15


async def test_a_stop_spanning_token_boundaries_ends_the_completion_where_the_whole_text_search_did(model, tokenizer):
    # No prefix cache: the second request would prefill its last prompt token alone, and a one-row product
    # rounds differently from the whole prompt's on some CPUs (AMD EPYC's MKL: one log-prob 1 ulp off).
    engine = HFEngine(model=model, tokenizer=tokenizer, prefix_cache_tokens=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=80, seed=7)
    try:
        free = await engine.generate(PROMPTS[0], params)
        text = tokenizer.decode(free.token_ids)
        # Two characters before and after a token boundary past the 50th token (the window holds about 20),
        # where the stop string occurs first.
        for boundary in range(50, len(free.token_ids) - 1):
            head = tokenizer.decode(free.token_ids[:boundary])
            stop = text[len(head) - 2 : len(head) + 2]
            if text.startswith(head) and stop.isprintable() and text.find(stop) == len(head) - 2:
                break
        end, (matched, overshoot) = first_stops(tokenizer, free.token_ids, (stop,))
        done = await engine.generate(PROMPTS[0], dataclasses.replace(params, stop=(stop,)))
    finally:
        await engine.close()
    assert len(free.token_ids) == 80 and end == boundary + 1  # the token after the boundary completes it
    assert done.token_ids == free.token_ids[:end] and done.logprobs == free.logprobs[:end]
    assert (done.finish_reason, done.stop_reason, done.stop_overshoot) == ("stop", matched, overshoot)
