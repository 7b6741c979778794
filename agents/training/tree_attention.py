"""Attention over a packed row of paths: each token sees its own path up to itself, nothing else.

Registered with transformers' ``AttentionInterface`` as ``"agents_tree"``, so any model that
routes attention through that interface (Llama, Qwen2/3, Mistral, SmolLM, most current
architectures) runs a packed row (:func:`agents.training.packing.pack_paths`) unchanged:
:func:`enable_tree_attention` routes the model's attention through it, and a forward pass given
``packed_paths=`` (the row's layout) and ``tree_kernel=`` runs it.

Path ``b``'s own tokens (the places ``offsets[b]`` onwards, contiguous in the row) are its
queries; its keys and values are those of its whole path (the places ``where[b]``); a query at
depth ``d`` sees the keys at depths up to ``d``. The shared prefix's queries, keys and values
come from the path that owns it, so everything outside attention (the projections and MLPs,
most of a forward pass) runs once per packed token, attention once per own token against its
path, and nothing is of the row's length squared. Two ways run it, both exact:

- ``per-path``: one ``scaled_dot_product_attention`` call per path: plain causal for a path that
  owns all its tokens (the first of each tree: a slice of the row), else its own queries against
  its gathered keys under a ``[own, length]`` mask;
- ``batched``: one call for all paths, own queries and keys right-padded to the longest: fewer
  calls, more padded work;
- ``flex``: on a GPU, one FlexAttention call over the whole row under a block mask (a token sees
  the places of its own path at depths up to its own), which skips the row's fully masked
  blocks: no gather, no padding. Compiled with ``torch.compile``; FlexAttention has been slower
  than SDPA below about 1K tokens, so rows shorter than :data:`FLEX_MIN_TOKENS` keep SDPA.

:func:`choose_kernel` picks one per micro-batch: ``flex`` on CUDA for long rows, else the
cheaper of the other two by the count of query-key pairs computed plus a fixed cost per call;
the trainer's metrics record the choice. Masks are built once per packed row and reused by every
layer. (On CPU, PyTorch's FlexAttention runs forward only, which is how the tests check it.)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F

from agents.training.packing import PackedPaths

__all__ = [
    "ATTENTION_NAME",
    "check_tree_attention",
    "choose_kernel",
    "enable_tree_attention",
    "tree_attention_calls",
    "tree_attention_forward",
]

ATTENTION_NAME = "agents_tree"
# A scaled_dot_product_attention call costs about as much as this many query-key pairs of work
# besides them: 1,200 to 2,100 in runs of benchmarks.train_bench ("call_cost_pairs": 2 CPU cores,
# SmolLM2-135M's 9 heads of 64, forward and backward).
CALL_COST_PAIRS = 1600
#: Rows at least this long run FlexAttention on a GPU (below it FlexAttention has been slower than SDPA).
FLEX_MIN_TOKENS = 1024

Kernel = Literal["per-path", "batched", "flex"]


def choose_kernel(packed: PackedPaths, device: torch.device | str = "cpu") -> Kernel:
    """``flex`` for a long row on CUDA, else ``per-path`` or ``batched``, whichever computes fewer
    query-key pairs plus calls (module docstring)."""
    if torch.device(device).type == "cuda" and packed.tokens >= FLEX_MIN_TOKENS:
        return "flex"
    paths = [(s, n) for s, n in zip(packed.starts, packed.lengths) if n > s]
    # A causal call skips the masked half; a masked one computes every pair.
    per_path = sum(n * (n + 1) // 2 if s == 0 else (n - s) * n for s, n in paths) + len(paths) * CALL_COST_PAIRS
    batched = len(paths) * max(n - s for s, n in paths) * max(n for _, n in paths) + CALL_COST_PAIRS
    return "batched" if batched < per_path else "per-path"


def tree_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``[1, heads, P, dim]`` in, ``[1, P, heads, dim]`` out."""
    packed: PackedPaths | None = kwargs.get("packed_paths")
    kernel: Kernel | None = kwargs.get("tree_kernel")
    if packed is None or kernel is None:
        raise ValueError("tree attention needs the forward pass's packed_paths= and tree_kernel= arguments")
    for feature in ("sliding_window", "softcap", "s_aux", "position_bias"):
        if kwargs.get(feature) is not None or getattr(module, feature, None) is not None:
            raise ValueError(
                f"{type(module).__name__} uses {feature}, which tree attention does not apply; "
                "set TrainerConfig.packing='flat' for this model"
            )
    if dropout:
        raise ValueError("tree attention has no dropout (the trainer runs the policy in eval mode)")
    run = {"batched": _batched, "flex": _flex}.get(kernel, _per_path)
    out = run(packed, query, key, value, scaling, query.shape[1] != key.shape[1])  # grouped-query attention
    return out.transpose(1, 2).contiguous(), None


