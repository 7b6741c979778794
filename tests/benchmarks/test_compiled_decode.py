"""The compiled-decode benchmark times the fused step's own arithmetic: its FrozenDecodeStep, run eagerly, gives the
fused step's logits and writes the same keys and values into the same rooms."""

import pytest
import torch

from agents.engines.cpu_kernels import packed_linear_supported
from agents.engines.fused_decode import FusedDecodeStep
from agents.models import tiny_llama
from benchmarks.compiled_decode import FrozenDecodeStep, filled_cache

pytestmark = pytest.mark.skipif(not packed_linear_supported(), reason="torch without oneDNN bfloat16")


@pytest.mark.parametrize("biases", [False, True], ids=["llama", "biases"])
def test_the_frozen_step_is_the_fused_steps_arithmetic(biases):
    model = tiny_llama(attention_bias=biases, mlp_bias=biases).bfloat16().eval()
    if biases:  # as Qwen2's q, k and v projections have; initialised to zero, which would test nothing
        generator = torch.Generator().manual_seed(1)
        for name, parameter in model.named_parameters():
            if name.endswith("bias"):
                parameter.data = torch.randn(parameter.shape, generator=generator).to(parameter.dtype)
    tokens = torch.tensor([7, 11, 13])
    with torch.inference_mode():
        expected_cache, cache = filled_cache(model, 3, 6), filled_cache(model, 3, 6)
        mask, _ = expected_cache.decode_inputs()
        expected = FusedDecodeStep(model)(tokens, mask, expected_cache)
        mask, _ = cache.decode_inputs()
        rooms = [layer.kv() for layer in cache.slot_layers]
        logits = FrozenDecodeStep(model)(
            tokens, mask.bool()[:, None, None, :], cache.lengths, [k for k, _ in rooms], [v for _, v in rooms]
        )
    assert logits.shape == expected.shape == (3, model.config.vocab_size) and logits.dtype == torch.float32
    # oneDNN's packed products and F.linear may sum in another order: on the AMX Xeon they agreed to the bit, on an
    # AMD EPYC a key differs by one bfloat16 rounding, which the layers after it carry into the logits. A wrong
    # formula (a bias, a rotation, a projection missed) is off by as much as the values themselves.
    assert (logits - expected).abs().max() <= expected.abs().max() * 2**-5
    for layer, expected_layer in zip(cache.slot_layers, expected_cache.slot_layers):
        for room, expected_room in zip(layer.kv(), expected_layer.kv()):
            new, expected_new = room[:, :, :7].float(), expected_room[:, :, :7].float()  # 6 prefilled, 1 new
            assert (new - expected_new).abs().max() <= expected_new.abs().max() * 2**-7  # one bfloat16 rounding
