"""python-math:arithmetic: expressions that evaluate to their answers, a fixed held-out set that no training task
repeats, training tasks from the options' distribution, and an episode solved with the python tool."""

import ast

import numpy as np
import pytest

import agentenv
from agentenv.envs.arithmetic import HELDOUT_TASKS, TRAINING_TASKS, ArithmeticTasks, random_expression
from agentenv.options import OptionError


def numbers_in(expression: str) -> list[int]:
    return [node.value for node in ast.walk(ast.parse(expression, mode="eval")) if isinstance(node, ast.Constant)]


def operations_in(expression: str) -> int:
    return sum(isinstance(node, ast.BinOp) for node in ast.walk(ast.parse(expression, mode="eval")))


def test_an_expression_reads_as_python_evaluates_it():
    rng = np.random.default_rng(0)
    parenthesised = 0
    for _ in range(2000):
        operations, digits = int(rng.integers(1, 6)), int(rng.integers(1, 4))
        text, value = random_expression(rng, operations, digits)
        assert eval(text) == value
        assert operations_in(text) == operations
        assert all(0 <= n < 10**digits for n in numbers_in(text))
        parenthesised += "(" in text
    assert 300 < parenthesised < 1900  # precedence needs them now and then, not always


def test_the_held_out_set_is_fixed_whatever_the_options_and_no_training_task_repeats_it():
    default, narrow = ArithmeticTasks(), ArithmeticTasks(min_operations=2, max_operations=2, max_digits=1, seed=5)
    assert len(default) == HELDOUT_TASKS + TRAINING_TASKS == 1_000_500
    # pinned: a change of the generator changes every recorded held-out score
    assert (default[0].question, default[0].answers) == ("What is 141 + 2 + 81 * 2 - 80?", ("225",))
    assert (default[499].question, default[499].answers) == ("What is (5 * 5 + 14) * 872?", ("34008",))
    assert default[:HELDOUT_TASKS] == narrow[:HELDOUT_TASKS] == ArithmeticTasks(seed=9)[:HELDOUT_TASKS]
    heldout = {example.question for example in default[:HELDOUT_TASKS]}
    assert {operations_in(q[8:-1]) for q in heldout} == {2, 3, 4}
    # Two operations on one-digit numbers: few enough that the held-out set holds some of them ...
    small = [q for q in heldout if operations_in(q[8:-1]) == 2 and max(numbers_in(q[8:-1])) < 10]
    assert small
    # ... and that 3,000 draws would repeat them; each repeat is drawn again.
    training = narrow[HELDOUT_TASKS : HELDOUT_TASKS + 3000]
    assert not heldout & {example.question for example in training}
    assert all(ex.meta["operations"] == 2 and max(numbers_in(ex.meta["expression"])) < 10 for ex in training)
    assert all(int(ex.answers[0]) == eval(ex.meta["expression"]) >= 0 for ex in training)
    # the same task on every call and every machine; seeds differ
    assert narrow[4000] == ArithmeticTasks(min_operations=2, max_operations=2, max_digits=1, seed=5)[4000]
    assert default[HELDOUT_TASKS] != ArithmeticTasks(seed=1)[HELDOUT_TASKS]
    assert default[-1] == default[len(default) - 1] and default[-1].id == "arithmetic-1000499"
    with pytest.raises(IndexError, match="task 1000500 of 1000500"):
        default[len(default)]
    with pytest.raises(ValueError, match="need 1 <= min_operations <= max_operations, got min_operations=3"):
        ArithmeticTasks(min_operations=3, max_operations=2)


def test_an_episode_is_solved_with_the_python_tool_and_graded_exactly():
    env = agentenv.make("python-math:arithmetic")
    try:
        obs, _ = env.reset(options={"index": 600})
        task = env.unwrapped.tasks[600]
        assert obs.endswith(f"Problem: {task.question}\n") and "<python> code </python>" in obs
        call, answer = env.unwrapped.demo_actions()
        assert call.endswith(f"<python>print({task.meta['expression']})</python>")
        observation, reward, terminated, _, _ = env.step(call)
        assert (observation, reward, terminated) == (task.answers[0], 0.0, False)
        _, reward, terminated, _, info = env.step(answer)
        assert (reward, terminated, info["grade"]["math_equal"]) == (1.0, True, 1.0)
        env.reset(options={"index": 600})
        wrong = str(int(task.answers[0]) + 1)
        assert env.step(f"<answer> \\boxed{{{wrong}}} </answer>")[1] == 0.0
    finally:
        env.close()


def test_the_answer_must_be_the_value_not_the_expression_that_math_verify_would_evaluate():
    # Under math-verify's equivalence (reward="math") boxing the question's expression scores: a learner found it.
    for reward, expected in (("em", 0.0), ("math", 1.0)):
        env = agentenv.make("python-math:arithmetic", reward=reward)
        try:
            env.reset(options={"index": 600})
            expression = env.unwrapped.tasks[600].meta["expression"]
            _, score, terminated, _, info = env.step(f"<answer> \\boxed{{{expression}}} </answer>")
            assert (score, terminated, info["grade"]["em"], info["grade"]["math_equal"]) == (expected, True, 0.0, 1.0)
        finally:
            env.close()


def imported(env, module: str) -> str:
    """Whether the episode's session has ``module`` loaded before any call imports it."""
    env.reset(options={"index": 0})
    return env.step(f"<python>import sys\nprint({module!r} in sys.modules)</python>")[0]


def test_its_sessions_start_with_math_alone_where_python_math_loads_numpy_and_sympy():
    # numpy and sympy cost ~260 ms of each episode's sandbox start; integer expressions need neither.
    for env_id, options, loaded in [
        ("python-math:arithmetic", {}, "False"),
        ("python-math:arithmetic", {"preimport": ["math", "numpy"]}, "True"),
        ("python-math", {}, "True"),
    ]:
        env = agentenv.make(env_id, **options)
        try:
            assert (imported(env, "math"), imported(env, "numpy")) == ("True", loaded), (env_id, options)
        finally:
            env.close()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"preimport": "math"}, "preimport must be a list or a tuple or None, got 'math'"),
        ({"max_digits": 0}, "max_digits must be an int >= 1, got 0"),
        ({"seed": "1"}, "seed must be an int, got '1'"),
        ({"min_operations": 3, "max_operations": 2}, "need 1 <= min_operations <= max_operations"),
    ],
)
def test_bad_options_name_the_option_and_the_value(options, message):
    with pytest.raises((OptionError, ValueError), match=message):
        agentenv.make("python-math:arithmetic", **options)
