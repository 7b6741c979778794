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
path, and nothing is of the row's length squared. Four kernels run it, all exact:

- ``per-path``: one ``scaled_dot_product_attention`` call per path: plain causal for a path that
  owns all its tokens (the first of each tree: a slice of the row), else its own queries against
  its gathered keys under bottom-right-aligned causal attention (``causal_lower_right``: the
  query at depth ``start + i`` sees the first ``start + i + 1`` keys), which the flash and
  memory-efficient kernels run on a GPU without a mask;
- ``batched``: one call for all paths, own queries and keys right-padded to the longest: fewer
  calls, more padded work;
- ``varlen``: on a GPU, one variable-length flash call (``torch.nn.attention.varlen``) a layer:
  the row's own tokens as queries, each path's gathered keys, bottom-right causal; exactly the
  pairs needed, no mask, no padding, no compile. Needs a 16-bit compute dtype;
- ``flex``: one FlexAttention call over the whole row under a block mask, skipping the row's
  fully masked blocks. A place ``k`` is visible from ``q`` exactly when it is ``q``'s ancestor
  in the row's token tree (or ``q`` itself): with each place numbered in depth-first preorder
  (``enter``) and ``exit`` the end of its subtree's numbers, ``enter[k] <= enter[q] < exit[k]``.
  The mask reads two ``[P]`` tensors, so its captured sizes are the row's length only (no
  ``[paths, P]`` table whose size could collide with another under dynamo's duck sizing).
  ``create_block_mask`` and ``flex_attention`` are compiled once per process with dynamic
  shapes (:func:`warm_up_flex` compiles them for the gradient and no-gradient passes before the
  first step), rows are padded to a multiple of the 128-token block, and q/k/v run in the
  compute dtype (fp32 q/k from norms or rotary tables under autocast would run flex in fp32).
  A row shorter than two blocks is padded to two (dynamo specialises a size of 1).
  Inductor's flex kernel needs a head dimension of at least 16 (:data:`FLEX_MIN_HEAD_DIM`).

:func:`choose_kernel` picks one per micro-batch: on CUDA, ``varlen`` where it runs (a 16-bit
compute dtype and a torch that has it), else ``flex`` for long rows where the head dimension
allows; otherwise the cheaper of ``per-path`` and ``batched`` by the count of query-key pairs
computed plus a fixed cost per call. The CUDA rule is provisional: it is what the kernels'
designs imply, not yet a measurement (``benchmarks/gpu_bench.py`` times every kernel against
padded on one GPU). ``TrainerConfig.tree_kernel`` forces one; the trainer's metrics record the
choice. Masks are built once per packed row and reused by every layer. (On CPU, PyTorch's
FlexAttention runs forward only, which is how the tests check it; varlen runs on CUDA only.)
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable
from typing import Any, Literal, cast

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

from agents.models import AttentionShape
from agents.training.packing import PackedPaths

__all__ = [
    "ATTENTION_NAME",
    "KERNELS",
    "attention_shape",
    "check_tree_attention",
    "choose_kernel",
    "enable_tree_attention",
    "kernel_unavailable",
    "tree_attention_calls",
    "tree_attention_forward",
    "warm_up_flex",
]

ATTENTION_NAME = "agents_tree"
# A scaled_dot_product_attention call costs about as much as this many query-key pairs of work
# besides them: 1,200 to 2,100 in runs of benchmarks.train_bench ("call_cost_pairs": 2 CPU cores,
# SmolLM2-135M's 9 heads of 64, forward and backward).
CALL_COST_PAIRS = 1600
#: Rows at least this long run FlexAttention on a GPU without varlen (below it FlexAttention has been slower than SDPA).
FLEX_MIN_TOKENS = 1024
#: Inductor's FlexAttention kernel fails to compile below this head dimension (the H200 run, head dim 8).
FLEX_MIN_HEAD_DIM = 16
#: FlexAttention's block: a row is padded to a multiple of it.
FLEX_BLOCK = 128

Kernel = Literal["per-path", "batched", "flex", "varlen"]
KERNELS: tuple[Kernel, ...] = ("per-path", "batched", "flex", "varlen")


def attention_shape(model: torch.nn.Module) -> AttentionShape:
    """The query heads, key-value heads and head dimension of ``model``'s attention (from its config)."""
    return AttentionShape.of(_text_config(model))


def kernel_unavailable(
    kernel: Kernel, device: torch.device | str, shape: AttentionShape | None, compute_dtype: torch.dtype
) -> str | None:
    """Why ``kernel`` cannot run on ``device`` for a model of ``shape`` in ``compute_dtype``; ``None`` if it can."""
    device = torch.device(device)
    if kernel == "varlen":
        if device.type != "cuda":
            return f"varlen runs on CUDA only (flash attention), not on {device.type}"
        if compute_dtype not in (torch.float16, torch.bfloat16):
            return f"varlen runs flash attention, which needs a 16-bit compute dtype, not {compute_dtype}"
        if _varlen_attention() is None:
            return f"torch {torch.__version__} has no torch.nn.attention.varlen (it came in 2.10)"
    if kernel == "flex" and device.type == "cuda" and shape is not None and shape.head_dim < FLEX_MIN_HEAD_DIM:
        return f"FlexAttention's compiled kernel needs a head dimension >= {FLEX_MIN_HEAD_DIM}; the model's is {shape.head_dim}"
    return None


