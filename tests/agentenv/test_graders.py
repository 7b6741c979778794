import asyncio
import functools
import json
import threading
import time

import pytest

import agentenv
from agentenv import graders
from agentenv.graders import (
    Grade,
    cover_exact_match,
    exact_match,
    extract_answer,
    extract_boxed,
    f1_score,
    grade,
    math_equal,
    normalize_answer,
)
from agentenv.rewards import REWARD_SCHEMES, call_reward, get_reward


def test_squad_normalisation():
    assert normalize_answer("The  Eiffel-Tower!") == "eiffeltower"
    assert normalize_answer("An apple, a day") == "apple day"
    assert normalize_answer("  Théâtre   du  Soleil ") == "théâtre du soleil"


def test_exact_match_over_several_golds():
    assert exact_match("the Rush", ["Rush", "Rush (band)"]) == 1.0
    assert exact_match("Rush band", ["Rush"]) == 0.0


def test_f1_is_word_level_and_takes_the_best_gold():
    # pred tokens: new york city; gold "new york": P=2/3, R=1 -> F1 = 0.8
    assert f1_score("New York City", ["New York"]) == pytest.approx(0.8)
    assert f1_score("New York City", ["Boston", "new york city"]) == 1.0
    assert f1_score("", ["x"]) == 0.0
    assert f1_score("Paris", ["London"]) == 0.0


def test_cover_em_matches_whole_words_only():
    assert cover_exact_match("It was Barack Obama.", ["Obama"]) == 1.0
    assert cover_exact_match("Obamacare", ["Obama"]) == 0.0
    assert cover_exact_match("anything", ["the"]) == 0.0  # a gold that normalises to nothing never matches


@pytest.mark.parametrize(
    "text, boxed",
    [
        ("x \\boxed{1} y \\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{ Paris }", "Paris"),
        ("\\fbox{42}", "42"),
        ("no box", None),
        ("\\boxed{unclosed", None),
    ],
)
def test_extract_boxed_takes_the_last_balanced_box(text, boxed):
    assert extract_boxed(text) == boxed


def test_extract_answer_formats():
    assert extract_answer("I think \\boxed{Rush}") == "Rush"
    assert extract_answer("Rush") is None
    assert extract_answer("Rush", require_boxed=False) == "Rush"
    assert extract_answer(None) is None


@pytest.mark.parametrize(
    "prediction, gold, equal",
    [
        ("0.5", "\\frac{1}{2}", 1.0),
        ("1/2", "\\frac{1}{2}", 1.0),
        ("1+x^2", "x^2+1", 1.0),
        ("\\left(3, \\frac{\\pi}{2}\\right)", "\\left( 3, \\frac{\\pi}{2} \\right)", 1.0),
        ("Evelyn", "\\text{Evelyn}", 1.0),
        ("18.0", "18", 1.0),
        ("7", "8", 0.0),
        ("", "8", 0.0),
    ],
)
def test_math_equal(prediction, gold, equal):
    assert math_equal(prediction, [gold]) == equal


def test_math_grade_and_reward():
    g = grade("\\boxed{0.5}", ["\\frac{1}{2}"], math=True)
    assert g == Grade("0.5", True, 0.0, 0.0, 0.0, 1.0)
    assert g.as_dict()["math_equal"] == 1.0 and "math_equal" not in grade("\\boxed{a}", ["a"]).as_dict()
    assert call_reward(get_reward("math"), {"grade": g, "tool_counts": {}}) == 1.0
    with pytest.raises(ValueError, match="the grade has no 'math_equal'"):
        get_reward("math")(grade("\\boxed{a}", ["a"]), {})


def test_grade():
    assert grade("\\boxed{the Rush}", ["Rush"]) == Grade("the Rush", True, 1.0, 1.0, 1.0)
    assert grade("Rush", ["Rush"]) == Grade(None, False, 0.0, 0.0, 0.0)
    assert grade("\\boxed{Rush band}", ["Rush"]) == Grade("Rush band", True, 0.0, pytest.approx(2 / 3), 1.0)


