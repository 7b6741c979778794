"""Checkpoints: weights, optimiser, schedule and RNG round-trip exactly; folders are found and checked;
writes are durable, and what crashes and damage leave behind is cleaned up or refused by name."""

import json
import os
import random
import socket
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM, get_scheduler

from agents.models import tiny_llama
from agents.training.checkpoint import (
    CorruptCheckpointError,
    checkpoint_name,
    get_rng_state,
    latest_checkpoint,
    latest_valid_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    remove_stale_temporaries,
    save_checkpoint,
    set_rng_state,
    verify_checkpoint,
)


def tiny_model(seed: int, layers: int = 2) -> LlamaForCausalLM:
    return tiny_llama(
        seed,
        vocab_size=40,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2048,
        pad_token_id=None,
    )


def trained(model):
    """An optimiser and constant schedule that have taken two AdamW steps on ``model``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = get_scheduler("constant", optimizer)
    for _ in range(2):
        model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits.sum().backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return optimizer, scheduler


def test_round_trip_restores_weights_optimiser_schedule_position_and_rng(tmp_path):
    source = tiny_model(0)
    optimizer, scheduler = trained(source)
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    path = save_checkpoint(
        tmp_path / checkpoint_name(2),
        model=source,
        optimizer=optimizer,
        scheduler=scheduler,
        step=2,
        data_position={"next_row": 16},
        config={"lr": 0.01},
    )
    expected_draws = (random.random(), float(np.random.rand()), torch.rand(4))
    assert path.name == "step_000002"
    assert sorted(p.name for p in path.iterdir()) == ["model", "trainer_state.json", "trainer_state.pt"]

    target = tiny_model(7)
    target_optimizer = torch.optim.AdamW(target.parameters(), lr=1e-2, weight_decay=0.01)
    target_scheduler = get_scheduler("constant", target_optimizer)
    checkpoint = load_checkpoint(path, model=target, optimizer=target_optimizer, scheduler=target_scheduler)
    assert (checkpoint.step, checkpoint.data_position, checkpoint.config) == (2, {"next_row": 16}, {"lr": 0.01})
    assert (random.random(), float(np.random.rand())) == expected_draws[:2]
    assert torch.equal(torch.rand(4), expected_draws[2])
    for (name, a), b in zip(source.state_dict().items(), target.state_dict().values()):
        assert torch.equal(a, b), name
    assert target.lm_head.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()  # still tied
    saved, loaded = optimizer.state_dict(), target_optimizer.state_dict()
    assert saved["param_groups"] == loaded["param_groups"]
    for index, state in saved["state"].items():
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key], loaded["state"][index][key])
    assert target_scheduler.state_dict() == scheduler.state_dict()


def test_model_folder_is_a_transformers_checkpoint(tmp_path):
    source = tiny_model(0)
    optimizer, scheduler = trained(source)
    path = save_checkpoint(tmp_path / "c", model=source, optimizer=optimizer, scheduler=scheduler, step=1)
    loaded = AutoModelForCausalLM.from_pretrained(path / "model")
    for (name, a), b in zip(source.state_dict().items(), loaded.state_dict().values()):
        assert torch.equal(a, b), name


def test_rng_state_survives_torch_load_weights_only(tmp_path):
    random.seed(5), np.random.seed(6), torch.manual_seed(7)
    torch.save(get_rng_state(), tmp_path / "rng.pt")
    draws = (random.gauss(0, 1), np.random.standard_normal(), torch.randn(2))
    set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    assert (random.gauss(0, 1), np.random.standard_normal()) == draws[:2]
    assert torch.equal(torch.randn(2), draws[2])


def test_latest_checkpoint_takes_the_highest_complete_step(tmp_path):
    assert latest_checkpoint(tmp_path / "missing") is None
    model = tiny_model(0)
    optimizer, scheduler = trained(model)
    for step in (2, 10, 9):
        save_checkpoint(
            tmp_path / checkpoint_name(step), model=model, optimizer=optimizer, scheduler=scheduler, step=step
        )
    (tmp_path / checkpoint_name(11)).mkdir()  # no trainer_state.json: not a checkpoint
    (tmp_path / ".step_000012.abc").mkdir()  # a temporary folder of an interrupted save
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000010"


def test_bad_data_position_fails_before_anything_is_written(tmp_path):
    model = tiny_model(0)
    optimizer, scheduler = trained(model)
    with pytest.raises(ValueError, match="data_position and config must be JSON-serialisable"):
        save_checkpoint(
            tmp_path / "c",
            model=model,
            optimizer=optimizer,
            scheduler=scheduler,
            step=1,
            data_position={"rows": {1, 2}},
        )
    assert list(tmp_path.iterdir()) == []


def test_loading_checks_the_folder_format_and_architecture(tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a checkpoint folder"):
        load_checkpoint(tmp_path, model=tiny_model(0))
    model = tiny_model(0)
    optimizer, scheduler = trained(model)
    path = save_checkpoint(tmp_path / "c", model=model, optimizer=optimizer, scheduler=scheduler, step=1)
    with pytest.raises(ValueError, match="has weights this model lacks"):
        load_checkpoint(path, model=tiny_model(0, layers=1))
    with pytest.raises(ValueError, match="lacks weights of this model"):
        load_checkpoint(path, model=tiny_model(0, layers=3))
    state = json.loads((path / "trainer_state.json").read_text())
    (path / "trainer_state.json").write_text(json.dumps({**state, "format": "other/1"}))
    with pytest.raises(ValueError, match="format 'other/1'"):
        load_checkpoint(path, model=model)


def test_lora_checkpoint_holds_only_the_adapter(tmp_path):
    from peft import LoraConfig, get_peft_model

    def lora_model(seed):
        model = get_peft_model(tiny_model(0), LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
        torch.manual_seed(seed)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.data.normal_()
        return model

    source = lora_model(1)
    optimizer = torch.optim.AdamW([p for p in source.parameters() if p.requires_grad])
    scheduler = get_scheduler("constant", optimizer)
    path = save_checkpoint(tmp_path / "c", model=source, optimizer=optimizer, scheduler=scheduler, step=1)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (path / "model").iterdir()}
    target = lora_model(2)
    load_checkpoint(path, model=target)
    for (name, a), b in zip(source.state_dict().items(), target.state_dict().values()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match="holds a LoRA adapter; load it into a LoRA policy"):
        load_checkpoint(path, model=tiny_model(0))


# -- durability, crashes and damage ------------------------------------------------------------


def save(model, optimizer, scheduler, folder, step):
    return save_checkpoint(
        folder / checkpoint_name(step), model=model, optimizer=optimizer, scheduler=scheduler, step=step
    )


def dead_pid() -> int:
    """The pid of a process that has ended."""
    return int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True).stdout)


def test_every_file_and_folder_is_fsynced_before_the_rename_and_the_parent_after(tmp_path, monkeypatch):
    model = tiny_model(0)
    optimizer, scheduler = trained(model)
    events = []
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(source, target):
        events.append(("rename", str(source), str(target)))
        real_rename(source, target)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    path = save(model, optimizer, scheduler, tmp_path, 1)

    (publish,) = [event for event in events if event[0] == "rename"]
    _, tmp, target = publish
    assert target == str(path)
    before, after = events[: events.index(publish)], events[events.index(publish) + 1 :]
    synced = {Path(name).relative_to(tmp).as_posix() for kind, name in before if name.startswith(tmp)}
    assert {p.relative_to(path).as_posix() for p in path.rglob("*")} | {"."} <= synced  # files, and folders' entries
    assert after == [("fsync", str(tmp_path))]  # the rename itself


def test_a_save_killed_midway_leaves_a_temporary_folder_that_the_next_save_removes(tmp_path):
    # A process that saves step 1, then dies by SIGKILL while writing step 2 (its model/ written).
    script = f"""
