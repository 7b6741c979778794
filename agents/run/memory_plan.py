"""The memory plan of a run: what the trainer and the engine hold on one device, estimated before the run.

``agents train --plan`` prints it for the chosen model, preset and device and says whether the
run fits; a run on a GPU warns at start when it does not. The estimate counts, per device:

- the trainer's weights (float32: the trainer keeps float32 parameters and computes in bfloat16
  on a GPU; bfloat16 for a LoRA base with ``base_dtype``), gradients and AdamW's two moments
  (float32, trainable parameters only: LoRA's few);
- the activations of the largest micro-batch kept for the backward pass: per token and decoder
  layer the tensors a Llama-style layer saves (norm inputs in the weights' dtype; norm outputs,
  q/k/v, the attention output and the MLP's four intermediates in the compute dtype); with
  gradient checkpointing only each recomputed layer's input plus one layer's tensors while it is
  recomputed (``checkpoint_layers``: the fraction of layers recomputed; the others keep theirs);
- the scoring of action tokens: ``score_chunk`` positions of float32 logits, five
  (logits, logits / T, softmax, its product with the logits, their gradients), or the whole
  micro-batch's without chunking;
- the engine: vLLM's bfloat16 weights and its KV cache (the share it is given, or what the
  rollout's concurrency needs at full length), or HFEngine's: it shares the trainer's weights, and
  in bfloat16 (a GPU, or a CPU with bfloat16 units) keeps a bfloat16 copy of them; its running
  batch's KV room (the rollout's concurrency at full length, in bfloat16 or float32 likewise) and
  its prefix cache, counted full.

The update and the rollout take turns when the engine sleeps (vLLM on the trainer's GPU): the
device's peak is the larger of the two phases; otherwise both are held at once. Checked against
measured peaks on CPU (``tests/agents/run/test_memory_plan.py``); on a GPU, allocator fragmentation
and CUDA's own context (~0.5-1 GiB) come on top, which is why a plan that leaves less than 10%
free is called tight.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agents.models import AttentionShape, resolve_model

__all__ = ["KNOWN_SHAPES", "MemoryPlan", "ModelShape", "memory_plan", "model_shape", "run_plan", "set_flags"]

GIB = 2**30


@dataclass(frozen=True)
class ModelShape:
    """What the memory of a decoder-only transformer depends on (the fields of its ``config.json``)."""

    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qk_norm: bool = False  # a norm on each head's queries and keys (Qwen3)

    @property
    def parameters(self) -> int:
        """Weights of the embedding, every layer (attention, MLP, norms) and the head unless tied."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)
        layer = attention + 3 * self.hidden * self.intermediate + 2 * self.hidden + 2 * self.head_dim * self.qk_norm
        return self.vocab * self.hidden * (1 if self.tied else 2) + self.layers * layer + self.hidden

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> ModelShape:
        """From a transformers ``config.json`` mapping."""
        attention = AttentionShape.of(config)
        return cls(
            layers=int(config["num_hidden_layers"]),
            hidden=int(config["hidden_size"]),
            intermediate=int(config["intermediate_size"]),
            heads=attention.heads,
            kv_heads=attention.kv_heads,
            head_dim=attention.head_dim,
            vocab=int(config["vocab_size"]),
            tied=bool(config.get("tie_word_embeddings", False)),
            qk_norm=str(config.get("model_type", "")).startswith("qwen3"),
        )


#: Shapes of models a plan is often asked for before they are downloaded (their published config.json).
KNOWN_SHAPES: dict[str, ModelShape] = {
    "Qwen/Qwen3-4B": ModelShape(36, 2560, 9728, 32, 8, 128, 151936, tied=True, qk_norm=True),
    "Qwen/Qwen3-8B": ModelShape(36, 4096, 12288, 32, 8, 128, 151936, tied=False, qk_norm=True),
    "Qwen/Qwen3-14B": ModelShape(40, 5120, 17408, 40, 8, 128, 151936, tied=False, qk_norm=True),
}