@pytest.mark.parametrize(
    "scheme, response, tools, reward",
    [
        ("em", "\\boxed{Rush}", {}, 1.0),
        ("em", "Rush", {}, 0.0),  # bad format, no penalty
        ("at2po", "Rush", {}, -1.0),  # AT²PO: -1 bad format
        ("at2po", "\\boxed{Queen}", {}, 0.0),
        ("f1", "\\boxed{Rush band}", {}, 2 / 3),
        ("aepo", "\\boxed{Rush}", {"search": 1}, 1.0),  # right, but only one tool used: no bonus
        ("aepo", "\\boxed{Rush}", {"search": 2, "python": 1}, 1.1),  # AEPO: +0.1 with both tools
        ("aepo", "\\boxed{Rush band}", {"search": 1, "python": 1}, 2 / 3),  # not right: no bonus
        ("aepo", None, {}, -1.0),
        ("cover_em", "\\boxed{the band Rush}", {}, 1.0),
    ],
)
def test_reward_schemes(scheme, response, tools, reward):
    fn = get_reward(scheme)
    assert call_reward(fn, {"grade": grade(response, ["Rush"]), "tool_counts": tools, "answer": None}) == pytest.approx(
        reward
    )


def test_custom_reward_receives_only_named_arguments():
    def length_penalised(answer, answers):
        return float(answer in answers) - 0.01 * len(answer)

    assert call_reward(length_penalised, {"answer": "Rush", "answers": ["Rush"], "grade": None}) == pytest.approx(0.96)
    with pytest.raises(TypeError, match=r"asks for \['judge'\]"):
        call_reward(lambda judge: 1.0, {"answer": "x"})
    assert call_reward(lambda **kw: len(kw), {"a": 1, "b": 2}) == 2.0


def test_unknown_reward_scheme():
    with pytest.raises(
        ValueError,
        match=r"unknown reward scheme 'bleu'; choose one of \['aepo', 'at2po', 'cover_em', 'em', 'f1', 'math'\]",
    ):
        get_reward("bleu")
    assert sorted(REWARD_SCHEMES) == ["aepo", "at2po", "cover_em", "em", "f1", "math"]


# -- math grading is bounded wherever it runs ------------------------------------------------------

TOWER = "9^{9^{9^{9}}}"  # 9^(9^387420489): sympy would compute it for as long as it is let
# The tests that need a worker process (a deadline off the main thread) cannot pass without one.
needs_workers = pytest.mark.skipif(graders._pool_disabled is not None, reason=f"{graders._pool_disabled}")


def _in_thread(fn, *args, **kwargs):
    """fn(*args, **kwargs) on a new thread (where SIGALRM, math-verify's timeout, cannot reach)."""
    result = []
    thread = threading.Thread(target=lambda: result.append(fn(*args, **kwargs)))
    thread.start()
    thread.join(60)
    assert result, "the grading did not return within 60 s"
    return result[0]


@pytest.mark.parametrize("where", ["main thread", "thread", "asyncio.to_thread"])
def test_a_power_tower_grades_as_not_equal_at_once_on_any_thread(where):
    call = functools.partial(grade, f"\\boxed{{{TOWER}}}", ["42"], math=True)
    start = time.monotonic()
    if where == "main thread":
        g = call()
    elif where == "thread":
        g = _in_thread(call)
    else:
        g = asyncio.run(asyncio.to_thread(call))
    assert time.monotonic() - start < 15
    assert g.math_equal == 0.0 and g.math_detail.startswith("refused: it has a number of about 3.7e+08 digits")
    assert g.as_dict()["math_detail"] == g.math_detail
    assert get_reward("math")(g, {}) == 0.0


@pytest.mark.parametrize(
    "prediction",
    [TOWER, "10^{10^{10}}", "(10^{6})!", "x^{9^{9^{9}}}", "\\left(1, 2^{2^{100}}\\right)", "\\frac{1}{2^{10^{9}}}"],
)
def test_answers_with_numbers_too_large_to_compare_are_refused(prediction):
    assert graders._math_equal(prediction, ["1"], 10.0)[1].startswith("refused: ")


@pytest.mark.parametrize(
    "prediction, gold",
    [
        ("2^{10}", "1024"),
        ("10^{100}", "10^{100}"),
        ("2^{2^{3}}", "256"),
        ("100!", "100!"),
        ("\\frac{1}{2^{64}}", "2^{-64}"),
        ("\\binom{10}{5}", "252"),
        ("\\sqrt{2}^{1000}", "2^{500}"),
        ("2^{100000}", "2^{100000}"),  # 30,103 digits: compared
        ("\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}"),
    ],
)
def test_large_but_reasonable_answers_are_still_compared(prediction, gold):
    assert graders._math_equal(prediction, [gold], 10.0) == (1.0, None)


