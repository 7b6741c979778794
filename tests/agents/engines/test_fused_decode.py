"""FusedDecodeStep: transformers' logits for a decode step of rows of different lengths (Llama, and Qwen2 with
its projection biases), packed again after a weight change, and the models it declines with the reason."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
from transformers import DynamicCache, Qwen2Config, Qwen2ForCausalLM

from agents.engines.cpu_kernels import CPU_GQA_ATTENTION, packed_linear_supported
from agents.engines.fused_decode import FusedDecodeStep
from agents.engines.kv_cache import SlotCache
from agents.models import tiny_llama

pytestmark = pytest.mark.skipif(not packed_linear_supported(), reason="torch without oneDNN bfloat16")

LENGTHS = (5, 9, 3)  # rows of different lengths: the step runs under a padding mask


def tiny_qwen2() -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=50,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # initialised to zeros, which would hide a bias left out
            for projection in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                projection.bias.normal_()
    return model


def prefilled(model) -> SlotCache:
    """A SlotCache holding a random prompt of each of LENGTHS, prefilled one by one by transformers."""
    generator = torch.Generator().manual_seed(1)
    cache = SlotCache(model.config.num_hidden_layers, max_rows=4, dtype=torch.bfloat16)
    sequences = []
    for length in LENGTHS:
        prompt_cache = DynamicCache()
        ids = torch.randint(1, model.config.vocab_size, (1, length), generator=generator)
        model(input_ids=ids, past_key_values=prompt_cache, use_cache=True)
        sequences.append([(keys[0], values[0]) for keys, values, *_ in prompt_cache])
    cache.add_rows(sequences)
    return cache


def forward_pass_logits(model, tokens: torch.Tensor, cache: SlotCache) -> torch.Tensor:
    mask, positions = cache.decode_inputs()
    output = model(input_ids=tokens[:, None], attention_mask=mask, position_ids=positions, past_key_values=cache)
    return output.logits[:, -1].float()


@pytest.mark.parametrize("make", [lambda: tiny_llama(), tiny_qwen2], ids=["llama", "qwen2-biases"])
def test_a_fused_step_gives_the_forward_passs_logits_and_keys(make):
    model = make().bfloat16()
    model.set_attn_implementation(CPU_GQA_ATTENTION)  # what HFEngine runs on CPU
    tokens = torch.tensor([7, 11, 13])
    with torch.inference_mode():
        expected_cache, cache = prefilled(model), prefilled(model)
        expected = forward_pass_logits(model, tokens, expected_cache)
        step = FusedDecodeStep(model)
        mask, _ = cache.decode_inputs()
        logits = step(tokens, mask, cache)
    assert logits.shape == (3, 50) and logits.dtype == torch.float32
    # The same operations in the same order: equal here (AVX512-BF16); at most a bfloat16 rounding anywhere.
    assert (logits - expected).abs().max() <= expected.abs().max() * 2**-8
    for layer, expected_layer in zip(cache.slot_layers, expected_cache.slot_layers):
        for room, expected_room in zip(layer.kv(), expected_layer.kv()):
            for row, length in enumerate(LENGTHS):  # the new key and value at each row's own column
                assert torch.equal(room[row, :, : length + 1], expected_room[row, :, : length + 1])


def test_a_weight_changed_in_place_is_packed_again():
    model = tiny_llama().bfloat16()
    model.set_attn_implementation(CPU_GQA_ATTENTION)
    tokens = torch.tensor([7, 11, 13])
    with torch.inference_mode():
        step = FusedDecodeStep(model)
        cache = prefilled(model)
        before = step(tokens, cache.decode_inputs()[0], cache)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight.mul_(3.0)  # an optimiser step on a shared model, a load
    with torch.inference_mode():
        cache = prefilled(model)
        after = step(tokens, cache.decode_inputs()[0], cache)
        cache = prefilled(model)
        fresh = FusedDecodeStep(model)(tokens, cache.decode_inputs()[0], cache)
    assert torch.equal(after, fresh) and not torch.equal(after, before)


def test_models_it_cannot_run_are_declined_with_the_reason():
    from peft import LoraConfig, get_peft_model

    assert FusedDecodeStep.unsupported(tiny_llama().bfloat16()) is None
    assert "torch.float32" in FusedDecodeStep.unsupported(tiny_llama())
    dynamic = tiny_llama(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}).bfloat16()
    assert "'dynamic'" in FusedDecodeStep.unsupported(dynamic)
    adapted = get_peft_model(tiny_llama().bfloat16(), LoraConfig(r=2, target_modules=["q_proj"]))
    assert "is not one of" in FusedDecodeStep.unsupported(adapted)
    assert "not plain nn.Linear" in FusedDecodeStep.unsupported(adapted.base_model.model)
    with pytest.raises(ValueError, match="FusedDecodeStep cannot run this model: weights are torch.float32"):
        FusedDecodeStep(tiny_llama())
