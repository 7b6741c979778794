"""The python tool over a real LocalSandbox, and the python-math and tool-qa environments."""

import json
import subprocess

import pytest

import agentenv
from agentenv.python_tool import PythonSession
from sandboxes import SandboxError


@pytest.fixture
def math_env(tmp_path):
    data = tmp_path / "half.jsonl"
    data.write_text(json.dumps({"problem": "What is 1 divided by 2?", "answer": "\\frac{1}{2}"}) + "\n")
    env = agentenv.make("python-math", data=str(data))
    yield env
    env.close()


def test_python_math_prompt_and_tool(math_env):
    obs, info = math_env.reset(seed=0)
    assert obs.endswith("Problem: What is 1 divided by 2?\n")
    assert "- <python> code </python>: Execute Python code in a persistent session" in obs
    assert math_env.stop_strings == ["</python>"]
    assert math_env.step("<python>import numpy as np\nx = np.arange(5)\nprint('sum', x.sum())\nx.mean()</python>")[
        0
    ] == ("sum 10\nnp.float64(2.0)")
    assert math_env.step("<python>x.max()</python>")[0] == "np.int64(4)"  # the session persists
    assert math_env.step("<python>```python\nx.min()\n```</python>")[0] == "np.int64(0)"  # fences stripped
    err = math_env.step("<python>1/0</python>")[0]
    assert err.startswith("Traceback") and err.endswith("ZeroDivisionError: division by zero")


@pytest.mark.parametrize("answer, reward", [("\\frac{1}{2}", 1.0), ("0.5", 1.0), ("1/2", 1.0), ("0.6", 0.0)])
def test_python_math_grades_by_mathematical_equivalence(math_env, answer, reward):
    math_env.reset(seed=0)
    obs, r, terminated, _, info = math_env.step(f"<answer>The result is \\boxed{{{answer}}}</answer>")
    assert (r, terminated, info["grade"]["math_equal"]) == (reward, True, reward)


def test_fork_mid_episode_branches_the_python_session(math_env):
    math_env.reset(seed=0)
    math_env.step("<python>before = 1</python>")
    branch = math_env.fork()
    assert branch.step("<python>after = 'branch'; before</python>")[0] == "1"
    assert math_env.step("<python>after = 'main'; before</python>")[0] == "1"
    assert branch.step("<python>after</python>")[0] == "'branch'"
    assert math_env.step("<python>after</python>")[0] == "'main'"
    branch.close()
    assert math_env.step("<python>before + 1</python>")[0] == "2"  # closing a fork leaves its parent alive


def test_reset_starts_a_fresh_session_and_close_stops_it(math_env):
    math_env.reset(seed=0)
    math_env.step("<python>secret = 42</python>")
    session = math_env.tools["python"].fn
    old = session.sandbox
    pid = old.pid
    assert pid is not None
    math_env.reset(seed=0)
    assert old.closed and session.sandbox is not old  # a fresh session
    assert math_env.step("<python>secret</python>")[0].endswith("NameError: name 'secret' is not defined")
    pid = session.sandbox.pid
    assert pid is not None
    math_env.close()
    assert subprocess.run(["ps", "-p", str(pid)], capture_output=True).returncode == 1


def test_python_tool_json_form_and_limits(math_env):
    env = agentenv.make("python-math", parser="json", timeout=1.0)
    env.reset(seed=0)
    call = {"name": "python", "arguments": {"code": "print(6 * 7)"}}
    assert env.step(f"<tool_call>{json.dumps(call)}</tool_call>")[0] == "42"
    obs = env.step('<tool_call>{"name": "python", "arguments": {"code": "while True: pass"}}</tool_call>')[0]
    assert "killed: the call exceeded its wall-clock timeout of 1 s" in obs
    obs = env.step('<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>')[0]
    assert obs.startswith("1") and "restarted" in obs  # the next call says the state was lost
    env.close()


