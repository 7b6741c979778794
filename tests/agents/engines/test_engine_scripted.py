"""ScriptedEngine replays its script and applies the real engines' stop rules."""

import asyncio

import pytest

from agents.engines import SamplingParams, ScriptedEngine
from agents.engines.scripted import ScriptedTurn


class CharTokenizer:
    """One token per character (id = code point), enough to test text turns and stop strings."""

    def encode(self, text, add_special_tokens=False):
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)


async def test_turns_in_order_then_a_clear_error():
    engine = ScriptedEngine([[5, 6, 7], ScriptedTurn(token_ids=[8], logprobs=[-0.5])])
    first = await engine.generate([1], SamplingParams())
    second = await engine.generate([1, 2], SamplingParams())
    assert (first.token_ids, first.logprobs, first.finish_reason) == ([5, 6, 7], [-1.0, -1.0, -1.0], "eos")
    assert (second.token_ids, second.logprobs) == ([8], [-0.5])
    assert [call[0] for call in engine.calls] == [[1], [1, 2]]
    with pytest.raises(IndexError, match="the script ran out after 2 completions"):
        await engine.generate([1], SamplingParams())


async def test_stop_string_cuts_at_the_completing_token_and_reports_overshoot():
    engine = ScriptedEngine(lambda prompt: "think<search>q</search>\nmore", tokenizer=CharTokenizer())
    done = await engine.generate([1], SamplingParams(stop=("</search>",)))
    assert CharTokenizer().decode(done.token_ids) == "think<search>q</search>"
    assert (done.finish_reason, done.stop_reason, done.stop_overshoot) == ("stop", "</search>", "")

    multi_char = ScriptedEngine([[ord("a"), 0x3E0A]], tokenizer=_MultiCharTokenizer())  # last token is ">\n"
    done = await multi_char.generate([1], SamplingParams(stop=("a>",)))
    assert (done.token_ids, done.stop_overshoot) == ([ord("a"), 0x3E0A], "\n")


class _MultiCharTokenizer(CharTokenizer):
    def decode(self, ids, skip_special_tokens=True):
        return "".join(">\n" if i == 0x3E0A else chr(i) for i in ids)


async def test_stop_ids_eos_and_length():
    engine = ScriptedEngine(lambda prompt: [3, 4, 9, 5], eos_token_ids=[9])
    assert (await engine.generate([1], SamplingParams(stop_token_ids=(4,)))).token_ids == [3, 4]
    eos = await engine.generate([1], SamplingParams())
    assert (eos.token_ids, eos.finish_reason, eos.stop_reason) == ([3, 4, 9], "eos", None)
    cut = await engine.generate([1], SamplingParams(max_new_tokens=2))
    assert (cut.token_ids, cut.finish_reason) == ([3, 4], "length")
    past = await engine.generate([1], SamplingParams(ignore_eos=True, max_new_tokens=4))
    assert (past.token_ids, past.finish_reason) == ([3, 4, 9, 5], "length")


async def test_entropies_and_top_logprobs_only_when_scripted():
    turn = ScriptedTurn(
        token_ids=[3, 4], logprobs=[-0.1, -0.2], token_entropies=0.7, top_logprobs=[[(3, -0.1), (8, -2.0)], [(4, -0.2)]]
    )
    engine = ScriptedEngine(lambda prompt: turn)
    done = await engine.generate([1], SamplingParams(return_entropy=True, logprobs_topk=1))
    assert done.token_entropies == [0.7, 0.7] and done.top_logprobs == [[(3, -0.1)], [(4, -0.2)]]
    bare = ScriptedEngine(lambda prompt: [3])
    with pytest.raises(ValueError, match="give the ScriptedTurn token_entropies="):
        await bare.generate([1], SamplingParams(return_entropy=True))


async def test_latency_overlaps_across_callers():
    engine = ScriptedEngine(lambda prompt: [1], latency_s=0.05)
    tasks = [asyncio.create_task(engine.generate([1], SamplingParams())) for _ in range(50)]
    await asyncio.sleep(0.01)
    # Every call is inside its latency at once: none finished, all registered.
    assert len(engine.calls) == 50 and not any(task.done() for task in tasks)
    assert all(done.token_ids == [1] for done in await asyncio.gather(*tasks))


def test_bad_requests_are_named():
    engine = ScriptedEngine([[1]], vocab_size=10)
    with pytest.raises(ValueError, match="prompt_ids is empty"):
        asyncio.run(engine.generate([], SamplingParams()))
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 10\): \[12\]"):
        asyncio.run(engine.generate([12], SamplingParams()))
    with pytest.raises(ValueError, match="needs exactly one of token_ids or text"):
        ScriptedTurn()
