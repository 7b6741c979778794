"""The compiled-decode benchmark times the fused step's own arithmetic: its FrozenDecodeStep, run eagerly, gives the
fused step's logits and writes the same keys and values into the same rooms."""

import pytest
import torch

from agents.engines.cpu_kernels import packed_linear_supported
from agents.engines.fused_decode import FusedDecodeStep
from agents.models import tiny_llama
from benchmarks.compiled_decode import FrozenDecodeStep, filled_cache

pytestmark = pytest.mark.skipif(not packed_linear_supported(), reason="torch without oneDNN bfloat16")


def test_the_frozen_step_is_the_fused_steps_arithmetic():
    model = tiny_llama().bfloat16().eval()
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
    assert (logits - expected).abs().max() <= expected.abs().max() * 2**-8  # at most a bfloat16 rounding
    for layer, expected_layer in zip(cache.slot_layers, expected_cache.slot_layers):
        for room, expected_room in zip(layer.kv(), expected_layer.kv()):
            assert torch.equal(room[:, :, :7], expected_room[:, :, :7])  # the 6 prefilled columns and the new one
