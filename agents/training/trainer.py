"""The trainer: policy-gradient updates of a transformers causal LM on a batch of training paths.

One :meth:`Trainer.step` (read :meth:`Trainer._update` top to bottom):

1. collate the paths (:func:`agents.training.batch.collate`) into right-padded ``[batch, tokens]`` tensors,
   and plan the step's passes once (:meth:`agents.training.forward.PolicyForward.plan`): mini-batches
   of micro-batches, each packed into one row, reused by every pass below;
2. old log-probs: recompute them with the current policy before any update (verl's
   ``compute_log_prob``; the default), or take the sampler's. With one update per batch (one
   epoch, one mini-batch) the recomputed ones are the update's own forward pass, detached, and
   take no pass of their own. Either way the sampler's log-probs are compared with the
   trainer's and the mismatch reported;
3. reference log-probs, when a KL penalty to a reference policy is on;
4. one epoch of ``mini_batches`` optimiser updates over the batch; each accumulates gradients
   over micro-batches of ``micro_batch_size`` sequences (padded, or packed into one row), clips
   the gradient norm, and steps AdamW and the learning-rate schedule (docs/algorithms/training.md "Optimiser and batching");
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
import functools
import inspect
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import distributed as dist
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from agents.engines.base import update_then_sync
from agents.models import (
    cpu_compute_dtype,
    load_model,
    load_tokenizer,
    release_free_memory,
    release_openmp_threads,
)
from agents.progress import progress_bar, transformers_bars
from agents.rollout.tree import TrainingPath
from agents.training.batch import PathBatch, collate
from agents.training.checkpoint import checkpoint_name, load_checkpoint, save_checkpoint
from agents.training.forward import MicroBatch, PolicyForward, StepPlan
from agents.training.lora import merged_lora_weights, with_lora
from agents.training.metrics import MetricsLog, plot_curves
from agents.training.optimizer import adamw_and_schedule, clipped_step, trainable_parameters
from agents.training.reporting import import_wandb
from agents.training.sharding import gathered_state_dict, place_in_group, shard
from agents.training.step_metrics import StepLog, StepWork, checked_rollout_metrics, merge_rollout_metrics
from agents.training.trainer_config import TrainerConfig
from agents.training.trainer_loss import TrainerLoss
from agents.training.tree_attention import attention_shape, check_tree_attention

if TYPE_CHECKING:
    from peft import PeftModel

    from agents.engines.base import WeightReceiver

__all__ = ["Trainer", "TrainerConfig"]


class Trainer:
    """Trains a causal LM on :class:`~agents.rollout.tree.TrainingPath` batches with a policy-gradient loss.

    Args:
        model: a transformers causal LM with float32 parameters (the trainer changes it in
            place), or a model name for :func:`agents.models.load_model`. With
            ``lora_rank > 0`` it is wrapped in a peft LoRA model; the wrapping injects the
            adapters into this very object, so an engine sharing it generates with them.
        config: hyper-parameters (defaults: :class:`TrainerConfig`).
        tokenizer: saved with checkpoints; loaded by name when ``model`` is a name.
        engine: receives the new weights after every step
            (:class:`~agents.engines.base.WeightReceiver`: any :class:`~agents.engines.base.Engine`, or an
            object with a coroutine ``update_weights(state_dict)`` and ``supports_sleep = False``; with
            True, ``sleep``/``wake_up`` coroutines too); an engine whose ``model`` is this model shares
            the weights and needs no copy (its ``forward_lock``, if any, is held while the
            weights change). Can be set later as ``trainer.engine``.
        ref_model: the reference policy of the KL penalty. Without it, ``kl_coef > 0`` uses
            the base model with the adapters switched off under LoRA, and otherwise a frozen
            copy of the initial policy.
        out_dir: the run folder for ``metrics.jsonl``, the reporters' files (``report_to``), ``curves.png`` and
            ``checkpoints/``; ``None`` keeps metrics in memory (``trainer.metrics.history``).
        distributed: be one rank of the initialised default ``torch.distributed`` group (what
            :class:`agents.run.cluster.trainer_ranks.TrainerGroup` starts). With a world size N > 1
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
        engine: WeightReceiver | None = None,
        ref_model: PreTrainedModel | None = None,
        out_dir: str | Path | None = None,
        distributed: bool = False,
    ) -> None:
        self.config = cfg = config or TrainerConfig()
        #: This process's place in the trainer's group: rank 0 of 1 unless ``distributed``.
        self.rank, self.world_size = place_in_group(distributed)
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
        self.model: PreTrainedModel | PeftModel = with_lora(model, cfg) if cfg.lora_rank else model
        self.trainable_parameters = trainable_parameters(self.model)
        attention = attention_shape(model) if cfg.packing == "tree" else None
        self.forward = PolicyForward(cfg, self.device, self.compute_dtype, self.rank, self.world_size, attention)
        if cfg.gradient_checkpointing:
            self.forward.enable_checkpointing(model)
        self.ref_model = ref_model
        if ref_model is None and cfg.kl_coef > 0 and not cfg.lora_rank:
            self.ref_model = copy.deepcopy(model)
        if self.ref_model is not None:
            self.ref_model.eval().requires_grad_(False)
        if self.world_size > 1:
            policies = [m for m in (self.model, self.ref_model) if m is not None]
            self.forward.roots = shard(policies, self.device, self.compute_dtype)
            # fully_shard replaced the parameters by sharded ones (DTensors): the optimiser takes those.
            self.trainable_parameters = trainable_parameters(self.model)
        if cfg.packing == "tree":  # switched on at the first packed pass (enable_tree_attention says why)
            for policy in (self.model, self.ref_model):
                if policy is not None:
                    check_tree_attention(policy)
        self.loss = TrainerLoss(cfg, uses_reference=self._uses_reference)
        self.optimizer, self.scheduler = adamw_and_schedule(self.trainable_parameters, cfg, self.device)
        self.engine = engine
        self.out_dir = None if out_dir is None else Path(out_dir)
        #: Steps (rollout batches) trained so far; checkpoints and metrics are numbered by it.
        self.step_count = 0
        # metrics.jsonl, the reporters and the train bar; out_dir from rank 0 only, the others keep theirs in memory
        self._log = StepLog(cfg, self.out_dir if self.rank == 0 else None, show=self._shows_progress)
        self._accumulated: StepWork | None = None  # the next step's passes so far (accumulate)

    @property
    def metrics(self) -> MetricsLog | None:
        """The step records' log (``metrics.history``): opened by the first step, or by :meth:`resume`."""
        return self._log.metrics

    @property
    def engine(self) -> WeightReceiver | None:
        """The engine that receives new weights after every step (``None``: none)."""
        return self._engine

    @engine.setter
    def engine(self, engine: WeightReceiver | None) -> None:
        if engine is not None and not inspect.iscoroutinefunction(getattr(engine, "update_weights", None)):
            raise TypeError(
                f"engine must have a coroutine update_weights(state_dict); {type(engine).__name__} has none"
            )
        if engine is not None and not isinstance(getattr(engine, "supports_sleep", None), bool):
            raise TypeError(
                f"engine must say whether it sleeps through updates (supports_sleep, a bool; every Engine has it, "
                f"False by default); {type(engine).__name__} does not"
            )
        self._engine = engine

    @property
    def local(self) -> Trainer:
        """This trainer, which runs in this process (:class:`agents.run.backends.TrainerBackend`)."""
        return self

    @property
    def placement(self) -> list[dict[str, Any]]:
        """None of its own: it runs in this process (:class:`agents.run.backends.TrainerBackend`)."""
        return []

    @property
    def rendezvous(self) -> None:
        """None: it meets no other ranks itself (:class:`agents.run.backends.TrainerBackend`)."""
        return None

    @property
    def shares_weights_with_engine(self) -> bool:
        """Whether the engine generates with this very model object (no copy needed)."""
        shared = getattr(self.engine, "model", None)
        return shared is not None and (shared is self.model or shared is self.base_model)

    @property
    def _uses_reference(self) -> bool:
        return self.ref_model is not None or self.config.kl_coef > 0

    @property
    def _old_in_update(self) -> bool:
        """Whether π_old's recomputed log-probs come from the update's own forward pass, without a pass of their own.

        With one optimiser update per batch (one epoch, one mini-batch) every micro-batch is
        scored by the weights π_old names, so its forward pass's log-probs, detached, are the
        recomputed ones (TRL skips that pass for the same reason). docs/algorithms/training.md "Old log-probs".
        """
        cfg = self.config
        return cfg.old_logprobs == "recompute" and cfg.epochs == 1 and cfg.mini_batches == 1

    @property
    def _ranks_compare_own_passes(self) -> bool:
        """Whether each rank measured the mismatch on its own passes only (π_old not recomputed by a pass of its own, ranks > 1)."""
        return self.world_size > 1 and (self.config.old_logprobs == "sampler" or self._old_in_update)

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
        rollout_metrics = checked_rollout_metrics(rollout_metrics or {})
        self.open_steps_bar()
        batch = None if not _size(paths) else paths if isinstance(paths, PathBatch) else collate(paths, self.pad_id)
        if batch is None and self._accumulated is None:
            raise ValueError("Trainer.step got no paths and none were accumulated: there is nothing to train on")
        if self._log.metrics is None:  # before the update, so that a folder holding another run fails first
            self._log.open()
        # The update runs in a worker thread so the event loop (and a shared engine) keeps going.
        if self._accumulated is None:
            assert batch is not None
            update = functools.partial(self._in_thread, self._update, batch, release_memory=True)
        else:
            update = functools.partial(self._in_thread, self._finish_accumulated, batch, release_memory=True)
        metrics, engine_seconds = await update_then_sync(
            self.engine,
            update,
            self.sync_weights,
            sleep=self.config.sleep_engine,
            keep_weights=bool(self.config.lora_rank),  # a LoRA sync sends only the adapted layers
            before_wake=lambda: self.optimizer.zero_grad(set_to_none=True),  # the engine's KV cache takes their memory
        )
        metrics["time/sync_s"] = engine_seconds
        self.step_count += 1
        record = merge_rollout_metrics(metrics, rollout_metrics)
        if self.world_size > 1:  # rank 0's timings: one record, the same on every rank
            shared = [record]
            dist.broadcast_object_list(shared, src=0)
            record = shared[0]
        self._log.log(self.step_count, record)
        return record

    async def accumulate(self, paths: Sequence[TrainingPath] | PathBatch) -> None:
        """Run the next step's forward and backward passes on part of its batch now.

        For a batch that arrives in parts (asynchronous training streams each prompt's trees
        as they come back): the parts' gradients add up, and :meth:`step` with the rest of the
        batch (possibly nothing) takes the one optimiser step. The update is the one of
        ``step(all paths)`` up to rounding: each part's loss is weighted by its loss units (the
        action tokens under token-mean) and the sum divided by the
        whole batch's once it is known (docs/algorithms/steps.md eq. 79). Needs one optimiser update a step
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
        self._accumulated = await self._in_thread(self._accumulate, batch, self._accumulated)

    async def _in_thread(self, work: Callable[..., Any], *args: Any, release_memory: bool = False) -> Any:
        """``work(*args)`` in an executor thread, whose OpenMP helpers end after it on CPU: an engine decoding next
        in another thread runs at full speed (:func:`~agents.models.release_openmp_threads`). With
        ``release_memory`` (a step's update, not each streamed part: a trim takes ~0.5 s on a 10 GB heap) the
        memory it freed goes back to the system (:func:`~agents.models.release_free_memory`)."""

        def run() -> Any:
            try:
                return work(*args)
            finally:
                if self.device.type == "cpu":
                    release_openmp_threads()
                if release_memory:
                    release_free_memory()

        return await asyncio.to_thread(run)

    def _update(self, batch: PathBatch) -> dict[str, float]:
        """Steps 2-4 of the module docstring on one collated batch; returns the trainer's metrics."""
        cfg = self.config
        batch = self._on_device(batch)
        plan = self.forward.plan(batch, cfg.mini_batches)  # split and packed once, for every pass below
        work = StepWork(batch)
        # 2-3. Old log-probs: the current policy before this step's updates, and the reference's.
        old_logprobs, ref_logprobs = self._old_and_reference(batch, plan, work)

        # 4. Updates: one optimiser step per mini-batch, gradients accumulated over its micro-batches.
        start = time.perf_counter()
        units = self.loss.units(batch.mask)
        bar = progress_bar(
            f"update step {self.step_count + 1}",
            cfg.epochs * sum(len(mini_batch.passes) for mini_batch in plan.mini_batches),
            unit="micro-batches",
            leave=False,
            show=self._shows_progress,
        )
        for epoch in range(cfg.epochs):
            for update, mini_batch in enumerate(plan.mini_batches):
                self.optimizer.zero_grad(set_to_none=True)
                total = int(units[mini_batch.rows].sum())  # over the whole mini-batch, every rank
                for micro, real in mini_batch.passes:
                    # u_j / Σ_j' u_j'  (docs/algorithms/training.md eq. 58)
                    share = int(units[micro.rows].sum()) / max(total, 1)
                    first = epoch == update == 0
                    self._backward(batch, micro, real, (old_logprobs, ref_logprobs), share, work, first=first)
                    bar.update()
                self._optimizer_step(work)
        bar.close()
        work.add_passes(plan.micro_batches, times=cfg.epochs)
        work.time_update += time.perf_counter() - start
        return work.result(self.config.epochs, combine_ranks=self._ranks_compare_own_passes)

    def _accumulate(self, batch: PathBatch, work: StepWork | None) -> StepWork:
        """:meth:`accumulate` on one collated part: its passes' gradients added to the step's so far."""
        batch = self._on_device(batch)
        if work is None:  # the step's first part
            self.optimizer.zero_grad(set_to_none=True)
            work = StepWork(batch)
        else:
            work.add(batch)
        plan = self.forward.plan(batch)
        old_logprobs, ref_logprobs = self._old_and_reference(batch, plan, work)
        start = time.perf_counter()
        units = self.loss.units(batch.mask)
        (mini_batch,) = plan.mini_batches
        for micro, real in mini_batch.passes:
            # weighted by u_j now; divided by Σ_j' u_j' of the whole batch before the optimiser step (eq. 79)
            weight = float(units[micro.rows].sum())
            self._backward(batch, micro, real, (old_logprobs, ref_logprobs), weight, work, first=True)
        work.add_passes(plan.micro_batches)
        work.units += int(units.sum())
        work.time_update += time.perf_counter() - start
        return work

    def _finish_accumulated(self, rest: PathBatch | None) -> dict[str, float]:
        """:meth:`step` after :meth:`accumulate`: the rest's passes, then the one optimiser step."""
        assert self._accumulated is not None
        work = self._accumulated if rest is None else self._accumulate(rest, self._accumulated)
        self._accumulated = None
        start = time.perf_counter()
        # Σ_j u_j ∇ℓ_j / Σ_j u_j: the whole batch's gradient (docs/algorithms/steps.md eq. 79)
        scale = 1.0 / max(work.units, 1)
        for parameter in self.trainable_parameters:
            if parameter.grad is not None:
                parameter.grad.mul_(scale)
        work.loss.scale(scale)
        self._optimizer_step(work)
        work.time_update += time.perf_counter() - start
        return work.result(self.config.epochs, combine_ranks=self._ranks_compare_own_passes)

    def _on_device(self, batch: PathBatch) -> PathBatch:
        batch = batch.to(self.device)
        if batch.mask.bool()[:, 0].any():
            raise ValueError(
                "a path starts with an action token, which has no context to be scored from; "
                "every path must start with at least one prompt token"
            )
        return batch

    def _old_and_reference(
        self, batch: PathBatch, plan: StepPlan, work: StepWork
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """π_old's log-probs of ``batch`` (recomputed, the sampler's, or None: the update's own) and the reference's (KL on), timed into ``work``."""
        start = time.perf_counter()
        old_logprobs: torch.Tensor | None = batch.sampler_logprobs
        if self._old_in_update:
            old_logprobs = None  # the update's own forward pass gives them (_backward)
        elif self.config.old_logprobs == "recompute":
            old_logprobs = self.forward.score(self.model, batch, plan)
            work.mismatch.add(old_logprobs, batch.sampler_logprobs, batch.mask.bool())
        ref_logprobs = None
        if self._uses_reference:
            with self._reference_policy() as reference:
                ref_logprobs = self.forward.score(reference, batch, plan)
        work.time_old += time.perf_counter() - start
        return old_logprobs, ref_logprobs

    def _backward(
        self,
        batch: PathBatch,
        micro: MicroBatch,
        real: bool,
        old_and_reference: tuple[torch.Tensor | None, torch.Tensor | None],
        weight: float,
        work: StepWork,
        *,
        first: bool,
    ) -> None:
        """One micro-batch's forward pass and the backward pass of its loss × ``weight``.

        ``real`` False: a pass that keeps the ranks' collectives in step, to no effect. ``first``:
        the pass of the step's first update, where the sampler's log-probs are compared with the
        trainer's when they serve as π_old.
        """
        cfg = self.config
        cut = micro.cut
        old_logprobs, ref_logprobs = (None if values is None else values[cut] for values in old_and_reference)
        mask = batch.mask[cut].bool()
        # A_t ← w_t · A_t when shared turns are trained once (docs/algorithms/credit.md eq. 35)
        advantages = batch.advantages[cut] * batch.weights[cut] if cfg.dedup_shared_turns else batch.advantages[cut]
        logprobs, entropy = self.forward(self.model, batch, micro, entropy_grad=cfg.entropy_coef > 0)
        assert entropy is not None  # the forward pass computes the entropy unless asked not to (entropy=False)
        if old_logprobs is None:  # π_old is the policy of this very pass (_old_in_update)
            old_logprobs = logprobs.detach()
        if (cfg.old_logprobs == "sampler" or self._old_in_update) and first and real:
            work.mismatch.add(logprobs.detach(), batch.sampler_logprobs[cut], mask)
        loss, metrics = self.loss(
            logprobs,
            old_logprobs,
            advantages,
            batch.mask[cut],
            entropy=entropy,
            turn_ids=batch.turn_ids[cut],
            ref_logprobs=ref_logprobs,
            # π_behav of the decoupled objective: the sampler's (docs/algorithms/steps.md eq. 75)
            behaviour_logprobs=batch.sampler_logprobs[cut] if cfg.decoupled else None,
        )
        if not real:  # gradient exactly 0
            (loss * 0.0).backward()
            return
        # The loss averages over action tokens (token-mean) or sequences (the seq-mean modes); a
        # micro-batch's loss is weighted by its share of the mini-batch's, so that accumulating
        # micro-batches gives the gradient of the whole mini-batch at once (docs/algorithms/training.md eq. 58).
        (loss * weight).backward()
        if "loss" not in metrics:  # a callable loss may report nothing
            metrics["loss"] = float(loss.detach())
        if "entropy" not in metrics:
            metrics["entropy"] = float((entropy.detach() * mask).sum() / mask.sum().clamp(min=1))
        work.loss.add(metrics, weight)

    def _optimizer_step(self, work: StepWork) -> None:
        """Clip the accumulated gradient and step AdamW and the schedule; its numbers into ``work``."""
        if self.world_size > 1:  # each rank's micro-batches' shares: their sum is the mini-batch's
            work.loss.combine_ranks()
        work.optim["lr"].append(self.scheduler.get_last_lr()[0])
        grad_norm = clipped_step(
            self.trainable_parameters,
            self.optimizer,
            self.scheduler,
            self.config.max_grad_norm,
            self._weights_changing(),
        )
        work.optim["grad_norm"].append(grad_norm)
        work.loss.end_update()

    # ---- log-probs -----------------------------------------------------------------------

    def compute_logprobs(self, paths: Sequence[TrainingPath] | PathBatch) -> torch.Tensor:
        """Log-probs of every token under the current policy, ``[batch, tokens]`` like the collated batch.

        ``[b, t]`` scores token ``t`` of path ``b`` given the tokens before it (the
        :class:`~agents.training.batch.PathBatch` convention); 0 at ``t = 0`` and on padding.
        """
        batch = (paths if isinstance(paths, PathBatch) else collate(paths, self.pad_id)).to(self.device)
        return self.forward.score(self.model, batch, self.forward.plan(batch), actions_only=False)

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

        Under LoRA, only the adapted layers' merged weights (``W + ΔW``,
        :func:`agents.training.lora.merged_lora_weights`); engines accept such a partial state
        dict. With ``world_size > 1`` every rank must call it (it gathers the shards); rank 0 gets
        the weights, the other ranks an empty dict.
        """
        if self.world_size > 1:
            state = gathered_state_dict(self.base_model)
            if self.rank != 0:
                return {}
        else:
            state = {name: tensor.detach() for name, tensor in self.base_model.state_dict().items()}
        return merged_lora_weights(self.base_model, state) if self.config.lora_rank else state

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
        self._log.close_bar()  # the next one counts from the checkpoint's step
        self._log.open(resume_step=checkpoint.step)
        return checkpoint.data_position

    def close(self) -> None:
        """Close the metric writers and progress bars."""
        self._log.close()

    def _weights_changing(self) -> contextlib.AbstractContextManager:
        """Held while weights change in place: a sharing engine must not read them half-written."""
        lock = getattr(self.engine, "forward_lock", None)
        return lock if lock is not None and self.shares_weights_with_engine else contextlib.nullcontext()

    # ---- progress ------------------------------------------------------------------------

    def open_steps_bar(self) -> None:
        """Show the ``train`` bar (``total_steps``, from ``step_count``) now; :meth:`step` opens it otherwise.

        A run opens it before its first rollout, so that the bar (a line, in a log file) is there
        from the start; :meth:`resume` closes it, and the next one counts from the checkpoint's step.
        """
        self._log.open_bar(self.step_count)

    @property
    def _shows_progress(self) -> bool | None:
        """``config.progress`` on rank 0; the other ranks show none (agents.progress says what None shows)."""
        return self.config.progress if self.rank == 0 else False


def _compute_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else cpu_compute_dtype()
    return getattr(torch, name)


def _size(paths: Sequence[TrainingPath] | PathBatch) -> int:
    return paths.ids.shape[0] if isinstance(paths, PathBatch) else len(paths)