def choose_kernel(
    packed: PackedPaths,
    device: torch.device | str = "cpu",
    *,
    shape: AttentionShape | None = None,
    compute_dtype: torch.dtype = torch.float32,
) -> Kernel:
    """On CUDA ``varlen`` where it runs, else ``flex`` for a long row where the head dimension allows;
    otherwise ``per-path`` or ``batched``, whichever computes fewer query-key pairs plus calls
    (module docstring)."""
    if torch.device(device).type == "cuda":
        if kernel_unavailable("varlen", device, shape, compute_dtype) is None:
            return "varlen"
        if packed.tokens >= FLEX_MIN_TOKENS and kernel_unavailable("flex", device, shape, compute_dtype) is None:
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
    # Under autocast queries and keys leave the rotary embedding in float32 and values come out of their projection
    # in the compute dtype; torch's attention kernels take one dtype (on a GPU autocast casts them, on a CPU not).
    dtype = value.dtype
    query, key = query.to(dtype), key.to(dtype)
    run = {"batched": _batched, "flex": _flex, "varlen": _varlen}.get(kernel, _per_path)
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
    outs = []
    for row, (start, length, offset) in enumerate(zip(packed.starts, packed.lengths, packed.offsets)):
        if start == length:
            continue  # every token of this path belongs to earlier ones
        queries = query[:, :, offset : offset + length - start]
        # A path that owns all its tokens (in order): plain causal attention on a slice of the row.
        keys = slice(offset, offset + length) if start == 0 else packed.where[row, :length]
        # Else its own queries (depths start..length-1) against all its keys, causal aligned to the last key.
        mask = None if start == 0 else causal_lower_right(length - start, length)
        outs.append(
            F.scaled_dot_product_attention(
                queries, key[:, :, keys], value[:, :, keys], mask, is_causal=start == 0, scale=scaling, enable_gqa=gqa
            )
        )
    return torch.cat(outs, dim=2)


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


def _varlen(
    packed: PackedPaths,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    gqa: bool,
) -> torch.Tensor:
    varlen = _varlen_attention()
    assert varlen is not None, "choose_kernel and TrainerConfig checks offer varlen only where torch has it"
    attend, options, takes_gqa = varlen
    cu_queries, cu_keys, longest_own, longest, key_places = _varlen_layout(packed, query.device)
    q = query[0].transpose(0, 1)  # [P, heads, dim]: every place is some path's own query, in row order
    k, v = (t[0].transpose(0, 1)[key_places] for t in (key, value))  # [Σ lengths, kv heads, dim]
    if gqa and not takes_gqa:  # a torch whose varlen has no enable_gqa: each key-value head to its query heads
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    elif gqa:
        options = {**options, "enable_gqa": True}
    out = attend(q, k, v, cu_queries, cu_keys, longest_own, longest, scale=scaling, **options)
    return cast(torch.Tensor, out).transpose(0, 1).unsqueeze(0)


def _varlen_layout(packed: PackedPaths, device: torch.device) -> tuple[Any, ...]:
    """The varlen call's cumulative query and key lengths, their maxima, and each path's key places (once per row)."""
    layout = packed.cache.get("varlen")
    if layout is None:
        rows = [row for row, (s, n) in enumerate(zip(packed.starts, packed.lengths)) if n > s]
        own = [packed.lengths[r] - packed.starts[r] for r in rows]
        lengths = [packed.lengths[r] for r in rows]

        def cumulative(values: list[int]) -> torch.Tensor:
            return torch.tensor([0, *itertools.accumulate(values)], dtype=torch.int32, device=device)

        key_places = torch.cat([packed.where[r, : packed.lengths[r]] for r in rows]).to(device)
        layout = (cumulative(own), cumulative(lengths), max(own), max(lengths), key_places)
        packed.cache["varlen"] = layout
    return layout


