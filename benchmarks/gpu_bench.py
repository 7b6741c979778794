"""One GPU with torch and transformers only (no vLLM, no Ray): the tree kernels' exactness and speed, the engine, a run.

    python -m benchmarks.gpu_bench [--json PATH] [--smoke] [--sections kernels,qwen3_4b,engine,train,nccl]
                                   [--budget-s 480] [--model-folder DIR]

Five sections, each in its own process (its own CUDA memory and dynamo caches, and a time limit:
one that fails or hangs prints its error and the others go on); shapes are real, weights random
(speed and memory do not depend on them):

- ``kernels`` (a): every tree-attention kernel (``TrainerConfig.tree_kernel``: per-path, batched,
  flex, varlen) against the padded layout on the AT²PO paper shape at scale 0.25: log-probs, loss
  and gradients of one step, on the tiny test model (head dim 16, FlexAttention's minimum) and the
  SmolLM2-135M shape. Float32 must agree to float rounding; in bfloat16 (autocast, on CUDA) a
  kernel's error against the float32 padded step must stay within twice padded bfloat16's own (+ a
  little slack).
- ``qwen3_4b`` (b): the Qwen3-4B shape, AT²PO's paper-shape batch of 2 prompts (44 paths of 1,912
  tokens), float32 master weights under bfloat16 autocast, gradient checkpointing, micro-batches of
  16,384 tokens, under padded and tree with each kernel: a warm-up step, then 2 timed steps (step,
  old-log-prob and update seconds), tokens forwarded, model TFLOP/s (6·N·T/t over the update's
  forwarded tokens) and MFU against the 989 TFLOP/s bf16 dense datasheet peak of an H100/H200, peak
  allocated memory beside the memory plan's update phase (agents/run/memory_plan.py), and dynamo graphs
  compiled during the timed steps (0: no recompiles after warm-up). The ratios are against padded.
  Layouts are skipped, with a message, once the section's time runs out.
- ``engine`` (c): HFEngine's generated tokens per second at 1, 16 and 64 concurrent requests on the
  SmolLM2 shape in bfloat16 (512-token prompts, 128 new tokens, sampled at temperature 1, end of
  sequence ignored so that every request makes 128 tokens), beside ``model.generate`` on the same
  batch (one padded batch; the ratio engine / generate).
- ``train`` (d): ``agents train`` (AT²PO, multihop-qa, preset cpu-demo, engine hf) on the device
  for 2 steps, then ``--resume`` to 3, with a SmolLM2-shaped checkpoint of random weights.
- ``nccl`` (e): one trainer step of a one-rank ``torch.distributed`` group on NCCL, through the
  trainer rank of ``agents.run.cluster.trainer_ranks`` without Ray (the trainer shards with FSDP2 at
  two ranks or more; at one it runs its single-process update inside the group).

The SmolLM2 shape comes from a folder holding the embedded model's ``config.json`` and tokenizer
files: ``--model-folder``, else ``.whl/smollm2-135m`` (``benchmarks/gpu_wheels.sh`` puts it there
to travel to a machine without the embedded model), else the embedded model converted here.
``--smoke`` runs every section with tiny shapes and few tokens in about a minute on a CPU (the
CUDA-only ``qwen3_4b`` and ``engine`` numbers then come from a CPU; ``nccl`` runs on gloo), which
is how the tests check this script. About 8 minutes on one H100/H200 (``--budget-s``: the
sections' time limits add up to it). ``benchmarks/gpu_check.sh`` runs it on a bare machine.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import copy
import gc
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
#: Each section: its letter in issue 37's list, what it measures, and its share of the time budget.
SECTIONS: dict[str, tuple[str, str, float]] = {
    "kernels": ("a", "tree-attention kernels against padded: log-probs, loss, gradients", 0.19),
    "qwen3_4b": ("b", "Qwen3-4B shape, AT2PO paper batch: time, TFLOP/s, memory, compiles", 0.42),
    "engine": ("c", "HFEngine tokens/s beside model.generate", 0.13),
    "train": ("d", "agents train on the device: 2 steps, then --resume to 3", 0.18),
    "nccl": ("e", "a one-rank NCCL trainer step", 0.08),
}
#: The tree kernels (TrainerConfig.tree_kernel), FlexAttention last: it compiles, and may run out of time.
KERNELS = ("per-path", "batched", "varlen", "flex")
#: Dense bfloat16 peak of an H100 or H200 SXM (datasheet); ~790 measured for a bf16 matmul on such machines.
PEAK_TFLOPS = 989.0
#: SmolLM2-135M's shape, for when no folder holds its config.json (its published config).
SMOLLM2_135M: dict[str, Any] = {
    "hidden_size": 576,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "intermediate_size": 1536,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
    "rope_theta": 100000.0,
    "max_position_embeddings": 8192,
}
#: Qwen3-4B's shape (its published config.json; agents.run.memory_plan.KNOWN_SHAPES has the same).
QWEN3_4B: dict[str, Any] = {
    "hidden_size": 2560,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "intermediate_size": 9728,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "rope_theta": 1e6,
    "max_position_embeddings": 40960,
}
#: What --smoke shrinks a shape to: 2 layers of width 64, 4 heads of 16 (FlexAttention's minimum) over 2 KV heads.
TINY: dict[str, Any] = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "intermediate_size": 128,
}
#: Files of a model folder that are not the tokenizer's (a random checkpoint writes its own).
_NOT_TOKENIZER = ("config.json", "agentenv_conversion.json")


# ---- the sections' common parts ---------------------------------------------------------------


@dataclass
class Context:
    """What a section gets: its settings, its share of the time, the shared work folder."""

    smoke: bool
    budget_s: float
    work: Path
    model_folder: str | None
    start: float

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.start)


class Record:
    """A section's results, rewritten to its file whenever they grow (a section killed for time keeps them)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {}

    def save(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        tmp.replace(self.path)


def _say(section: str, text: str) -> None:
    print(f"  [{section}] {text}", flush=True)


def _device() -> Any:
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _shape_folder(ctx: Context) -> Path:
    """The folder with SmolLM2-135M's config.json and tokenizer (module docstring says where it is looked for)."""
    if ctx.model_folder:
        folder = Path(ctx.model_folder)
    elif (ROOT / ".whl" / "smollm2-135m" / "config.json").is_file():
        folder = ROOT / ".whl" / "smollm2-135m"
    else:
        from agents.models import ModelNotAvailableError, resolve_model

        try:
            folder = resolve_model("smollm2-135m")
        except ModelNotAvailableError as error:
            raise ModelNotAvailableError(
                f"{error}; or run benchmarks/gpu_wheels.sh on a machine that has it and carry .whl/ "
                "(it holds the model's config.json and tokenizer files), or give --model-folder"
            ) from error
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(f"--model-folder {folder} holds no config.json (SmolLM2-135M's, with its tokenizer)")
    return folder


def _smollm2_config(ctx: Context) -> Any:
    """SmolLM2-135M's config (2 layers of width 64 under --smoke), from the shape folder or its numbers."""
    from transformers import AutoConfig, LlamaConfig

    try:
        config = AutoConfig.from_pretrained(_shape_folder(ctx))
    except (OSError, FileNotFoundError):
        config = LlamaConfig(**SMOLLM2_135M)
    if ctx.smoke:
        for name, value in TINY.items():
            setattr(config, name, value)
    return config


def _build(config: Any, device: Any, seed: int = 0) -> Any:
    """A causal LM of ``config`` with random weights, float32, made on ``device``, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    return model.float().eval()


def _paper_paths(scale: float, vocab: int, prompts: int = 1) -> list[Any]:
    """AT²PO's paper-shape trees (benchmarks.train_bench), one per prompt, at ``scale``: their training paths."""
    from benchmarks.train_bench import _synthetic

    return [path for seed in range(prompts) for path in _synthetic("at2po", scale, vocab, seed)]


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _synchronize() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _timed_step(trainer: Any, paths: list[Any]) -> tuple[dict[str, float], float]:
    _synchronize()
    start = time.perf_counter()
    metrics = asyncio.run(trainer.step(paths))
    _synchronize()
    return metrics, time.perf_counter() - start


def _kernels_of(trainer: Any, paths: list[Any]) -> str:
    """The tree-attention kernels of the trainer's plan for ``paths``, with their micro-batch counts (``-``: padded)."""
    from collections import Counter

    from agents.training.batch import collate

    plan = trainer.forward.plan(collate(paths, trainer.pad_id))
    counts = Counter(micro.kernel for micro in plan.micro_batches if micro.kernel is not None)
    return ", ".join(f"{kernel} {count}" for kernel, count in sorted(counts.items())) or "-"


def _cannot_run(error: Exception) -> str | None:
    """Why the trainer refused a forced tree kernel on this machine (its ValueError says), else ``None``."""
    text = str(error)
    if not isinstance(error, ValueError) or "cannot run here: " not in text:
        return None
    return text.split("cannot run here: ")[-1].split("; set tree_kernel")[0]


# ---- (a) the kernels against padded ----------------------------------------------------------------


def _step_result(model: Any, config: Any, paths: list[Any], backward: bool) -> dict[str, Any]:
    """Log-probs of every path, then (``backward``) one step's loss and gradients, on a copy of ``model``."""
    from agents.training.trainer import Trainer

    start = time.perf_counter()
    trainer = Trainer(copy.deepcopy(model), config)
    built = time.perf_counter() - start
    logprobs = trainer.compute_logprobs(paths)
    result: dict[str, Any] = {"logprobs": logprobs, "loss": None, "grads": None, "build_s": built}
    result["kernels"] = _kernels_of(trainer, paths)
    if backward:
        metrics, seconds = _timed_step(trainer, paths)
        result["loss"] = metrics["policy/loss"]
        result["step_s"] = seconds
        result["grads"] = {name: p.grad for name, p in trainer.model.named_parameters() if p.grad is not None}
    return result


def _errors(result: dict[str, Any], reference: dict[str, Any]) -> dict[str, float | None]:
    """Largest |Δ log-prob|, the loss's relative difference and the gradients' (‖Δg‖ / ‖g‖ over all)."""
    errors: dict[str, float | None] = {
        "logprob_max_abs": float((result["logprobs"].float() - reference["logprobs"].float()).abs().max()),
        "loss_rel": None,
        "grad_rel": None,
    }
    if result["loss"] is not None:
        errors["loss_rel"] = abs(result["loss"] - reference["loss"]) / max(abs(reference["loss"]), 1e-12)
        diff = sum(float((result["grads"][n].float() - g.float()).pow(2).sum()) for n, g in reference["grads"].items())
        norm = sum(float(g.float().pow(2).sum()) for g in reference["grads"].values())
        errors["grad_rel"] = math.sqrt(diff) / max(math.sqrt(norm), 1e-30)
    return errors


#: float32 against float32 padded: summation order only (30 layers of SmolLM2 on random ids).
FLOAT32_TOLERANCE = {"logprob_max_abs": 1e-3, "loss_rel": 1e-4, "grad_rel": 1e-3}
#: bfloat16: a kernel's error against float32 padded may be twice padded bfloat16's own, plus this.
BFLOAT16_SLACK = {"logprob_max_abs": 0.02, "loss_rel": 1e-3, "grad_rel": 0.01}


def _verdict(errors: dict[str, float | None], dtype: str, padded16: dict[str, float | None] | None) -> str:
    bad = []
    for name, value in errors.items():
        if value is None:
            continue
        if dtype == "float32":
            limit = FLOAT32_TOLERANCE[name]
        else:
            own = padded16[name] if padded16 is not None else None
            limit = 2 * (own or 0.0) + BFLOAT16_SLACK[name]
        if not value <= limit:  # a NaN fails too
            bad.append(f"{name} {value:.2e} > {limit:.2e}")
    return "ok" if not bad else "FAILED: " + "; ".join(bad)


def section_kernels(ctx: Context, out: Record) -> None:
    """(a) Each kernel's log-probs, loss and gradients against padded, per model shape and compute dtype."""
    from agents.learners import AT2PO
    from agents.models import tiny_llama

    device = _device()
    cuda = device.type == "cuda"
    dtypes = ["float32", "bfloat16"] if cuda else ["float32"]
    scale = 0.03 if ctx.smoke else 0.25
    shapes: list[tuple[str, Callable[[], Any]]] = [
        (
            "tiny (head dim 16)",
            lambda: tiny_llama(
                0,
                hidden_size=64,
                intermediate_size=128,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=4096,
                initializer_range=0.5,
            ).to(device),
        ),
        ("SmolLM2-135M" + (" (2 layers)" if ctx.smoke else ""), lambda: _build(_smollm2_config(ctx), device)),
    ]
    out.data.update({"scale": scale, "dtypes": dtypes, "rows": [], "failures": []})

    def config(packing: str, dtype: str, **kernel: str) -> Any:
        return AT2PO().trainer_config(
            lr=1e-6,
            progress=False,
            report_to=("none",),
            old_logprobs="sampler",
            max_grad_norm=1e9,  # no clipping: the gradients compared are the loss's own
            micro_batch_size=64,
            packing=packing,
            compute_dtype=dtype,
            **kernel,
        )

    # Each shape's model, batch and padded references first; then kernel by kernel over the shapes,
    # FlexAttention last (it compiles per shape and dtype: if time runs out, it is what is left out).
    cases: dict[str, dict[str, Any]] = {}
    for shape, make in shapes:
        model = make()
        paths = _paper_paths(scale, model.config.vocab_size)
        _say("kernels", f"{shape}: {len(paths)} paths, {sum(len(p.ids) for p in paths)} tokens, {device}")
        reference = _step_result(model, config("padded", "float32"), paths, backward=True)
        padded16_errors = None
        if cuda:
            padded16 = _step_result(model, config("padded", "bfloat16"), paths, backward=True)
            padded16_errors = _errors(padded16, reference)
            del padded16
            out.data["rows"].append({"shape": shape, "layout": "padded", "dtype": "bfloat16", **padded16_errors})
        cases[shape] = {"model": model, "paths": paths, "reference": reference, "padded16": padded16_errors}
        _free()
    out.save()
    for kernel in KERNELS:
        for shape, case in cases.items():
            for dtype in dtypes:
                row: dict[str, Any] = {"shape": shape, "layout": f"tree/{kernel}", "dtype": dtype}
                out.data["rows"].append(row)
                if kernel == "flex" and ctx.left() < 30:
                    row["verdict"] = f"skipped: {ctx.left():.0f} s left of the section's {ctx.budget_s:.0f} s"
                    _say("kernels", f"{shape} {kernel} {dtype}: {row['verdict']}")
                    continue
                row["verdict"] = "started (the section was stopped before it ended)"
                out.save()
                # PyTorch runs FlexAttention forward only on a CPU: the log-probs are checked, not the step.
                backward = not (kernel == "flex" and not cuda)
                try:
                    trainer_config = config("tree", dtype, tree_kernel=kernel)
                    result = _step_result(case["model"], trainer_config, case["paths"], backward)
                except Exception as error:
                    why = _cannot_run(error)
                    row["verdict"] = f"skipped: {why}" if why else f"ERROR: {type(error).__name__}: {error}"
                    if not why:
                        traceback.print_exc()
                else:
                    row.update(_errors(result, case["reference"]))
                    row.update(kernels=result["kernels"], build_s=result["build_s"], step_s=result.get("step_s"))
                    row["verdict"] = _verdict(
                        {k: row[k] for k in ("logprob_max_abs", "loss_rel", "grad_rel")}, dtype, case["padded16"]
                    )
                    if not backward:
                        row["verdict"] += " (log-probs only: FlexAttention runs forward only on a CPU)"
                    del result
                _free()
                if row["verdict"].startswith(("FAILED", "ERROR")):
                    out.data["failures"].append(f"{shape} {row['layout']} {dtype}: {row['verdict']}")
                out.save()
                _say("kernels", f"{shape} {kernel} {dtype}: {row['verdict']}")
    if out.data["failures"]:
        out.data["status"] = f"failed: {len(out.data['failures'])} kernel checks"


def print_kernels(data: dict[str, Any]) -> None:
    from agents.eval.tables import text_table

    def number(value: Any) -> str:
        return "-" if value is None else f"{value:.2e}"

    rows = [
        [
            row["shape"],
            row["layout"],
            row["dtype"],
            row.get("kernels", "-"),
            number(row.get("logprob_max_abs")),
            number(row.get("loss_rel")),
            number(row.get("grad_rel")),
            row.get("verdict", "reference"),
        ]
        for row in data.get("rows", [])
    ]
    head = ["shape", "layout", "dtype", "kernel ran", "max |Δ logprob|", "loss rel Δ", "grad rel Δ", "verdict"]
    print(f"against padded float32, AT2PO paper shape at scale {data.get('scale')}:")
    print(text_table(head, rows))


# ---- (b) Qwen3-4B's step per layout -----------------------------------------------------------------


@contextlib.contextmanager
def _graphs_compiled() -> Iterator[list[int]]:
    """Dynamo graphs compiled inside the block (its count of unique graphs, before and after)."""
    from torch._dynamo.utils import counters

    seen = [int(counters["stats"]["unique_graphs"])]
    yield seen
    seen.append(int(counters["stats"]["unique_graphs"]))


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def section_qwen3_4b(ctx: Context, out: Record) -> None:
    """(b) The Qwen3-4B shape's step under padded and tree with each kernel: time, TFLOP/s, memory, compiles."""
    import torch
    from transformers import Qwen3Config

    from agents.learners import AT2PO
    from agents.run.memory_plan import GIB, ModelShape, memory_plan
    from agents.training.trainer import Trainer

    device = _device()
    if device.type != "cuda" and not ctx.smoke:
        out.data["status"] = "skipped: no CUDA"
        return
    # --smoke: a small vocabulary too (on a CPU, 151,936 logits a token would take most of the time)
    config = Qwen3Config(**{**QWEN3_4B, **({**TINY, "vocab_size": 1024} if ctx.smoke else {})})
    scale, micro_tokens, timed, prompts = (0.03, 512, 1, 1) if ctx.smoke else (1.0, 16384, 2, 2)
    paths = _paper_paths(scale, config.vocab_size, prompts=prompts)
    shape = ModelShape.from_config(config.to_dict())
    device_bytes = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    out.data.update(
        {
            "shape": "Qwen3-4B" + (" (tiny)" if ctx.smoke else ""),
            "parameters": shape.parameters,
            "paths": len(paths),
            "tokens": sum(len(p.ids) for p in paths),
            "micro_batch_tokens": micro_tokens,
            "timed_steps": timed,
            "peak_tflops": PEAK_TFLOPS,
            "layouts": {},
        }
    )
    _say("qwen3_4b", f"{len(paths)} paths, {out.data['tokens']} tokens, {shape.parameters / 1e9:.2f}B parameters")
    durations: list[float] = []
    for packing, kernel in [("padded", None), *(("tree", k) for k in KERNELS)]:
        name = packing if kernel is None else f"tree/{kernel}"
        row: dict[str, Any] = {}
        out.data["layouts"][name] = row
        if durations and ctx.left() < max(durations) + 10:
            row["status"] = f"skipped: over the section's {ctx.budget_s:.0f} s (a layout took {max(durations):.0f} s)"
            _say("qwen3_4b", f"{name}: {row['status']}")
            out.save()
            continue
        if kernel == "flex" and device.type != "cuda":
            row["status"] = "skipped: FlexAttention runs forward only on a CPU"
            _say("qwen3_4b", f"{name}: {row['status']}")
            continue
        row["status"] = "started (the section was stopped before it ended)"
        out.save()
        start = time.perf_counter()
        trainer = None
        try:
            trainer_config = AT2PO().trainer_config(
                packing=packing,
                gradient_checkpointing=True,
                micro_batch_tokens=micro_tokens,
                micro_batch_size=len(paths),  # the token budget splits the batch, not a count of paths
                old_logprobs="recompute",
                progress=False,
                report_to=("none",),
                **({} if kernel is None else {"tree_kernel": kernel}),
            )
            trainer = Trainer(_build(config, device), trainer_config)
            row["build_s"] = time.perf_counter() - start
            _, row["warmup_s"] = _timed_step(trainer, paths)
            _say("qwen3_4b", f"{name}: built in {row['build_s']:.1f} s, warm-up step {row['warmup_s']:.1f} s")
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            steps = []
            with _graphs_compiled() as graphs:
                for _ in range(timed):
                    metrics, seconds = _timed_step(trainer, paths)
                    steps.append((metrics, seconds))
                    _say("qwen3_4b", f"{name}: step {seconds:.1f} s (update {metrics['time/update_s']:.1f} s)")
            row["graphs_compiled_after_warmup"] = graphs[1] - graphs[0]
            row["graphs_total"] = graphs[1]
            row["step_s"] = _mean([seconds for _, seconds in steps])
            row["old_logprobs_s"] = _mean([m["time/old_logprobs_s"] for m, _ in steps])
            row["update_s"] = _mean([m["time/update_s"] for m, _ in steps])
            row["tokens_forwarded"] = steps[-1][0]["batch/tokens_forwarded"]
            row["tokens_trained"] = steps[-1][0]["tokens/trained"]
            row["kernels"] = _kernels_of(trainer, paths)
            row["update_tflops"] = 6 * shape.parameters * row["tokens_forwarded"] / row["update_s"] / 1e12
            row["mfu"] = row["update_tflops"] / PEAK_TFLOPS
            plan = memory_plan(
                shape,
                trainer=trainer_config,
                engine="hf",
                engine_kwargs={},
                concurrency=1,
                max_tokens=max(len(p.ids) for p in paths),
                on_gpu=device.type == "cuda",
                device_bytes=device_bytes,
            )
            row["plan_update_gib"] = plan.update_peak / GIB
            if device.type == "cuda":
                row["peak_allocated_gib"] = torch.cuda.max_memory_allocated() / GIB
            row["status"] = "ok"
        except Exception as error:
            why = _cannot_run(error)
            row["status"] = f"skipped: {why}" if why else f"error: {type(error).__name__}: {str(error)[:300]}"
            if why:
                _say("qwen3_4b", f"{name}: {row['status']}")
            else:
                traceback.print_exc()
        finally:
            del trainer
            _free()
        durations.append(time.perf_counter() - start)
        row["seconds"] = durations[-1]
        out.save()
    padded = out.data["layouts"]["padded"]
    for row in out.data["layouts"].values():
        if row.get("status") == "ok" and padded.get("status") == "ok":
            for key in ("step_s", "update_s", "tokens_forwarded"):
                row[f"{key}_vs_padded"] = row[key] / padded[key]
    errors = [name for name, row in out.data["layouts"].items() if row["status"].startswith("error")]
    if errors:
        out.data["status"] = f"error in {', '.join(errors)}"


def print_qwen3_4b(data: dict[str, Any]) -> None:
    from agents.eval.tables import text_table

    def cell(row: dict[str, Any], key: str, form: str = "{:.2f}") -> str:
        return form.format(row[key]) if row.get(key) is not None else "-"

    rows, others = [], []
    for name, row in data.get("layouts", {}).items():
        if row.get("status") != "ok":
            others.append(f"{name}: {row.get('status', 'not run')}")
            continue
        rows.append(
            [
                name,
                row["kernels"],
                cell(row, "step_s", "{:.1f}"),
                cell(row, "old_logprobs_s", "{:.1f}"),
                cell(row, "update_s", "{:.1f}"),
                cell(row, "update_s_vs_padded"),
                cell(row, "tokens_forwarded", "{:,.0f}"),
                cell(row, "tokens_forwarded_vs_padded"),
                cell(row, "update_tflops", "{:.0f}"),
                cell(row, "mfu", "{:.1%}"),
                cell(row, "peak_allocated_gib", "{:.1f}"),
                cell(row, "plan_update_gib", "{:.1f}"),
                str(row.get("graphs_compiled_after_warmup", "-")),
            ]
        )
    head = [
        "layout",
        "kernel ran",
        "step s",
        "old lp s",
        "update s",
        "/ padded",
        "tokens fwd",
        "/ padded",
        "TFLOP/s",
        "MFU",
        "peak GiB",
        "plan GiB",
        "compiles",
    ]
    print(
        f"{data.get('shape')}: {data.get('paths')} paths, {data.get('tokens')} tokens, micro-batches of "
        f"{data.get('micro_batch_tokens')} tokens, mean of {data.get('timed_steps')} steps after a warm-up; "
        f"TFLOP/s = 6·N·forwarded/update s, MFU of {PEAK_TFLOPS:.0f}; compiles: dynamo graphs during the timed steps"
    )
    print(text_table(head, rows))
    print("\n".join(others))


# ---- (c) HFEngine beside model.generate ------------------------------------------------------------


def section_engine(ctx: Context, out: Record) -> None:
    """(c) HFEngine's tokens/s at 1, 16 and 64 concurrent requests beside ``model.generate`` on the same batch."""
    import random

    import torch
    from transformers import GenerationConfig

    from agents.engines import HFEngine, SamplingParams
    from agents.models import load_tokenizer

    device = _device()
    if device.type != "cuda" and not ctx.smoke:
        out.data["status"] = "skipped: no CUDA"
        return
    prompt_tokens, new_tokens, concurrency = (32, 8, [1, 4]) if ctx.smoke else (512, 128, [1, 16, 64])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = _build(_smollm2_config(ctx), device).to(dtype)
    tokenizer = load_tokenizer(str(_shape_folder(ctx)))
    engine = HFEngine(model, tokenizer, max_batch_size=max(concurrency), seed=0)
    engine.eos_token_ids = frozenset()  # random weights: every request makes new_tokens, as min_new_tokens below
    rng = random.Random(0)
    vocab = model.config.vocab_size
    generation = GenerationConfig(
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        pad_token_id=tokenizer.pad_token_id or 0,
        eos_token_id=tokenizer.eos_token_id,
    )
    out.data.update(
        {
            "dtype": str(dtype),
            "prompt_tokens": prompt_tokens,
            "new_tokens": new_tokens,
            "rows": [],
        }
    )

    def prompts(n: int) -> list[list[int]]:  # distinct random prompts: no prefix of one is cached for another
        return [[rng.randrange(100, vocab) for _ in range(prompt_tokens)] for _ in range(n)]

    async def engine_rate(batch: list[list[int]]) -> tuple[int, float]:
        engine.prefix_cache.clear()
        _synchronize()
        start = time.perf_counter()
        done = await asyncio.gather(
            *(
                engine.generate(p, SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=i))
                for i, p in enumerate(batch)
            )
        )
        _synchronize()
        return sum(len(c.token_ids) for c in done), time.perf_counter() - start

    def generate_rate(batch: list[list[int]]) -> tuple[int, float]:
        ids = torch.tensor(batch, device=device)
        _synchronize()
        start = time.perf_counter()
        with torch.no_grad():
            output = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=generation)
        _synchronize()
        return (output.shape[1] - ids.shape[1]) * ids.shape[0], time.perf_counter() - start

    async def run() -> None:
        await engine_rate(prompts(2))  # warm-up: the worker thread, CUDA kernels, allocator
        generate_rate(prompts(2))
        durations: list[float] = []
        for n in concurrency:
            if durations and ctx.left() < 2.5 * durations[-1] + 5:
                out.data["rows"].append({"requests": n, "status": f"skipped: over the section's {ctx.budget_s:.0f} s"})
                continue
            start = time.perf_counter()
            batch = prompts(n)
            engine_tokens, engine_s = await engine_rate(batch)
            generate_tokens, generate_s = generate_rate(batch)
            row: dict[str, Any] = {
                "requests": n,
                "engine_tokens": engine_tokens,
                "engine_s": engine_s,
                "engine_tokens_per_s": engine_tokens / engine_s,
                "generate_tokens": generate_tokens,
                "generate_s": generate_s,
                "generate_tokens_per_s": generate_tokens / generate_s,
                "status": "ok",
            }
            row["engine_vs_generate"] = row["engine_tokens_per_s"] / row["generate_tokens_per_s"]
            out.data["rows"].append(row)
            out.save()
            durations.append(time.perf_counter() - start)
            _say(
                "engine",
                f"{n} requests: engine {row['engine_tokens_per_s']:.0f} tok/s, generate "
                f"{row['generate_tokens_per_s']:.0f} tok/s",
            )

    async def main() -> None:
        try:
            await run()
        finally:
            await engine.close()

    asyncio.run(main())


