"""Rollout workers on real Ray: the same trees as one process, weights equal after a sync, a killed
worker loses nothing, and an environment registered in the driver (here, in this test module) runs
on the workers and trains.

The model is a random 2-layer Llama with a byte-level tokenizer saved as a checkpoint folder (the
workers load it by path, as they would a real model), the environment a user's own.
"""

import asyncio
import dataclasses
import json
import os
import signal
import time

import pytest
import torch

import agentenv
from agentenv.wrappers import TokenEnv
from agents.models import load_model, load_tokenizer
from agents.run.backends import LocalRollout, run_engine
from agents.run.cluster.rollout_workers import RolloutPool, WorkerSpec
from agents.run.cluster.weight_sync import weights_digest
from agents.run.config import TrainConfig, build, merge
from agents.run.train import train
from agents.training.metrics import read_jsonl


class SlowLetters(agentenv.Env):
    """``turns`` turns, each taking ``delay`` seconds; the reward is the fraction of answered characters in a-z."""

    def __init__(self, turns: int = 2, delay: float = 0.0, render_mode=None):
        super().__init__(render_mode=render_mode)
        self.turns, self.delay = turns, delay

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.said = []
        return "Write letters.", {}

    def step(self, action):
        time.sleep(self.delay)
        self.said.append(action)
        text = "".join(self.said)
        done = len(self.said) == self.turns
        letters = sum("a" <= ch <= "z" for ch in text)
        return "next", letters / max(1, len(text)) if done else 0.0, done, False, {}


@pytest.fixture(scope="module", autouse=True)
def slow_letters(module_envs):
    """Registered here, in the driver, only: the workers get the entry by value."""
    module_envs("cluster-tests/slow-letters-v0", SlowLetters)


def letters_config(model: str, **changes) -> TrainConfig:
    """AT²PO on slow-letters: 4 prompts × (2 + 1·2) leaves of 6-token turns per step."""
    values = merge(
        TrainConfig(algo="at2po").to_dict(),
        {
            "env": "cluster-tests/slow-letters",
            "model": model,
            "steps": 2,
            "prompts_per_step": 4,
            "holdout": 2,
            "eval_questions": 2,
            "checkpoint_every": 1,
            "strategy": {"M": 2, "L": 1, "K": 2},
            "trainer": {"lr": 3e-2, "mini_batches": 1, "micro_batch_size": 16, "report_to": ["none"]},
            "sampling": {"max_new_tokens": 6},
            "rollout": {"max_response_tokens": 24},
        },
    )
    return TrainConfig.from_dict(merge(values, changes))


@pytest.fixture(scope="module")
def pool(ray_local, tiny_model):
    """Two rollout workers on the tiny model, one start for the module (each kill test kills a different worker once)."""
    config = letters_config(tiny_model, env_kwargs={"delay": 0.2})
    parts = build(config)
    spec = WorkerSpec(config, agentenv.spec(config.env), parts.learner.strategy, parts.tree)
    notes: list[str] = []
    pool = RolloutPool(spec, 2, cpus=1, restarts=1, log=notes.append)
    pool.notes = notes
    yield pool, config, parts
    asyncio.run(pool.close())


def leaves(prompts):
    return [[(leaf.action_ids, leaf.reward) for leaf in prompt.leaves] for prompt in prompts]