def test_tool_qa_offers_search_and_python_with_the_aepo_bonus():
    env = agentenv.make("tool-qa")
    obs, info = env.reset(options={"index": 0})
    assert env.stop_strings == ["</search>", "</python>"]
    assert "<search> query </search>" in obs and "<python> code </python>" in obs
    # AEPO's released reward (ATPO's deep_research_em.compute_score): EM, or F1 + 0.1 with both tools.
    env.step("<think>Search first.</think><search>Kiss and Tell 1945 Shirley Temple</search>")
    answer = "<think>Found it.</think><answer>\\boxed{Chief of Protocol}</answer>"
    only_search = env.fork()
    partly = env.fork()
    assert only_search.step(answer)[1] == 1.0  # right, one tool: EM
    assert partly.step(answer.replace("Chief of", "Head of"))[1] == 0.0  # EM 0, one tool: no F1 credit
    env.step("<python>'Chief of Protocol'.upper()</python>")
    both = env.fork()
    assert env.step(answer)[1] == pytest.approx(1.1)  # right with both tools: F1 + 0.1
    assert both.step(answer.replace("Chief of", "Head of"))[1] == pytest.approx(2 / 3 + 0.1)  # F1 > 0 suffices
    for branch in (env, only_search, partly, both):
        branch.close()


def test_docker_sandbox_without_an_engine_fails_clearly_at_make():
    with pytest.raises(SandboxError, match="DockerSandbox needs a running Docker engine"):
        agentenv.make("python-math", sandbox="docker")
    with pytest.raises(ValueError, match="sandbox must be 'local', 'docker' or a callable"):
        PythonSession("vm")


def _no_bubblewrap(monkeypatch):
    from sandboxes import isolation

    monkeypatch.setattr(isolation.shutil, "which", lambda name, *args, **kwargs: None)
    monkeypatch.setattr(isolation, "_warned", set())
    return isolation


def test_make_passes_isolation_to_the_sandbox(tmp_path):
    from sandboxes import isolation

    bwrap = isolation.shutil.which("bwrap")
    if not (bwrap and isolation.bubblewrap_works(bwrap)):
        pytest.skip("bubblewrap is not usable here")
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"problem": "1+1?", "answer": "2"}) + "\n")
    env = agentenv.make("python-math", data=str(data), isolation="bubblewrap")
    env.reset(seed=0)
    assert env.step("<python>print(6 * 7)</python>")[0] == "42"
    assert env.tools["python"].fn.sandbox.isolation.mode == "bubblewrap"
    env.close()
    env = agentenv.make("tool-qa", isolation="bubblewrap")
    env.reset(seed=0)
    assert env.step("<python>print(6 * 7)</python>")[0] == "42"
    assert env.tools["python"].fn.sandbox.isolation.mode == "bubblewrap"
    env.close()


def test_make_requires_bubblewrap_when_asked_to(monkeypatch):
    _no_bubblewrap(monkeypatch)
    with pytest.raises(SandboxError, match="isolation='bubblewrap' but bwrap is not installed.*apt-get install"):
        agentenv.make("python-math", isolation="bubblewrap")


def test_make_as_root_without_bubblewrap_refuses_unless_unsafe(monkeypatch):
    isolation = _no_bubblewrap(monkeypatch)
    monkeypatch.setattr(isolation, "unreadable_path", lambda python: "/root/.pyenv")
    monkeypatch.setattr(isolation.os, "geteuid", lambda: 0)  # only the choice is made: nothing starts
    with pytest.raises(SandboxError, match="must not run as root without isolation.*isolation='unsafe-process'"):
        agentenv.make("python-math")
    with pytest.warns(RuntimeWarning, match="AS ROOT"):
        env = agentenv.make("python-math", isolation="unsafe-process")
    env.close()


def test_isolation_is_for_local_sandboxes_only():
    with pytest.raises(ValueError, match="isolation='bubblewrap' applies to sandbox='local' only"):
        PythonSession("docker", isolation="bubblewrap")


def test_preimport_is_for_the_sandboxes_the_session_starts():
    with pytest.raises(ValueError, match=r"preimport=\('math',\) applies to sandbox='local' or 'docker' only"):
        PythonSession(lambda: None, preimport=("math",))
