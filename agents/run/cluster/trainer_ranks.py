"""Trainer ranks: N Ray actors forming one ``torch.distributed`` group, the model sharded by FSDP2.

Each actor holds one :class:`~agents.training.trainer.Trainer` built with ``distributed=True``
(rank r of N: gloo on CPU, NCCL on GPU); every rank receives the whole batch and trains its
share of each mini-batch's micro-batches, and the summed gradients make every update the one
process's (see :func:`agents.training.sharding.rank_passes`). The driver holds a :class:`TrainerGroup`::

    ensure_ray("local", processes=2)
    group = TrainerGroup("smollm2-135m", TrainerConfig(), ranks=2, out_dir="runs/a")
    record = await group.step(paths, {"time/rollout_s": 3.2})   # rank 0 logs it
    refs, size = await group.weight_refs(256 << 20)              # rank 0's buckets in the object store
    group.save_checkpoint(data_position={"next_row": 64})
    group.close()

The ranks are reserved together in one Ray placement group (bundle r holds rank r), spread
over the nodes by its strategy and put on the nodes that offer the custom ``resources`` they
ask for; :attr:`TrainerGroup.placement` says where each landed. The group meets at rank 0's
node's address as Ray reports it. Every rank writes its shards of each checkpoint under the
run folder, so each must see it: a rank that does not is refused at start, before any model
is loaded.

A rank that fails stops the run: every call raises a RuntimeError naming the rank and its node,
and the group's actors are killed (the others would wait in a collective for it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import secrets
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from agents.engines.base import update_then_sync
from agents.models import load_model, load_tokenizer
from agents.run.cluster.runtime import cpu_share, import_ray, node_alive, require_resources, this_process
from agents.run.cluster.weight_sync import BucketReceiver, put_buckets
from agents.training.trainer import Trainer
from agents.training.trainer_config import TrainerConfig

if TYPE_CHECKING:
    from agents.engines.base import WeightReceiver

__all__ = ["TrainerGroup"]

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
#: Seconds to wait for Ray to reserve the ranks' placement group before refusing (its strategy or
#: resources may fit no set of nodes, which Ray would wait for forever).
PLACEMENT_PATIENCE_S = 60.0
#: Seconds a failed rank's peers' nodes are watched for a loss before the rank itself is blamed
#: (Ray marks a node whose raylet died dead after a few missed health checks).
NODE_LOSS_PATIENCE_S = 15.0
#: The file the driver writes in the run folder for every rank to read (:meth:`_Rank.sees`).
_SHARED_CHECK = ".ranks-see-this-folder"


def _tokenizer_of(model: str) -> Any:
    """The tokenizer of ``model``; ``None`` for a local folder that has none (a bare test model)."""
    folder = Path(model)
    if folder.is_dir() and not any((folder / name).is_file() for name in _TOKENIZER_FILES):
        return None
    return load_tokenizer(model)


class _Rank:
    """One trainer rank, the body of a Ray actor (its methods run one at a time)."""

    def __init__(self, rank: int, ranks: int, threads: int | None) -> None:
        self.rank, self.ranks = rank, ranks
        if threads is not None:
            torch.set_num_threads(threads)
        self.trainer: Trainer | None = None

    def where(self) -> dict[str, Any]:
        """This rank's node (id and address, as Ray reports them) and process."""
        return {"rank": self.rank, **this_process()}

    def rendezvous(self) -> tuple[str, int]:
        """This node's address (as Ray reports it, never a loopback guess) and a free port: rank 0's, where the group meets."""
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("", 0))
            port = probe.getsockname()[1]
        return this_process()["ip"], int(port)

    def sees(self, path: str, token: str) -> bool:
        """Whether the file at ``path`` holds ``token`` here: the driver wrote it, so this node shares its folder."""
        try:
            return Path(path).read_text(encoding="utf-8") == token
        except OSError:
            return False

    def start(
        self,
        address: str,
        port: int,
        backend: str,
        model: str,
        config: TrainerConfig,
        out_dir: str | None,
        seed: int | None,
    ) -> int:
        """Join the group and build the trainer (the model loaded here, then sharded); returns the step."""
        import torch.distributed as dist

        if backend == "nccl":
            torch.cuda.set_device(0)  # Ray shows each rank its one GPU
        dist.init_process_group(backend, rank=self.rank, world_size=self.ranks, init_method=f"tcp://{address}:{port}")
        device = config.device or ("cuda" if backend == "nccl" else "cpu")
        if config.device is None:
            config = dataclasses.replace(config, device=device)
        shown = config.progress if self.rank == 0 else False  # as the Trainer's own bars
        policy = load_model(model, dtype=getattr(torch, config.base_dtype), device=device, progress=shown)
        if seed is not None:  # what the trainer initialises at random (LoRA's A) repeats; rank 0's goes to all
            torch.manual_seed(seed)
        self.trainer = Trainer(policy, config, tokenizer=_tokenizer_of(model), out_dir=out_dir, distributed=True)
        return self.trainer.step_count

    def _trainer(self) -> Trainer:
        assert self.trainer is not None, "start() builds the trainer first"
        return self.trainer

    def step(self, paths: Sequence[Any], rollout_metrics: Mapping[str, float] | None) -> dict[str, float]:
        return asyncio.run(self._trainer().step(paths, rollout_metrics))

    def accumulate(self, paths: Sequence[Any]) -> None:
        asyncio.run(self._trainer().accumulate(paths))

    def open_steps_bar(self) -> None:
        self._trainer().open_steps_bar()

    def weight_refs(self, bucket_bytes: int) -> tuple[list[Any], int] | None:
        state = self._trainer().engine_state_dict()  # every rank takes part in the gather
        return put_buckets(state, bucket_bytes) if self.rank == 0 else None

    def engine_state_dict(self) -> dict[str, torch.Tensor]:
        return self._trainer().engine_state_dict()

    def save_checkpoint(self, data_position: dict[str, Any] | None, plot_title: str | None) -> str:
        return str(self._trainer().save_checkpoint(data_position=data_position, plot_title=plot_title))

    def resume(self, path: str) -> tuple[dict[str, Any], int]:
        trainer = self._trainer()
        position = trainer.resume(path)
        return position, trainer.step_count

    def stop(self) -> None:
        import torch.distributed as dist

        if self.trainer is not None:
            self.trainer.close()
        if dist.is_initialized():
            dist.destroy_process_group()


