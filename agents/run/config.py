"""The configuration of a training run: every hyper-parameter, named presets, files and overrides.

A run is described by one :class:`TrainConfig`. Its top-level fields say what to train on what
(``algo``, ``env``, ``model``, ``engine``, ``steps``, ``prompts_per_step``, …); its sections
override the hyper-parameters of the parts the run is built from:

==============  =======================================================================
section         what it sets
==============  =======================================================================
``strategy``    fields of the learner's rollout strategy (``M``, ``K`` of EntropyTree, …)
``credit``      fields of the learner's credit assignment (``backup`` of TurnwiseCredit, …)
``loss``        the loss's keyword hyper-parameters (``eps_high``, …), plus ``kl_coef``
                and ``entropy_coef``
``trainer``     fields of :class:`agents.training.trainer_config.TrainerConfig` (``lr``, ``mini_batches``, …)
``sampling``    fields of :class:`agents.engines.SamplingParams` (``temperature``, …)
``rollout``     fields of :class:`agents.rollout.RolloutConfig` and :class:`agents.rollout.tree_loop.TreeConfig` (``max_response_tokens``,
                ``concurrency``, ``turn_timeout``; ``budget`` as a dict of
                :class:`agents.rollout.strategies.Budget` fields)
``env_kwargs``  keyword arguments of ``agentenv.make`` (``reward``, ``max_tool_calls``, …)
``engine_kwargs`` keyword arguments of the engine: :class:`~agents.engines.hf.HFEngine`'s
                (``prefix_cache_tokens``, …), or :class:`~agents.engines.vllm.VLLMEngine`'s
                (``kv_cache_gib``, ``dtype``, …) and any of vLLM's engine arguments
                (``gpu_memory_utilization``, ``enforce_eager``, …)
``cluster``     fields of :class:`agents.run.cluster.ClusterConfig`: trainer ranks, rollout workers,
                placement, the Ray address (default: one process, no Ray)
==============  =======================================================================

Values come, each layer overriding the one before, from the defaults (the papers' budgets), a
named preset (:data:`PRESETS`), a config file (YAML or JSON, this nested layout) and the command
line (``--steps 8``, ``--set trainer.lr=1e-5``). :func:`build` turns a config into the run's
parts and :func:`effective_config` writes back every value those parts use; a run saves that as
``config.json``, itself a valid config file.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import inspect
import json
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agents.engines.base import SamplingParams
from agents.engines.factory import ENGINES
from agents.models import DEFAULT_MODEL

# Only light imports at the top: the parser of `agents train` (agents.cli) reads PRESETS and
# TrainConfig's defaults, and its --help must not load torch. The parts a config builds into (learners,
# losses, trainer, rollout) are imported by the functions that build them.
from agents.run.cluster.config import ClusterConfig

if TYPE_CHECKING:
    from agents.learners import Learner
    from agents.rollout.tree_loop import TreeConfig
    from agents.training.trainer_config import TrainerConfig

__all__ = [
    "PRESETS",
    "RESUMABLE",
    "SECTIONS",
    "RunParts",
    "TrainConfig",
    "build",
    "effective_config",
    "load_config_file",
    "merge",
    "parse_overrides",
    "preset",
    "resolve",
]

#: The sections of :class:`TrainConfig` that hold hyper-parameter overrides.
SECTIONS = (
    "strategy",
    "credit",
    "loss",
    "trainer",
    "sampling",
    "rollout",
    "env_kwargs",
    "engine_kwargs",
    "cluster",
)
#: Values that may change when a run resumes; any other change would make it another run.
#: (A run resumes at any number of trainer ranks and rollout workers: ``cluster`` may change too;
#: where metrics are reported, ``trainer.report_to`` and ``trainer.wandb_project``, as well; and how
#: the update is split and laid out in memory, which leaves it the same up to rounding: a run that ran
#: out of memory resumes with smaller micro-batches.)
RESUMABLE = frozenset(
    {
        "steps",
        "max_rollout_tokens",
        "eval_every",
        "eval_at_tokens",
        "eval_before",
        "eval_questions",
        "checkpoint_every",
        "keep_checkpoints",
        "engine_kwargs",
        "cluster",
        "trainer.report_to",
        "trainer.wandb_project",
        "trainer.micro_batch_size",
        "trainer.micro_batch_tokens",
        "trainer.gradient_checkpointing",
        "trainer.checkpoint_layers",
        "trainer.score_chunk",
        "trainer.packing",
        "trainer.tree_kernel",
        # How many episodes run at once: the same episodes, sampled in other batches (a run killed for
        # memory during its rollouts resumes with fewer).
        "rollout.concurrency",
    }
)
# Set by the run itself (or by the learner), never through a section.
_RUN_OWNED = {
    "trainer": ("loss", "loss_kwargs", "kl_coef", "entropy_coef", "total_steps", "device", "progress", "temperature"),
    "sampling": ("seed",),
    # The rollout section is flat: RolloutConfig's fields and TreeConfig's own (a tree times out per turn).
    "rollout": ("sampling", "seed", "rollout", "episode_timeout"),
    # The engine generates with the run's model (HFEngine: the trainer's own object) and seed.
    "engine_kwargs": ("model", "tokenizer", "seed"),
}


@dataclass
class TrainConfig:
    """Everything a training run needs; the defaults are the papers' budgets.

    Attributes:
        algo: The learner (``at2po``, ``aepo``, ``grpo``, ``tree-grpo``, ``arpo``), or the name of
            a learner passed to :func:`agents.run.train.train` directly.
        env: A registered environment id (``agentenv list`` shows them).
        model: A model name, local checkpoint folder or Hugging Face id.
        engine: ``hf`` (transformers, sharing the trainer's model) or ``vllm`` (weights synced).
        device: Where the trainer's model goes; ``None``: CUDA if present, else CPU.
        steps: Rollout batches to train on.
        prompts_per_step: Prompts per rollout batch.
        seed: Seeds the task order and every rollout.
        holdout: The env's first ``holdout`` tasks are never trained on; evaluation uses them.
        eval_questions: Held-out questions evaluated (greedy, no tree); at most ``holdout``; 0: no
            evaluation.
        eval_every: Also evaluate after every this many steps; 0: only before and after training.
        eval_at_tokens: Also evaluate after the step whose rollouts bring the tokens sampled so far
            (counted as ``max_rollout_tokens`` counts them) to or past each of these counts: held-out
            scores at fixed rollout budgets, for learners whose steps sample different numbers of tokens
            (``benchmarks.learning --budget-points``).
        eval_before: Evaluate before the first step (step 0); off to save the time when the
            initial policy's scores are known (the same model and questions).
        checkpoint_every: Save a checkpoint after every this many steps (and after the last).
        keep_checkpoints: Keep the newest this many intact checkpoints, removing older ones as new
            ones are saved (each holds the model and its optimiser state: 1.6 GB for the embedded
            135M model); ``None`` (``all`` on the command line) keeps every one. The newest intact
            checkpoint, which ``--resume`` continues from and whose ``model/`` is the run's final
            model, always stays.
        budget_reward: The reward of a path that the token budget (``rollout.max_response_tokens``
            or ``rollout.budget``) ended before the environment did, i.e. without an answer;
            ``None`` keeps what it earned so far. Under AT²PO's reward an unanswered response is
            a format failure (−1), so the presets using that reward set −1.
        max_staleness: η of asynchronous training (a top-level field: ``async`` is a Python
            keyword). 0: every step is rollout, update, weight sync, as always. η ≥ 1 (needs ``cluster.rollout_workers`` ≥ 1): the workers roll out
            the next η steps while the trainer updates, a prompt's trees are trained on only when
            the weights that sampled their oldest token are at most η versions behind the
            trainer's, and the trainer's objective is the decoupled one (``trainer.decoupled``,
            on unless set; it needs ``trainer.old_logprobs=recompute``). See :func:`agents.run.train.train`.
        stream_update: At η ≥ 1 with one optimiser update a step (``trainer.mini_batches`` and
            ``trainer.epochs`` 1), the trainer runs its forward and backward passes on each
            prompt's trees as they come back, while the step's other prompts roll out, and only
            the optimiser step waits for the step's last trees
            (:meth:`~agents.training.trainer.Trainer.accumulate`): the same update up to rounding,
            sooner. Off: the update starts when the whole step is back. Not used at η = 0 (the
            synchronous run stays bit for bit), nor with more updates a step (each one after the
            first would need every tree's π_old under the step's weights first).
        dynamic_sampling: DAPO's dynamic sampling (Yu et al. 2025, §3.2; verl's
            ``algorithm.filter_groups``): a prompt whose leaves all get the same reward, whose every
            advantage is therefore 0, is dropped and replaced by the next task, until the step holds
            ``prompts_per_step`` prompts with signal or ``max_sampled_prompts`` have been rolled out
            (:func:`agents.run.steps.sample_with_signal`; ``sampling/*`` in the metrics count the cost).
            Off by default, as in the papers of every learner here; it needs ``max_staleness`` 0.
        max_sampled_prompts: The most prompts one step rolls out under ``dynamic_sampling``; ``None``:
            3 × ``prompts_per_step``, the over-sampling of verl's DAPO recipe (``gen_prompt_bsz`` =
            3 × ``train_prompt_bsz``).
        min_round_prompts: The fewest prompts a round of ``dynamic_sampling`` rolls out while
            ``max_sampled_prompts`` allows: round 0 the step's own and then the order's next tasks, later
            rounds more than eq. 82 asks when it asks fewer (docs/algorithms/steps.md eq. 83). More prompts in
            one round fill an engine's batches that a round of few prompts leaves short, and save the
            rounds after it when they bring the signal; the prompts kept are still the first with signal
            in task order. 1 (the default): eq. 82 alone.
        max_rollout_tokens: End the run after the step whose rollouts bring the tokens sampled
            so far (``sampling/tokens``: every prompt rolled out, dropped ones included) to this
            many, or after ``steps`` steps, whichever comes first; ``None``: ``steps`` steps. Runs of
            different learners compared at one rollout budget (``benchmarks.learning``) set it.
        strategy, credit, loss, trainer, sampling, rollout, env_kwargs, engine_kwargs, cluster:
            hyper-parameter overrides (see the module docstring).
    """

    # The learners' names are written out in the docstring, which `agents train --help` shows without
    # importing torch; tests/agents/test_cli.py checks them against agents.learners.LEARNERS.
    algo: str = "at2po"
    env: str = "multihop-qa"
    model: str = DEFAULT_MODEL
    engine: str = "hf"
    device: str | None = None
    steps: int = 100
    prompts_per_step: int = (
        64  # AT²PO: 64 prompts × 22 leaves per batch (docs/algorithms/training.md "Mini-batches and micro-batches")
    )
    seed: int = 0
    holdout: int = 100
    eval_questions: int = 100
    eval_every: int = 0
    eval_at_tokens: tuple[int, ...] = ()
    eval_before: bool = True
    checkpoint_every: int = 10
    keep_checkpoints: int | None = 2
    budget_reward: float | None = None
    max_staleness: int = 0
    stream_update: bool = True
    dynamic_sampling: bool = False
    max_sampled_prompts: int | None = None
    min_round_prompts: int = 1
    max_rollout_tokens: int | None = None
    strategy: dict[str, Any] = field(default_factory=dict)
    credit: dict[str, Any] = field(default_factory=dict)
    loss: dict[str, Any] = field(default_factory=dict)
    trainer: dict[str, Any] = field(default_factory=lambda: {"mini_batches": 8})  # AT²PO: mini-batches of 8 prompts
    sampling: dict[str, Any] = field(default_factory=lambda: {"temperature": 1.0})  # every paper samples at T = 1
    rollout: dict[str, Any] = field(default_factory=dict)
    env_kwargs: dict[str, Any] = field(default_factory=dict)
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    cluster: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"unknown engine {self.engine!r}; choose one of {', '.join(ENGINES)}")
        if self.engine == "openai":
            raise ValueError(
                "engine 'openai' samples from a server's model, which cannot load the trainer's weights after each "
                "step; train with engine hf or vllm (agents eval --engine openai evaluates a served model)"
            )
        for name in ("steps", "prompts_per_step", "checkpoint_every"):
            _require_int(name, getattr(self, name), minimum=1)
        for name in ("seed", "holdout", "eval_questions", "eval_every", "max_staleness"):
            _require_int(name, getattr(self, name), minimum=0)
        keep = self.keep_checkpoints
        if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
            raise ValueError(
                f"keep_checkpoints must be an int >= 1 (the newest checkpoint always stays), or None to keep "
                f"every checkpoint; got {keep!r}"
            )
        for name in ("eval_before", "stream_update", "dynamic_sampling"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        self._check_dynamic_sampling()
        self._check_eval_at_tokens()
        if self.budget_reward is not None and not isinstance(self.budget_reward, (int, float)):
            raise ValueError(f"budget_reward must be a number or None, got {self.budget_reward!r}")
        if self.eval_questions > self.holdout:
            raise ValueError(
                f"eval_questions={self.eval_questions} is more than the {self.holdout} held-out tasks, "
                "so some would be questions the run trains on; raise holdout or lower eval_questions"
            )
        for name in SECTIONS:
            section = getattr(self, name)
            if not isinstance(section, dict):
                raise ValueError(f"section {name!r} must be a mapping of names to values, got {section!r}")
            owned = sorted(set(section) & set(_RUN_OWNED.get(name, ())))
            if owned:
                raise ValueError(
                    f"{name}.{owned[0]} is set by the run, not through the {name!r} section "
                    "(the loss, kl_coef and entropy_coef go in 'loss', total_steps follows 'steps', "
                    "device is top-level, seeds follow 'seed', the trainer's temperature is "
                    "sampling.temperature)"
                )

    def _check_eval_at_tokens(self) -> None:
        points = self.eval_at_tokens
        if not isinstance(points, (list, tuple)) or not all(
            isinstance(p, int) and not isinstance(p, bool) and p >= 1 for p in points
        ):
            raise ValueError(f"eval_at_tokens must be a list of token counts >= 1, got {points!r}")
        if list(points) != sorted(set(points)):
            raise ValueError(f"eval_at_tokens must be increasing, got {list(points)}")
        self.eval_at_tokens = tuple(points)  # a config file's or a saved config's list, as the default's tuple

    def _check_dynamic_sampling(self) -> None:
        if self.max_rollout_tokens is not None:
            _require_int("max_rollout_tokens", self.max_rollout_tokens, minimum=1)
        most = self.max_sampled_prompts
        if most is not None and (isinstance(most, bool) or not isinstance(most, int) or most < self.prompts_per_step):
            raise ValueError(
                f"max_sampled_prompts must be an int >= prompts_per_step ({self.prompts_per_step}): a step rolls out "
                f"at least its own prompts; got {most!r} (None: 3 × prompts_per_step)"
            )
        _require_int("min_round_prompts", self.min_round_prompts, minimum=1)
        if self.dynamic_sampling and self.max_staleness:
            raise ValueError(
                f"dynamic_sampling replaces a step's prompts after its rollout, but max_staleness="
                f"{self.max_staleness} has later steps take their tasks before that; set max_staleness=0 "
                "or dynamic_sampling=false"
            )

    @property
    def sampled_prompts(self) -> int:
        """The most prompts a step rolls out under ``dynamic_sampling`` (``max_sampled_prompts`` or its default)."""
        return self.max_sampled_prompts if self.max_sampled_prompts is not None else 3 * self.prompts_per_step

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> TrainConfig:
        """A config from a nested mapping (a config file's layout); unknown keys are errors."""
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(values) - set(known))
        if unknown:
            raise ValueError(f"unknown config key {unknown[0]!r}; the keys are {', '.join(known)}")
        values = copy.deepcopy(dict(values))
        trainer = values.get("trainer")
        if isinstance(trainer, dict) and isinstance(trainer.get("tensorboard"), bool):
            # config.json of runs written before trainer.report_to replaced the tensorboard switch
            trainer["report_to"] = ["tensorboard"] if trainer.pop("tensorboard") else ["none"]
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """The config as a nested, JSON-ready dict (the layout of a config file)."""
        return copy.deepcopy(dataclasses.asdict(self))

    def changed(self, other: TrainConfig) -> list[str]:
        """Dotted names of the values that differ between this config and ``other``."""
        return _differences(self.to_dict(), other.to_dict())


#: Named presets: overrides shared by every algorithm (``common``) and per-algorithm ``strategy`` sizes.
#:
#: - ``paper``: the setting of the AT²PO tables (docs/algorithms/learners.md "Reference results"), in which
#:   every learner was run: the defaults (each paper's strategy, 64 prompts in 8 mini-batches,
#:   lr 1e-6, prompt 2000 and response 6192 tokens, 6 tool calls, top-3 passages) with AT²PO's
#:   reward (−1 bad format, 0 wrong, 1 exact match), and the trainer's memory settings its memory
#:   plan needs (gradient checkpointing, micro-batches of at most 8192 tokens). For the search-QA
#:   environments on a GPU, where it generates with vLLM when that is installed and no layer names
#:   an engine (see :func:`resolve`).
#: - ``cpu-demo``: what two CPU cores train in minutes with the embedded 135M model on
#:   ``multihop-qa``: 2 prompts per step, 6 leaves per prompt for every learner (one rollout
#:   budget for all), 2 tool calls, one short search result, turns of at most 48 tokens, 256
#:   response tokens, and a learning rate 50× the papers' so that a few steps move the policy
#:   (π_old recomputed, the default: HFEngine samples from a bfloat16 copy of the trainer's model
#:   on a CPU with bfloat16 units, whose log-probs differ by up to ~0.5 nats).
#:   The prompt shows one worked episode and asks for a plain ``<answer> … </answer>``
#:   (Search-R1's format) and sampling runs at temperature 0.6: at the papers' temperature 1.0
#:   and boxed answers, none of 32 sampled episodes of the 135M model ended in the answer format
#:   with or without the example, so every reward was equal and no advantage was non-zero; at
#:   0.6 with the example, 5 of 32 answered (measured on this machine).
PRESETS: dict[str, dict[str, Any]] = {
    "paper": {
        "common": {
            "env_kwargs": {"reward": "at2po"},
            "budget_reward": -1.0,
            # From the memory plan (agents train --plan): 4 paths of up to 8192 tokens per micro-batch
            # keep ~140 GiB of activations for Qwen3-4B; one path's tokens under checkpointing, ~4 GiB.
            # Neither changes the update.
            "trainer": {"gradient_checkpointing": True, "micro_batch_tokens": 8192},
        },
        "strategy": {},
    },
    "cpu-demo": {
        "common": {
            "steps": 3,
            "prompts_per_step": 2,
            "holdout": 50,
            "eval_questions": 8,
            "checkpoint_every": 2,
            "budget_reward": -1.0,
            "trainer": {"lr": 5e-5, "mini_batches": 1, "micro_batch_size": 4},
            "sampling": {"temperature": 0.6, "max_new_tokens": 48},
            "rollout": {"max_response_tokens": 256, "concurrency": 16},
            "env_kwargs": {
                "reward": "at2po",
                "max_tool_calls": 2,
                "topk": 1,
                "result_chars": 300,
                "example": True,
                "require_boxed": False,
            },
        },
        "strategy": {
            "at2po": {"M": 4, "L": 1, "K": 2},  # 4 + 1·2 = 6 leaves
            "aepo": {"k": 6},
            "grpo": {"n": 6},
            "tree-grpo": {"M": 2, "N": 2, "L": 1, "K": 3},  # 2 trees × (1 chain + 1 round of 2) = 6 leaves
            "arpo": {"n": 6, "N": 3},
        },
    },
    # python-math:arithmetic from a cold start (docs/environments.md): the recipe of the probes in
    # benchmarks/results/arithmetic_grpo_probe.json, 8 prompts x 8 leaves for every learner.
    "cpu-arithmetic": {
        "common": {
            "env": "python-math:arithmetic",
            "steps": 12,  # a cap: the rollout budget below ends a run first (3 steps of ~13,500 tokens)
            "prompts_per_step": 8,
            "holdout": 500,
            "eval_questions": 200,
            "checkpoint_every": 12,
            # One epoch of demonstrations leaves ~15% of prompts with reward variance: sample up to 4x as
            # many for the 8 with signal (DAPO's dynamic sampling; the dropped ones' tokens count too).
            "dynamic_sampling": True,
            "max_sampled_prompts": 32,
            "max_rollout_tokens": 40_000,
            "trainer": {"lr": 2e-5, "mini_batches": 1, "micro_batch_size": 4},
            "sampling": {"temperature": 1.0, "max_new_tokens": 64},
            "rollout": {"max_response_tokens": 192, "concurrency": 64},
            "env_kwargs": {"max_tool_calls": 2},
        },
        "strategy": {
            "at2po": {"M": 4, "L": 1, "K": 4},  # 4 + 1·4 = 8 leaves
            "aepo": {"k": 8},
            "grpo": {"n": 8},
            "tree-grpo": {"M": 2, "N": 3, "L": 1, "K": 4},  # 2 trees × (1 chain + 1 round of 3) = 8 leaves
            "arpo": {"n": 8, "N": 4},
        },
    },
}


def preset(name: str, algo: str | None) -> dict[str, Any]:
    """The overrides of the preset ``name`` for ``algo``, as a nested mapping (``None``: the common ones only)."""
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; choose one of {', '.join(PRESETS)}")
    chosen = PRESETS[name]
    return merge(chosen["common"], {"strategy": chosen["strategy"].get(algo, {})})


@dataclass(frozen=True)
class RunParts:
    """The objects a :class:`TrainConfig` describes.

    Attributes:
        learner: Strategy, credit and loss with the config's hyper-parameters.
        trainer: The trainer's configuration (the learner's loss, ``total_steps = steps``).
        tree: The rollout's configuration, without a seed (the run seeds every step).
        cluster: The processes of the run (default: one).
    """

    learner: Learner
    trainer: TrainerConfig
    tree: TreeConfig
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


def build(config: TrainConfig, learner: Learner | None = None) -> RunParts:
    """The parts of the run ``config`` describes; ``learner`` replaces ``config.algo``'s learner.

    Section values are checked by the classes they go to; an unknown name is an error that lists
    the known ones. ``learner`` takes the ``strategy`` section only from a config made for it
    (``config.algo`` is its name, as :func:`resolve` with ``learner=`` makes it): a section for another
    algo is an error, since it would replace the learner's own strategy sizes with that algo's (a
    preset's, say). The ``credit`` and ``loss`` sections apply to any learner.
    """
    from agents.learners import LEARNERS
    from agents.rollout.episodes import RolloutConfig
    from agents.rollout.strategies import Budget
    from agents.rollout.tree_loop import TreeConfig
    from agents.training.trainer_config import TrainerConfig

    own = learner is not None
    if learner is None:
        if config.algo not in LEARNERS:
            raise ValueError(
                f"unknown algo {config.algo!r}; choose one of {', '.join(LEARNERS)}, "
                "or pass your own learner to agents.run.train.train"
            )
        learner = LEARNERS[config.algo]()
    elif config.strategy and config.algo != learner.name:
        raise ValueError(
            f"the config's strategy section {config.strategy} is for algo {config.algo!r} (a preset fills it with "
            f"the sizes of that learner's strategy), but the learner passed in is {learner.name!r}, whose strategy "
            f"is {learner.strategy!r}: the section would replace its sizes; resolve the config for your learner "
            f"with agents.run.config.resolve(..., learner=yours), which leaves a preset's strategy sizes out, or set "
            f"algo to {learner.name!r} to apply the section to it"
        )
    loss = dict(config.loss)
    kl_coef = loss.pop("kl_coef", learner.kl_coef)
    entropy_coef = loss.pop("entropy_coef", 0.0)
    try:
        learner = learner.configure(strategy=config.strategy)
    except ValueError as error:
        if not own:
            raise
        raise ValueError(
            f"{error}: the config's strategy section {config.strategy} does not fit the learner passed in "
            f"({learner.strategy!r}); leave the section empty to keep the learner's own sizes "
            "(agents.run.config.resolve(..., learner=yours) leaves a preset's out)"
        ) from None
    learner = learner.configure(credit=config.credit, loss=loss, kl_coef=kl_coef)
    sampling = SamplingParams(**_checked(SamplingParams, config.sampling, "sampling"))
    if sampling.greedy:
        raise ValueError(
            "sampling.temperature is 0 (greedy): every sample of a prompt would be the same; "
            "train at a temperature above 0 (the papers: 1.0)"
        )
    cluster = ClusterConfig.from_dict(config.cluster)
    if config.max_staleness and not cluster.rollout_workers:
        raise ValueError(
            f"max_staleness={config.max_staleness} rolls out while the trainer updates, which needs rollout workers "
            "of their own: --rollout-workers 1 (or more), or max_staleness=0"
        )
    if cluster.in_flight_updates and (cluster.worker_engine or config.engine) != "hf":
        raise ValueError(
            f"cluster.in_flight_updates=true needs HFEngine workers, which record the weights that sampled each "
            f"token; the workers' engine is {cluster.worker_engine or config.engine!r} (vLLM's engines do not say): "
            "cluster.worker_engine=hf, or cluster.in_flight_updates=false"
        )
    trainer_values = _checked(TrainerConfig, config.trainer, "trainer")
    if config.max_staleness and "decoupled" not in trainer_values:
        # Trees sampled by older weights: the decoupled objective, unless the run says otherwise.
        if trainer_values.get("old_logprobs", TrainerConfig.old_logprobs) != "recompute":
            raise ValueError(
                f"max_staleness={config.max_staleness} trains on trees sampled by older weights, with the decoupled "
                "objective, which needs the recomputed log-probs as the proximal policy: --set "
                "trainer.old_logprobs=recompute (or --set trainer.decoupled=false to train without it)"
            )
        trainer_values["decoupled"] = True
    # The trainer scores tokens under the distribution they were sampled from (logits / T).
    trainer = learner.trainer_config(
        **trainer_values,
        entropy_coef=entropy_coef,
        total_steps=config.steps,
        device=config.device,
        temperature=sampling.temperature,
    )
    rollout = dict(config.rollout)
    if "budget" in rollout:
        if not isinstance(rollout["budget"], Mapping):
            raise ValueError(f"rollout.budget must be a mapping of Budget fields, got {rollout['budget']!r}")
        rollout["budget"] = Budget(**_checked(Budget, rollout["budget"], "rollout.budget"))
    _check_engine_kwargs(config.engine, config.engine_kwargs)
    # One flat section for the turns' RolloutConfig and the tree's own TreeConfig fields.
    _checked_rollout(rollout)
    turns = {name: rollout.pop(name) for name in _rollout_fields(RolloutConfig) if name in rollout}
    tree = TreeConfig(rollout=RolloutConfig(sampling=sampling, **turns), **rollout)
    return RunParts(learner, trainer, tree, cluster)


def effective_config(config: TrainConfig, parts: RunParts) -> TrainConfig:
    """``config`` with every section filled with every value ``parts`` use (what ``config.json`` holds)."""
    from agents.rollout.episodes import RolloutConfig
    from agents.rollout.tree_loop import TreeConfig
    from agents.training.losses import LOSSES

    learner = parts.learner
    loss = learner.loss if callable(learner.loss) else LOSSES[learner.loss]
    trainer = {name: value for name, value in parts.trainer.to_dict().items() if name not in _RUN_OWNED["trainer"]}
    tree = parts.tree
    rollout = {
        **{name: getattr(tree.rollout, name) for name in _rollout_fields(RolloutConfig)},
        **{name: getattr(tree, name) for name in _rollout_fields(TreeConfig)},
    }
    rollout["budget"] = dataclasses.asdict(rollout["budget"])
    sampling = {
        f.name: getattr(tree.rollout.sampling, f.name)
        for f in dataclasses.fields(tree.rollout.sampling)
        if f.name not in _RUN_OWNED["sampling"]
    }
    sampling.update(stop=list(sampling["stop"]), stop_token_ids=list(sampling["stop_token_ids"]))
    return dataclasses.replace(
        config,
        algo=learner.name,
        strategy=_fields(learner.strategy),
        credit=_fields(learner.credit),
        loss={
            **_loss_defaults(loss),
            **learner.loss_kwargs,
            "kl_coef": learner.kl_coef,
            "entropy_coef": parts.trainer.entropy_coef,
        },
        trainer=trainer,
        rollout=rollout,
        sampling=sampling,
        env_kwargs=copy.deepcopy(config.env_kwargs),
        engine_kwargs=copy.deepcopy(config.engine_kwargs),
        cluster=dataclasses.asdict(parts.cluster),
    )


def resolve(
    *,
    base: Mapping[str, Any] | None = None,
    preset_name: str | None = None,
    file: str | Path | None = None,
    values: Mapping[str, Any] | None = None,
    assignments: Sequence[str] = (),
    learner: Learner | None = None,
) -> TrainConfig:
    """A config from its layers, each overriding the one before.

    Args:
        base: A config as a mapping (a resumed run's ``config.json``); default: the defaults.
        preset_name: A preset of :data:`PRESETS`, for the algorithm the later layers (or ``base``) name.
            ``paper`` on a GPU also chooses the engine when no layer (nor ``base``) names one: ``vllm``
            if vLLM is installed, else ``hf`` with a warning on stderr of what that costs.
        file: A YAML or JSON config file.
        values: Top-level values (the command line's flags).
        assignments: ``KEY=VALUE`` strings (``--set``), see :func:`parse_overrides`.
        learner: The learner you will pass to :func:`agents.run.train.train`: the config is made for it
            (``algo`` is its name), and a preset then sets only what it shares between algorithms,
            not the strategy sizes of its own learners, so that yours keeps its own. A layer that
            names another algo is an error.
    """
    layers = [load_config_file(file) if file is not None else {}, dict(values or {}), parse_overrides(assignments)]
    merged = copy.deepcopy(dict(base)) if base is not None else TrainConfig().to_dict()
    if learner is not None:
        given = [layer for layer in (*layers, base or {}) if "algo" in layer]
        other = next((layer["algo"] for layer in given if layer["algo"] != learner.name), None)
        if other is not None:
            raise ValueError(
                f"the config names algo {other!r}, but it is resolved for the learner {learner.name!r} (learner=); "
                "drop that algo: the learner's name is the run's algo"
            )
        merged["algo"] = learner.name
        algo = None  # preset(name, None): the preset's common settings only
    else:
        algo = next((layer["algo"] for layer in reversed(layers) if "algo" in layer), merged.get("algo"))
    if preset_name is not None:
        merged = merge(merged, preset(preset_name, algo))
    for layer in layers:
        merged = merge(merged, layer)
    if preset_name == "paper" and not any("engine" in layer for layer in (*layers, base or {})):
        merged["engine"] = _paper_engine(merged.get("device"))
    return TrainConfig.from_dict(merged)


# What `--preset paper` on a GPU without vLLM prints. ~10x is issue 37's estimate from its H200 run, where
# HFEngine decoded 61 tokens/s for one request and 410 for 16 (SmolLM2-135M's shape, bfloat16; vLLM was not there).
_PAPER_WITHOUT_VLLM = "warning: HFEngine generates ~10x slower than vLLM on a GPU; install vllm for --preset paper"


def _paper_engine(device: str | None) -> str:
    """The engine of ``--preset paper`` when no layer names one: vLLM on a GPU where it is installed, else HFEngine
    (on a GPU with a warning on stderr of what that costs)."""
    if device is not None and not str(device).startswith("cuda"):
        return "hf"
    import torch  # only here: the parser of `agents train` reads this module and must not load torch

    if not torch.cuda.is_available():
        return "hf"
    if importlib.util.find_spec("vllm") is not None:
        return "vllm"
    print(_PAPER_WITHOUT_VLLM, file=sys.stderr)
    return "hf"


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The nested mapping in a YAML (``.yaml``/``.yml``) or JSON (``.json``) file."""
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if path.suffix in (".yaml", ".yml"):
        import yaml

        try:
            values = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ValueError(f"config file {path} is not valid YAML: {error}") from None
    elif path.suffix == ".json":
        try:
            values = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"config file {path} is not valid JSON: {error}") from None
    else:
        raise ValueError(f"config file {path} must end in .yaml, .yml or .json")
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise ValueError(f"config file {path} must hold a mapping of keys to values, found {type(values).__name__}")
    return values


def parse_overrides(
    assignments: Sequence[str], flag: str = "--set", example: str = "trainer.lr=1e-5"
) -> dict[str, Any]:
    """``["trainer.lr=1e-5", "strategy.K=3"]`` as a nested mapping; values are read as YAML.

    ``flag`` and ``example`` name the command-line option in the error for a malformed assignment.

    Any float notation is a float (``1e-5``, which YAML alone reads as a string); ``true``,
    ``false``, ``null``, ``[1, 2]`` and ``{a: 1}`` are what YAML makes of them; anything else is
    a string.
    """
    import yaml

    nested: dict[str, Any] = {}
    for assignment in assignments:
        key, sep, text = assignment.partition("=")
        parts = key.strip().split(".")
        if not sep or not all(parts):
            raise ValueError(f"{flag} takes KEY=VALUE (e.g. {example}), got {assignment!r}")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        if isinstance(value, str):
            try:
                value = float(value)
            except ValueError:
                pass
        target = nested
        for part in parts[:-1]:
            target = target.setdefault(part, {})
            if not isinstance(target, dict):
                raise ValueError(f"--set {assignment!r} sets a field inside {part!r}, which is already a value")
        target[parts[-1]] = value
    return nested


def merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """``base`` with ``override`` laid over it; mappings merge key by key, other values replace."""
    merged = copy.deepcopy(dict(base))
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), Mapping):
            merged[key] = merge(merged[key], value)
        else:
            merged[key] = copy.deepcopy(value)
    return merged


def _checked(cls: type, values: Mapping[str, Any], section: str) -> dict[str, Any]:
    """``values`` if every name is an init field of dataclass ``cls``; else an error listing them."""
    names = [f.name for f in dataclasses.fields(cls) if f.init and f.name not in _RUN_OWNED.get(section, ())]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"{section} has no setting {unknown[0]!r}; the settings are {', '.join(names)}")
    return dict(values)


def _check_engine_kwargs(engine: str, values: Mapping[str, Any]) -> None:
    """HFEngine takes only its own keyword arguments; vLLM's engine arguments are checked by vLLM."""
    if engine != "hf":
        return
    from agents.engines.hf import HFEngine

    names = [name for name in inspect.signature(HFEngine).parameters if name not in _RUN_OWNED["engine_kwargs"]]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(
            f"engine_kwargs has no setting {unknown[0]!r} for the hf engine; its settings are {', '.join(names)} "
            "(vLLM's engine arguments need --engine vllm)"
        )


def _rollout_fields(cls: type) -> list[str]:
    """The fields of ``cls`` (RolloutConfig or TreeConfig) that the flat ``rollout`` section sets."""
    return [f.name for f in dataclasses.fields(cls) if f.init and f.name not in _RUN_OWNED["rollout"]]


def _checked_rollout(values: Mapping[str, Any]) -> None:
    """Every name of the ``rollout`` section is a field of RolloutConfig or TreeConfig; else an error listing them."""
    from agents.rollout.episodes import RolloutConfig
    from agents.rollout.tree_loop import TreeConfig

    names = _rollout_fields(RolloutConfig) + _rollout_fields(TreeConfig)
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"rollout has no setting {unknown[0]!r}; the settings are {', '.join(names)}")


def _fields(part: Any) -> dict[str, Any]:
    """A strategy's or credit's init fields (empty for a part that is not a dataclass)."""
    if not dataclasses.is_dataclass(part):
        return {}
    return {f.name: getattr(part, f.name) for f in dataclasses.fields(part) if f.init}


def _loss_defaults(loss: Any) -> dict[str, Any]:
    """The keyword hyper-parameters of a loss function with their defaults (no tensors, no KL)."""
    from agents.training.losses import TRAINER_INPUTS

    skip = set(TRAINER_INPUTS)
    parameters = list(inspect.signature(loss).parameters.values())[4:]  # after the four tensors
    return {
        p.name: p.default
        for p in parameters
        if p.name not in skip
        and p.default is not inspect.Parameter.empty
        and p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
    }


def _require_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        found: list[str] = []
        for key in sorted(set(a) | set(b)):
            found += _differences(a.get(key), b.get(key), f"{prefix}{key}.")
        return found
    return [] if a == b else [prefix.rstrip(".")]
