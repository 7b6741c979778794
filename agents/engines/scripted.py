"""A test tool: an engine that replays scripted completions, optionally after a fixed latency.

Unit tests of the rollout loop and the learners use it to drive episodes with known actions,
and the loop-overhead benchmark uses its fixed latency as an ideal engine. It applies the same
stop rules as the real engines to the scripted ids, so a script longer than its stop is cut
where a real engine would have stopped.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from agentenv.wrappers.token_env import skip_special_decoder
from agents.engines.base import Completion, Engine, FinishReason, SamplingParams, find_stop

__all__ = ["ScriptedEngine", "ScriptedTurn"]


@dataclass(frozen=True)
class ScriptedTurn:
    """One scripted completion: token ids or text (encoded with the engine's tokenizer), its
    log-probs (one per token, or one float for every token), and, for requests that ask for
    them, token entropies (likewise) and top log-probs (per token, a list of ``(id, logprob)``)."""

    token_ids: Sequence[int] | None = None
    text: str | None = None
    logprobs: Sequence[float] | float = -1.0
    token_entropies: Sequence[float] | float | None = None
    top_logprobs: Sequence[Sequence[tuple[int, float]]] | None = None

    def __post_init__(self) -> None:
        if (self.token_ids is None) == (self.text is None):
            raise ValueError("a ScriptedTurn needs exactly one of token_ids or text")


class ScriptedEngine(Engine):
    """Returns scripted completions in order, or from ``script(prompt_ids)`` when it is a function.

    ``script`` is an iterable of :class:`ScriptedTurn` (or plain strings / lists of ids), consumed
    one per :meth:`generate` call across all callers, or a function ``prompt_ids -> turn``.
    ``tokenizer`` (anything with ``encode``/``decode``) is needed for text turns and stop
    strings; ``latency_s`` is slept before each answer; ``eos_token_ids`` end a completion like
    a real end-of-sequence token, and so does the end of a scripted turn that no stop, EOS or
    ``max_new_tokens`` cut earlier (``finish_reason="eos"``). ``calls`` records every
    ``(prompt_ids, params)``.
    """

    supports_entropy = True

    def __init__(
        self,
        script: Iterable[ScriptedTurn | str | Sequence[int]]
        | Callable[[list[int]], ScriptedTurn | str | Sequence[int]],
        *,
        tokenizer=None,
        latency_s: float = 0.0,
        eos_token_ids: Iterable[int] = (),
        vocab_size: int = 1 << 31,
    ) -> None:
        if latency_s < 0:
            raise ValueError(f"latency_s must be >= 0, got {latency_s}")
        self._next = script if callable(script) else _cycle_once(script)
        self.tokenizer = tokenizer
        self.latency_s = latency_s
        self.eos_token_ids = frozenset(eos_token_ids)
        self.vocab_size = vocab_size
        self.calls: list[tuple[list[int], SamplingParams]] = []
        self._decode: Callable[[list[int]], str] | None = None

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        ids = self._check_request(prompt_ids, params, self.vocab_size)
        self.calls.append((ids, params))
        turn = _as_turn(self._next(ids))
        if self.latency_s:
            await asyncio.sleep(self.latency_s)
        return self._complete(turn, params)

    def _complete(self, turn: ScriptedTurn, params: SamplingParams) -> Completion:
        token_ids = (
            list(turn.token_ids)
            if turn.token_ids is not None
            else self._tokenizer("text turns").encode(turn.text, add_special_tokens=False)
        )
        logprobs = _per_token(turn.logprobs, len(token_ids), "logprobs")
        reason: FinishReason = "length"
        stop_reason: str | int | None = None
        overshoot = ""
        end = min(len(token_ids), params.max_new_tokens)
        # A stop or end-of-sequence token ends the turn at its position; a stop string before it
        # wins. The prefixes' texts only grow, so the first prefix holding a stop string is found
        # by bisection: O(log n) decodes instead of one per token.
        first_token = next(
            (
                n
                for n, t in enumerate(token_ids[:end], 1)
                if t in params.stop_token_ids or (t in self.eos_token_ids and not params.ignore_eos)
            ),
            None,
        )
        text_end = end if first_token is None else first_token - 1
        match = None
        if params.stop and text_end:
            decode = self._decoder("stop strings")
            low, high = 1, text_end
            if find_stop(decode(token_ids[:high]), params.stop) is None:
                low = high + 1
            while low < high:
                middle = (low + high) // 2
                if find_stop(decode(token_ids[:middle]), params.stop) is None:
                    low = middle + 1
                else:
                    high = middle
            if low <= text_end:
                text = decode(token_ids[:low])
                match = find_stop(text, params.stop)
                assert match is not None
                reason, stop_reason, overshoot, end = "stop", match[0], text[match[1] :], low
        if match is None and first_token is not None:
            token = token_ids[first_token - 1]
            if token in params.stop_token_ids:
                reason, stop_reason, end = "stop", token, first_token
            else:
                reason, end = "eos", first_token
        elif match is None:
            # A script that ends before max_new_tokens ends like an end-of-sequence.
            reason = "length" if end == params.max_new_tokens else "eos"
        top_logprobs = token_entropies = None
        if params.logprobs_topk:
            if turn.top_logprobs is None:
                raise ValueError("the request asks for top log-probs; give the ScriptedTurn top_logprobs=")
            top_logprobs = [list(top[: params.logprobs_topk]) for top in turn.top_logprobs]
            _per_token(top_logprobs, len(token_ids), "top_logprobs")
            top_logprobs = top_logprobs[:end]
        if params.return_entropy:
            if turn.token_entropies is None:
                raise ValueError("the request asks for entropies; give the ScriptedTurn token_entropies=")
            token_entropies = _per_token(turn.token_entropies, len(token_ids), "token_entropies")[:end]
        return Completion(
            token_ids=token_ids[:end],
            logprobs=logprobs[:end],
            finish_reason=reason,
            stop_reason=stop_reason,
            stop_overshoot=overshoot,
            top_logprobs=top_logprobs,
            token_entropies=token_entropies,
        )

    def _decoder(self, purpose: str) -> Callable[[list[int]], str]:
        if self._decode is None:
            self._decode = skip_special_decoder(self._tokenizer(purpose))
        return self._decode

    def _tokenizer(self, purpose: str):
        if self.tokenizer is None:
            raise ValueError(f"ScriptedEngine needs tokenizer= for {purpose}")
        return self.tokenizer


def _per_token(values, n: int, name: str) -> list:
    """``values`` as a list of ``n`` items; one number stands for every token."""
    if isinstance(values, (int, float)):
        return [float(values)] * n
    values = list(values)
    if len(values) != n:
        raise ValueError(f"scripted turn has {len(values)} {name} for {n} tokens")
    return values


def _as_turn(item: ScriptedTurn | str | Sequence[int]) -> ScriptedTurn:
    if isinstance(item, ScriptedTurn):
        return item
    if isinstance(item, str):
        return ScriptedTurn(text=item)
    return ScriptedTurn(token_ids=list(item))


def _cycle_once(script: Iterable) -> Callable[[list[int]], ScriptedTurn | str | Sequence[int]]:
    """A function returning the script's turns one by one, failing clearly when they run out."""
    turns = iter(script)
    served = itertools.count()

    def next_turn(_prompt: list[int]):
        for turn in turns:
            next(served)
            return turn
        raise IndexError(f"the script ran out after {next(served)} completions")

    return next_turn