def _per_path(
    packed: PackedPaths,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    gqa: bool,
) -> torch.Tensor:
    masks = _own_masks(packed, query.device)
    outs = []
    for row, (start, length, offset) in enumerate(zip(packed.starts, packed.lengths, packed.offsets)):
        if start == length:
            continue  # every token of this path belongs to earlier ones
        queries = query[:, :, offset : offset + length - start]
        # A path that owns all its tokens (in order): plain causal attention on a slice of the row.
        keys = slice(offset, offset + length) if start == 0 else packed.where[row, :length]
        mask = None if start == 0 else masks[row]
        outs.append(
            F.scaled_dot_product_attention(
                queries, key[:, :, keys], value[:, :, keys], mask, is_causal=start == 0, scale=scaling, enable_gqa=gqa
            )
        )
    return torch.cat(outs, dim=2)


def _own_masks(packed: PackedPaths, device: torch.device) -> dict[int, torch.Tensor]:
    """Per path that shares a prefix, ``[own, length]``: the query at depth ``start + i`` sees depths up to its own."""
    masks = packed.cache.get("own_masks")
    if masks is None:
        masks = {
            row: torch.arange(length, device=device)[None, :] <= torch.arange(start, length, device=device)[:, None]
            for row, (start, length) in enumerate(zip(packed.starts, packed.lengths))
            if 0 < start < length
        }
        packed.cache["own_masks"] = masks
    return masks


