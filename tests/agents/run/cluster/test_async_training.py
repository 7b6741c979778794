"""Asynchronous training (``max_staleness`` = η): the version gate, the pipeline's bound on staleness, its metrics.

The gate and the pipeline's bookkeeping are tested without Ray, on scripted engines and hand-made
trees; the runs use one rollout worker on the tiny model of tests/conftest.py, with one request
at a time on its engine and no prefix cache, so that a tree's numbers do not depend on how
requests happen to batch (what makes η = 0 comparable bit for bit).
"""

import asyncio
import math
import shutil
import time

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import agentenv
import agents.progress
from agents.engines.base import Completion, Engine, SamplingParams
from agents.engines.scripted import ScriptedEngine
from agents.rollout.strategies import PromptTrees
from agents.rollout.tree import RolloutTree
from agents.run import steps as steps_module
from agents.run.cluster.rollout_workers import REQUEST_PRIORITY, RolloutPool, RolloutWorker, VersionGate, WorkerSpec
from agents.run.config import TrainConfig, build, merge
from agents.run.steps import PipelinedSteps, SynchronousSteps
from agents.run.task_order import TaskOrder
from agents.run.train import train
from agents.training.metrics import read_jsonl
from agents.training.trainer import TrainerConfig

# -- the gate -----------------------------------------------------------------------------------


class HeldEngine(Engine):
    """Each generate waits for ``release``; update_weights fails if a generation is in flight."""

    def __init__(self) -> None:
        self.active, self.weights, self.seen = 0, 0, []
        self.release = asyncio.Event()

    async def generate(self, prompt_ids, params):
        self.active += 1
        self.seen.append(self.weights)
        try:
            await self.release.wait()
        finally:
            self.active -= 1
        return Completion([1], [-0.5], "length")

    async def update_weights(self, state_dict):
        assert self.active == 0, "weights loaded while a request was in flight"
        await asyncio.sleep(0.01)
        assert self.active == 0, "a request started while the weights were loading"
        self.weights = state_dict["v"]


async def ticks(n: int = 5) -> None:
    for _ in range(n):
        await asyncio.sleep(0)


async def test_the_gate_loads_weights_only_between_requests_and_stamps_each_completion_with_its_version():
    engine = HeldEngine()
    gate = VersionGate(engine)
    params = SamplingParams(max_new_tokens=1)
    first = [asyncio.create_task(gate.generate([1], params)) for _ in range(2)]
    await ticks()
    assert gate.in_flight == 2
    update = asyncio.create_task(gate.update_weights({"v": 7}))
    await ticks()
    assert not update.done() and engine.weights == 0  # waits for the two in flight
    late = asyncio.create_task(gate.generate([1], params))
    await ticks()
    assert engine.active == 2 and gate.in_flight == 2  # the new request waits for the update
    engine.release.set()
    stamped = [(await task).version for task in first]
    await update
    completion = await late
    assert stamped == [0, 0] and completion.version == 1 and gate.version == 1
    assert engine.seen == [0, 0, 7]  # each request ran on the weights its stamp names
    async with gate.updating(version=5):  # the workers' load_buckets: the pool's version
        pass
    assert (await gate.generate([1], params)).version == 5


async def test_an_update_cancelled_while_it_waits_lets_requests_through_again():
    engine = HeldEngine()
    gate = VersionGate(engine)
    params = SamplingParams(max_new_tokens=1)
    held = asyncio.create_task(gate.generate([1], params))
    await ticks()
    update = asyncio.create_task(gate.update_weights({"v": 1}))
    await ticks()
    update.cancel()
    await asyncio.gather(update, return_exceptions=True)
    engine.release.set()
    assert (await gate.generate([1], params)).version == 0
    assert (await held).version == 0 and gate.version == 0


class InFlightEngine(Engine):
    """Samples two tokens, the first under the weights of when the request came, the second of when it is released."""

    supports_inflight_updates = True

    def __init__(self) -> None:
        self.version: int | None = None  # None until the first load in flight
        self.release, self.loaded = asyncio.Event(), []

    async def generate(self, prompt_ids, params):
        first = self.version
        await self.release.wait()
        return Completion([1, 2], [-0.5, -0.5], "length", token_versions=[first, self.version])

    async def update_weights_in_flight(self, state_dict, version):
        self.loaded.append(state_dict["v"])
        self.version = version


