"""The engine contract: SamplingParams validation, Completion shape checks, stop matching."""

import pytest

from agents.engines import Completion, SamplingParams
from agents.engines.base import find_stop, update_then_sync


def test_defaults_are_plain_sampling():
    params = SamplingParams()
    assert (params.temperature, params.top_p, params.top_k, params.max_new_tokens) == (1.0, 1.0, -1, 512)
    assert (params.stop, params.stop_token_ids, params.seed, params.logprobs_topk) == ((), (), None, 0)
    assert not params.greedy and SamplingParams(temperature=0).greedy


def test_lists_become_tuples_so_params_hash():
    params = SamplingParams(stop=["</search>"], stop_token_ids=[2, 7])
    assert params.stop == ("</search>",) and params.stop_token_ids == (2, 7)
    assert hash(params) == hash(SamplingParams(stop=("</search>",), stop_token_ids=(2, 7)))


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -0.1}, "temperature must be a finite number >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_k": 0}, r"top_k must be -1 \(off\) or >= 1"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"stop": ("",)}, "stop strings must be non-empty"),
        ({"stop_token_ids": (-1,)}, "stop_token_ids must be >= 0"),
        ({"logprobs_topk": -1}, "logprobs_topk must be >= 0"),
    ],
)
def test_bad_values_are_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_a_bare_stop_string_is_rejected_not_split_into_characters():
    with pytest.raises(TypeError, match="stop must be a sequence of str"):
        SamplingParams(stop="</search>")
    with pytest.raises(TypeError, match="stop_token_ids must hold only int"):
        SamplingParams(stop_token_ids=(2.0,))


def test_completion_checks_lengths():
    Completion(token_ids=[1, 2], logprobs=[-0.1, -0.2], finish_reason="eos")
    with pytest.raises(ValueError, match="1 logprobs for 2 tokens"):
        Completion(token_ids=[1, 2], logprobs=[-0.1], finish_reason="eos")
    with pytest.raises(ValueError, match="1 token_entropies for 2 tokens"):
        Completion(token_ids=[1, 2], logprobs=[-0.1, -0.2], finish_reason="eos", token_entropies=[0.5])


def test_find_stop_takes_the_earliest_match_and_its_end():
    assert find_stop("a </search> b </python>", ["</python>", "</search>"]) == ("</search>", 11)
    assert find_stop("</sea", ["</search>"]) is None
    assert find_stop("x</search>\n", ["</search>"]) == ("</search>", 10)


async def test_an_engine_without_sleep_mode_says_so_when_asked_to_sleep():
    from agents.engines.scripted import ScriptedEngine

    engine = ScriptedEngine(lambda prompt: [1])
    assert engine.supports_sleep is False
    with pytest.raises(TypeError, match="ScriptedEngine cannot sleep"):
        await engine.sleep(level=2)
    with pytest.raises(TypeError, match="ScriptedEngine cannot sleep"):
        await engine.wake_up()


@pytest.mark.parametrize(
    ("sleep", "supports_sleep", "keep_weights", "expected"),
    [
        (True, True, False, ["sleep 2", "update", "before_wake", "wake_up", "sync"]),
        (True, True, True, ["sleep 1", "update", "before_wake", "wake_up", "sync"]),
        (False, True, False, ["update", "sync"]),  # the trainer keeps the engine awake
        (True, False, False, ["update", "sync"]),  # an engine that cannot sleep is not asked to
    ],
)
async def test_update_then_sync_orders_an_engines_turn_around_a_training_step(
    sleep, supports_sleep, keep_weights, expected
):
    calls = []

    class Receiver:
        def __init__(self):
            self.supports_sleep = supports_sleep

        async def sleep(self, level=1):
            calls.append(f"sleep {level}")

        async def wake_up(self):
            calls.append("wake_up")

    async def update():
        calls.append("update")
        return {"loss": 0.5}

    async def sync():
        calls.append("sync")

    result, seconds = await update_then_sync(
        Receiver(),
        update,
        sync,
        sleep=sleep,
        keep_weights=keep_weights,
        before_wake=lambda: calls.append("before_wake"),
    )
    assert calls == expected and result == {"loss": 0.5} and seconds >= 0
    calls.clear()
    assert (await update_then_sync(None, update, sync, sleep=True, keep_weights=False))[0] == {"loss": 0.5}
    assert calls == ["update", "sync"]  # no engine: the trainer's sync decides what that means
