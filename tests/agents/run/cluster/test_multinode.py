"""Several Ray nodes: ranks and workers placed on the nodes that offer what they ask for, meeting across
nodes, a node lost mid-run, and a run folder one node cannot see.

The nodes are Ray's own (``ray.cluster_utils.Cluster``, as Ray tests itself): a head and two more
raylets on this host, each with its CPUs, its object store and its resources, joined the way a user
joins a cluster (``RAY_ADDRESS`` and ``cluster.address=auto``). The node that cannot see the run
folder is a real ``ray start`` whose processes see an empty file system at that path (bubblewrap
mounts a tmpfs over it). What stays untested without separate hosts: their network (every node has
this host's address) and disks that differ in more than one folder.

The run is AT²PO on a letters game with the tiny model of tests/conftest.py; its reference is the
same run in one process (the tolerance of tests/agents/run/cluster/test_rollout_workers.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

import agentenv
from agents.run.config import TrainConfig, merge
from agents.run.train import train
from agents.training.metrics import read_jsonl

STORE = 150 * 2**20  # the blind node's object store: the tiny model's weights are a few MiB


class Letters(agentenv.Env):
    """Two turns; the reward is the fraction of answered characters in a-z.

    On the node whose id is ``hang_node`` a step first touches the file ``reached`` and then never
    returns (that node is about to be removed), so the prompt is mid-rollout when the node goes.
    """

    def __init__(self, hang_node: str = "", reached: str = "", render_mode=None):
        super().__init__(render_mode=render_mode)
        self.hang_node, self.reached = hang_node, reached

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.said = []
        return "Write letters.", {}

    def step(self, action):
        if self.hang_node and _node_id() == self.hang_node:
            Path(self.reached).touch()
            time.sleep(600)
        self.said.append(action)
        text = "".join(self.said)
        done = len(self.said) == 2
        return "next", sum("a" <= ch <= "z" for ch in text) / max(1, len(text)) if done else 0.0, done, False, {}


def _node_id() -> str:
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else ""


@pytest.fixture(scope="module", autouse=True)
def letters(module_envs):
    module_envs("multinode-tests/letters-v0", Letters)


def run_config(model: str, **changes: Any) -> TrainConfig:
    """AT²PO on letters: 3 prompts × (2 + 1·2) leaves of 6-token turns a step, 3 steps, a checkpoint each."""
    values = merge(
        TrainConfig(algo="at2po").to_dict(),
        {
            "env": "multinode-tests/letters",
            "model": model,
            "steps": 3,
            "prompts_per_step": 3,
            "holdout": 1,
            "eval_questions": 0,
            "checkpoint_every": 1,
            "strategy": {"M": 2, "L": 1, "K": 2},
            "trainer": {"lr": 3e-2, "mini_batches": 1, "micro_batch_size": 16, "report_to": ["none"]},
            "sampling": {"max_new_tokens": 6},
            "rollout": {"max_response_tokens": 24},
        },
    )
    return TrainConfig.from_dict(merge(values, changes))


@pytest.fixture(scope="module")
def alone(tiny_model, tmp_path_factory):
    """The run in one process (no Ray): the reference of every multi-node run."""
    out = tmp_path_factory.mktemp("alone") / "run"
    asyncio.run(train(run_config(tiny_model), out, progress=False, log=lambda note: None))
    return out


def assert_matches(records: list[dict[str, float]], reference: list[dict[str, float]]) -> None:
    """The tolerance of ranks and workers against one process: the same trees, the same update to float error."""
    assert [r["step"] for r in records] == [r["step"] for r in reference]
    for spread, one in zip(records, reference):
        assert spread["reward/mean"] == one["reward/mean"]  # the synced weights sample the same trees
        assert spread["tokens/generated"] == one["tokens/generated"]
        assert spread["batch/sequences"] == one["batch/sequences"] == 12  # no prompt lost
        assert spread["policy/loss"] == pytest.approx(one["policy/loss"], rel=1e-5, abs=1e-7)
        assert spread["optim/grad_norm"] == pytest.approx(one["optim/grad_norm"], rel=1e-4)


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / "step_000003" / "model" / "model.safetensors")


def assert_same_weights(run: Path, reference: Path, atol: float = 1e-5) -> None:
    ours, theirs = final_weights(run), final_weights(reference)
    assert ours.keys() == theirs.keys()  # the ranks' consolidated model, too, holds the tied matrix once
    assert max(float((ours[n] - theirs[n]).abs().max()) for n in theirs) <= atol


def node_addresses() -> dict[str, str]:
    import ray

    return {entry["NodeID"]: entry["NodeManagerAddress"] for entry in ray.nodes() if entry["Alive"]}


@pytest.mark.slow
async def test_ranks_and_workers_on_the_nodes_that_offer_their_resources_train_as_one_process(
    nodes, alone, tiny_model, tmp_path
):
    cluster = {
        "address": "auto",
        "trainer_ranks": 2,
        "rollout_workers": 2,
        "rank_resources": {"trainer": 1},  # one a node: node-a and node-b
        "worker_resources": {"rollout": 1},
    }
    notes: list[str] = []
    result = await train(run_config(tiny_model, cluster=cluster), tmp_path / "run", progress=False, log=notes.append)
    assert_matches(result.history, read_jsonl(alone / "metrics.jsonl"))
    assert_same_weights(tmp_path / "run", alone)

    placement = json.loads((tmp_path / "run" / "placement.json").read_text())
    two = {nodes.id("node-a"), nodes.id("node-b")}
    assert {entry["node"] for entry in placement["trainer_ranks"]} == two
    assert {entry["node"] for entry in placement["rollout_workers"]} == two
    # The group met at rank 0's node's address as Ray reports it (this host's, not a loopback guess).
    rank0 = placement["trainer_ranks"][0]
    host, port = placement["rendezvous"].rsplit(":", 1)
    assert host == rank0["ip"] == node_addresses()[rank0["node"]] and not host.startswith("127.") and int(port) > 0
    assert sum(note.startswith(("trainer rank", "rollout worker")) and " on node " in note for note in notes) == 4
    # Every prompt of steps 2 and 3 (spread over both nodes' workers) was sampled by the synced weights.
    assert [r["async/version"] for r in result.history] == [0, 1, 2]
    assert all(r["sync/bytes"] > 0 for r in result.history[1:])


def bwrap_works() -> bool:
    return (
        shutil.which("bwrap") is not None and subprocess.run(["bwrap", "--dev-bind", "/", "/", "true"]).returncode == 0
    )


def blind_node(address: str, folder: Path) -> subprocess.Popen:
    """``ray start`` joining ``address`` as a node with resource ``blind``, whose processes see ``folder`` empty."""
    ray_cli = str(Path(sys.executable).with_name("ray"))
    command = [
        *("bwrap", "--dev-bind", "/", "/", "--tmpfs", str(folder), "--die-with-parent"),
        *(ray_cli, "start", "--address", address, "--num-cpus", "2", "--resources", '{"blind": 2}'),
        *("--object-store-memory", str(STORE), "--block"),
    ]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)


@pytest.mark.slow
async def test_ranks_on_a_node_that_cannot_see_the_run_folder_are_refused_before_any_model_loads(
    nodes, tiny_model, tmp_path
):
    if not bwrap_works():
        pytest.skip("needs bubblewrap with user namespaces, which mounts the folder away on one node")
    import ray

    before = len(ray.nodes())
    node = blind_node(nodes.cluster.address, tmp_path)
    try:
        deadline = time.monotonic() + 120
        while ray.cluster_resources().get("blind", 0) < 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        assert ray.cluster_resources().get("blind") == 2
        blind = next(e["NodeID"] for e in ray.nodes() if e["Alive"] and "blind" in e["Resources"])
        cluster = {"address": "auto", "trainer_ranks": 2, "rank_resources": {"blind": 1}}
        config = run_config(tiny_model, cluster=cluster)
        with pytest.raises(RuntimeError) as refused:
            await train(config, tmp_path / "run", progress=False, log=lambda note: None)
        message = str(refused.value)
        assert f"trainer rank 0 on node {blind[:12]}" in message and f"rank 1 on node {blind[:12]}" in message
        assert f"cannot see the run folder {tmp_path / 'run'}" in message
        assert "storage every node mounts at the same path" in message
        assert not (tmp_path / "run" / "checkpoints").exists() and not (tmp_path / "run" / "metrics.jsonl").exists()
        # The placement group is freed (Ray returns a removed group's resources a moment later).
        deadline = time.monotonic() + 30
        while ray.available_resources().get("blind") != 2 and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert ray.available_resources().get("blind") == 2
    finally:
        os.killpg(node.pid, signal.SIGTERM)
        node.wait(timeout=60)
    deadline = time.monotonic() + 60
    while len([e for e in ray.nodes() if e["Alive"]]) >= before + 1 and time.monotonic() < deadline:
        await asyncio.sleep(0.5)


async def remove_when(nodes: Any, name: str, happened) -> None:
    """Remove node ``name`` once ``happened()`` is true."""
    while not happened():
        await asyncio.sleep(0.05)
    nodes.remove(name)


@pytest.mark.slow
async def test_a_node_lost_with_a_rollout_worker_mid_rollout_loses_no_prompt(nodes, alone, tiny_model, tmp_path):
    reached = tmp_path / "reached"
    cluster = {
        "address": "auto",
        "trainer_ranks": 2,
        "rollout_workers": 2,
        "rank_resources": {"head": 1},  # the ranks stay; node-b holds a worker
        "worker_resources": {"rollout": 1},
    }
    env_kwargs = {"hang_node": nodes.id("node-b"), "reached": str(reached)}
    config = run_config(tiny_model, cluster=cluster, env_kwargs=env_kwargs)
    notes: list[str] = []
    removal = asyncio.ensure_future(remove_when(nodes, "node-b", reached.exists))
    try:
        result = await train(config, tmp_path / "run", progress=False, log=notes.append)
    finally:
        await asyncio.wait_for(removal, timeout=5)
        nodes.add("node-b")  # a fresh node for the tests after this one
    records = result.history
    assert_matches(records, read_jsonl(alone / "metrics.jsonl"))  # its prompts ran again on node-a, the same
    assert records[0]["cluster/worker_failures"] == 1 and records[0]["cluster/prompts_rerun"] >= 1
    assert [r["cluster/workers_live"] for r in records] == [1, 1, 1]  # no node offers a second worker's resource
    placement = json.loads((tmp_path / "run" / "placement.json").read_text())["rollout_workers"]
    rank = next(entry["rank"] for entry in placement if entry["node"] == env_kwargs["hang_node"])
    assert any(note.startswith(f"rollout worker {rank} died") for note in notes)


@pytest.mark.slow
async def test_a_node_lost_with_a_trainer_rank_stops_the_run_naming_both_and_resume_goes_on_at_fewer_ranks(
    nodes, alone, tiny_model, tmp_path
):
    run = tmp_path / "run"
    cluster = {
        "address": "auto",
        "trainer_ranks": 2,
        "rollout_workers": 2,
        "rank_resources": {"trainer": 1},  # a rank on each of node-a and node-b
        "worker_resources": {"head": 1},
    }
    config = run_config(tiny_model, cluster=cluster)
    removal = asyncio.ensure_future(
        remove_when(nodes, "node-b", lambda: (run / "checkpoints" / "step_000001" / "model").is_dir())
    )
    lost = nodes.id("node-b")
    try:
        with pytest.raises(RuntimeError) as stopped:
            await train(config, run, progress=False, log=lambda note: None)
    finally:
        await asyncio.wait_for(removal, timeout=5)
        nodes.add("node-b")
    rank = next(
        e["rank"] for e in json.loads((run / "placement.json").read_text())["trainer_ranks"] if e["node"] == lost
    )
    message = str(stopped.value)
    assert f"trainer rank {rank} on node {lost[:12]} (192" in message and "was lost with its node" in message
    assert "--resume" in message
    stopped_at = len(read_jsonl(run / "metrics.jsonl"))
    assert 1 <= stopped_at < 3

    # On the nodes left, at one rank (the trainer in this process): it goes on from its last checkpoint.
    fewer = dataclasses.replace(config, cluster={**cluster, "trainer_ranks": 1})
    notes: list[str] = []
    resumed = await train(fewer, run, resume=True, progress=False, log=notes.append)
    assert resumed.steps == 3 and any(note.startswith(f"resumed {run} at step") for note in notes)
    assert_matches(read_jsonl(run / "metrics.jsonl"), read_jsonl(alone / "metrics.jsonl"))
    assert_same_weights(run, alone)