import os, signal, torch
from transformers import get_scheduler
from agents.models import tiny_llama
from agents.training.checkpoint import save_checkpoint
model = tiny_llama(0, vocab_size=40, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                   num_attention_heads=2, num_key_value_heads=1, pad_token_id=None)
optimizer = torch.optim.AdamW(model.parameters())
scheduler = get_scheduler("constant", optimizer)
save_checkpoint({str(tmp_path / "step_000001")!r}, model=model, optimizer=optimizer, scheduler=scheduler, step=1)
torch.save = lambda *args, **kwargs: os.kill(os.getpid(), signal.SIGKILL)
save_checkpoint({str(tmp_path / "step_000002")!r}, model=model, optimizer=optimizer, scheduler=scheduler, step=2)
"""
    killed = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert killed.returncode == -9, killed.stderr
    (left,) = [p for p in tmp_path.iterdir() if p.name.startswith(".step_000002.tmp.")]
    assert left.name.endswith(f"@{socket.gethostname()}") and (left / "model" / "model.safetensors").is_file()
    assert latest_checkpoint(tmp_path) == tmp_path / "step_000001"  # the interrupted save is no checkpoint
    verify_checkpoint(tmp_path / "step_000001")

    model = tiny_model(0)
    optimizer, scheduler = trained(model)
    save(model, optimizer, scheduler, tmp_path, 3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001", "step_000003"]


def test_only_temporary_folders_whose_writer_is_gone_are_removed(tmp_path):
    host = socket.gethostname()
    names = {
        "dead": f".step_000004.tmp.abcd1234.{dead_pid()}@{host}",
        "live": f".step_000004.tmp.abcd1234.{os.getppid()}@{host}",  # pytest's parent runs
        "ours": f".step_000004.tmp.sharded.{os.getpid()}@{host}",  # this process writes nothing now
        "elsewhere": f".step_000004.tmp.abcd1234.1@{host}-other",  # another host's pid cannot be checked
        "old-random": ".step_000004.k2j3h4k_",  # named by an older version: writer unknown
        "old-sharded": ".step_000004.writing",
    }
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "shard").write_bytes(b"x" * 100)
    (tmp_path / ".cache").mkdir()  # not ours
    (tmp_path / "step_000004").mkdir()

    assert sorted(p.name for p in remove_stale_temporaries(tmp_path)) == sorted([names["dead"], names["ours"]])
    # At a run's start no process of the run writes, so only a live process of this host keeps its folder.
    assert sorted(p.name for p in remove_stale_temporaries(tmp_path, all_writers_gone=True)) == sorted(
        [names["elsewhere"], names["old-random"], names["old-sharded"]]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([".cache", names["live"], "step_000004"])


def _truncate(file):
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


def _overwrite_start(file):
    data = file.read_bytes()
    file.write_bytes(b"\xff" * 64 + data[64:])


def _damage_pickle(file):
    """Overwrite the pickle inside the archive, leaving the archive's directory whole (torch.load fails)."""
    data = bytearray(file.read_bytes())
    info = next(i for i in zipfile.ZipFile(file).infolist() if i.filename.endswith("data.pkl"))
    name_length, extra_length = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    start = info.header_offset + 30 + name_length + extra_length
    data[start : start + info.file_size] = b"X" * info.file_size
    file.write_bytes(bytes(data))