def model_shape(model: str) -> ModelShape:
    """The shape of ``model``: a known id, or the ``config.json`` of its local folder (the embedded model's
    is converted once, offline)."""
    if model in KNOWN_SHAPES:
        return KNOWN_SHAPES[model]
    folder = Path(model) if Path(model).is_dir() else resolve_model(model)
    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    return ModelShape.from_config(config.get("text_config", config))


@dataclass
class MemoryPlan:
    """Estimated bytes per part on one device, the two phases' totals and whether the run fits."""

    parts: dict[str, float]
    update_peak: float
    rollout_peak: float
    device_bytes: float | None
    engine_sleeps: bool
    notes: list[str] = field(default_factory=list)

    @property
    def peak(self) -> float:
        """The device's peak: the larger phase when the engine sleeps during updates, else both at once."""
        if self.engine_sleeps:
            return max(self.update_peak, self.rollout_peak)
        return self.update_peak + self.parts["engine weights"] + self.parts["engine KV cache"]

    @property
    def fits(self) -> bool | None:
        """Whether the peak is within the device's memory (``None`` without a device size)."""
        return None if self.device_bytes is None else self.peak <= self.device_bytes

    def table(self) -> str:
        """The plan as a table a person reads."""
        lines = [f"{'part':<34} {'GiB':>9}"]
        lines += [f"{name:<34} {value / GIB:>9.2f}" for name, value in self.parts.items()]
        lines.append(f"{'update phase (trainer)':<34} {self.update_peak / GIB:>9.2f}")
        lines.append(f"{'rollout phase (engine + kept state)':<34} {self.rollout_peak / GIB:>9.2f}")
        how = "the engine sleeps during updates" if self.engine_sleeps else "engine and trainer at once"
        lines.append(f"{'peak (' + how + ')':<34} {self.peak / GIB:>9.2f}")
        if self.device_bytes is not None:
            verdict = "fits" if self.fits else "does NOT fit"
            # vLLM sizes its KV cache to the memory it is given; the trainer's update has no such slack.
            if self.fits and self.update_peak > 0.9 * self.device_bytes:
                verdict = "fits, tight (the update leaves under 10% free)"
            lines.append(f"device {self.device_bytes / GIB:.0f} GiB: {verdict}")
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def memory_plan(
    shape: ModelShape,
    *,
    trainer: Any,
    engine: str,
    engine_kwargs: dict[str, Any],
    concurrency: int,
    max_tokens: int,
    on_gpu: bool,
    device_bytes: float | None = None,
    cpu_bfloat16: bool = False,
) -> MemoryPlan:
    """The plan of a run whose trainer has the settings ``trainer`` (a TrainerConfig) and whose paths are at
    most ``max_tokens`` long (prompt and response).

    Args:
        shape: The model's shape.
        trainer: The run's :class:`~agents.training.trainer_config.TrainerConfig`.
        engine: ``"hf"`` or ``"vllm"``.
        engine_kwargs: The run's ``engine_kwargs`` (``kv_cache_gib``, ``gpu_memory_utilization``).
        concurrency: Sequences the engine holds at once (the rollout's concurrency).
        max_tokens: The longest path (max_prompt_tokens + max_response_tokens).
        on_gpu: Whether the trainer computes in bfloat16 (a GPU) or float32.
        device_bytes: The device's memory, to say whether the run fits.
        cpu_bfloat16: On a CPU, whether HFEngine generates in bfloat16
            (:func:`~agents.models.cpu_compute_dtype`); float32 otherwise.
    """
    s = shape
    parameters = s.parameters
    compute = 2 if on_gpu and trainer.compute_dtype != "float32" else 4
    trainable = parameters
    if trainer.lora_rank:
        # LoRA on every linear layer of every decoder layer: r·(in + out) per matrix.
        attention = 4 * s.hidden + 2 * s.head_dim * (s.heads + s.kv_heads)  # q, k, v, o: in + out each
        per_layer = trainer.lora_rank * (attention + 3 * (s.hidden + s.intermediate))  # + gate, up, down
        trainable = s.layers * per_layer
    parts: dict[str, float] = {
        "trainer weights": (2.0 if trainer.base_dtype == "bfloat16" else 4.0) * parameters,
        "gradients": 4.0 * trainable,
        "optimizer state": 8.0 * trainable,  # AdamW's m and v, float32
    }
    tokens = min(
        trainer.micro_batch_size * max_tokens, trainer.micro_batch_tokens or trainer.micro_batch_size * max_tokens
    )
    tokens = max(tokens, max_tokens)  # a path longer than the budget goes alone
    qkv = s.head_dim * (2 * s.heads + 2 * s.kv_heads)
    per_token_layer = 8.0 * s.hidden + compute * (2 * s.hidden + qkv + 4 * s.intermediate)
    # Checkpointed layers keep their float32 input; the others all their tensors; one is recomputed at a time.
    recomputed = math.ceil(trainer.checkpoint_layers * s.layers) if trainer.gradient_checkpointing else 0
    kept = s.layers - recomputed
    activations = tokens * (recomputed * 4.0 * s.hidden + kept * per_token_layer + (recomputed > 0) * per_token_layer)
    parts["activations (largest micro-batch)"] = activations
    scored = trainer.score_chunk or tokens
    # float32 [positions, vocab] tensors alive at once: the logits, logits / T, the entropy's softmax and
    # its product with the logits, then their gradients (measured on CPU: 4.5-5 of them).
    parts["logits (scoring)"] = 5 * 4.0 * min(scored, tokens) * s.vocab + tokens * s.hidden * compute
    kv_per_token = 2 * s.layers * s.kv_heads * s.head_dim
    notes = []
    sleeps = engine == "vllm" and on_gpu and trainer.sleep_engine
    if engine == "vllm":
        parts["engine weights"] = 2.0 * parameters
        need = 2.0 * kv_per_token * concurrency * max_tokens  # bfloat16, every sequence at full length
        if engine_kwargs.get("kv_cache_gib") is not None:
            kv = float(engine_kwargs["kv_cache_gib"]) * GIB
        elif device_bytes is not None:
            # The share the run gives vLLM beside the trainer (agents.engines.vllm.colocated_memory_share),
            # or the one it is told.
            share = engine_kwargs.get("gpu_memory_utilization")
            if share is None:
                from agents.engines.vllm import colocated_memory_share

                try:  # free at vLLM's start: the device less the trainer's weights
                    free = device_bytes - parts["trainer weights"]
                    share = colocated_memory_share(int(free), int(device_bytes), int(parts["optimizer state"]))
                except ValueError:  # no room: the plan says it does not fit
                    share = 0.0
            kv = max(share * device_bytes - parts["engine weights"], 0.0)
        else:
            kv = need
        parts["engine KV cache"] = kv
        held = f"the KV cache holds {kv / (2 * kv_per_token):,.0f} tokens"
        if kv >= need:
            notes.append(f"{held}: all {concurrency} sequences at their full {max_tokens} tokens")
        else:
            notes.append(
                f"{held}, {kv / need:.0%} of {concurrency} sequences at their full {max_tokens} tokens "
                "(vLLM queues the sequences that do not fit)"
            )
    else:
        # HFEngine generates with the trainer's own model object, in bfloat16 on a GPU and on a CPU with
        # bfloat16 units: from a bfloat16 copy of float32 weights (ComputeCopy), with a bfloat16 KV cache.
        # Imported here: the module brings transformers, and `agents train --help` reads this one.
        from agents.engines.kv_cache import GROWTH, PREFIX_CACHE_BYTES

        half = on_gpu or cpu_bfloat16
        parts["engine weights"] = 2.0 * parameters if half and trainer.base_dtype != "bfloat16" else 0.0
        kv_bytes = (2.0 if half else 4.0) * kv_per_token
        # The running batch's room (SlotCache): every row as long as the longest, GROWTH spare columns.
        parts["engine KV cache"] = kv_bytes * concurrency * (max_tokens + GROWTH)

        cached = engine_kwargs.get("prefix_cache_tokens")
        parts["engine prefix cache"] = float(PREFIX_CACHE_BYTES) if cached is None else kv_bytes * int(cached)
    update = sum(parts[name] for name in ("trainer weights", "gradients", "optimizer state")) + activations
    update += parts["logits (scoring)"]
    rollout = parts["trainer weights"] + parts["optimizer state"] + parts["engine weights"] + parts["engine KV cache"]
    rollout += parts.get("engine prefix cache", 0.0)
    if not sleeps:
        rollout += parts["gradients"]  # kept through the rollout when nothing asks for their memory
    return MemoryPlan(parts, update, rollout, device_bytes, sleeps, notes)