async def test_workers_grow_the_trees_one_process_grows_and_hold_the_trainers_weights_after_a_sync(pool):
    pool, config, parts = pool
    assert len({info["pid"] for info in pool.info}) == 2 and os.getpid() not in {i["pid"] for i in pool.info}
    await pool.update_weights(load_model(config.model).state_dict())  # the local run's weights, whatever ran before
    tasks = [2, 5, 3, 7]
    counted: list[int] = []
    spread = await pool.rollout(tasks, seed=11, on_branches=counted.append)
    assert counted == [4, 4, 4, 4]  # each prompt's M + L·K branches as its trees come back (the progress bar)
    tokenizer = load_tokenizer(config.model)
    env = TokenEnv(agentenv.make(config.env, **config.env_kwargs), tokenizer)
    local = LocalRollout(env, run_engine(config, parts.tree.rollout), tokenizer, parts)
    try:
        alone = await local.rollout(tasks, seed=11)
    finally:
        await local.close()
    assert [p.index for p in spread] == [0, 1, 2, 3] and [p.key for p in spread] == tasks
    assert all(len(prompt.leaves) == 4 for prompt in spread)  # M + L·K leaves each
    assert leaves(spread) == leaves(alone)  # each prompt's seeds follow it to whichever worker runs it
    assert all(node.env is None for prompt in spread for tree in prompt.trees for node in [tree.root, *tree.nodes()])
    cluster = {name: value for name, value in pool.metrics().items() if name.startswith("cluster/")}
    assert cluster == {"cluster/worker_failures": 0.0, "cluster/prompts_rerun": 0.0, "cluster/workers_live": 2.0}

    # A sync: new weights on every worker, equal to the sender's, each tied tensor sent once.
    model = load_model(config.model)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01)
    before = await pool.digests()
    await pool.update_weights(model.state_dict())
    after = await pool.digests()
    assert before[0] == before[1] and after[0] == after[1] != before[0]
    assert after[0] == weights_digest(model.state_dict())
    assert pool.last_sync.buckets >= 1
    assert pool.last_sync.bytes == sum(p.numel() * 4 for p in model.parameters())  # the tied matrix once


def test_workers_ray_cannot_place_are_refused_after_a_short_wait(pool):
    _, config, parts = pool
    spec = WorkerSpec(config, agentenv.spec(config.env), parts.learner.strategy, parts.tree)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"Ray cannot place 2 rollout workers now \(2000 CPUs, \d+ free\)"):
        RolloutPool(spec, 2, cpus=1000)
    assert 5.0 <= time.monotonic() - start < 30.0  # resources a kill frees a moment later are waited for


async def test_a_pool_started_right_after_another_closed_gets_its_cpus(pool, ray_local):
    _, config, parts = pool
    spec = WorkerSpec(config, agentenv.spec(config.env), parts.learner.strategy, parts.tree)
    share = ray_local.available_resources()["CPU"] / 2  # two workers take every CPU the module pool leaves
    first = RolloutPool(spec, 2, cpus=share, restarts=0)
    await first.close()
    second = RolloutPool(spec, 2, cpus=share, restarts=0)  # Ray frees the first's CPUs a moment after the kill
    try:
        assert [info["rank"] for info in second.info] == [0, 1]
    finally:
        await second.close()


async def test_a_worker_killed_during_a_step_loses_no_prompt_and_comes_back_with_the_current_weights(pool):
    pool, config, parts = pool
    expected = await pool.digests()
    victim = pool.pids()[0]
    step = asyncio.ensure_future(pool.rollout([2, 3, 4, 5, 6, 7], seed=3))
    await asyncio.sleep(0.3)  # both workers are inside their prompts (each takes >= 0.8 s: 4 rounds of 0.2 s turns)
    assert not step.done()
    os.kill(victim, signal.SIGKILL)
    prompts = await step
    assert [p.key for p in prompts] == [2, 3, 4, 5, 6, 7]
    assert all(len(prompt.leaves) == 4 and not prompt.error for prompt in prompts)
    metrics = pool.metrics()
    assert metrics["cluster/worker_failures"] == 1.0 and metrics["cluster/prompts_rerun"] >= 1.0
    assert any("rollout worker" in note and "died" in note for note in pool.notes)
    for _ in range(120):  # Ray restarts the worker; it reloads the last sync's weights
        if all(worker.live for worker in pool.workers):
            break
        await asyncio.sleep(0.5)
    assert all(worker.live for worker in pool.workers), pool.notes
    assert victim not in pool.pids()
    assert await pool.digests() == expected


