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
    searches = [policy_turn(seed, 0, 3) for seed in range(400)]
    searches = [text for text in searches if text.endswith("</search>")]
    assert len(set(searches)) == len(searches) > 100  # each query new: it reaches the server, not the cache


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


def test_the_summary_counts_faults_reruns_errors_and_lost_prompts():
    from benchmarks.soak import PER_STEP, SERIES, summarise

    def record(step, sequences, leaves_per_prompt, **more):
        return {"step": step, "batch/sequences": sequences, "tree/leaves_per_prompt": leaves_per_prompt, **more}

    records = [
        record(1, 12.0, 6.0),
        record(2, 11.0, 5.5, **{"tree/errors": 1.0, "cluster/worker_failures": 1.0, "cluster/prompts_rerun": 2.0}),
        record(3, 6.0, 6.0),  # one prompt of two trained on: lost
        record(4, 6.0, 3.0, **{"rollout/prompts_without_leaves": 1.0}),  # two rolled out, one with no leaf
    ]
    readings = [{"step": float(s), **{name: 10.0 for name, _, _ in SERIES}} for s in range(1, 5)]
    faults = [
        {"t_s": 1.0, "step": 1, "kind": "kill_sandbox", "pid": 7},
        {"t_s": 2.0, "step": 2, "kind": "kill_sandbox", "pid": None},
        {"t_s": 3.0, "step": 2, "kind": "kill_rollout_worker", "pid": 8},
    ]
    measured = {
        "steps": 4,
        "seconds": 60.0,
        "faults": faults,
        "records": records,
        "readings": readings,
        "errors": [{"step": 2, "note": "rollout: 1 turn(s) ... failed"}],
        "server_restarts": 1,
        "server_exit": 0,
        "prompts_per_step": 2,
    }
    summary = summarise(measured)
    assert summary["faults"] == {
        "kill_sandbox": {"injected": 1, "no_target": 1},
        "kill_rollout_worker": {"injected": 1, "no_target": 0},
    }
    assert (summary["worker_failures"], summary["prompts_rerun"], summary["episode_errors"]) == (1.0, 2.0, 1.0)
    assert summary["prompts_per_step"] == [1, 2] and summary["sequences_per_step"] == [6.0, 11.0, 12.0]
    assert summary["prompts_lost"] == 2.0
    assert summary["all_flat"] and set(summary["trends"]) == {name for name, _, _ in SERIES}
    assert summary["per_step"][1]["cluster/prompts_rerun"] == 2.0 and set(summary["per_step"][0]) == set(PER_STEP)
