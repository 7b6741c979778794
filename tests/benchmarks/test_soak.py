"""The soak benchmark's logic: the scripted policy's turns and the verdict on a resource's trend (no Ray)."""

import pytest

from benchmarks.soak import Said, policy_turn, trend


def test_the_policy_answers_once_its_tool_calls_are_spent_and_repeats_for_a_seed():
    assert policy_turn(5, 3, max_tool_calls=3).startswith("<answer> ")
    assert [policy_turn(5, t, 3) for t in range(3)] == [policy_turn(5, t, 3) for t in range(3)]
    kinds = {policy_turn(seed, 0, 3).split(">")[0] for seed in range(200)}
    assert kinds == {"<answer", "<search", "<python"}
    turns = {policy_turn(seed, 0, 3) for seed in range(400)}
    assert "<python>while True: pass</python>" in turns and "<search> unclosed query" in turns


def test_a_series_is_flat_when_its_second_half_grows_less_than_its_tolerance():
    steps = list(range(1, 101))
    warm_up_then_level = [100.0 + 50.0 * (s < 20) for s in steps]
    assert trend(steps, warm_up_then_level, floor=8.0).flat  # the first half is not judged
    leak = [100.0 + 0.5 * s for s in steps]  # half a unit a step: 24.5 over the second half
    judged = trend(steps, leak, floor=8.0)
    assert not judged.flat
    assert judged.slope_per_100_steps == pytest.approx(50.0) and judged.growth == pytest.approx(24.5)
    assert judged.tolerance == 8.0  # the floor: 5% of the median (137.75) is 6.9
    assert trend(steps, [1000.0] * 100, floor=8.0).tolerance == pytest.approx(50.0)  # 5% of the median
    assert trend(steps, [3.0] * 100, floor=2.0).tolerance == 2.0


def test_the_run_notes_of_failed_turns_are_kept_with_their_step(capsys):
    import sys

    said = Said(sys.stdout)
    said.write("step 4/10: reward +0.1\nrollout: 1 turn(s) or prompt(s) failed and were abandoned: X\nstep 5")
    said.write("/10: reward\n")
    assert said.errors == [{"step": 5, "note": "rollout: 1 turn(s) or prompt(s) failed and were abandoned: X"}]
    assert said.step == 5 and "rollout: 1 turn" in capsys.readouterr().out
