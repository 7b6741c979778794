"""The rollout loop's logic, exactly, with a byte-level tokenizer and a scripted engine (no model).

The engine here is a test double: it answers each request with the ids of a scripted action text
(tokenised with a different split than the tokenizer's own, so any re-tokenisation would show),
and records every request it received.
"""

import asyncio
import json
import threading
import time

import numpy as np
import pytest

import agentenv.tools
from agentenv import Env, TokenEnv, ToolEnv, tool
from agentenv.datasets import Example
from agents.engines.base import Completion, Engine, SamplingParams
from agents.rollout import (
    DEFAULT_MAX_PROMPT_TOKENS,
    DEFAULT_MAX_RESPONSE_TOKENS,
    Episode,
    RolloutConfig,
    Trajectory,
    episodes_for,
    run_episode,
    run_episodes,
    stream_episodes,
)
from agents.rollout.tree import RolloutTree

EOS = 2
OFFSET = 10  # byte b has id b + OFFSET
MERGED = {300: "</lookup>"}  # one merged token, as a BPE vocabulary has; encode() never uses it


class ByteTokenizer:
    """Bytes as ids, a chat template of <role>…</role> tags, and one merged token only a sampler emits."""

    all_special_ids = [EOS]
    eos_token_id = EOS

    def encode(self, text, add_special_tokens=False):
        return [b + OFFSET for b in text.encode()]

    def decode(self, ids, skip_special_tokens=False):
        parts = []
        for i in ids:
            if i == EOS:
                parts.append(b"" if skip_special_tokens else b"<eos>")
            elif i in MERGED:
                parts.append(MERGED[i].encode())
            else:
                parts.append(bytes([i - OFFSET]))
        return b"".join(parts).decode(errors="replace")

    def apply_chat_template(self, messages, chat_template=None, tokenize=False, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


TOK = ByteTokenizer()


def lookup(term: str) -> str:
    """Look a term up.

    Args:
        term: what to look up.
    """
    return f"{term} is 42"


TASKS = [Example(id=f"q{i}", question=f"What is x{i}?", answers=("42",)) for i in range(20)]


def make_env(**kwargs) -> TokenEnv:
    defaults = dict(prompt_template="Q: {question}", max_tool_calls=3)
    return TokenEnv(ToolEnv(TASKS, [lookup], **{**defaults, **kwargs}), TOK)


def ids_of(text: str) -> list[int]:
    """How a sampler emits ``text``: bytes, but the closing tag as the single merged token 300."""
    if text.endswith("</lookup>"):
        return TOK.encode(text[: -len("</lookup>")]) + [300]
    return TOK.encode(text)


SEARCH_THEN_ANSWER = ["<lookup>x</lookup>", "<answer> \\boxed{42} </answer>"]


class ScriptEngine(Engine):
    """Replies with the scripted actions in turn (by the number of turns in the prompt); records requests.

    ``script(prompt_text, turn) -> text | BaseException | None``; ``None`` never answers (hangs);
    an exception is raised. ``delay`` seconds of latency per call (``asyncio.sleep``).
    """

    supports_entropy = True

    def __init__(self, script=None, delay=0.0):
        self.script = script or (lambda prompt, turn: SEARCH_THEN_ANSWER[min(turn, 1)])
        self.delay = delay
        self.requests: list[tuple[list[int], SamplingParams]] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.cancelled = 0

    async def generate(self, prompt_ids, params):
        self.requests.append((list(prompt_ids), params))
        prompt = TOK.decode(prompt_ids)
        turn = prompt.count("<result>")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay)
            reply = self.script(prompt, turn)
            if reply is None:
                await asyncio.Event().wait()
            if isinstance(reply, BaseException):
                raise reply
            ids = ids_of(reply)[: params.max_new_tokens]
            logprobs = [-0.5 - 0.01 * k for k in range(len(ids))]
            entropies = [1.0 + 0.01 * k for k in range(len(ids))] if params.return_entropy else None
            finish = "stop" if ids and ids[-1] == 300 else "length" if len(ids) == params.max_new_tokens else "eos"
            return Completion(
                ids, logprobs, finish, stop_reason="</lookup>" if finish == "stop" else None, token_entropies=entropies
            )
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.in_flight -= 1