def print_engine(data: dict[str, Any]) -> None:
    from agents.eval.tables import text_table

    rows = [
        [
            str(row["requests"]),
            f"{row['engine_tokens_per_s']:.0f}",
            f"{row['generate_tokens_per_s']:.0f}",
            f"{row['engine_vs_generate']:.2f}",
            f"{row['engine_tokens']} / {row['generate_tokens']}",
        ]
        if row.get("status") == "ok"
        else [str(row["requests"]), row.get("status", "?"), "", "", ""]
        for row in data.get("rows", [])
    ]
    print(
        f"SmolLM2-135M shape in {data.get('dtype')}, prompts of {data.get('prompt_tokens')} tokens, "
        f"{data.get('new_tokens')} new tokens each, temperature 1:"
    )
    print(text_table(["requests", "HFEngine tok/s", "generate tok/s", "engine / generate", "tokens"], rows))


# ---- (d) agents train, then --resume ---------------------------------------------------------------


def _random_checkpoint(ctx: Context) -> Path:
    """A SmolLM2-shaped checkpoint of random weights with the real tokenizer (tiny under --smoke), made once."""
    folder = ctx.work / ("tiny-smollm2" if ctx.smoke else "smollm2-135m-random")
    if (folder / "done").is_file():
        return folder
    shape = _shape_folder(ctx)  # the tokenizer must be the real one: the environments' prompts go through it
    model = _build(_smollm2_config(ctx), "cpu")
    model.save_pretrained(folder)
    for item in shape.iterdir():
        if item.is_file() and item.name not in _NOT_TOKENIZER and item.suffix not in (".safetensors", ".bin"):
            shutil.copy2(item, folder / item.name)
    (folder / "done").write_text("")
    return folder


