import asyncio
import json

import gymnasium
import pytest

import agentenv
from agentenv import ToolError, tool
from agentenv.testing import check_env
from agentenv.tool_env import ECHO_WORDS

QUESTION_0 = "What government position was held by the woman who portrayed Corliss Archer in the film Kiss and Tell?"


@pytest.fixture(scope="module")
def env():
    return agentenv.make("multihop-qa")


def test_reset_poses_a_question_with_the_tool_syntax(env):
    obs, info = env.reset(options={"index": 0})
    assert obs.endswith(f"Question: {QUESTION_0}\n")
    assert "- <search> query </search>: Search for passages relevant to a query." in obs
    assert "at most 6 times" in obs and "<answer> \\boxed{Beijing} </answer>" in obs
    assert info == {
        "id": "5a8c7595554299585d9e36b6",
        "question": QUESTION_0,
        "answers": ["Chief of Protocol"],
        "turn": 0,
        "tool_calls": 0,
    }
    assert env.stop_strings == ["</search>"]


def test_seeded_reset_is_reproducible(env):
    a = env.reset(seed=7)[1]["question"]
    b = env.reset(seed=7)[1]["question"]
    c = env.reset(seed=8)[1]["question"]
    assert a == b != c


def test_search_step_then_answer(env):
    env.reset(options={"index": 0})
    obs, reward, terminated, truncated, info = env.step(
        f"<think>Find the actress.</think>\n<search>{QUESTION_0}</search>"
    )
    assert obs.startswith(
        "Page 1: Kiss and Tell (1945 film)\nKiss and Tell is a 1945 American comedy film starring then 17-year-old Shirley Temple"
    )
    assert obs.count("Page ") == 3
    obs_search = obs
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert (info["turn"], info["tool_calls"], info["tool"], info["error"]) == (1, 1, "search", None)
    obs, reward, terminated, truncated, info = env.step("<answer>She was \\boxed{Chief of Protocol}</answer>")
    assert (obs, reward, terminated, truncated) == ("", 1.0, True, False)
    assert info["grade"] == {
        "answer": "Chief of Protocol",
        "format_ok": True,
        "em": 1.0,
        "f1": 1.0,
        "cover_em": 1.0,
        "token_cover_em": 1.0,
        "reward": 1.0,
        "in_results": False,  # right, but not from the search: none of its three passages names her office
        "equals_example": False,
        "echoes_question": False,
    }
    assert "protocol" not in obs_search.lower()
    with pytest.raises(RuntimeError, match="the episode is over"):
        env.step("<answer>\\boxed{x}</answer>")


def test_step_before_reset_and_wrong_types():
    fresh = agentenv.make("multihop-qa")
    with pytest.raises(RuntimeError, match=r"call reset\(\) before step\(\)"):
        fresh.step("<search>x</search>")
    fresh.reset(seed=0)
    with pytest.raises(TypeError, match=r"an action is the text of one model turn \(str\), got list"):
        fresh.step([1, 2])
    with pytest.raises(ValueError, match=r"options\['index'\] must be an int in \[0, 500\), got 500"):
        fresh.reset(options={"index": 500})


def test_malformed_calls_are_observations_not_exceptions(env):
    env.reset(options={"index": 0})
    obs, reward, terminated, truncated, info = env.step("<search>unclosed")
    assert obs == "The <search> tag was opened but never closed: write <search>…</search>."
    assert (reward, terminated, truncated, info["tool_calls"], info["turn"]) == (0.0, False, False, 0, 1)
    obs, *_ = env.step("<browse>http://example.com</browse>")
    assert obs.startswith("There is no tool called <browse>.")
    obs, *_ = env.step("I do not know.")
    assert obs.startswith("No tool call or answer was found in your turn.")


