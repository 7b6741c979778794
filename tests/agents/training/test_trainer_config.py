"""agents.training.trainer_config: every bad value is refused with the field, the value and the fix."""

import json

import pytest

from agents.training.losses import ppo_clip_loss
from agents.training.trainer_config import TrainerConfig


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"loss": "ppo"}, "unknown loss 'ppo'; choose one of ppo_clip, gspo, atpo, aepo"),
        ({"loss": 3}, "TrainerConfig.loss must be a name or a callable, got int"),
        ({"micro_batch_size": 0}, "TrainerConfig.micro_batch_size must be a finite number > 0, got 0"),
        ({"lr": float("nan")}, "TrainerConfig.lr must be a finite number > 0, got nan"),
        ({"kl_coef": -0.1}, "TrainerConfig.kl_coef must be a finite number >= 0, got -0.1"),
        ({"micro_batch_tokens": 0}, "micro_batch_tokens must be an int >= 1 or None, got 0"),
        ({"micro_batch_tokens": True}, "micro_batch_tokens must be an int >= 1 or None, got True"),
        ({"score_chunk": 0}, "TrainerConfig.score_chunk must be an int >= 1 or None, got 0"),
        ({"total_steps": 0}, "TrainerConfig.total_steps must be >= 1 or None, got 0"),
        ({"checkpoint_layers": 1.5}, r"checkpoint_layers must be a fraction in \(0, 1\], got 1.5"),
        ({"packing": "dense"}, "TrainerConfig.packing must be 'tree', 'flat' or 'padded', got 'dense'"),
        ({"tree_kernel": "cuda"}, "TrainerConfig.tree_kernel must be one of 'auto', "),
        ({"old_logprobs": "vllm"}, "TrainerConfig.old_logprobs must be 'recompute' or 'sampler', got 'vllm'"),
        ({"decoupled": True, "old_logprobs": "sampler"}, "decoupled=True needs old_logprobs='recompute'"),
        ({"compute_dtype": "float16"}, "compute_dtype must be 'auto', 'float32' or 'bfloat16', got 'float16'"),
        ({"base_dtype": "bfloat16"}, r"base_dtype='bfloat16' needs LoRA \(lora_rank > 0\)"),
        ({"base_dtype": "bfloat16", "lora_rank": 8, "compute_dtype": "float32"}, "set compute_dtype to 'auto'"),
        ({"report_to": ("tensorbord",)}, "TrainerConfig.report_to has no reporter .tensorbord.; choose from"),
    ],
)
def test_a_bad_value_names_the_field_the_value_and_the_fix(overrides, message):
    with pytest.raises((ValueError, TypeError), match=message):
        TrainerConfig(**overrides)


def test_configs_written_when_packing_was_a_switch_still_load():
    assert TrainerConfig(packing=True).packing == "flat"
    assert TrainerConfig(packing=False).packing == "padded"


def test_to_dict_is_json_and_names_a_callable_loss():
    values = TrainerConfig(loss=ppo_clip_loss, report_to=("none",)).to_dict()
    assert values["loss"] == "agents.training.losses.ppo_clip_loss"
    assert values["adam_betas"] == [0.9, 0.999] and values["report_to"] == ["none"]
    assert json.loads(json.dumps(values)) == values
    # Every field is there, so a run folder's config.json records every hyper-parameter.
    assert set(values) == set(TrainerConfig.__dataclass_fields__)
    by_name = TrainerConfig(**{**TrainerConfig().to_dict(), "adam_betas": (0.9, 0.999), "report_to": ("none",)})
    assert by_name.loss == "ppo_clip" and by_name.lr == 1e-6
