"""Every option of ``make`` is checked before any work: one line naming the option, the value and what is allowed."""

import numpy as np
import pytest

import agentenv
import agentenv.envs.math
import agentenv.envs.qa
import agentenv.envs.web
from agentenv.datasets import DatasetError, Example
from agentenv.envs.math import MathEnv
from agentenv.envs.qa import QAEnv
from agentenv.envs.web import WebResearchEnv
from agentenv.options import Option, OptionError, OptionTypeError
from agentenv.rewards import REWARD_SCHEMES
from agentenv.tool_env import ToolEnv

QA_OPTIONS = (
    "aliases, corpus, data, dataset, example, f1, grader, max_obs_chars, max_tool_calls, max_turns, parser, "
    "prompt_template, render_mode, require_boxed, result_chars, reward, search, tools, topk, unanswerable"
)
TOOL_QA_OPTIONS = (
    "aliases, corpus, data, dataset, example, f1, grader, isolation, max_obs_chars, max_tool_calls, max_turns, "
    "parser, preimport, prompt_template, render_mode, require_boxed, result_chars, reward, sandbox, search, timeout, "
    "tools, topk, unanswerable"
)
MATH_OPTIONS = (
    "data, dataset, example, isolation, limits, max_obs_chars, max_tool_calls, max_turns, parser, preimport, "
    "prompt_template, render_mode, require_boxed, reward, sandbox, timeout, tools"
)
WEB_OPTIONS = (
    "aliases, allow_private_urls, browse_timeout, cache, corpus, data, dataset, example, grader, max_obs_chars, "
    "max_tool_calls, max_turns, page_chars, parser, prompt_template, render_mode, require_boxed, reward, search, "
    "snippet_chars, tools, topk"
)
REWARDS = list(REWARD_SCHEMES)
ISOLATIONS = "['auto', 'bubblewrap', 'process', 'unsafe-process']"
SEARCH = "the http(s):// URL of a retrieval server, or pass a SearchBackend"


@pytest.fixture
def no_work(monkeypatch):
    """Fail a test that gets as far as loading data or making a sandbox: the checks come first."""

    def reached(*args, **kwargs):
        raise AssertionError("an option was checked after the environment started its work")

    for module in (agentenv.envs.qa, agentenv.envs.math, agentenv.envs.web):
        monkeypatch.setattr(module, "load_examples", reached)
    monkeypatch.setattr(agentenv.envs.qa, "python_tool", reached)
    monkeypatch.setattr(agentenv.envs.math, "python_tool", reached)


