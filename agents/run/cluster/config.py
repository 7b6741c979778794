"""The ``cluster`` section of a run: how many trainer ranks and rollout workers, and where they go."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

__all__ = ["PLACEMENTS", "RANK_STRATEGIES", "WORKER_STRATEGIES", "ClusterConfig"]

#: ``colocated``: trainer ranks and engines time-share the same GPUs (engines sleep during the
#: update); ``split``: engines get GPUs of their own.
PLACEMENTS = ("colocated", "split")
#: Ray's placement-group strategies, for the trainer ranks (reserved together, as Ray Train does).
RANK_STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
#: Ray's scheduling strategies for rollout workers (no placement group: a worker whose node is lost
#: is restarted wherever Ray finds room).
WORKER_STRATEGIES = ("DEFAULT", "SPREAD")


@dataclass(frozen=True)
class ClusterConfig:
    """Processes of a run. The defaults are the single process: no Ray, no process group.

    Attributes:
        trainer_ranks: N, the processes of the trainer's ``torch.distributed`` group (FSDP2 shards
            the model over them; NCCL on GPU, gloo on CPU). 1: the trainer runs in the driver.
        rollout_workers: M, Ray actors that each own an engine and the environments of the
            prompts they run. 0: the rollout runs in the driver on its own engine.
        tensor_parallel_size: GPUs of each rollout worker's vLLM engine (1 on CPU).
        placement: ``colocated`` or ``split`` (see :data:`PLACEMENTS`); on CPU both place every
            process on the machine's cores.
        address: ``local`` starts Ray on this machine with the cores it has; ``auto`` joins the
            cluster started with ``ray start`` (or a ``ray://`` / ``host:port`` address).
        worker_engine: The workers' engine: ``hf``, ``vllm``, or ``"module:attr"``, a function of no
            arguments returning your own :class:`~agents.engines.base.Engine` (importable on every
            node; called once in each worker); ``None``: the run's ``engine``.
        rank_resources: Ray resources each trainer rank needs besides its CPUs and GPUs: a custom
            resource that only some nodes offer (``ray start --resources='{"trainer": 8}'``) puts
            the ranks on those nodes.
        worker_resources: The same for each rollout worker (``{"rollout": 1}``: nodes started
            with that resource).
        rank_strategy: How the ranks' placement group spreads them over nodes (see
            :data:`RANK_STRATEGIES`); ``PACK`` (Ray Train's default) keeps the collectives on few nodes.
        worker_strategy: ``DEFAULT`` (Ray packs where there is room) or ``SPREAD`` (one node after another).
        worker_restarts: How often Ray restarts a worker whose process died (its prompts of the
            running step go to the other workers meanwhile).
        sync_bucket_mb: Size of one bucket of the weight sync through Ray's object store.
        in_flight_updates: A sync lands between two decode steps of the requests in flight, which
            go on with the new weights (each token records the version that sampled it), instead
            of holding new requests until those in flight finish on the old weights. For
            ``max_staleness`` ≥ 1, where syncs land during rollouts; HFEngine workers (vLLM's
            engines do not report which weights sampled a token). Off by default.
    """

    trainer_ranks: int = 1
    rollout_workers: int = 0
    tensor_parallel_size: int = 1
    placement: str = "colocated"
    address: str = "local"
    worker_engine: str | None = None
    worker_restarts: int = 1
    sync_bucket_mb: int = 256
    in_flight_updates: bool = False
    rank_resources: dict[str, float] = dataclasses.field(default_factory=dict)
    worker_resources: dict[str, float] = dataclasses.field(default_factory=dict)
    rank_strategy: str = "PACK"
    worker_strategy: str = "DEFAULT"

    def __post_init__(self) -> None:
        for name, minimum in (
            ("trainer_ranks", 1),
            ("rollout_workers", 0),
            ("tensor_parallel_size", 1),
            ("worker_restarts", 0),
            ("sync_bucket_mb", 1),
        ):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"cluster.{name} must be an integer >= {minimum}, got {value!r}")
        if self.placement not in PLACEMENTS:
            raise ValueError(f"cluster.placement must be one of {', '.join(PLACEMENTS)}, got {self.placement!r}")
        if not isinstance(self.address, str) or not self.address:
            raise ValueError(f"cluster.address must be 'local', 'auto' or a Ray address, got {self.address!r}")
        if not isinstance(self.in_flight_updates, bool):
            raise ValueError(f"cluster.in_flight_updates must be true or false, got {self.in_flight_updates!r}")
        if self.in_flight_updates and not self.rollout_workers:
            raise ValueError(
                "cluster.in_flight_updates=true changes the weights of rollout workers' engines; "
                "it needs cluster.rollout_workers >= 1"
            )
        engine = self.worker_engine
        if engine not in (None, "hf", "vllm") and not (isinstance(engine, str) and _is_entry_point(engine)):
            raise ValueError(
                f"cluster.worker_engine must be 'hf', 'vllm', 'module:attr' (a function returning your engine) "
                f"or None, got {engine!r}"
            )
        for name in ("rank_resources", "worker_resources"):
            _check_resources(f"cluster.{name}", getattr(self, name))
        for name, known in (("rank_strategy", RANK_STRATEGIES), ("worker_strategy", WORKER_STRATEGIES)):
            if getattr(self, name) not in known:
                raise ValueError(f"cluster.{name} must be one of {', '.join(known)}, got {getattr(self, name)!r}")

    @property
    def uses_ray(self) -> bool:
        """Whether the run needs Ray: more than one trainer rank, or any rollout worker."""
        return self.trainer_ranks > 1 or self.rollout_workers > 0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> ClusterConfig:
        """The section from a config mapping; an unknown key is an error listing the known ones."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"cluster has no setting {unknown[0]!r}; it has {', '.join(known)}")
        return cls(**values)


def _is_entry_point(text: str) -> bool:
    module, _, attr = text.partition(":")
    return all(part and all(piece.isidentifier() for piece in part.split(".")) for part in (module, attr))


def _check_resources(name: str, resources: Any) -> None:
    """Ray's custom resources: names to amounts > 0 (CPU and GPU have settings of their own)."""
    if not isinstance(resources, dict):
        raise ValueError(f"{name} must be a mapping of Ray resource names to amounts, got {resources!r}")
    for key, amount in resources.items():
        if not isinstance(key, str) or not key or key in ("CPU", "GPU"):
            raise ValueError(
                f"{name} names {key!r}; give a custom resource a node offers (ray start --resources), "
                "not CPU or GPU, which the run sets itself"
            )
        if isinstance(amount, bool) or not isinstance(amount, (int, float)) or not amount > 0:
            raise ValueError(f"{name}[{key!r}] must be a number > 0, got {amount!r}")