@functools.cache
def _varlen_attention() -> tuple[Callable[..., Any], dict[str, Any], bool] | None:
    """torch's varlen attention, the keyword that makes it bottom-right causal in this torch, and
    whether it takes ``enable_gqa``; ``None`` before torch 2.10."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    parameters = inspect.signature(varlen_attn).parameters
    # torch 2.10 has is_causal; later ones a (left, right) window, (-1, 0) being causal. Flash
    # aligns both to the bottom right when a sequence has fewer queries than keys.
    causal: dict[str, Any] = {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}
    return varlen_attn, causal, "enable_gqa" in parameters


def _flex(
    packed: PackedPaths,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    scaling: float | None,
    gqa: bool,
) -> torch.Tensor:
    block_mask = _flex_block_mask(packed, query.device)
    pad = block_mask.seq_lengths[0] - packed.tokens  # up to a whole block; the padding sees only itself
    dtype = value.dtype  # a projection's output: the compute dtype under autocast
    q, k, v = (F.pad(t.to(dtype), (0, 0, 0, pad)) for t in (query, key, value))
    out = _compiled(flex_attention, query.device)(q, k, v, block_mask=block_mask, scale=scaling, enable_gqa=gqa)
    return cast(torch.Tensor, out)[:, :, : packed.tokens]  # every place is some path's own token, in row order


def _flex_block_mask(packed: PackedPaths, device: torch.device) -> BlockMask:
    """The row's block mask (built once per row): the query at place q sees the place k when k is
    q's ancestor in the row's token tree or q itself (module docstring)."""
    block_mask = packed.cache.get("flex")
    if block_mask is None:
        enter, exit = _preorder(packed.previous.tolist())
        # Whole blocks, at least 2: dynamo specialises a size of 1, so one block would compile again.
        padding = range(len(enter), max(2, -(-len(enter) // FLEX_BLOCK)) * FLEX_BLOCK)
        enter_places = torch.tensor([*enter, *padding], device=device)
        exit_places = torch.tensor([*exit, *(place + 1 for place in padding)], device=device)
        with torch.no_grad():
            block_mask = _compiled(_tree_block_mask, device)(enter_places, exit_places)
        packed.cache["flex"] = block_mask
    return block_mask


def _preorder(previous: list[int]) -> tuple[list[int], list[int]]:
    """Each place's number in a depth-first preorder of the row's token tree (``previous`` gives a
    place's parent, -1 at a root), and the end of its subtree's numbers."""
    children: list[list[int]] = [[] for _ in previous]
    roots: list[int] = []
    for place, parent in enumerate(previous):
        (roots if parent < 0 else children[parent]).append(place)
    enter, exit = [0] * len(previous), [0] * len(previous)
    count = 0
    stack = [(root, False) for root in reversed(roots)]
    while stack:  # iterative: a path may be thousands of tokens deep
        place, done = stack.pop()
        if done:
            exit[place] = count
            continue
        enter[place], count = count, count + 1
        stack.append((place, True))
        stack.extend((child, False) for child in reversed(children[place]))
    return enter, exit


def _tree_block_mask(enter: torch.Tensor, exit: torch.Tensor) -> BlockMask:
    """The block mask of a row whose places have the preorder intervals ``[enter, exit)``."""

    def sees(batch: torch.Tensor, head: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        return (enter[k] <= enter[q]) & (enter[q] < exit[k])

    places = enter.shape[0]
    return create_block_mask(sees, None, None, places, places, device=enter.device)


#: How FlexAttention's functions are compiled, by device type; eager elsewhere (CPU: forward only).
COMPILE_BACKENDS: dict[str, Any] = {"cuda": "inductor"}
_COMPILED: dict[tuple[Callable[..., Any], str], Callable[..., Any]] = {}


def _compiled(function: Callable[..., Any], device: torch.device) -> Callable[..., Any]:
    """``function`` compiled once per process and device type, with dynamic shapes: rows differ in
    length every micro-batch, and uncompiled FlexAttention materialises every score."""
    backend = COMPILE_BACKENDS.get(device.type)
    if backend is None:
        return function
    key = (function, device.type)
    if key not in _COMPILED:
        _COMPILED[key] = torch.compile(function, dynamic=True, backend=backend)
    return _COMPILED[key]


def warm_up_flex(shape: AttentionShape, device: torch.device, compute_dtype: torch.dtype) -> None:
    """Compile FlexAttention for ``shape`` before the first step: the block mask, the no-gradient
    pass and (on CUDA, where flex has a backward pass) the gradient pass with its backward.

    The warm-up row's block count differs from every head count and the head dimension, so
    dynamo's duck sizing gives each its own symbol and no later row's sizes recompile it.
    """
    if device.type not in COMPILE_BACKENDS:
        return
    taken = {shape.heads, shape.kv_heads, shape.head_dim}
    blocks = next(n for n in range(2, 1 << 16) if n not in taken and n * FLEX_BLOCK not in taken)
    places = blocks * FLEX_BLOCK
    row = PackedPaths(
        ids=torch.zeros(1, places, dtype=torch.long, device=device),
        positions=torch.arange(places, device=device)[None],
        where=torch.arange(places, device=device)[None],
        previous=torch.arange(-1, places - 1, device=device),
        starts=[0],
        lengths=[places],
        offsets=[0],
    )
    with torch.autocast(device.type, dtype=compute_dtype, enabled=compute_dtype != torch.float32):
        for grad in (False, True) if device.type == "cuda" else (False,):
            heads = (shape.heads, shape.kv_heads, shape.kv_heads)
            q, k, v = (torch.randn(1, n, places, shape.head_dim, device=device, requires_grad=grad) for n in heads)
            with torch.set_grad_enabled(grad):  # as in a pass: q/k/v from projections, the value in the compute dtype
                out = _flex(row, q, k, v.to(compute_dtype), shape.head_dim**-0.5, shape.heads != shape.kv_heads)
            if grad:
                out.float().sum().backward()


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
