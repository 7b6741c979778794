"""The LLM judge on an engine: the judge's logic driven by a ScriptedEngine (exact prompts, ids,
verdicts and failures), and the embedded SmolLM2 as a real judge model."""

import pytest

from agentenv.judge import JUDGE_PROMPT, Judgement, parse_verdict
from agents.engines.base import SamplingParams
from agents.engines.scripted import ScriptedEngine
from agents.eval.judge import DEFAULT_JUDGE_MAX_TOKENS, engine_ask, engine_judge

EOS = 0  # the char tokenizer's end-of-turn id


class ChatCharTokenizer:
    """One token per character (id = code point) with a two-tag chat template; id 0 ends a turn."""

    chat_template = "<user>{content}</user><assistant>"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True):
        assert (tokenize, add_generation_prompt, [m["role"] for m in messages]) == (False, True, ["user"])
        return self.chat_template.format(content=messages[0]["content"])

    def encode(self, text, add_special_tokens=False):
        assert add_special_tokens is False
        return [ord(c) for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids if not (skip_special_tokens and i == EOS))


TOK = ChatCharTokenizer()


def scripted_judge(replies, **options):
    """A judge whose model replies ``replies[predicted answer]`` (an exception is raised)."""

    def script(prompt_ids):
        prompt = TOK.decode(prompt_ids)
        answer = prompt.split("Predicted Answer: ")[1].split("\n")[0]
        reply = replies[answer]
        if isinstance(reply, Exception):
            raise reply
        return reply + chr(EOS)

    engine = ScriptedEngine(script, tokenizer=TOK, eos_token_ids=[EOS])
    return engine, engine_judge(engine, TOK, "scripted-judge", retry_delay=0, **options)


async def test_the_engine_gets_arpos_prompt_as_one_chat_turn_decoded_greedily():
    engine, judge = scripted_judge({"Shakespeare": "Correct"})
    judgement = await judge.judge("Who wrote Hamlet?", ["William Shakespeare"], "Shakespeare")
    assert judgement == Judgement("correct", "judge", reply="Correct")
    ((prompt_ids, params),) = engine.calls
    prompt = JUDGE_PROMPT.format(
        question="Who wrote Hamlet?", labeled_answer="William Shakespeare", pred_answer="Shakespeare"
    )
    assert TOK.decode(prompt_ids) == f"<user>{prompt}</user><assistant>"
    assert params == SamplingParams(temperature=0, max_new_tokens=DEFAULT_JUDGE_MAX_TOKENS)
    # Its cost: the prompt's ids and the reply's, end of turn included.
    assert (judge.stats.prompt_tokens, judge.stats.completion_tokens) == (len(prompt_ids), len("Correct") + 1)


async def test_scripted_verdicts_failures_and_cache_through_the_engine():
    engine, judge = scripted_judge(
        {
            "Paris": "Incorrect",
            "the French capital": "<judgment>Correct</judgment>",
            "Lyon": "I cannot tell.",
            "Nice": RuntimeError("CUDA out of memory"),
        }
    )
    items = [
        (f"Capital of France? ({a})", ["Paris, France"], a) for a in ("Paris", "the French capital", "Lyon", "Nice")
    ]
    results = await judge.judge_many([*items, items[1], ("Capital?", ["Paris"], "Paris"), ("Capital?", ["X"], None)])
    assert [(r.verdict, r.source, r.cached) for r in results] == [
        ("incorrect", "judge", False),
        ("correct", "judge", False),
        ("unjudged", "judge", False),  # unparsable: counted apart, never a 0
        ("unjudged", "judge", False),  # the engine failed three times
        ("correct", "judge", True),  # the same question, golds, answer and judge model: one call
        ("correct", "exact", False),
        ("incorrect", "no answer", False),
    ]
    assert results[3].detail == "the judge call failed (3 tries); last: RuntimeError: CUDA out of memory"
    s = judge.stats
    assert (s.requests, s.calls, s.failed_calls, s.cached, s.exact, s.no_answer) == (7, 6, 3, 1, 1, 1)
    assert (s.correct, s.incorrect, s.unjudged) == (3, 2, 2)
    assert len(engine.calls) == 6


async def test_a_reply_cut_by_the_token_limit_is_unjudged():
    engine, judge = scripted_judge({"B": "Correct"}, max_new_tokens=3)
    judgement = await judge.judge("Q?", ["A"], "B")
    assert (judgement.verdict, judgement.reply) == ("unjudged", "Cor")
    assert engine.calls[0][1].max_new_tokens == 3


def test_a_tokenizer_without_chat_template_is_refused():
    class Plain:
        chat_template = None

    with pytest.raises(ValueError, match="the judge model's tokenizer \\(Plain\\) has no chat template"):
        engine_ask(ScriptedEngine([]), Plain())


@pytest.mark.slow  # the real SmolLM2-135M: two or three greedy generations of 4 tokens on CPU
async def test_the_embedded_model_judges_offline_greedily_and_cached():
    from agents.engines.hf import HFEngine
    from agents.models import DEFAULT_MODEL

    engine = HFEngine(DEFAULT_MODEL)
    try:
        judge = engine_judge(engine, engine.tokenizer, DEFAULT_MODEL, max_new_tokens=4)
        first = await judge.judge("What is the capital of France?", ["Paris"], "Lyon")
        again = await judge.judge("What is the capital of France?", ["Paris"], "Lyon")
        other = await judge.judge("What is the capital of Italy?", ["Rome"], "Milan")
    finally:
        await engine.close()
    # The reply is whatever the model says; its verdict follows ARPO's rule on that reply exactly.
    for judgement in (first, other):
        assert judgement.source == "judge" and isinstance(judgement.reply, str)
        assert (judgement.verdict, judgement.detail) == parse_verdict(judgement.reply)
    france_calls = 2 if first.verdict == "unjudged" else 1  # an unjudged verdict is not cached: asked again
    if first.verdict == "unjudged":
        assert again == first  # and greedy decoding says the same
    else:
        assert again == Judgement(first.verdict, "judge", reply=first.reply, cached=True)

    def prompt_tokens(question, gold, answer):
        prompt = JUDGE_PROMPT.format(question=question, labeled_answer=gold, pred_answer=answer)
        text = engine.tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return len(engine.tokenizer.encode(text, add_special_tokens=False))

    assert judge.stats.calls == france_calls + 1
    assert judge.stats.prompt_tokens == france_calls * prompt_tokens(
        "What is the capital of France?", "Paris", "Lyon"
    ) + prompt_tokens("What is the capital of Italy?", "Rome", "Milan")
    assert 0 < judge.stats.completion_tokens <= 4 * judge.stats.calls