def _reserve(ranks: int, cpus: float, gpus: float, resources: dict[str, float], strategy: str) -> Any:
    """The ranks' placement group, reserved (one bundle a rank); refused, saying why, when Ray cannot."""
    import ray
    from ray.util.placement_group import placement_group, remove_placement_group

    require_resources("trainer ranks", ranks, cpus, gpus, resources=resources)
    bundle = {"CPU": cpus, **({"GPU": gpus} if gpus else {}), **resources}
    group = placement_group([dict(bundle) for _ in range(ranks)], strategy=strategy)
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_PATIENCE_S)
    if not ready:
        remove_placement_group(group)
        nodes = [entry["Resources"] for entry in ray.nodes() if entry["Alive"]]
        raise RuntimeError(
            f"Ray could not place {ranks} trainer ranks of {bundle} each with strategy {strategy} in "
            f"{PLACEMENT_PATIENCE_S:g} s; its live nodes have {nodes}; add nodes, or change cluster.rank_strategy "
            "or cluster.rank_resources"
        )
    return group


def _placed(actor: Any, group: Any, rank: int, cpus: float, gpus: float, resources: Mapping[str, float] | None) -> Any:
    """``actor`` in bundle ``rank`` of ``group``, asking for what the bundle holds."""
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    strategy = PlacementGroupSchedulingStrategy(placement_group=group, placement_group_bundle_index=rank)
    return actor.options(num_cpus=cpus, num_gpus=gpus, resources=dict(resources or {}), scheduling_strategy=strategy)