def section_train(ctx: Context, out: Record) -> None:
    """(d) ``agents train`` for 2 steps on the device, then ``--resume`` to 3; what each step recorded."""
    device = _device()
    model = _random_checkpoint(ctx)
    run = ctx.work / "train-run"
    shutil.rmtree(run, ignore_errors=True)
    base = [sys.executable, "-m", "agents", "train", "--algo", "at2po", "--env", "multihop-qa"]
    base += ["--model", str(model), "--preset", "cpu-demo", "--engine", "hf", "--eval-questions", "0"]
    base += ["--device", device.type, "--out", str(run), "--no-progress", "--report-to", "none"]
    if ctx.smoke:  # one prompt of short turns: the steps' machinery, not their size
        base += [
            "--prompts-per-step",
            "1",
            "--set",
            "sampling.max_new_tokens=8",
            "--set",
            "rollout.max_response_tokens=64",
        ]
    out.data.update({"device": device.type, "model": str(model), "runs": []})
    for steps, extra in ((2, []), (3, ["--resume"])):
        command = [*base, "--steps", str(steps), *extra]
        _say("train", " ".join(command[1:]))
        start = time.perf_counter()
        done = subprocess.run(command, cwd=ROOT, timeout=max(ctx.left() - 5, 10), capture_output=True, text=True)
        out.data["runs"].append({"steps": steps, "seconds": time.perf_counter() - start, "rc": done.returncode})
        out.save()
        if done.returncode:
            tail = (done.stdout + done.stderr).strip().splitlines()[-15:]
            print("\n".join(tail), flush=True)
            out.data["status"] = f"error: agents train --steps {steps} {' '.join(extra)} exited {done.returncode}"
            out.data["output_tail"] = tail
            return
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps_done = [r for r in records if "time/update_s" in r]
    out.data["steps"] = [
        {
            key: r.get(key)
            for key in (
                "time/step_s",
                "time/rollout_s",
                "time/update_s",
                "reward/mean",
                "policy/loss",
                "tokens/trained",
            )
        }
        for r in steps_done
    ]
    checkpoints = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    out.data["checkpoints"] = checkpoints
    if len(steps_done) != 3 or "step_000003" not in checkpoints:
        out.data["status"] = (
            f"failed: {len(steps_done)} step records, checkpoints {checkpoints} (expected 3, step_000003)"
        )


