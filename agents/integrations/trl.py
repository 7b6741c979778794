"""AT²PO's and AEPO's losses in TRL's ``GRPOTrainer``, and agentenv environments as its rollout function.

Two pieces, usable together or apart (extra ``[trl]``; tested with TRL 1.16.0):

- :class:`AgentsGRPOTrainer` is ``GRPOTrainer`` with one method replaced, ``_compute_loss``. When
  ``GRPOConfig.loss_type`` names one of this project's losses (``"atpo"``, ``"aepo"``, ``"gspo"``,
  ``"ppo_clip"`` or a name given to :func:`~agents.training.losses.register_loss`), the tensors TRL
  computes (per-token log-probs and entropies from its own forward pass, old log-probs, advantages,
  the completion mask times its tool mask) go to that loss unchanged; any other ``loss_type`` is
  TRL's own. TRL 1.16 has no hook for a loss (its loss types are branches inside
  ``_compute_loss``), so replacing that method is the least invasive way in.
- :class:`AgentEnvRollout` is a ``rollout_func``: each prompt's episode is played in an agentenv
  environment through :class:`~agentenv.wrappers.TokenEnv` by :func:`~agents.rollout.run_episodes`,
  with an engine on the trainer's own model, and TRL gets the exact sampled ids, a mask that is 0
  on the observation tokens (TRL's ``env_mask``) and the environment's reward
  (:func:`environment_reward`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from datasets import Dataset
from peft import PeftModel
from transformers import PreTrainedModel
from trl import GRPOConfig, GRPOTrainer

from agentenv.core import run_sync
from agentenv.wrappers import TokenEnv
from agents.engines.base import DEFAULT_MAX_NEW_TOKENS, Engine, SamplingParams
from agents.engines.hf import HFEngine
from agents.rollout.episodes import (
    DEFAULT_CONCURRENCY,
    DEFAULT_MAX_PROMPT_TOKENS,
    DEFAULT_MAX_RESPONSE_TOKENS,
    RolloutConfig,
    run_episodes,
    task_episode,
)
from agents.training.losses import LOSSES, TRAINER_INPUTS, LossFn

__all__ = ["AgentEnvRollout", "AgentsGRPOTrainer", "environment_reward"]

#: GRPOConfig settings that act only inside TRL's own losses: the value that leaves each off, and why
#: another value is refused with this project's losses rather than silently ignored.
_TRL_LOSS_SETTINGS: dict[str, tuple[Any, str]] = {
    "epsilon": (0.2, "it is the clip range of TRL's losses; set eps_low in loss_kwargs"),
    "epsilon_high": (None, "it is the clip range of TRL's losses; set eps_high in loss_kwargs"),
    "delta": (None, "TRL's two-sided clip is not part of these losses"),
    "importance_sampling_level": ("token", "ATPO and GSPO define their own level (turn, sequence)"),
    "top_entropy_quantile": (1.0, "masking tokens would split ATPO's turns and move AEPO's entropy statistics"),
    "off_policy_mask_threshold": (None, "TRL's off-policy sequence mask is not part of these losses"),
    "use_adaptive_entropy": (False, "set a constant entropy_coef"),
}

#: The multimodal inputs TRL's ``_compute_loss`` forwards to its scoring pass; forwarded the same way.
_MODEL_INPUTS = (
    "pixel_values",
    "image_grid_thw",
    "num_images",
    "pixel_attention_mask",
    "spatial_shapes",
    "num_tiles",
    "image_sizes",
    "token_type_ids",
    "mm_token_type_ids",
    "image_position_ids",
)


class AgentsGRPOTrainer(GRPOTrainer):
    """TRL's ``GRPOTrainer`` whose ``loss_type`` may also be one of this project's losses.

    ``AgentsGRPOTrainer(model, reward_funcs, args=GRPOConfig(loss_type="atpo", ...))`` trains with
    :func:`~agents.training.losses.atpo_loss`; everything else (generation, rewards, group advantages,
    the optimiser, logging) is TRL's. ``loss_kwargs`` are the loss's hyper-parameters (``eps_low``,
    ``eps_high``, ``agg``, AEPO's ``entropy_advantage_coef`` …); without them the loss runs with its
    papers' defaults (docs/algorithms/losses.md "Losses"), not with ``GRPOConfig.epsilon``. ``GRPOConfig.beta``
    is the loss's ``kl_coef`` (with TRL's reference log-probs) and ``GRPOConfig.entropy_coef`` its
    ``entropy_coef``.

    What TRL's tensors become: the loss's ``mask`` is ``completion_mask × tool_mask``, so the
    observation tokens of a multi-turn completion are off it and ATPO finds its turns as the runs of
    1s (docs/algorithms/losses.md eq. 44; TRL has no turn ids); ``advantages`` is TRL's one advantage per
    completion on each of its tokens; ``old_logprobs`` TRL's recomputed ones, or the current ones
    detached when TRL skips them on-policy; AEPO's ``entropy`` is the entropy TRL's fused head
    computes in the same forward pass. The loss's metrics are logged as ``<loss_type>/<name>``.

    Settings of TRL's own losses that these losses do not have (``epsilon``, ``delta``,
    ``importance_sampling_level="sequence"``, ``top_entropy_quantile``, ``off_policy_mask_threshold``,
    adaptive entropy, vLLM importance-sampling correction, a MoE router loss) are refused.
    """

    def __init__(self, *args: Any, loss_kwargs: Mapping[str, Any] | None = None, **kwargs: Any) -> None:
        config = inspect.signature(GRPOTrainer.__init__).bind(self, *args, **kwargs).arguments.get("args")
        loss_fn = LOSSES.get(config.loss_type) if isinstance(config, GRPOConfig) else None
        self.loss_kwargs: dict[str, Any] = dict(loss_kwargs or {})
        if loss_fn is None and self.loss_kwargs:
            raise ValueError(
                "loss_kwargs are hyper-parameters of this project's losses; GRPOConfig.loss_type names none "
                f"({config.loss_type if isinstance(config, GRPOConfig) else 'dapo'!r}; choose one of {', '.join(LOSSES)})"
            )
        if loss_fn is not None and isinstance(config, GRPOConfig):  # checked before TRL loads the model
            self._loss_inputs, self._agg = _loss_parameters(loss_fn, self.loss_kwargs, config)
        super().__init__(*args, **kwargs)
        self.loss_fn: LossFn | None = loss_fn
        if loss_fn is not None and self.aux_loss_enabled:
            raise ValueError(
                f"loss_type={self.loss_type!r} does not add a Mixture-of-Experts router loss; set "
                "GRPOConfig.router_aux_loss_coef=0.0"
            )

    def _compute_loss(self, model: torch.nn.Module, inputs: dict[str, Any]) -> torch.Tensor:
        if self.loss_fn is None:
            return super()._compute_loss(model, inputs)
        completion_ids, completion_mask = inputs["completion_ids"], inputs["completion_mask"]
        # TRL's own scoring pass (its fused head at the sampling temperature): the tensors its losses get
        logprobs, entropy, _ = self._get_per_token_logps_and_entropies(
            model,
            torch.cat([inputs["prompt_ids"], completion_ids], dim=1),
            torch.cat([inputs["prompt_mask"], completion_mask], dim=1),
            completion_ids.size(1),
            compute_entropy=True,
            **{name: inputs.get(name) for name in _MODEL_INPUTS},
        )
        # tool_mask (a rollout_func's env_mask) is 0 on tool and observation tokens: never trained
        mask = completion_mask if "tool_mask" not in inputs else completion_mask * inputs["tool_mask"]
        advantages = inputs["advantages"]
        if advantages.dim() == 1:  # one advantage a completion, on each of its tokens
            advantages = advantages.unsqueeze(1).expand_as(logprobs)
        old_logprobs = inputs.get("old_per_token_logps")
        if old_logprobs is None:  # TRL skips recomputing them when the update is on-policy
            old_logprobs = logprobs.detach()
        given = {
            "entropy": entropy,
            "ref_logprobs": inputs.get("ref_per_token_logps"),
            "kl_coef": self.beta,
            "entropy_coef": self.entropy_coef,
        }
        loss, metrics = self.loss_fn(
            logprobs,
            old_logprobs,
            advantages,
            mask,
            **self.loss_kwargs,
            **{name: value for name, value in given.items() if name in self._loss_inputs},
        )
        mode = "train" if _model(self).training else "eval"
        self._log_loss_metrics(metrics, mode)
        return loss * self._share(mask, inputs, mode)

    def _share(self, mask: torch.Tensor, inputs: dict[str, Any], mode: str) -> torch.Tensor | float:
        """This micro-batch's weight in the gradient TRL accumulates (docs/algorithms/training.md eq. 58)."""
        if mode != "train":  # TRL neither splits nor accumulates in evaluation
            return 1.0
        if self._agg == "token-mean":
            # u_j / Σ u: its action tokens over the accumulation window's, the window as TRL's "dapo" counts it
            window = (
                inputs["num_items_in_batch"]
                / self.accelerator.num_processes
                * self.current_gradient_accumulation_steps
                / _config(self).steps_per_generation
            )
            return mask.sum() / window.clamp(min=1)
        # seq-mean modes: TRL's micro-batches hold equally many completions, so each weighs the same
        return 1.0 / self.current_gradient_accumulation_steps

    def _log_loss_metrics(self, metrics: Mapping[str, float], mode: str) -> None:
        if not metrics:
            return
        names = sorted(metrics)
        local = torch.tensor([float(metrics[name]) for name in names], device=self.accelerator.device)
        means = self.accelerator.gather(local).view(-1, len(names)).mean(0)  # over the processes
        for name, value in zip(names, means.tolist()):
            self._metrics[mode][f"{self.loss_type}/{name}"].append(value)