@pytest.mark.parametrize(
    ("file", "damage"),
    [
        ("trainer_state.json", _truncate),
        ("trainer_state.json", lambda f: f.write_text("[]")),
        ("trainer_state.json", lambda f: f.write_text(json.dumps({**json.loads(f.read_text()), "step": "2"}))),
        ("model/config.json", _truncate),
        ("model/model.safetensors", _truncate),
        ("model/model.safetensors", _overwrite_start),
        ("model/model.safetensors", lambda f: f.unlink()),
        ("trainer_state.pt", _truncate),
        ("trainer_state.pt", _overwrite_start),
        ("trainer_state.pt", _damage_pickle),
    ],
)
def test_a_damaged_file_is_named_and_the_previous_checkpoint_offered(tmp_path, file, damage):
    model = tiny_model(0)
    optimizer, scheduler = trained(model)
    first = save(model, optimizer, scheduler, tmp_path, 1)
    newest = save(model, optimizer, scheduler, tmp_path, 2)
    damage(newest / file)

    target = tiny_model(7)
    before = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    with pytest.raises(CorruptCheckpointError) as raised:
        load_checkpoint(newest, model=target)
    message = str(raised.value)
    assert message.startswith(f"{newest / file} is corrupt: ")
    assert f"load the previous checkpoint, {first}, instead" in message
    assert raised.value.file == newest / file
    assert all(torch.equal(before[name], tensor) for name, tensor in target.state_dict().items())  # untouched

    skipped = []
    expected = first if damage is not _damage_pickle else newest  # only torch.load reads the whole pickle
    assert latest_valid_checkpoint(tmp_path, on_skip=lambda path, error: skipped.append((path, error.file))) == expected
    assert skipped == ([] if expected == newest else [(newest, newest / file)])
    assert latest_valid_checkpoint(tmp_path, older_than=newest) == first