def print_train(data: dict[str, Any]) -> None:
    from agents.eval.tables import text_table

    def cell(value: Any, form: str) -> str:
        return "-" if value is None else form.format(value)

    rows = [
        [
            str(i + 1),
            cell(step.get("time/step_s"), "{:.1f}"),
            cell(step.get("time/rollout_s"), "{:.1f}"),
            cell(step.get("time/update_s"), "{:.2f}"),
            cell(step.get("reward/mean"), "{:+.3f}"),
            cell(step.get("policy/loss"), "{:+.4f}"),
        ]
        for i, step in enumerate(data.get("steps", []))
    ]
    runs = ", ".join(f"--steps {r['steps']}: {r['seconds']:.0f} s (rc {r['rc']})" for r in data.get("runs", []))
    print(f"agents train on {data.get('device')}: {runs}; checkpoints {', '.join(data.get('checkpoints', []))}")
    print(text_table(["step", "step s", "rollout s", "update s", "reward", "loss"], rows))


# ---- (e) a one-rank NCCL step ------------------------------------------------------------------------


def section_nccl(ctx: Context, out: Record) -> None:
    """(e) One trainer step of a one-rank process group (NCCL on CUDA; gloo under --smoke on a CPU), without Ray."""
    import torch
    import torch.distributed as dist

    from agents.learners import AT2PO
    from agents.run.cluster.trainer_ranks import _Rank

    device = _device()
    if device.type != "cuda" and not ctx.smoke:
        out.data["status"] = "skipped: no CUDA"
        return
    backend = "nccl" if device.type == "cuda" else "gloo"
    model = _random_checkpoint(ctx)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    rank = _Rank(0, 1, None)
    config = AT2PO().trainer_config(progress=False, report_to=("none",), device=device.type)
    try:
        start = time.perf_counter()
        rank.start("127.0.0.1", port, backend, str(model), config, None, 0)
        trainer = rank._trainer()
        started = time.perf_counter() - start
        paths = _paper_paths(0.03 if ctx.smoke else 0.25, trainer.model.config.vocab_size)
        _synchronize()
        start = time.perf_counter()
        metrics = rank.step(paths, None)
        _synchronize()
        seconds = time.perf_counter() - start
        total = torch.ones(1, device=device)
        dist.all_reduce(total)  # a collective on the backend itself
        state = rank.engine_state_dict()
        out.data.update(
            {
                "backend": backend,
                "world_size": dist.get_world_size(),
                "trainer_world_size": trainer.world_size,
                "fsdp_sharded": bool(trainer.forward.roots),
                "start_s": started,
                "step_s": seconds,
                "loss": metrics["policy/loss"],
                "grad_norm": metrics["optim/grad_norm"],
                "all_reduce": float(total.item()),
                "state_tensors": len(state),
            }
        )
        _say("nccl", f"{backend}: step {seconds:.1f} s, loss {metrics['policy/loss']:+.4f}")
        if not math.isfinite(metrics["policy/loss"]) or total.item() != 1.0:
            out.data["status"] = "failed: a loss that is not finite, or all_reduce of 1 over one rank is not 1"
    finally:
        rank.stop()