async def test_a_load_in_flight_waits_for_nothing_and_each_token_keeps_the_version_that_sampled_it():
    engine = InFlightEngine()
    gate = VersionGate(engine, version=3, inflight_updates=True)
    params = SamplingParams(max_new_tokens=2)
    first = [asyncio.create_task(gate.generate([1], params)) for _ in range(2)]
    await ticks()
    await gate.load_in_flight({"v": 7}, version=4)  # returns with both still in flight
    assert gate.version == 4 and gate.in_flight == 2 and engine.loaded == [7]
    late = asyncio.create_task(gate.generate([1], params))
    await ticks()
    assert gate.in_flight == 3  # a new request does not wait for anything either
    engine.release.set()
    done = [await task for task in first]
    # the first token came before the engine's first load (None): the version the worker started with
    assert [(c.token_versions, c.version) for c in done] == [([3, 4], 3), ([3, 4], 3)]
    assert ((await late).token_versions, (await late).version) == ([4, 4], 4)
    await gate.update_weights({"v": 8})  # the engine contract's update: in flight too, as the next version
    assert gate.version == 5 and engine.loaded == [7, 8] and gate.in_flight == 0
    assert gate.clock.count == 0 and gate.clock.since is None and gate.clock.seconds > 0


async def test_an_engine_that_cannot_load_in_flight_is_refused_and_a_gate_counts_its_busy_seconds():
    with pytest.raises(ValueError) as error:
        VersionGate(HeldEngine(), inflight_updates=True)
    assert str(error.value) == (
        "cluster.in_flight_updates=true needs an engine that loads weights while requests are in flight, and "
        "HeldEngine cannot (supports_inflight_updates is False): use HFEngine workers (cluster.worker_engine=hf) "
        "or cluster.in_flight_updates=false"
    )
    with pytest.raises(TypeError, match="HeldEngine cannot change its weights while requests are in flight"):
        await HeldEngine().update_weights_in_flight({}, 1)
    engine = HeldEngine()
    gate = VersionGate(engine)
    held = asyncio.create_task(gate.generate([1], SamplingParams(max_new_tokens=1)))
    await asyncio.sleep(0.05)
    now = time.perf_counter()
    assert gate.clock.count == 1 and 0.05 <= gate.clock.busy(now) < 1.0 and gate.clock.seconds == 0.0
    engine.release.set()
    await held
    assert gate.clock.count == 0 and 0.05 <= gate.clock.seconds < 1.0
    assert gate.clock.busy(time.perf_counter() + 10) == gate.clock.seconds  # idle time is not busy


# -- the configuration ----------------------------------------------------------------------------


class QueueEngine(Engine):
    """Records the order in which requests enter (by their first prompt id); each ends when the test lets one."""

    def __init__(self) -> None:
        self.entered: list[int] = []
        self.finish = asyncio.Semaphore(0)

    async def generate(self, prompt_ids, params):
        self.entered.append(prompt_ids[0])
        await self.finish.acquire()
        return Completion([1], [-0.5], "length")

    async def update_weights(self, state_dict):
        self.entered.append(-state_dict["v"])


async def ask(gate: VersionGate, marker: int, priority: int) -> Completion:
    REQUEST_PRIORITY.set(priority)  # this task's own context, as a worker's rollout sets it
    return await gate.generate([marker], SamplingParams())


