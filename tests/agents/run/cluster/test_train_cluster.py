"""`agents train` on the embedded model with two FSDP2 trainer ranks and two rollout workers (real Ray, gloo).

The issue's command line, with one prompt a step, one held-out question and gradient checkpointing so
that two ranks, two workers and the driver fit a 2-core, 24 GiB machine in a few minutes (without
checkpointing each rank's activations peak at ~9 GiB on this preset).
"""

import json
import shlex
import shutil

import pytest

from agents.cli import main
from agents.training.metrics import read_jsonl

LINE = shlex.split(
    "train --algo at2po --env multihop-qa --model smollm2-135m --preset cpu-demo --trainer-ranks 2 "
    "--rollout-workers 2 --steps 2 --prompts-per-step 1 --eval-questions 1 --checkpoint-every 1 "
    "--set trainer.gradient_checkpointing=true --no-progress"
)


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_the_cluster_command_line_writes_the_run_folder_and_resumes_exactly(ray_local, tmp_path):
    out = tmp_path / "run"
    assert main([*LINE, "--out", str(out)]) == 0
    records = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["batch/sequences"] == 6 and r["cluster/worker_failures"] == 0 for r in records)
    assert records[1]["sync/bytes"] > 500e6  # SmolLM2's float32 weights, the tied matrix once
    saved = json.loads((out / "config.json").read_text())
    assert (saved["cluster"]["trainer_ranks"], saved["cluster"]["rollout_workers"]) == (2, 2)
    # The run folder of a single-process run, plus the sharded optimiser state in each checkpoint.
    assert {"config.json", "metrics.jsonl", "checkpoints", "curves.png", "heldout"} <= {p.name for p in out.iterdir()}
    last = out / "checkpoints" / "step_000002"
    assert (last / "model" / "config.json").is_file() and (last / "sharded").is_dir()

    # Back to the step-1 checkpoint, then --resume: step 2 repeats.
    shutil.rmtree(last)
    assert main([*LINE, "--out", str(out), "--resume"]) == 0
    again = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in again] == [1, 2]
    assert again[1]["reward/mean"] == records[1]["reward/mean"]
    assert again[1]["tokens/generated"] == records[1]["tokens/generated"]
    assert again[1]["policy/loss"] == pytest.approx(records[1]["policy/loss"], rel=1e-5, abs=1e-7)