def print_nccl(data: dict[str, Any]) -> None:
    from agents.eval.tables import text_table

    keys = ["backend", "world_size", "fsdp_sharded", "start_s", "step_s", "loss", "grad_norm", "state_tensors"]
    rows = [
        [key, f"{data[key]:.4g}" if isinstance(data[key], float) else str(data[key])] for key in keys if key in data
    ]
    print("one rank (FSDP2 shards at two ranks or more; at one the trainer's own update runs inside the group):")
    print(text_table(["", "value"], rows))


SECTION_FUNCTIONS: dict[str, Callable[[Context, Record], None]] = {
    "kernels": section_kernels,
    "qwen3_4b": section_qwen3_4b,
    "engine": section_engine,
    "train": section_train,
    "nccl": section_nccl,
}
PRINTERS: dict[str, Callable[[dict[str, Any]], None]] = {
    "kernels": print_kernels,
    "qwen3_4b": print_qwen3_4b,
    "engine": print_engine,
    "train": print_train,
    "nccl": print_nccl,
}


# ---- the driver ---------------------------------------------------------------------------------


def _section_child(name: str, result: Path, ctx: Context) -> None:
    """In the section's process: run it, and record its status (its error, if it raised) and data."""
    out = Record(result)
    try:
        SECTION_FUNCTIONS[name](ctx, out)
        out.data.setdefault("status", "ok")
    except Exception as error:
        traceback.print_exc()
        out.data["status"] = f"error: {type(error).__name__}: {str(error)[:500]}"
        out.data["traceback"] = traceback.format_exc()[-4000:]
    out.data["seconds"] = time.perf_counter() - ctx.start
    out.save()