async def test_a_full_engine_serves_the_requests_of_the_oldest_step_first_then_in_arrival_order():
    engine = QueueEngine()
    gate = VersionGate(engine, capacity=2)
    asks = [(1, 5), (2, 5), (3, 5), (4, 4), (5, 6), (6, 4), (7, 3)]
    tasks = [asyncio.ensure_future(ask(gate, marker, priority)) for marker, priority in asks]
    await ticks()
    assert engine.entered == [1, 2] and gate.in_flight == 2  # the engine's batch is full: the rest wait
    tasks[-1].cancel()  # marker 7 (priority 3) gives up while it waits
    for _ in range(5):
        engine.finish.release()
        await ticks()
    assert engine.entered == [1, 2, 4, 6, 3, 5] and gate.in_flight == 1
    # A load between requests waits for the engine to empty; the requests that come meanwhile wait for it.
    update = asyncio.ensure_future(gate.update_weights({"v": 1}))
    late = asyncio.ensure_future(ask(gate, 8, 0))
    await ticks()
    assert engine.entered[-1] == 5
    engine.finish.release()
    await ticks()
    assert engine.entered[-2:] == [-1, 8] and gate.version == 1
    engine.finish.release()
    await asyncio.gather(update, late, *tasks[:-1])
    assert tasks[-1].cancelled() and gate.in_flight == 0 and not gate._waiting
    with pytest.raises(ValueError, match=r"capacity must be >= 1 \(or None: no limit\), got 0"):
        VersionGate(engine, capacity=0)


async def test_without_a_capacity_every_request_goes_into_the_engine_at_once():
    engine = QueueEngine()
    gate = VersionGate(engine)
    tasks = [asyncio.ensure_future(ask(gate, marker, priority)) for marker, priority in [(1, 5), (2, 4), (3, 3)]]
    await ticks()
    assert engine.entered == [1, 2, 3] and gate.in_flight == 3
    for _ in tasks:
        engine.finish.release()
    await asyncio.gather(*tasks)


def test_max_staleness_is_an_int_at_least_0_and_needs_rollout_workers():
    for bad in (-1, 1.5, True, "1"):
        with pytest.raises(ValueError, match="max_staleness must be an int >= 0"):
            TrainConfig(max_staleness=bad)
    with pytest.raises(ValueError) as error:
        build(TrainConfig(max_staleness=1))
    assert str(error.value) == (
        "max_staleness=1 rolls out while the trainer updates, which needs rollout workers of their own: "
        "--rollout-workers 1 (or more), or max_staleness=0"
    )
    assert "\n" not in str(error.value)


def test_in_flight_updates_are_a_bool_for_hfengine_rollout_workers():
    workers = {"rollout_workers": 1, "in_flight_updates": True}
    assert build(TrainConfig(max_staleness=1, cluster=workers)).cluster.in_flight_updates is True
    assert build(TrainConfig()).cluster.in_flight_updates is False
    with pytest.raises(ValueError, match="cluster.in_flight_updates must be true or false, got 'yes'"):
        build(TrainConfig(cluster={"rollout_workers": 1, "in_flight_updates": "yes"}))
    with pytest.raises(ValueError, match="it needs cluster.rollout_workers >= 1"):
        build(TrainConfig(cluster={"in_flight_updates": True}))
    with pytest.raises(ValueError) as error:
        build(TrainConfig(cluster={**workers, "worker_engine": "vllm"}))
    assert str(error.value) == (
        "cluster.in_flight_updates=true needs HFEngine workers, which record the weights that sampled each token; "
        "the workers' engine is 'vllm' (vLLM's engines do not say): cluster.worker_engine=hf, or "
        "cluster.in_flight_updates=false"
    )


def test_the_decoupled_objective_is_on_at_max_staleness_1_unless_the_run_says_otherwise():
    workers = {"cluster": {"rollout_workers": 1}}
    assert build(TrainConfig(**workers)).trainer.decoupled is False
    assert build(TrainConfig(max_staleness=1, **workers)).trainer.decoupled is True
    off = TrainConfig(max_staleness=1, trainer={"decoupled": False, "old_logprobs": "sampler"}, **workers)
    assert build(off).trainer.decoupled is False
    with pytest.raises(ValueError, match=r"--set trainer.old_logprobs=recompute \(or --set trainer.decoupled=false"):
        build(TrainConfig(max_staleness=2, trainer={"old_logprobs": "sampler"}, **workers))


# -- the pipeline's bookkeeping, on hand-made trees ---------------------------------------------


