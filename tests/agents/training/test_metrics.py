"""Metrics: JSONL records, TensorBoard scalars, resume truncation and the curves plot (read on its Axes)."""

import json
import math
import warnings

import pytest
from PIL import Image

from agents.training.metrics import METRIC_DISPLAY, PLOT_PANELS, MetricsLog, curves_figure, plot_curves, read_jsonl


def test_records_go_to_jsonl_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(tmp_path)
    log.log(1, {"reward/mean": 0.5, "policy/loss": -0.25})
    log.log(2, {"reward/mean": 0.75, "policy/loss": math.nan})
    log.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert json.loads(lines[1]) == {"step": 2, "reward/mean": 0.75, "policy/loss": None}
    records = read_jsonl(tmp_path / "metrics.jsonl")
    assert records[0] == {"step": 1, "reward/mean": 0.5, "policy/loss": -0.25}
    assert math.isnan(records[1]["policy/loss"])
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward/mean")] == [(1, 0.5), (2, 0.75)]


def test_in_memory_log_keeps_history_only():
    log = MetricsLog(None)
    log.log(3, {"a": 1})
    assert log.history == [{"step": 3, "a": 1.0}]
    with pytest.raises(ValueError, match="keeps its history in memory only"):
        log.jsonl_path
    with pytest.raises(ValueError, match="'step' is the record's key"):
        log.log(4, {"step": 4})


def test_resume_drops_records_after_the_checkpoint_and_a_fresh_log_refuses_an_old_run(tmp_path):
    log = MetricsLog(tmp_path, report_to="none")
    for step in (1, 2, 3):
        log.log(step, {"x": step})
    with pytest.raises(FileExistsError, match="already holds the metrics of a run"):
        MetricsLog(tmp_path, report_to="none")
    resumed = MetricsLog(tmp_path, report_to="none", resume_step=2)
    assert [r["step"] for r in resumed.history] == [1, 2]
    resumed.log(3, {"x": 30})
    assert [(r["step"], r["x"]) for r in read_jsonl(tmp_path / "metrics.jsonl")] == [(1, 1), (2, 2), (3, 30)]


def test_plot_has_one_panel_per_metric_group_present(tmp_path):
    history = [
        {
            "step": s,
            "reward/mean": 0.1 * s,
            "reward/std": 0.05,
            "policy/clip_frac_low": 0.01,
            "policy/clip_frac_high": 0.02,
        }
        for s in (1, 2, 3)
    ]
    path = plot_curves(history, tmp_path / "plots" / "curves.png")
    # Two panels (reward, clip fraction) side by side: 2 × 4.2 in × 3.0 in at 100 dpi.
    assert Image.open(path).size == (840, 300)
    four = [{**record, "policy/entropy": 1.0, "optim/grad_norm": 0.5} for record in history]
    assert Image.open(plot_curves(four, tmp_path / "four.png")).size == (1260, 600)
    with pytest.raises(ValueError, match="nothing to plot"):
        plot_curves([{"step": 1, "other": 1.0}], tmp_path / "none.png")


def visible_ticks(axis):
    """The x tick locations inside the axis' view."""
    low, high = axis.get_xlim()
    return [tick for tick in axis.get_xticks() if low <= tick <= high]


def test_curves_name_the_run_label_units_and_clip_the_reward_band():
    history = [
        # mean ± std reaches past the batch's rewards at every step: the band stops at min and max.
        {"step": 1, "reward/mean": 0.0, "reward/std": 1.0, "reward/min": -1.0, "reward/max": 0.5},
        {"step": 2, "reward/mean": -0.5, "reward/std": 1.0, "reward/min": -1.0, "reward/max": 1.0},
        {"step": 3, "reward/mean": 0.8, "reward/std": 0.4, "reward/min": 0.0, "reward/max": 1.0},
    ]
    history = [
        {**r, "policy/clip_frac_low": 0.01, "policy/clip_frac_high": 0.02, "time/rollout_s": 5.0} for r in history
    ]
    title = "at2po · multihop-qa · smollm2-135m (runs/demo)"
    figure = curves_figure(history, title=title)
    assert figure.get_suptitle() == title
    axes = {axis.get_title(): axis for axis in figure.axes if axis.get_visible()}
    assert {name: axis.get_ylabel() for name, axis in axes.items()} == {
        "reward": "reward",
        "clip fraction": "fraction of tokens",
        "seconds per step": "seconds",
    }
    for axis in axes.values():
        assert axis.get_xlabel() == "training step"
        assert visible_ticks(axis) == [1.0, 2.0, 3.0]
    legends = {
        name: [t.get_text() for t in axis.get_legend().get_texts()] for name, axis in axes.items() if axis.get_legend()
    }
    assert legends == {
        "reward": ["mean over leaves", "± std (within min–max)"],
        "clip fraction": ["clipped (low side)", "clipped (high side)"],
    }
    (band,) = axes["reward"].collections
    corners = {(float(x), float(y)) for x, y in band.get_paths()[0].vertices}
    assert corners == {(1, -1.0), (2, -1.0), (3, 0.4), (1, 0.5), (2, 0.5), (3, 1.0)}


def test_every_panel_has_a_unit_shared_by_its_metrics_and_proportions_stay_in_range():
    for title, names in PLOT_PANELS:
        assert len({METRIC_DISPLAY[name].unit for name in names}) == 1, title
    assert all(METRIC_DISPLAY[name].bounds == (0.0, 1.0) for name in ("reward/em", "policy/clip_frac_low"))
    nothing_clipped = [{"step": s, "policy/clip_frac_low": 0.0, "policy/clip_frac_high": 0.0} for s in (1, 2)]
    (axis,) = curves_figure(nothing_clipped).axes
    assert axis.get_ylim() == pytest.approx((-0.0022, 0.055))  # autoscaled to ±0.055; no negative fractions


def test_one_step_draws_a_readable_figure_without_warnings(tmp_path):
    record = {"step": 4, "reward/mean": 0.2, "reward/std": 0.5, "reward/min": -0.1, "reward/max": 1.0}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        figure = curves_figure([record, {"step": 4, "policy/entropy": 0.7}])
        plot_curves([record], tmp_path / "one.png", title="one step")
    reward, entropy = (axis for axis in figure.axes if axis.get_visible())
    assert visible_ticks(reward) == [4.0] and visible_ticks(entropy) == [4.0]
    assert entropy.get_ylabel() == "nats per token"
    (spread,) = reward.containers  # one step has no band to fill: its spread is an error bar
    (segment,) = spread.lines[2][0].get_segments()
    assert segment.tolist() == [[4.0, pytest.approx(-0.1)], [4.0, pytest.approx(0.7)]]  # within min–max
    assert (tmp_path / "one.png").is_file()