GREEDY = SamplingParams(temperature=0, max_new_tokens=64)


async def test_one_episode_is_prompt_then_exact_action_and_observation_ids():
    engine = ScriptEngine()
    env = make_env()
    trajectory = await run_episode(engine, Episode(env, options={"index": 3}, key="k"), RolloutConfig(sampling=GREEDY))

    prompt = TOK.encode("<user>Q: What is x3?</user><assistant>")
    action1, action2 = ids_of(SEARCH_THEN_ANSWER[0]), ids_of(SEARCH_THEN_ANSWER[1])
    obs1 = TOK.encode("\n<result>\nx is 42\n</result>\n")
    assert trajectory.status == "terminated" and trajectory.error is None
    assert trajectory.prompt_ids == prompt
    assert trajectory.ids == prompt + action1 + obs1 + action2
    assert trajectory.ids == env.sequence()[0] and trajectory.mask == env.sequence()[1]
    assert action1[-1] == 300 and 300 not in TOK.encode(TOK.decode(action1))  # kept as sampled
    assert trajectory.sampler_logprobs == [None] * len(prompt) + [-0.5 - 0.01 * k for k in range(len(action1))] + [
        None
    ] * len(obs1) + [-0.5 - 0.01 * k for k in range(len(action2))]
    assert trajectory.reward == 1.0 and trajectory.key == "k" and trajectory.index == 0
    assert trajectory.info["question"] == "What is x3?" and trajectory.info["grade"]["em"] == 1.0

    first, second = trajectory.turns
    assert first.action_span == (len(prompt), len(prompt) + len(action1))
    assert first.obs_span == (first.action_span[1], first.action_span[1] + len(obs1))
    assert second.action_span == (first.obs_span[1], first.obs_span[1] + len(action2))
    assert second.obs_ids == [] and second.obs_span == (second.action_span[1],) * 2
    assert (first.finish_reason, first.stop_reason, first.reward) == ("stop", "</lookup>", 0.0)
    assert (second.finish_reason, second.reward) == ("eos", 1.0)
    assert trajectory.response_length == len(action1) + len(obs1) + len(action2)
    assert trajectory.num_action_tokens == len(action1) + len(action2)

    # What the engine was asked: the running id list, never re-encoded, with the env's stop strings.
    (prompt1, params1), (prompt2, params2) = engine.requests
    assert prompt1 == prompt and prompt2 == prompt + action1 + obs1
    assert params1.stop == params2.stop == ("</lookup>",)
    assert params1.max_new_tokens == params2.max_new_tokens == 64
    assert params1.temperature == 0 and params1.seed is None


async def test_stop_strings_of_sampling_params_come_first_and_are_not_repeated():
    engine = ScriptEngine()
    config = RolloutConfig(sampling=SamplingParams(stop=["</answer>", "</lookup>"]))
    await run_episode(engine, Episode(make_env(), options={"index": 0}), config)
    assert engine.requests[0][1].stop == ("</answer>", "</lookup>")


async def test_the_response_budget_caps_generation_and_cuts_the_last_observation():
    prompt_len = len(TOK.encode("<user>Q: What is x0?</user><assistant>"))
    action1 = ids_of(SEARCH_THEN_ANSWER[0])
    budget = len(action1) + 5  # room for five observation tokens after the first action
    engine = ScriptEngine()
    config = RolloutConfig(sampling=SamplingParams(max_new_tokens=100), max_response_tokens=budget)
    trajectory = await run_episode(engine, Episode(make_env(), options={"index": 0}), config)

    assert trajectory.status == "budget"
    assert engine.requests[0][1].max_new_tokens == budget  # min(100, budget)
    assert len(engine.requests) == 1  # nothing left for a second turn
    turn = trajectory.turns[0]
    assert turn.obs_ids == TOK.encode("\n<result>\nx is 42\n</result>\n")[:5]
    assert turn.info["obs_cut"] == len(TOK.encode("\n<result>\nx is 42\n</result>\n")) - 5
    assert trajectory.response_length == budget and len(trajectory.ids) == prompt_len + budget