def _run_section(name: str, args: argparse.Namespace, work: Path, limit: float) -> dict[str, Any]:
    """Run a section in its own process group, killed after ``limit`` seconds; its record, with a status."""
    result = work / f"{name}.json"
    result.unlink(missing_ok=True)
    command = [sys.executable, "-m", "benchmarks.gpu_bench", "--section", name, "--result", str(result)]
    command += ["--work", str(work), "--budget-s", f"{max(limit - 5, 5):.0f}"]  # 5 s to exit within the limit
    command += ["--smoke"] if args.smoke else []
    command += ["--model-folder", args.model_folder] if args.model_folder else []
    start = time.perf_counter()
    child = subprocess.Popen(command, cwd=ROOT, start_new_session=True)
    try:
        rc = child.wait(timeout=limit)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)  # the section and what it started (agents train)
        rc, timed_out = child.wait(), True
    seconds = time.perf_counter() - start
    data = json.loads(result.read_text()) if result.is_file() else {}
    if timed_out:
        data["status"] = f"timeout: killed after {limit:.0f} s (what it had measured is kept)"
    elif "status" not in data or rc:
        data["status"] = data.get("status") if rc == 0 else f"error: the section's process exited {rc}"
    data["seconds"] = seconds
    return data


def _headline(name: str, data: dict[str, Any]) -> str:
    """One line of a section's result for the summary."""
    if not data.get("status", "").startswith("ok"):
        return ""
    if name == "kernels":
        checked = [row for row in data.get("rows", []) if row.get("verdict", "").startswith("ok")]
        return f"{len(checked)} kernel checks within tolerance"
    if name == "qwen3_4b":
        done = {k: v for k, v in data.get("layouts", {}).items() if v.get("status") == "ok" and k != "padded"}
        best = min(done.items(), key=lambda item: item[1]["update_s"], default=None)
        return (
            f"fastest tree update: {best[0]} at {best[1].get('update_s_vs_padded', float('nan')):.2f}x padded"
            if best
            else ""
        )
    if name == "engine":
        rows = [row for row in data.get("rows", []) if row.get("status") == "ok"]
        return f"{rows[-1]['requests']} requests: {rows[-1]['engine_vs_generate']:.2f}x generate" if rows else ""
    if name == "train":
        return f"{len(data.get('steps', []))} steps, checkpoints {', '.join(data.get('checkpoints', []))}"
    if name == "nccl":
        return f"{data.get('backend')}: step {data.get('step_s', float('nan')):.1f} s"
    return ""