# (id, overrides, error class, message after "make('<id>'): ")
CASES = [
    # the cases
    ("multihop-qa", {"topk": "3"}, OptionTypeError, "topk must be an int >= 1, got '3'"),
    ("multihop-qa", {"max_tool_calls": "x"}, OptionTypeError, "max_tool_calls must be an int >= 0, got 'x'"),
    ("multihop-qa", {"topk": "abc"}, OptionTypeError, "topk must be an int >= 1, got 'abc'"),  # --env-arg topk=abc
    ("multihop-qa", {"max_tool_calls": -2}, OptionError, "max_tool_calls must be an int >= 0, got -2"),
    ("multihop-qa", {"topk": True}, OptionTypeError, "topk must be an int >= 1, got True"),  # a bool is not a count
    (
        "multihop-qa",
        {"nosuch": 1},
        OptionTypeError,
        f"ToolEnv.__init__() got an unexpected keyword argument 'nosuch'. Valid options: {QA_OPTIONS}.",
    ),
    # multihop-qa and singlehop-qa (QAEnv), with the options they pass on to ToolEnv
    ("multihop-qa", {"topk": 0}, OptionError, "topk must be an int >= 1, got 0"),
    ("multihop-qa", {"topk": 2.0}, OptionTypeError, "topk must be an int >= 1, got 2.0"),
    ("singlehop-qa", {"result_chars": 0}, OptionError, "result_chars must be an int >= 1, got 0"),
    ("multihop-qa", {"max_turns": 0}, OptionError, "max_turns must be an int >= 1 or None, got 0"),
    ("multihop-qa", {"max_obs_chars": 0}, OptionError, "max_obs_chars must be an int >= 1, got 0"),
    (
        "multihop-qa:2wiki",
        {"unanswerable": "grade"},
        OptionError,
        "unanswerable must be one of ['skip', 'include'], got 'grade'",
    ),
    ("multihop-qa", {"f1": "exact"}, OptionError, "f1 must be one of ['squad', 'hotpotqa'] or None, got 'exact'"),
    (
        "multihop-qa",
        {"parser": "yaml"},
        OptionError,
        "parser must be one of ['xml', 'json'] or a ToolCallParser, got 'yaml'",
    ),
    ("singlehop-qa:nq", {"reward": "bleu"}, OptionError, f"reward must be one of {REWARDS} or a callable, got 'bleu'"),
    ("multihop-qa", {"reward": 1}, OptionTypeError, f"reward must be one of {REWARDS} or a callable, got 1"),
    ("multihop-qa", {"require_boxed": "no"}, OptionTypeError, "require_boxed must be a bool, got 'no'"),
    ("multihop-qa", {"example": 1}, OptionTypeError, "example must be a bool or a string or None, got 1"),
    ("multihop-qa", {"data": 3}, OptionTypeError, "data must be a path or None, got 3"),
    ("multihop-qa", {"grader": "em"}, OptionTypeError, "grader must be a callable or None, got 'em'"),
    ("multihop-qa", {"prompt_template": None}, OptionTypeError, "prompt_template must be a string, got None"),
    ("multihop-qa", {"tools": "search"}, OptionTypeError, "tools must be a list or a tuple, got 'search'"),
    ("multihop-qa", {"tools": [3]}, OptionTypeError, "tools[0] must be a Tool or a callable, got 3"),
    (
        "singlehop-qa",
        {"search": "google"},
        OptionError,
        f"unknown search backend 'google': use 'local' (offline BM25), 'duckduckgo', {SEARCH}",
    ),
    (
        "multihop-qa",
        {"render_mode": "human"},
        OptionError,
        "render_mode='human' is not supported by QAEnv; choose one of ['ansi'] or None",
    ),
    (
        "multihop-qa",
        {"example": True, "prompt_template": "Q: {question}"},
        OptionError,
        "example= needs a prompt_template with an {example} field to put it in",
    ),
    (
        "multihop-qa",
        {"max_tool_cals": 3},
        OptionTypeError,
        "ToolEnv.__init__() got an unexpected keyword argument 'max_tool_cals'. Did you mean 'max_tool_calls'? "
        f"Valid options: {QA_OPTIONS}.",
    ),
    # tool-qa: QAEnv's options and the python tool's
    ("tool-qa", {"sandbox": "vm"}, OptionError, "sandbox must be one of ['local', 'docker'] or a callable, got 'vm'"),
    ("tool-qa", {"timeout": 0}, OptionError, "timeout must be a number > 0, got 0"),
    ("tool-qa", {"isolation": "none"}, OptionError, f"isolation must be one of {ISOLATIONS} or None, got 'none'"),
    ("tool-qa", {"topk": -1}, OptionError, "topk must be an int >= 1, got -1"),
    ("tool-qa", {"max_tool_calls": "6"}, OptionTypeError, "max_tool_calls must be an int >= 0, got '6'"),
    (
        "tool-qa",
        {"sandbx": "local"},
        OptionTypeError,
        "ToolEnv.__init__() got an unexpected keyword argument 'sandbx'. Did you mean 'sandbox'? "
        f"Valid options: {TOOL_QA_OPTIONS}.",
    ),
    # python-math (MathEnv)
    (
        "python-math",
        {"sandbox": "vm"},
        OptionError,
        "sandbox must be one of ['local', 'docker'] or a callable, got 'vm'",
    ),
    ("python-math:gsm8k", {"timeout": -1.5}, OptionError, "timeout must be a number > 0, got -1.5"),
    ("python-math", {"timeout": "5"}, OptionTypeError, "timeout must be a number > 0, got '5'"),
    ("python-math", {"isolation": "none"}, OptionError, f"isolation must be one of {ISOLATIONS} or None, got 'none'"),
    ("python-math", {"limits": {}}, OptionTypeError, "limits must be a Limits or None, got {}"),
    ("python-math", {"max_tool_calls": 1.5}, OptionTypeError, "max_tool_calls must be an int >= 0, got 1.5"),
    ("python-math", {"max_turns": "8"}, OptionTypeError, "max_turns must be an int >= 1 or None, got '8'"),
    ("python-math", {"reward": "bleu"}, OptionError, f"reward must be one of {REWARDS} or a callable, got 'bleu'"),
    (
        "python-math",
        {"example": "Q: 1+1?"},
        OptionError,
        "example= needs a prompt_template with an {example} field to put it in",
    ),
    (
        "python-math",
        {"grader": print},
        OptionTypeError,
        f"MathEnv() got an unexpected keyword argument 'grader'. Valid options: {MATH_OPTIONS}.",
    ),
    # web-research (WebResearchEnv)
    ("web-research", {"topk": 0}, OptionError, "topk must be an int >= 1, got 0"),
    ("web-research:nq", {"snippet_chars": -1}, OptionError, "snippet_chars must be an int >= 1, got -1"),
    ("web-research", {"topk": "10"}, OptionTypeError, "topk must be an int >= 1, got '10'"),
    ("web-research", {"snippet_chars": 1.5}, OptionTypeError, "snippet_chars must be an int >= 1, got 1.5"),
    ("web-research", {"page_chars": 99}, OptionError, "page_chars must be an int >= 100, got 99"),
    ("web-research", {"browse_timeout": 0}, OptionError, "browse_timeout must be a number > 0, got 0"),
    ("web-research", {"cache": "rw"}, OptionError, "cache must be one of ['use', 'record', 'replay', 'off'], got 'rw'"),
    ("web-research", {"allow_private_urls": 1}, OptionTypeError, "allow_private_urls must be a bool, got 1"),
    ("web-research", {"max_obs_chars": -5}, OptionError, "max_obs_chars must be an int >= 1, got -5"),
    (
        "web-research",
        {"search": 3},
        OptionTypeError,
        f"unknown search backend 3: use 'local' (offline BM25), 'duckduckgo', {SEARCH}",
    ),
    (
        "web-research",
        {"top_k": 5},
        OptionTypeError,
        f"ToolEnv.__init__() got an unexpected keyword argument 'top_k'. Did you mean 'topk'? Valid options: {WEB_OPTIONS}.",
    ),
]