async def test_a_turn_samples_at_most_what_the_budget_leaves():
    engine = ScriptEngine(script=lambda prompt, turn: "<think>" + "y" * 50)  # never calls a tool
    config = RolloutConfig(sampling=SamplingParams(max_new_tokens=40), max_response_tokens=100)
    trajectory = await run_episode(engine, Episode(make_env(), options={"index": 0}), config)
    asked = [params.max_new_tokens for _, params in engine.requests]
    assert asked[0] == 40
    assert all(n == min(40, 100 - used) for n, used in zip(asked, _used_before_each_turn(trajectory)))
    assert trajectory.status == "budget" and trajectory.response_length == 100


def _used_before_each_turn(trajectory: Trajectory) -> list[int]:
    prompt = len(trajectory.prompt_ids)
    return [turn.action_span[0] - prompt for turn in trajectory.turns]


async def test_a_prompt_over_the_limit_is_an_error_naming_the_limit():
    trajectory = await run_episode(
        ScriptEngine(), Episode(make_env(), options={"index": 0}), RolloutConfig(max_prompt_tokens=10)
    )
    assert trajectory.status == "error" and trajectory.turns == []
    assert "more than max_prompt_tokens=10" in trajectory.error and "tokens" in trajectory.error


async def test_failing_episodes_are_recorded_and_never_stop_the_others():
    def script(prompt, turn):
        if "x1?" in prompt:
            return RuntimeError("engine crashed")
        return SEARCH_THEN_ANSWER[min(turn, 1)]

    class BrokenEnv(Env):
        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            return "Q: broken", {}

        def step(self, action):
            raise OSError("tool server is down")

    episodes = [Episode(make_env(), options={"index": i}) for i in range(4)]
    episodes.insert(2, Episode(TokenEnv(BrokenEnv(), TOK)))
    trajectories = await run_episodes(ScriptEngine(script), episodes, RolloutConfig(concurrency=2))

    assert [t.status for t in trajectories] == ["terminated", "error", "error", "terminated", "terminated"]
    assert trajectories[1].error == "RuntimeError: engine crashed"
    assert trajectories[2].error == "OSError: tool server is down"
    assert [t.reward for t in trajectories] == [1.0, 0.0, 0.0, 1.0, 1.0]
    assert not trajectories[1].ok and trajectories[0].ok


async def test_an_episode_over_its_timeout_is_recorded_and_the_others_finish():
    engine = ScriptEngine(lambda prompt, turn: None if "x2?" in prompt else SEARCH_THEN_ANSWER[min(turn, 1)])
    episodes = [Episode(make_env(), options={"index": i}) for i in range(4)]
    # 2 s: the others finish in milliseconds, with room on a loaded machine (0.2 s timed them out there too)
    trajectories = await run_episodes(engine, episodes, RolloutConfig(episode_timeout=2.0))
    assert [t.status for t in trajectories] == ["terminated", "terminated", "timeout", "terminated"]
    assert trajectories[2].error == "TimeoutError: the episode took longer than episode_timeout=2.0 s"
    assert engine.cancelled == 1 and engine.in_flight == 0


async def test_concurrency_is_bounded_and_reached():
    engine = ScriptEngine(delay=0.01)
    episodes = [Episode(make_env(), options={"index": i}) for i in range(10)]
    trajectories = await run_episodes(engine, episodes, RolloutConfig(concurrency=3))
    assert engine.max_in_flight == 3
    assert all(t.status == "terminated" for t in trajectories)


