"""Engines by name: the one factory that ``agents eval``, the training loop, rollout workers and the benchmarks use.

It takes plain values, so that it needs nothing of a run's configuration (the training loop
passes its config's through :func:`agents.run.backends.run_engine`), and building a parser
needs only :data:`ENGINES`: each engine is imported when one is made (HFEngine and VLLMEngine
load torch, OpenAIEngine aiohttp).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from agents.engines.base import Engine

if TYPE_CHECKING:
    import torch

__all__ = ["ENGINES", "ColocatedTrainer", "make_engine"]

#: The engines :func:`make_engine` builds (``--engine``). A training run needs one that loads the
#: trainer's weights after every step, so it takes ``hf`` or ``vllm``; ``openai`` serves a fixed model.
ENGINES = ("hf", "vllm", "openai")


@dataclass(frozen=True)
class ColocatedTrainer:
    """A trainer on the engine's GPU, which vLLM must leave room for.

    Attributes:
        device: The trainer's CUDA device.
        trainable_parameters: Elements of the parameters it trains (their AdamW state stays on the GPU).
    """

    device: torch.device
    trainable_parameters: int


def make_engine(
    kind: str,
    model: Any,
    *,
    concurrency: int,
    tokenizer: Any = None,
    seed: int | None = None,
    device: str | None = None,
    base_url: str | None = None,
    max_model_len: int | None = None,
    engine_kwargs: Mapping[str, Any] | None = None,
    colocated: ColocatedTrainer | None = None,
    log: Callable[[str], None] = print,
) -> Engine:
    """The engine ``kind`` (one of :data:`ENGINES`) generating with ``model``.

    Args:
        kind: ``hf`` (:class:`~agents.engines.hf.HFEngine`), ``vllm``
            (:class:`~agents.engines.vllm.VLLMEngine`) or ``openai``
            (:class:`~agents.engines.openai.OpenAIEngine`, a server's model).
        model: A model name, local folder or Hugging Face id; for ``hf`` also a loaded model
            (the trainer's own object, which the engine then shares), with ``tokenizer``.
        concurrency: Requests in flight: HFEngine's ``max_batch_size``, vLLM's ``max_num_seqs``.
        tokenizer: A tokenizer (object or name) when it differs from the model's; not used by vLLM.
        seed: Seed of sampled decoding (vLLM: 0 when ``None``).
        device: HFEngine's device (default cpu); vLLM places itself.
        base_url: The server of ``openai``, e.g. ``http://127.0.0.1:8000/v1`` (an API key is
            read from ``$OPENAI_API_KEY``).
        max_model_len: vLLM's longest sequence, prompt and response (default VLLMEngine's).
        engine_kwargs: More keyword arguments of the engine; for vLLM those that are not
            VLLMEngine's own (and its ``engine_args``) go to vLLM's engine arguments.
        colocated: A trainer on the same GPU: vLLM gets, unless ``engine_kwargs`` set
            ``gpu_memory_utilization`` or ``kv_cache_gib``, the memory share that leaves the trainer its
            optimiser state (:func:`~agents.engines.vllm.colocated_memory_share`, noted to ``log``), and
            takes the weights by CUDA IPC unless ``engine_kwargs`` set ``weight_transfer``.
        log: Where the note about vLLM's memory share goes.
    """
    kwargs = dict(engine_kwargs or {})
    if kind == "hf":
        from agents.engines.hf import HFEngine  # loads torch and transformers

        settings = {"max_batch_size": concurrency, "seed": seed, **({"device": device} if device else {}), **kwargs}
        return HFEngine(model, tokenizer, **settings)
    if kind == "vllm":
        return _vllm_engine(model, concurrency, seed, max_model_len, kwargs, colocated, log)
    if kind == "openai":
        if base_url is None:
            raise ValueError(
                f"--engine openai needs --base-url (base_url=), the address of the server of {model!r}, "
                "e.g. http://127.0.0.1:8000/v1"
            )
        from agents.engines.openai import OpenAIEngine  # loads aiohttp

        return OpenAIEngine(base_url, model, tokenizer=tokenizer, api_key=os.environ.get("OPENAI_API_KEY"), **kwargs)
    raise ValueError(f"unknown engine {kind!r}; choose one of {', '.join(ENGINES)}")


def _vllm_engine(
    model: str,
    concurrency: int,
    seed: int | None,
    max_model_len: int | None,
    kwargs: dict[str, Any],
    colocated: ColocatedTrainer | None,
    log: Callable[[str], None],
) -> Engine:
    """VLLMEngine with its own keyword arguments, vLLM's engine arguments apart, and room for a colocated trainer."""
    from agents.engines.vllm import VLLMEngine, colocated_memory_share  # loads torch

    own = set(inspect.signature(VLLMEngine).parameters)
    vllm_args = {
        **kwargs.pop("engine_args", {}),
        **{name: kwargs.pop(name) for name in list(kwargs) if name not in own},
    }
    if colocated is not None:
        if "gpu_memory_utilization" not in vllm_args and "kv_cache_gib" not in kwargs:
            import torch

            free, total = torch.cuda.mem_get_info(colocated.device)
            optimizer_bytes = 8 * colocated.trainable_parameters  # AdamW's m and v in float32
            vllm_args["gpu_memory_utilization"] = share = colocated_memory_share(free, total, optimizer_bytes)
            log(
                f"vLLM beside the trainer on {colocated.device}: gpu_memory_utilization {share:.2f} "
                f"({free / 2**30:.1f} of {total / 2**30:.1f} GiB free, {optimizer_bytes / 2**30:.1f} GiB kept for "
                "the optimiser state); set engine_kwargs.gpu_memory_utilization to choose"
            )
        kwargs.setdefault("weight_transfer", "ipc")  # vLLM's own transfer from the trainer's GPU tensors
    if max_model_len is not None:
        kwargs.setdefault("max_model_len", max_model_len)
    settings = {"max_num_seqs": concurrency, **kwargs}
    return VLLMEngine(model, seed=seed or 0, engine_args=vllm_args, **settings)