@pytest.mark.parametrize(
    "env_id, overrides, error, message", CASES, ids=[f"{c[0]}-{'-'.join(map(str, c[1]))}" for c in CASES]
)
def test_a_bad_option_is_named_with_its_value_before_any_work(no_work, env_id, overrides, error, message):
    with pytest.raises(error) as e:
        agentenv.make(env_id, **overrides)
    assert str(e.value) == f"make({env_id!r}): {message}"
    assert isinstance(e.value, ValueError)  # one `except ValueError` catches every bad option (agents' CLI does)
    assert isinstance(e.value, TypeError) == (error is OptionTypeError)
    assert e.value.option.startswith(next(iter(overrides)))  # for a CLI to say which --env-arg was wrong


def test_an_unknown_option_of_a_plain_environment_lists_the_valid_ones(monkeypatch):
    class Countdown(agentenv.Env):
        def __init__(self, start: int = 3, render_mode: str | None = None) -> None:
            super().__init__(render_mode=render_mode)

    monkeypatch.setattr(agentenv.registration.registry, "_specs", dict(agentenv.registration.registry._specs))
    agentenv.register("countdown-test", Countdown)
    with pytest.raises(OptionTypeError) as e:
        agentenv.make("countdown-test", strat=5)
    assert str(e.value) == (
        "make('countdown-test'): got an unexpected keyword argument 'strat'. Did you mean 'start'? "
        "Valid options: render_mode, start."
    )


