"""Reporters besides metrics.jsonl: TensorBoard and Weights & Biases (offline), from the log to ``agents train``.

W&B runs offline here (no network, no account); each test reads back what the run wrote with a
reader of W&B's ``.wandb`` transaction log (a LevelDB-style log of protobuf records; the client
ships no reader of its own).
"""

import json
import re
import struct
import sys
import time
from pathlib import Path

import pytest

import agentenv
from agents.cli import main
from agents.eval.heldout import SCORES, HeldOut, HeldOutLog, Score
from agents.models import tiny_llama
from agents.rollout.tree import RolloutTree
from agents.run.config import RESUMABLE, TrainConfig, merge
from agents.run.folder import CONFIG_FILE
from agents.run.train import train
from agents.training import reporting
from agents.training.metrics import MetricsLog, read_jsonl
from agents.training.reporting import WANDB_INSTALL, check_report_to
from agents.training.trainer import Trainer, TrainerConfig

pytestmark = pytest.mark.timeout(300)  # a W&B service that never answers fails the test instead of hanging it


@pytest.fixture(autouse=True)
def offline_wandb(monkeypatch, tmp_path):
    """W&B offline and quiet, its caches and settings in the test's folder, no WANDB_DIR or project of the shell."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_INIT_TIMEOUT", "60")
    for name in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(name, str(tmp_path / "wandb-home" / name.lower()))
    for name in ("WANDB_DIR", "WANDB_PROJECT", "WANDB_RUN_ID", "WANDB_RESUME"):
        monkeypatch.delenv(name, raising=False)
    yield
    assert not reporting._RUNS, "a W&B run was left open"


# -- reading an offline run back ------------------------------------------------------------------

_BLOCK = 32768  # the log's block size; a record header (crc32, length, type) never straddles a block


def wandb_records(path: Path) -> list:
    """The protobuf ``Record`` messages of a ``.wandb`` file, in order."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    if not data:
        return []
    assert data[:4] == b":W&B", path
    records, position, pending = [], 7, b""  # after the file header: magic, 0xBEE1, version
    while position + 7 <= len(data):
        if _BLOCK - position % _BLOCK < 7:  # a block's tail too short for a header is padding
            position += _BLOCK - position % _BLOCK
            continue
        _crc, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0 and length == 0:
            position += 7
            continue
        pending += data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a FULL record, or the LAST piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def offline_runs(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "wandb").glob("offline-run-*"), key=lambda folder: folder.name)


def item_key(item) -> str:
    """The name of a logged item: ``key``, or a flat name's one-part ``nested_key``."""
    return item.key or ".".join(item.nested_key)


def read_run(folder: Path) -> dict:
    """An offline run's id, project, name, config and logged rows (W&B's own ``_`` keys left out)."""
    (log,) = folder.glob("run-*.wandb")
    # finish() returns once W&B's service has the run's exit; its writer may close the file a moment later.
    deadline = time.monotonic() + 30
    while not (records := wandb_records(log)) or records[-1].WhichOneof("record_type") != "exit":
        assert time.monotonic() < deadline, f"{log} has no exit record"
        time.sleep(0.05)
    run, rows = None, []
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
        elif kind == "history":
            row = {item_key(item): json.loads(item.value_json) for item in record.history.item}
            rows.append({key: value for key, value in row.items() if not key.startswith("_")})
    assert run is not None
    config = {item_key(item): json.loads(item.value_json) for item in run.config.update if item_key(item) != "_wandb"}
    return {"id": run.run_id, "project": run.project, "name": run.display_name, "config": config, "rows": rows}


# -- report_to ------------------------------------------------------------------------------------


def test_report_to_takes_names_of_reporters_and_none_alone():
    assert check_report_to("wandb") == ("wandb",)
    assert check_report_to(["tensorboard", "wandb", "tensorboard"]) == ("tensorboard", "wandb")
    assert TrainerConfig(report_to=["none"]).report_to == ("none",)
    assert TrainerConfig(report_to=("wandb",)).to_dict()["report_to"] == ["wandb"]  # JSON-ready, as config.json
    with pytest.raises(
        ValueError, match=r"^--report-to has no reporter 'nosuch'; choose from tensorboard, wandb, none"
    ):
        check_report_to(["tensorboard", "nosuch"], "--report-to")
    with pytest.raises(ValueError, match="report_to 'none' means nothing besides metrics.jsonl, so it cannot go with"):
        TrainerConfig(report_to=["none", "tensorboard"])
    with pytest.raises(ValueError, match="TrainerConfig.report_to takes reporter names"):
        TrainerConfig(report_to=None)
    assert {"trainer.report_to", "trainer.wandb_project"} <= RESUMABLE  # where metrics go may change on resume
    assert CONFIG_FILE == reporting._RUN_CONFIG  # W&B attaches the file that agents train writes


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (
            ["--report-to", "nosuch"],
            "--report-to has no reporter 'nosuch'; choose from tensorboard, wandb, none (several allowed)",
        ),
        (
            ["--report-to", "none", "tensorboard"],
            "--report-to 'none' means nothing besides metrics.jsonl, so it cannot go with tensorboard",
        ),
    ],
)
def test_agents_train_refuses_a_bad_report_to_in_one_line(capsys, tmp_path, flags, message):
    with pytest.raises(SystemExit) as exited:
        main(["train", "--preset", "cpu-demo", *flags, "--out", str(tmp_path / "run")])
    assert exited.value.code == 2 and capsys.readouterr().err == f"agents train: error: {message}\n"
    assert not (tmp_path / "run").exists()