def _loss_parameters(
    loss_fn: LossFn, loss_kwargs: Mapping[str, Any], config: GRPOConfig
) -> tuple[frozenset[str], str | None]:
    """Which trainer inputs the loss takes, and its aggregation; checks the config against the loss."""
    for name, (off, why) in _TRL_LOSS_SETTINGS.items():
        if getattr(config, name) != off:
            raise ValueError(
                f"GRPOConfig.{name}={getattr(config, name)!r} with loss_type={config.loss_type!r}: {why} "
                f"(leave it at {off!r})"
            )
    if config.use_vllm and config.vllm_importance_sampling_correction:
        raise ValueError(
            f"loss_type={config.loss_type!r} returns the aggregated loss, so TRL cannot weight its tokens by the vLLM "
            "importance-sampling ratio; set GRPOConfig.vllm_importance_sampling_correction=False"
        )
    parameters = inspect.signature(loss_fn).parameters
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values())
    reserved = sorted(set(loss_kwargs) & set(TRAINER_INPUTS))
    if reserved:
        raise ValueError(
            f"loss_kwargs sets {reserved}, which the trainer supplies: kl_coef is GRPOConfig.beta, entropy_coef "
            "GRPOConfig.entropy_coef, and the tensors come from TRL"
        )
    unknown = [] if takes_any else sorted(set(loss_kwargs) - set(parameters))
    if unknown:
        raise ValueError(f"loss {config.loss_type!r} has no parameter {', '.join(unknown)}")
    taken = frozenset(name for name in TRAINER_INPUTS if takes_any or name in parameters)
    needed = {"ref_logprobs": config.beta != 0, "entropy_coef": config.entropy_coef != 0}
    missing = [name for name, need in needed.items() if need and name not in taken]
    if missing:
        raise ValueError(
            f"loss {config.loss_type!r} takes no {', '.join(missing)}: set GRPOConfig.beta and entropy_coef to 0"
        )
    agg = loss_kwargs.get("agg", parameters["agg"].default if "agg" in parameters else None)
    return taken, agg


