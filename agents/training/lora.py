"""LoRA: adapters injected into the policy for training, merged into its base weights for an engine.

:func:`with_lora` wraps a transformers model in peft's LoRA in place (only the adapters train).
:func:`merged_lora_weights` turns a full state dict of that model (local, or gathered from the
trainer ranks) into what an engine loads: each adapted layer's ``W + (α/r)·B·A`` under the plain
model's names, which is what peft's own merge computes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

    from agents.training.trainer_config import TrainerConfig

__all__ = ["merged_lora_weights", "with_lora"]


def with_lora(model: PreTrainedModel, cfg: TrainerConfig) -> PeftModel:
    """``model`` with LoRA adapters injected in place (only the adapters train)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        target_modules=cfg.lora_target_modules,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )  # no dropout in RL, as for the base model
    return get_peft_model(model, lora).eval()


def merged_lora_weights(model: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapted layers' merged weights (and their biases) from ``state``, ``model``'s full state dict.

    ``model`` is the transformers model holding the injected adapters (the layers' names and
    scalings come from it); ``state`` holds the full tensors under its ``state_dict`` names, on one
    process or gathered from the ranks. Only plain linear adapters merge this way: a DoRA or
    non-linear (embedding, convolution) adapter raises.
    """
    from peft.tuners.lora import Linear as LoraLinear
    from peft.tuners.lora import LoraLayer
    from peft.utils.other import transpose

    merged: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if not isinstance(module, LoraLayer):
                continue
            if not isinstance(module, LoraLinear) or any(module.use_dora.get(a) for a in module.active_adapters):
                kind = f"{type(module).__name__} adapter" + (" with DoRA" if isinstance(module, LoraLinear) else "")
                raise ValueError(
                    f"{name}: a LoRA {kind}, but only plain linear adapters merge into the engine's weights; target "
                    "linear layers only (TrainerConfig.lora_target_modules) or use an engine that shares the trainer's model"
                )
            weight = state[f"{name}.base_layer.weight"]
            for a in module.active_adapters:  # W + (α/r)·B·A, peft's get_delta_weight on the full tensors
                delta = state[f"{name}.lora_B.{a}.weight"] @ state[f"{name}.lora_A.{a}.weight"]
                weight = weight + transpose(delta, module.fan_in_fan_out) * module.scaling[a]
            merged[f"{name}.weight"] = weight
            if f"{name}.base_layer.bias" in state:
                merged[f"{name}.bias"] = state[f"{name}.base_layer.bias"]
    return merged
