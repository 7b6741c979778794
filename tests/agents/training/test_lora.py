"""LoRA on a tiny Llama: the adapters injected, and their merge W + (α/r)·B·A into the engine's weights."""

import copy

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from agents.models import tiny_llama
from agents.training.lora import merged_lora_weights, with_lora
from agents.training.trainer_config import TrainerConfig

ATTENTION = ("q_proj", "v_proj")


def config(**overrides) -> TrainerConfig:
    return TrainerConfig(**{"lr": 1e-3, "progress": False, "report_to": ("none",), **overrides})


def adapted(**model_config) -> tuple[torch.nn.Module, PeftModel]:
    """The tiny Llama with rank-4, α=8 adapters on q_proj and v_proj, their B set non-zero."""
    model = tiny_llama(**model_config)
    peft = with_lora(model, config(lora_rank=4, lora_alpha=8, lora_target_modules=list(ATTENTION)))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, parameter in peft.named_parameters():
            if "lora_B" in name:  # peft starts B at zero, which would make every merge W itself
                parameter.normal_()
    return model, peft


def state_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}


def test_with_lora_injects_trainable_adapters_in_place_and_freezes_the_rest():
    model = tiny_llama()
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.no_grad():
        before = model(input_ids=ids).logits
    peft = with_lora(model, config(lora_rank=4, lora_alpha=8, lora_target_modules=list(ATTENTION)))
    assert isinstance(peft, PeftModel) and not peft.training  # eval: no dropout, as for the base model
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear"  # peft's, in the model passed
    assert model.model.layers[0].self_attn.q_proj.scaling["default"] == 2.0  # α / r
    assert isinstance(model.model.layers[0].self_attn.q_proj.lora_dropout["default"], torch.nn.Identity)
    trainable = {name: p.numel() for name, p in peft.named_parameters() if p.requires_grad}
    # per layer: q_proj 32→32 (A 4×32, B 32×4), v_proj 32→16 (A 4×32, B 16×4)
    assert sorted(trainable) == sorted(
        f"base_model.model.model.layers.{layer}.self_attn.{module}.lora_{ab}.default.weight"
        for layer in (0, 1)
        for module in ATTENTION
        for ab in "AB"
    )
    assert sum(trainable.values()) == 2 * (128 + 128 + 128 + 64)
    with torch.no_grad():  # B starts at zero: the adapted policy is the base policy
        torch.testing.assert_close(peft(input_ids=ids).logits, before, atol=0, rtol=0)


def test_with_lora_on_all_linear_adapts_every_linear_layer_but_the_output_head():
    model = tiny_llama()
    with_lora(model, config(lora_rank=2))
    adapted_layers = sorted(name for name, module in model.named_modules() if hasattr(module, "lora_A"))
    projections = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    assert adapted_layers == sorted(
        f"model.layers.{layer}.{'self_attn' if p[0] in 'qkvo' else 'mlp'}.{p}" for layer in (0, 1) for p in projections
    )


def test_merged_weights_are_w_plus_alpha_over_r_times_b_a_under_the_plain_names():
    model, _ = adapted()
    state = state_of(model)
    merged = merged_lora_weights(model, state)
    # only the adapted layers, without peft's base_layer and adapter names
    assert sorted(merged) == sorted(f"model.layers.{i}.self_attn.{m}.weight" for i in (0, 1) for m in ATTENTION)
    for layer in (0, 1):
        for module in ATTENTION:
            prefix = f"model.layers.{layer}.self_attn.{module}"
            delta = state[f"{prefix}.lora_B.default.weight"] @ state[f"{prefix}.lora_A.default.weight"]
            assert delta.abs().max() > 0.1  # a merge that dropped ΔW would not pass
            expected = state[f"{prefix}.base_layer.weight"] + 2.0 * delta
            torch.testing.assert_close(merged[f"{prefix}.weight"], expected, atol=0, rtol=0)


def test_merged_weights_equal_peft_merge_and_carry_the_base_bias():
    model, peft = adapted(attention_bias=True)
    merged = merged_lora_weights(model, state_of(model))
    plain = state_of(copy.deepcopy(peft).merge_and_unload())
    assert len(merged) == 8  # four adapted layers, each a weight and a bias
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, plain[name], atol=1e-6, rtol=1e-6)
    bias = "model.layers.1.self_attn.v_proj.bias"
    assert torch.equal(merged[bias], model.model.layers[1].self_attn.v_proj.base_layer.bias)


def test_merged_weights_are_taken_from_the_state_not_from_the_model():
    # the state may be gathered from other ranks: its tensors, not the local module's, are merged
    model, _ = adapted()
    state = {name: torch.zeros_like(tensor) for name, tensor in state_of(model).items()}
    prefix = "model.layers.0.self_attn.q_proj"
    state[f"{prefix}.base_layer.weight"] = torch.full((32, 32), 0.5)
    state[f"{prefix}.lora_A.default.weight"] = torch.ones(4, 32)
    state[f"{prefix}.lora_B.default.weight"] = torch.full((32, 4), 0.25)
    merged = merged_lora_weights(model, state)
    # 0.5 + (8/4) · Σ_r 0.25 · 1 over the rank of 4
    assert torch.equal(merged[f"{prefix}.weight"], torch.full((32, 32), 2.5))
    assert torch.equal(merged["model.layers.1.self_attn.v_proj.weight"], torch.zeros(16, 32))


def test_a_dora_adapter_does_not_merge_into_the_engine_weights():
    # Embedding adapters: tests/agents/training/test_trainer.py
    model = tiny_llama()
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(
        ValueError, match=r"^model\.layers\.0\.self_attn\.q_proj: a LoRA Linear adapter with DoRA, but only plain"
    ):
        merged_lora_weights(model, state_of(model))