def prompt_with_versions(index: int, versions: list[int]) -> PromptTrees:
    """A prompt whose tree has one two-turn leaf per version pair: a shared first turn at ``versions[0]``."""
    tree = RolloutTree([1, 2])
    first = tree.add_turn(tree.root, action_ids=[3, 4], sampler_logprobs=[-0.5, -0.5], version=versions[0])
    for number, version in enumerate(versions[1:]):
        tree.add_turn(
            first,
            obs_ids=[5],
            action_ids=[6],
            sampler_logprobs=[-0.5],
            terminal=True,
            reward=float(number),
            version=version,
        )
    return PromptTrees(index=index, key=index, trees=[tree], rng=np.random.default_rng(0))


def test_a_turns_version_is_saved_and_loaded_with_its_tree(tmp_path):
    prompt = prompt_with_versions(0, [3, 4, 5])
    prompt.trees[0].save(tmp_path / "tree.json")
    loaded = RolloutTree.load(tmp_path / "tree.json")
    assert [node.version for node in loaded.nodes()] == [3, 4, 5] and loaded.root.version is None
    legacy = loaded.to_dict()
    for record in legacy["nodes"]:
        del record["version"]  # a tree saved before versions were recorded
    assert {node.version for node in RolloutTree.from_dict(legacy).nodes()} == {None}
    with pytest.raises(ValueError, match="version must be a non-negative int or None"):
        loaded.add_turn(loaded.root, action_ids=[1], sampler_logprobs=[-1.0], version=-1)


def test_a_turns_token_versions_are_saved_and_its_version_is_the_oldest(tmp_path):
    tree = RolloutTree([1, 2])
    mixed = tree.add_turn(tree.root, action_ids=[3, 4, 5], sampler_logprobs=[-0.5] * 3, token_versions=[2, 2, 3])
    assert mixed.version == 2 and mixed.token_versions == [2, 2, 3]
    plain = tree.add_turn(
        mixed, obs_ids=[6], action_ids=[7], sampler_logprobs=[-0.5], version=3, terminal=True, reward=1.0
    )
    tree.save(tmp_path / "tree.json")
    loaded = RolloutTree.load(tmp_path / "tree.json")
    assert [(n.version, n.token_versions) for n in loaded.nodes()] == [(2, [2, 2, 3]), (3, None)]
    assert plain.token_versions is None
    with pytest.raises(ValueError, match=r"one version \(an int\) per action token: 3 tokens, got \[2, 3\]"):
        tree.add_turn(tree.root, action_ids=[3, 4, 5], sampler_logprobs=[-0.5] * 3, token_versions=[2, 3])
    with pytest.raises(ValueError, match=r"version 3 is not the oldest of token_versions \(2\)"):
        tree.add_turn(tree.root, action_ids=[3, 4], sampler_logprobs=[-0.5] * 2, version=3, token_versions=[2, 3])
    with pytest.raises(ValueError, match=r"token_versions\[1\] must be a non-negative int or None, got -1"):
        tree.add_turn(tree.root, action_ids=[3, 4], sampler_logprobs=[-0.5] * 2, token_versions=[2, -1])


def test_tokens_are_counted_by_their_own_versions():
    tree = RolloutTree([1, 2])
    first = tree.add_turn(tree.root, action_ids=[3, 4, 5], sampler_logprobs=[-0.5] * 3, token_versions=[2, 3, 4])
    tree.add_turn(
        first, obs_ids=[6], action_ids=[7, 8], sampler_logprobs=[-0.5] * 2, version=4, terminal=True, reward=1.0
    )
    prompt = PromptTrees(index=0, key=0, trees=[tree], rng=np.random.default_rng(0))
    metrics = steps_module._staleness_metrics([prompt], [2], version=4, eta=2)
    assert [metrics[f"async/tokens_stale_{k}"] for k in range(3)] == [3.0, 1.0, 1.0]
    assert metrics["async/staleness_2"] == 1.0 and metrics["async/staleness_max"] == 2.0


