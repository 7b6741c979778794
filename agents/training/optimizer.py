"""The optimiser: AdamW over the policy's trainable parameters, its learning-rate schedule, and the clipped step.

docs/algorithms/training.md "AdamW and gradient clipping": AdamW on float32 parameters, the gradient norm
clipped to ``max_grad_norm`` (eq. 57), and an update whose gradient norm is not finite skipped.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
from torch.distributed.tensor import DTensor
from transformers import get_scheduler

from agents.training.trainer_config import TrainerConfig

__all__ = ["adamw_and_schedule", "clipped_step", "trainable_parameters"]


def trainable_parameters(model: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The parameters the optimiser updates; refuses a model with none, or with any not in float32."""
    parameters = [p for p in model.parameters() if p.requires_grad]
    if not parameters:
        raise ValueError("the model has no parameter with requires_grad=True, so there is nothing to train")
    wrong = {str(p.dtype) for p in parameters if p.dtype != torch.float32}
    if wrong:
        raise ValueError(
            f"trainable parameters are {', '.join(sorted(wrong))}; load the policy in float32 "
            "(the trainer computes in bfloat16 on a GPU through autocast)"
        )
    return parameters


def adamw_and_schedule(
    parameters: list[torch.nn.Parameter], cfg: TrainerConfig, device: torch.device
) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW over ``parameters`` and its learning-rate schedule, which steps once per optimiser update."""
    fused = device.type == "cuda" if cfg.fused_adamw is None else cfg.fused_adamw
    optimizer = torch.optim.AdamW(
        parameters,
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
    scheduler = get_scheduler(
        cfg.lr_schedule, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=total_updates
    )
    return optimizer, scheduler


def clipped_step(
    parameters: list[torch.nn.Parameter],
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    max_grad_norm: float,
    weights_changing: contextlib.AbstractContextManager,
) -> float:
    """Clip the accumulated gradient, step the optimiser (held in ``weights_changing``) and the schedule.

    Returns the gradient norm before clipping; a non-finite one skips the optimiser's step.
    """
    # Clip to max_grad_norm; the returned norm is the one before clipping (docs/algorithms/training.md eq. 57).
    # Over sharded parameters it is the norm of the whole (reduced) gradient.
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_grad_norm)
    grad_norm = float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if math.isfinite(grad_norm):
        with weights_changing:
            optimizer.step()
    # else: verl skips an update whose gradient overflowed rather than corrupt the weights
    scheduler.step()
    return grad_norm
