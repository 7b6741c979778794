"""`agents train` end to end with the embedded SmolLM2-135M on multihop-qa: the run folder, resume, eval."""

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
from safetensors.torch import load_file

from agents.cli import main
from agents.training.metrics import read_jsonl

pytestmark = pytest.mark.slow

TRAIN = ["train", "--algo", "at2po", "--env", "multihop-qa", "--model", "smollm2-135m"]
# The cpu-demo preset made smaller still: 1 prompt, a tree of 2 chains + 1 branch, 16-token turns.
SMALL = [
    "--preset",
    "cpu-demo",
    "--prompts-per-step",
    "1",
    "--eval-questions",
    "1",
    "--set",
    "strategy.M=2",
    "--set",
    "strategy.L=1",
    "--set",
    "strategy.K=1",
    "--set",
    "sampling.max_new_tokens=16",
    "--set",
    "rollout.max_response_tokens=64",
    "--no-progress",
]


def test_agents_train_writes_a_run_resumes_it_exactly_and_agents_eval_loads_the_checkpoint(tmp_path, capsys):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main([*TRAIN, "--steps", "2", "--out", str(straight), *SMALL]) == 0
    printed = capsys.readouterr().out
    assert "before (step 0)" in printed and "after (step 2)" in printed  # the held-out before/after table

    checkpoint = straight / "checkpoints" / "step_000002"
    assert (checkpoint / "model" / "config.json").is_file() and (checkpoint / "trainer_state.pt").is_file()
    records = read_jsonl(straight / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert all(r["tree/leaves_per_prompt"] == 3 and r["batch/sequences"] == 3 for r in records)  # M + L·K
    assert all(r["mismatch/max_abs"] < 2e-3 for r in records)  # sampler and trainer agree (float32)
    # The engine's share of the rollout and its rows per decode pass (1 prompt of 3 leaves: at most 3 rows).
    assert all(0 < r["engine/busy_frac"] <= 1 and 1 <= r["engine/mean_rows"] <= 3 for r in records)
    assert [r["step"] for r in read_jsonl(straight / "heldout" / "metrics.jsonl")] == [0, 2]
    for image in ("curves.png", "heldout.png"):
        assert (straight / image).read_bytes()[:4] == b"\x89PNG"
    config = json.loads((straight / "config.json").read_text())
    assert config["strategy"]["M"] == 2 and config["loss"]["eps_high"] == 0.004 and config["budget_reward"] == -1.0
    # Below, only its weights and counters are compared: its optimiser state (1.1 GB) need not share the disk.
    (checkpoint / "trainer_state.pt").unlink()

    assert main([*TRAIN, "--steps", "1", "--out", str(resumed), *SMALL]) == 0
    assert main(["train", "--out", str(resumed), "--resume", "--steps", "2", "--no-progress"]) == 0
    capsys.readouterr()
    a, b = read_jsonl(straight / "metrics.jsonl")[-1], read_jsonl(resumed / "metrics.jsonl")[-1]
    for name in ("reward/mean", "tokens/generated", "tokens/trained", "tree/turns"):
        assert a[name] == b[name], name  # the same tasks and seeds give the same samples
    assert b["policy/loss"] == pytest.approx(a["policy/loss"], rel=1e-4, abs=1e-7)
    state = [
        json.loads((run / "checkpoints" / "step_000002" / "trainer_state.json").read_text())
        for run in (straight, resumed)
    ]
    assert state[0]["data_position"] == state[1]["data_position"] == {"epoch": 0, "offset": 2}
    weights = [
        load_file(run / "checkpoints" / "step_000002" / "model" / "model.safetensors") for run in (straight, resumed)
    ]
    assert max(float((weights[0][n] - weights[1][n]).abs().max()) for n in weights[0]) < 1e-6
    after = [read_jsonl(run / "heldout" / "metrics.jsonl")[-1] for run in (straight, resumed)]
    assert after[0]["reward"] == after[1]["reward"] and after[0]["step"] == after[1]["step"] == 2

    assert (
        main(
            [
                "eval",
                "--env",
                "multihop-qa",
                "--model",
                str(checkpoint / "model"),
                "--limit",
                "1",
                "--max-new-tokens",
                "16",
                "--max-response-tokens",
                "64",
                "--no-progress",
                "--transcripts",
                "0",
                "--json",
                str(tmp_path / "eval.json"),
            ]
        )
        == 0
    )
    assert json.loads((tmp_path / "eval.json").read_text())["results"]["multihop-qa"]["questions"] == 1