def test_tool_call_limit_then_turn_limit():
    env = agentenv.make("multihop-qa", max_tool_calls=2)
    assert env.max_turns == 4
    env.reset(options={"index": 0})
    for _ in range(2):
        assert env.step("<search>Shirley Temple</search>")[0].startswith("Page 1:")
    obs, reward, terminated, truncated, info = env.step("<search>Shirley Temple</search>")
    assert obs == (
        "You have reached the limit of 2 tool calls; this call was not run. "
        "Give your final answer now, inside <answer> and </answer>."
    )
    assert (terminated, truncated, info["tool_calls"]) == (False, False, 2)
    obs, reward, terminated, truncated, info = env.step("<search>again</search>")
    assert (reward, terminated, truncated) == (0.0, False, True)  # 4 turns: truncated, graded as unanswered
    assert info["grade"]["format_ok"] is False


def test_format_penalty_and_aepo_rewards():
    env = agentenv.make("multihop-qa", reward="at2po", max_turns=1)
    env.reset(options={"index": 0})
    assert env.step("<answer>Chief of Protocol</answer>")[1] == -1.0  # no \boxed{}: bad format
    env.reset(options={"index": 0})
    assert env.step("<search>x</search>")[1:4] == (-1.0, False, True)  # truncated without an answer
    # ATPO deep_research_em.py validate_format: no <think>…</think> pair is a bad format too
    env.reset(options={"index": 0})
    assert env.step("<answer>\\boxed{Chief of Protocol}</answer>")[1] == -1.0
    env.reset(options={"index": 0})
    assert env.step("<think>I know.</think><answer>\\boxed{Chief of Protocol}</answer>")[1] == 1.0
    env = agentenv.make("multihop-qa", reward="f1")
    env.reset(options={"index": 0})
    # "protocol chief officer" vs "chief of protocol": 2 common words of 3 each -> F1 = 2/3
    assert env.step("<answer>\\boxed{Protocol chief officer}</answer>")[1] == pytest.approx(2 / 3)


@pytest.mark.parametrize(
    "env_id, index, f1",
    [
        # hotpotqa/hotpot hotpot_evaluate_v1.py: gold "yes", answer "yes, it is" -> F1 0
        ("multihop-qa", 250, 0.0),
        # Alab-NII/2wikimultihop 2wikimultihop_evaluate_v1.1.py: the same rule
        ("multihop-qa:2wiki", 11, 0.0),
        # NQ's F1 is SQuAD's: gold "Yes" (one of four), "yes, it is": P=1/3, R=1 -> 0.5
        ("singlehop-qa:nq", 395, 0.5),
    ],
)
def test_each_dataset_is_graded_with_its_official_f1(env_id, index, f1):
    env = agentenv.make(env_id, reward="f1")
    env.reset(options={"index": index})
    reward, _, _, info = env.step("<answer>\\boxed{yes, it is}</answer>")[1:]
    assert (reward, info["grade"]["f1"]) == (pytest.approx(f1), pytest.approx(f1))
    squad = agentenv.make(env_id, reward="f1", f1="squad")  # the choice can be made by hand
    squad.reset(options={"index": index})
    assert squad.step("<answer>\\boxed{yes, it is}</answer>")[1] == pytest.approx(0.5)


@pytest.mark.parametrize(
    "rows_as, f1, expected",
    [
        ("official", None, 0.0),  # hotpot_evaluate_v1.py: gold "no", "no, it is not" -> 0
        ("official", "squad", 0.4),  # chosen by hand: SQuAD's F1, 1 common word of 4 and of 1: P=1/4, R=1
        ("plain", None, 0.4),  # the same rows in a format that names no benchmark: SQuAD's
    ],
)
def test_a_data_file_is_graded_with_the_f1_its_format_implies(tmp_path, rows_as, f1, expected):
    # Before: a user's official-format HotpotQA file was graded with SQuAD's F1 (the shipped data's
    # format decided, not the file's): 52 of 1,992 graded variants differed from the official script.
    rows = [json.loads(line) for line in agentenv.datasets.builtin_path("hotpotqa-official").read_text().splitlines()]
    if rows_as == "plain":
        rows = [{"question": r["question"], "answers": [r["answer"]]} for r in rows]
    data = tmp_path / "dev.json"
    data.write_text(json.dumps(rows))  # the official release is one JSON list
    env = agentenv.make("multihop-qa", data=str(data), reward="f1", **({"f1": f1} if f1 else {}))
    env.reset(options={"index": 8})
    assert env.state.task.answers == ("no",)
    reward, _, _, info = env.step("<answer>\\boxed{no, it is not}</answer>")[1:]
    assert (reward, info["grade"]["f1"]) == (pytest.approx(expected), pytest.approx(expected))