def test_a_damaged_only_checkpoint_says_that_none_is_intact(tmp_path):
    model = tiny_model(0)
    optimizer, scheduler = trained(model)
    path = save(model, optimizer, scheduler, tmp_path, 1)
    (path / "model" / "config.json").write_text("{")
    with pytest.raises(CorruptCheckpointError, match=f"no earlier checkpoint in {tmp_path} is intact"):
        load_checkpoint(path, model=model)
    assert latest_valid_checkpoint(tmp_path) is None


def test_saving_over_a_checkpoint_replaces_it_whole(tmp_path):
    model = tiny_model(0)
    optimizer, scheduler = trained(model)
    path = save(model, optimizer, scheduler, tmp_path, 1)
    (path / "model" / "model.safetensors").write_bytes(b"damaged")
    (path / "stray").write_text("from before")
    save(model, optimizer, scheduler, tmp_path, 1)
    verify_checkpoint(path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000001"] and not (path / "stray").exists()


def test_pruning_keeps_the_newest_intact_checkpoints_and_never_the_last_intact_one(tmp_path):
    model = tiny_model(0)
    optimizer, scheduler = trained(model)
    paths = [save(model, optimizer, scheduler, tmp_path, step) for step in (1, 2, 3, 4)]
    _truncate(paths[3] / "model" / "model.safetensors")  # the newest is damaged: it counts for nothing

    assert prune_checkpoints(tmp_path, keep=2) == [paths[0]]  # 3 and 2 are the two newest intact ones
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000002", "step_000003", "step_000004"]
    assert prune_checkpoints(tmp_path, keep=1) == [paths[1]]
    _truncate(paths[2] / "trainer_state.pt")
    assert prune_checkpoints(tmp_path, keep=1) == []  # no intact checkpoint is left to count: nothing goes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_000003", "step_000004"]  # no temporary left
    assert prune_checkpoints(tmp_path / "absent", keep=1) == []
    with pytest.raises(
        ValueError, match=r"keep must be an int >= 1 \(the newest intact checkpoint always stays\), got 0"
    ):
        prune_checkpoints(tmp_path, keep=0)


def test_a_checkpoint_being_pruned_is_renamed_away_before_it_is_deleted(tmp_path, monkeypatch):
    model = tiny_model(0)
    optimizer, scheduler = trained(model)
    old, new = (save(model, optimizer, scheduler, tmp_path, step) for step in (1, 2))
    renames = []
    real_rename = os.rename
    monkeypatch.setattr(os, "rename", lambda a, b: (renames.append((Path(a), Path(b))), real_rename(a, b))[1])
    assert prune_checkpoints(tmp_path, keep=1) == [old]
    assert renames == [(old, tmp_path / f".step_000001.tmp.removed.{os.getpid()}@{socket.gethostname()}")]
    assert remove_stale_temporaries(tmp_path) == []  # and deleted: nothing of it is left for the next save
    assert [p.name for p in tmp_path.iterdir()] == [new.name]
