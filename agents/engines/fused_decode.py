"""HFEngine's bfloat16 decode step on CPU for Llama-family models, without transformers' modules in the way.

A decode step of a small model on a CPU is as much Python and small operations as arithmetic: SmolLM2-135M's
transformers forward pass for one new token a row runs ~6,000 torch calls (views, casts, the cache's bookkeeping,
the rotary embedding per layer), about half of a one-row step's 33 ms on this machine's 2 cores (AVX512-BF16).
:class:`FusedDecodeStep` computes the same step directly on the model's weights: the query, key and value
projections as one product and the gate and up projections as another (on weights packed into oneDNN's layout,
as :func:`~agents.engines.cpu_kernels.pack_linear_layers` packs the rest), the rotary embedding once for all
layers, the new keys and values written into the :class:`SlotCache` rooms, and attention by
:func:`~agents.engines.cpu_kernels._decode_attention`. The operations and their order are those of transformers'
Llama code (``modeling_llama.py``: ``LlamaRMSNorm``, ``apply_rotary_pos_emb``, ``LlamaMLP``,
``LlamaDecoderLayer``), so the logits are bit-identical to the forward pass's here; a step takes 27.5 ms against
33 for one row, HFEngine decodes 1.19x / 1.08x / 1.13x faster at 1 / 16 / 64 requests
(``benchmarks/cpu_bench.py``, run 5).

Written here because neither transformers nor torch has a lean decode step for CPU: vLLM's CPU backend keeps
its own model code for this reason, and ``torch.compile`` of this same function was no faster on these
shapes (inductor lowers the packed products as opaque calls and its fused norms round differently).
Prefill passes keep transformers' forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from agents.engines.cpu_kernels import _decode_attention, packed_linear_supported, weights_version
from agents.engines.kv_cache import SlotCache

__all__ = ["FusedDecodeStep"]

#: Model classes whose decoder layers are Llama's (pre-norm RMSNorm, rotary attention, SiLU-gated MLP).
SUPPORTED_MODELS = ("LlamaForCausalLM", "Qwen2ForCausalLM")
#: Rotary embeddings whose frequencies are fixed at load (the dynamic kinds change them per forward pass).
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


class FusedDecodeStep:
    """One decode step of a bfloat16 Llama-family ``model`` on CPU: next-token logits for every row of a :class:`SlotCache`.

    ``step(token_ids, attention_mask, cache)`` takes each row's newest token ([rows]) and the mask of
    :meth:`SlotCache.decode_inputs`, writes the token's key and value at each row's length, and returns float32
    logits [rows, vocab]; the caller advances the cache. The fused products are packed again when any weight of
    the model changed in place (an optimiser step on a shared model, a load), seen from the version counters.
    Memory: one more copy of the query, key, value, gate and up weights. :meth:`unsupported` says why a model
    cannot use it.
    """

    def __init__(self, model: Any) -> None:
        reason = self.unsupported(model)
        if reason is not None:
            raise ValueError(f"FusedDecodeStep cannot run this model: {reason}")
        self.model: Any = model  # a transformers model: its submodules by name
        self._parameters = list(model.parameters())
        self._version = -1  # of the weights last packed
        self._fused: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, torch.Tensor | None]] = []

    @staticmethod
    def unsupported(model: Any) -> str | None:
        """Why ``model`` (a transformers model) cannot use a fused decode step (``None`` when it can)."""
        if type(model).__name__ not in SUPPORTED_MODELS:
            return f"{type(model).__name__} is not one of {SUPPORTED_MODELS}"
        parameter = next(model.parameters())
        if parameter.device.type != "cpu" or parameter.dtype != torch.bfloat16:
            return f"weights are {parameter.dtype} on {parameter.device.type}, not bfloat16 on cpu"
        if not packed_linear_supported():
            return "this torch has no oneDNN bfloat16 kernel for packed weights"
        config = model.config
        if config.hidden_act != "silu":
            return f"hidden_act is {config.hidden_act!r}, not 'silu'"
        rope_type = model.model.rotary_emb.rope_type
        if rope_type not in STATIC_ROPE_TYPES:
            return f"rope_type {rope_type!r} changes its frequencies per forward pass"
        for layer in model.model.layers:
            projections = (*_attention_projections(layer), layer.self_attn.o_proj, *_mlp_projections(layer))
            if any(type(p) is not torch.nn.Linear for p in projections):  # adapters (LoRA) wrap them
                return "its projections are not plain nn.Linear layers (an adapter?)"
        return None

    def __call__(self, token_ids: torch.Tensor, attention_mask: torch.Tensor, cache: SlotCache) -> torch.Tensor:
        model = self.model.model
        self._pack()
        rows = token_ids.shape[0]
        lengths, width = cache.lengths, cache.width + 1
        mask = attention_mask.bool()[:, None, None, :]
        hidden = model.embed_tokens(token_ids)  # [rows, hidden]
        cos, sin = model.rotary_emb(hidden, lengths[:, None])  # [rows, 1, head dim]: the same for every layer
        for layer, slot, (qkv, qkv_bias, gate_up, gate_up_bias) in zip(model.layers, cache.slot_layers, self._fused):
            attention = layer.self_attn
            dim = attention.head_dim
            heads, kv_heads = attention.q_proj.out_features // dim, attention.k_proj.out_features // dim
            projected = _packed_linear(layer.input_layernorm(hidden), qkv, qkv_bias)
            query, key, value = projected.split((heads * dim, kv_heads * dim, kv_heads * dim), -1)
            query = _rotate(query.view(rows, heads, dim), cos, sin)
            key = _rotate(key.view(rows, kv_heads, dim), cos, sin)
            keys, values = slot.kv()
            keys[cache.rows_index, :, lengths] = key.to(keys.dtype)
            values[cache.rows_index, :, lengths] = value.view(rows, kv_heads, dim).to(values.dtype)
            attended = _decode_attention(
                query[:, :, None], keys[:rows, :, :width], values[:rows, :, :width], mask, attention.scaling
            )
            hidden = hidden + attention.o_proj(attended.reshape(rows, heads * dim))
            gate, up = _packed_linear(layer.post_attention_layernorm(hidden), gate_up, gate_up_bias).chunk(2, -1)
            hidden = hidden + layer.mlp.down_proj(F.silu(gate) * up)
        return self.model.lm_head(model.norm(hidden)).float()

    def _pack(self) -> None:
        """Pack the fused products again if any weight changed since they were packed."""
        version = weights_version(self._parameters)
        if version == self._version:
            return
        self._fused = []
        for layer in self.model.model.layers:
            qkv, qkv_bias = _fuse(_attention_projections(layer))
            gate_up, gate_up_bias = _fuse(_mlp_projections(layer))
            self._fused.append((qkv, qkv_bias, gate_up, gate_up_bias))
        self._version = version


def _attention_projections(layer: Any) -> tuple[torch.nn.Linear, ...]:
    return layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj


def _mlp_projections(layer: Any) -> tuple[torch.nn.Linear, ...]:
    return layer.mlp.gate_proj, layer.mlp.up_proj


def _fuse(linears: tuple[torch.nn.Linear, ...]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One packed weight (and bias) computing ``linears``' outputs side by side."""
    weight = torch.cat([linear.weight.detach() for linear in linears])
    return torch.ops.mkldnn._reorder_linear_weight(weight, 64), _fused_bias(linears)


def _fused_bias(linears: tuple[torch.nn.Linear, ...]) -> torch.Tensor | None:
    """``linears``' biases side by side (zeros for one without), or ``None`` when none has one."""
    if all(linear.bias is None for linear in linears):
        return None
    return torch.cat(
        [
            linear.weight.new_zeros(linear.out_features) if linear.bias is None else linear.bias.detach()
            for linear in linears
        ]
    )


def _packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' ``apply_rotary_pos_emb`` for one of query or key ([rows, heads, head dim])."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin
