"""Every hyper-parameter of the trainer, with its default and its source (no torch or transformers needed to read it)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from agents.training.losses import LOSSES, LossFn
from agents.training.reporting import check_report_to
from agents.training.tree_attention import KERNELS

__all__ = ["TrainerConfig"]


@dataclass
class TrainerConfig:
    """Every hyper-parameter of :class:`Trainer`, with its default and where the default comes from."""

    # Optimiser. docs/algorithms/training.md "AdamW and gradient clipping": AdamW, lr 1e-6 constant, weight
    # decay 0.01, grad-norm clip 1.0.
    lr: float = 1e-6
    weight_decay: float = 0.01  # applied to every parameter, as verl's actor optimiser does
    adam_betas: tuple[float, float] = (0.9, 0.999)  # torch.optim.AdamW default (verl's too)
    adam_eps: float = 1e-8  # torch.optim.AdamW default
    # torch's fused AdamW: one kernel per step instead of the multi-tensor path, whose temporaries
    # take another float32 copy of the parameters (16 GB for 4B) at the step. The same update
    # (1e-7). None: fused on a GPU, the multi-tensor path on a CPU.
    fused_adamw: bool | None = None
    max_grad_norm: float = 1.0
    lr_schedule: str = "constant"  # a transformers.get_scheduler name; every paper: constant
    warmup_steps: int = 0  # optimiser updates of linear warm-up; the papers use none
    # Steps (rollout batches) the run will take: needed by decaying schedules, and sizes the
    # progress bar. None: unknown.
    total_steps: int | None = None

    # Batching. One epoch over each rollout batch, split into mini-batches (docs/algorithms/training.md "Mini-batches and micro-batches";
    # AT²PO: 64 prompts × 22 leaves with mini-batches of 8 prompts = 8 updates per batch).
    mini_batches: int = 1  # optimiser updates per epoch; the batch is split in order
    epochs: int = 1  # passes over each rollout batch (verl ppo_epochs; every paper: 1)
    micro_batch_size: int = 4  # at most this many sequences per forward/backward pass; gradients accumulate
    # At most this many tokens per micro-batch, counted as sequences × the longest one (padding
    # included), or one sequence alone when it is longer; None: sequences only. A budget in
    # tokens bounds activation memory where a count does not (one 8k-token path costs as much as
    # sixteen of 512). The update is the same whatever the split (docs/algorithms/training.md eq. 58).
    micro_batch_tokens: int | None = None
    # Recompute each decoder layer's activations in the backward pass instead of keeping them
    # (transformers' gradient checkpointing): one layer's activations held instead of all of
    # them, for about one more forward pass of compute. The same gradients.
    gradient_checkpointing: bool = False
    # The fraction of decoder layers recomputed under gradient_checkpointing (the first
    # ceil(fraction × layers); 1.0: every layer, transformers' own). A layer left out keeps its
    # activations and is not run twice: where memory allows (agents train --plan counts it),
    # fewer recomputed layers make the update faster, as torchtitan's selective checkpointing of
    # every n-th layer does. The same gradients.
    checkpoint_layers: float = 1.0
    # The trainer scores action tokens only: the output layer runs on their positions, this many
    # at a time, each chunk recomputed in the backward pass, so one chunk's float32 logits exist
    # instead of the micro-batch's [sequences, tokens, vocab] (~20 GB for 4 x 8k tokens of a 150k
    # vocabulary). None: the model's full logits (also used for models whose logits are more than
    # head(hidden), e.g. soft-capped). The same values up to float rounding.
    score_chunk: int | None = 2048
    # How a micro-batch's paths are laid out for the forward pass, docs/algorithms/training.md "Training on the tree":
    # "tree" packs them into one row holding every shared prefix once (the prompt of a
    # prompt's chains, the shared turns of a tree) under tree attention, and bounds a micro-batch by
    # its packed tokens instead of its paths (micro_batch_tokens, else micro_batch_size × the
    # batch's longest path); "flat" packs each path whole into one row; "padded" right-pads the
    # paths into [paths, tokens]. The same log-probs and gradients, up to float rounding. Tree is
    # the default: 0.48x the padded update time on real cpu-demo AT2PO trees, 0.80x on the AT2PO
    # paper shape and 0.93x on the GRPO one (benchmarks/results/train_bench.json).
    packing: Literal["tree", "flat", "padded"] = "tree"
    # The tree-attention kernel of packing="tree" (agents/training/tree_attention.py): "auto" picks
    # one per micro-batch (on CUDA varlen where it runs, else flex for long rows; on CPU per-path or
    # batched by their cost), or name one of KERNELS to force it (checked at trainer start).
    tree_kernel: Literal["auto", "per-path", "batched", "flex", "varlen"] = "auto"

    # Loss: a name in LOSSES or a callable with the agents.training.losses signature, and its
    # hyper-parameters (each loss documents its own defaults and their sources).
    loss: str | LossFn = "ppo_clip"
    loss_kwargs: dict[str, Any] = field(default_factory=dict)
    # Train a turn shared by k leaf paths once in total (advantages × TrainingPath.weights)
    # instead of once per path. docs/algorithms/credit.md eq. 35: the AT²PO code trains it once per path (False).
    dedup_shared_turns: bool = False

    # Old log-probs: "recompute" (verl's actor recomputes them before the update; every paper's
    # code) or "sampler" (the engine's, skipping that forward pass; the mismatch is then measured
    # on the first mini-batch, the only one trained before the policy changes). docs/algorithms/training.md "Old log-probs".
    old_logprobs: Literal["recompute", "sampler"] = "recompute"
    # The decoupled objective for rollouts sampled by an older policy (asynchronous training): the
    # recomputed log-probs are the proximal policy the loss clips around, and the sampler's weight
    # each token by π_prox/π_behav (AReaL; docs/algorithms/steps.md "Decoupled objective", eqs. 75-77).
    # Needs old_logprobs="recompute"; the weight cap is the loss's behaviour_weight_cap.
    decoupled: bool = False
    # the sampler's temperature: logits are divided by it (verl); papers: 1.0 (docs/algorithms/index.md eq. 4)
    temperature: float = 1.0

    # Regularisers. KL (k3) to a reference policy: 0 in AT²PO and AEPO, 0.001 in GRPO
    # (DeepSeekMath); any value > 0 needs a reference (see Trainer). Entropy bonus: 0 everywhere.
    # docs/algorithms/losses.md eqs. 50, 51 ("KL penalty (k3)", "Entropy bonus").
    kl_coef: float = 0.0
    entropy_coef: float = 0.0

    # LoRA through peft, for small machines. 0: full fine-tuning (verl's lora_rank default).
    lora_rank: int = 0
    lora_alpha: int = 16  # verl default
    lora_target_modules: str | list[str] = "all-linear"  # verl default

    # Precision. Trained parameters and optimiser state stay float32; "auto" computes in bfloat16
    # (autocast) on a GPU and on a CPU with bfloat16 units (AMX or AVX512-BF16: agents.models.cpu_compute_dtype,
    # which $AGENTENV_CPU_BFLOAT16 overrides), in float32 on other CPUs (where bfloat16 is emulated and slow).
    compute_dtype: Literal["auto", "float32", "bfloat16"] = "auto"
    # The dtype a model loaded by name keeps its weights in. "bfloat16" only under LoRA: the frozen
    # base then takes half the memory (a 14B model 28 instead of 55 GiB) while the adapters and
    # their optimiser state stay float32; it needs bfloat16 compute (autocast).
    base_dtype: Literal["float32", "bfloat16"] = "float32"
    device: str | None = None  # where a model loaded by name goes; None: CUDA if present, else CPU

    # An engine that can sleep (vLLM on the trainer's GPU) releases its weights and KV cache while
    # the trainer updates, and the gradients are freed before it wakes, so rollout and update take
    # turns with the device's memory. Off: both keep theirs (an engine on other devices).
    sleep_engine: bool = True

    # Logging, with out_dir: metrics.jsonl always, and the reporters named here (agents.training.reporting):
    # "tensorboard" (events under tensorboard/), "wandb" (Weights & Biases, files under wandb/), several
    # at once, or "none" for nothing more. Transformers' TrainingArguments.report_to spelling.
    report_to: Sequence[str] = ("tensorboard",)
    wandb_project: str | None = None  # the W&B project; None: $WANDB_PROJECT, else "agentenv"
    # The train and update bars (agents.progress): False none; True or None tqdm bars on a terminal,
    # a plain line every 30 s on a file or a pipe.
    progress: bool | None = None

    def __post_init__(self) -> None:
        positive = {
            "lr": self.lr,
            "max_grad_norm": self.max_grad_norm,
            "mini_batches": self.mini_batches,
            "epochs": self.epochs,
            "micro_batch_size": self.micro_batch_size,
            "temperature": self.temperature,
        }
        for name, value in positive.items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"TrainerConfig.{name} must be a finite number > 0, got {value!r}")
        non_negative = {
            "weight_decay": self.weight_decay,
            "warmup_steps": self.warmup_steps,
            "kl_coef": self.kl_coef,
            "entropy_coef": self.entropy_coef,
            "lora_rank": self.lora_rank,
        }
        for name, value in non_negative.items():
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise ValueError(f"TrainerConfig.{name} must be a finite number >= 0, got {value!r}")
        if self.micro_batch_tokens is not None and (
            isinstance(self.micro_batch_tokens, bool)
            or not isinstance(self.micro_batch_tokens, int)
            or self.micro_batch_tokens < 1
        ):
            raise ValueError(
                f"TrainerConfig.micro_batch_tokens must be an int >= 1 or None, got {self.micro_batch_tokens!r}"
            )
        if self.score_chunk is not None and (
            isinstance(self.score_chunk, bool) or not isinstance(self.score_chunk, int) or self.score_chunk < 1
        ):
            raise ValueError(f"TrainerConfig.score_chunk must be an int >= 1 or None, got {self.score_chunk!r}")
        if self.total_steps is not None and self.total_steps < 1:
            raise ValueError(f"TrainerConfig.total_steps must be >= 1 or None, got {self.total_steps!r}")
        self.report_to = check_report_to(self.report_to, "TrainerConfig.report_to")
        if isinstance(self.packing, bool):  # configs written when packing was on or off
            self.packing = "flat" if self.packing else "padded"
        if isinstance(self.checkpoint_layers, bool) or not 0 < self.checkpoint_layers <= 1:
            raise ValueError(
                f"TrainerConfig.checkpoint_layers must be a fraction in (0, 1], got {self.checkpoint_layers!r}"
            )
        if self.packing not in ("tree", "flat", "padded"):
            raise ValueError(f"TrainerConfig.packing must be 'tree', 'flat' or 'padded', got {self.packing!r}")
        if self.tree_kernel != "auto" and self.tree_kernel not in KERNELS:
            names = ", ".join(repr(k) for k in ("auto", *KERNELS))
            raise ValueError(f"TrainerConfig.tree_kernel must be one of {names}, got {self.tree_kernel!r}")
        if self.old_logprobs not in ("recompute", "sampler"):
            raise ValueError(f"TrainerConfig.old_logprobs must be 'recompute' or 'sampler', got {self.old_logprobs!r}")
        if self.decoupled and self.old_logprobs != "recompute":
            raise ValueError(
                "TrainerConfig.decoupled=True needs old_logprobs='recompute': the decoupled objective clips "
                "around the recomputed (proximal) log-probs and weights by the sampler's"
            )
        if self.compute_dtype not in ("auto", "float32", "bfloat16"):
            raise ValueError(
                f"TrainerConfig.compute_dtype must be 'auto', 'float32' or 'bfloat16', got {self.compute_dtype!r}"
            )
        if self.base_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"TrainerConfig.base_dtype must be 'float32' or 'bfloat16', got {self.base_dtype!r}")
        if self.base_dtype == "bfloat16" and not self.lora_rank:
            raise ValueError(
                "TrainerConfig.base_dtype='bfloat16' needs LoRA (lora_rank > 0): full fine-tuning trains the weights "
                "themselves, which stay float32"
            )
        if self.base_dtype == "bfloat16" and self.compute_dtype == "float32":
            raise ValueError(
                "TrainerConfig.base_dtype='bfloat16' computes in bfloat16; set compute_dtype to 'auto' or 'bfloat16'"
            )
        if isinstance(self.loss, str) and self.loss not in LOSSES:
            raise ValueError(f"unknown loss {self.loss!r}; choose one of {', '.join(LOSSES)} or pass a callable")
        if not isinstance(self.loss, str) and not callable(self.loss):
            raise TypeError(f"TrainerConfig.loss must be a name or a callable, got {type(self.loss).__name__}")

    def to_dict(self) -> dict[str, Any]:
        """The configuration as JSON-ready values (a callable loss by its qualified name)."""
        values = dataclasses.asdict(self)
        if callable(self.loss):
            values["loss"] = f"{self.loss.__module__}.{self.loss.__qualname__}"
        values["adam_betas"] = list(self.adam_betas)
        values["report_to"] = list(self.report_to)
        return values