@pytest.mark.parametrize(
    "prediction, gold, equal",
    [("0.5", "\\frac{1}{2}", 1.0), ("1+x^2", "x^2+1", 1.0), ("Evelyn", "\\text{Evelyn}", 1.0), ("7", "8", 0.0)],
)
def test_math_equal_off_the_main_thread_grades_as_on_it(prediction, gold, equal):
    assert _in_thread(graders._math_equal, prediction, [gold], 10.0) == (equal, None)
    assert _in_thread(math_equal, prediction, [gold]) == math_equal(prediction, [gold]) == equal


# \binom{10^7}{5*10^6}: math-verify's parser computes it, which takes far longer than any limit.
SLOW = "\\binom{10^{7}}{5000000}"


@needs_workers
def test_a_slow_answer_off_the_main_thread_is_stopped_at_the_deadline_and_the_worker_replaced():
    start = time.monotonic()
    equal, detail = _in_thread(graders._math_equal, SLOW, ["1"], 1.0)
    assert time.monotonic() - start < 15
    assert (equal, detail) == (0.0, "timed out: no result within 1 s (the grading process was stopped)")
    assert _in_thread(graders._math_equal, "\\frac{1}{2}", ["0.5"], 10.0) == (1.0, None)


def test_a_slow_answer_on_the_main_thread_stops_at_math_verify_s_limit(monkeypatch):
    monkeypatch.setattr(graders, "_STEP_TIMEOUT", 1)
    start = time.monotonic()
    g = grade(f"\\boxed{{{SLOW}}}", ["1"], math=True)
    assert time.monotonic() - start < 15
    assert (g.math_equal, g.math_detail) == (0.0, "timed out: math-verify gave up parsing after 1 s")


@needs_workers
def test_a_worker_that_died_is_replaced():
    assert _in_thread(graders._math_equal, "42", ["42"], 10.0) == (1.0, None)  # a worker is running
    pool = graders._math_workers()
    for worker in list(pool._idle):
        worker._process.kill()
        worker._process.wait()
    equal, detail = _in_thread(graders._math_equal, "42", ["42"], 10.0)
    assert equal == 0.0 and detail.startswith("failed: the grading process died: it exited with status -9")
    assert _in_thread(graders._math_equal, "42", ["42"], 10.0) == (1.0, None)


def test_normal_grades_have_no_math_detail():
    g = grade("\\boxed{\\frac{1}{2}}", ["0.5"], math=True)
    assert g.math_detail is None and "math_detail" not in g.as_dict()
    assert grade("\\boxed{7}", ["8"], math=True).as_dict() == {
        "answer": "7",
        "format_ok": True,
        "em": 0.0,
        "f1": 0.0,
        "cover_em": 0.0,
        "math_equal": 0.0,
    }


def test_where_no_worker_can_start_grading_off_the_main_thread_still_works(monkeypatch, caplog):
    monkeypatch.setattr(graders, "_pool", None)
    monkeypatch.setattr(graders, "_pool_disabled", None)
    monkeypatch.setattr(graders, "_pool_disabled_said", False)
    monkeypatch.setattr(graders.sys, "executable", "/nonexistent/python")
    assert _in_thread(graders._math_equal, "\\frac{1}{2}", ["0.5"], 10.0) == (1.0, None)  # graded in the thread
    assert graders._pool_disabled.startswith("cannot start /nonexistent/python")
    assert "math grading off the main thread has no time limit in this process" in caplog.text
    assert _in_thread(graders._math_equal, "7", ["8"], 10.0) == (0.0, None)


def test_the_math_env_reports_why_an_answer_was_not_compared(tmp_path):
    data = tmp_path / "half.jsonl"
    data.write_text(json.dumps({"problem": "What is 1 divided by 2?", "answer": "\\frac{1}{2}"}) + "\n")
    env = agentenv.make("python-math", data=str(data))
    try:
        env.reset(seed=0)
        start = time.monotonic()
        step = env.astep(f"<answer>\\boxed{{{TOWER}}}</answer>")  # graded on the thread of an event loop
        _, reward, terminated, _, info = _in_thread(asyncio.run, step)
        assert time.monotonic() - start < 15
        assert (reward, terminated, info["grade"]["math_equal"]) == (0.0, True, 0.0)
        assert info["grade"]["math_detail"].startswith("refused: it has a number of about 3.7e+08 digits")
    finally:
        env.close()