async def test_results_come_back_in_episode_order_and_stream_in_finishing_order():
    delays = {0: 0.06, 1: 0.0, 2: 0.03}

    class SlowFor(ScriptEngine):
        async def generate(self, prompt_ids, params):
            await asyncio.sleep(delays[int(TOK.decode(prompt_ids).split("x")[1][0])])
            return await super().generate(prompt_ids, params)

    episodes = [Episode(make_env(), options={"index": i}, key=i) for i in range(3)]
    streamed = [t.key async for t in stream_episodes(SlowFor(), episodes)]
    assert streamed == [1, 2, 0]
    ordered = await run_episodes(SlowFor(), episodes)
    assert [t.key for t in ordered] == [0, 1, 2] and [t.index for t in ordered] == [0, 1, 2]


async def test_cancelling_the_caller_cancels_every_running_episode():
    engine = ScriptEngine(lambda prompt, turn: None)  # every request hangs
    episodes = [Episode(make_env(), options={"index": i}) for i in range(6)]
    task = asyncio.create_task(run_episodes(engine, episodes, RolloutConfig(concurrency=4)))
    while engine.in_flight < 4:
        await asyncio.sleep(0.001)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert engine.in_flight == 0 and engine.cancelled == 4 and len(engine.requests) == 4


async def test_closing_the_stream_early_cancels_the_rest():
    engine = ScriptEngine(lambda prompt, turn: SEARCH_THEN_ANSWER[1] if "x0?" in prompt else None)
    episodes = [Episode(make_env(), options={"index": i}) for i in range(3)]
    stream = stream_episodes(engine, episodes)
    first = await anext(stream)
    assert first.index == 0 and engine.in_flight == 2
    await stream.aclose()
    assert engine.in_flight == 0 and engine.cancelled == 2


async def test_seeded_sampling_gives_each_episode_and_turn_its_own_reproducible_seed():
    config = RolloutConfig(sampling=SamplingParams(seed=7))
    engine = ScriptEngine()
    await run_episodes(engine, [Episode(make_env(), options={"index": 0}) for _ in range(2)], config)
    seeds = sorted(params.seed for _, params in engine.requests)
    expected = sorted(
        int(np.random.SeedSequence([7, episode, turn]).generate_state(1)[0])
        for episode in range(2)
        for turn in range(2)
    )
    assert seeds == expected and len(set(seeds)) == 4


async def test_states_at_turn_boundaries_fork_the_episode_where_each_action_was_sampled():
    env = make_env()
    trajectory = await run_episode(ScriptEngine(), Episode(env, options={"index": 5}), RolloutConfig(keep_states=True))
    first, second = trajectory.turns
    assert first.env.sequence()[0] == trajectory.prompt_ids
    assert second.env.sequence()[0] == trajectory.ids[: second.action_span[0]]

    # Resample turn 2 from its state: a wrong answer, without touching the recorded episode.
    obs, reward, terminated, _, info = await second.env.astep(ids_of("<answer> \\boxed{41} </answer>"))
    assert (reward, terminated, info["grade"]["em"]) == (0.0, True, 0.0)
    assert env.sequence()[0] == trajectory.ids and env.unwrapped.state.reward == 1.0

    bare = await run_episode(ScriptEngine(), Episode(make_env(), options={"index": 5}), RolloutConfig())
    assert [t.env for t in bare.turns] == [None, None]  # off by default: a fork may hold a sandbox
    trajectory.close_envs()
    assert [t.env for t in trajectory.turns] == [None, None]


async def test_entropies_and_top_logprobs_are_kept_when_the_engine_gives_them():
    config = RolloutConfig(sampling=SamplingParams(return_entropy=True))
    trajectory = await run_episode(ScriptEngine(), Episode(make_env(), options={"index": 0}), config)
    assert trajectory.turns[0].token_entropies == [1.0 + 0.01 * k for k in range(len(trajectory.turns[0].action_ids))]
    record = trajectory.to_dict()
    assert len(record["token_entropies"]) == len(record["ids"])
    assert [e is None for e in record["token_entropies"]] == [m == 0 for m in record["mask"]]


