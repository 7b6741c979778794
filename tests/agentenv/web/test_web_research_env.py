"""web-research: search, browse the offline web, answer; forks, SSRF from the model, rewards, backends."""

import pytest

import agentenv
from agentenv.envs.web import WebResearchEnv
from agentenv.serve.hosting import BackgroundServer
from agentenv.serve.retrieval import RetrievalService
from agentenv.serve.web import LOCAL_WEB_URL, LocalWebSearch
from agentenv.testing import check_env

QUESTION_0 = "Who was president of the United States in the year that Citibank was founded?"
KISS_AND_TELL = f"{LOCAL_WEB_URL}/wiki/Kiss_and_Tell_(1945_film)"


@pytest.fixture(scope="module")
def env():
    return agentenv.make("web-research")


def test_defaults_bamboogle_offline_web_search_and_browse(env):
    assert isinstance(env, WebResearchEnv) and isinstance(env.backend, LocalWebSearch)
    assert len(env.tasks) == 125 and env.stop_strings == ["</search>", "</browse>"]
    obs, info = env.reset(options={"index": 0})
    assert info["question"] == QUESTION_0 and info["answers"] == ["james madison"]
    assert "- <search> query </search>: Search the web; each result shows a title, its URL and a snippet." in obs
    assert "- <browse> url </browse>: Open a web page (http or https) and read its text." in obs
    assert env.browser.aliases and env.browser.allow_private_urls is False


def test_search_then_browse_the_offline_web_end_to_end(env):
    env.reset(options={"index": 0})
    obs, reward, terminated, truncated, info = env.step("<search>Kiss and Tell 1945 film Corliss Archer</search>")
    assert obs.startswith(
        f"Page 1: Kiss and Tell (1945 film)\nURL: {KISS_AND_TELL}\nKiss and Tell is a 1945 American "
        "comedy film starring then 17-year-old Shirley Temple as Corliss Archer."
    )
    assert obs.count("\nURL: http://wiki.local/wiki/") == 10  # AEPO: top-10 results, snippets of ~300 characters
    obs, *_ = env.step(f"<think>Open it.</think><browse>{KISS_AND_TELL}</browse>")
    assert obs.startswith(f"Title: Kiss and Tell (1945 film) - Offline Wiki\nURL: {KISS_AND_TELL}\nPage 1 of 1\n\n")
    assert f"starring then 17-year-old [Shirley Temple]({LOCAL_WEB_URL}/wiki/Shirley_Temple) as Corliss Archer" in obs
    obs, *_ = env.step(
        f'<browse>{{"url": "{LOCAL_WEB_URL}/wiki/Shirley_Temple", "find": "Chief of Protocol"}}</browse>'
    )
    assert obs.startswith(f"Title: Shirley Temple - Offline Wiki\nURL: {LOCAL_WEB_URL}/wiki/Shirley_Temple\n")
    assert '1 match for "Chief of Protocol" (1 page):\n[page 1] …' in obs
    obs, *_ = env.step(f'<browse>{{"url": "{LOCAL_WEB_URL}/wiki/Shirley_Temple", "page": 3}}</browse>')
    assert obs == "Error: page 3 does not exist: this document has 1 page"
    obs, *_, info = env.step(f"<browse>{LOCAL_WEB_URL}/wiki/No_Such_Article</browse>")
    assert obs == f"Error: HTTP 404 Not Found: {LOCAL_WEB_URL}/wiki/No_Such_Article"
    assert info["tool_calls"] == 5


def test_the_model_cannot_reach_other_local_addresses(env, closed_port):
    env.reset(options={"index": 0})
    assert env.step("<browse>file:///etc/passwd</browse>")[0] == (
        "Error: only http:// and https:// URLs can be opened, not file: (file:///etc/passwd)"
    )
    assert env.step(f"<browse>http://127.0.0.1:{closed_port}/admin</browse>")[0] == (
        f"Error: http://127.0.0.1:{closed_port}/admin points to the private or local address 127.0.0.1; "
        "only public web addresses can be opened"
    )
    assert env.step("<browse>http://169.254.169.254/latest/meta-data/</browse>")[0].startswith(
        "Error: http://169.254.169.254/latest/meta-data/ points to the private or local address"
    )


