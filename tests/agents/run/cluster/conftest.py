"""One local Ray instance for the whole test session (starting Ray costs ~15 s on two cores), and a
cluster of several Ray nodes on this host for the modules that need one."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

# Logical CPUs for every actor alive at once in one module (a module's worker pool plus a run's
# two workers and two ranks); Ray would otherwise wait for free CPUs forever.
LOCAL_PROCESSES = 8
STORE = 150 * 2**20  # each node's object store: the tiny model's weights are a few MiB


@pytest.fixture(scope="session")
def ray_local():
    """Ray started on this machine (as ``cluster.address=local`` does), shut down after the session."""
    from agents.run.cluster.runtime import ensure_ray

    ray = ensure_ray("local", processes=LOCAL_PROCESSES)
    yield ray
    ray.shutdown()


@dataclass
class Nodes:
    """The cluster, and its two worker nodes by name (``node-a``, ``node-b``)."""

    cluster: Any
    nodes: dict[str, Any]

    def id(self, name: str) -> str:
        return self.nodes[name].node_id

    def add(self, name: str) -> None:
        """A node ``name``: 2 CPUs, one trainer rank's and one rollout worker's custom resource."""
        self.nodes[name] = self.cluster.add_node(
            num_cpus=2, resources={"trainer": 1, "rollout": 1, name: 1}, object_store_memory=STORE
        )
        self.cluster.wait_for_nodes()

    def remove(self, name: str) -> None:
        self.cluster.remove_node(self.nodes.pop(name), allow_graceful=False)


@pytest.fixture(scope="module")
def nodes():
    """A head (4 CPUs, resource ``head``) and nodes ``node-a`` and ``node-b``, joined through RAY_ADDRESS."""
    import ray
    from ray.cluster_utils import Cluster

    from agents.run.cluster.runtime import ensure_ray

    was_local = ray.is_initialized()
    if was_local:
        ray.shutdown()
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 4,
            "resources": {"head": 4},
            "include_dashboard": False,
            "object_store_memory": STORE,
        },
    )
    joined = Nodes(cluster, {})
    for name in ("node-a", "node-b"):
        joined.add(name)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RAY_ADDRESS", cluster.address)
        ensure_ray("auto")  # as `agents train --ray-address auto` joins it
        yield joined
        ray.shutdown()
    cluster.shutdown()
    if was_local:  # the session's local Ray, for the modules after this one
        ensure_ray("local", processes=LOCAL_PROCESSES)
