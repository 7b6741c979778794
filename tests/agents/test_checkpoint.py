"""Checkpoints: weights, optimiser, schedule and RNG round-trip exactly; folders are found and checked."""

import json
import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM, get_scheduler

from agents.models import tiny_llama
from agents.training.checkpoint import (
    checkpoint_name,
    get_rng_state,
    latest_checkpoint,
    load_checkpoint,
    save_checkpoint,
    set_rng_state,
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