async def test_to_dict_is_one_json_line_with_ids_mask_logprobs_reward_and_text():
    trajectory = await run_episode(ScriptEngine(), Episode(make_env(), options={"index": 4}, key=("qa", 4, 0)))
    record = json.loads(json.dumps(trajectory.to_dict(TOK)))
    assert record["ids"] == trajectory.ids and record["mask"] == trajectory.mask
    assert [lp is None for lp in record["sampler_logprobs"]] == [m == 0 for m in record["mask"]]
    assert record["reward"] == 1.0 and record["status"] == "terminated" and record["error"] is None
    assert record["question"] == "What is x4?" and record["answers"] == ["42"] and record["id"] == "q4"
    assert record["grade"]["em"] == 1.0 and record["key"] == ["qa", 4, 0]
    assert record["text"] == TOK.decode(trajectory.ids)
    assert record["text"].endswith("<lookup>x</lookup>\n<result>\nx is 42\n</result>\n<answer> \\boxed{42} </answer>")
    assert [t["action_span"] for t in record["turns"]] == [list(t.action_span) for t in trajectory.turns]
    assert [t["tool"] for t in record["turns"]] == ["lookup", None]
    assert "token_entropies" not in record


async def test_a_trajectory_becomes_a_chain_of_a_rollout_tree_with_the_same_training_ids():
    trajectory = await run_episode(
        ScriptEngine(), Episode(make_env(), options={"index": 0}), RolloutConfig(keep_states=True)
    )
    first, second = trajectory.turns
    first.version = 3  # as a worker's engine stamps them; the second turn's weights changed mid-action
    second.token_versions = [4] * (len(second.action_ids) - 1) + [5]
    second.version = 4
    tree = RolloutTree(trajectory.prompt_ids)
    leaf = trajectory.add_to(tree)
    assert leaf.terminal and leaf.reward == 1.0 and leaf.depth == 2
    assert (leaf.parent.version, leaf.parent.token_versions) == (3, None)  # the sampler's weights, as in a tree
    assert (leaf.version, leaf.token_versions) == (4, second.token_versions)
    assert leaf.env is trajectory.turns[1].env and leaf.parent.env is trajectory.turns[0].env
    leaf.advantage = 0.5
    (path,) = tree.paths(advantage="leaf")
    assert path.ids == trajectory.ids and path.mask == trajectory.mask
    assert [lp for lp, m in zip(path.sampler_logprobs, path.mask) if m] == [
        lp for lp in trajectory.sampler_logprobs if lp is not None
    ]

    with pytest.raises(ValueError, match="prompt differs"):
        trajectory.add_to(RolloutTree([1, 2, 3]))


async def test_an_unfinished_trajectory_stays_open_in_the_tree():
    config = RolloutConfig(max_response_tokens=len(ids_of(SEARCH_THEN_ANSWER[0])) + 3)
    trajectory = await run_episode(ScriptEngine(), Episode(make_env(), options={"index": 0}), config)
    tree = RolloutTree(trajectory.prompt_ids)
    node = trajectory.add_to(tree)
    assert trajectory.status == "budget" and not node.terminal and tree.leaves() == []


def test_episodes_for_forks_the_env_once_per_sample():
    env = make_env()
    episodes = episodes_for(env, [3, 5], samples=2, key_prefix="qa")
    assert [e.key for e in episodes] == [("qa", 3, 0), ("qa", 3, 1), ("qa", 5, 0), ("qa", 5, 1)]
    assert [dict(e.options) for e in episodes] == [{"index": 3}, {"index": 3}, {"index": 5}, {"index": 5}]
    assert len({id(e.env) for e in episodes} | {id(env)}) == 5