def test_a_grader_given_to_the_env_is_used_as_it_is():
    calls = []

    def grader(response, answers):
        calls.append(response)
        return agentenv.graders.grade(response, answers, f1="squad")

    env = agentenv.make("multihop-qa", reward="f1", grader=grader)
    env.reset(options={"index": 250})
    assert env.step("<answer>\\boxed{yes, it is}</answer>")[1] == 0.5 and calls == ["\\boxed{yes, it is}"]


def test_search_r1_answer_format_is_what_the_prompt_asks_for():
    env = agentenv.make("multihop-qa", reward="at2po", require_boxed=False)
    obs, _ = env.reset(options={"index": 0})
    assert "for example <answer> Beijing </answer>.\n" in obs and "boxed" not in obs
    assert env.step("<answer> Chief of Protocol </answer>")[1] == 1.0  # the tag's content is the answer
    env.reset(options={"index": 0})
    assert env.step("<answer> \\boxed{Chief of Protocol} </answer>")[1] == 1.0  # a box is still read
    env.reset(options={"index": 0})
    assert env.step("<answer>  </answer>")[1] == -1.0  # empty: no answer


def test_example_shows_a_worked_episode_in_the_graded_format():
    plain = agentenv.make("multihop-qa").reset(options={"index": 0})[0]
    assert "Example:" not in plain  # the papers' prompt: no demonstration
    obs = agentenv.make("multihop-qa", example=True).reset(options={"index": 0})[0]
    example = obs[obs.index("Example:\n") : obs.index(f"Question: {QUESTION_0}")]
    assert example.startswith("Example:\nQuestion: In which country was the director of the film Amélie born?\n")
    assert example.count("<search>") == 2 and example.count("<result>\nPage 1: ") == 2
    assert example.endswith("<answer> \\boxed{France} </answer>\n")
    assert obs.replace(example, "") == plain
    unboxed = agentenv.make("multihop-qa", example=True, require_boxed=False).reset(options={"index": 0})[0]
    assert "<answer> France </answer>\nQuestion: " in unboxed
    own = agentenv.make("multihop-qa", example="Question: 1+1?\n<answer> \\boxed{2} </answer>")
    assert "Example:\nQuestion: 1+1?\n<answer> \\boxed{2} </answer>\nQuestion: " in own.reset(options={"index": 0})[0]
    with pytest.raises(ValueError, match=r"example= needs a prompt_template with an \{example\} field"):
        agentenv.make("multihop-qa", example=True, prompt_template="Q: {question}")


def test_the_grade_says_whether_the_answer_was_found_or_copied_from_the_example():
    env = agentenv.make("multihop-qa", example=True, require_boxed=False, topk=1, result_chars=300)
    assert env.unwrapped.example_answer == "france"  # SEARCH_EXAMPLE's answer, normalised

    def grade(*actions: str) -> dict:
        env.reset(options={"index": 0})
        for action in actions:
            info = env.step(action)[4]
        return {key: info["grade"][key] for key in ("em", "in_results", "equals_example")}

    search = f"<search>{QUESTION_0}</search>"  # top-1: "Kiss and Tell is a 1945 American comedy film starring … Shirley Temple"
    assert grade(search, "<answer> Shirley Temple </answer>") == {
        "em": 0.0,
        "in_results": True,
        "equals_example": False,
    }
    assert grade(search, "<answer> the comedy </answer>") == {"em": 0.0, "in_results": True, "equals_example": False}
    # Whole words only: "Temp" is inside "Temple" but is not a word of the result.
    assert grade(search, "<answer> Temp </answer>") == {"em": 0.0, "in_results": False, "equals_example": False}
    # Not searched: nothing was returned, however right the answer.
    assert grade("<answer> Chief of Protocol </answer>") == {"em": 1.0, "in_results": False, "equals_example": False}
    assert grade(search, "<answer> France. </answer>") == {"em": 0.0, "in_results": False, "equals_example": True}
    assert grade(search, "<answer>  </answer>") == {"em": 0.0, "in_results": False, "equals_example": False}
    plain = agentenv.make("multihop-qa", require_boxed=False)
    assert plain.unwrapped.example_answer == ""  # no example: nothing to copy
    plain.reset(options={"index": 0})
    assert plain.step("<answer> France </answer>")[4]["grade"]["equals_example"] is False


