"""Learners: a rollout strategy, a credit assignment and a loss, with their hyper-parameters.

A :class:`Learner` is a plain composition a user can take apart or replace piece by piece:

- ``strategy`` (:mod:`agents.rollout.strategies`): where the rollout trees of a prompt branch;
- ``credit``: from the finished trees of one prompt to training paths with advantages, any
  callable ``credit(trees) -> list[TrainingPath]`` (:mod:`agents.training.credit` has the formulas
  and the three that wrap them: ``GRPOCredit``, ``TreeGRPOCredit``, ``TurnwiseCredit``);
- ``loss`` (:mod:`agents.training.losses`): a name of :data:`agents.training.losses.LOSSES` or any callable with
  the losses' signature, with ``loss_kwargs``, and the KL coefficient to a reference policy.

The five learners of the papers are subclasses that only change the defaults (each names its
sources; the formulas: docs/algorithms/learners.md "Learners"):

=============  ============================  ==================  ===========================
learner        strategy                      credit              loss
=============  ============================  ==================  ===========================
``AT2PO``      EntropyTree (10 + 2·6 leaves)  TurnwiseCredit      atpo (turn-level ratio)
``AEPO``       EntropyBalancedBranching (16)  GRPOCredit          aepo (both balancing terms)
``GRPO``       Chain (16)                     GRPOCredit          ppo_clip, KL 0.001
``TreeGRPO``   RandomTree (2 trees × 3)       TreeGRPOCredit      ppo_clip
``ARPO``       EntropyBranching (16)          GRPOCredit          ppo_clip
=============  ============================  ==================  ===========================

Bring your own by replacing any part: ``AT2PO(credit=my_credit)``, ``GRPO(loss=my_loss)``,
``Learner(strategy=..., credit=..., loss=...)``. :func:`agents.run.train.train` runs any of them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from agents.rollout.strategies import (
    Chain,
    EntropyBalancedBranching,
    EntropyBranching,
    EntropyTree,
    RandomTree,
    Strategy,
)
from agents.rollout.tree import RolloutTree, TrainingPath
from agents.training.credit import Credit, GRPOCredit, TreeGRPOCredit, TurnwiseCredit
from agents.training.losses import LOSSES, LossFn
from agents.training.trainer_config import TrainerConfig

__all__ = [
    "AEPO",
    "ARPO",
    "AT2PO",
    "GRPO",
    "LEARNERS",
    "Learner",
    "TreeGRPO",
]


@dataclass(frozen=True)
class Learner:
    """A rollout strategy, a credit assignment and a policy loss, with their hyper-parameters.

    Args:
        strategy: Where the trees of a prompt branch (an :class:`agents.rollout.strategies.Strategy`).
        credit: ``credit(trees) -> paths`` over the finished trees of one prompt (:data:`agents.training.credit.Credit`).
        loss: A loss name (``ppo_clip``, ``gspo``, ``atpo``, ``aepo``) or a callable
            ``f(logprobs, old_logprobs, advantages, mask, **hyper) -> (loss, metrics)``.
        loss_kwargs: The loss's hyper-parameters; unset ones keep the loss's defaults.
        kl_coef: Coefficient of the k3 KL penalty to the initial policy (0: no reference model).
        name: How runs and metrics call this learner.
    """

    strategy: Strategy
    credit: Credit
    loss: str | LossFn = "ppo_clip"
    loss_kwargs: Mapping[str, Any] = field(default_factory=dict)
    kl_coef: float = 0.0
    name: str = "custom"

    def __post_init__(self) -> None:
        if not isinstance(self.strategy, Strategy):
            raise TypeError(
                f"{type(self).__name__}.strategy must be an agents.rollout.strategies.Strategy, "
                f"got {type(self.strategy).__name__}"
            )
        if not callable(self.credit):
            raise TypeError(
                f"{type(self).__name__}.credit must be a callable credit(trees) -> paths, "
                f"got {type(self.credit).__name__}"
            )
        if isinstance(self.loss, str):
            if self.loss not in LOSSES:
                raise ValueError(f"unknown loss {self.loss!r}; choose one of {', '.join(LOSSES)} or pass a callable")
        elif not callable(self.loss):
            raise TypeError(
                f"{type(self).__name__}.loss must be a loss name or a callable, got {type(self.loss).__name__}"
            )
        if not (isinstance(self.kl_coef, (int, float)) and math.isfinite(self.kl_coef) and self.kl_coef >= 0):
            raise ValueError(f"{type(self).__name__}.kl_coef must be a finite number >= 0, got {self.kl_coef!r}")
        object.__setattr__(self, "loss_kwargs", dict(self.loss_kwargs))

    def replace(self, **changes: Any) -> Learner:
        """A copy with some parts or hyper-parameters replaced (``dataclasses.replace``)."""
        return dataclasses.replace(self, **changes)

    def configure(
        self,
        *,
        strategy: Mapping[str, Any] | None = None,
        credit: Mapping[str, Any] | None = None,
        loss: Mapping[str, Any] | None = None,
        kl_coef: float | None = None,
    ) -> Learner:
        """A copy with hyper-parameters changed by name (how config files and ``--set`` reach a learner).

        ``strategy`` and ``credit`` set fields of those parts; ``loss`` updates ``loss_kwargs``. A
        field a part does not have is an error that lists the fields it has.
        """
        return self.replace(
            strategy=_with_fields(self.strategy, strategy or {}, "strategy"),
            credit=_with_fields(self.credit, credit or {}, "credit"),
            loss_kwargs={**self.loss_kwargs, **(loss or {})},
            kl_coef=self.kl_coef if kl_coef is None else kl_coef,
        )

    def assign_credit(self, trees: Sequence[RolloutTree]) -> list[TrainingPath]:
        """The training paths of one prompt's finished trees, with advantages from ``credit``."""
        paths = self.credit(trees)
        if not isinstance(paths, list) or not all(isinstance(path, TrainingPath) for path in paths):
            raise TypeError(
                f"credit {self.credit!r} must return a list of agents.rollout.tree.TrainingPath "
                "(tree.paths(...) after filling the advantages)"
            )
        return paths

    def trainer_config(self, **fields: Any) -> TrainerConfig:
        """A :class:`~agents.training.trainer_config.TrainerConfig` with this learner's loss and KL, plus ``fields``."""
        for own in ("loss", "loss_kwargs", "kl_coef"):
            if own in fields:
                raise ValueError(f"{own} belongs to the learner; set it with learner.replace({own}=...)")
        return TrainerConfig(loss=self.loss, loss_kwargs=dict(self.loss_kwargs), kl_coef=self.kl_coef, **fields)

    def describe(self) -> dict[str, Any]:
        """JSON-ready: each part's class (or function) and its hyper-parameters."""
        return {
            "name": self.name,
            "strategy": _part(self.strategy),
            "credit": _part(self.credit),
            "loss": self.loss if isinstance(self.loss, str) else _qualified_name(self.loss),
            "loss_kwargs": dict(self.loss_kwargs),
            "kl_coef": self.kl_coef,
        }