class FakePool:
    """A pool whose rollouts are given prompts, and whose version the test sets."""

    def __init__(self, batches: dict[int, list[PromptTrees]]) -> None:
        self.batches, self.version, self.failures, self.reruns, self.sent = batches, 0, 0, 0, []
        self.priorities: list[int] = []

    async def rollout(self, tasks, seed, on_branches=None, *, priority=0, on_prompt=None):
        self.sent.append(tuple(tasks))
        self.priorities.append(priority)
        step = len(self.sent)
        prompts = self.batches[step]
        for index, prompt in enumerate(prompts):
            await self.back(step, index)
            on_branches(len(prompt.leaves))
            if on_prompt is not None:
                on_prompt(index, prompt)
        return prompts

    async def back(self, step: int, index: int) -> None:
        """When prompt ``index`` of step ``step`` comes back: at once."""

    def idle_seconds(self) -> float:
        return 0.0

    async def engine_idle_seconds(self) -> float:
        return 0.0

    def metrics(self) -> dict[str, float]:
        return {}


async def test_the_pipeline_sends_eta_steps_ahead_and_drops_a_tree_older_than_eta_versions(capsys, monkeypatch):
    # The rollout bars are transient (shown on a log stream only past LINE_INTERVAL): show each one's end line.
    monkeypatch.setattr(agents.progress, "LINE_INTERVAL", 0.0)
    config = TrainConfig(algo="grpo", steps=3, prompts_per_step=2, holdout=0, eval_questions=0, max_staleness=1)
    config.cluster = {"rollout_workers": 1}
    parts = build(config)
    pool = FakePool(
        {
            1: [prompt_with_versions(0, [0, 0, 0]), prompt_with_versions(1, [0, 0, 0])],
            2: [prompt_with_versions(0, [0, 1, 1]), prompt_with_versions(1, [1, 1, 1])],
            # Step 3 is trained at version 2: a first turn sampled at version 0 is 2 behind (dropped).
            3: [prompt_with_versions(0, [0, 2, 2]), prompt_with_versions(1, [1, 2, 2])],
        }
    )
    order = TaskOrder(None, holdout=0, seed=0)
    steps = PipelinedSteps(config, parts, pool, order, None, ahead=1)
    paths, metrics, position = await steps.batch(1)
    assert pool.sent == [(0, 1), (2, 3)]  # steps 1 and 2 go at once: step 2 is at most 1 version behind
    assert position == {"epoch": 0, "offset": 2} and len(paths) == 4
    assert metrics["async/staleness_0"] == 2 and metrics["async/trees_dropped"] == 0
    steps.trained(1)
    pool.version = 1
    await ticks()
    assert pool.sent[-1] == (4, 5)  # the trainer holds step 1's weights: step 3 may go
    paths, metrics, position = await steps.batch(2)
    assert position == {"epoch": 0, "offset": 4}
    assert (metrics["async/staleness_0"], metrics["async/staleness_1"], metrics["async/staleness_max"]) == (1, 1, 1)
    assert metrics["async/staleness_mean"] == 0.5
    # Tokens by versions behind: prompt 0's first turn (2 tokens) at version 0; the rest at 1.
    assert (metrics["async/tokens_stale_0"], metrics["async/tokens_stale_1"]) == (6, 2)
    steps.trained(2)
    pool.version = 2
    paths, metrics, _ = await steps.batch(3)
    assert metrics["async/trees_dropped"] == 1 and metrics["async/staleness_1"] == 1
    assert {path.leaf.version for path in paths} == {2} and len(paths) == 2  # prompt 1's leaves only
    assert metrics["async/version"] == 2 and len(pool.sent) == 3
    assert pool.priorities == [1, 2, 3]  # each step's requests carry its number: older steps go first
    await steps.close()
    # Each step's bar (GRPO: 16 a prompt planned) counts the leaves back before the trainer waited (step 2's came with 1's).
    ends = [line for line in capsys.readouterr().err.splitlines() if " in 00:" in line]
    assert [line.split(" in ")[0] for line in ends] == [f"rollout step {s}: 4/32 leaves" for s in (1, 2, 3)]


class HeldPool(FakePool):
    """A FakePool whose prompts come back when the test releases them."""

    def __init__(self, batches: dict[int, list[PromptTrees]]) -> None:
        super().__init__(batches)
        self.released = {(step, i): asyncio.Event() for step, prompts in batches.items() for i in range(len(prompts))}

    async def back(self, step: int, index: int) -> None:
        await self.released[step, index].wait()


