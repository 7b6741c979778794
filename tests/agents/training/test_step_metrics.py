"""A training step's numbers: rollout metrics, the mismatch, loss metrics, the step's record and its log."""

import json
import math
import re
from types import SimpleNamespace

import pytest
import torch

import agents.progress
from agents.rollout.tree import TrainingPath
from agents.training import sharding, step_metrics
from agents.training.batch import collate
from agents.training.metrics import GENERATED_TOKENS, ROLLOUT_TIME
from agents.training.step_metrics import (
    LossMetrics,
    Mismatch,
    StepLog,
    StepWork,
    checked_rollout_metrics,
    merge_rollout_metrics,
)
from agents.training.trainer_config import TrainerConfig


def config(**overrides) -> TrainerConfig:
    return TrainerConfig(**{"lr": 1e-3, "progress": False, "report_to": ("none",), **overrides})


def fake_ranks(monkeypatch, module, *others):
    """``module``'s torch.distributed as a group of ranks: this one first, then ranks holding ``others``."""

    def all_gather_object(gathered, mine):
        gathered[:] = [mine, *others]

    fake = SimpleNamespace(get_world_size=lambda: 1 + len(others), all_gather_object=all_gather_object)
    monkeypatch.setattr(module, "dist", fake)


def batch_of(*paths):
    """(length, actions, reward) per path: a prompt token, then ``actions`` action tokens among ``length``."""
    return collate(
        [
            TrainingPath(
                ids=[1] * length,
                mask=[0] + [1] * actions + [0] * (length - 1 - actions),
                advantages=[0.0] * length,
                sampler_logprobs=[math.nan] * length,
                turn_ids=[0] * length,
                weights=[0.0] * length,
                reward=reward,
                leaf=None,
            )
            for length, actions, reward in paths
        ],
        pad_id=0,
    )


def test_rollout_metrics_become_floats_and_may_use_any_name_the_trainer_leaves_free():
    checked = checked_rollout_metrics({"reward/em": True, "tokens/generated": 100, "time/rollout_s": 2.5})
    assert checked == {"reward/em": 1.0, "tokens/generated": 100.0, "time/rollout_s": 2.5}
    assert all(type(value) is float for value in checked.values())


def test_rollout_metrics_refuse_the_trainers_names_and_groups_saying_which_it_owns():
    # the caller's reward/mean and policy/x: tests/agents/training/test_trainer.py
    with pytest.raises(
        ValueError,
        match=r"^rollout_metrics names \['throughput/x', 'time/step_s'\], which the trainer computes itself; rename "
        r"them \(the trainer owns policy/, mismatch/, optim/, batch/, throughput/\* and reward/max, reward/mean, ",
    ):
        checked_rollout_metrics({"time/step_s": 1.0, "time/rollout_s": 1.0, "throughput/x": 2.0})


@pytest.mark.parametrize(
    ("value", "error"), [("fast", "could not convert string to float: 'fast'"), (None, "not 'NoneType'")]
)
def test_rollout_metrics_refuse_a_value_that_is_no_number(value, error):
    with pytest.raises(ValueError, match=f"^rollout_metrics values must be numbers: .*{error}"):
        checked_rollout_metrics({"reward/em": value})


def test_merge_adds_the_step_time_and_the_rollout_throughput():
    own = {"time/old_logprobs_s": 1.5, "time/update_s": 2.0, "time/sync_s": 0.25, "reward/mean": 0.5}
    record = merge_rollout_metrics(own, {ROLLOUT_TIME: 4.0, GENERATED_TOKENS: 100.0, "reward/em": 0.75})
    assert record == {
        **own,
        ROLLOUT_TIME: 4.0,
        GENERATED_TOKENS: 100.0,
        "reward/em": 0.75,
        "time/step_s": 7.75,
        "throughput/rollout_tokens_per_s": 25.0,
    }


def test_merge_counts_a_missing_time_as_zero_and_gives_no_throughput_without_time_or_tokens():
    assert merge_rollout_metrics({"time/update_s": 2.0}, {GENERATED_TOKENS: 100.0}) == {
        "time/update_s": 2.0,
        GENERATED_TOKENS: 100.0,
        "time/step_s": 2.0,
    }
    zero_time = merge_rollout_metrics({"time/update_s": 2.0}, {ROLLOUT_TIME: 0.0, GENERATED_TOKENS: 100.0})
    assert "throughput/rollout_tokens_per_s" not in zero_time and zero_time["time/step_s"] == 2.0
    assert "throughput/rollout_tokens_per_s" not in merge_rollout_metrics({}, {ROLLOUT_TIME: 3.0})


