"""Rollout workers: Ray actors that each own an engine and the environments of the prompts they run.

A prompt's whole tree grows on one worker, so every ``fork()`` stays in that process; what
comes back is the finished :class:`~agents.rollout.strategies.PromptTrees` with token ids,
log-probs, entropies, rewards and tree structure, never a live environment. The driver's
:class:`RolloutPool` gives each prompt to the worker with the fewest prompts in flight; a
worker whose process dies loses nothing: its unfinished prompts go to the other workers, Ray
restarts it (``cluster.worker_restarts``), and it takes work again once it holds the current
weights. Every prompt keeps its position in the batch, from which its seeds derive, so the
trees do not depend on which worker grew them.

Environments are built on the worker by ``agentenv.make`` from the driver's registry entry
(:class:`agentenv.EnvSpec`), so an environment the user registered in the driver works there:
an entry point given as a class or factory travels by value (with the module that defines it),
one given as ``"module:attr"`` must be importable on the workers (an installed package, or on
``PYTHONPATH``). The same holds for a user's own strategy. What the plug-in imports itself must
be installed on every node.

Weights change between requests: each worker's engine sits behind a :class:`VersionGate`, which
lets a weight load start only once no generation is in flight (new ones wait meanwhile) and
stamps every completion with the version of the weights that sampled it, so that every turn of a
tree records its tokens' version (:attr:`agents.rollout.tree.Node.version`). Versions count the
syncs (0: the weights a worker started with; a resumed run goes on from its step). With
``cluster.in_flight_updates`` (HFEngine workers), a load instead lands between two decode steps
while requests go on, and each token records the version that sampled it
(:attr:`~agents.rollout.tree.Node.token_versions`).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import dataclasses
import heapq
import itertools
import os
import sys
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import agentenv
from agentenv.registration import EnvSpec
from agentenv.wrappers import TokenEnv
from agents.engines.base import Completion, Engine, SamplingParams
from agents.eval.heldout import HeldOut, evaluate_heldout
from agents.models import load_tokenizer
from agents.rollout.episodes import task_episode
from agents.rollout.strategies import PromptTrees, Strategy
from agents.rollout.tree_loop import TreeConfig, planned_branches, rollout_trees
from agents.run.backends import RolloutBackend, run_engine
from agents.run.cluster.config import ClusterConfig
from agents.run.cluster.runtime import import_ray, require_resources, this_process
from agents.run.cluster.weight_sync import SyncReport, put_buckets, weights_digest
from agents.run.steps import PipelinedSteps, streamed_update

if TYPE_CHECKING:
    from agents.run.backends import TrainerBackend
    from agents.run.config import RunParts, TrainConfig
    from agents.run.task_order import TaskOrder

__all__ = ["REQUEST_PRIORITY", "RolloutPool", "RolloutWorker", "VersionGate", "WorkerSpec"]

#: The priority of the requests made in this context (lower goes first): a worker's rollouts set
#: it to their step, so that when its engine is full the requests of older steps go first.
REQUEST_PRIORITY: contextvars.ContextVar[int] = contextvars.ContextVar("request_priority", default=0)


@dataclass
class BusyClock:
    """What is in flight, and the seconds in which at least one thing was."""

    count: int = 0
    seconds: float = 0.0  # busy seconds until ``since``
    since: float | None = None  # when the count last left 0

    def enter(self) -> None:
        if self.count == 0:
            self.since = time.perf_counter()
        self.count += 1

    def leave(self) -> None:
        self.count -= 1
        if self.count == 0 and self.since is not None:
            self.seconds += time.perf_counter() - self.since
            self.since = None

    def busy(self, now: float) -> float:
        """Busy seconds until ``now`` (a ``time.perf_counter()`` reading)."""
        return self.seconds + (now - self.since if self.since is not None else 0.0)


class VersionGate(Engine):
    """An engine whose completions are stamped with the version of the weights that sampled them.

    By default weights change only between requests: :meth:`generate` waits while an update is
    pending, counts as in flight while the engine generates, and stamps its
    :class:`~agents.engines.Completion` with the version it ran under (``version``);
    :meth:`updating` marks an update pending, waits until no request is in flight, and yields;
    the new ``version`` holds from when the block ends.

    With ``inflight_updates`` (an engine with ``supports_inflight_updates``), :meth:`load_in_flight`
    changes the weights between two decode steps while requests go on; a completion then carries
    its tokens' versions (``token_versions``) and ``version`` is its oldest token's, the
    one the bound on staleness counts.

    With ``capacity`` (the requests the engine decodes together, its ``max_batch_size``), the gate
    lets at most that many into the engine and, when it is full, the waiting request with the
    lowest :data:`REQUEST_PRIORITY` goes next (ties in arrival order). With rollouts of several
    steps on one engine (``max_staleness`` ≥ 1) the older step's trees then finish first, as they
    would alone, instead of sharing the batch turn by turn with the newer step's: the trainer waits
    for them, and the next step may start only after they are trained on.

    :attr:`clock` counts the seconds the engine had at least one request in flight (the rest is
    its idle time: tool calls, waits for work, drains before a load). Everything else
    (``vocab_size``, ``model``, ``sleep``, ``close``, …) is the engine's own.

    Example::

        async with gate.updating(version=3):
            await gate.engine.update_weights(state_dict)
    """

    def __init__(
        self, engine: Engine, version: int = 0, *, inflight_updates: bool = False, capacity: int | None = None
    ) -> None:
        if inflight_updates and not engine.supports_inflight_updates:
            raise ValueError(
                f"cluster.in_flight_updates=true needs an engine that loads weights while requests are in flight, "
                f"and {type(engine).__name__} cannot (supports_inflight_updates is False): use HFEngine workers "
                "(cluster.worker_engine=hf) or cluster.in_flight_updates=false"
            )
        if capacity is not None and capacity < 1:
            raise ValueError(f"a VersionGate's capacity must be >= 1 (or None: no limit), got {capacity}")
        self.engine, self.version, self.inflight_updates, self.capacity = engine, version, inflight_updates, capacity
        self.clock = BusyClock()
        self._waiting: list[tuple[int, int]] = []  # (priority, arrival) of the requests held back, a heap
        self._arrivals = itertools.count()
        self._pending = 0
        self._changed = asyncio.Condition()
        self._one_update = asyncio.Lock()

    @property
    def in_flight(self) -> int:
        """Requests in the engine now."""
        return self.clock.count

    @property
    def supports_entropy(self) -> bool:  # type: ignore[override]
        return self.engine.supports_entropy

    @property
    def supports_sleep(self) -> bool:  # type: ignore[override]
        return self.engine.supports_sleep

    def __getattr__(self, name: str) -> Any:
        if name == "engine":  # not set yet (unpickling): never recurse
            raise AttributeError(name)
        return getattr(self.engine, name)

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        async with self._changed:
            ticket = (REQUEST_PRIORITY.get(), next(self._arrivals))
            heapq.heappush(self._waiting, ticket)
            try:
                await self._changed.wait_for(lambda: self._may_enter(ticket))
            finally:
                self._waiting.remove(ticket)
                heapq.heapify(self._waiting)
                self._changed.notify_all()  # the next in line may go (or another, when this one was cancelled)
            self.clock.enter()
            version = self.version
        try:
            completion = await self.engine.generate(prompt_ids, params)
        finally:
            async with self._changed:
                self.clock.leave()
                self._changed.notify_all()
        if self.inflight_updates:
            # None: sampled before the engine's first in-flight load, under the version it started with
            tokens = completion.token_versions or [None] * len(completion.token_ids)
            resolved = [version if v is None else v for v in tokens]
            completion.token_versions, version = list(resolved), min(resolved)
        completion.version = version
        return completion

    def _may_enter(self, ticket: tuple[int, int]) -> bool:
        """Whether the request holding ``ticket`` may go into the engine now."""
        if self._pending and not self.inflight_updates:
            return False  # a load between requests is waiting for the engine to empty
        return self._waiting[0] == ticket and (self.capacity is None or self.in_flight < self.capacity)

    @contextlib.asynccontextmanager
    async def updating(self, version: int) -> AsyncIterator[None]:
        """Hold new requests, wait for those in flight, change the weights in the block, then ``version``."""
        async with self._one_update:
            async with self._changed:
                self._pending += 1
                try:
                    await self._changed.wait_for(lambda: self.in_flight == 0)
                except BaseException:
                    self._pending -= 1
                    self._changed.notify_all()
                    raise
            try:
                yield
                self.version = version
            finally:
                async with self._changed:
                    self._pending -= 1
                    self._changed.notify_all()

    async def load_in_flight(self, state_dict: Mapping[str, Any], version: int) -> None:
        """Load the whole ``state_dict`` as ``version`` between two decode steps; requests in flight go on."""
        async with self._one_update:
            await self.engine.update_weights_in_flight(state_dict, version)
            self.version = version

    async def update_weights(self, state_dict: Mapping[str, Any]) -> None:
        """Load ``state_dict`` as version ``self.version + 1``: between requests, or in flight."""
        if self.inflight_updates:
            await self.load_in_flight(state_dict, self.version + 1)
            return
        async with self.updating(self.version + 1):
            await self.engine.update_weights(state_dict)

    async def sleep(self, level: int = 1) -> None:
        await self.engine.sleep(level=level)

    async def wake_up(self) -> None:
        await self.engine.wake_up()

    async def close(self) -> None:
        await self.engine.close()


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs to build its engine and environments (plain values, sent once).

    Attributes:
        config: The run's :class:`~agents.run.config.TrainConfig` (model, engine and its arguments,
            seed, env id and arguments).
        env_spec: The driver's registry entry of ``config.env``.
        strategy: The learner's rollout strategy.
        tree: The rollout settings of every prompt (its ``seed`` is set per step).
        threads: Torch threads of the worker's process (its share of the node's cores).
        engine: A function building the worker's engine instead of the run's (``config.engine``):
            your own engine, or a scripted one for a simulated cluster (``benchmarks.scale_bench``).
    """

    config: TrainConfig
    env_spec: EnvSpec
    strategy: Strategy
    tree: TreeConfig
    threads: int = 1
    engine: Callable[[], Engine] | None = None