async def test_streamed_steps_hand_each_prompts_paths_to_the_trainer_as_they_come_back():
    config = TrainConfig(algo="grpo", steps=2, prompts_per_step=3, holdout=0, eval_questions=0, max_staleness=1)
    config.cluster = {"rollout_workers": 1}
    parts = build(config)
    pool = HeldPool(
        {
            1: [prompt_with_versions(i, [0, 0, 0]) for i in range(3)],
            # Step 2 is trained at version 1: prompt 1's first turn, at version 0, is one behind (kept).
            2: [
                prompt_with_versions(0, [1, 1, 1]),
                prompt_with_versions(1, [0, 1, 1]),
                prompt_with_versions(2, [1] * 4),
            ],
        }
    )
    handed: list[list[float]] = []  # the rewards of each part the trainer got

    async def accumulate(paths):
        handed.append([path.reward for path in paths])
        await asyncio.sleep(0.05)  # the trainer's passes take a while: trees come back meanwhile

    steps = PipelinedSteps(
        config, parts, pool, TaskOrder(None, holdout=0, seed=0), None, ahead=1, accumulate=accumulate
    )
    first = asyncio.ensure_future(steps.batch(1))
    pool.released[1, 0].set()
    await ticks()
    assert handed == [[0.0, 1.0]] and not first.done()  # prompt 0's two leaves, before prompts 1 and 2
    pool.released[1, 1].set()
    pool.released[1, 2].set()  # both back while the trainer runs prompt 0's passes: one part
    paths, metrics, position = await first
    assert paths == [] and handed == [[0.0, 1.0], [0.0, 1.0, 0.0, 1.0]]
    assert metrics["async/paths_streamed_frac"] == pytest.approx(2 / 6)  # prompt 0's, before the last were back
    assert metrics["async/staleness_0"] == 3 and metrics["rollout/prompts_without_leaves"] == 0
    assert 0.0 <= metrics["time/trainer_idle_s"] < metrics["time/cycle_s"]
    steps.trained(1)
    pool.version = 1
    for i in range(3):
        pool.released[2, i].set()
    paths, metrics, _ = await steps.batch(2)
    # every prompt came back before the trainer looked: one part, nothing streamed early
    assert paths == [] and handed[2:] == [[0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 2.0]]
    assert metrics["async/paths_streamed_frac"] == 0.0 and metrics["async/trees_dropped"] == 0
    assert metrics["async/staleness_1"] == 1
    await steps.close()


def test_streaming_is_the_runs_at_max_staleness_1_with_one_update_a_step():
    class Trainer:
        def __init__(self, mini_batches, epochs):
            self.config = TrainerConfig(mini_batches=mini_batches, epochs=epochs)

        async def accumulate(self, paths):
            pass

    one = Trainer(1, 1)
    assert steps_module.streamed_update(TrainConfig(max_staleness=1), one) == one.accumulate
    assert steps_module.streamed_update(TrainConfig(max_staleness=0), one) is None  # η = 0 stays the synchronous run
    assert steps_module.streamed_update(TrainConfig(max_staleness=1, stream_update=False), one) is None
    assert steps_module.streamed_update(TrainConfig(max_staleness=1), Trainer(2, 1)) is None
    assert steps_module.streamed_update(TrainConfig(max_staleness=1), Trainer(1, 2)) is None
    with pytest.raises(ValueError, match="stream_update must be true or false, got 'yes'"):
        TrainConfig(stream_update="yes")


# -- runs on a rollout worker ---------------------------------------------------------------------


