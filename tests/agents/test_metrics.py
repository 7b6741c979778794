"""Metrics: JSONL records, TensorBoard scalars, resume truncation and the curves plot."""

import json
import math

import pytest
from PIL import Image

from agents.training.metrics import MetricsLog, plot_curves, read_jsonl


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
    log = MetricsLog(tmp_path, tensorboard=False)
    for step in (1, 2, 3):
        log.log(step, {"x": step})
    with pytest.raises(FileExistsError, match="already holds the metrics of a run"):
        MetricsLog(tmp_path, tensorboard=False)
    resumed = MetricsLog(tmp_path, tensorboard=False, resume_step=2)
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
