"""Held-out scores: 95% intervals inside each score's range, and their plots read on the Axes."""

import json
import math
import statistics
import warnings
from pathlib import Path

import pytest
from matplotlib.container import ErrorbarContainer

from agents.cli import main
from agents.eval.heldout import (
    SCORE_DISPLAY,
    Z_95,
    HeldOut,
    HeldOutLog,
    Score,
    interval,
    paired_difference,
    paired_table,
    read_evaluation,
)

TITLE = "at2po · multihop-qa · smollm2-135m (runs/demo)"


def held_out(step: int, em: list[float], f1: list[float], format_ok: list[float], reward: list[float]) -> HeldOut:
    # The answer-origin scores follow the format: an answer given was found in a result, never repeated.
    columns = {"em": em, "f1": f1, "format_ok": format_ok, "reward": reward, "tool_calls": format_ok}
    nothing = [0.0] * len(em)
    columns.update(in_results=format_ok, equals_example=nothing, echoes_question=nothing, repeated=nothing)
    scores = {name: interval(values, SCORE_DISPLAY[name].bounds) for name, values in columns.items()}
    return HeldOut(step, len(em), scores, 1.0, columns, list(range(len(em))))


def visible_ticks(axis):
    """The x tick locations inside the axis' view."""
    low, high = axis.get_xlim()
    return [tick for tick in axis.get_xticks() if low <= tick <= high]


def test_intervals_stay_inside_the_range_of_the_score():
    nothing = interval([0.0] * 8)  # a proportion: Wilson's interval
    assert (nothing.mean, nothing.low) == (0.0, 0.0)
    assert nothing.high == pytest.approx(Z_95**2 / (8 + Z_95**2))  # 0.324, as the make demo's EM
    f1 = [0.5] + [0.0] * 7  # the make demo's F1 after 3 steps, whose normal interval went below 0
    half = Z_95 * statistics.stdev(f1) / math.sqrt(8)
    assert interval(f1) == Score(0.0625, 0.0625 - half, 0.0625 + half)
    assert 0.0625 - half == pytest.approx(-0.0600, abs=1e-4)
    assert interval(f1, (0.0, 1.0)) == Score(0.0625, 0.0, 0.0625 + half)
    assert interval([0.4], (0.0, 1.0)) == Score(0.4, 0.0, 1.0)  # one answer: anything in the range
    assert interval([0.4]) == Score(0.4, -math.inf, math.inf)
    for n in range(1, 201):  # Wilson's interval holds the mean even where rounding puts its end past 0 or 1
        for p in (0.0, 1.0):
            score = interval([p] * n)
            assert score.low <= score.mean <= score.high
    assert {name: display.bounds for name, display in SCORE_DISPLAY.items()} == {
        "em": (0.0, 1.0),
        "f1": (0.0, 1.0),
        "format_ok": (0.0, 1.0),
        "reward": None,
        "tool_calls": (0.0, math.inf),
        "in_results": (0.0, 1.0),
        "equals_example": (0.0, 1.0),
        "echoes_question": (0.0, 1.0),
        "repeated": (0.0, 1.0),
    }


def test_heldout_plot_draws_each_evaluation_as_a_point_with_its_interval(tmp_path):
    before = held_out(0, em=[0.0] * 8, f1=[0.0] * 8, format_ok=[0.0] * 8, reward=[-1.0] * 8)
    after = held_out(3, em=[0.0] * 8, f1=[0.5] + [0.0] * 7, format_ok=[1.0] * 7 + [0.0], reward=[0.0] * 7 + [-1.0])
    log = HeldOutLog(tmp_path, report_to=())
    log.add(before, plot_title=TITLE)
    log.add(after, plot_title=TITLE)
    log.close()
    assert (tmp_path / "heldout.png").is_file()
    figure = log.figure(title=TITLE)
    assert figure.get_suptitle() == f"{TITLE}: held-out scores, 95% intervals"
    assert len(figure.axes) == 9  # three rows of three
    for axis, (name, display) in zip(figure.axes, SCORE_DISPLAY.items()):
        assert (axis.get_title(), axis.get_ylabel(), axis.get_xlabel()) == (display.name, display.unit, "training step")
        assert visible_ticks(axis) == [0.0, 1.0, 2.0, 3.0]
        # No line joins the two evaluations: nothing was measured between them.
        assert [line.get_linestyle() for line in axis.get_lines()] == ["None"] * 3  # points and two rows of caps
        (bars,) = axis.containers
        assert isinstance(bars, ErrorbarContainer) and bars.has_yerr
        scores = [before.scores[name], after.scores[name]]
        assert bars.lines[0].get_ydata().tolist() == [score.mean for score in scores]
        segments = [segment.tolist() for segment in bars.lines[2][0].get_segments()]
        assert segments == [
            [[step, pytest.approx(score.low)], [step, pytest.approx(score.high)]] for step, score in zip((0, 3), scores)
        ]
        if display.bounds == (0.0, 1.0):
            assert axis.get_ylim() == pytest.approx((-0.05, 1.05))
            assert all(0.0 <= y <= 1.0 for segment in segments for _, y in segment)
    assert after.scores["f1"].low == 0.0


