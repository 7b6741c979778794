"""The configured loss as the trainer calls it: hyper-parameters checked once, trainer inputs supplied.

A loss (:mod:`agents.training.losses`) is ``f(logprobs, old_logprobs, advantages, mask, **hyper)``;
its keyword parameters named in :data:`~agents.training.losses.TRAINER_INPUTS` are the trainer's
to supply, every other one is a hyper-parameter set by ``TrainerConfig.loss_kwargs``.
:class:`TrainerLoss` checks the configuration against the loss's signature when the trainer is
built, and then, per micro-batch, passes the loss the inputs it takes.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from agents.training.losses import LOSSES, TRAINER_INPUTS, LossFn
from agents.training.trainer_config import TrainerConfig

__all__ = ["TrainerLoss"]


class TrainerLoss:
    """``config.loss`` with its hyper-parameters and the trainer's coefficients.

    Args:
        config: ``loss``, ``loss_kwargs``, ``kl_coef``, ``entropy_coef`` and ``decoupled`` are read.
        uses_reference: a KL penalty to a reference policy is on (the loss must take ``ref_logprobs``).
    """

    def __init__(self, config: TrainerConfig, *, uses_reference: bool) -> None:
        self.config = config
        self.fn: LossFn = LOSSES[config.loss] if isinstance(config.loss, str) else config.loss
        self.parameters = _loss_parameters(self.fn, config, uses_reference=uses_reference)
        #: Each path's loss weighs by its action tokens (``agg="token-mean"``), else by 1.
        self.token_weighted = self.parameters.get("agg") == "token-mean"

    def units(self, mask: torch.Tensor) -> torch.Tensor:
        """u_j of each path (docs/algorithms/training.md eq. 58): its action tokens under token-mean, else 1 (0 without any)."""
        mask = mask.bool()
        return mask.sum(-1) if self.token_weighted else (mask.sum(-1) > 0)

    def __call__(
        self,
        logprobs: torch.Tensor,
        old_logprobs: torch.Tensor,
        advantages: torch.Tensor,
        mask: torch.Tensor,
        **inputs: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """The loss and its metrics; of ``inputs`` (tensors named in ``TRAINER_INPUTS``) the loss gets those it takes."""
        supplied = {**inputs, "kl_coef": self.config.kl_coef, "entropy_coef": self.config.entropy_coef}
        taken = {name: value for name, value in supplied.items() if name in self.parameters}
        return self.fn(logprobs, old_logprobs, advantages, mask, **self.config.loss_kwargs, **taken)


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
        tensors = list(signature.parameters)[:4]  # logprobs, old_logprobs, advantages, mask, however declared
        takes = [key for key in params if key not in tensors]
        raise ValueError(f"loss {name} has no parameter {', '.join(unknown)}; it takes {', '.join(takes)}")
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