def test_mismatch_is_the_max_and_mean_absolute_difference_over_action_tokens_only():
    mismatch = Mismatch()
    assert mismatch.result() == {"mismatch/max_abs": 0.0, "mismatch/mean_abs": 0.0, "mismatch/tokens": 0.0}
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -9.0, -4.0]])
    sampler = torch.tensor([[-1.5, -7.0, -2.75], [-0.5, 0.0, -4.125]])  # off the mask: differences of 5 and 9
    mismatch.add(trainer, sampler, torch.tensor([[True, False, True], [True, False, True]]))
    mismatch.add(trainer, sampler, torch.zeros(2, 3, dtype=torch.bool))  # no action tokens: nothing changes
    mismatch.add(trainer[:1], trainer[:1] + 0.0625, torch.tensor([[True, True, False]]))
    # |differences|: 0.5, 0.25, 0, 0.125, then 0.0625 twice
    assert mismatch.result() == {"mismatch/max_abs": 0.5, "mismatch/mean_abs": 1.0 / 6, "mismatch/tokens": 6.0}


def test_mismatch_combines_ranks_as_the_max_of_their_maxima_and_the_sums_of_their_sums(monkeypatch):
    mismatch = Mismatch()
    mismatch.add(torch.tensor([0.25, 1.0]), torch.tensor([0.0, 0.0]), torch.tensor([True, True]))
    fake_ranks(monkeypatch, step_metrics, (2.0, 3.0, 2), (0.5, 0.75, 3))
    mismatch.combine_ranks()
    # sums 1.25 + 3 + 0.75 = 5 over 2 + 2 + 3 = 7 tokens
    assert mismatch.result() == {"mismatch/max_abs": 2.0, "mismatch/mean_abs": 5.0 / 7, "mismatch/tokens": 7.0}


def test_loss_metrics_weigh_values_by_share_sum_counts_and_average_over_updates():
    metrics = LossMetrics()
    metrics.add({"loss": 2.0, "turns": 3.0}, share=0.25)
    metrics.add({"loss": 4.0, "turns": 5.0}, share=0.75)
    assert dict(metrics.update) == {"loss": 3.5, "turns": 8.0}
    metrics.end_update()
    assert dict(metrics.update) == {} and metrics.updates == 1
    metrics.add({"loss": 1.0, "turns": 2.0, "clipped_turns": 1.0}, share=1.0)
    metrics.end_update()
    # the loss averaged over 2 updates; counts are one epoch's: all of them over 1 epoch, half over 2
    assert metrics.result(epochs=1) == {"loss": 2.25, "turns": 10.0, "clipped_turns": 1.0}
    assert metrics.result(epochs=2) == {"loss": 2.25, "turns": 5.0, "clipped_turns": 0.5}


def test_loss_metrics_scale_weights_given_as_units_but_not_counts():
    metrics = LossMetrics()
    metrics.add({"loss": 2.0, "sequences": 1.0}, share=1.0)  # a part with 1 unit
    metrics.add({"loss": 4.0, "sequences": 3.0}, share=3.0)  # a part with 3 units
    metrics.scale(1 / 4)
    assert dict(metrics.update) == {"loss": 3.5, "sequences": 4.0}


def test_loss_metrics_sum_each_ranks_shares_of_the_update(monkeypatch):
    metrics = LossMetrics()
    metrics.add({"loss": 2.0, "turns": 3.0}, share=0.25)
    fake_ranks(monkeypatch, sharding, {"loss": 3.0, "turns": 4.0, "clipped_turns": 1.0})
    metrics.combine_ranks()
    assert dict(metrics.update) == {"loss": 3.5, "turns": 7.0, "clipped_turns": 1.0}
    metrics.end_update()
    assert metrics.result(epochs=1) == {"loss": 3.5, "turns": 7.0, "clipped_turns": 1.0}


def step_work() -> StepWork:
    """Two parts: paths of 4 and 2 tokens (rewards 1 and 0), then one of 3 (reward 0.5); 2 + 1 + 2 action tokens."""
    work = StepWork(batch_of((4, 2, 1.0), (2, 1, 0.0)))
    work.add(batch_of((3, 2, 0.5)))
    work.loss.add({"loss": 0.5, "sequences": 3.0}, share=1.0)
    work.loss.end_update()
    work.mismatch.add(torch.tensor([0.5]), torch.tensor([0.0]), torch.tensor([True]))
    work.optim["grad_norm"] += [2.0, 4.0]
    work.optim["lr"] += [1e-3, 5e-4]
    work.time_old, work.time_update = 0.5, 4.0
    return work