def test_agents_train_passes_report_to_and_the_project_to_the_trainer(capsys):
    for flags, report_to in (([], ["tensorboard"]), (["--report-to", "none"], ["none"])):
        assert main(["train", "--algo", "grpo", *flags, "--print-config"]) == 0
        assert json.loads(capsys.readouterr().out)["trainer"]["report_to"] == report_to
    assert main(["train", "--report-to", "tensorboard", "wandb", "--wandb-project", "mine", "--print-config"]) == 0
    trainer = json.loads(capsys.readouterr().out)["trainer"]
    assert trainer["report_to"] == ["tensorboard", "wandb"] and trainer["wandb_project"] == "mine"


MISSING = f"report_to 'wandb' needs the wandb package: {WANDB_INSTALL}"


def test_a_missing_wandb_client_says_how_to_install_it(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    with pytest.raises(ImportError, match=f"^{re.escape(MISSING)}$"):
        MetricsLog(tmp_path / "log", report_to=["tensorboard", "wandb"])
    with pytest.raises(ImportError, match="pip install 'agentenv\\[wandb\\]'"):
        Trainer("no/such-model", TrainerConfig(report_to=("wandb",)), out_dir=tmp_path / "trainer")  # before loading
    with pytest.raises(SystemExit) as exited:
        main(["train", "--preset", "cpu-demo", "--report-to", "wandb", "--out", str(tmp_path / "run"), "--no-progress"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and err == f"agents train: error: {MISSING}\n"
    assert not (tmp_path / "run").exists()  # nothing written, no model loaded


# -- the W&B run ----------------------------------------------------------------------------------


def test_one_offline_wandb_run_per_run_folder_with_its_config_and_the_held_out_scores(tmp_path):
    run_dir = tmp_path / "run-a"
    run_dir.mkdir()
    config = {"algo": "grpo", "trainer": {"lr": 1e-5, "report_to": ["wandb"]}}
    (run_dir / CONFIG_FILE).write_text(json.dumps(config))  # what agents train writes first
    start = time.perf_counter()
    log = MetricsLog(run_dir, report_to=["wandb"], wandb_config={"ignored": True}, wandb_project="tests")
    heldout = HeldOutLog(run_dir, report_to=["wandb"])  # shares the run folder's W&B run
    started = time.perf_counter() - start
    log.log(1, {"reward/mean": 0.25, "policy/loss": -1.5})
    evaluation = HeldOut(1, 2, {name: Score(0.5, 0.25, 0.75) for name in SCORES}, seconds=3.0)
    heldout.add(evaluation)
    log.log(2, {"reward/mean": 0.75, "policy/loss": float("nan")})
    start = time.perf_counter()
    heldout.close()
    log.close()
    finished = time.perf_counter() - start
    print(f"W&B offline: start {started:.2f} s, finish {finished:.2f} s")

    (folder,) = offline_runs(run_dir)  # one W&B run, in the run folder
    run = read_run(folder)
    assert run["id"] == (run_dir / "wandb" / "run_id.txt").read_text().strip() and folder.name.endswith(run["id"])
    assert (run["project"], run["name"]) == ("tests", "run-a")
    assert run["config"] == config
    assert run["rows"][0] == {"step": 1, "reward/mean": 0.25, "policy/loss": -1.5}
    assert run["rows"][1] == {"step": 1, **{f"heldout/{name}": value for name, value in evaluation.record().items()}}
    assert run["rows"][2]["step"] == 2 and run["rows"][2]["reward/mean"] == 0.75
    assert run["rows"][2]["policy/loss"] != run["rows"][2]["policy/loss"]  # NaN stays NaN
    assert not (run_dir / "tensorboard").exists() and not (run_dir / "heldout" / "tensorboard").exists()
    assert [record["step"] for record in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2]


def test_resume_continues_the_same_wandb_run_and_a_new_run_starts_another(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    monkeypatch.setenv("WANDB_PROJECT", "from-env")
    log = MetricsLog(run_dir, report_to=["wandb"], wandb_config={"seed": 3})
    log.log(1, {"x": 1.0})
    log.log(2, {"x": 2.0})
    log.close()
    resumed = MetricsLog(run_dir, report_to=["tensorboard", "wandb"], resume_step=1)
    resumed.log(2, {"x": 20.0})
    resumed.close()
    first, second = (read_run(folder) for folder in offline_runs(run_dir))
    assert first["id"] == second["id"] and first["project"] == second["project"] == "from-env"
    assert first["config"] == {"seed": 3}
    # W&B keeps what it was sent: step 2 of the interrupted run stays, the resumed run logs step 2 again.
    assert [row["x"] for row in first["rows"]] == [1.0, 2.0] and second["rows"] == [{"step": 2, "x": 20.0}]
    assert [record["x"] for record in read_jsonl(run_dir / "metrics.jsonl")] == [1.0, 20.0]

    other = tmp_path / "other"
    MetricsLog(other, report_to="wandb").close()
    assert read_run(offline_runs(other)[0])["id"] != first["id"]


def test_wandb_dir_of_the_shell_keeps_its_place(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    MetricsLog(tmp_path / "run", report_to=["wandb"]).close()
    assert (tmp_path / "run" / "wandb" / "run_id.txt").is_file() and not offline_runs(tmp_path / "run")
    assert len(list((tmp_path / "elsewhere").glob("wandb/offline-run-*"))) == 1


# -- the trainer and agents train -----------------------------------------------------------------


def training_paths():
    """Two paths of one tree, with advantages: enough for a trainer step."""
    tree = RolloutTree([1, 2, 3, 4])
    tree.add_turn(tree.root, action_ids=[5, 6, 7], sampler_logprobs=[-1.0, -2.0, -1.5], terminal=True, reward=1.0)
    tree.add_turn(tree.root, action_ids=[8, 9], sampler_logprobs=[-2.5, -0.5], terminal=True, reward=0.0)
    for node in tree.nodes():
        node.advantage = node.reward - 0.5 if node.terminal else 0.0
    return tree.paths()


@pytest.mark.parametrize(
    ("report_to", "folders"), [(("none",), set()), (("tensorboard", "wandb"), {"tensorboard", "wandb"})]
)
async def test_the_trainer_writes_what_report_to_names(tmp_path, report_to, folders):
    config = TrainerConfig(lr=1e-3, progress=False, report_to=report_to)
    trainer = Trainer(tiny_llama(0, vocab_size=16), config, out_dir=tmp_path / "run")
    records = [await trainer.step(training_paths()) for _ in range(2)]
    trainer.close()
    run_dir = tmp_path / "run"
    assert {path.name for path in run_dir.iterdir() if path.is_dir()} == folders
    assert len(read_jsonl(run_dir / "metrics.jsonl")) == 2
    if "wandb" in folders:
        assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
        (folder,) = offline_runs(run_dir)
        run = read_run(folder)
        assert run["config"] == {"trainer": config.to_dict()}  # no config.json: the trainer's own
        for step, (row, record) in enumerate(zip(run["rows"], records), start=1):
            assert row == {"step": step, **record}


class Counting(agentenv.Env):
    """One turn; the reward is the share of the answer's characters that are digits."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return "Write digits.", {}

    def step(self, action):
        return "", sum(ch.isdigit() for ch in action) / max(1, len(action)), True, False, {}


async def test_agents_train_logs_one_wandb_run_that_a_resume_continues(tiny_model, tmp_path, module_envs):
    module_envs("reporting-tests/digits-v0", Counting)
    values = merge(
        TrainConfig(algo="grpo").to_dict(),
        {
            "env": "reporting-tests/digits",
            "model": tiny_model,
            "steps": 1,
            "prompts_per_step": 1,
            "holdout": 2,
            "eval_questions": 2,
            "eval_before": False,
            "strategy": {"n": 2},
            "trainer": {"lr": 1e-3, "mini_batches": 1, "report_to": ["tensorboard", "wandb"]},
            "sampling": {"max_new_tokens": 4},
            "rollout": {"max_response_tokens": 4},
        },
    )
    run_dir = tmp_path / "run"
    await train(TrainConfig.from_dict(values), run_dir, progress=False, log=lambda line: None)
    # The resume reports to W&B alone: where metrics go may change.
    values = merge(values, {"steps": 2, "trainer": {"report_to": ["wandb"]}})
    await train(TrainConfig.from_dict(values), run_dir, resume=True, progress=False, log=lambda line: None)

    first, second = (read_run(folder) for folder in offline_runs(run_dir))
    saved = json.loads((run_dir / CONFIG_FILE).read_text())
    assert first["id"] == second["id"] and first["name"] == "run" and second["config"] == saved
    assert first["project"] == "agentenv"
    assert [(row["step"], "reward/mean" in row, "heldout/em" in row) for row in first["rows"] + second["rows"]] == [
        (1, True, False),
        (1, False, True),
        (2, True, False),
        (2, False, True),
    ]
    assert (run_dir / "tensorboard").is_dir() and (run_dir / "heldout" / "tensorboard").is_dir()