def test_the_grade_says_whether_the_answer_repeats_the_question():
    env = agentenv.make("multihop-qa", require_boxed=False)
    assert ECHO_WORDS == 4

    def echoes(answer: str) -> bool:
        env.reset(options={"index": 0})  # QUESTION_0: "What government position was held by the woman who …"
        return env.step(f"<answer> {answer} </answer>")[4]["grade"]["echoes_question"]

    assert echoes(QUESTION_0)
    assert echoes("the government position was held by her")  # 4 of its words in a row
    assert not echoes("government position")  # 2 in a row: a phrase of it, not the question
    assert not echoes("it was held by")  # 3 in a row
    assert not echoes("Chief of Protocol")
    assert not echoes("")


def test_observations_are_truncated():
    env = agentenv.make("multihop-qa", max_obs_chars=50)
    env.reset(options={"index": 0})
    obs = env.step("<search>Shirley Temple</search>")[0]
    assert obs == "Page 1: Shirley Temple\nShirley Temple Black (April\n[… truncated 1145 characters]"


def test_custom_tool_plugs_into_an_environment():
    @tool
    def calculator(expression: str) -> str:
        """Evaluate an arithmetic expression.

        Args:
            expression: Digits and + - * / only.
        """
        if set(expression) - set("0123456789+-*/ ()."):
            raise ToolError("only digits and + - * / are allowed")
        return str(eval(expression))

    env = agentenv.make("multihop-qa", tools=[calculator])
    obs, _ = env.reset(options={"index": 0})
    assert "- <calculator> expression </calculator>: Evaluate an arithmetic expression." in obs
    assert env.stop_strings == ["</search>", "</calculator>"]
    assert env.step("<calculator>6 * 7</calculator>")[0] == "42"
    assert env.step("<calculator>__import__('os')</calculator>")[0] == "Error: only digits and + - * / are allowed"
    check_env(env)


def test_json_tool_call_format():
    env = agentenv.make("multihop-qa", parser="json")
    obs, _ = env.reset(options={"index": 0})
    assert '<tools>\n{"type": "function", "function": {"name": "search"' in obs
    assert env.stop_strings == ["</tool_call>"]
    obs = env.step('<tool_call>{"name": "search", "arguments": {"query": "Kiss and Tell 1945"}}</tool_call>')[0]
    assert obs.startswith("Page 1: Kiss and Tell (1945 film)")
    assert env.step('<tool_call>{"name": "search", "arguments": {"q": "x"}}</tool_call>')[0] == (
        "Error: invalid arguments for `search`: query: Field required; q: Extra inputs are not permitted"
    )
    assert env.step('<tool_call>{"name": "browse", "arguments": {}}</tool_call>')[0] == (
        "There is no tool called `browse`; available tools: search."
    )
    check_env(env)


def test_failing_tool_becomes_an_observation():
    @tool
    def broken(x: str) -> str:
        """Always fails."""
        raise KeyError(x)

    env = agentenv.make("multihop-qa", tools=[broken])
    env.reset(seed=0)
    assert env.step("<broken>k</broken>")[0] == "Error: the tool `broken` failed: KeyError: 'k'"


