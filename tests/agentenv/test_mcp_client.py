"""MCP servers' tools as agentenv tools, against the real server of mcp_server.py over stdio and streamable HTTP."""

import json
import socket
import subprocess
import sys
import time
import uuid
import warnings
from pathlib import Path

import psutil
import pytest

import agentenv
import agentenv.mcp_client
from agentenv import MCPHttpServer, MCPStdioServer, ToolEnv, mcp_tools
from agentenv.datasets import Example
from agentenv.testing import EnvCheckError, check_env

SERVER_FILE = Path(__file__).with_name("mcp_server.py")
STDIO = MCPStdioServer(sys.executable, [str(SERVER_FILE)])
TASK = Example("count", "How many hops?", ("3",))
INCR_SCHEMA = {
    "type": "object",
    "properties": {
        "key": {"title": "Key", "type": "string"},
        "by": {"default": 1, "title": "By", "type": "integer"},
    },
    "required": ["key"],
    "title": "incrArguments",
}
NAME = "MCP server `agentenv-test`"
LOST = (
    "the connection to the server was lost (the server process exited or closed the connection); "
    "its tools are unavailable until the next episode"
)


@pytest.fixture(scope="module")
def http_url():
    """The test server over streamable HTTP on a free loopback port (its counters are shared by all sessions)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, str(SERVER_FILE), "http", str(port)])
    deadline = time.monotonic() + 30
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, "the HTTP test server did not start"
            time.sleep(0.05)
    yield f"http://127.0.0.1:{port}/mcp"
    process.terminate()
    process.wait(10)


@pytest.fixture(params=["stdio", "http"])
def server(request):
    return STDIO if request.param == "stdio" else MCPHttpServer(request.getfixturevalue("http_url"))


def counter_env(fork="replay", **options):
    """A one-task ToolEnv over the server's tools (builds in milliseconds, unlike the QA envs' index)."""
    return ToolEnv([TASK], mcp_tools(STDIO, fork=fork, **options), require_boxed=False)


def test_the_servers_schemas_and_descriptions_come_through(server):
    tools = {t.name: t for t in mcp_tools(server, fork="replay")}
    assert list(tools) == ["incr", "get", "media", "fail", "crash", "sleep"]
    incr = tools["incr"]
    assert incr.parameters == INCR_SCHEMA
    assert incr.description == "Add `by` to the counter `key` and return its new value."
    assert incr.schema["function"]["parameters"] == INCR_SCHEMA
    assert incr.primary_parameter == "key"
    assert tools["sleep"].parameters["properties"] == {"seconds": {"title": "Seconds", "type": "number"}}
    assert tools["get"].description == "The value of the counter `key` (0 if it was never incremented)."
    assert (incr.stateful, incr.fn.fork_policy) == (True, "replay")
    incr.fn.close()


async def test_a_call_returns_the_servers_text(server):
    tools = {t.name: t for t in mcp_tools(server, fork="share")}
    key = f"calls-over-{'stdio' if server is STDIO else 'http'}"
    assert await tools["incr"].acall({"key": key, "by": "2"}) == f"{key}=2"  # the server coerces "2"
    assert await tools["get"].acall({"key": key}) == f"{key}=2"
    assert await tools["media"].acall({"key": key}) == f"{key}=2\n[image content]\nnote on {key}"
    tools["incr"].fn.close()


def test_an_error_result_and_a_timeout_are_observations(server):
    env = ToolEnv([TASK], mcp_tools(server, fork="replay", timeout_s=0.5))
    env.reset()
    assert env.step("<fail>no key</fail>")[0] == (
        f"Error: {NAME}, tool `fail`: the tool reported an error: Error executing tool fail: refused: no key"
    )
    assert env.step('<incr>{"key": "k", "by": "many"}</incr>')[0].startswith(
        f"Error: {NAME}, tool `incr`: the tool reported an error: Error executing tool incr: 1 validation error"
    )
    obs, reward, terminated, truncated, _ = env.step("<sleep>30</sleep>")
    assert obs == (
        f"Error: {NAME}, tool `sleep`: no answer within 0.5 s; the call was cancelled and its session closed "
        "(a server stuck on it would hold up every later call); the next call opens a new session, which first "
        "replays the 2 earlier calls of this episode"
    )
    assert (reward, terminated, truncated) == (0.0, False, False)
    assert env.step("<sleep>0</sleep>")[0] == "slept 0.0"  # a new session
    env.close()


def test_a_crash_of_the_server_is_an_observation_until_the_next_episode():
    env = counter_env()
    env.reset()
    assert env.step("<incr>k</incr>")[0] == "k=1"
    assert env.step("<crash>4</crash>")[0] == f"Error: {NAME}, tool `crash`: {LOST}"
    not_called = (
        f"Error: {NAME}, tool `get`: not called: the connection to the server was lost earlier in this episode "
        "(it reconnects at the next episode)"
    )
    assert env.step("<get>k</get>")[0] == not_called
    lost_fork = env.fork()  # replaying the parent's calls would crash its server too: it starts lost
    assert lost_fork.step("<get>k</get>")[0] == not_called
    env.reset()
    assert env.step("<get>k</get>")[0] == "k=0"  # a new process, fresh counters
    env.close()
    lost_fork.close()


def test_replay_forks_see_the_branch_point_and_diverge():
    env = counter_env()
    env.reset()
    assert env.step("<incr>a</incr>")[0] == "a=1"
    assert env.step('<incr>{"key": "a", "by": 2}</incr>')[0] == "a=3"
    child = env.fork()
    assert env.step("<incr>a</incr>")[0] == "a=4"  # the parent moves on after the branch point
    assert child.step("<get>a</get>")[0] == "a=3"  # its own session, where the two calls before the fork were replayed
    assert child.step("<incr>a</incr>")[0] == "a=4"
    grandchild = child.fork()  # replays the parent's two calls and the child's one
    assert grandchild.step("<incr>a</incr>")[0] == "a=5"
    assert child.step("<get>a</get>")[0] == "a=4"
    assert env.step("<get>a</get>")[0] == "a=4"
    for e in (env, child, grandchild):
        e.close()


def test_two_forks_at_one_point_are_independent_and_each_has_one_session():
    env = counter_env()
    env.reset()
    assert env.step("<incr>a</incr>")[0] == "a=1"
    twin_a, twin_b = env.fork(), env.fork()
    assert twin_a.step("<incr>a</incr>")[0] == "a=2"
    assert twin_a.step("<get>a</get>")[0] == "a=2"  # all the server's tools of a fork call one session
    assert twin_b.step("<get>a</get>")[0] == "a=1"
    assert env.step("<get>a</get>")[0] == "a=1"
    for e in (env, twin_a, twin_b):
        e.close()


def test_share_forks_see_each_others_effects_and_warn_once():
    env = counter_env(fork="share")
    env.reset()
    assert env.step("<incr>a</incr>")[0] == "a=1"
    message = (
        "the MCP tools of server `agentenv-test` were made with fork='share': forks of the environment share "
        "one server session, so branches see each other's effects"
    )
    with pytest.warns(UserWarning) as record:
        child = env.fork()
    assert [str(w.message) for w in record] == [message]
    assert child.step("<incr>a</incr>")[0] == "a=2"
    assert env.step("<get>a</get>")[0] == "a=2"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = env.fork()
    second.close()  # the others keep the session
    assert child.step("<get>a</get>")[0] == "a=2"
    child.reset()  # a new episode leaves the shared session
    assert child.step("<get>a</get>")[0] == "a=0"
    assert env.step("<get>a</get>")[0] == "a=2"
    env.close()
    child.close()


def test_refuse_forks_raise_and_check_env_says_why():
    env = counter_env(fork="refuse")
    env.reset()
    assert env.step("<incr>a</incr>")[0] == "a=1"
    with pytest.raises(RuntimeError) as raised:
        env.fork()
    assert str(raised.value) == (
        "the MCP tool `incr` of server `agentenv-test` was made with fork='refuse': the server's state cannot be "
        "copied, so this environment cannot be forked. Make the tools with mcp_tools(..., fork='replay') to give "
        "each fork its own session that replays the episode's calls, or fork='share' to let forks share one session."
    )
    assert env.step("<get>a</get>")[0] == "a=1"  # the failed fork left the episode as it was
    with pytest.raises(EnvCheckError) as failed:
        check_env(env, skip_gymnasium=True)
    assert str(failed.value) == (
        "ToolEnv: fork() must give an independent copy\n  fork_policy='refuse' is declared by tools `incr`, `get`, "
        "`media`, `fail`, `crash`, `sleep` (state that cannot be forked), so fork() raises; give it a policy that "
        "forks to check the env"
    )
    env.close()


@pytest.mark.slow
def test_check_env_passes_with_replay_and_notes_share():
    counting = ["<incr>a</incr>", "<incr>a</incr>", "<get>a</get>", "<answer>3</answer>"]
    replay = counter_env()
    check_env(replay, actions=counting, skip_gymnasium=True)
    replay.close()
    share = counter_env(fork="share")
    with pytest.warns(UserWarning) as record:
        check_env(share, actions=counting, skip_gymnasium=True)
    note = (
        "ToolEnv: fork_policy='share' is declared by tools `incr`, `get`, `media`, `fail`, `crash`, `sleep` "
        "(forks share its state): fork results are not checked for independence"
    )
    assert note in [str(w.message) for w in record]
    share.close()


def test_mcp_tools_in_a_multihop_qa_episode():
    env = agentenv.make("multihop-qa", tools=mcp_tools(STDIO, fork="replay"))
    obs, _ = env.reset(options={"index": 0})
    assert "- <incr> key </incr>: Add `by` to the counter `key` and return its new value." in obs
    assert env.stop_strings == ["</search>", "</incr>", "</get>", "</media>", "</fail>", "</crash>", "</sleep>"]
    assert env.step("<think>Count the hops.</think>\n<incr>hops</incr>")[0] == "hops=1"
    assert env.step("<search>Kiss and Tell 1945 Shirley Temple</search>")[0].startswith("Page 1: Kiss and Tell")
    assert env.step('<incr>{"key": "hops", "by": 2}</incr>')[0] == "hops=3"
    obs, reward, terminated, truncated, info = env.step("<answer>\\boxed{Chief of Protocol}</answer>")
    assert (obs, reward, terminated, truncated, info["tool_calls"]) == ("", 1.0, True, False, 3)
    env.close()


def test_mcp_tools_in_a_tool_qa_episode_with_json_calls():
    env = agentenv.make("tool-qa", parser="json", tools=mcp_tools(STDIO, fork="replay"))
    obs, _ = env.reset(options={"index": 0})
    assert '{"type": "function", "function": {"name": "incr", "description": "Add `by` to the counter' in obs
    call = '<tool_call>{"name": "incr", "arguments": {"key": "hops", "by": 2}}</tool_call>'
    assert env.step(call)[0] == "hops=2"
    assert env.step('<tool_call>{"name": "get", "arguments": {"key": "hops"}}</tool_call>')[0] == "hops=2"
    assert env.step('<tool_call>{"name": "python", "arguments": {"code": "print(6 * 7)"}}</tool_call>')[0] == "42"
    search = '<tool_call>{"name": "search", "arguments": {"query": "Kiss and Tell 1945"}}</tool_call>'
    assert env.step(search)[0].startswith("Page 1: Kiss and Tell")
    answer = "<think>Found it.</think><answer>\\boxed{Chief of Protocol}</answer>"  # AEPO's format: a <think> pair
    obs, reward, terminated, truncated, _ = env.step(answer)
    assert (obs, terminated, truncated) == ("", True, False) and reward == pytest.approx(1.1)  # AEPO: both tools
    env.close()


def test_bad_servers_and_options_fail_at_mcp_tools():
    with pytest.raises(ConnectionError) as raised:
        mcp_tools(MCPStdioServer("/nonexistent/mcp-server"), fork="replay")
    assert str(raised.value) == (
        "MCP server `/nonexistent/mcp-server`: could not connect to the server: FileNotFoundError: "
        "[Errno 2] No such file or directory: '/nonexistent/mcp-server'"
    )
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    with pytest.raises(ConnectionError, match=r"could not connect to the server: ConnectError: All connection"):
        mcp_tools(f"http://127.0.0.1:{port}/mcp", fork="share")
    with pytest.raises(ValueError, match="fork must be one of 'replay', 'share', 'refuse', got 'copy'"):
        mcp_tools(STDIO, fork="copy")
    with pytest.raises(ValueError, match="an MCP server URL starts with http:// or https://, got 'ftp://x'"):
        mcp_tools("ftp://x", fork="share")
    with pytest.raises(
        TypeError, match=r"args is a sequence of arguments, got the string 'server.py': pass \['server.py'\]"
    ):
        MCPStdioServer("python", "server.py")


async def test_a_stdio_server_starts_when_sys_stderr_has_no_file_descriptor(monkeypatch):
    # pytest's capture and some notebooks replace sys.stderr with a stream the subprocess cannot inherit
    import io

    monkeypatch.setattr(sys, "stderr", io.StringIO())
    tools = {t.name: t for t in mcp_tools(STDIO, fork="share")}
    assert await tools["incr"].acall({"key": "no-fileno"}) == "no-fileno=1"
    tools["incr"].fn.close()


# -- hostile servers (mcp_hostile_server.py): wedged sessions, endless listings, floods, leaked processes ----------

HOSTILE_FILE = Path(__file__).with_name("mcp_hostile_server.py")
HOSTILE = "MCP server `hostile`"


def hostile(mode, *extra):
    """A hostile server, and the token that marks its process (see :func:`processes_of`)."""
    token = f"token-{uuid.uuid4().hex}"
    return MCPStdioServer(sys.executable, [str(HOSTILE_FILE), mode, token, *extra]), token


def processes_of(token):
    """The pids of the server marked with ``token`` and of every process it started."""
    pids = []
    for process in psutil.process_iter(["cmdline"]):
        if token in (process.info["cmdline"] or []):
            pids += [process.pid, *(child.pid for child in process.children(recursive=True))]
    return pids


def alive(pid):
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def json_env(tools, **options):
    return ToolEnv([TASK], tools, parser="json", require_boxed=False, **options)


def call(name, **arguments):
    return f'<tool_call>{{"name": "{name}", "arguments": {json.dumps(arguments)}}}</tool_call>'


def test_a_timed_out_session_is_closed_and_the_next_call_reconnects_and_replays():
    # Before: the session stayed open, stuck behind the call, and every later call of the episode timed out too.
    server, token = hostile("hang")
    env = json_env(mcp_tools(server, fork="replay", timeout_s=0.5))
    env.reset()
    assert env.step(call("incr", key="k"))[0] == "k=1"
    assert env.step(call("incr", key="k"))[0] == "k=2"
    stuck = processes_of(token)
    assert env.step(call("hang"))[0] == (
        f"Error: {HOSTILE}, tool `hang`: no answer within 0.5 s; the call was cancelled and its session closed "
        "(a server stuck on it would hold up every later call); the next call opens a new session, which first "
        "replays the 2 earlier calls of this episode"
    )
    assert env.step(call("get", key="k"))[0] == "k=2"  # a new server process, the episode's state replayed
    assert env.step(call("incr", key="k"))[0] == "k=3"
    fork = env.fork()  # the timed-out call is not replayed in a fork either
    assert fork.step(call("get", key="k"))[0] == "k=3"
    env.close()
    fork.close()
    assert [pid for pid in stuck if alive(pid)] == []


def test_a_timeout_under_share_reconnects_without_replaying():
    server, _ = hostile("hang")
    env = json_env(mcp_tools(server, fork="share", timeout_s=0.5))
    env.reset()
    assert env.step(call("incr", key="k"))[0] == "k=1"
    assert env.step(call("hang"))[0] == (
        f"Error: {HOSTILE}, tool `hang`: no answer within 0.5 s; the call was cancelled and its session closed "
        "(a server stuck on it would hold up every later call); the next call opens a new session"
    )
    assert env.step(call("get", key="k"))[0] == "k=0"  # a new process: nothing to replay under "share"
    env.close()


async def test_a_large_result_comes_back_whole():
    server, _ = hostile("hang")
    tools = {t.name: t for t in mcp_tools(server, fork="share")}
    result = await tools["big"].acall({"n": 3_000_001})  # many reads of the pipe make one line
    assert (len(result), set(result)) == (3_000_001, {"x"})
    assert await tools["get"].acall({"key": "k"}) == "k=0"
    tools["big"].fn.close()


@pytest.mark.parametrize("crash", [False, True], ids=["server-alive", "server-crashed"])
def test_no_process_of_the_server_outlives_env_close(crash):
    # Before: the `sleep` that a tool started lived on under PID 1, whether the server was alive or crashed.
    server, token = hostile("hang")
    env = json_env(mcp_tools(server, fork="replay"))
    env.reset()
    child = int(env.step(call("spawn"))[0])
    pids = processes_of(token)
    assert child in pids and all(alive(pid) for pid in pids)
    if crash:
        psutil.Process(pids[0]).kill()  # the server dies; its child stays in its process group
        assert env.step(call("get", key="k"))[0] == f"Error: {HOSTILE}, tool `get`: {LOST}"
    env.close()
    assert [pid for pid in pids if alive(pid)] == []


def test_a_rejected_make_ends_the_server_and_its_children():
    # Before: make() raised, and the server (and its child) were still alive 10 s later.
    server, token = hostile("answer")
    tools = mcp_tools(server, fork="replay")
    pids = processes_of(token)
    assert len(pids) == 2 and all(alive(pid) for pid in pids)  # the server and the `sleep` it started
    with pytest.raises(ValueError, match=r"^tool name 'answer' is used twice \(or is the reserved `answer`\)$"):
        agentenv.make("multihop-qa", tools=tools)
    assert [pid for pid in pids if alive(pid)] == []


def test_an_endless_listing_stops_at_max_tools_with_a_warning():
    # Before: mcp_tools never returned, its memory growing.
    server, _ = hostile("endless")
    with pytest.warns(UserWarning) as record:
        tools = mcp_tools(server, fork="share", max_tools=5)
    assert [t.name for t in tools] == ["tool_0", "tool_1", "tool_2", "tool_3", "tool_4"]
    assert [str(w.message) for w in record] == [
        f"{HOSTILE}: what enters the prompt is capped: it lists more than 5 tools; the first 5 are used "
        "(max_tools). mcp_tools(max_tools=, max_description_chars=, max_schema_chars=) raise the caps"
    ]
    tools[0].fn.close()


def test_endless_empty_pages_fail_after_the_page_cap(monkeypatch):
    monkeypatch.setattr(agentenv.mcp_client, "MAX_LIST_PAGES", 30)  # the default, 1000, takes a few seconds
    server, token = hostile("empty-pages")
    with pytest.raises(ConnectionError) as raised:
        mcp_tools(server, fork="share")
    assert str(raised.value) == (
        f"{HOSTILE}: could not list the tools: the listing did not end within 30 pages (the server gives a next "
        "cursor every time; 0 tools so far)"
    )
    assert processes_of(token) == []


def test_a_listing_that_outlasts_its_deadline_fails():
    server, token = hostile("slow-pages")  # half a second a page, without end
    with pytest.raises(ConnectionError) as raised:
        mcp_tools(server, fork="share", connect_timeout_s=5)
    assert str(raised.value) == f"{HOSTILE}: could not list the tools within 5 s"
    assert processes_of(token) == []


def test_descriptions_schemas_and_tool_count_are_capped_in_the_prompt():
    # Before: the 100,000-character description and the 2,000-property schema entered the prompt whole.
    server, _ = hostile("flood")
    with pytest.warns(UserWarning) as record:
        tools = mcp_tools(server, fork="share", max_tools=2)
    assert [str(w.message) for w in record] == [
        f"{HOSTILE}: what enters the prompt is capped: it lists more than 2 tools; the first 2 are used (max_tools); "
        "the descriptions of `long` are cut to 2048 characters (max_description_chars); `wide` is left out: an "
        "input schema over 4096 characters (max_schema_chars). mcp_tools(max_tools=, max_description_chars=, "
        "max_schema_chars=) raise the caps"
    ]
    assert [t.name for t in tools] == ["long"]
    assert tools[0].description == "x" * 2047 + "…"
    env = ToolEnv([TASK], tools)
    env.reset()
    assert len(env.state.prompt) < 3000
    env.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing over the caps: no warning
        tools = mcp_tools(server, fork="share", max_description_chars=100_000, max_schema_chars=100_000)
    assert [(t.name, len(t.description), len(t.parameters["properties"])) for t in tools] == [
        ("long", 100_000, 0),
        ("wide", 7, 2000),
        ("ok", 17, 0),
    ]
    tools[0].fn.close()


def test_a_server_without_tools_is_not_left_running():
    # Before: no tool held the listing's session, so nothing ever closed it.
    server, token = hostile("none")
    assert mcp_tools(server, fork="share") == []
    assert processes_of(token) == []


@pytest.mark.parametrize("name", ["", "a b", "<x>", "a/b", "x" * 129])
def test_a_tool_name_the_model_cannot_write_is_refused(name):
    # Before: the tools were accepted, shown in the prompt and callable.
    server, token = hostile("name", name)
    with pytest.raises(ValueError) as raised:
        mcp_tools(server, fork="share")
    assert str(raised.value) == (
        f"{HOSTILE}: tool name {name!r} is not valid: a tool name is 1 to 128 ASCII letters, digits, '_', '-' or '.' "
        "(the model writes it as a tag, <name>…</name>)"
    )
    assert processes_of(token) == []


def test_a_tool_env_refuses_a_tool_name_the_model_cannot_write():
    @agentenv.tool(name="look up")
    def look_up(term: str) -> str:
        """Look a term up."""
        return term

    with pytest.raises(ValueError) as raised:
        ToolEnv([TASK], [look_up])
    assert str(raised.value) == (
        "tool name 'look up' is not valid: a tool name is 1 to 128 ASCII letters, digits, '_', '-' or '.' "
        "(the model writes it as a tag, <name>…</name>)"
    )
    dotted = agentenv.tool(name="notes.read-v2")(look_up.fn)  # MCP's names: dots and hyphens
    assert list(ToolEnv([TASK], [dotted]).tools) == ["notes.read-v2"]