async def test_every_episode_of_a_concurrent_run_matches_its_own_env_sequence():
    envs = [make_env() for _ in range(12)]
    trajectories = await run_episodes(
        ScriptEngine(delay=0.001),
        [Episode(e, options={"index": i}) for i, e in enumerate(envs)],
        RolloutConfig(concurrency=5),
    )
    for trajectory, env in zip(trajectories, envs):
        assert (trajectory.ids, trajectory.mask) == env.sequence()
        assert f"What is x{trajectory.index}?" in TOK.decode(trajectory.prompt_ids)


def test_bad_arguments_are_refused_with_a_clear_message():
    with pytest.raises(TypeError, match="wrap a text env with TokenEnv"):
        Episode(ToolEnv(TASKS, [lookup]))
    with pytest.raises(ValueError, match="concurrency must be >= 1"):
        RolloutConfig(concurrency=0)
    with pytest.raises(ValueError, match="episode_timeout must be > 0"):
        RolloutConfig(episode_timeout=0)
    with pytest.raises(ValueError, match="max_prompt_tokens and max_response_tokens must be >= 1"):
        RolloutConfig(max_response_tokens=0)
    with pytest.raises(TypeError, match="sampling must be a SamplingParams"):
        RolloutConfig(sampling={"temperature": 0})
    with pytest.raises(ValueError, match="samples must be >= 1"):
        episodes_for(make_env(), [0], samples=0)


async def test_streaming_refuses_something_that_is_not_an_episode():
    with pytest.raises(TypeError, match=r"episodes\[1\] is a dict"):
        await run_episodes(ScriptEngine(), [Episode(make_env()), {"env": make_env()}])


def test_the_papers_token_limits_are_the_defaults():
    config = RolloutConfig()
    assert (config.max_prompt_tokens, config.max_response_tokens) == (
        DEFAULT_MAX_PROMPT_TOKENS,
        DEFAULT_MAX_RESPONSE_TOKENS,
    )
    assert (DEFAULT_MAX_PROMPT_TOKENS, DEFAULT_MAX_RESPONSE_TOKENS) == (2000, 6192)


async def test_take_turn_resumes_an_episode_from_a_kept_state_without_touching_the_original():
    from agents.rollout import take_turn

    trajectory = await run_episode(
        ScriptEngine(), Episode(make_env(), options={"index": 2}), RolloutConfig(keep_states=True)
    )
    second = trajectory.turns[1]
    context = second.env.sequence()[0]
    assert context == trajectory.ids[: second.action_span[0]]

    wrong = ScriptEngine(lambda prompt, turn: "<answer> \\boxed{7} </answer>")
    turn, status = await take_turn(
        wrong,
        second.env.fork(),
        context,
        RolloutConfig(sampling=GREEDY),
        prompt_length=len(trajectory.prompt_ids),
        seed=11,
        max_new_tokens=40,
    )
    assert status == "terminated" and turn.reward == 0.0 and turn.info["grade"]["answer"] == "7"
    assert turn.action_ids == ids_of("<answer> \\boxed{7} </answer>") and len(turn.action_ids) < 40
    assert turn.action_span == (len(context), len(context) + len(turn.action_ids)) and turn.obs_ids == []
    ((prompt, params),) = wrong.requests
    assert prompt == context and (params.seed, params.max_new_tokens) == (11, 40)
    assert trajectory.reward == 1.0 and second.env.sequence()[0] == context  # both untouched


