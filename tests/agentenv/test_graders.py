import pytest

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
