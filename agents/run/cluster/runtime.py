"""Ray for a run: start it on this machine or join a running cluster, with errors that say what to do."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

__all__ = ["cpu_share", "ensure_ray", "import_ray", "node_alive", "require_resources", "this_process"]

# Ray's own metrics agent and dashboard are not used and cost a core's worth of start-up here.
_RAY_INIT = {"include_dashboard": False, "log_to_driver": True}


def import_ray() -> Any:
    """The ``ray`` module, or an ImportError saying how to install it."""
    try:
        import ray
    except ImportError:
        raise ImportError(
            "cluster.trainer_ranks > 1 or cluster.rollout_workers > 0 needs Ray: pip install 'ray>=2.50' "
            "(make installs it), or keep the single process (trainer_ranks=1, rollout_workers=0)"
        ) from None
    return ray


def ensure_ray(address: str = "local", *, processes: int = 1) -> Any:
    """Ray, started or joined once per process; returns the ``ray`` module.

    ``local`` starts a Ray instance on this machine with its cores, at least ``processes`` of
    them logically (Ray's CPUs are a scheduling count: two cores can host a trainer rank and a
    rollout worker each, which then share the cores). ``auto`` (or an address) joins a cluster
    started with ``ray start --head``.
    """
    ray = import_ray()
    if ray.is_initialized():
        return ray
    env = {"env_vars": {name: os.environ[name] for name in _FORWARDED_ENV if name in os.environ}}
    if address == "local":
        cores = os.cpu_count() or 1
        ray.init(num_cpus=max(cores, processes), runtime_env=env, **_RAY_INIT)
        return ray
    try:
        ray.init(address=address, runtime_env=env, **_RAY_INIT)
    except ConnectionError as error:
        raise ConnectionError(
            f"no Ray cluster reachable at cluster.address={address!r} ({error}); start one with "
            "`ray start --head` on the head node (and `ray start --address HEAD:6379` on the others), "
            "or use cluster.address=local to start Ray on this machine"
        ) from None
    return ray


def require_resources(
    what: str,
    count: int,
    cpus: float,
    gpus: float = 0.0,
    patience_s: float = 5.0,
    resources: Mapping[str, float] | None = None,
) -> None:
    """Refuse, saying why, to start ``count`` actors that Ray could not place (it would wait forever).

    Each asks for ``cpus``, ``gpus`` and the custom ``resources``; what the whole cluster has free
    is compared (where on which node is Ray's to settle). Ray frees a killed actor's resources a
    moment after the kill, so resources short at first are looked at again for up to
    ``patience_s`` (a pool closed just before this one).
    """
    import ray

    need = {"CPU": count * cpus, "GPU": count * gpus, **{name: count * n for name, n in (resources or {}).items()}}
    deadline = time.monotonic() + patience_s
    while True:
        free = ray.available_resources()
        short = [
            f"{need[kind]:g} {kind + 's' if kind in ('CPU', 'GPU') else repr(kind)}, {free.get(kind, 0.0):g} free"
            for kind in need
            if need[kind] > free.get(kind, 0.0) + 1e-9
        ]
        if not short or time.monotonic() >= deadline:
            break
        time.sleep(0.1)
    if short:
        raise RuntimeError(
            f"Ray cannot place {count} {what} now ({'; '.join(short)}); stop the actors that hold them, "
            "add nodes (ray start --address), or ask for fewer processes"
        )


def this_process() -> dict[str, Any]:
    """Where the calling process (a Ray actor) runs, as Ray reports it: ``node`` (its node's id),
    ``ip`` (the node's address, where others reach it) and ``pid``."""
    import ray

    return {"node": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address(), "pid": os.getpid()}


def node_alive(node: str) -> bool:
    """Whether Ray counts the node with id ``node`` among the cluster's live ones."""
    import ray

    return any(entry["NodeID"] == node and entry["Alive"] for entry in ray.nodes())


def cpu_share(processes: int) -> float:
    """Ray CPUs one of ``processes`` actors asks for on a local instance (they split the machine)."""
    cores = os.cpu_count() or 1
    return max(cores, processes) / max(processes, 1)


# Settings the actors must see as the driver does (offline hubs, vLLM's telemetry off, threads).
_FORWARDED_ENV = (
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "VLLM_NO_USAGE_STATS",
    "DO_NOT_TRACK",
    "HF_HOME",
    "PYTHONPATH",
)
