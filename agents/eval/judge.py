"""The LLM judge of :mod:`agentenv.judge` on an engine of :mod:`agents.engines`.

:func:`engine_ask` turns an engine and its tokenizer into the judge's ``ask``: the prompt as one
user message under the judge model's chat template (ARPO's evaluation sends it the same way, as
one chat message), decoded greedily, the reply decoded without special tokens.
:func:`engine_judge` builds the :class:`~agentenv.judge.Judge` in one call::

    engine = HFEngine("smollm2-135m")  # or OpenAIEngine("http://127.0.0.1:8000", "Qwen2.5-72B-Instruct")
    judge = engine_judge(engine, engine.tokenizer, "smollm2-135m")
    judgement = await judge.judge("Who wrote Hamlet?", ["William Shakespeare"], "Shakespeare")

Each judged answer costs one generation of at most ``max_new_tokens`` tokens on that engine
(the prompt is about 100 tokens plus the question and answers); exact matches, answers already
judged and missing answers cost none (:class:`~agentenv.judge.JudgeStats` counts all of it).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from agentenv.judge import Judge, JudgeReply
from agents.engines.base import Engine, SamplingParams

__all__ = ["DEFAULT_JUDGE_MAX_TOKENS", "engine_ask", "engine_judge"]

# A verdict is a word or two; a reasoning judge (ARPO's parser reads <judgment> tags for them)
# needs more, and greedy decoding ends at the end of the turn anyway.
DEFAULT_JUDGE_MAX_TOKENS = 256


def engine_ask(
    engine: Engine,
    tokenizer: Any,
    *,
    max_new_tokens: int = DEFAULT_JUDGE_MAX_TOKENS,
    temperature: float = 0.0,
) -> Callable[[str], Awaitable[JudgeReply]]:
    """An ``ask(prompt)`` for :class:`~agentenv.judge.Judge` that generates on ``engine``.

    ``tokenizer`` is the judge model's (its chat template frames the prompt as a user turn).
    Decoding is greedy by default, so a cached verdict is the one a new call would give.
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError(
            f"the judge model's tokenizer ({type(tokenizer).__name__}) has no chat template; the judge prompt is a "
            "chat message, so use an instruction-tuned model (or give the tokenizer a chat_template)"
        )
    params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)

    async def ask(prompt: str) -> JudgeReply:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        # The template already holds the special tokens; encoding must not add a second BOS.
        prompt_ids = list(tokenizer.encode(text, add_special_tokens=False))
        completion = await engine.generate(prompt_ids, params)
        reply = tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        return JudgeReply(reply, len(prompt_ids), len(completion.token_ids))

    return ask


def engine_judge(
    engine: Engine,
    tokenizer: Any,
    model: str,
    *,
    max_new_tokens: int = DEFAULT_JUDGE_MAX_TOKENS,
    temperature: float = 0.0,
    **options: Any,
) -> Judge:
    """A :class:`~agentenv.judge.Judge` asking ``engine`` (serving ``model``, the cache key's name).

    ``options`` are the Judge's own (``prompt``, ``timeout``, ``attempts``, ``retry_delay``,
    ``exact_shortcut``, ``unparsable``, ``max_concurrency``, ``cache_file``).
    """
    return Judge(
        engine_ask(engine, tokenizer, max_new_tokens=max_new_tokens, temperature=temperature), model, **options
    )