def test_forks_browse_the_same_pages(env):
    env.reset(options={"index": 0})
    env.step("<search>Shirley Temple</search>")
    a, b = env.fork(), env.fork()
    obs_a = a.step(f"<browse>{KISS_AND_TELL}</browse>")[0]
    obs_b = b.step(f"<browse>{KISS_AND_TELL}</browse>")[0]
    assert obs_a == obs_b and obs_a.startswith("Title: Kiss and Tell (1945 film)")
    assert a.browser is b.browser is env.browser  # one page cache for the whole tree
    assert len(a.state.history()) == len(b.state.history()) == 2 and len(env.state.history()) == 1


def test_rewards_f1_by_default_and_the_aepo_bonus():
    env = agentenv.make("web-research")
    env.reset(options={"index": 0})
    assert env.step("<answer>\\boxed{President James Madison}</answer>")[1] == pytest.approx(0.8)  # F1: 2 of 3 words
    # AEPO's released rule (ATPO's deep_research_em.compute_score) with search and browse as its two tools.
    aepo = agentenv.make("web-research", reward="aepo")

    def answer_after(calls, answer):
        aepo.reset(options={"index": 0})
        for call in calls:
            aepo.step(f"<think>look it up</think>{call}")
        return aepo.step(f"<think>found it</think><answer>\\boxed{{{answer}}}</answer>")[1]

    search, browse = "<search>Citibank founded</search>", f"<browse>{LOCAL_WEB_URL}/</browse>"
    assert answer_after([search], "James Madison") == 1.0  # EM, browse not used
    assert answer_after([search], "President James Madison") == 0.0  # EM 0 (F1 0.8) without both tools
    assert answer_after([search, browse], "James Madison") == pytest.approx(1.1)  # both tools: F1 + 0.1
    assert answer_after([search, browse], "President James Madison") == pytest.approx(0.9)  # F1 > 0 suffices
    aepo.reset(options={"index": 0})
    assert aepo.step("<think>x</think><answer>James Madison</answer>")[1] == -1.0  # no \boxed{}: bad format
    aepo.reset(options={"index": 0})
    assert aepo.step("<answer>\\boxed{James Madison}</answer>")[1] == -1.0  # no <think> pair: bad format


def test_json_tool_calls_and_check_env():
    env = agentenv.make("web-research:hotpotqa", parser="json")
    env.reset(options={"index": 0})
    obs = env.step(
        '<tool_call>{"name": "browse", "arguments": {"url": "' + KISS_AND_TELL + '", "page": 1}}</tool_call>'
    )[0]
    assert obs.startswith("Title: Kiss and Tell (1945 film) - Offline Wiki\n")
    check_env(env)


def test_a_retrieval_server_as_the_search_backend(tmp_path, monkeypatch):
    from agentenv.datasets import Paragraph

    monkeypatch.setenv("AGENTENV_CACHE", str(tmp_path))
    service = RetrievalService(
        [
            Paragraph("Citibank", "Citibank was founded in 1812."),
            Paragraph("James Madison", "James Madison was president from 1809 to 1817."),
        ]
    )
    server = BackgroundServer(service.make_app)
    url = server.start()
    try:
        env = agentenv.make("web-research", search=url, topk=1)
        assert env.site is None
        env.reset(options={"index": 0})
        assert env.step("<search>When was Citibank founded?</search>")[0] == (
            "Page 1: Citibank\nCitibank was founded in 1812."
        )
    finally:
        server.stop()


def test_bad_arguments():
    with pytest.raises(ValueError, match=r"make\('web-research'\): topk must be an int >= 1, got 0"):
        agentenv.make("web-research", topk=0)
    with pytest.raises(ValueError, match="unknown search backend 'google'"):
        agentenv.make("web-research", search="google")
