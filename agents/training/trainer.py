"""The trainer: policy-gradient updates of a transformers causal LM on a batch of training paths.

One :meth:`Trainer.step` (read :meth:`Trainer._update` top to bottom):

1. collate the paths (:func:`agents.training.batch.collate`) into right-padded ``[batch, tokens]`` tensors;
2. old log-probs: recompute them with the current policy before any update (verl's
   ``compute_log_prob``; the default), or take the sampler's. Either way the sampler's
   log-probs are compared with the trainer's and the mismatch reported;
3. reference log-probs, when a KL penalty to a reference policy is on;
4. one epoch of ``mini_batches`` optimiser updates over the batch; each accumulates gradients
   over micro-batches of ``micro_batch_size`` sequences (padded, or packed into one row), clips
   the gradient norm, and steps AdamW and the learning-rate schedule (docs/algorithms.md "Optimiser and batching");
5. weight sync to the engine: nothing to copy when it shares the model object (``HFEngine``
   built on ``trainer.model``), ``await engine.update_weights(state_dict)`` otherwise. An engine
   that can sleep (vLLM on the same GPU) sleeps through steps 2-4 and wakes before the sync;
6. metrics (:mod:`agents.training.metrics`), merged with the caller's rollout numbers, to JSONL and
   the reporters of ``report_to`` (TensorBoard, W&B).

A batch that arrives in parts (asynchronous training, each prompt's trees as they come back) goes
through :meth:`Trainer.accumulate` part by part, its passes run at once, and the step that brings
the rest takes the one optimiser step.

Every hyper-parameter is a field of :class:`TrainerConfig` with its default and source.

Example::

    trainer = Trainer("smollm2-135m", TrainerConfig(loss="atpo", mini_batches=2), out_dir="runs/a")
    engine = HFEngine(trainer.model, trainer.tokenizer)      # shares the weights
    trainer.engine = engine
    ...                                                      # roll out trees, assign credit
    metrics = await trainer.step(paths, {"time/rollout_s": 12.5, "tokens/generated": 3100})
    trainer.save_checkpoint(data_position={"next_row": 64})  # model, optimiser, RNG, step
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import inspect
import math
import time
from collections import defaultdict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import distributed as dist
from torch.distributed.tensor import DTensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase, get_scheduler
from transformers.modeling_layers import GradientCheckpointingLayer

from agents.models import load_model, load_tokenizer
from agents.progress import progress_bar, transformers_bars
from agents.rollout.tree import TrainingPath
from agents.training.batch import PathBatch, collate
from agents.training.checkpoint import checkpoint_name, load_checkpoint, save_checkpoint
from agents.training.losses import LOSSES, TRAINER_INPUTS, LossFn
from agents.training.metrics import GENERATED_TOKENS, ROLLOUT_TIME, MetricsLog, plot_curves
from agents.training.packing import PackedPaths, new_tokens, pack_paths
from agents.training.reporting import import_wandb
from agents.training.scoring import score_logits, score_positions, score_states, score_tokens
from agents.training.trainer_config import TrainerConfig
from agents.training.tree_attention import (
    check_tree_attention,
    choose_kernel,
    enable_tree_attention,
    tree_attention_calls,
)

if TYPE_CHECKING:
    from peft import PeftModel

__all__ = ["Trainer", "TrainerConfig"]

# Metric names the trainer writes (see agents.training.metrics); the caller's rollout metrics must avoid them.
_TRAINER_GROUPS = ("policy/", "mismatch/", "optim/", "batch/", "throughput/")
_TRAINER_METRICS = frozenset(
    {
        "reward/mean",
        "reward/std",
        "reward/min",
        "reward/max",
        "tokens/trained",
        "tokens/action",
        "time/old_logprobs_s",
        "time/update_s",
        "time/sync_s",
        "time/step_s",
    }
)
# Loss metrics that count things (turns, sequences): summed over micro-batches, not averaged.
_COUNT_METRICS = frozenset({"turns", "clipped_turns", "sequences", "clipped_sequences"})


class Trainer:
    """Trains a causal LM on :class:`~agents.rollout.tree.TrainingPath` batches with a policy-gradient loss.

    Args:
        model: a transformers causal LM with float32 parameters (the trainer changes it in
            place), or a model name for :func:`agents.models.load_model`. With
            ``lora_rank > 0`` it is wrapped in a peft LoRA model; the wrapping injects the
            adapters into this very object, so an engine sharing it generates with them.
        config: hyper-parameters (defaults: :class:`TrainerConfig`).
        tokenizer: saved with checkpoints; loaded by name when ``model`` is a name.
        engine: receives the new weights after every step: any object with a coroutine
            ``update_weights(state_dict)``; an engine whose ``model`` is this model shares
            the weights and needs no copy (its ``forward_lock``, if any, is held while the
            weights change). Can be set later as ``trainer.engine``.
        ref_model: the reference policy of the KL penalty. Without it, ``kl_coef > 0`` uses
            the base model with the adapters switched off under LoRA, and otherwise a frozen
            copy of the initial policy.
        out_dir: the run folder for ``metrics.jsonl``, the reporters' files (``report_to``), ``curves.png`` and
            ``checkpoints/``; ``None`` keeps metrics in memory (``trainer.metrics.history``).
        distributed: be one rank of the initialised default ``torch.distributed`` group (what
            :class:`agents.cluster.trainer_ranks.TrainerGroup` starts). With a world size N > 1
            the model is sharded with FSDP2 over a mesh of the model's device; every rank gets the
            whole batch and runs micro-batches r, r + N, … of each mini-batch, and gradients are
            summed, so each update equals the one process's. Metrics and ``curves.png`` go to
            ``out_dir`` from rank 0 only; checkpoints are sharded (``torch.distributed.checkpoint``)
            plus the consolidated ``model/``. With world size 1 it is the single process.
    """

    def __init__(
        self,
        model: PreTrainedModel | str,
        config: TrainerConfig | None = None,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        engine: Any = None,
        ref_model: PreTrainedModel | None = None,
        out_dir: str | Path | None = None,
        distributed: bool = False,
    ) -> None:
        self.config = cfg = config or TrainerConfig()
        #: This process's place in the trainer's group: rank 0 of 1 unless ``distributed``.
        self.rank, self.world_size = 0, 1
        if distributed:
            if not (dist.is_available() and dist.is_initialized()):
                raise ValueError(
                    "Trainer(distributed=True) is one rank of a torch.distributed group: call "
                    "torch.distributed.init_process_group first (agents.cluster.trainer_ranks.TrainerGroup does), "
                    "or leave distributed=False for the single process"
                )
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        if "wandb" in cfg.report_to and out_dir is not None and self.rank == 0:
            import_wandb()  # a missing client fails here, before the model loads
        if isinstance(model, str):
            device = cfg.device or ("cuda" if torch.cuda.is_available() else "cpu")
            tokenizer = tokenizer or load_tokenizer(model)
            with transformers_bars(self._shows_progress):  # off with progress=False too
                model = load_model(
                    model, dtype=getattr(torch, cfg.base_dtype), device=device, progress=self._shows_progress
                )
        self.tokenizer = tokenizer
        self.device = next(model.parameters()).device
        self.compute_dtype = _compute_dtype(cfg.compute_dtype, self.device)
        if next(model.parameters()).dtype == torch.bfloat16:
            self.compute_dtype = torch.bfloat16  # a bfloat16 base (under LoRA) computes in bfloat16 anywhere
        # No dropout in RL (verl turns it off): the recomputed old log-probs and the training
        # forward pass must score the same policy.
        model.eval()
        self.base_model: PreTrainedModel = model
        self.model: PreTrainedModel | PeftModel = _with_lora(model, cfg) if cfg.lora_rank else model
        self.trainable_parameters = [p for p in self.model.parameters() if p.requires_grad]
        if not self.trainable_parameters:
            raise ValueError("the model has no parameter with requires_grad=True, so there is nothing to train")
        wrong = {str(p.dtype) for p in self.trainable_parameters if p.dtype != torch.float32}
        if wrong:
            raise ValueError(
                f"trainable parameters are {', '.join(sorted(wrong))}; load the policy in float32 "
                "(the trainer computes in bfloat16 on a GPU through autocast)"
            )
        self._checkpointed_layers: list[torch.nn.Module] = []
        if cfg.gradient_checkpointing:
            if not getattr(model, "supports_gradient_checkpointing", False):
                raise ValueError(
                    f"{type(model).__name__} does not support gradient checkpointing; "
                    "set TrainerConfig.gradient_checkpointing=False"
                )
            # Non-reentrant checkpointing: gradients reach LoRA adapters without inputs that require grad.
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            self._checkpointed_layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
        self.ref_model = ref_model
        if ref_model is None and cfg.kl_coef > 0 and not cfg.lora_rank:
            self.ref_model = copy.deepcopy(model)
        if self.ref_model is not None:
            self.ref_model.eval().requires_grad_(False)
        # FSDP2 roots of the policy and the reference, by id of the model they hold (none in one process).
        self._roots: dict[int, torch.nn.Module] = {}
        if self.world_size > 1:
            self._shard()
            # fully_shard replaced the parameters by sharded ones (DTensors): the optimiser takes those.
            self.trainable_parameters = [p for p in self.model.parameters() if p.requires_grad]
        if cfg.packing == "tree":  # switched on at the first packed pass (enable_tree_attention says why)
            for policy in (self.model, self.ref_model):
                if policy is not None:
                    check_tree_attention(policy)
        self.loss_fn: LossFn = LOSSES[cfg.loss] if isinstance(cfg.loss, str) else cfg.loss
        self._loss_params = _loss_parameters(self.loss_fn, cfg, uses_reference=self._uses_reference)
        self._token_weighted = self._loss_params.get("agg") == "token-mean"
        fused = self.device.type == "cuda" if cfg.fused_adamw is None else cfg.fused_adamw
        self.optimizer = torch.optim.AdamW(
            self.trainable_parameters,
            lr=cfg.lr,
            betas=cfg.adam_betas,
            eps=cfg.adam_eps,
            weight_decay=cfg.weight_decay,
            fused=fused or None,  # None, not False: torch then picks its default multi-tensor path
        )
        total_updates = None if cfg.total_steps is None else cfg.total_steps * cfg.mini_batches * cfg.epochs
        if cfg.lr_schedule == "constant" and cfg.warmup_steps:
            raise ValueError("lr_schedule 'constant' has no warm-up; use 'constant_with_warmup' with warmup_steps")
        if cfg.lr_schedule not in ("constant", "constant_with_warmup") and total_updates is None:
            raise ValueError(f"lr_schedule {cfg.lr_schedule!r} decays over the run; set TrainerConfig.total_steps")
        self.scheduler = get_scheduler(
            cfg.lr_schedule, self.optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=total_updates
        )
        self.engine = engine
        self.out_dir = None if out_dir is None else Path(out_dir)
        #: Steps (rollout batches) trained so far; checkpoints and metrics are numbered by it.
        self.step_count = 0
        self.metrics: MetricsLog | None = None  # opened by the first step, or by resume()
        self._passes: defaultdict[str, int] = defaultdict(int)  # what the step's update passes forwarded
        self._last_pass: dict[str, int] = {}
        self._steps_bar: Any = None  # the ``train`` bar (progress_bar), opened by open_steps_bar
        self._accumulated: _StepWork | None = None  # the next step's passes so far (accumulate)

    @property
    def engine(self) -> Any:
        """The engine that receives new weights after every step (``None``: none)."""
        return self._engine

    @engine.setter
    def engine(self, engine: Any) -> None:
        if engine is not None and not inspect.iscoroutinefunction(getattr(engine, "update_weights", None)):
            raise TypeError(
                f"engine must have a coroutine update_weights(state_dict); {type(engine).__name__} has none"
            )
        self._engine = engine

    @property
    def shares_weights_with_engine(self) -> bool:
        """Whether the engine generates with this very model object (no copy needed)."""
        shared = getattr(self.engine, "model", None)
        return shared is not None and (shared is self.model or shared is self.base_model)

    @property
    def _uses_reference(self) -> bool:
        return self.ref_model is not None or self.config.kl_coef > 0

    @property
    def pad_id(self) -> int:
        """The id that pads paths to one length (any id works: padding is never attended to)."""
        for source in (self.tokenizer, self.base_model.config):
            pad = getattr(source, "pad_token_id", None)
            if isinstance(pad, int):
                return pad
        return 0

    # ---- one training step ---------------------------------------------------------------

    async def step(
        self, paths: Sequence[TrainingPath] | PathBatch, rollout_metrics: Mapping[str, float] | None = None
    ) -> dict[str, float]:
        """Train on one rollout batch, sync the engine, log and return the step's metrics.

        Args:
            paths: the batch's training paths (or an already collated :class:`PathBatch`),
                with advantages from credit assignment and the sampler's log-probs. After
                :meth:`accumulate`, the batch's remaining paths (possibly none).
            rollout_metrics: the caller's numbers for this batch, merged into the record, for
                instance ``time/rollout_s`` and ``tokens/generated`` (see :mod:`agents.training.metrics`)
                or ``reward/em``; names must differ from the trainer's own.
        """
        rollout_metrics = _checked_rollout_metrics(rollout_metrics or {})
        self.open_steps_bar()
        batch = None if not _size(paths) else paths if isinstance(paths, PathBatch) else collate(paths, self.pad_id)
        if batch is None and self._accumulated is None:
            raise ValueError("Trainer.step got no paths and none were accumulated: there is nothing to train on")
        if self.metrics is None:  # before the update, so that a folder holding another run fails first
            self.metrics = self._open_metrics(resume_step=None)
        sleeps = self.config.sleep_engine and bool(getattr(self.engine, "supports_sleep", False))
        start = time.perf_counter()
        if sleeps:
            # Level 2 drops the engine's weights: the sync below reloads them all. A LoRA sync sends
            # only the adapted layers, so the engine keeps a CPU copy of the rest (level 1).
            await self.engine.sleep(level=1 if self.config.lora_rank else 2)
        time_sleep = time.perf_counter() - start
        # The update runs in a worker thread so the event loop (and a shared engine) keeps going.
        if self._accumulated is None:
            assert batch is not None
            metrics = await asyncio.to_thread(self._update, batch)
        else:
            metrics = await asyncio.to_thread(self._finish_accumulated, batch)
        start = time.perf_counter()
        if sleeps:
            self.optimizer.zero_grad(set_to_none=True)  # the engine's KV cache takes their memory
            await self.engine.wake_up()
        await self.sync_weights()
        metrics["time/sync_s"] = time.perf_counter() - start + time_sleep
        self.step_count += 1
        record = _merge_rollout_metrics(metrics, rollout_metrics)
        if self.world_size > 1:  # rank 0's timings: one record, the same on every rank
            shared = [record]
            dist.broadcast_object_list(shared, src=0)
            record = shared[0]
        self.metrics.log(self.step_count, record)
        self._advance_steps_bar(record)
        return record

    async def accumulate(self, paths: Sequence[TrainingPath] | PathBatch) -> None:
        """Run the next step's forward and backward passes on part of its batch now.

        For a batch that arrives in parts (asynchronous training streams each prompt's trees
        as they come back): the parts' gradients add up, and :meth:`step` with the rest of the
        batch (possibly nothing) takes the one optimiser step. The update is the one of
        ``step(all paths)`` up to rounding: each part's loss is weighted by its loss units (the
        action tokens under token-mean) and the sum divided by the
        whole batch's once it is known (docs/algorithms.md eq. 79). Needs one optimiser update a step
        (``mini_batches = epochs = 1``): every later one would need the whole batch's π_old first.
        """
        cfg = self.config
        if cfg.mini_batches != 1 or cfg.epochs != 1:
            raise ValueError(
                f"Trainer.accumulate needs one optimiser update a step, but mini_batches={cfg.mini_batches} and "
                f"epochs={cfg.epochs}: set both to 1, or hand the whole batch to Trainer.step"
            )
        if not _size(paths):
            return
        batch = paths if isinstance(paths, PathBatch) else collate(paths, self.pad_id)
        self._accumulated = await asyncio.to_thread(self._accumulate, batch, self._accumulated)

    def _update(self, batch: PathBatch) -> dict[str, float]:
        """Steps 2-4 of the module docstring on one collated batch; returns the trainer's metrics."""
        cfg = self.config
        batch = self._on_device(batch)
        n = batch.ids.shape[0]
        if cfg.mini_batches > n:
            raise ValueError(f"mini_batches={cfg.mini_batches} but the batch has only {n} sequences")
        lengths = batch.attention_mask.sum(-1)
        micro_batches = [
            self._micro_batches(rows, lengths, batch.ids) for rows in torch.arange(n).tensor_split(cfg.mini_batches)
        ]
        # This rank's passes over each mini-batch: all of them in one process (see _rank_passes).
        passes = [self._rank_passes(mini_batch) for mini_batch in micro_batches]
        bar = progress_bar(
            f"update step {self.step_count + 1}",
            cfg.epochs * sum(len(p) for p in passes),
            unit="micro-batches",
            leave=False,
            show=self._shows_progress,
        )
        work = _StepWork(batch)
        self._passes = defaultdict(int)
        # 2-3. Old log-probs: the current policy before this step's updates, and the reference's.
        old_logprobs, ref_logprobs = self._old_and_reference(batch, work)

        # 4. Updates: one optimiser step per mini-batch, gradients accumulated over its micro-batches.
        start = time.perf_counter()
        units = self._loss_units(batch)
        for epoch in range(cfg.epochs):
            for update, mini_batch in enumerate(micro_batches):
                self.optimizer.zero_grad(set_to_none=True)
                total = sum(int(units[rows].sum()) for rows in mini_batch)  # over the whole mini-batch, every rank
                for rows, real in passes[update]:
                    share = int(units[rows].sum()) / max(total, 1)  # u_j / Σ_j' u_j'  (docs/algorithms.md eq. 58)
                    self._backward(
                        batch, rows, real, old_logprobs, ref_logprobs, share, work, first=epoch == update == 0
                    )
                    bar.update()
                self._optimizer_step(work)
        bar.close()
        work.time_update += time.perf_counter() - start
        return self._update_metrics(work)

    def _accumulate(self, batch: PathBatch, work: _StepWork | None) -> _StepWork:
        """:meth:`accumulate` on one collated part: its passes' gradients added to the step's so far."""
        batch = self._on_device(batch)
        if work is None:  # the step's first part
            self.optimizer.zero_grad(set_to_none=True)
            self._passes = defaultdict(int)
            work = _StepWork(batch)
        else:
            work.add(batch)
        old_logprobs, ref_logprobs = self._old_and_reference(batch, work)
        start = time.perf_counter()
        units = self._loss_units(batch)
        micro_batches = self._micro_batches(torch.arange(batch.ids.shape[0]), batch.attention_mask.sum(-1), batch.ids)
        for rows, real in self._rank_passes(micro_batches):
            # weighted by u_j now; divided by Σ_j' u_j' of the whole batch before the optimiser step (eq. 79)
            self._backward(batch, rows, real, old_logprobs, ref_logprobs, float(units[rows].sum()), work, first=True)
        work.units += int(units.sum())
        work.time_update += time.perf_counter() - start
        return work

    def _finish_accumulated(self, rest: PathBatch | None) -> dict[str, float]:
        """:meth:`step` after :meth:`accumulate`: the rest's passes, then the one optimiser step."""
        assert self._accumulated is not None
        work = self._accumulated if rest is None else self._accumulate(rest, self._accumulated)
        self._accumulated = None
        start = time.perf_counter()
        # Σ_j u_j ∇ℓ_j / Σ_j u_j: the whole batch's gradient (docs/algorithms.md eq. 79)
        scale = 1.0 / max(work.units, 1)
        for parameter in self.trainable_parameters:
            if parameter.grad is not None:
                parameter.grad.mul_(scale)
        work.loss.scale(scale)
        self._optimizer_step(work)
        work.time_update += time.perf_counter() - start
        return self._update_metrics(work)

    def _on_device(self, batch: PathBatch) -> PathBatch:
        batch = batch.to(self.device)
        if batch.mask.bool()[:, 0].any():
            raise ValueError(
                "a path starts with an action token, which has no context to be scored from; "
                "every path must start with at least one prompt token"
            )
        return batch

    def _old_and_reference(self, batch: PathBatch, work: _StepWork) -> tuple[torch.Tensor, torch.Tensor | None]:
        """π_old's log-probs of ``batch`` (recomputed, or the sampler's) and the reference's (KL on), timed into ``work``."""
        start = time.perf_counter()
        old_logprobs = batch.old_logprobs
        if self.config.old_logprobs == "recompute":
            old_logprobs = self._score(self.model, batch)
            work.mismatch.add(old_logprobs, batch.old_logprobs, batch.mask.bool())
        ref_logprobs = None
        if self._uses_reference:
            with self._reference_policy() as reference:
                ref_logprobs = self._score(reference, batch)
        work.time_old += time.perf_counter() - start
        return old_logprobs, ref_logprobs

    def _loss_units(self, batch: PathBatch) -> torch.Tensor:
        """u_j of each path (docs/algorithms.md eq. 58): its action tokens under token-mean, else 1 (0 without any)."""
        mask = batch.mask.bool()
        return mask.sum(-1) if self._token_weighted else (mask.sum(-1) > 0)

    def _backward(
        self,
        batch: PathBatch,
        rows: torch.Tensor,
        real: bool,
        old_logprobs: torch.Tensor,
        ref_logprobs: torch.Tensor | None,
        weight: float,
        work: _StepWork,
        *,
        first: bool,
    ) -> None:
        """One micro-batch's forward pass and the backward pass of its loss × ``weight``.

        ``first``: the pass of the step's first update, where the sampler's log-probs are
        compared with the trainer's when they serve as π_old.
        """
        cfg = self.config
        width = int(batch.attention_mask[rows].sum(-1).max())  # trim the batch's padding
        cut = (rows, slice(0, width))
        mask = batch.mask[cut].bool()
        # A_t ← w_t · A_t when shared turns are trained once (docs/algorithms.md eq. 35)
        advantages = batch.advantages[cut] * batch.weights[cut] if cfg.dedup_shared_turns else batch.advantages[cut]
        with self._checkpointing():
            logprobs, entropy = self._forward(
                self.model,
                batch.ids[cut],
                batch.attention_mask[cut],
                entropy_grad=cfg.entropy_coef > 0,
                scored=batch.mask[cut],
            )
        assert entropy is not None  # _forward computes the entropy unless asked not to (entropy=False)
        if real:
            for name, count in self._last_pass.items():
                self._passes[name] += count
        if cfg.old_logprobs == "sampler" and first and real:
            work.mismatch.add(logprobs.detach(), batch.old_logprobs[cut], mask)
        optional = {
            "entropy": entropy,
            "turn_ids": batch.turn_ids[cut],
            "entropy_coef": cfg.entropy_coef,
            "ref_logprobs": None if ref_logprobs is None else ref_logprobs[cut],
            "kl_coef": cfg.kl_coef,
            # π_behav of the decoupled objective: the sampler's (docs/algorithms.md eq. 75)
            "behaviour_logprobs": batch.old_logprobs[cut] if cfg.decoupled else None,
        }
        loss, metrics = self.loss_fn(
            logprobs,
            old_logprobs[cut],
            advantages,
            batch.mask[cut],
            **cfg.loss_kwargs,
            **{name: value for name, value in optional.items() if name in self._loss_params},
        )
        if not real:  # a pass that keeps the ranks' collectives in step: gradient exactly 0
            (loss * 0.0).backward()
            return
        # The loss averages over action tokens (token-mean) or sequences (the seq-mean modes); a
        # micro-batch's loss is weighted by its share of the mini-batch's, so that accumulating
        # micro-batches gives the gradient of the whole mini-batch at once (docs/algorithms.md eq. 58).
        (loss * weight).backward()
        if "loss" not in metrics:  # a callable loss may report nothing
            metrics["loss"] = float(loss.detach())
        if "entropy" not in metrics:
            metrics["entropy"] = _masked_mean(entropy.detach(), mask)
        work.loss.add(metrics, weight)

    def _optimizer_step(self, work: _StepWork) -> None:
        """Clip the accumulated gradient and step AdamW and the schedule; its numbers into ``work``."""
        cfg = self.config
        if self.world_size > 1:  # each rank's micro-batches' shares: their sum is the mini-batch's
            work.loss.update = defaultdict(float, _sum_over_ranks(work.loss.update))
        work.optim["lr"].append(self.scheduler.get_last_lr()[0])
        # Clip to max_grad_norm; the returned norm is the one before clipping (docs/algorithms.md eq. 57).
        # Over sharded parameters it is the norm of the whole (reduced) gradient.
        norm = torch.nn.utils.clip_grad_norm_(self.trainable_parameters, cfg.max_grad_norm)
        grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        work.optim["grad_norm"].append(grad_norm)
        if math.isfinite(grad_norm):
            with self._weights_changing():
                self.optimizer.step()
        else:  # verl skips an update whose gradient overflowed rather than corrupt the weights
            work.optim["skipped_updates"].append(1.0)
        self.scheduler.step()
        work.loss.end_update()

    def _update_metrics(self, work: _StepWork) -> dict[str, float]:
        """The trainer's metrics of the step whose passes and updates ``work`` holds."""
        cfg = self.config
        if self.world_size > 1 and cfg.old_logprobs == "sampler":  # each rank compared its own micro-batches
            work.mismatch.combine_ranks()
        if self.world_size > 1:  # each rank counted its own passes
            self._passes = defaultdict(int, {k: int(v) for k, v in _sum_over_ranks(self._passes).items()})
        rewards = torch.cat(work.rewards).double()
        optim = work.optim
        return {
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std(correction=0).item(),
            "reward/min": rewards.min().item(),
            "reward/max": rewards.max().item(),
            **{f"policy/{name}": value for name, value in work.loss.result(cfg.epochs).items()},
            **work.mismatch.result(),
            "optim/grad_norm": sum(optim["grad_norm"]) / len(optim["grad_norm"]),
            "optim/lr": optim["lr"][-1],
            "optim/updates": float(len(optim["grad_norm"])),
            "optim/skipped_updates": float(len(optim["skipped_updates"])),
            "tokens/trained": work.trained_tokens,
            "tokens/action": work.action_tokens,
            "batch/sequences": float(work.sequences),
            # What the update's forward passes ran on: padding included, each shared prefix once under tree packing.
            "batch/tokens_forwarded": float(self._passes["tokens_forwarded"]),
            **(
                {
                    f"batch/tree_{kernel}_passes": self._passes[f"{kernel}_passes"]
                    / max(self._passes["tree_passes"], 1)
                    for kernel in ("batched", "flex")
                }
                if cfg.packing == "tree"
                else {}
            ),
            "time/old_logprobs_s": work.time_old,
            "time/update_s": work.time_update,
            "throughput/update_tokens_per_s": work.trained_tokens * cfg.epochs / work.time_update,
        }

    # ---- log-probs -----------------------------------------------------------------------

    def compute_logprobs(self, paths: Sequence[TrainingPath] | PathBatch) -> torch.Tensor:
        """Log-probs of every token under the current policy, ``[batch, tokens]`` like the collated batch.

        ``[b, t]`` scores token ``t`` of path ``b`` given the tokens before it (the
        :class:`~agents.training.batch.PathBatch` convention); 0 at ``t = 0`` and on padding.
        """
        batch = paths if isinstance(paths, PathBatch) else collate(paths, self.pad_id)
        return self._score(self.model, batch.to(self.device), actions_only=False)

    @torch.no_grad()
    def _score(self, model: torch.nn.Module, batch: PathBatch, *, actions_only: bool = True) -> torch.Tensor:
        """Log-probs of ``batch``'s action tokens (every token with ``actions_only=False``) under
        ``model`` ([batch, tokens], 0 elsewhere), micro-batched."""
        scores = torch.zeros(batch.ids.shape, dtype=torch.float32, device=self.device)
        micro_batches = self._micro_batches(torch.arange(batch.ids.shape[0]), batch.attention_mask.sum(-1), batch.ids)
        for rows, real in self._rank_passes(micro_batches):
            width = int(batch.attention_mask[rows].sum(-1).max())
            scored = batch.mask[rows, :width] if actions_only else None
            values = self._forward(
                model, batch.ids[rows, :width], batch.attention_mask[rows, :width], entropy=False, scored=scored
            )[0]
            if real:
                scores[rows, :width] = values
        if self.world_size > 1:
            # Each rank filled only its rows (the others are 0), so the sum is every rank's whole batch.
            dist.all_reduce(scores)
            root = self._roots.get(id(model))
            if root is not None:
                root.reshard()  # type: ignore[operator]  # FSDPModule.reshard; no backward pass will do it
        return scores

    def _rank_passes(self, micro_batches: list[torch.Tensor]) -> list[tuple[torch.Tensor, bool]]:
        """This rank's passes over ``micro_batches``: ``(rows, real)``.

        In one process, every micro-batch. Rank r of N takes micro-batches r, r + N, r + 2N, …,
        then as many passes on one row of the first micro-batch (``real`` False, contributing
        nothing) as make every rank run the same number of passes: FSDP's all-gathers and
        reduce-scatters run in each pass and must pair up across the ranks.
        """
        if self.world_size == 1:
            return [(rows, True) for rows in micro_batches]
        mine = micro_batches[self.rank :: self.world_size]
        count = -(-len(micro_batches) // self.world_size)
        return [(rows, True) for rows in mine] + [(micro_batches[0][:1], False)] * (count - len(mine))

    def _micro_batches(
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

    @contextlib.contextmanager
    def _checkpointing(self):
        """Gradient checkpointing for one forward pass that needs gradients, when configured.

        transformers checkpoints a decoder layer only while that layer is in training mode; only
        those layers' flags are set, so dropout and every other module stay in eval mode and the
        pass scores the same policy as the no-grad ones.
        """
        layers = self._checkpointed_layers if self.config.gradient_checkpointing else []
        for layer in layers:
            layer.training = True
        try:
            yield
        finally:
            for layer in layers:
                layer.training = False

    def _forward(
        self,
        model: torch.nn.Module,
        ids: torch.Tensor,
        attention_mask: torch.Tensor,
        *,
        entropy: bool = True,
        entropy_grad: bool = False,
        scored: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Per-token log-probs and full-vocabulary entropies of right-padded sequences.

        ``logprobs[b, t] = log softmax(z / T)[ids[b, t]]`` with ``z`` the logits at ``t − 1``
        (0 at ``t = 0`` and on padding); ``entropy[b, t]`` is the entropy of that distribution.
        The entropy carries a gradient only with ``entropy_grad`` (an entropy bonus). With
        ``scored`` (a ``[batch, tokens]`` mask, the action tokens), only those tokens are scored
        (0 elsewhere) and the output layer runs on them alone, in chunks (see ``score_chunk``).
        """
        root = self._roots.get(id(model))
        if root is not None:  # sharded: the whole pass inside the FSDP root's forward (see _Passes)
            return root(self._forward_pass, ids, attention_mask, entropy, entropy_grad, scored)
        return self._forward_pass(model, ids, attention_mask, entropy, entropy_grad, scored)

    def _forward_pass(
        self,
        model: torch.nn.Module,
        ids: torch.Tensor,
        attention_mask: torch.Tensor,
        entropy: bool,
        entropy_grad: bool,
        scored: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        packing = self.config.packing
        packed = None if packing == "padded" else pack_paths(ids, attention_mask, share=packing == "tree")
        if packed is None:
            inputs: dict[str, Any] = {"input_ids": ids, "attention_mask": attention_mask}
        else:  # flat: no mask, the position ids' restarts delimit the paths; tree: tree attention
            inputs = {"input_ids": packed.ids, "position_ids": packed.positions}
        # What this pass ran on; _update counts it into the step's batch/* metrics when the pass is real.
        self._last_pass = {"tokens_forwarded": ids.numel() if packed is None else packed.tokens}
        if packing == "tree":
            assert packed is not None
            enable_tree_attention(model)
            kernel = choose_kernel(packed, ids.device)
            inputs.update(packed_paths=packed, tree_kernel=kernel)
            calls = tree_attention_calls(model)
            self._last_pass.update(
                tree_passes=1, batched_passes=int(kernel == "batched"), flex_passes=int(kernel == "flex")
            )
        parts = _decoder_and_head(model) if scored is not None and self.config.score_chunk else None
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=self.compute_dtype != torch.float32):
            if parts is not None:
                assert scored is not None
                scores = self._score_chosen(parts, inputs, packed, scored, attention_mask, entropy, entropy_grad)
            else:
                logits = model(**inputs, use_cache=False).logits
        if packing == "tree" and tree_attention_calls(model) == calls:
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
        """``_forward`` for the tokens of ``scored`` only: the decoder's hidden states, then the head in chunks."""
        decoder, head = parts
        chunk = self.config.score_chunk
        assert chunk is not None  # _forward takes this path only with a chunk size
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

    @contextlib.contextmanager
    def _reference_policy(self):
        """The reference policy of the KL penalty: ``ref_model``, or the LoRA base model."""
        if self.ref_model is not None:
            yield self.ref_model
        else:
            with self.model.disable_adapter():
                yield self.model

    # ---- weights: engine sync and checkpoints --------------------------------------------

    async def sync_weights(self) -> None:
        """Hand the current weights to the engine (nothing to do when it shares the model)."""
        if self.engine is None or self.shares_weights_with_engine:
            return
        await self.engine.update_weights(self.engine_state_dict())

    def engine_state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's weights under the base transformers model's names.

        Under LoRA, only the adapted layers' merged weights (``W + ΔW``); engines accept such a
        partial state dict. With ``world_size > 1`` every rank must call it (it gathers the
        shards); rank 0 gets the weights, the other ranks an empty dict.
        """
        if self.world_size > 1:
            return self._gathered_state_dict()
        if not self.config.lora_rank:
            return {name: tensor.detach() for name, tensor in self.model.state_dict().items()}
        from peft.tuners.lora import LoraLayer

        merged: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for name, module in self.base_model.named_modules():
                if isinstance(module, LoraLayer):
                    base = module.get_base_layer()
                    weight, bias = base.weight, getattr(base, "bias", None)
                    assert isinstance(weight, torch.Tensor)  # nn.Module.__getattr__ is typed Tensor | Module
                    # peft declares get_delta_weight on every concrete LoraLayer (Linear, Embedding, Conv…) but
                    # not on the LoraLayer base class itself.
                    delta = sum(
                        module.get_delta_weight(adapter)  # type: ignore[attr-defined]
                        for adapter in module.active_adapters
                    )
                    merged[f"{name}.weight"] = weight + delta  # W + (α/r)·B·A
                    if bias is not None:
                        merged[f"{name}.bias"] = bias.detach()
        return merged

    def _gathered_state_dict(self) -> dict[str, torch.Tensor]:
        """engine_state_dict of a sharded policy: the full weights gathered to rank 0's CPU."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)  # rank 0 only
        gathered = get_model_state_dict(self.base_model, options=options)
        if self.rank != 0:
            return {}
        full = {name: value for name, value in gathered.items() if isinstance(value, torch.Tensor)}
        if not self.config.lora_rank:
            return full
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.lora import LoraLayer
        from peft.utils.other import transpose

        merged: dict[str, torch.Tensor] = {}
        for name, module in self.base_model.named_modules():
            if not isinstance(module, LoraLayer):
                continue
            if not isinstance(module, LoraLinear) or any(module.use_dora.get(a) for a in module.active_adapters):
                raise ValueError(
                    f"{name}: with trainer ranks > 1, LoRA merges only plain linear adapters; "
                    "target linear layers only (TrainerConfig.lora_target_modules) or use one trainer rank"
                )
            weight = full[f"{name}.base_layer.weight"]
            for a in module.active_adapters:  # peft's get_delta_weight on the full tensors: (α/r)·B·A
                delta = full[f"{name}.lora_B.{a}.weight"] @ full[f"{name}.lora_A.{a}.weight"]
                weight = weight + transpose(delta, module.fan_in_fan_out) * module.scaling[a]
            merged[f"{name}.weight"] = weight
            if f"{name}.base_layer.bias" in full:
                merged[f"{name}.bias"] = full[f"{name}.base_layer.bias"]
        return merged

    def save_checkpoint(
        self,
        path: str | Path | None = None,
        data_position: dict[str, Any] | None = None,
        *,
        plot_title: str | None = None,
    ) -> Path:
        """Write a checkpoint (weights, optimiser, schedule, RNG, step, ``data_position``) and the plot.

        ``path`` defaults to ``out_dir/checkpoints/step_NNNNNN``. ``data_position`` is the caller's
        opaque, JSON-serialisable place in its data, returned by :meth:`resume`. The curves of
        every step so far are drawn into ``curves.png`` in the checkpoint and in ``out_dir``,
        headed ``plot_title`` (e.g. the run's algorithm, environment, model and folder).
        """
        if path is None:
            if self.out_dir is None:
                raise ValueError("save_checkpoint needs a path, or a Trainer with out_dir")
            path = self.out_dir / "checkpoints" / checkpoint_name(self.step_count)
        with transformers_bars(self._shows_progress):  # its "Writing model shards" bar
            path = save_checkpoint(
                path,
                model=self.model,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                step=self.step_count,
                data_position=data_position,
                config=self.config.to_dict(),
                tokenizer=self.tokenizer,
                sharded=self.world_size > 1,
            )
        if self.metrics is not None and self.metrics.history and self.rank == 0:
            plot_curves(self.metrics.history, path / "curves.png", title=plot_title)
            if self.out_dir is not None:
                plot_curves(self.metrics.history, self.out_dir / "curves.png", title=plot_title)
        return path

    def resume(self, path: str | Path) -> dict[str, Any]:
        """Continue from a checkpoint: weights, optimiser, schedule, RNG and step; returns its data position.

        The following steps repeat the original run's bit for bit on the same hardware and
        thread count (given the same batches). Metrics of later steps (from a run that went on
        past the checkpoint) are dropped from ``out_dir``. The engine is not synced here; the next :meth:`step` or
        :meth:`sync_weights` does it.
        """
        with self._weights_changing():
            checkpoint = load_checkpoint(path, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler)
        self.step_count = checkpoint.step
        self._close_steps_bar()  # the next one counts from the checkpoint's step
        if self.metrics is not None:
            self.metrics.close()
        self.metrics = self._open_metrics(resume_step=checkpoint.step)
        return checkpoint.data_position

    def close(self) -> None:
        """Close the metric writers and progress bars."""
        if self.metrics is not None:
            self.metrics.close()
        self._close_steps_bar()

    def _weights_changing(self) -> contextlib.AbstractContextManager:
        """Held while weights change in place: a sharing engine must not read them half-written."""
        lock = getattr(self.engine, "forward_lock", None)
        return lock if lock is not None and self.shares_weights_with_engine else contextlib.nullcontext()

    # ---- progress ------------------------------------------------------------------------

    @property
    def _metrics_dir(self) -> Path | None:
        """Where metrics go: ``out_dir`` on rank 0; the other ranks keep theirs in memory."""
        return self.out_dir if self.rank == 0 else None

    def _open_metrics(self, resume_step: int | None) -> MetricsLog:
        """The step metrics' log, with the reporters of ``report_to`` (W&B gets the trainer's configuration
        unless the run folder holds the run's own ``config.json``)."""
        return MetricsLog(
            self._metrics_dir,
            report_to=self.config.report_to,
            resume_step=resume_step,
            wandb_project=self.config.wandb_project,
            wandb_config={"trainer": self.config.to_dict()},
        )

    def _shard(self) -> None:
        """Shard the policy (and a reference copy) over the group with FSDP2: each decoder layer, then the rest.

        The root of each is a :class:`_Passes` around the model, so that every pass the trainer runs
        (the chunked head of ``_score_chosen`` included) is one forward of the root: its hooks gather
        the embeddings, final norm and head (tied or not) before and reduce their gradients after.
        Gradients are summed over the ranks, not averaged: each rank's micro-batches carry their
        share of the whole mini-batch already.
        """
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        # Every rank starts from rank 0's weights: a random initialisation (LoRA's A, a model
        # built from a config) would otherwise differ between the ranks, and shard into a mix.
        with torch.no_grad():
            for model in (self.model, self.ref_model):
                for tensor in [] if model is None else [*model.parameters(), *model.buffers()]:
                    dist.broadcast(tensor.data, src=0)
        dtypes = {p.dtype for p in self.model.parameters()}
        if len(dtypes) > 1:
            raise ValueError(
                f"trainer ranks > 1 shard the policy with FSDP2, which needs one parameter dtype, but it has "
                f"{', '.join(sorted(map(str, dtypes)))} (LoRA over a bfloat16 base?); set "
                "TrainerConfig.base_dtype='float32' or use one trainer rank"
            )
        # An explicit mesh on the model's device: without one FSDP moves CPU models to CUDA where there is a GPU.
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        bf16 = self.device.type == "cuda" and self.compute_dtype == torch.bfloat16
        # float32 throughout otherwise (the default policy); bfloat16 compute on a GPU as one process's autocast.
        policy = (
            MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            if bf16
            else MixedPrecisionPolicy()
        )
        for model in (self.model, self.ref_model):
            if model is None:
                continue
            root = _Passes(model)
            for module in [*_decoder_layers(model), root]:
                fully_shard(module, mesh=mesh, mp_policy=policy)
                module.set_gradient_divide_factor(1.0)  # type: ignore[operator]  # an FSDPModule now
                module.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]  # plain SUM (gloo has no PREMUL_SUM)
            self._roots[id(model)] = root

    def open_steps_bar(self) -> None:
        """Show the ``train`` bar (``total_steps``, from ``step_count``) now; :meth:`step` opens it otherwise.

        A run opens it before its first rollout, so that the bar (a line, in a log file) is there
        from the start; :meth:`resume` closes it, and the next one counts from the checkpoint's step.
        """
        if self._steps_bar is None:
            self._steps_bar = progress_bar(
                "train", self.config.total_steps, unit="steps", initial=self.step_count, show=self._shows_progress
            )

    def _close_steps_bar(self) -> None:
        if self._steps_bar is not None:
            self._steps_bar.close()
            self._steps_bar = None

    @property
    def _shows_progress(self) -> bool | None:
        """``config.progress`` on rank 0; the other ranks show none (agents.progress says what None shows)."""
        return self.config.progress if self.rank == 0 else False

    def _advance_steps_bar(self, record: Mapping[str, float]) -> None:
        self.open_steps_bar()
        self._steps_bar.set_postfix(
            reward=f"{record['reward/mean']:.3f}", loss=f"{record['policy/loss']:.4f}", refresh=False
        )
        self._steps_bar.update()


def _with_lora(model: PreTrainedModel, cfg: TrainerConfig) -> PeftModel:
    """``model`` with LoRA adapters injected in place (only the adapters train)."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(
        r=cfg.lora_rank,
        lora_alpha=cfg.lora_alpha,
        target_modules=cfg.lora_target_modules,
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )  # no dropout in RL, as for the base model
    return get_peft_model(model, lora).eval()


def _compute_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


def _loss_parameters(loss_fn: LossFn, cfg: TrainerConfig, uses_reference: bool) -> dict[str, Any]:
    """The loss's keyword parameters and the values it will run with; checks the config against them."""
    signature = inspect.signature(loss_fn)
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in signature.parameters.values())
    params = {
        name: p.default
        for name, p in signature.parameters.items()
        if p.kind in (inspect.Parameter.KEYWORD_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    }
    name = getattr(loss_fn, "__name__", repr(loss_fn))
    reserved = sorted(set(cfg.loss_kwargs) & set(TRAINER_INPUTS))
    if reserved:
        raise ValueError(
            f"loss_kwargs sets {reserved}, which the trainer supplies; set kl_coef and entropy_coef "
            "on TrainerConfig, and leave the tensors to the trainer"
        )
    unknown = sorted(set(cfg.loss_kwargs) - set(params)) if not takes_any else []
    if unknown:
        raise ValueError(f"loss {name} has no parameter {', '.join(unknown)}; it takes {', '.join(list(params)[4:])}")
    needed = {
        "kl_coef": uses_reference,
        "ref_logprobs": uses_reference,
        "entropy": cfg.entropy_coef > 0,
        "entropy_coef": cfg.entropy_coef > 0,
        "behaviour_logprobs": cfg.decoupled,
    }
    missing = [param for param, need in needed.items() if need and param not in params and not takes_any]
    if missing:
        raise ValueError(
            f"loss {name} takes no {', '.join(missing)}, so it cannot apply the configured KL penalty, "
            "entropy bonus or decoupled objective"
        )
    if takes_any:
        params.update(dict.fromkeys(TRAINER_INPUTS))
    return {**params, **cfg.loss_kwargs}


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


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers FSDP shards one by one: transformers' checkpointable layers, else ``model.layers``."""
    layers: list[torch.nn.Module] = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if layers:
        return layers
    for module in model.modules():
        found = getattr(module, "layers", None)
        if isinstance(found, torch.nn.ModuleList):
            return list(found)
    return []


class _Passes(torch.nn.Module):
    """The FSDP2 root around a sharded model: ``_Passes(model)(run, *args)`` is ``run(model, *args)``.

    FSDP2 gathers the root's parameters (embeddings, final norm, output layer) in the root's
    forward pre-hook and reduces their gradients from hooks it sets there; a pass that calls the
    decoder and the head separately would bypass both. Running every pass as this module's
    forward keeps them, whatever the pass calls inside.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, run: Any, *args: Any) -> Any:
        return run(self.model, *args)


def _sum_over_ranks(values: Mapping[str, float]) -> dict[str, float]:
    """Each name's values summed over the ranks (in rank order, so every rank gets the same floats)."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dict(values))
    total: dict[str, float] = defaultdict(float)
    for part in gathered:
        for name, value in part.items():
            total[name] += value
    return dict(total)


def _unpacked(values: torch.Tensor, places: torch.Tensor, packed: PackedPaths) -> torch.Tensor:
    """Scores of the row's ``places`` back to ``[paths, tokens]`` (0 at depth 0, which has no score)."""
    row = values.new_zeros(packed.tokens).index_put((places,), values)
    return row[packed.where]


def _size(paths: Sequence[TrainingPath] | PathBatch) -> int:
    return paths.ids.shape[0] if isinstance(paths, PathBatch) else len(paths)


def _masked_mean(values: torch.Tensor, mask: torch.Tensor) -> float:
    return float((values * mask).sum() / mask.sum().clamp(min=1))


def _checked_rollout_metrics(rollout: Mapping[str, float]) -> dict[str, float]:
    """The caller's metrics as floats, refusing names the trainer writes itself."""
    clash = sorted(name for name in rollout if name in _TRAINER_METRICS or name.startswith(_TRAINER_GROUPS))
    if clash:
        raise ValueError(
            f"rollout_metrics names {clash}, which the trainer computes itself; rename them "
            f"(the trainer owns {', '.join(_TRAINER_GROUPS)}* and {', '.join(sorted(_TRAINER_METRICS))})"
        )
    try:
        return {str(name): float(value) for name, value in rollout.items()}
    except (TypeError, ValueError) as error:
        raise ValueError(f"rollout_metrics values must be numbers: {error}") from None


def _merge_rollout_metrics(own: dict[str, float], rollout: dict[str, float]) -> dict[str, float]:
    """The trainer's metrics with the caller's, plus what follows from both (step time, rollout tokens/s)."""
    record = {**own, **rollout}
    record["time/step_s"] = sum(
        record.get(name, 0.0) for name in (ROLLOUT_TIME, "time/old_logprobs_s", "time/update_s", "time/sync_s")
    )
    if ROLLOUT_TIME in rollout and GENERATED_TOKENS in rollout and rollout[ROLLOUT_TIME] > 0:
        record["throughput/rollout_tokens_per_s"] = rollout[GENERATED_TOKENS] / rollout[ROLLOUT_TIME]
    return record


class _Mismatch:
    """|sampler log-prob − trainer log-prob| over action tokens: max and mean (docs/algorithms.md eq. 59)."""

    def __init__(self) -> None:
        self.max, self.sum, self.tokens = 0.0, 0.0, 0

    def add(self, trainer: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor) -> None:
        difference = (trainer.double() - sampler.double()).abs()[mask]  # docs/algorithms.md eq. 59
        if difference.numel():
            self.max = max(self.max, float(difference.max()))
            self.sum += float(difference.sum())
            self.tokens += difference.numel()

    def combine_ranks(self) -> None:
        """Every rank's comparisons together (max of the maxima, sums and counts summed)."""
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (self.max, self.sum, self.tokens))
        self.max = max(part[0] for part in gathered)
        self.sum = sum(part[1] for part in gathered)
        self.tokens = sum(part[2] for part in gathered)

    def result(self) -> dict[str, float]:
        return {
            "mismatch/max_abs": self.max,
            "mismatch/mean_abs": self.sum / max(self.tokens, 1),
            "mismatch/tokens": float(self.tokens),
        }


class _LossMetrics:
    """Loss metrics of the micro-batches: weighted means per update (counts summed), then per step."""

    def __init__(self) -> None:
        self.update: dict[str, float] = defaultdict(float)
        self.totals: dict[str, float] = defaultdict(float)
        self.updates = 0

    def add(self, metrics: Mapping[str, float], share: float) -> None:
        for name, value in metrics.items():
            self.update[name] += value if name in _COUNT_METRICS else value * share

    def scale(self, factor: float) -> None:
        """The update's weighted sums × ``factor`` (weights given as units, divided by their total at the end)."""
        for name in self.update:
            if name not in _COUNT_METRICS:
                self.update[name] *= factor

    def end_update(self) -> None:
        for name, value in self.update.items():
            self.totals[name] += value
        self.update.clear()
        self.updates += 1

    def result(self, epochs: int) -> dict[str, float]:
        """Averages over the updates; counts summed over one epoch's mini-batches."""
        return {
            name: value / (epochs if name in _COUNT_METRICS else self.updates) for name, value in self.totals.items()
        }


class _StepWork:
    """What a step's passes and updates add up to: loss metrics, the mismatch, the optimiser's
    numbers, timings, and the sizes of the batch (or of its parts so far, under accumulate)."""

    def __init__(self, batch: PathBatch) -> None:
        self.loss, self.mismatch = _LossMetrics(), _Mismatch()
        self.optim: defaultdict[str, list[float]] = defaultdict(list)
        self.time_old = self.time_update = 0.0
        self.units = 0  # Σ u_j of the parts accumulated so far
        self.rewards: list[torch.Tensor] = []
        self.trained_tokens = self.action_tokens = 0.0
        self.sequences = 0
        self.add(batch)

    def add(self, batch: PathBatch) -> None:
        self.rewards.append(batch.rewards)
        self.trained_tokens += float(batch.attention_mask.sum())
        self.action_tokens += float(batch.mask.sum())
        self.sequences += batch.ids.shape[0]