class TrainerGroup:
    """The driver's handle on N trainer ranks (Ray actors); Ray must be started (``ensure_ray``).

    Args:
        model: a model name or folder for :func:`agents.models.load_model`, loaded by every rank.
        config: the trainer's hyper-parameters, the same on every rank.
        ranks: N, the processes of the group.
        out_dir: the run folder (rank 0 writes metrics there; checkpoints go to its
            ``checkpoints/``, which every rank must see: each writes its shards).
        cpus_per_rank: Ray CPUs per actor; ``None``: :func:`agents.run.cluster.runtime.cpu_share` of N.
        gpus_per_rank: 0 (CPU ranks, gloo) or the GPUs per actor (NCCL; 1 for FSDP).
        seed: seeds torch on the ranks just before the trainer is built, so that what it
            initialises at random (LoRA's A matrices) is reproducible; ``None``: unseeded. Either
            way every rank starts from rank 0's weights.
        resources: custom Ray resources each rank asks for (``{"trainer": 1}``: nodes started
            with ``ray start --resources='{"trainer": K}'``, K ranks each).
        strategy: the placement group's strategy (``PACK``, ``SPREAD``, ``STRICT_PACK``,
            ``STRICT_SPREAD``).
    """

    def __init__(
        self,
        model: str,
        config: TrainerConfig,
        *,
        ranks: int,
        out_dir: str | Path | None,
        cpus_per_rank: float | None = None,
        gpus_per_rank: float = 0,
        seed: int | None = None,
        bucket_bytes: int = 256 * 2**20,
        resources: Mapping[str, float] | None = None,
        strategy: str = "PACK",
    ) -> None:
        if isinstance(ranks, bool) or not isinstance(ranks, int) or ranks < 1:
            raise ValueError(f"ranks must be an integer >= 1, got {ranks!r}")
        import torch.distributed as dist

        backend = "nccl" if gpus_per_rank else "gloo"
        available = dist.is_available() and (dist.is_nccl_available() if gpus_per_rank else dist.is_gloo_available())
        if not available:
            raise RuntimeError(
                f"trainer ranks need torch.distributed with the {backend} backend, which this torch build "
                f"({torch.__version__}) lacks; install a torch with it, or use cluster.trainer_ranks=1"
            )
        ray = import_ray()
        if not ray.is_initialized():
            raise RuntimeError("TrainerGroup needs Ray started: call agents.run.cluster.runtime.ensure_ray first")
        self.config, self.ranks, self.bucket_bytes = config, ranks, bucket_bytes
        #: Receives the weights after every step (and :meth:`sync_weights`): a
        #: :class:`~agents.run.cluster.rollout_workers.RolloutPool` loads rank 0's buckets from the
        #: object store; any other engine gets them by ``update_weights``, bucket by bucket.
        self.engine: WeightReceiver | None = None
        self.tokenizer = _tokenizer_of(model)
        self.step_count = 0
        self._ray = ray
        cores = os.cpu_count() or 1
        threads = None if gpus_per_rank else max(1, cores // ranks)
        cpus = cpu_share(ranks) if cpus_per_rank is None else cpus_per_rank
        self._actors: list[Any] = []
        self._group = _reserve(ranks, cpus, gpus_per_rank, dict(resources or {}), strategy)
        #: Where each rank runs: ``{"rank", "node", "ip", "pid"}`` (node id and address as Ray reports them).
        self.placement: list[dict[str, Any]] = []
        try:
            self._actors = [
                _placed(ray.remote(_Rank), self._group, rank, cpus, gpus_per_rank, resources).remote(
                    rank, ranks, threads
                )
                for rank in range(ranks)
            ]
            self.placement = self._collect([a.where.remote() for a in self._actors])
            out = None if out_dir is None else str(Path(out_dir).resolve())
            if out is not None:
                self._require_shared(Path(out))
            address, port = self._collect([self._actors[0].rendezvous.remote()])[0]
            steps = self._collect(
                [a.start.remote(address, port, backend, model, config, out, seed) for a in self._actors]
            )
        except BaseException:
            self.close()
            raise
        #: Where the group met: rank 0's node's address and a port there.
        self.rendezvous = (address, port)
        self.step_count = steps[0]

    def _require_shared(self, out: Path) -> None:
        """Refuse to start when a rank cannot see the run folder, where every rank writes its checkpoint shards."""
        out.mkdir(parents=True, exist_ok=True)
        check, token = out / _SHARED_CHECK, secrets.token_hex(16)
        check.write_text(token, encoding="utf-8")
        try:
            seen = self._collect([a.sees.remote(str(check), token) for a in self._actors])
        finally:
            check.unlink(missing_ok=True)
        blind = [where for where, sees in zip(self.placement, seen) if not sees]
        if blind:
            ranks = ", ".join(f"rank {w['rank']} on node {w['node'][:12]} ({w['ip']})" for w in blind)
            raise RuntimeError(
                f"trainer {ranks} cannot see the run folder {out} (a file the driver wrote there is not on "
                f"that node): every rank writes its shards of each checkpoint under {out / 'checkpoints'}, so "
                "the folder must be on storage every node mounts at the same path (NFS, a cluster file system; "
                "--out there), or the ranks must go to nodes that share it (cluster.rank_resources), or "
                "cluster.trainer_ranks=1"
            )

    # ---- the driver's calls ---------------------------------------------------------------

    @property
    def local(self) -> None:
        """None: the trainer runs on the ranks, not in this process (:class:`agents.run.backends.TrainerBackend`)."""
        return None

    async def step(self, paths: Sequence[Any], rollout_metrics: Mapping[str, float] | None = None) -> dict[str, float]:
        """One training step on every rank; the record (Trainer.step's, without an engine sync), rank 0's."""
        batch = self._ray.put(list(paths))  # once in the object store, read by every rank
        metrics = dict(rollout_metrics) if rollout_metrics else None

        async def update() -> list[dict[str, float]]:
            records = await self._collect_async([a.step.remote(batch, metrics) for a in self._actors])
            self.step_count += 1  # before the sync: the weights it sends are this step's
            return records

        # Colocated engines release the GPUs for the update (as Trainer.step does with its engine).
        records, _ = await update_then_sync(
            self.engine,
            update,
            self.sync_weights,
            sleep=self.config.sleep_engine,
            keep_weights=bool(self.config.lora_rank),
        )
        return records[0]

    async def accumulate(self, paths: Sequence[Any]) -> None:
        """The next step's passes on part of its batch, on every rank (:meth:`agents.training.trainer.Trainer.accumulate`)."""
        part = self._ray.put(list(paths))
        await self._collect_async([a.accumulate.remote(part) for a in self._actors])

    def open_steps_bar(self) -> None:
        """Show rank 0's ``train`` bar now (:meth:`agents.training.trainer.Trainer.open_steps_bar`)."""
        self._collect([self._actors[0].open_steps_bar.remote()])

    async def sync_weights(self) -> None:
        """Hand the current weights to :attr:`engine` through the object store (nothing without one).

        The record of a step is written by rank 0 before this sync; the sync's numbers reach the
        next step's record as ``sync/*`` (from the pool's metrics).
        """
        if self.engine is None:
            return
        start = time.perf_counter()
        refs, size = await self.weight_refs(self.bucket_bytes)
        if isinstance(self.engine, BucketReceiver):
            await self.engine.load_buckets(refs, size, time.perf_counter() - start)
            return
        for ref in refs:
            await self.engine.update_weights(await ref)

    async def weight_refs(self, bucket_bytes: int) -> tuple[list[Any], int]:
        """The full weights as object-store buckets (:func:`agents.run.cluster.weight_sync.put_buckets`) and their bytes."""
        results = await self._collect_async([a.weight_refs.remote(bucket_bytes) for a in self._actors])
        refs, size = results[0]
        return refs, size

    def engine_state_dict(self) -> dict[str, torch.Tensor]:
        """The full weights (engine names), fetched to the driver: for tests and small models."""
        return self._collect([a.engine_state_dict.remote() for a in self._actors])[0]

    def save_checkpoint(self, data_position: dict[str, Any] | None = None, *, plot_title: str | None = None) -> Path:
        """A checkpoint under ``out_dir/checkpoints`` (sharded, plus the consolidated ``model/``) and
        ``curves.png``, headed ``plot_title``."""
        saves = [a.save_checkpoint.remote(data_position, plot_title) for a in self._actors]
        return Path(self._collect(saves)[0])

    def resume(self, path: str | Path) -> dict[str, Any]:
        """Continue from a checkpoint written at any number of ranks; returns its data position."""
        position, self.step_count = self._collect([a.resume.remote(str(path)) for a in self._actors])[0]
        return position

    def close(self) -> None:
        """Leave the group, end the actors and free their placement group (idempotent)."""
        actors, self._actors = getattr(self, "_actors", []), []
        group, self._group = getattr(self, "_group", None), None
        ray = self._ray
        if actors:
            stops = [a.stop.remote() for a in actors]
            ray.wait(stops, num_returns=len(stops), timeout=10)
            for actor in actors:
                ray.kill(actor)
        if group is not None:
            ray.util.remove_placement_group(group)

    # ---- failures --------------------------------------------------------------------------

    def _failed(self, rank: int, error: BaseException) -> RuntimeError:
        """The error that stops the run when ``rank`` failed, naming the rank to blame and its node."""
        cause = getattr(error, "cause", None) or error
        # A rank whose process is gone is the one to blame; one that raised may be a survivor of another's loss.
        blamed, lost = self._blame(
            rank, patience_s=0.0 if isinstance(error, self._ray.exceptions.RayActorError) else None
        )
        self.close()  # the other ranks would wait in a collective for this one
        what = f"{type(cause).__name__}: {cause}"
        if lost:
            where = self.placement[blamed]
            stopped = f"trainer rank {blamed} on node {where['node'][:12]} ({where['ip']}) was lost with its node"
            if blamed != rank:  # a survivor's collective broke first
                stopped += f" (rank {rank} then failed: {what})"
        elif rank < len(self.placement):
            where = self.placement[rank]
            stopped = f"trainer rank {rank} on node {where['node'][:12]} ({where['ip']}) failed: {what}"
        else:
            stopped = f"trainer rank {rank} failed: {what}"
        return RuntimeError(
            f"{stopped}; the run stops; continue with --resume from the last checkpoint (on the nodes left, with "
            "as many --trainer-ranks as they hold: a checkpoint resumes at any number of ranks)"
        )

    def _blame(self, rank: int, patience_s: float | None = None) -> tuple[int, bool]:
        """The rank a failure is due to, and whether its node is lost.

        When a node dies, the ranks left usually fail first (their collective loses its peer) and
        Ray marks the node dead a few seconds later, so the nodes are looked at for up to
        :data:`NODE_LOSS_PATIENCE_S` (or ``patience_s``) before ``rank`` itself is blamed.
        """
        deadline = time.monotonic() + (NODE_LOSS_PATIENCE_S if patience_s is None else patience_s)
        while self.placement:
            lost = [where["rank"] for where in self.placement if not node_alive(where["node"])]
            if lost:
                return (rank if rank in lost else lost[0]), True
            if time.monotonic() >= deadline:
                break
            time.sleep(0.5)
        return rank, False

    def _collect(self, refs: list[Any]) -> list[Any]:
        """Every rank's result, or the first failure as a RuntimeError (the group then closed)."""
        if not self._actors:
            raise RuntimeError("the trainer group is closed")
        index = {ref: rank for rank, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        while pending:
            ready, pending = self._ray.wait(pending, num_returns=1)
            for ref in ready:
                try:
                    results[index[ref]] = self._ray.get(ref)
                except Exception as error:
                    raise self._failed(index[ref], error) from error
        return [results[rank] for rank in range(len(refs))]

    async def _collect_async(self, refs: list[Any]) -> list[Any]:
        if not self._actors:
            raise RuntimeError("the trainer group is closed")

        async def get(ref: Any) -> Any:
            return await ref

        tasks = [asyncio.ensure_future(get(ref)) for ref in refs]
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for rank, task in enumerate(tasks):
            if task in done and task.exception() is not None:
                error = task.exception()
                assert error is not None
                for other in tasks:
                    other.cancel()
                raise self._failed(rank, error) from error
        return [task.result() for task in tasks]