class Letters(agentenv.Env):
    """Two turns; the reward is the fraction of characters in a-z."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.said = []
        return "Write letters.", {}

    def step(self, action):
        self.said.append(action)
        text = "".join(self.said)
        done = len(self.said) == 2
        return "next", sum("a" <= ch <= "z" for ch in text) / max(1, len(text)) if done else 0.0, done, False, {}


@pytest.fixture(scope="module", autouse=True)
def letters(module_envs):
    module_envs("async-tests/letters-v0", Letters)


def run_config(model: str, **changes) -> TrainConfig:
    """AT²PO on letters, 3 prompts × (2 + 1·2) leaves a step, on one worker whose engine runs one request at a time."""
    values = merge(
        TrainConfig(algo="at2po").to_dict(),
        {
            "env": "async-tests/letters",
            "model": model,
            "steps": 3,
            "prompts_per_step": 3,
            "holdout": 1,
            "eval_questions": 0,
            "checkpoint_every": 3,
            "strategy": {"M": 2, "L": 1, "K": 2},
            "trainer": {"lr": 3e-2, "mini_batches": 1, "micro_batch_size": 16, "report_to": ["none"]},
            "sampling": {"max_new_tokens": 6},
            "rollout": {"max_response_tokens": 24},
            "engine_kwargs": {"max_batch_size": 1, "prefix_cache_tokens": 0},
            "cluster": {"rollout_workers": 1},
        },
    )
    return TrainConfig.from_dict(merge(values, changes))


class PriorityRecorder(ScriptedEngine):
    """Says "ab" every turn and records the priority each request carries; its batch holds 2."""

    max_batch_size = 2

    def __init__(self) -> None:
        super().__init__(lambda ids: [97, 98])
        self.priorities: list[int] = []

    async def generate(self, prompt_ids, params):
        self.priorities.append(REQUEST_PRIORITY.get())
        return await super().generate(prompt_ids, params)


async def test_a_workers_rollout_gives_its_requests_its_priority_behind_a_gate_as_large_as_the_engines_batch(
    tiny_model,
):
    config = run_config(tiny_model)
    parts = build(config)
    spec = WorkerSpec(config, agentenv.spec(config.env), parts.learner.strategy, parts.tree, engine=PriorityRecorder)
    threads = torch.get_num_threads()
    try:
        worker = RolloutWorker(spec, rank=0)  # in this process: it sets this process's torch threads to its share
    finally:
        torch.set_num_threads(threads)  # later tests, in any order, compute with the threads they started with
    assert worker.engine.capacity == 2
    prompt = await worker.rollout(0, task=5, seed=1, priority=7)
    recorder = worker.engine.engine
    assert len(recorder.priorities) == len(prompt.leaves) == 4  # one request a leaf here
    assert set(recorder.priorities) == {7} and REQUEST_PRIORITY.get() == 0  # the caller's context is untouched


def capture_trees(monkeypatch) -> list[list[PromptTrees]]:
    """The trees each step trains on, as the pipeline hands them to credit assignment."""
    seen: list[list[PromptTrees]] = []
    record = steps_module._rollout_record

    def spy(rollout, tasks, prompts, seconds, paths):
        seen.append(prompts)
        return record(rollout, tasks, prompts, seconds, paths)

    monkeypatch.setattr(steps_module, "_rollout_record", spy)
    return seen


def final_weights(run) -> dict[str, torch.Tensor]:
    return load_file(run / "checkpoints" / "step_000003" / "model" / "model.safetensors")


def versions(prompt: PromptTrees) -> set[int]:
    return {node.version for tree in prompt.trees for node in tree.nodes()}


@pytest.mark.slow
async def test_max_staleness_0_through_the_pipeline_is_the_synchronous_run_bit_for_bit(
    ray_local, tiny_model, tmp_path, monkeypatch
):
    config = run_config(tiny_model)
    with monkeypatch.context() as patch:  # the steps a run without rollout workers takes
        patch.setattr(
            RolloutPool,
            "steps",
            lambda pool, config, parts, order, progress, trainer: SynchronousSteps(
                config, parts, pool, order, progress
            ),
        )
        synchronous = await train(config, tmp_path / "sync", progress=False, log=lambda note: None)
    assert "async/version" not in synchronous.history[0]
    seen = capture_trees(monkeypatch)
    pipelined = await train(config, tmp_path / "pipeline", progress=False, log=lambda note: None)
    assert len(synchronous.history) == len(pipelined.history) == 3
    for step, (alone, piped) in enumerate(zip(synchronous.history, pipelined.history), start=1):
        for name, value in alone.items():
            if not name.startswith(("time/", "throughput/", "sync/")) and not name.endswith("_s"):  # timings
                assert piped[name] == value or (math.isnan(value) and math.isnan(piped[name])), name
        assert piped["async/staleness_0"] == 3 and piped["async/trees_dropped"] == 0
        assert piped["async/version"] == step - 1
    # Every turn of step s was sampled by the weights after step s − 1 (the worker's s − 1th sync).
    assert [set().union(*map(versions, prompts)) for prompts in seen] == [{0}, {1}, {2}]
    one, other = final_weights(tmp_path / "sync"), final_weights(tmp_path / "pipeline")
    assert one.keys() == other.keys() and all(torch.equal(one[name], other[name]) for name in one)
    assert read_jsonl(tmp_path / "sync" / "metrics.jsonl")[2]["policy/loss"] == synchronous.history[2]["policy/loss"]


@pytest.mark.slow
@pytest.mark.parametrize("in_flight", [False, True], ids=["between-requests", "in-flight"])
async def test_max_staleness_1_trains_every_step_on_trees_at_most_one_version_old(
    ray_local, tiny_model, tmp_path, monkeypatch, in_flight
):
    seen = capture_trees(monkeypatch)
    config = run_config(tiny_model, max_staleness=1, steps=3, cluster={"in_flight_updates": in_flight})
    result = await train(config, tmp_path / "run", progress=False, log=lambda note: None)
    records = result.history
    assert [r["step"] for r in records] == [1, 2, 3] and result.config.trainer["decoupled"] is True
    for step, (record, prompts) in enumerate(zip(records, seen), start=1):
        trained = step - 1  # the trainer's version: one sync a step
        assert record["async/version"] == trained and record["async/trees_dropped"] == 0
        assert record["async/staleness_0"] + record["async/staleness_1"] == 3
        assert record["async/staleness_max"] <= 1
        for prompt in prompts:
            assert versions(prompt) <= {trained - 1, trained}
            for node in (node for tree in prompt.trees for node in tree.nodes() if node.token_versions):
                assert node.version == min(node.token_versions) < max(node.token_versions) <= trained
                assert len(node.token_versions) == len(node.action_ids)
        tokens = sum(len(node.action_ids) for prompt in prompts for tree in prompt.trees for node in tree.nodes())
        assert record["async/tokens_stale_0"] + record["async/tokens_stale_1"] == tokens == record["tokens/generated"]
        assert record["time/trainer_idle_s"] >= 0 and record["time/engine_idle_s"] >= 0
        assert record["time/worker_idle_s"] >= 0
        assert record["time/cycle_s"] >= record["time/trainer_idle_s"]
        assert 0.0 <= record["async/paths_streamed_frac"] <= 1.0  # one update a step: each prompt's trees streamed
    # Step 2 went to the worker with step 1, before the first update; its requests wait for step 1's
    # (one at a time on this engine, the older step's first), and those that ran before the sync are version 0.
    assert records[1]["async/staleness_1"] >= 1 and any(0 in versions(p) for p in seen[1])
    assert (tmp_path / "run" / "checkpoints" / "step_000003" / "model").is_dir()


@pytest.mark.slow
async def test_an_asynchronous_run_resumes_at_its_checkpoint_with_the_next_steps_tasks_and_versions(
    ray_local, tiny_model, tmp_path, monkeypatch
):
    trained_tasks: list[list[int]] = []
    record = steps_module._rollout_record

    def spy(rollout, tasks, prompts, seconds, paths):
        trained_tasks.append(list(tasks))
        return record(rollout, tasks, prompts, seconds, paths)

    monkeypatch.setattr(steps_module, "_rollout_record", spy)
    config = run_config(tiny_model, max_staleness=1, checkpoint_every=1)
    first = await train(config, tmp_path / "run", progress=False, log=lambda note: None)
    shutil.rmtree(tmp_path / "run" / "checkpoints" / "step_000003")  # as if stopped after step 2's checkpoint
    again = await train(config, tmp_path / "run", resume=True, progress=False, log=lambda note: None)
    assert trained_tasks[3] == trained_tasks[2]  # step 3's tasks again (step 4's, rolled out ahead, were not kept)
    assert [record["step"] for record in again.history] == [1, 2, 3]
    # Versions go on from the checkpoint: step 3 trains at version 2, as in the first run.
    assert again.history[2]["async/version"] == first.history[2]["async/version"] == 2
    assert again.history[2]["async/staleness_0"] == 3  # nothing older than the resumed weights