def _device_name(cuda: bool) -> str:
    """The GPU's name from nvidia-smi: torch would open a CUDA context (~0.5 GiB) in the driver for the whole run."""
    if not cuda:
        return "cpu (no CUDA)"
    try:
        query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader", "--id=0"]
        return subprocess.run(query, capture_output=True, text=True, timeout=30, check=True).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "cuda"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes and few tokens: about a minute on a CPU")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"of {', '.join(SECTIONS)}")
    parser.add_argument("--budget-s", type=float, help="seconds for all sections (default 480; --smoke 600)")
    parser.add_argument(
        "--model-folder", help="SmolLM2-135M's config.json and tokenizer (default .whl/smollm2-135m, else the embedded)"
    )
    parser.add_argument("--section", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.section:  # a section's own process (see _run_section)
        ctx = Context(args.smoke, args.budget_s, args.work, args.model_folder, time.perf_counter())
        _section_child(args.section, args.result, ctx)
        return
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    budget = args.budget_s or (600.0 if args.smoke else 480.0)
    if budget <= 0:
        parser.error(f"--budget-s must be > 0, got {budget}")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import torch
    import transformers

    results: dict[str, Any] = {
        "command": "python -m benchmarks.gpu_bench " + " ".join(sys.argv[1:]),
        "device": _device_name(torch.cuda.is_available()),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "smoke": args.smoke,
        "budget_s": budget,
        "sections": {},
    }
    print(f"{results['device']}, torch {torch.__version__}, transformers {transformers.__version__}", flush=True)
    shares = sum(SECTIONS[name][2] for name in sections)
    start, spent = time.perf_counter(), 0.0
    with tempfile.TemporaryDirectory(prefix="gpu_bench.") as work:
        for i, name in enumerate(sections):
            letter, title, share = SECTIONS[name]
            # each its share of the budget, plus what the sections before it left unused
            limit = budget * share / shares + max(
                0.0, budget * sum(SECTIONS[s][2] for s in sections[:i]) / shares - spent
            )
            print(f"\n== {letter}. {name}: {title} (at most {limit:.0f} s; {time.perf_counter() - start:.0f} s so far)")
            data = _run_section(name, args, Path(work), limit)
            spent += data["seconds"]
            results["sections"][name] = data
            print(f"-- {name}: {data['status']} in {data['seconds']:.0f} s")
            if (
                data.get("status", "").startswith(("ok", "failed", "error in"))
                or data.get("rows")
                or data.get("layouts")
            ):
                try:
                    PRINTERS[name](data)
                except Exception as error:  # a table of partial results must not stop the other sections
                    print(f"(no table: {type(error).__name__}: {error})")
            if args.json:  # after every section, so that an interrupted run keeps what it measured
                args.json.write_text(json.dumps(results, indent=1, default=str))
    from agents.eval.tables import text_table

    print(f"\nsummary ({time.perf_counter() - start:.0f} s, {results['device']}):")
    rows = [
        [f"{SECTIONS[name][0]}. {name}", data["status"][:90], f"{data['seconds']:.0f}", _headline(name, data)]
        for name, data in results["sections"].items()
    ]
    print(text_table(["section", "status", "s", "result"], rows))
    if args.json:
        print(f"wrote {args.json}")
    failed = [name for name, data in results["sections"].items() if not data["status"].startswith(("ok", "skipped"))]
    if failed:
        sys.exit(f"not ok: {', '.join(failed)}")


if __name__ == "__main__":
    main()