def test_step_result_is_the_record_of_the_parts_passes_and_updates():
    work = step_work()
    work.add_passes(
        [SimpleNamespace(tokens_forwarded=8, kernel=None), SimpleNamespace(tokens_forwarded=3, kernel=None)]
    )
    assert work.result(epochs=2) == {
        "reward/mean": 0.5,
        "reward/std": pytest.approx(math.sqrt(1 / 6), abs=1e-12),  # the population std of 1, 0, 0.5
        "reward/min": 0.0,
        "reward/max": 1.0,
        "policy/loss": 0.5,
        "policy/sequences": 1.5,  # summed over the updates, per epoch
        "mismatch/max_abs": 0.5,
        "mismatch/mean_abs": 0.5,
        "mismatch/tokens": 1.0,
        "optim/grad_norm": 3.0,
        "optim/lr": 5e-4,  # the last update's
        "optim/updates": 2.0,
        "optim/skipped_updates": 0.0,
        "tokens/trained": 9.0,  # 4 + 2 + 3 real tokens; the padding is not trained
        "tokens/action": 5.0,
        "batch/sequences": 3.0,
        "batch/tokens_forwarded": 11.0,  # no tree-attention pass: no batch/tree_* share
        "time/old_logprobs_s": 0.5,
        "time/update_s": 4.0,
        "throughput/update_tokens_per_s": 9.0 * 2 / 4.0,  # every epoch trains the tokens again
    }


def test_step_result_counts_skipped_updates_and_the_share_of_passes_by_tree_kernel():
    work = step_work()
    work.optim["grad_norm"].append(math.inf)
    work.optim["lr"].append(2.5e-4)
    micro = [SimpleNamespace(tokens_forwarded=t, kernel=k) for t, k in ((12, "batched"), (8, "varlen"), (5, None))]
    work.add_passes(micro, times=2)
    work.add_passes(micro[1:2])
    result = work.result(epochs=1)
    assert (result["optim/updates"], result["optim/skipped_updates"], result["optim/lr"]) == (3.0, 1.0, 2.5e-4)
    assert result["optim/grad_norm"] == math.inf
    assert result["batch/tokens_forwarded"] == 2 * (12 + 8 + 5) + 8
    # of 5 tree-attention passes (a padded pass has no kernel): 2 batched, 3 varlen
    shares = {name: value for name, value in result.items() if name.startswith("batch/tree_")}
    assert shares == {"batch/tree_batched_passes": 0.4, "batch/tree_flex_passes": 0.0, "batch/tree_varlen_passes": 0.6}


def test_step_result_combines_the_ranks_mismatch_only_when_asked(monkeypatch):
    fake_ranks(monkeypatch, step_metrics, (1.5, 1.5, 1))
    assert step_work().result(epochs=1)["mismatch/max_abs"] == 0.5
    combined = step_work().result(epochs=1, combine_ranks=True)
    assert (combined["mismatch/max_abs"], combined["mismatch/mean_abs"], combined["mismatch/tokens"]) == (1.5, 1.0, 2.0)


def record(reward: float, loss: float) -> dict[str, float]:
    return {"reward/mean": reward, "policy/loss": loss}


def test_step_log_writes_each_record_and_a_resume_drops_the_later_ones(tmp_path):
    log = StepLog(config(), tmp_path, show=False)
    for step in (1, 2, 3):
        log.log(step, record(0.25 * step, -0.5))
    log.close()
    assert [json.loads(line)["reward/mean"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [
        0.25,
        0.5,
        0.75,
    ]
    resumed = StepLog(config(), tmp_path, show=False)
    assert [r["step"] for r in resumed.open(resume_step=2).history] == [1, 2]
    resumed.log(3, record(1.0, 0.0))
    resumed.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(r["step"], r["reward/mean"]) for r in records] == [(1, 0.25), (2, 0.5), (3, 1.0)]


def test_step_log_keeps_records_in_memory_without_a_run_folder():
    log = StepLog(config(), None, show=False)
    log.log(1, record(0.5, 0.125))
    assert log.metrics is not None and log.metrics.history == [{"step": 1, "reward/mean": 0.5, "policy/loss": 0.125}]


def test_step_log_bar_counts_steps_from_the_resumed_one_and_shows_reward_and_loss(capsys, monkeypatch):
    monkeypatch.setattr(agents.progress, "LINE_INTERVAL", 0.0)  # a line at every count (stderr is no terminal here)
    log = StepLog(config(total_steps=5), None, show=True)
    log.log(3, record(0.5, -0.123456))  # the first step after a resume from step 2
    log.close()
    log.close_bar()  # closing twice is harmless
    lines = capsys.readouterr().err.splitlines()
    assert [re.sub(r" (in|after) \d\d:\d\d.*", "", line) for line in lines] == ["train: 2/5 steps"] + [
        "train: 3/5 steps"
    ] * 2
    assert lines[1].endswith(", reward=0.500, loss=-0.1235") and lines[2].endswith(", reward=0.500, loss=-0.1235")