class AgentEnvRollout:
    """TRL's ``rollout_func`` for an agentenv environment: one episode per prompt, exact token ids.

    ``rollout = AgentEnvRollout(TokenEnv(agentenv.make("multihop-qa"), tokenizer))`` with the model's
    tokenizer; ``rollout.dataset(range(64))`` is the ``train_dataset`` (its ``prompt`` column holds each
    task's first observation, by which a prompt finds its task again); then
    ``GRPOTrainer(..., reward_funcs=environment_reward, train_dataset=..., rollout_func=rollout)``.

    Each call plays one episode per prompt TRL passes (TRL repeats a prompt ``num_generations``
    times), each on a fork of the env, with :func:`~agents.rollout.run_episodes`. TRL gets
    ``prompt_ids`` (the task under the chat template, as :class:`TokenEnv` renders it), ``completion_ids``
    (every action and observation after it, the actions exactly as sampled), ``env_mask`` (1 on action
    tokens, 0 on observations), ``logprobs`` (the sampler's; 0 on observations, as in TRL's tool loop)
    and ``env_reward`` (the episode's return). Sampling follows ``GRPOConfig`` (``temperature``, ``top_p``,
    ``top_k``); ``max_completion_length`` is the response budget of actions and observations together
    (as TRL's tool loop counts it); ``max_new_tokens`` caps one turn and ``max_prompt_tokens`` the
    prompt.

    ``engine(trainer)`` builds the engine on the first call; by default an
    :class:`~agents.engines.hf.HFEngine` on the trainer's model (the same weights, CPU or GPU, nothing to
    sync). An engine with weights of its own must be kept in sync by whoever builds it. The sampled
    episodes are chains: rollout trees (AT²PO's branching) need this project's own loop.
    """

    def __init__(
        self,
        env: TokenEnv,
        *,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
        concurrency: int = DEFAULT_CONCURRENCY,
        engine: Callable[[GRPOTrainer], Engine] | None = None,
    ) -> None:
        if not isinstance(env, TokenEnv):
            raise TypeError(f"AgentEnvRollout needs an agentenv TokenEnv(env, tokenizer), got {type(env).__name__}")
        self.env = env
        self.max_new_tokens = max_new_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self.concurrency = concurrency
        self._build_engine = engine
        self._engine: Engine | None = None
        self._tasks: dict[str, int] = {}

    def dataset(self, tasks: Iterable[int]) -> Dataset:
        """A TRL dataset of these tasks: ``prompt`` (the task's first observation) and ``task``."""
        prompts, indices = [], []
        for task in tasks:
            episode = task_episode(self.env, task)
            try:
                options = dict(episode.options) if episode.options else None
                observation, _ = episode.env.env.reset(seed=episode.seed, options=options)
            finally:
                episode.env.close()
            self._tasks.setdefault(observation, task)  # tasks with the same text are the same prompt
            prompts.append(observation)
            indices.append(task)
        return Dataset.from_dict({"prompt": prompts, "task": indices})

    def __call__(self, prompts: list[Any], trainer: GRPOTrainer) -> dict[str, list[Any]]:
        """Play one episode per prompt; returns TRL's rollout fields and ``env_mask``, ``env_reward``."""
        if trainer.mask_truncated_completions:
            raise ValueError(
                "an agentenv episode ends on the environment's last action, not always on an EOS token, so TRL "
                "would take it for truncated and drop it; set GRPOConfig.mask_truncated_completions=False"
            )
        args, model = _config(trainer), _model(trainer)
        engine = self._engine_for(trainer)
        episodes = [task_episode(self.env, self._task_of(prompt)) for prompt in prompts]
        config = RolloutConfig(
            sampling=_sampling(args, self.max_new_tokens),
            concurrency=self.concurrency,
            max_prompt_tokens=self.max_prompt_tokens,
            max_response_tokens=args.max_completion_length or DEFAULT_MAX_RESPONSE_TOKENS,
        )
        was_training = model.training
        model.eval()  # no dropout while sampling
        try:
            trajectories = run_sync(run_episodes(engine, episodes, config))
        finally:
            model.train(was_training)
            for episode in episodes:
                episode.env.close()
        failed = [t for t in trajectories if not t.ok]
        if failed:
            raise RuntimeError(f"{len(failed)} of {len(trajectories)} episodes failed; the first: {failed[0].error}")
        starts = [len(t.prompt_ids) for t in trajectories]
        return {
            "prompt_ids": [t.prompt_ids for t in trajectories],
            "completion_ids": [t.ids[start:] for t, start in zip(trajectories, starts)],
            "logprobs": [
                [0.0 if lp is None else lp for lp in t.sampler_logprobs[start:]]
                for t, start in zip(trajectories, starts)
            ],
            "env_mask": [t.mask[start:] for t, start in zip(trajectories, starts)],
            "env_reward": [t.reward for t in trajectories],
        }

    def close(self) -> None:
        """Close the engine this rollout built (its worker thread)."""
        if self._engine is not None:
            run_sync(self._engine.close())
            self._engine = None

    def _task_of(self, prompt: Any) -> int:
        if not isinstance(prompt, str) or prompt not in self._tasks:
            raise ValueError(
                "a prompt that is not the first observation of a task from this rollout's dataset(); "
                "build train_dataset with rollout.dataset(tasks)"
            )
        return self._tasks[prompt]

    def _engine_for(self, trainer: GRPOTrainer) -> Engine:
        if self._engine is None:
            if self._build_engine is not None:
                self._engine = self._build_engine(trainer)
            elif _config(trainer).use_vllm:
                raise ValueError(
                    "AgentEnvRollout samples with an agents engine on the trainer's model, not with TRL's vLLM; "
                    "set GRPOConfig.use_vllm=False, or pass engine= to build one yourself"
                )
            else:
                self._engine = HFEngine(_model(trainer), self.env.tokenizer, seed=_config(trainer).seed)
        return self._engine