def test_user_corpus_and_data_overrides(tmp_path):
    data = tmp_path / "qa.jsonl"
    data.write_text('{"question": "Who drums in Rush?", "answers": ["Neil Peart"]}\n')
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(
        '{"title": "Rush", "text": "Neil Peart was the drummer of Rush."}\n'
        '{"title": "Queen", "text": "Roger Taylor drums in Queen."}\n'
    )
    env = agentenv.make("singlehop-qa:nq", data=str(data), corpus=str(corpus), topk=1)
    env.reset(seed=0)
    assert env.step("<search>drummer of Rush</search>")[0] == "Page 1: Rush\nNeil Peart was the drummer of Rush."


def test_singlehop_sets_search_the_pooled_multihop_corpus():
    env = agentenv.make("singlehop-qa:popqa")
    assert len(env.backend.passages) == 9490
    env2 = agentenv.make("multihop-qa:bamboogle")
    assert env2.backend is env.backend  # one index shared in-process


REGISTERED = sorted(agentenv.registry)


def test_the_pooled_env_searches_every_multihop_sets_paragraphs_and_grades_with_hotpotqas_f1():
    env = agentenv.make("multihop-qa:pooled")
    assert len(env.tasks) == 864 and env.tasks[500].question == agentenv.datasets.load_examples("2wiki")[0].question
    own = {
        (p.title, p.text)
        for name in ("hotpotqa", "2wiki", "musique")
        for e in agentenv.datasets.load_examples(name)
        for p in e.paragraphs
    }
    assert len(env.backend.passages) == len(own) == 9293
    assert env.grader.keywords["f1"] == "hotpotqa"


def test_registered_ids():
    assert REGISTERED == [
        "multihop-qa",
        "multihop-qa:2wiki",
        "multihop-qa:bamboogle",
        "multihop-qa:hotpotqa",
        "multihop-qa:musique",
        "multihop-qa:pooled",
        "python-math",
        "python-math:arithmetic",
        "python-math:gsm8k",
        "python-math:math500",
        "singlehop-qa",
        "singlehop-qa:nq",
        "singlehop-qa:popqa",
        "singlehop-qa:triviaqa",
        "tool-qa",
        "web-research",
        "web-research:2wiki",
        "web-research:bamboogle",
        "web-research:hotpotqa",
        "web-research:musique",
        "web-research:nq",
        "web-research:popqa",
        "web-research:triviaqa",
    ]


@pytest.mark.parametrize("env_id", REGISTERED)
def test_check_env_passes_for_every_registered_id(env_id):
    check_env(agentenv.make(env_id))


def test_gymnasium_make():
    env = gymnasium.make("agentenv/multihop-qa")
    obs, info = env.reset(seed=3)
    assert info["question"] in obs
    assert isinstance(env.unwrapped, agentenv.ToolEnv)
    # Gymnasium reads "a:b" as "module:env", so variants use "." there.
    assert agentenv.spec("multihop-qa:2wiki").gymnasium_id == "agentenv/multihop-qa.2wiki"
    env = gymnasium.make("agentenv/multihop-qa.2wiki", max_tool_calls=1)
    assert env.unwrapped.max_tool_calls == 1


async def test_async_steps_do_not_block_each_other():
    """Two episodes whose tool waits on the other: only an event loop that interleaves them finishes."""
    gate = asyncio.Event()

    @tool
    async def wait_for_other(who: str) -> str:
        """Wait until the other episode arrives."""
        if who == "first":
            await gate.wait()
        else:
            gate.set()
        return who

    envs = [agentenv.make("multihop-qa", tools=[wait_for_other]) for _ in range(2)]
    for e in envs:
        await e.areset(seed=0)
    first, second = await asyncio.wait_for(
        asyncio.gather(
            envs[0].astep("<wait_for_other>first</wait_for_other>"),
            envs[1].astep("<wait_for_other>second</wait_for_other>"),
        ),
        timeout=5,
    )
    assert (first[0], second[0]) == ("first", "second")
    with pytest.raises(RuntimeError, match=r"use the async form instead"):
        envs[0].step("<search>x</search>")


def test_unknown_override_is_named():
    with pytest.raises(
        TypeError,
        match=r"make\('multihop-qa'\): ToolEnv.__init__\(\) got an unexpected keyword argument 'max_tool_cals'",
    ):
        agentenv.make("multihop-qa", max_tool_cals=3)