@dataclass(frozen=True)
class AT2PO(Learner):
    """AT²PO (Zong et al. 2026, arXiv 2601.04767): entropy-guided tree, turn-wise credit, turn-level loss.

    EntropyTree M=10, L=2, K=6, α=0.05 (22 leaves per prompt); turn-wise credit with the
    softmax-of-entropy backup; ``atpo_loss`` (turn-level ratio and clipping, ε 3e-3 / 4e-3,
    seq-mean-token-mean); no KL, no entropy bonus. All are the official code's defaults.
    """

    strategy: Strategy = EntropyTree()
    credit: Credit = TurnwiseCredit()
    loss: str | LossFn = "atpo"
    kl_coef: float = 0.0  # AT²PO trains without a KL term
    name: str = "at2po"


@dataclass(frozen=True)
class AEPO(Learner):
    """AEPO (Dong et al. 2025, arXiv 2510.14545): entropy-balanced rollout and policy optimisation.

    EntropyBalancedBranching k=16 (pre-monitoring split, consecutive-branch penalty); GRPO
    advantages; ``aepo_loss`` with both balancing terms on: the clipping-balanced upper bound and
    the entropy-aware advantage (computed from the training forward pass's token entropies, on
    whether or not an entropy bonus is used). No KL.
    """

    strategy: Strategy = EntropyBalancedBranching()
    credit: Credit = GRPOCredit()
    loss: str | LossFn = "aepo"
    loss_kwargs: Mapping[str, Any] = field(
        default_factory=lambda: {"clip_balanced": True, "entropy_aware_advantage": True}
    )
    kl_coef: float = 0.0  # AEPO trains without a KL term
    name: str = "aepo"