#: What :func:`run_plan` tries, in order, for a run that does not fit: the trainer settings that
#: lower the update's memory without changing it, then LoRA, which trains adapters instead, then
#: LoRA over bfloat16 base weights.
REMEDIES: tuple[dict[str, Any], ...] = (
    {"gradient_checkpointing": True, "micro_batch_tokens": "max_tokens"},
    {"gradient_checkpointing": True, "micro_batch_tokens": "max_tokens", "lora_rank": 16},
    {"gradient_checkpointing": True, "micro_batch_tokens": "max_tokens", "lora_rank": 16, "base_dtype": "bfloat16"},
)


def run_plan(config: Any, parts: Any, device_gib: float | None = None) -> tuple[MemoryPlan, dict[str, Any]]:
    """The plan of a training run (:class:`~agents.run.config.TrainConfig` and its built parts), and the
    trainer settings it needs to fit (empty when it fits as it is).

    ``device_gib`` is the device's memory; ``None``: the CUDA device the run would use, if any
    (then the trainer computes in bfloat16), else no verdict and float32 as on a CPU. A run that
    does not fit is planned again with each of :data:`REMEDIES`; the first that fits is returned
    (the last one tried when none does).
    """
    import dataclasses

    plan = _plan_of(config, parts, device_gib)
    if plan.fits is not False:
        return plan, {}
    rollout = parts.tree.rollout
    for remedy in REMEDIES:
        settings = {
            name: rollout.max_prompt_tokens + rollout.max_response_tokens if value == "max_tokens" else value
            for name, value in remedy.items()
        }
        changed = dataclasses.replace(parts, trainer=dataclasses.replace(parts.trainer, **settings))
        plan = _plan_of(config, changed, device_gib)
        if plan.fits:
            break
    return plan, {name: value for name, value in settings.items() if getattr(parts.trainer, name) != value}


