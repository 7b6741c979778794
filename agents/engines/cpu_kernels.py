"""CPU kernels for HFEngine's no-grad forward passes: grouped-query attention without KV copies, weight-first
float32 linear layers, prepacked bfloat16 linear layers.

All apply only to HFEngine's no-grad forward passes on CPU, so the trainer's forward passes (which need
gradients) never see them.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

__all__ = [
    "CPU_GQA_ATTENTION",
    "WeightFirstLinear",
    "pack_linear_layers",
    "packed_linear_supported",
    "weights_version",
]

#: The attention implementation HFEngine gives an ``sdpa`` model on CPU (see :func:`_sdpa_cpu_gqa`).
CPU_GQA_ATTENTION = "sdpa-cpu-gqa"


def weights_version(parameters: Iterable[torch.Tensor]) -> int:
    """A number that changes whenever any of ``parameters`` is changed in place (an optimiser step, a
    ``load_state_dict``): what a copy or a packing of the weights compares to know it is stale."""
    return sum(p._version for p in parameters)  # bumped by every in-place change


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
    ours = (
        query.shape[1] != key.shape[1]  # grouped
        and query.device.type == "cpu"
        and not torch.is_grad_enabled()
        and kwargs.get("position_bias") is None
    )
    if ours and query.dtype == torch.bfloat16 and query.shape[2] == 1 and not kwargs.get("dropout"):
        # transformers passes no mask when no row needs one (rows of equal lengths)
        return _decode_attention(query, key, value, attention_mask, kwargs.get("scaling")), None
    if not ours or attention_mask is None:  # without a mask transformers copies no KV heads
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


#: Whether a bfloat16 decode step's attention runs torch's CPU flash kernel (:func:`_decode_attention`): on a CPU
#: with AMX tiles its products run on them, elsewhere it is ten times slower than two batched products.
FLASH_DECODE = torch.cpu._is_amx_tile_supported()


def _decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scale: float | None
) -> torch.Tensor:
    """A bfloat16 decode step's attention ([rows, heads, 1, dim] queries): torch's flash kernel with AMX, else
    two batched products; [rows, 1, heads, dim] out.

    Without AMX torch's CPU flash kernel spends most of its time on block bookkeeping when a row has one
    query: at 64 rows x 100 cached positions of SmolLM2 it took 3.1 ms a layer against 0.31 ms
    as two products, 16 rows x 300 positions 2.4 ms against 0.24 (AMD EPYC, AVX512-BF16, 2 cores). With AMX
    (Intel Xeon, 2 cores) the kernel is the faster one: 1 row x 350 positions 30 us against 205, 8 rows 138
    against 459, 64 rows x 200 773 against 1,493 (``FLASH_DECODE``). In the products a KV head's query
    heads are one [group, dim] matrix, so the grouped KV is read as it is stored. Scores and the
    softmax are float32; the probabilities go into the second product in bfloat16, as flash
    attention on a GPU does (outputs within a bfloat16 rounding or two of float32 attention).
    """
    if FLASH_DECODE:
        output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)
        return output.transpose(1, 2).contiguous()
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


def packed_linear_supported() -> bool:
    """Whether this torch has oneDNN's bfloat16 linear kernel for prepacked weights (:func:`pack_linear_layers`)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_linear_layers(model: torch.nn.Module, max_rows: int = 512) -> int:
    """Make every bfloat16 ``nn.Linear`` of ``model`` (a private copy: :class:`~agents.engines.hf.ComputeCopy`)
    multiply inputs of at most ``max_rows`` rows by its weight reordered once into oneDNN's blocked layout;
    the number of layers changed.

    ``F.linear`` hands oneDNN the plain weight and the kernel reorders it on every call; for a decode step's
    few rows that is a good part of the product. 30 layers of SmolLM2-135M's linear shapes, bfloat16, 2 cores
    (AVX512-BF16): 1 row 18.4 -> 13.3 ms, 4 rows 19.8 -> 11.7, 16 rows 31.4 -> 17.0, 64 rows 50.3 -> 42.3,
    512 rows about even, 2,048 rows 9% slower (so larger prefills keep ``F.linear``); the same products,
    bit-identical there. inductor's weight freezing and IPEX prepack so too, for weights that never change;
    here a layer packs again when its weight's version counter moved (any in-place change: a refresh of the
    copy, a load). A layer's own ``forward``, not a ``TorchFunctionMode``: a mode sees every torch call of the
    pass, which cost 5.5 of a one-row step's 36 ms. Memory: one more copy of the linear weights.
    """
    layers = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.dtype == torch.bfloat16]
    for layer in layers:
        layer.forward = _PackedForward(layer, max_rows)  # type: ignore[method-assign,assignment]  # this instance's
    return len(layers)


class _PackedForward:
    """The forward of one :func:`pack_linear_layers` layer: oneDNN on the packed weight, else ``F.linear``."""

    def __init__(self, layer: torch.nn.Linear, max_rows: int) -> None:
        self.layer, self.max_rows = layer, max_rows
        self.version = -1  # of the weight last packed
        self.packed: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.layer.weight, self.layer.bias
        if torch.is_grad_enabled() or x.dtype != torch.bfloat16 or x.numel() // x.shape[-1] > self.max_rows:
            return F.linear(x, weight, bias)
        if self.packed is None or self.version != weight._version:
            self.packed, self.version = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 64), weight._version
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, bias, "none", [], "")