def _config(trainer: GRPOTrainer) -> GRPOConfig:
    if not isinstance(trainer.args, GRPOConfig):  # GRPOTrainer makes one when given none
        raise TypeError(f"a GRPOTrainer's args are a GRPOConfig, got {type(trainer.args).__name__}")
    return trainer.args


def _model(trainer: GRPOTrainer) -> PreTrainedModel | PeftModel:
    if not isinstance(trainer.model, PreTrainedModel | PeftModel):
        raise TypeError(f"a GRPOTrainer trains a transformers (or peft) model, got {type(trainer.model).__name__}")
    return trainer.model


def _sampling(args: GRPOConfig, max_new_tokens: int) -> SamplingParams:
    """GRPOConfig's sampling settings as the engines' :class:`SamplingParams` for one turn."""
    if args.min_p is not None or args.repetition_penalty != 1.0 or args.generation_kwargs:
        raise ValueError(
            "AgentEnvRollout samples with temperature, top_p and top_k only; leave GRPOConfig.min_p None, "
            "repetition_penalty 1.0 and generation_kwargs unset"
        )
    top_k = args.top_k if args.top_k else -1  # TRL's 0 and our -1 both mean no top-k filter
    return SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=top_k, max_new_tokens=max_new_tokens)


def environment_reward(env_reward: list[float], **kwargs: Any) -> list[float]:
    """TRL reward function: each completion's episode return, as :class:`AgentEnvRollout` reported it."""
    return [float(reward) for reward in env_reward]