def _batched(
    packed: PackedPaths,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    gqa: bool,
) -> torch.Tensor:
    query_places, key_places, mask, keep = _batched_layout(packed, query.device)
    q = query[0][:, query_places].transpose(0, 1)  # [paths, heads, own, dim]
    k, v = key[0][:, key_places].transpose(0, 1), value[0][:, key_places].transpose(0, 1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    return out.transpose(0, 1)[:, keep].unsqueeze(0)  # the paths' own tokens, in row order


def _batched_layout(packed: PackedPaths, device: torch.device) -> tuple[torch.Tensor, ...]:
    """The batched call's query and key places, its mask, and which outputs are own tokens (built once per row)."""
    layout = packed.cache.get("batched")
    if layout is None:
        rows = [row for row, (s, n) in enumerate(zip(packed.starts, packed.lengths)) if n > s]
        own = torch.tensor([packed.lengths[r] - packed.starts[r] for r in rows], device=device)
        starts = torch.tensor([packed.starts[r] for r in rows], device=device)
        offsets = torch.tensor([packed.offsets[r] for r in rows], device=device)
        lengths = torch.tensor([packed.lengths[r] for r in rows], device=device)
        i = torch.arange(int(own.max()), device=device)
        d = torch.arange(int(lengths.max()), device=device)
        query_places = torch.where(i < own[:, None], offsets[:, None] + i, 0)  # [paths, own]
        key_places = packed.where[rows, : len(d)]  # [paths, length] (0 past a path's end: masked)
        mask = (d[None, None, :] <= (starts[:, None] + i)[:, :, None]) & (d < lengths[:, None])[:, None, :]
        mask |= (i >= own[:, None])[:, :, None] & (d == 0)  # a padded query sees one key: no row of -inf
        keep = i[None, :] < own[:, None]
        packed.cache["batched"] = layout = (query_places, key_places, mask[:, None], keep)
    return layout


def _flex(
    packed: PackedPaths,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    gqa: bool,
) -> torch.Tensor:
    out = _flex_attention(query.device)(
        query, key, value, block_mask=_flex_block_mask(packed, query.device), scale=scaling, enable_gqa=gqa
    )
    return cast(torch.Tensor, out)  # every place of the row is some path's own token, in row order


def _flex_block_mask(packed: PackedPaths, device: torch.device) -> Any:
    """The row's block mask (built once per row): the query at place q sees the place k when k is on
    q's own path at a depth up to q's."""
    block_mask = packed.cache.get("flex")
    if block_mask is None:
        from torch.nn.attention.flex_attention import create_block_mask

        own = torch.tensor([n - s for s, n in zip(packed.starts, packed.lengths)], device=device)
        owner = torch.repeat_interleave(torch.arange(len(own), device=device), own)  # [P] the path owning each place
        on_path = torch.zeros(len(own), packed.tokens, dtype=torch.bool, device=device)  # [paths, P]
        for row, length in enumerate(packed.lengths):
            on_path[row, packed.where[row, :length]] = True
        depth = packed.positions[0]

        def sees(batch: torch.Tensor, head: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
            return on_path[owner[q], k] & (depth[k] <= depth[q])

        places = packed.tokens
        block_mask = create_block_mask(sees, None, None, places, places, device=device, _compile=device.type == "cuda")
        packed.cache["flex"] = block_mask
    return block_mask


_COMPILED_FLEX: dict[str, Callable[..., Any]] = {}


def _flex_attention(device: torch.device) -> Callable[..., Any]:
    """FlexAttention, compiled on a GPU (uncompiled it materialises every score); eager on CPU."""
    from torch.nn.attention.flex_attention import flex_attention

    if device.type == "cpu":
        return flex_attention
    if device.type not in _COMPILED_FLEX:  # rows differ in length every micro-batch: dynamic shapes
        _COMPILED_FLEX[device.type] = torch.compile(flex_attention, dynamic=True)
    return _COMPILED_FLEX[device.type]


class _Dispatch:
    """The attention function registered for a model: tree attention for a packed row, the model's own otherwise."""

    def __init__(self, own: Callable[..., Any]) -> None:
        self.own, self.calls = own, 0

    def __call__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("packed_paths") is None:
            return self.own(module, *args, **kwargs)
        self.calls += 1
        return tree_attention_forward(module, *args, **kwargs)


def check_tree_attention(model: torch.nn.Module) -> None:
    """Raise unless ``model``'s attention runs through transformers' attention functions (tree attention can wrap it)."""
    from transformers import AttentionInterface

    own = _text_config(model)._attn_implementation
    if own not in AttentionInterface._global_mapping and not (own or "").startswith(ATTENTION_NAME):
        raise ValueError(
            f"packing='tree' runs through transformers' attention functions, but {type(model).__name__} uses "
            f"attn_implementation={own!r}; load it with attn_implementation='sdpa' (the default) or set "
            "TrainerConfig.packing='flat'"
        )


def enable_tree_attention(model: torch.nn.Module) -> None:
    """Let ``model`` run packed rows: its attention becomes tree attention in a pass given ``packed_paths``.

    Every other pass (an engine generating with the same model) runs the model's own attention,
    masks included: the attention it has when this is called, so the trainer calls it at its
    first packed pass, after an engine sharing the model has chosen its kernels. The switch stays:
    it holds through gradient checkpointing, whose backward pass recomputes the attention after
    the forward pass returned. Calling it again does nothing.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    check_tree_attention(model)
    config = _text_config(model)
    own = config._attn_implementation
    if own.startswith(ATTENTION_NAME):
        return
    name = f"{ATTENTION_NAME}+{own}"
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _Dispatch(AttentionInterface._global_mapping[own]))
        own_mask = cast("Callable[..., Any] | None", ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(own))
        if own_mask is not None:  # the model's own passes build the masks its own attention expects
            ALL_MASK_ATTENTION_FUNCTIONS.register(name, own_mask)
    config._attn_implementation = name


def tree_attention_calls(model: torch.nn.Module) -> int:
    """How many attention calls of ``model`` have run as tree attention so far (0 if never enabled)."""
    from transformers import AttentionInterface

    dispatch = AttentionInterface._global_mapping.get(_text_config(model)._attn_implementation)
    return dispatch.calls if isinstance(dispatch, _Dispatch) else 0


def _text_config(model: torch.nn.Module) -> Any:
    get_base = getattr(model, "get_base_model", None)  # peft: the transformers model inside
    base = get_base() if callable(get_base) else model
    config = getattr(base, "config", None)
    if config is None:
        raise ValueError(f"{type(model).__name__} has no transformers config, so tree attention cannot be set on it")
    return config