class WorkerRestarted(RuntimeError):
    """A call reached a worker process other than the one the pool knows: Ray restarted it between
    two calls, so it holds its first weights, not the last sync's (the pool treats it as lost)."""


class RolloutWorker:
    """One worker process: its engine, its environment, and the trees of the prompts it is given.

    Made a Ray actor by :class:`RolloutPool`; usable in-process too (tests of its logic).
    """

    def __init__(self, spec: WorkerSpec, rank: int) -> None:
        self.spec, self.rank = spec, rank
        env = spec.env_spec
        if env != _registered(env.id):  # a user's environment, registered in the driver
            agentenv.register(
                env.id,
                env.entry_point,
                nondeterministic=env.nondeterministic,
                description=env.description,
                **env.kwargs,
            )
        if spec.engine is not None:
            engine = spec.engine()
        else:
            engine = run_engine(spec.config, spec.tree.rollout, log=lambda note: None)
        cluster = ClusterConfig.from_dict(spec.config.cluster)
        self.engine = VersionGate(
            engine, inflight_updates=cluster.in_flight_updates, capacity=getattr(engine, "max_batch_size", None)
        )
        if "torch" in sys.modules:  # the engine computes with torch: its threads are this worker's share of the cores
            sys.modules["torch"].set_num_threads(spec.threads)
        self.tokenizer = load_tokenizer(spec.config.model)
        self.env = TokenEnv(agentenv.make(spec.config.env, **spec.config.env_kwargs), self.tokenizer)
        self.version = 0
        self.started = time.perf_counter()
        self.incarnation = os.urandom(8).hex()  # a restarted process draws a new one: see _check

    def engine_busy(self) -> tuple[float, float]:
        """Seconds since the engine was built, and those it had a request in flight (its idle time is the rest)."""
        now = time.perf_counter()
        return now - self.started, self.engine.clock.busy(now)

    def ready(self) -> dict[str, Any]:
        """Where the worker runs (its node's id and address as Ray reports them, its pid), returned once
        it has loaded its engine."""
        where = this_process() if _in_ray_actor() else {"node": None, "ip": None, "pid": os.getpid()}
        return {
            "rank": self.rank,
            **where,
            "version": self.version,
            "supports_sleep": self.engine.supports_sleep,
            "incarnation": self.incarnation,
        }

    def _check(self, incarnation: str | None) -> None:
        """Refuse a call meant for an earlier process of this worker (``None``: any process will do)."""
        if incarnation is not None and incarnation != self.incarnation:
            raise WorkerRestarted(
                f"rollout worker {self.rank} was restarted since the pool last reached it (process "
                f"{incarnation} then, {self.incarnation} now) and holds weights version {self.version}"
            )

    async def rollout(
        self, index: int, task: int, seed: int, priority: int = 0, incarnation: str | None = None
    ) -> PromptTrees:
        """The trees of ``task``, the batch's prompt number ``index``, under the rollout ``seed``.

        Its requests carry ``priority`` (:data:`REQUEST_PRIORITY`; the pipeline gives each step's
        its step number). Node environments are dropped before the trees leave the process.
        ``incarnation``: the process the caller expects (:class:`WorkerRestarted` if another).
        """
        self._check(incarnation)
        mark = REQUEST_PRIORITY.set(priority)  # the tasks of its tree inherit it
        episode = task_episode(self.env, task)
        try:
            tree = dataclasses.replace(self.spec.tree, seed=seed)
            (prompt,) = await rollout_trees(self.engine, [episode], self.spec.strategy, tree, indices=[index])
        finally:
            episode.env.close()
            REQUEST_PRIORITY.reset(mark)
        for rollout_tree in prompt.trees:
            for node in [rollout_tree.root, *rollout_tree.nodes()]:
                node.env = None
        return prompt

    async def load_buckets(self, refs: Sequence[Any], version: int) -> float:
        """Load the weights held in ``refs`` (object refs of :func:`put_buckets`), bucket by bucket.

        Returns the seconds it took.
        """
        start = time.perf_counter()
        if self.engine.inflight_updates:  # all buckets at once: a decode step never sees half the new weights
            state_dict: dict[str, Any] = {}
            for ref in refs:
                state_dict.update(await ref)
            await self.engine.load_in_flight(state_dict, version)
        else:
            async with self.engine.updating(version):  # between requests: those in flight finish first
                for ref in refs:
                    await self.engine.engine.update_weights(await ref)
        self.version = version
        return time.perf_counter() - start

    def digest(self, names: Sequence[str] | None = None) -> str:
        """:func:`weights_digest` of the engine's weights: the state dict of the model it generates with.

        Engines whose weights live in processes of their own (VLLMEngine's workers) hold no such
        model here and are refused with a TypeError.
        """
        model = getattr(self.engine, "model", None)
        if model is None:
            raise TypeError(
                f"{type(self.engine).__name__} keeps its weights in processes of its own, so this worker cannot "
                "digest them; compare digests on HFEngine workers"
            )
        return weights_digest(model.state_dict(), None if names is None else set(names))

    async def evaluate(self, kwargs: Mapping[str, Any], incarnation: str | None = None) -> HeldOut:
        """:func:`agents.eval.heldout.evaluate_heldout` on this worker's engine (``incarnation``: as :meth:`rollout`)."""
        self._check(incarnation)
        return await evaluate_heldout(self.engine, self.tokenizer, **kwargs)

    async def sleep(self, level: int) -> None:
        await self.engine.sleep(level=level)

    async def wake_up(self) -> None:
        await self.engine.wake_up()

    async def close(self) -> None:
        self.env.close()
        await self.engine.close()