async def test_take_turn_reports_a_used_up_budget_and_refuses_a_turn_beyond_it():
    from agents.rollout import take_turn

    env = make_env()
    prompt, _ = await env.areset(options={"index": 0})
    action = ids_of(SEARCH_THEN_ANSWER[0])
    obs_len = len(TOK.encode("\n<result>\nx is 42\n</result>\n"))
    config = RolloutConfig(max_response_tokens=len(action) + obs_len)  # exactly one call and its result
    turn, status = await take_turn(ScriptEngine(), env, prompt, config, prompt_length=len(prompt))
    assert status == "budget" and len(turn.obs_ids) == obs_len and "obs_cut" not in turn.info
    with pytest.raises(ValueError, match="used its max_response_tokens"):
        await take_turn(ScriptEngine(), env, prompt + action + turn.obs_ids, config, prompt_length=len(prompt))
    with pytest.raises(ValueError, match="max_new_tokens must be >= 1"):
        await take_turn(
            ScriptEngine(), make_env(), prompt, RolloutConfig(), prompt_length=len(prompt), max_new_tokens=0
        )


def test_the_package_exports_the_loop_lazily():
    import agents
    from agents.rollout import run_episodes as direct

    assert agents.run_episodes is direct and "Trajectory" in agents.__all__
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        agents.nope


async def test_the_state_forked_for_a_failing_turn_is_closed():
    closed = []

    class FailingStep(Env):
        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            return "Q: fails", {}

        def step(self, action):
            raise OSError("tool crashed")

        def fork(self):
            child = FailingStep()
            child.close = lambda: closed.append("fork")
            return child

    trajectory = await run_episode(
        ScriptEngine(), Episode(TokenEnv(FailingStep(), TOK)), RolloutConfig(keep_states=True)
    )
    assert trajectory.error == "OSError: tool crashed" and closed == ["fork"]


# -- one tool's failure stays in its episode ---------------------------------------------------

FAILING = {3, 17, 25, 38, 44, 59}  # the episodes (of 60) whose tool call fails or hangs
MANY_TASKS = [Example(id=f"q{i}", question=f"What is x{i}?", answers=("42",)) for i in range(60)]


def env_with(lookup_fn) -> TokenEnv:
    """An env over 60 tasks whose only tool, called `lookup`, is ``lookup_fn`` (a function or a Tool)."""
    return TokenEnv(ToolEnv(MANY_TASKS, [tool(lookup_fn, name="lookup")], prompt_template="Q: {question}"), TOK)


def failing_script(prompt, turn):
    """Episodes in FAILING look up "fail", the others "x"; everyone answers on the next turn."""
    if turn:
        return SEARCH_THEN_ANSWER[1]
    index = int(prompt.split("What is x")[1].split("?")[0])
    return "<lookup>fail</lookup>" if index in FAILING else SEARCH_THEN_ANSWER[0]


def sixty_episodes(lookup_fn) -> list[Episode]:
    return [Episode(env_with(lookup_fn), options={"index": i}) for i in range(60)]


@pytest.mark.parametrize("kind", ["sync", "async"])
async def test_a_tool_raising_cancelled_error_fails_only_its_own_episode(kind):
    def sync_lookup(term: str) -> str:
        """Look a term up.

        Args:
            term: what to look up.
        """
        if term == "fail":
            raise asyncio.CancelledError("the tool's own cancellation")
        return f"{term} is 42"

    async def async_lookup(term: str) -> str:
        """Look a term up.

        Args:
            term: what to look up.
        """
        return sync_lookup(term)

    lookup_fn = sync_lookup if kind == "sync" else async_lookup
    trajectories = await run_episodes(ScriptEngine(failing_script), sixty_episodes(lookup_fn))

    assert len(trajectories) == 60 and all(t.status == "terminated" for t in trajectories)
    for t in trajectories:
        observation = TOK.decode(t.turns[0].obs_ids)
        if t.index in FAILING:  # the failure is the model's observation, as any tool exception is
            assert "Error: the tool `lookup` failed: CancelledError: the tool's own cancellation" in observation
        else:
            assert "x is 42" in observation