@dataclass(frozen=True)
class GRPO(Learner):
    """GRPO (Shao et al. 2024, DeepSeekMath): 16 independent chains, group z-scores, PPO clip and KL.

    Chain n=16; ``ppo_clip_loss`` ε 0.2, dual clip 3, token-mean; KL (k3) to the initial
    policy with coefficient 0.001 (docs/algorithms/losses.md eq. 50).
    """

    strategy: Strategy = Chain()
    credit: Credit = GRPOCredit()
    loss: str | LossFn = "ppo_clip"
    kl_coef: float = 0.001  # DeepSeekMath's β; docs/algorithms/losses.md "KL penalty (k3)"
    name: str = "grpo"


@dataclass(frozen=True)
class TreeGRPO(Learner):
    """Tree-GRPO (Ji et al. 2025, arXiv 2509.21240): random tree expansion, intra- plus inter-tree advantages.

    RandomTree M=2, N=2, L=1, K=3 (6 leaves per prompt); ``ppo_clip_loss`` with its defaults; no
    KL (docs/algorithms/losses.md "KL penalty (k3)": a KL term for GRPO only).
    """

    strategy: Strategy = RandomTree()
    credit: Credit = TreeGRPOCredit()
    loss: str | LossFn = "ppo_clip"
    kl_coef: float = 0.0
    name: str = "tree-grpo"


@dataclass(frozen=True)
class ARPO(Learner):
    """ARPO (Dong et al. 2025, arXiv 2507.19849): entropy-adaptive branching after tool results.

    EntropyBranching n=16, N=8; GRPO advantages; ``ppo_clip_loss`` with its defaults; no KL
    (docs/algorithms/losses.md "KL penalty (k3)": a KL term for GRPO only).
    """

    strategy: Strategy = EntropyBranching()
    credit: Credit = GRPOCredit()
    loss: str | LossFn = "ppo_clip"
    kl_coef: float = 0.0
    name: str = "arpo"


#: The learners ``agents train --algo`` knows, by name (each class builds its learner with no arguments).
LEARNERS: dict[str, Callable[[], Learner]] = {
    "at2po": AT2PO,
    "aepo": AEPO,
    "grpo": GRPO,
    "tree-grpo": TreeGRPO,
    "arpo": ARPO,
}


def _with_fields(part: Any, changes: Mapping[str, Any], section: str) -> Any:
    """``dataclasses.replace(part, **changes)``, naming the fields ``part`` has when one is unknown."""
    if not changes:
        return part
    if not dataclasses.is_dataclass(part) or isinstance(part, type):
        raise ValueError(f"{section} {part!r} is not a dataclass instance, so its fields cannot be set from a config")
    names = [f.name for f in dataclasses.fields(part) if f.init]
    unknown = sorted(set(changes) - set(names))
    if unknown:
        raise ValueError(
            f"{section} {type(part).__name__} has no field {', '.join(unknown)}; its fields are {', '.join(names)}"
        )
    return dataclasses.replace(part, **changes)


def _part(part: Any) -> dict[str, Any]:
    """A strategy or credit as ``{"class": name, field: value, ...}`` (a function: ``{"function": name}``)."""
    if dataclasses.is_dataclass(part):
        return {
            "class": _qualified_name(type(part)),
            **{f.name: getattr(part, f.name) for f in dataclasses.fields(part) if f.init},
        }
    if hasattr(part, "__qualname__"):
        return {"function": _qualified_name(part)}
    return {"class": _qualified_name(type(part))}


def _qualified_name(thing: Any) -> str:
    return f"{thing.__module__}.{thing.__qualname__}"