@pytest.mark.parametrize("env_id", sorted(agentenv.registry))
def test_every_shipped_environment_refuses_an_unknown_option_before_any_work(no_work, env_id):
    with pytest.raises(OptionTypeError) as e:
        agentenv.make(env_id, nosuch=1)
    message = str(e.value)
    assert message.startswith(f"make({env_id!r}): ToolEnv.__init__() got an unexpected keyword argument 'nosuch'.")
    assert "\n" not in message and " Valid options: " in message and "max_tool_calls" in message


def test_tool_env_checks_its_options_when_built_directly():
    tasks = [Example("q", "Q?", ("a",))]
    with pytest.raises(OptionError) as e:
        ToolEnv(tasks, max_tool_calls=-2)
    assert str(e.value) == "max_tool_calls must be an int >= 0, got -2"
    assert (e.value.option, e.value.value) == ("max_tool_calls", -2)
    with pytest.raises(OptionTypeError, match=r"^max_obs_chars must be an int >= 1, got '6000'$"):
        ToolEnv(tasks, max_obs_chars="6000")
    with pytest.raises(
        OptionError, match=r"^render_mode='human' is not supported by ToolEnv; choose one of \['ansi'\] or None$"
    ):
        ToolEnv(tasks, render_mode="human")
    with pytest.raises(ValueError, match=r"^ToolEnv needs at least one task$"):
        ToolEnv([])
    # what was valid stays valid: numpy integers, None where allowed, zero tool calls
    env = ToolEnv(tasks, max_tool_calls=np.int64(0), max_turns=None, max_obs_chars=np.int32(10), grader=None)
    assert (env.max_tool_calls, env.max_turns, env.max_obs_chars) == (0, 2, 10)


def test_direct_construction_checks_before_any_work(no_work):
    with pytest.raises(OptionTypeError, match=r"^topk must be an int >= 1, got '3'$"):
        QAEnv(topk="3")
    with pytest.raises(OptionError, match=r"^timeout must be a number > 0, got 0$"):
        MathEnv(timeout=0)
    with pytest.raises(OptionError, match=r"^page_chars must be an int >= 100, got 10$"):
        WebResearchEnv(page_chars=10)
    with pytest.raises(OptionTypeError, match=r"^isolation must be one of .* or None, got 1$"):
        agentenv.envs.qa.tool_qa(isolation=1)


def test_the_registered_defaults_and_valid_values_pass_the_checks(no_work):
    for env_id in agentenv.registry:
        spec = agentenv.spec(env_id)
        factory = spec.load()
        if isinstance(factory, type) and factory.__module__.startswith("agentenv."):  # not other tests' envs
            factory.check_options(spec.kwargs)
    QAEnv.check_options({"topk": np.int64(5), "example": None, "f1": None, "search": "https://example.org"})
    MathEnv.check_options({"timeout": 5, "isolation": None, "sandbox": lambda: None, "reward": lambda grade: 1.0})
    WebResearchEnv.check_options({"topk": 1, "snippet_chars": 1, "browse_timeout": 0.5, "page_chars": 100})


def test_option_words_what_is_allowed():
    assert Option(int, minimum=1, optional=True).allowed() == "an int >= 1 or None"
    assert Option(float, minimum=0, exclusive=True).allowed() == "a number > 0"
    assert Option(choices=("a", "b")).allowed() == "one of ['a', 'b']"
    with pytest.raises(OptionError) as e:
        Option(int)("name", "x" * 500)
    assert len(str(e.value)) < 150  # a long value is shortened: the message stays one short line
    assert issubclass(OptionTypeError, TypeError) and issubclass(OptionTypeError, ValueError)


def test_an_empty_data_file_is_called_empty_at_make(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n   \n")
    with pytest.raises(DatasetError) as e:
        agentenv.make("multihop-qa", data=str(path))
    assert str(e.value) == f"{path}: the file is empty; expected one JSON object per line (JSONL) or a JSON list"