def set_flags(settings: dict[str, Any]) -> str:
    """Trainer settings as the ``--set`` flags that choose them."""
    return " ".join(f"--set trainer.{name}={str(value).lower()}" for name, value in settings.items())


def _plan_of(config: Any, parts: Any, device_gib: float | None) -> MemoryPlan:
    on_gpu, device_bytes = device_gib is not None, None if device_gib is None else device_gib * GIB
    if device_gib is None and (config.device or "cuda").startswith("cuda"):
        import torch

        if torch.cuda.is_available():
            on_gpu, device_bytes = True, float(torch.cuda.get_device_properties(config.device or 0).total_memory)
    rollout = parts.tree.rollout
    cpu_bfloat16 = False
    if not on_gpu and config.engine == "hf":
        import torch

        from agents.models import cpu_compute_dtype

        cpu_bfloat16 = cpu_compute_dtype() == torch.bfloat16
    return memory_plan(
        model_shape(config.model),
        trainer=parts.trainer,
        engine=config.engine,
        engine_kwargs=dict(config.engine_kwargs),
        concurrency=rollout.concurrency,
        max_tokens=rollout.max_prompt_tokens + rollout.max_response_tokens,
        on_gpu=on_gpu,
        device_bytes=device_bytes,
        cpu_bfloat16=cpu_bfloat16,
    )