@dataclass
class _Worker:
    handle: Any
    rank: int
    live: bool = True
    reviving: asyncio.Task | None = field(default=None, repr=False)
    prompts: BusyClock = field(default_factory=BusyClock)  # prompts (or an evaluation) in flight on it


class RolloutPool(RolloutBackend):
    """The driver's handle on M rollout workers: prompts out by load, trees back, weights to all.

    The :class:`~agents.run.backends.RolloutBackend` of a run with ``cluster.rollout_workers`` > 0;
    :class:`~agents.run.steps.PipelinedSteps` also reads its clocks, failures and weights :attr:`version`.

    Args:
        spec: What each worker builds.
        workers: M.
        cpus: Ray CPUs each worker asks for.
        gpus: GPUs each worker asks for (its vLLM's ``tensor_parallel_size``; 0 on CPU).
        restarts: How often Ray restarts a worker whose process died.
        bucket_bytes: Size of one bucket of the weight sync.
        colocated: The workers' engines share GPUs with the trainer: they sleep through each
            update (:attr:`supports_sleep`, when their engines can).
        log: Where notes about failures go.
        resources: Custom Ray resources each worker asks for (nodes that offer them take the workers).
        strategy: Ray's scheduling strategy, ``DEFAULT`` or ``SPREAD`` (over the nodes).
    """

    def __init__(
        self,
        spec: WorkerSpec,
        workers: int,
        *,
        cpus: float = 1.0,
        gpus: float = 0.0,
        restarts: int = 1,
        bucket_bytes: int = 256 * 2**20,
        colocated: bool = False,
        log: Any = print,
        resources: Mapping[str, float] | None = None,
        strategy: str = "DEFAULT",
    ) -> None:
        if workers < 1:
            raise ValueError(f"a RolloutPool needs at least one worker, got {workers}")
        ray = import_ray()
        require_resources("rollout workers", workers, cpus, gpus, resources=resources)
        _travel_by_value(spec.env_spec.entry_point, spec.strategy, spec.engine)
        actor = ray.remote(RolloutWorker).options(
            num_cpus=cpus,
            num_gpus=gpus,
            resources=dict(resources or {}),
            scheduling_strategy=strategy,
            max_restarts=restarts,
            max_task_retries=0,
            max_concurrency=1000,
        )
        self._ray, self.log, self.bucket_bytes, self.colocated = ray, log, bucket_bytes, colocated
        self._planned = planned_branches(spec.strategy, spec.tree)  # each prompt's branches, for on_branches
        self.workers = [_Worker(actor.remote(spec, rank), rank) for rank in range(workers)]
        try:
            self.info = ray.get([worker.handle.ready.remote() for worker in self.workers])
        except ray.exceptions.RayError as error:
            for worker in self.workers:
                ray.kill(worker.handle, no_restart=True)
            raise RuntimeError(f"a rollout worker could not start: {error}") from None
        self._weights: tuple[list[Any], int] | None = None  # the last sync's refs, for restarted workers
        self._sleeps = colocated and all(info["supports_sleep"] for info in self.info)
        self.version = 0  # the weights' version: each sync adds one (a resumed run starts it at its step)
        self.last_sync: SyncReport | None = None
        self.failures = 0  # worker deaths noticed so far
        self.reruns = 0  # prompts run again after their worker died, so far
        self._rollout_marks = (0, 0)  # failures and reruns when the last rollout began
        self._started = time.perf_counter()
        self._engine_readings: dict[int, tuple[float, float]] = {}  # each worker's last engine_busy()
        self._engine_idle = {worker.rank: 0.0 for worker in self.workers}

    @property
    def engine(self) -> RolloutPool:
        """What receives the trainer's weights: the pool itself (:meth:`update_weights`)."""
        return self

    @property
    def supports_sleep(self) -> bool:
        """Whether the workers' engines share the trainer's GPUs (``colocated``) and can sleep through its updates."""
        return self._sleeps

    @property
    def placement(self) -> list[dict[str, Any]]:
        """Where each worker runs, ``{"rank", "node", "ip", "pid"}`` (their latest incarnation)."""
        return [{key: info[key] for key in ("rank", "node", "ip", "pid")} for info in self.info]

    def set_version(self, version: int) -> None:
        """The workers hold the weights of ``version`` (a resumed run's: the next sync is ``version + 1``)."""
        self.version = version

    # ---- rollout ----------------------------------------------------------------------------

    async def rollout(
        self,
        tasks: Sequence[int],
        seed: int,
        on_branches: Callable[[int], None] | None = None,
        *,
        priority: int = 0,
        on_prompt: Callable[[int, PromptTrees], None] | None = None,
    ) -> list[PromptTrees]:
        """The trees of every task, in order; prompt ``i`` of the batch keeps index ``i``.

        ``priority``: the workers' engines, when full, serve requests of a lower one first
        (:class:`VersionGate`); the pipeline gives each step its step number. ``on_prompt(i,
        trees)`` is called as each prompt's trees come back (the pipeline streams them to the trainer).

        A prompt whose worker died goes to the least-loaded live worker (or waits for a
        restarted one); the step fails only when no worker is left. ``on_branches`` counts each
        prompt's branches when its trees come back (as
        :func:`~agents.rollout.tree_loop.rollout_trees` counts them: the planned ones, when known).
        """
        self._rollout_marks = (self.failures, self.reruns)
        results: dict[int, PromptTrees] = {}
        pending = list(enumerate(tasks))
        running: dict[asyncio.Future, tuple[_Worker, int, int]] = {}
        while pending or running:
            while pending and any(worker.live for worker in self.workers):
                worker = min((w for w in self.workers if w.live), key=lambda w: (w.prompts.count, w.rank))
                index, task = pending.pop(0)
                worker.prompts.enter()
                ref = worker.handle.rollout.remote(index, task, seed, priority, self._incarnation(worker))
                running[asyncio.ensure_future(_awaited(ref))] = (worker, index, task)
            revivals = [w.reviving for w in self.workers if w.reviving is not None]
            if not running and not revivals:
                raise self._none_left(f"the prompts {[i for i, _ in pending]} have no worker left")
            done, _ = await asyncio.wait([*running, *revivals], return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                if future not in running:
                    continue  # a revival finished: the loop hands that worker work again
                worker, index, task = running.pop(future)
                worker.prompts.leave()
                try:
                    results[index] = future.result()
                    if on_branches is not None:
                        on_branches(self._planned if self._planned is not None else len(results[index].leaves))
                    if on_prompt is not None:
                        on_prompt(index, results[index])
                except _lost_worker_errors(self._ray) as error:
                    pending.append((index, task))
                    self.reruns += 1
                    if worker.live:
                        self._lost(worker, error)
        return [results[index] for index in range(len(tasks))]

    def metrics(self) -> dict[str, float]:
        """``cluster/*`` numbers of the last rollout (worker failures, prompts run again) and ``sync/*`` of the
        sync that gave it its weights."""
        return {
            **(self.last_sync.metrics() if self.last_sync is not None else {}),
            "cluster/worker_failures": float(self.failures - self._rollout_marks[0]),
            "cluster/prompts_rerun": float(self.reruns - self._rollout_marks[1]),
            "cluster/workers_live": float(sum(worker.live for worker in self.workers)),
        }

    def idle_seconds(self) -> float:
        """Seconds since the pool started in which a worker held no prompt, averaged over the workers.

        A worker is busy while it holds at least one prompt (or an evaluation); the difference of two
        readings is the workers' idle time between them (what ``time/worker_idle_s`` reports).
        """
        now = time.perf_counter()
        return sum(now - self._started - worker.prompts.busy(now) for worker in self.workers) / len(self.workers)

    async def engine_idle_seconds(self) -> float:
        """Seconds in which a worker's engine had no request in flight, averaged over the workers.

        Finer than :meth:`idle_seconds`: an engine also idles while its worker holds prompts whose
        episodes are calling tools, and while a load waits for the requests in flight to finish.
        Counted from each worker's start (a restarted worker's count starts again); the difference
        of two readings is the engines' idle time between them (what ``time/engine_idle_s`` reports).
        """
        live = [worker for worker in self.workers if worker.live]
        readings = await asyncio.gather(
            *(_awaited(worker.handle.engine_busy.remote()) for worker in live), return_exceptions=True
        )
        for worker, reading in zip(live, readings):
            if isinstance(reading, BaseException):
                continue  # a dead worker adds nothing; the next rollout notices and revives it
            elapsed, busy = reading
            last_elapsed, last_busy = self._engine_readings.get(worker.rank, (0.0, 0.0))
            if elapsed < last_elapsed:  # its process restarted: its clocks began again
                last_elapsed = last_busy = 0.0
            self._engine_idle[worker.rank] += (elapsed - busy) - (last_elapsed - last_busy)
            self._engine_readings[worker.rank] = (elapsed, busy)
        return sum(self._engine_idle.values()) / len(self.workers)

    def _lost(self, worker: _Worker, error: BaseException) -> None:
        """A worker's process died: stop giving it work and bring it back with the current weights."""
        worker.live = False
        self.failures += 1
        what = "was restarted since its last call" if isinstance(error, WorkerRestarted) else "died"
        self.log(f"rollout worker {worker.rank} {what} ({type(error).__name__}); its prompts go to the other workers")
        worker.reviving = asyncio.ensure_future(self._revive(worker))

    async def _revive(self, worker: _Worker, patience_s: float = 600.0) -> None:
        """Wait for Ray's restart of ``worker``, load the current weights, and mark it live."""
        exceptions = self._ray.exceptions
        deadline = time.monotonic() + patience_s
        try:
            while True:
                try:
                    await _awaited(worker.handle.ready.remote())
                    break
                except exceptions.ActorUnavailableError:  # restarting: its new process is not up yet
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(1.0)
            if self._weights is not None:
                await _awaited(worker.handle.load_buckets.remote(self._weights[0], self.version))
            info = await _awaited(worker.handle.ready.remote())
        except exceptions.RayError as error:
            self.log(f"rollout worker {worker.rank} is gone for good ({type(error).__name__})")
            return
        finally:
            worker.reviving = None
        worker.live = True
        self.info[worker.rank] = info
        self.log(
            f"rollout worker {worker.rank} restarted on node {info['node'][:12]} ({info['ip']}) and holds the "
            "current weights"
        )

    # ---- weights ----------------------------------------------------------------------------

    async def update_weights(self, state_dict: Mapping[str, Any]) -> None:
        """The engine contract's sync: put ``state_dict`` in the object store, load it on every worker."""
        refs, size = put_buckets(state_dict, self.bucket_bytes)
        await self.load_buckets(refs, size)

    async def load_buckets(self, refs: list[Any], size: int, put_s: float = 0.0) -> SyncReport:
        """Load the buckets ``refs`` (``size`` bytes) on every live worker; returns what the sync moved."""
        self.version += 1
        self._weights = (refs, size)
        start = time.perf_counter()
        live = [worker for worker in self.workers if worker.live]
        outcomes = await asyncio.gather(
            *(_awaited(worker.handle.load_buckets.remote(refs, self.version)) for worker in live),
            return_exceptions=True,
        )
        for worker, outcome in zip(live, outcomes):
            if isinstance(outcome, _lost_worker_errors(self._ray)):
                self._lost(worker, outcome)  # its revival loads these weights
            elif isinstance(outcome, BaseException):
                raise outcome
        self.last_sync = SyncReport(size, len(refs), put_s, time.perf_counter() - start)
        return self.last_sync

    async def sleep(self, level: int = 1) -> None:
        """Every live worker's engine releases its GPU memory (the trainer's update runs meanwhile)."""
        await asyncio.gather(*(_awaited(w.handle.sleep.remote(level)) for w in self.workers if w.live))

    async def wake_up(self) -> None:
        """Every live worker's engine takes its memory back."""
        await asyncio.gather(*(_awaited(w.handle.wake_up.remote()) for w in self.workers if w.live))

    async def digests(self, names: Sequence[str] | None = None) -> list[str]:
        """Each live worker's :func:`weights_digest` (equal after a sync)."""
        live = [worker for worker in self.workers if worker.live]
        return list(await asyncio.gather(*(_awaited(w.handle.digest.remote(names)) for w in live)))

    def steps(
        self, config: TrainConfig, parts: RunParts, order: TaskOrder, progress: bool | None, trainer: TrainerBackend
    ) -> PipelinedSteps:
        """The workers' pipeline: rollouts up to η = ``max_staleness`` steps ahead of the trainer (at η = 0 the
        synchronous steps, with the workers' idle time measured), each prompt's trees streamed to the trainer
        when the run asks for it."""
        accumulate = streamed_update(config, trainer)
        return PipelinedSteps(config, parts, self, order, progress, ahead=config.max_staleness, accumulate=accumulate)

    async def evaluate(self, kwargs: Mapping[str, Any]) -> HeldOut:
        """The held-out evaluation on the first live worker (no progress bar: it has no terminal); run
        again on another (or the revived one) if that worker is lost meanwhile."""
        while True:
            live = [worker for worker in self.workers if worker.live]
            revivals = [worker.reviving for worker in self.workers if worker.reviving is not None]
            if not live:
                if not revivals:
                    raise self._none_left("none can evaluate")
                await asyncio.wait(revivals, return_when=asyncio.FIRST_COMPLETED)
                continue
            worker = live[0]
            worker.prompts.enter()
            try:
                return await _awaited(
                    worker.handle.evaluate.remote({**kwargs, "progress": False}, self._incarnation(worker))
                )
            except _lost_worker_errors(self._ray) as error:
                self._lost(worker, error)
            finally:
                worker.prompts.leave()

    def _none_left(self, what: str) -> RuntimeError:
        """The error when no worker is live or reviving: ``what`` could not be done."""
        return RuntimeError(
            f"every rollout worker died ({self.failures} failures); {what}; raise cluster.worker_restarts or "
            "check the workers' logs"
        )

    def _incarnation(self, worker: _Worker) -> str:
        """The process of ``worker`` that holds the pool's weights (the one its last ``ready`` reported)."""
        return str(self.info[worker.rank]["incarnation"])

    def pids(self) -> list[int]:
        """The workers' process ids (what a test kills)."""
        return [info["pid"] for info in self._ray.get([w.handle.ready.remote() for w in self.workers])]

    async def close(self) -> None:
        """Close the engines and end the worker processes (one still restarting is only ended)."""
        for worker in self.workers:
            if worker.reviving is not None:  # it may wait for a node to host it: a call would wait too
                worker.reviving.cancel()
            elif worker.live:
                try:
                    await asyncio.wait_for(_awaited(worker.handle.close.remote()), timeout=30)
                except (self._ray.exceptions.RayError, TimeoutError):
                    pass  # a dead worker has nothing left to close
            self._ray.kill(worker.handle, no_restart=True)


def _lost_worker_errors(ray: Any) -> tuple[type[BaseException], ...]:
    """What a call raises when its worker's process is gone (killed, out of memory, its node lost) or was
    replaced since the pool last reached it (:class:`WorkerRestarted`: Ray's error for it is also one);
    any other error raised by the worker's own code (``RayTaskError``) is a real failure and is not among them."""
    exceptions = ray.exceptions
    return (
        exceptions.RayActorError,
        exceptions.OutOfMemoryError,
        exceptions.WorkerCrashedError,
        exceptions.NodeDiedError,
        WorkerRestarted,
    )


def _in_ray_actor() -> bool:
    """Whether this process is a Ray actor (a worker is also built in-process, by tests of its logic)."""
    if "ray" not in sys.modules:
        return False
    import ray

    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def _registered(env_id: str) -> EnvSpec | None:
    try:
        return agentenv.spec(env_id)
    except agentenv.UnknownEnvError:
        return None


async def _awaited(ref: Any) -> Any:
    return await ref


def _travel_by_value(*objects: Any) -> None:
    """Let Ray pickle user-defined classes and factories by value, so workers need not import their module.

    Classes of ``agentenv``/``agents`` are imported on the workers as usual.
    """
    from ray import cloudpickle

    for obj in objects:
        if obj is None:
            continue
        module_name = getattr(obj, "__module__", None) or type(obj).__module__
        if module_name.split(".")[0] in ("agentenv", "agents", "builtins", "__main__"):
            continue  # ours are importable everywhere; __main__ already travels by value
        module = sys.modules.get(module_name)
        if module is not None:
            cloudpickle.register_pickle_by_value(module)
