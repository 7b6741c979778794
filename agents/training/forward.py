"""The policy's forward pass: a collated batch's token ids in, per-token log-probs and entropies out.

The contract. :meth:`PolicyForward.plan` splits a :class:`~agents.training.batch.PathBatch` once
per step into mini-batches of micro-batches (:class:`MicroBatch`), each its paths trimmed to the longest and,
under ``packing="flat"`` or ``"tree"``, packed into one row (:func:`agents.training.packing.pack_paths`)
with its tree-attention kernel chosen (:func:`agents.training.tree_attention.choose_kernel`).
Every pass of the step (the recomputed old log-probs, the reference's, every epoch's updates)
runs on that plan. Calling :class:`PolicyForward` on one micro-batch gives, for its ``[rows, width]``,

    logprobs[b, t] = log softmax(z[b, t − 1] / T)[ids[b, t]]   (docs/algorithms/index.md eq. 4)

and the entropies of those distributions (eq. 2), 0 at ``t = 0``, on padding and, when only the
action tokens are scored, on every other token. :meth:`PolicyForward.score` runs the no-grad
passes over a whole batch (micro-batched, every rank's rows).

How a pass runs:

- ``padded``: the model on the right-padded rows and their attention mask; ``flat``: one row of
  the paths one after another, the position ids' restarts delimiting them; ``tree``: one row in
  which every shared prefix stands once, under tree attention (:mod:`agents.training.tree_attention`);
- with ``score_chunk``, the action tokens only: the decoder's hidden states, then the output
  layer on a chunk of them at a time (:func:`agents.training.scoring.score_states`); otherwise
  the model's logits, scored by :mod:`agents.training.scoring`;
- a sharded model runs the whole pass inside its FSDP root's forward
  (:class:`agents.training.sharding.FSDPRoot`);
- a pass that needs gradients recomputes its decoder layers in the backward pass under
  ``gradient_checkpointing``.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import distributed as dist
from transformers.modeling_layers import GradientCheckpointingLayer

from agents.models import AttentionShape
from agents.training.batch import PathBatch
from agents.training.packing import PackedPaths, new_tokens, pack_paths
from agents.training.scoring import score_logits, score_positions, score_states, score_tokens
from agents.training.sharding import rank_passes
from agents.training.trainer_config import TrainerConfig
from agents.training.tree_attention import (
    Kernel,
    choose_kernel,
    enable_tree_attention,
    kernel_unavailable,
    tree_attention_calls,
    warm_up_flex,
)

__all__ = ["MicroBatch", "MiniBatch", "PolicyForward", "StepPlan"]


@dataclass
class MicroBatch:
    """One forward pass's paths: rows of the collated batch, their columns up to ``width``.

    Attributes:
        rows: the paths' rows in the batch.
        width: the longest path's length (the batch's padding beyond it is trimmed).
        packed: the paths as one row (``packing`` "flat" or "tree"); ``None`` when padded.
        kernel: the tree-attention kernel of the packed row (``packing="tree"``).
    """

    rows: torch.Tensor
    width: int
    packed: PackedPaths | None = None
    kernel: Kernel | None = None

    @property
    def cut(self) -> tuple[torch.Tensor, slice]:
        """The index of the micro-batch's ``[rows, width]`` in the batch's tensors."""
        return self.rows, slice(0, self.width)

    @property
    def tokens_forwarded(self) -> int:
        """What the pass runs on: padding included, each shared prefix once when packed as a tree."""
        return len(self.rows) * self.width if self.packed is None else self.packed.tokens


@dataclass
class MiniBatch:
    """The paths of one optimiser update: ``rows`` (every rank's), and this rank's ``passes``
    over its micro-batches as ``(micro-batch, real)`` (:func:`agents.training.sharding.rank_passes`)."""

    rows: torch.Tensor
    passes: list[tuple[MicroBatch, bool]]


@dataclass
class StepPlan:
    """A step's batch split and packed once.

    Attributes:
        micro_batches: every micro-batch, in order, of every rank.
        mini_batches: the optimiser updates' paths and this rank's passes over them.
        scoring: this rank's passes over the whole batch (the no-grad log-probs).
    """

    micro_batches: list[MicroBatch]
    mini_batches: list[MiniBatch]
    scoring: list[tuple[MicroBatch, bool]]


class PolicyForward:
    """The forward passes of a trainer (module docstring): plans, one micro-batch's scores, a batch's.

    Args:
        config: ``packing``, ``micro_batch_size``, ``micro_batch_tokens``, ``score_chunk``,
            ``temperature``, ``gradient_checkpointing`` and ``checkpoint_layers`` are read.
        device, compute_dtype: where and in what the passes run (autocast below float32).
        rank, world_size: this rank's place in the trainer's group (1 process: 0 of 1).
        attention: the policy's attention heads (:func:`agents.training.tree_attention.attention_shape`),
            which the tree kernels' choice reads; under ``packing="tree"`` a forced
            ``tree_kernel`` is checked against them and FlexAttention is compiled here if a
            pass may run it (:func:`agents.training.tree_attention.warm_up_flex`).
    """

    def __init__(
        self,
        config: TrainerConfig,
        device: torch.device,
        compute_dtype: torch.dtype,
        rank: int,
        world_size: int,
        attention: AttentionShape | None = None,
    ) -> None:
        self.config, self.device, self.compute_dtype = config, device, compute_dtype
        self.rank, self.world_size, self.attention = rank, world_size, attention
        if config.packing == "tree":
            self._prepare_tree_kernel()
        #: The FSDP roots of sharded models, by ``id`` of the model (none in one process).
        self.roots: Mapping[int, torch.nn.Module] = {}
        self._checkpointed: list[torch.nn.Module] = []
        self._cached: PackedPaths | None = None  # the packed row whose attention masks are kept

    def enable_checkpointing(self, model: torch.nn.Module) -> None:
        """Recompute ``model``'s decoder layers (the first ``checkpoint_layers`` of them) in the
        backward pass of every pass that needs gradients."""
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ValueError(
                f"{type(model).__name__} does not support gradient checkpointing; "
                "set TrainerConfig.gradient_checkpointing=False"
            )
        # Non-reentrant checkpointing: gradients reach LoRA adapters without inputs that require grad.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})  # type: ignore[operator]
        layers: list[torch.nn.Module] = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        self._checkpointed = layers[: math.ceil(self.config.checkpoint_layers * len(layers))]

    def _prepare_tree_kernel(self) -> None:
        """Refuse a forced kernel that cannot run here; compile FlexAttention before the first step if it may run."""
        kernel = self.config.tree_kernel
        if kernel != "auto":
            why = kernel_unavailable(kernel, self.device, self.attention, self.compute_dtype)
            if why is not None:
                raise ValueError(f"TrainerConfig.tree_kernel={kernel!r} cannot run here: {why}; set tree_kernel='auto'")
        flex_may_run = kernel == "flex" or (
            kernel == "auto"
            and kernel_unavailable("varlen", self.device, self.attention, self.compute_dtype) is not None
            and kernel_unavailable("flex", self.device, self.attention, self.compute_dtype) is None
        )
        if flex_may_run and self.attention is not None:
            warm_up_flex(self.attention, self.device, self.compute_dtype)

    # ---- the plan ------------------------------------------------------------------------

    def plan(self, batch: PathBatch, mini_batches: int = 1) -> StepPlan:
        """``batch``'s rows split in order into ``mini_batches``, each into micro-batches, each packed once."""
        n = batch.ids.shape[0]
        if mini_batches > n:
            raise ValueError(f"mini_batches={mini_batches} but the batch has only {n} sequences")
        lengths = batch.attention_mask.sum(-1)
        splits = torch.arange(n).tensor_split(mini_batches)
        micro = [
            [self.micro_batch(batch, rows) for rows in self.micro_batches(mini, lengths, batch.ids)] for mini in splits
        ]
        every = [m for mini in micro for m in mini]
        # A rank short of micro-batches runs one path of the first instead, to no effect.
        filler = self.micro_batch(batch, every[0].rows[:1]) if self.world_size > 1 else every[0]

        def mine(items: list[MicroBatch]) -> list[tuple[MicroBatch, bool]]:
            return rank_passes(items, filler, self.rank, self.world_size)

        return StepPlan(every, [MiniBatch(rows, mine(m)) for rows, m in zip(splits, micro)], scoring=mine(every))

    def micro_batch(self, batch: PathBatch, rows: torch.Tensor) -> MicroBatch:
        """The paths ``rows`` of ``batch`` as one pass: trimmed, packed and given their kernel."""
        width = int(batch.attention_mask[rows].sum(-1).max())  # trim the batch's padding
        packing = self.config.packing
        if packing == "padded":
            return MicroBatch(rows, width)
        packed = pack_paths(batch.ids[rows, :width], batch.attention_mask[rows, :width], share=packing == "tree")
        if packing == "flat":
            return MicroBatch(rows, width, packed)
        kernel = self.config.tree_kernel
        if kernel == "auto":
            kernel = choose_kernel(packed, self.device, shape=self.attention, compute_dtype=self.compute_dtype)
        return MicroBatch(rows, width, packed, kernel)

    def micro_batches(
        self, rows: torch.Tensor, lengths: torch.Tensor, ids: torch.Tensor | None = None
    ) -> list[torch.Tensor]:
        """``rows`` split in order into micro-batches.

        Padded or flat: at most ``micro_batch_size`` sequences and ``micro_batch_tokens`` padded
        tokens (sequences × the longest). Tree: at most ``micro_batch_tokens`` packed tokens, or
        without that budget ``micro_batch_size`` × the batch's longest path (what a padded
        micro-batch may hold); ``ids`` are the paths' tokens, which decide what they share. A
        sequence longer than the budget goes alone.
        """
        size, budget = self.config.micro_batch_size, self.config.micro_batch_tokens
        tree = self.config.packing == "tree"
        packed_budget = budget if budget is not None else size * int(lengths.max())
        groups: list[list[int]] = [[]]
        longest = used = 0  # the group's longest sequence, and its tokens as counted against the budget
        for row in rows.tolist():
            length, group = int(lengths[row]), groups[-1]
            if tree:
                assert ids is not None, "tree packing splits by packed tokens, which need the ids"
                tokens = used + new_tokens(ids, lengths, row, group)
                full = tokens > packed_budget
            else:
                tokens = max(longest, length) * (len(group) + 1)
                full = len(group) >= size or (budget is not None and tokens > budget)
            if group and full:
                groups.append([])
                longest, tokens = 0, length
            groups[-1].append(row)
            longest, used = max(longest, length), tokens
        return [torch.tensor(group, dtype=torch.long) for group in groups if group]

    # ---- the passes ----------------------------------------------------------------------

    @torch.no_grad()
    def score(
        self, model: torch.nn.Module, batch: PathBatch, plan: StepPlan, *, actions_only: bool = True
    ) -> torch.Tensor:
        """Log-probs of ``batch``'s action tokens (every token with ``actions_only=False``) under
        ``model``, ``[batch, tokens]`` and 0 elsewhere, on every rank."""
        scores = torch.zeros(batch.ids.shape, dtype=torch.float32, device=self.device)
        for micro, real in plan.scoring:
            values = self(model, batch, micro, entropy=False, actions_only=actions_only)[0]
            if real:
                scores[micro.cut] = values
        if self.world_size > 1:
            # Each rank filled only its rows (the others are 0), so the sum is every rank's whole batch.
            dist.all_reduce(scores)
            root = self.roots.get(id(model))
            if root is not None:
                root.reshard()  # type: ignore[operator]  # FSDPModule.reshard; no backward pass will do it
        return scores

    def __call__(
        self,
        model: torch.nn.Module,
        batch: PathBatch,
        micro: MicroBatch,
        *,
        entropy: bool = True,
        entropy_grad: bool = False,
        actions_only: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs and entropies (``None`` with ``entropy=False``) of ``micro``'s ``[rows, width]``.

        The entropy carries a gradient only with ``entropy_grad`` (an entropy bonus). With
        ``actions_only``, only the action tokens (``batch.mask``) are scored, 0 elsewhere.
        """
        ids, attention_mask = batch.ids[micro.cut], batch.attention_mask[micro.cut]
        scored = batch.mask[micro.cut] if actions_only else None
        if micro.packed is not self._cached:  # the previous row's pass and backward are done: free its masks
            if self._cached is not None:
                self._cached.cache.clear()
            self._cached = micro.packed
        root = self.roots.get(id(model))
        with self._checkpointing():
            if root is not None:  # sharded: the whole pass inside the FSDP root's forward (see FSDPRoot)
                return root(self._pass, ids, attention_mask, scored, micro, entropy, entropy_grad)
            return self._pass(model, ids, attention_mask, scored, micro, entropy, entropy_grad)

    @contextlib.contextmanager
    def _checkpointing(self) -> Iterator[None]:
        """Gradient checkpointing for a pass that needs gradients, when enabled.

        transformers checkpoints a decoder layer only while that layer is in training mode; only
        those layers' flags are set, so dropout and every other module stay in eval mode and the
        pass scores the same policy as the no-grad ones.
        """
        layers = self._checkpointed if torch.is_grad_enabled() else []
        for layer in layers:
            layer.training = True
        try:
            yield
        finally:
            for layer in layers:
                layer.training = False

    def _pass(
        self,
        model: torch.nn.Module,
        ids: torch.Tensor,
        attention_mask: torch.Tensor,
        scored: torch.Tensor | None,
        micro: MicroBatch,
        entropy: bool,
        entropy_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        packed = micro.packed
        if packed is None:
            inputs: dict[str, Any] = {"input_ids": ids, "attention_mask": attention_mask}
        else:  # flat: no mask, the position ids' restarts delimit the paths; tree: tree attention
            inputs = {"input_ids": packed.ids, "position_ids": packed.positions}
        if micro.kernel is not None:
            enable_tree_attention(model)
            inputs.update(packed_paths=packed, tree_kernel=micro.kernel)
            calls = tree_attention_calls(model)
        parts = _decoder_and_head(model) if scored is not None and self.config.score_chunk else None
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32):
            if parts is not None:
                assert scored is not None
                scores = self._score_chosen(parts, inputs, packed, scored, attention_mask, entropy, entropy_grad)
            else:
                logits = model(**inputs, use_cache=False).logits
        if micro.kernel is not None and tree_attention_calls(model) == calls:
            raise ValueError(
                f"{type(model).__name__}'s attention does not run through transformers' attention functions, so a "
                "packed tree would attend across paths; set TrainerConfig.packing='flat' or 'padded'"
            )
        if parts is not None:
            return scores
        temperature = self.config.temperature
        if packed is None:
            token_logprobs, token_entropy = score_tokens(
                logits, ids, temperature, entropy=entropy, entropy_grad=entropy_grad
            )
            pad = torch.nn.functional.pad  # position 0 has no context: 0
            values = [None if v is None else pad(v, (1, 0)) for v in (token_logprobs, token_entropy)]
        else:  # each place of the row scored once from the logits of the place before it in its path
            after = (packed.previous >= 0).nonzero().squeeze(-1)
            row_values = score_logits(
                logits[0, packed.previous[after]],
                packed.ids[0, after],
                temperature,
                entropy=entropy,
                entropy_grad=entropy_grad,
            )
            values = [None if v is None else _unpacked(v, after, packed) for v in row_values]
        logprobs, entropies = (None if v is None else v * attention_mask for v in values)
        assert logprobs is not None  # the log-probs are always scored
        return logprobs, entropies

    def _score_chosen(
        self,
        parts: tuple[torch.nn.Module, torch.nn.Module],
        inputs: dict[str, Any],
        packed: PackedPaths | None,
        scored: torch.Tensor,
        attention_mask: torch.Tensor,
        entropy: bool,
        entropy_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The pass for the tokens of ``scored`` only: the decoder's hidden states, then the head in chunks."""
        decoder, head = parts
        chunk = self.config.score_chunk
        assert chunk is not None  # _pass takes this path only with a chunk size
        chosen = scored.bool() & attention_mask.bool()
        chosen[:, 0] = False  # the first token has no context
        where = chosen.nonzero()  # [n, 2] (b, t)
        hidden = decoder(**inputs, use_cache=False).last_hidden_state
        temperature = self.config.temperature
        if packed is None:
            scores = score_positions(
                hidden,
                head,
                inputs["input_ids"],
                where,
                temperature,
                entropy=entropy,
                entropy_grad=entropy_grad,
                chunk_size=chunk,
            )
        else:  # each chosen place of the row once, from the hidden state of the place before it in its path
            places, copies = torch.unique(packed.where[where[:, 0], where[:, 1]], return_inverse=True)
            row_scores = score_states(
                hidden[0, packed.previous[places]],
                head,
                packed.ids[0, places],
                temperature,
                entropy=entropy,
                entropy_grad=entropy_grad,
                chunk_size=chunk,
            )
            scores = tuple(None if v is None else v[copies] for v in row_scores)  # type: ignore[assignment]
        results: list[torch.Tensor | None] = []
        for values in scores:
            if values is None:
                results.append(None)
                continue
            full = torch.zeros(attention_mask.shape, dtype=values.dtype, device=values.device)
            results.append(full.index_put((where[:, 0], where[:, 1]), values))
        first = results[0]
        assert first is not None  # score_positions always returns the log-probs
        return first, results[1]


def _decoder_and_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """The decoder and output layer of a causal LM whose logits are the head applied to its last hidden states.

    ``None`` (score from the model's own logits) for a model that does more between them:
    soft-capped or scaled logits (Gemma, Cohere) or no separate decoder.
    """
    get_base = getattr(model, "get_base_model", None)  # a peft model's transformers model, adapters in place
    base = get_base() if callable(get_base) else model
    config = getattr(base, "config", None)
    if getattr(config, "final_logit_softcapping", None) or getattr(config, "logit_scale", None) not in (None, 1, 1.0):
        return None
    get_decoder, get_head = getattr(base, "get_decoder", None), getattr(base, "get_output_embeddings", None)
    decoder = get_decoder() if callable(get_decoder) else None
    head = get_head() if callable(get_head) else None
    if not isinstance(decoder, torch.nn.Module) or not isinstance(head, torch.nn.Module) or decoder is base:
        return None
    return decoder, head


def _unpacked(values: torch.Tensor, places: torch.Tensor, packed: PackedPaths) -> torch.Tensor:
    """Scores of the row's ``places`` back to ``[paths, tokens]`` (0 at depth 0, which has no score)."""
    row = values.new_zeros(packed.tokens).index_put((places,), values)
    return row[packed.where]