async def test_a_cancelled_error_from_the_engine_is_that_episodes_error():
    def script(prompt, turn):
        return asyncio.CancelledError("request aborted") if "x2?" in prompt else SEARCH_THEN_ANSWER[min(turn, 1)]

    trajectories = await run_episodes(
        ScriptEngine(script), [Episode(make_env(), options={"index": i}) for i in range(4)]
    )
    assert [t.status for t in trajectories] == ["terminated", "terminated", "error", "terminated"]
    assert trajectories[2].error == "CancelledError: request aborted"


@pytest.mark.parametrize("blocking", [False, True])
async def test_hanging_sync_tools_time_out_their_episodes_and_never_stall_the_others(blocking):
    release = threading.Event()

    def hanging_lookup(term: str) -> str:
        """Look a term up.

        Args:
            term: what to look up.
        """
        if term == "fail":
            release.wait(10)  # hangs until the test releases it (a sync wait: no await lets the loop run)
        return f"{term} is 42"

    if blocking:
        with pytest.warns(DeprecationWarning, match="blocking"):
            hanging_lookup = tool(hanging_lookup, name="lookup", blocking=True)
    try:
        start = time.perf_counter()
        trajectories = await run_episodes(
            ScriptEngine(failing_script), sixty_episodes(hanging_lookup), RolloutConfig(episode_timeout=1.0)
        )
        elapsed = time.perf_counter() - start
    finally:
        release.set()

    assert len(trajectories) == 60 and elapsed < 3.0
    for t in trajectories:
        if t.index in FAILING:
            assert t.status == "timeout"
            assert t.error == "TimeoutError: the episode took longer than episode_timeout=1.0 s"
        else:
            assert t.status == "terminated" and t.reward == 1.0 and t.seconds < 0.5


async def test_abandoned_hung_calls_leave_the_tool_threads_to_the_next_episodes(monkeypatch):
    # The probe's case: 6 hung calls filled the loop's default executor (6 workers on 2 cores), and
    # every later call waited behind them. With 6 tool threads, 6 hung calls fill them just the same.
    monkeypatch.setattr(agentenv.tools, "_THREADS", agentenv.tools._ToolThreads(6))
    release = threading.Event()

    def hanging_lookup(term: str) -> str:
        """Look a term up.

        Args:
            term: what to look up.
        """
        if term == "fail":
            release.wait(10)
        return f"{term} is 42"

    try:
        config = RolloutConfig(episode_timeout=0.5)
        hung = await run_episodes(
            ScriptEngine(failing_script),
            [Episode(env_with(hanging_lookup), options={"index": i}) for i in FAILING],
            config,
        )
        others = [Episode(env_with(hanging_lookup), options={"index": i}) for i in range(60) if i not in FAILING]
        trajectories = await run_episodes(ScriptEngine(failing_script), others, config)
    finally:
        release.set()
    assert [t.status for t in hung] == ["timeout"] * 6
    # Behind the hung calls an episode would wait their 10 s and time out at 0.5 s; no bound on its own time,
    # which a loaded machine stretches.
    assert len(trajectories) == 54 and all(t.status == "terminated" for t in trajectories)


async def test_cancelling_the_caller_during_tool_calls_still_cancels_the_run():
    release, entered = threading.Event(), []

    def hanging_lookup(term: str) -> str:
        """Look a term up.

        Args:
            term: what to look up.
        """
        entered.append(term)
        release.wait(10)
        return f"{term} is 42"

    async def async_hanging_lookup(term: str) -> str:
        """Look a term up.

        Args:
            term: what to look up.
        """
        entered.append(term)
        await asyncio.Event().wait()
        return f"{term} is 42"

    try:
        for lookup_fn in (hanging_lookup, async_hanging_lookup):
            entered.clear()
            episodes = [Episode(env_with(lookup_fn), options={"index": i}) for i in range(6)]
            task = asyncio.create_task(run_episodes(ScriptEngine(), episodes, RolloutConfig(concurrency=4)))
            while len(entered) < 4:
                await asyncio.sleep(0.001)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert len(entered) == 4
    finally:
        release.set()