async def test_a_worker_restarted_between_two_calls_is_noticed_and_reloads_the_current_weights(pool, ray_local):
    # The other worker this time (max_restarts=1 each): killed while idle, Ray restarts it before the
    # pool's next call, which then reaches a fresh process holding the model's first weights.
    pool, config, parts = pool
    model = load_model(config.model)  # weights other than the model's first, whatever ran before this test
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.02)
    await pool.update_weights(model.state_dict())
    expected = await pool.digests()
    handle = pool.workers[1].handle
    victim = ray_local.get(handle.ready.remote())["pid"]
    os.kill(victim, signal.SIGKILL)
    for _ in range(240):
        try:
            if ray_local.get(handle.ready.remote(), timeout=5)["pid"] != victim:
                break
        except ray_local.exceptions.RayError:
            pass  # dead or restarting
        await asyncio.sleep(0.5)
    assert ray_local.get(handle.digest.remote()) != expected[1]  # the restarted process's first weights
    prompts = await pool.rollout([2, 3, 4, 5], seed=3)
    assert all(len(prompt.leaves) == 4 and not prompt.error for prompt in prompts)
    metrics = pool.metrics()
    assert metrics["cluster/worker_failures"] == 1.0 and metrics["cluster/prompts_rerun"] >= 1.0
    assert any("rollout worker 1 was restarted since its last call" in note for note in pool.notes), pool.notes
    for _ in range(120):
        if all(worker.live for worker in pool.workers):
            break
        await asyncio.sleep(0.5)
    assert await pool.digests() == expected


@pytest.mark.slow
async def test_train_on_rollout_workers_writes_the_run_folder_and_resumes_exactly(ray_local, tiny_model, tmp_path):
    config = letters_config(tiny_model, cluster={"rollout_workers": 2}, steps=3, checkpoint_every=2)
    notes: list[str] = []
    result = await train(config, tmp_path / "run", progress=False, log=notes.append)
    assert result.steps == 3
    records = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["batch/sequences"] == 16 and r["cluster/worker_failures"] == 0 for r in records)
    saved = json.loads((tmp_path / "run" / "config.json").read_text())
    assert saved["cluster"]["rollout_workers"] == 2 and saved["cluster"]["trainer_ranks"] == 1
    assert [h.step for h in result.heldout] == [0, 3]

    # One process on the same config: the same trees, so the same rewards (the trainer is the same code).
    single = await train(dataclasses.replace(config, cluster={}), tmp_path / "single", progress=False, log=notes.append)
    for spread, alone in zip(result.history, single.history):
        assert spread["reward/mean"] == alone["reward/mean"]
        assert spread["policy/loss"] == pytest.approx(alone["policy/loss"], rel=1e-5, abs=1e-7)

    # Cut the run back to its step-2 checkpoint and resume: step 3 repeats.
    import shutil

    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_000003")
    resumed = await train(config, tmp_path / "run", resume=True, progress=False, log=notes.append)
    again = read_jsonl(tmp_path / "run" / "metrics.jsonl")
    assert resumed.steps == 3 and [r["step"] for r in again] == [1, 2, 3]
    assert again[2]["reward/mean"] == records[2]["reward/mean"]
    assert again[2]["policy/loss"] == pytest.approx(records[2]["policy/loss"], rel=1e-5, abs=1e-7)


@pytest.mark.slow
async def test_train_with_two_trainer_ranks_and_two_rollout_workers_matches_one_process(
    ray_local, tiny_model, tmp_path
):
    config = letters_config(tiny_model, cluster={"rollout_workers": 2, "trainer_ranks": 2}, steps=2)
    result = await train(config, tmp_path / "run", progress=False, log=lambda note: None)
    single = await train(dataclasses.replace(config, cluster={}), tmp_path / "single", progress=False, log=print)
    assert [r["step"] for r in result.history] == [1, 2]
    for spread, alone in zip(result.history, single.history):
        assert spread["reward/mean"] == alone["reward/mean"]  # the synced weights sample the same trees
        assert spread["policy/loss"] == pytest.approx(alone["policy/loss"], rel=1e-5, abs=1e-7)
        assert spread["optim/grad_norm"] == pytest.approx(alone["optim/grad_norm"], rel=1e-4)
    assert result.history[1]["sync/bytes"] > 0 and result.history[1]["sync/buckets"] >= 1
    final = tmp_path / "run" / "checkpoints" / "step_000002"
    assert (final / "model" / "config.json").is_file() and (final / "sharded").is_dir()
    # The run folder of one process, and where Ray put each rank and worker.
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == sorted(
        [p.name for p in (tmp_path / "single").iterdir()] + ["placement.json"]
    )