def test_one_evaluation_draws_a_readable_figure_without_warnings(tmp_path):
    log = HeldOutLog(None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        log.add(held_out(0, em=[1.0], f1=[0.5], format_ok=[1.0], reward=[1.0]))
        path = log.plot(tmp_path / "heldout.png")
        figure = log.figure()
    assert path.is_file()
    assert figure.get_suptitle() == "held-out scores, 95% intervals"
    assert [visible_ticks(axis) for axis in figure.axes] == [[0.0]] * 9


def test_the_comparison_table_has_a_row_per_score_and_a_column_per_evaluation():
    from agents.eval.heldout import comparison_table

    before = held_out(0, em=[0.0] * 4, f1=[0.0] * 4, format_ok=[0.0] * 4, reward=[-1.0] * 4)
    after = held_out(3, em=[1.0, 0.0, 0.0, 0.0], f1=[1.0, 0.5, 0.0, 0.0], format_ok=[1.0] * 4, reward=[1.0, 0, 0, 0])
    old = HeldOut(5, 4, {name: after.scores[name] for name in ("em", "f1", "format_ok", "reward")}, 1.0)
    lines = comparison_table([before, after, old], ["before", "after", "old record"]).splitlines()
    assert lines[0].split() == ["held-out", "score", "before", "after", "old", "record"]
    rows = {line[:34].strip(): line[34:].split("  ") for line in lines[2:]}
    cells = {name: [cell.strip() for cell in row if cell.strip()] for name, row in rows.items()}
    assert list(cells) == [
        "questions",
        "exact match %",
        "word F1 %",
        "answer format followed %",
        "reward",
        "tool calls",
        "answer in tool results %",
        "answer = worked example's %",
        "answer repeats the question %",
        "answer given to another question %",
    ]
    assert cells["questions"] == ["4", "4", "4"]
    assert cells["exact match %"][:2] == ["0.0 [0.0, 49.0]", "25.0 [4.6, 69.9]"]  # Wilson's intervals
    half = Z_95 * statistics.stdev([1.0, 0.5, 0.0, 0.0]) / 2
    assert cells["word F1 %"][1] == f"37.5 [0.0, {100 * (0.375 + half):.1f}]"  # the normal one, clipped at 0
    assert cells["reward"][0] == "-1.00 [-1.00, -1.00]"  # signed; no spread, no width
    assert cells["tool calls"][:2] == ["0.00 [0.00, 0.49]", "1.00 [0.51, 1.00]"]
    assert cells["answer in tool results %"][2] == "–"  # a record written before the score existed


def test_the_learning_benchmark_plot_follows_the_same_rules(tmp_path):
    from agents.run.train import TrainResult
    from benchmarks.learning import learning_config, learning_figure, plot

    before = held_out(0, em=[0.0] * 4, f1=[0.0] * 4, format_ok=[0.0] * 4, reward=[-1.0] * 4)
    after = held_out(2, em=[0.0] * 4, f1=[0.0] * 4, format_ok=[1.0, 0.0, 0.0, 0.0], reward=[0.0, -1.0, -1.0, -1.0])
    history = [
        {"step": 1, "reward/mean": -0.5, "reward/std": 0.8, "reward/min": -1.0, "reward/max": 0.0},
        {"step": 2, "reward/mean": 0.0, "reward/std": 0.8, "reward/min": -1.0, "reward/max": 1.0},
    ]
    for record, tokens in zip(history, (30.0, 40.0)):
        record["sampling/tokens"] = tokens
    results = {
        algo: TrainResult(tmp_path / algo, learning_config(algo, 2, 4), 2, None, history, [after])
        for algo in ("at2po", "grpo")
    }
    cold = learning_config("aepo", 3, 48, model="runs/demo/sft/model", assignments=["env_kwargs.reward=arpo"])
    assert (cold.algo, cold.steps, cold.eval_questions, cold.holdout) == ("aepo", 3, 48, 50)
    assert cold.model == "runs/demo/sft/model" and cold.env_kwargs["reward"] == "arpo"
    assert cold.env_kwargs["topk"] == 1  # the rest of the preset stays
    assert learning_config("grpo", 3, 120).holdout == 120  # the held-out tasks hold the questions scored
    # A preset's budget and held-out tasks stay unless the command line says otherwise.
    arithmetic = learning_config("grpo", 12, 200, preset="cpu-arithmetic")
    assert (arithmetic.max_rollout_tokens, arithmetic.holdout) == (40_000, 500)
    points = learning_config("grpo", 12, 200, preset="cpu-arithmetic", budget_points=(9000, 20_000), holdout=600)
    assert (points.max_rollout_tokens, points.eval_at_tokens, points.holdout) == (20_000, (9000, 20_000), 600)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = plot(results, before, tmp_path / "learning.png")
    assert path.is_file()
    figure = learning_figure(results, before, Path("runs/learning"))
    assert figure.get_suptitle() == ("AT²PO, GRPO · multihop-qa · smollm2-135m (runs/learning): held-out 95% intervals")
    train, tokens, f1, format_ok, reward = figure.axes
    assert tokens.get_xlabel() == "rollout tokens sampled"  # each learner's F1 at 0 and after 30 + 40 tokens
    assert [container.lines[0].get_xdata().tolist() for container in tokens.containers] == [[0.0, 70.0]] * 2
    assert [text.get_text() for text in tokens.get_legend().get_texts()] == ["AT²PO", "GRPO"]
    assert (train.get_ylabel(), train.get_xlabel(), visible_ticks(train)) == ("reward", "training step", [1.0, 2.0])
    assert [text.get_text() for text in train.get_legend().get_texts()] == ["AT²PO", "GRPO"]
    for band in train.collections:  # each learner's ±std, clipped to the batch's rewards
        assert band.get_paths()[0].vertices[:, 1].min() == -1.0 and band.get_paths()[0].vertices[:, 1].max() == 0.8
    for axis, name in ((f1, "f1"), (format_ok, "format_ok"), (reward, "reward")):
        assert axis.get_ylabel() == SCORE_DISPLAY[name].unit
        assert [label.get_text() for label in axis.get_xticklabels()] == [
            "before\ntraining",
            "AT²PO\n2 steps",
            "GRPO\n2 steps",
        ]
        assert all(line.get_linestyle() == "None" for line in axis.get_lines())
        assert [container.lines[0].get_ydata().tolist() for container in axis.containers] == [
            [before.scores[name].mean],
            [after.scores[name].mean],
            [after.scores[name].mean],
        ]
    assert format_ok.get_ylim() == pytest.approx((-0.05, 1.05))


def test_the_learning_benchmark_compares_its_learners_on_the_same_questions():
    from agents.run.train import TrainResult
    from benchmarks.learning import learning_config, paired_differences

    start = held_out(0, em=[0.0] * 4, f1=[0.0, 0.5, 0.0, 0.0], format_ok=[1.0] * 4, reward=[0.0] * 4)
    at2po = held_out(3, em=[1.0, 0.0, 0.0, 0.0], f1=[1.0, 0.5, 0.5, 0.0], format_ok=[1.0] * 4, reward=[0.0] * 4)
    grpo = held_out(3, em=[0.0] * 4, f1=[0.0, 0.5, 0.5, 0.0], format_ok=[1.0] * 4, reward=[0.0] * 4)
    results = {
        algo: TrainResult(Path(algo), learning_config(algo, 3, 4), 3, None, [], [held])
        for algo, held in (("at2po", at2po), ("grpo", grpo))
    }
    table, numbers = paired_differences(start, results)
    assert list(numbers) == ["AT²PO - start", "GRPO - start", "AT²PO - GRPO"]
    assert numbers["AT²PO - start"]["f1"] == 0.375 and numbers["AT²PO - GRPO"]["em"] == 0.25
    assert numbers["GRPO - start"]["f1"] == 0.125
    assert "AT²PO − GRPO" in table and "+25.0" in table


def test_the_learning_benchmark_compares_seeded_runs_at_each_budget_point(tmp_path):
    from agents.run.train import TrainResult
    from benchmarks.learning import budget_table, heldout_at, learning_config, learning_figure, run_key, run_name

    def accuracy(step: int, em: list[float]) -> HeldOut:
        return held_out(step, em=em, f1=em, format_ok=[1.0] * 4, reward=em)

    start = accuracy(0, [0.0, 0.0, 0.0, 1.0])
    history = [
        {"step": s, "sampling/tokens": t, "reward/mean": 0.0, "reward/std": 0.0, "reward/min": 0.0, "reward/max": 0.0}
        for s, t in ((1, 30.0), (2, 40.0))
    ]
    # each run: evaluated after step 1 (30 tokens) and step 2 (70 tokens)
    em = {
        ("at2po", 0): ([1.0, 0.0, 0.0, 1.0], [1.0, 1.0, 0.0, 1.0]),
        ("at2po", 1): ([1.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0]),
        ("grpo", 0): ([0.0, 0.0, 0.0, 1.0], [1.0, 0.0, 0.0, 1.0]),
        ("grpo", 1): ([0.0, 0.0, 0.0, 0.0], [1.0, 0.0, 0.0, 1.0]),
    }
    seeds = [0, 1]
    assert [run_key("at2po", 1, seeds), run_key("at2po", 1, [1]), run_name("at2po@1")] == [
        "at2po@1",
        "at2po",
        "AT²PO seed 1",
    ]
    results = {
        run_key(algo, seed, seeds): TrainResult(
            tmp_path / f"{algo}{seed}",
            learning_config(algo, 2, 4, seed=seed, budget_points=(30, 70)),
            2,
            None,
            history,
            [accuracy(1, early), accuracy(2, late)],
        )
        for (algo, seed), (early, late) in em.items()
    }
    config = results["grpo@1"].config
    assert (config.seed, config.eval_at_tokens, config.max_rollout_tokens) == (1, (30, 70), 70)
    assert heldout_at(results["at2po@0"], 30).step == 1 and heldout_at(results["at2po@0"], 31).step == 2
    assert heldout_at(results["at2po@0"], 71) is None  # the run ended before
    table, numbers = budget_table(start, results, [30, 70, 100], "em")
    # at 30 tokens AT²PO is +25 and +50 points over the start; across the two seeds +37.5 with a t interval
    at30 = numbers["30 AT²PO - start"]
    assert [entry["em"] for entry in at30["per_seed"]] == [0.25, 0.5]
    half = 12.706204736174707 * statistics.stdev([0.25, 0.5]) / 2**0.5  # t(0.975, 1 degree of freedom)
    assert at30["across_seeds"]["em"] == 0.375
    assert at30["across_seeds"]["em_low"] == pytest.approx(0.375 - half)
    assert [entry["em"] for entry in numbers["70 AT²PO - GRPO"]["per_seed"]] == [0.25, 0.5]
    assert [entry["em"] for entry in numbers["30 GRPO - start"]["per_seed"]] == [0.0, -0.25]
    assert numbers["100 AT²PO - start"] == {"per_seed": [], "across_seeds": None}
    assert "not reached" in table and "+37.5" in table
    figure = learning_figure(results, start, Path("runs/learning"), "em")
    tokens = figure.axes[1]
    assert tokens.get_ylabel() == SCORE_DISPLAY["em"].unit
    assert [text.get_text() for text in tokens.get_legend().get_texts()] == ["AT²PO", "GRPO"]  # once a learner
    assert [text.get_text() for text in figure.axes[0].get_legend().get_texts()] == ["AT²PO", "GRPO"]
    assert len(tokens.containers) == 4  # a curve a run: 0, 30 and 70 tokens
    assert [c.lines[0].get_xdata().tolist() for c in tokens.containers] == [[0.0, 30.0, 70.0]] * 4
    assert list(figure.axes[0].collections) == []  # nine runs' ±std bands would hide each other: lines alone
    ticks = figure.axes[2].get_xticklabels()  # a run a tick, written sideways so that the names do not overlap
    assert [label.get_text() for label in ticks] == [
        "before · training",
        "AT²PO seed 0 · 2 steps",
        "AT²PO seed 1 · 2 steps",
        "GRPO seed 0 · 2 steps",
        "GRPO seed 1 · 2 steps",
    ]
    assert {label.get_rotation() for label in ticks} == {90.0}


# -- paired comparison of two evaluations of the same questions -----------------------------------


def evaluation(step: int, f1: list[float], tasks: list[int] | None = None) -> HeldOut:
    """An evaluation of ``len(f1)`` questions with those F1 scores and EM 1 where F1 is 1."""
    em = [float(value == 1.0) for value in f1]
    columns = {"f1": f1, "em": em}
    scores = {name: interval(values, SCORE_DISPLAY[name].bounds) for name, values in columns.items()}
    return HeldOut(step, len(f1), scores, 1.0, columns, tasks if tasks is not None else list(range(len(f1))))


def test_a_paired_interval_sees_a_small_consistent_gain_that_independent_ones_cannot():
    # 40 questions of very different difficulty; the second checkpoint gains 0.05 on each of 20 of them.
    before = [(i % 10) / 10 for i in range(40)]
    after = [value + (0.05 if i % 2 else 0.0) for i, value in enumerate(before)]
    diff = paired_difference(before, after)
    assert diff.mean == pytest.approx(0.025) and 0 < diff.low < 0.025 < diff.high < 0.05
    a, b = interval(before, (0, 1)), interval(after, (0, 1))
    assert a.high > b.low  # independently, the two intervals overlap
    assert paired_difference(before, after) == diff  # seeded: it repeats


def test_a_paired_difference_of_unchanged_questions_is_exactly_zero():
    assert paired_difference([0.0, 1.0, 0.5], [0.0, 1.0, 0.5]) == Score(0.0, 0.0, 0.0)
    assert paired_difference([0.0, 0.0], [1.0, 1.0]) == Score(1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="two equally long, non-empty lists; got 2 and 1"):
        paired_difference([0.0, 1.0], [1.0])


def test_evaluations_saved_in_run_folders_are_read_back_and_compared(tmp_path, capsys):
    sft, rl = tmp_path / "sft", tmp_path / "rl"
    first = HeldOutLog(sft, report_to="none")
    first.add(evaluation(0, [0.0, 0.0, 0.0, 0.0]))
    first.add(evaluation(40, [0.0, 1.0, 0.5, 0.0]))
    first.close()
    second = HeldOutLog(rl, report_to="none")
    second.add(evaluation(3, [1.0, 1.0, 0.5, 0.5]))
    second.close()
    assert read_evaluation(sft).per_question["f1"] == [0.0, 1.0, 0.5, 0.0]
    assert read_evaluation(f"{sft}@0").step == 0 and read_evaluation(rl).tasks == [0, 1, 2, 3]

    assert main(["compare", str(sft), str(rl), "--labels", "sft", "rl", "--json", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    assert "rl − sft [paired 95%]" in out
    numbers = json.loads((tmp_path / "c.json").read_text())["scores"]
    assert numbers["f1"]["sft"] == 0.375 and numbers["f1"]["rl"] == 0.75 and numbers["f1"]["difference"] == 0.375
    assert numbers["em"]["difference"] == 0.25
    assert main(["compare", str(sft), str(rl), "--labels", "sft", "rl", "--summary", "f1"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("held-out word F1 %: 37.5 (sft) → 75.0 (rl), +37.5 points [")
    assert line.endswith("] (paired 95%, 4 questions)")
    with pytest.raises(SystemExit):
        main(["compare", str(sft), str(rl), "--summary", "bleu"])
    assert "no paired score 'bleu' in both evaluations; they have f1, em" in capsys.readouterr().err

    with pytest.raises(FileNotFoundError, match="has no evaluation at step 7; it has steps \\[0, 40\\]"):
        read_evaluation(f"{sft}@7")
    with pytest.raises(FileNotFoundError, match="holds no held-out evaluation with per-question scores"):
        read_evaluation(tmp_path / "nothing")
    other = HeldOutLog(tmp_path / "other", report_to="none")
    other.add(evaluation(1, [1.0, 1.0, 0.5, 0.5], tasks=[4, 5, 6, 7]))
    other.close()
    with pytest.raises(ValueError, match="asked different questions"):
        paired_table(read_evaluation(sft), read_evaluation(tmp_path / "other"))


def test_resuming_a_run_keeps_the_question_scores_of_evaluations_up_to_its_step(tmp_path):
    log = HeldOutLog(tmp_path, report_to="none")
    for step in (0, 2, 4):
        log.add(evaluation(step, [float(step == 4)] * 2))
    log.close()
    HeldOutLog(tmp_path, resume_step=2, report_to="none").close()
    assert read_evaluation(tmp_path).step == 2
    assert [json.loads(line)["step"] for line in (tmp_path / "heldout" / "questions.jsonl").open()] == [0, 2]
