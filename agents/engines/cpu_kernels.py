"""CPU kernels for HFEngine's no-grad forward passes: grouped-query attention without KV copies, weight-first linear layers.

Both are exact up to float32 summation order and apply only under no-grad on CPU, so the
trainer's forward passes (which need gradients) never see them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

__all__ = ["CPU_GQA_ATTENTION", "WeightFirstLinear"]

#: The attention implementation HFEngine gives an ``sdpa`` model on CPU (see :func:`_sdpa_cpu_gqa`).
CPU_GQA_ATTENTION = "sdpa-cpu-gqa"


def _sdpa_cpu_gqa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa attention, minus its copy of the KV heads on CPU under no-grad.

    With a mask, transformers repeats each KV head once per query head of its group before
    calling torch (CUDA's fast kernels need that); torch's CPU kernel takes the groups itself
    (``enable_gqa``) with bit-identical results. At 32 rows x 600 cached positions of SmolLM2 the
    copy cost 58.7 ms a layer against 4.9 ms without it, 90% of a decode step (this machine).
    """
    grouped = query.shape[1] != key.shape[1]
    if not grouped or query.device.type != "cpu" or torch.is_grad_enabled() or kwargs.get("position_bias") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if query.dtype == torch.bfloat16 and query.shape[2] == 1 and not kwargs.get("dropout"):
        # transformers passes no mask when no row needs one (rows of equal lengths)
        return _decode_attention(query, key, value, attention_mask, kwargs.get("scaling")), None
    if attention_mask is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    output = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=kwargs.get("dropout", 0.0),
        scale=kwargs.get("scaling"),
        enable_gqa=True,
    )
    return output.transpose(1, 2).contiguous(), None


def _decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float | None
) -> torch.Tensor:
    """A bfloat16 decode step's attention ([rows, heads, 1, dim] queries) as two batched products.

    torch's CPU flash kernel spends most of its time on block bookkeeping when a row has one
    query: at 64 rows x 100 cached positions of SmolLM2 it took 3.1 ms a layer against 0.31 ms
    here, 16 rows x 300 positions 2.4 ms against 0.24 (AVX512-BF16, 2 cores). A KV head's query
    heads are one [group, dim] matrix, so the grouped KV is read as it is stored. Scores and the
    softmax are float32; the probabilities go into the second product in bfloat16, as flash
    attention on a GPU does (outputs within a bfloat16 rounding or two of float32 attention).
    """
    rows, heads, _, dim = query.shape
    kv_heads, width = key.shape[1], key.shape[2]
    key, value = _whole_rows(key), _whole_rows(value)
    scores = torch.matmul(query.view(rows, kv_heads, heads // kv_heads, dim), key.transpose(-1, -2)).float()
    scores *= dim**-0.5 if scale is None else scale
    if key.shape[2] > width:  # the columns past the view: never attended
        scores[..., width:] = float("-inf")
    if mask is not None and mask.dtype == torch.bool:  # [rows, 1, 1, columns]: True where a row may attend
        scores[..., :width].masked_fill_(~mask, float("-inf"))
    elif mask is not None:  # additive
        scores[..., :width] += mask
    probabilities = scores.softmax(-1).to(value.dtype)
    output = torch.matmul(probabilities, value)  # [rows, kv heads, group, dim]
    return output.view(rows, heads, 1, dim).transpose(1, 2).contiguous()


def _whole_rows(cache: torch.Tensor) -> torch.Tensor:
    """``cache`` ([rows, kv heads, columns, dim]), or, when it is the first columns of a contiguous tensor with
    more (HFEngine's KV room, sliced to the longest row), all the columns of that tensor.

    bfloat16 batched products copy a strided operand first (9 rows x 700 columns of SmolLM2: 0.70 ms a layer
    against 0.27 ms); the room's columns past the slice hold zeros or an earlier row's keys, finite either way,
    and the caller masks them.
    """
    rows, heads, columns, dim = cache.shape
    stride = cache.stride()
    full = stride[1] // dim
    if cache.is_contiguous() or stride[3] != 1 or stride[2] != dim or stride[0] != heads * stride[1] or full < columns:
        return cache
    if cache.storage_offset() + rows * stride[0] > cache.untyped_storage().nbytes() // cache.element_size():
        return cache
    return cache.as_strided((rows, heads, full, dim), stride)


AttentionInterface.register(CPU_GQA_ATTENTION, _sdpa_cpu_gqa)
AttentionMaskInterface.register(CPU_GQA_ATTENTION, sdpa_mask)


class WeightFirstLinear(TorchFunctionMode):
    """Within this mode, ``F.linear(x, W)`` with 2 to ``max_rows`` input rows runs as ``(W @ xᵀ)ᵀ``.

    The same product, summed in another order (float32 rounding differences, ~1e-6). MKL's sgemm
    is slow for an input of a few rows, as a decode step's is (one per sequence), when the weight is
    its transposed second operand, as F.linear has it. SmolLM2-135M decode steps on this 2-core
    machine (400 cached positions): 4 rows 222-317 ms as F.linear, 122-141 ms weight first; 16 rows
    295-339 vs 216-239 ms; 32 rows about even. One row (12% slower) and prefill-sized inputs (50%
    slower at 32 x 300 tokens) keep F.linear. HFEngine's forward passes on CPU use this mode.
    transformers and torch offer no switch for it.
    """

    def __init__(self, max_rows: int = 32) -> None:
        super().__init__()
        self.max_rows = max_rows

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.linear:
            return func(*args, **kwargs)
        x, weight = args[0], args[1]
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
        rows = x.numel() // x.shape[-1]
        if not 2 <= rows <= self.max_rows:
            return func(*args, **kwargs)
        # Contiguous again: the layers after it are slow on the transposed layout.
        out = torch.mm(weight, x.reshape(rows, -1).t()).t().contiguous()
        if bias is not None:
            out += bias
        return out.view(*x.shape[:-1], weight.shape[0])
