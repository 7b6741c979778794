"""AT²PO's and AEPO's losses, turn-wise credit and agentenv episodes inside verl's trainer.

verl (extra ``[verl]``; tested with verl 0.9.1) imports this module through the ``verl.plugins``
entry point when ``import verl`` runs, in the driver and in every Ray worker; importing it
registers the same names. What it adds to verl's registries:

- policy loss ``atpo`` (``actor_rollout_ref.actor.policy_loss.loss_mode: atpo``):
  :func:`~agents.training.losses.atpo_loss` on the tensors verl's ``ppo_loss`` hands a policy loss.
  A turn is a maximal run of ``response_mask`` = 1 tokens, as in ATPO's own code. The clip range
  is verl's ``clip_ratio_low``/``clip_ratio_high`` (AT²PO's are 3e-3 and 4e-3), the aggregation
  verl's ``loss_agg_mode``; verl's KL loss and entropy bonus are added by verl around it.
- policy loss ``aepo``: :func:`~agents.training.losses.aepo_loss`. It needs the per-token entropy
  of the training forward pass, which verl's policy-loss signature does not carry, so it runs only
  inside :func:`aepo_ppo_loss`, a replacement for verl's ``ppo_loss`` to install with the actor
  worker group's ``set_loss_fn`` (with ``actor.calculate_entropy: true``).
- advantage estimator ``at2po_turnwise`` (``algorithm.adv_estimator: at2po_turnwise``):
  :func:`~agents.training.credit.turnwise_credit` on the tree of each prompt (see
  :func:`turnwise_advantages` for how the tree is read from what verl passes).
- agent loop ``agentenv`` (``actor_rollout_ref.rollout.agent.default_agent_loop: agentenv``):
  :class:`AgentenvAgentLoop`, one agentenv episode per verl sample through
  :class:`~agentenv.wrappers.TokenEnv`, sampled by verl's own rollout servers.

verl's losses are summed over micro-batches and normalised by the global batch (``agg_loss``
with ``global_batch_info``); this project's losses normalise by the micro-batch they see. The
registered losses call ours and rescale the result by local/global tokens (or sequences) × the
data-parallel size, which is exactly verl's normalisation, so on one micro-batch the loss and its
gradient are ours unchanged.
"""

from __future__ import annotations

import contextvars
import functools
import json
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, cast
from uuid import uuid4

import torch
from datasets import Dataset
from omegaconf import DictConfig, OmegaConf
from tensordict import TensorDict
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register
from verl.trainer.ppo.core_algos import register_adv_est, register_policy_loss
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import no_padding_2_padding

import agentenv
from agentenv.core import Env
from agentenv.wrappers import TokenEnv
from agentenv.wrappers.token_env import skip_special_decoder
from agents.engines.base import DEFAULT_MAX_NEW_TOKENS, Completion, Engine, FinishReason, SamplingParams, find_stop
from agents.rollout.episodes import RolloutConfig, run_episode, task_episode
from agents.rollout.tree import Node, RolloutTree
from agents.training.credit import turnwise_credit
from agents.training.losses import AGGREGATIONS, aepo_loss, atpo_loss

__all__ = [
    "AgentenvAgentLoop",
    "VerlServerEngine",
    "aepo_policy_loss",
    "aepo_ppo_loss",
    "atpo_policy_loss",
    "turn_spans",
    "turnwise_advantages",
    "write_dataset",
]

#: Metric names verl reports itself around a policy loss (ours would duplicate them).
_VERL_REPORTS = ("loss", "pg_loss")

# The per-token entropy of the micro-batch that aepo_ppo_loss is scoring, for the "aepo" policy loss
# that verl calls from inside it: verl's policy-loss signature has no entropy argument.
_ENTROPY: contextvars.ContextVar[torch.Tensor | None] = contextvars.ContextVar("agents_verl_entropy", default=None)


# ---- policy losses ----------------------------------------------------------------------------


@register_policy_loss("atpo")
def atpo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's ``atpo`` policy loss: :func:`~agents.training.losses.atpo_loss` with verl's clip range.

    ``config`` is verl's actor config (``ActorConfig``): ``clip_ratio_low``/``clip_ratio_high``
    (else ``clip_ratio``) are ε_low/ε_high. Rollout-correction weights, when verl passes them, scale
    the advantages (see :func:`_weighted`).
    """
    eps_low, eps_high = _clip_range(config)
    loss, metrics = atpo_loss(
        log_prob,
        old_log_prob,
        _weighted(advantages, rollout_is_weights),
        response_mask,
        eps_low=eps_low,
        eps_high=eps_high,
        agg=_aggregation(loss_agg_mode),
    )
    return loss * _global_batch_scale(response_mask, loss_agg_mode, config), _actor_metrics(metrics)


@register_policy_loss("aepo")
def aepo_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's ``aepo`` policy loss: :func:`~agents.training.losses.aepo_loss` with the entropy of the forward pass.

    The entropy comes from :func:`aepo_ppo_loss`, which verl must run instead of its ``ppo_loss``;
    called any other way this raises. ε_low/ε_high as for ``atpo``, the dual clip ``c`` is verl's
    ``clip_ratio_c``; the entropy-aware advantage and the clipping-balanced bound are on (AEPO's
    defaults).
    """
    entropy = _ENTROPY.get()
    if entropy is None:
        raise RuntimeError(
            "loss_mode 'aepo' needs the per-token entropy, which verl's policy-loss signature does not pass: "
            "install agents.integrations.verl.aepo_ppo_loss as the actor's loss function "
            "(actor_rollout_wg.set_loss_fn(functools.partial(aepo_ppo_loss, config=actor_config))) "
            "and set actor_rollout_ref.actor.calculate_entropy=true"
        )
    eps_low, eps_high = _clip_range(config)
    loss, metrics = aepo_loss(
        log_prob,
        old_log_prob,
        _weighted(advantages, rollout_is_weights),
        response_mask,
        entropy=entropy,
        eps_low=eps_low,
        eps_high=eps_high,
        dual_clip=config.clip_ratio_c,
        agg=_aggregation(loss_agg_mode),
    )
    return loss * _global_batch_scale(response_mask, loss_agg_mode, config), _actor_metrics(metrics)


def aepo_ppo_loss(
    config: Any, model_output: Mapping[str, torch.Tensor], data: TensorDict, dp_group: Any = None
) -> tuple[torch.Tensor, dict[str, Any]]:
    """verl's ``ppo_loss`` with the forward pass's per-token entropy handed to the ``aepo`` policy loss.

    Same signature as ``verl.workers.utils.losses.ppo_loss``; install it on the actor with
    ``actor_rollout_wg.set_loss_fn(functools.partial(aepo_ppo_loss, config=actor_config))``. Everything
    else (KL loss, entropy bonus, metrics, global-batch bookkeeping) is verl's ``ppo_loss``.
    """
    if config.policy_loss.get("loss_mode") != "aepo":
        raise ValueError(
            f"aepo_ppo_loss computes AEPO's loss; set actor.policy_loss.loss_mode=aepo "
            f"(it is {config.policy_loss.get('loss_mode')!r})"
        )
    entropy = model_output.get("entropy")
    if entropy is None:
        raise ValueError("AEPO needs the per-token entropy: set actor_rollout_ref.actor.calculate_entropy=true")
    token = _ENTROPY.set(no_padding_2_padding(entropy, data))
    try:
        return ppo_loss(config, model_output, data, dp_group)
    finally:
        _ENTROPY.reset(token)


def _clip_range(config: Any) -> tuple[float, float]:
    if config is None:
        raise ValueError("verl passes the actor config to a policy loss; got none")
    low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    return float(low), float(high)


def _aggregation(loss_agg_mode: str) -> str:
    if loss_agg_mode not in AGGREGATIONS:
        raise ValueError(
            f"loss_agg_mode {loss_agg_mode!r} is not one of this project's aggregations; use {', '.join(AGGREGATIONS)}"
        )
    return loss_agg_mode


def _weighted(advantages: torch.Tensor, rollout_is_weights: torch.Tensor | None) -> torch.Tensor:
    # verl multiplies each token's loss by its (non-negative, detached) rollout-correction weight w.
    # For w ≥ 0, w·max(−A·s, −A·clip(s)) = max(−wA·s, −wA·clip(s)) and likewise for the dual clip's
    # min, so scaling the advantages gives the same loss and gradient without copying the loss.
    return advantages if rollout_is_weights is None else advantages * rollout_is_weights


def _global_batch_scale(mask: torch.Tensor, loss_agg_mode: str, config: Any) -> float:
    """The factor from our micro-batch mean to this micro-batch's share of verl's global-batch mean."""
    info = config.global_batch_info
    dp_size = info.get("dp_size") or 1
    mask = mask.bool()
    if loss_agg_mode == "token-mean":
        local, total = int(mask.sum()), info.get("batch_num_tokens")
    else:  # seq-mean-*: verl divides by the global number of sequences
        local, total = int(mask.any(-1).sum()), info.get("global_batch_size")
    if total is None:
        if dp_size > 1:
            raise ValueError("verl's global batch size is needed when dp_size > 1")
        return 1.0
    return local / float(total) * dp_size


def _actor_metrics(metrics: Mapping[str, float]) -> dict[str, Any]:
    return {f"actor/policy/{name}": value for name, value in metrics.items() if name not in _VERL_REPORTS}


# ---- turn-wise credit ---------------------------------------------------------------------------


def turn_spans(mask: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of each turn of one response: the maximal runs of mask-1 tokens, in order."""
    flags = mask.bool().tolist()
    spans, start = [], None
    for position, on in enumerate([*flags, False]):
        if on and start is None:
            start = position
        elif not on and start is not None:
            spans.append((start, position))
            start = None
    return spans


@register_adv_est("at2po_turnwise")
def turnwise_advantages(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: Sequence[Any] | None = None,
    config: Any = None,
    node_ids: Sequence[Sequence[int]] | None = None,
    rollout_log_probs: torch.Tensor | None = None,
    **verl_extras: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """AT²PO turn-wise credit as a verl advantage estimator; returns ``(advantages, returns)``, equal.

    What verl (0.9.1) passes a registered estimator is ``token_level_rewards``, ``response_mask``,
    ``index`` (the prompt's ``uid``) and the algorithm ``config``; the tree is read from them:

    - rows with the same ``index`` are the paths of one prompt's tree, whose root is the prompt;
    - a row's reward is the sum of its token-level rewards (verl puts the score on the last token);
    - a row's turns are its maximal runs of ``response_mask`` = 1 (:func:`turn_spans`), and without
      ``node_ids`` each row is a chain of its own turns under the root: verl's trainers sample one
      trajectory per agent loop, so no two rows share a turn.

    Rows that share turns (a tree from this project's own rollout loop) need ``node_ids``, one id
    per turn of each row (equal ids: the same node), and ``rollout_log_probs`` for the node
    entropies of the backup (docs/algorithms/index.md eq. 1 and docs/algorithms/credit.md eq. 24).
    verl's ``compute_advantage`` passes neither; a custom trainer step can. The credit is
    :func:`~agents.training.credit.turnwise_credit` with its defaults, the official code's (leaf
    z-scores, child-softmax backup, ``A_n = V_n``;
    docs/algorithms/credit.md "AT²PO turn-wise credit"). Without ``node_ids`` only the root has
    several children and its value trains nothing (eq. 28), so no log-probs are needed. ``config``
    and verl's other keyword arguments are not used.
    """
    if index is None:
        raise ValueError("at2po_turnwise needs index (verl's uid of each row's prompt) to group a prompt's paths")
    if node_ids is not None and rollout_log_probs is None:
        raise ValueError("shared turns (node_ids) need rollout_log_probs: the backup weighs children by entropy")
    rewards = token_level_rewards.sum(-1).tolist()
    advantages = torch.zeros_like(token_level_rewards)
    rows_of: dict[Any, list[int]] = {}
    for row, key in enumerate(index):
        rows_of.setdefault(key, []).append(row)
    for rows in rows_of.values():
        tree = RolloutTree(prompt_ids=[0])  # the prompt's tokens play no part in the credit
        placed: list[tuple[int, list[tuple[int, int]], list[Node]]] = []
        nodes_by_id: dict[int, Node] = {}
        for row in rows:
            spans = turn_spans(response_mask[row])
            if not spans:
                continue  # nothing of this row is trained
            turn_ids: list[int | None] = [None] * len(spans) if node_ids is None else list(node_ids[row])
            if len(turn_ids) != len(spans):
                raise ValueError(f"row {row} has {len(spans)} turns in its mask but {len(turn_ids)} node ids")
            parent, chain = tree.root, []
            for (start, end), node_id in zip(spans, turn_ids):
                node = None if node_id is None else nodes_by_id.get(node_id)
                if node is None:
                    # Without node ids every row is its own chain: single children, whose backup
                    # weight is 1 whatever the entropy, so log-probs of 0 (when verl passes none)
                    # change no value.
                    logprobs = (
                        [0.0] * (end - start)
                        if rollout_log_probs is None
                        else rollout_log_probs[row, start:end].tolist()
                    )
                    node = tree.add_turn(parent, action_ids=[0] * (end - start), sampler_logprobs=logprobs)
                    if node_id is not None:
                        nodes_by_id[node_id] = node
                elif node.parent is not parent:
                    raise ValueError(f"row {row}: node {node_id} follows different turns in different rows")
                chain.append(node)
                parent = node
            if chain[-1].terminal:
                raise ValueError(f"row {row} ends at the same node as another row; each row is a path to its own leaf")
            chain[-1].finish(rewards[row])
            placed.append((row, spans, chain))
        if not placed:
            continue
        turnwise_credit(tree)
        for row, spans, chain in placed:
            for (start, end), node in zip(spans, chain):
                assert node.advantage is not None  # turnwise_credit fills every turn
                advantages[row, start:end] = node.advantage
    return advantages, advantages.clone()


# ---- the agent loop -------------------------------------------------------------------------------


class VerlServerEngine(Engine):
    """This project's :class:`~agents.engines.base.Engine` over verl's rollout-server client.

    ``server`` is the ``server_manager`` verl gives an agent loop (an ``LLMServerClient``); every
    request of one episode uses one ``request_id`` (verl's sticky session: the same server, its
    prefix cache). ``base_params`` are verl's sampling parameters for the episode; each turn
    overrides the ones :class:`~agents.engines.base.SamplingParams` sets, adds the stop strings
    (kept in the output, as this project's engines do; vLLM matches them only with its tokenizer
    loaded, ``rollout.skip_tokenizer_init: false``) and always asks for log-probs. verl's servers
    report no finish reason: a matched stop string is ``"stop"``, a full ``max_new_tokens``
    ``"length"``, anything else ``"eos"``.
    """

    def __init__(self, server: Any, tokenizer: Any, base_params: Mapping[str, Any], request_id: str) -> None:
        self.server = server
        self.tokenizer = tokenizer
        self.base_params = dict(base_params)
        self.request_id = request_id
        self.vocab_size = len(tokenizer)
        self._decode = skip_special_decoder(tokenizer)
        #: Seconds spent waiting for the server, and what it reported (verl's bookkeeping fields).
        self.seconds = 0.0
        self.num_preempted = 0
        self.extra_fields: dict[str, Any] = {}

    async def generate(self, prompt_ids: Sequence[int], params: SamplingParams) -> Completion:
        ids = self._check_request(prompt_ids, params, self.vocab_size)
        request = {
            **self.base_params,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "top_k": params.top_k,
            "max_tokens": params.max_new_tokens,
            "stop": list(params.stop),
            "stop_token_ids": list(params.stop_token_ids),
            "include_stop_str_in_output": True,
            "logprobs": True,
        }
        if params.seed is not None:
            request["seed"] = params.seed
        start = time.perf_counter()
        output = await self.server.generate(request_id=self.request_id, prompt_ids=ids, sampling_params=request)
        self.seconds += time.perf_counter() - start
        self.num_preempted += output.num_preempted or 0
        # The first turn's fields, then the newest weights version (as verl's tool agent loop keeps them).
        self.extra_fields = {**output.extra_fields, **self.extra_fields}
        if output.extra_fields.get("max_global_steps") is not None:
            self.extra_fields["max_global_steps"] = output.extra_fields["max_global_steps"]
        if output.log_probs is None or len(output.log_probs) != len(output.token_ids):
            raise RuntimeError("verl's rollout server returned no log-prob for every sampled token")
        token_ids = list(output.token_ids)
        text = self._decode(token_ids)
        stop = find_stop(text, params.stop)
        reason: FinishReason = "stop" if stop else "length" if len(token_ids) >= params.max_new_tokens else "eos"
        return Completion(
            token_ids=token_ids,
            logprobs=[float(lp) for lp in output.log_probs],
            finish_reason=reason,
            stop_reason=stop[0] if stop else None,
            stop_overshoot=text[stop[1] :] if stop else "",
        )


@functools.cache
def _text_env(env_id: str, env_kwargs_json: str) -> Env:
    """One environment of each kind per process (a search index is built once), forked per episode."""
    return agentenv.make(env_id, **json.loads(env_kwargs_json))


@register("agentenv")
class AgentenvAgentLoop(AgentLoopBase):
    """A verl agent loop that plays one agentenv episode per sample and returns its exact tokens.

    Each sample's ``index`` (verl's dataset sets it from ``extra_info.index``) is the task: the
    episode resets the environment with it and plays turns with
    :func:`~agents.rollout.episodes.run_episode`, sampling through verl's rollout servers
    (:class:`VerlServerEngine`). The prompt is the environment's own (its chat template applied to
    its task); the dataset's ``prompt`` column is not read. The episode's token budget is verl's
    ``rollout.prompt_length`` and ``rollout.response_length``. What verl gets back: the prompt ids,
    the response ids exactly as sampled with the observations between them, a mask that is 1 on
    sampled tokens and 0 on observations, the sampler's log-probs (0 off the mask) and the
    episode's reward as ``reward_score``.

    Options, set as extra keys of an entry in verl's ``agent_loop_config_path`` file (``_target_:
    agents.integrations.verl.AgentenvAgentLoop``): ``env`` (an agentenv id, default
    ``"multihop-qa"``), ``env_kwargs``, ``observations`` and ``system_prompt`` (as for
    :class:`~agentenv.wrappers.TokenEnv`), ``max_new_tokens`` (per turn). One episode is one
    trajectory: verl's trainers take one per agent loop, so tree rollouts need this project's own
    loop.
    """

    def __init__(
        self,
        *args: Any,
        env: str = "multihop-qa",
        env_kwargs: Mapping[str, Any] | None = None,
        observations: Literal["inline", "turn"] = "inline",
        system_prompt: str | None = None,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(env_kwargs, DictConfig):  # as verl's agent-loop entries give it: plain values for json
            env_kwargs = cast(dict[str, Any], OmegaConf.to_container(env_kwargs, resolve=True))
        self.env_id = env
        self.env_kwargs = dict(env_kwargs or {})
        self.observations = observations
        self.system_prompt = system_prompt
        self.max_new_tokens = max_new_tokens

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        """Play the episode of ``kwargs["index"]``; ``sampling_params`` are verl's for this sample."""
        base = TokenEnv(
            _text_env(self.env_id, json.dumps(self.env_kwargs, sort_keys=True)),
            self.tokenizer,
            observations=self.observations,
            system_prompt=self.system_prompt,
        )
        episode = task_episode(base, int(kwargs["index"]))  # on a fork: the shared env is never stepped
        engine = VerlServerEngine(self.server_manager, self.tokenizer, sampling_params, request_id=uuid4().hex)
        config = RolloutConfig(
            sampling=SamplingParams(
                temperature=float(sampling_params.get("temperature", 1.0)),
                top_p=float(sampling_params.get("top_p", 1.0)),
                top_k=int(sampling_params.get("top_k", -1)),
                max_new_tokens=self.max_new_tokens,
            ),
            concurrency=1,
            max_prompt_tokens=int(self.rollout_config.prompt_length),
            max_response_tokens=int(self.rollout_config.response_length),
        )
        try:
            trajectory = await run_episode(engine, episode, config)
        finally:
            episode.env.close()
        if not trajectory.ok:
            raise RuntimeError(f"the {self.env_id} episode of task {kwargs['index']} failed: {trajectory.error}")
        prompt = len(trajectory.prompt_ids)
        observations = sum(1 for turn in trajectory.turns if turn.obs_ids)
        return AgentLoopOutput(
            prompt_ids=trajectory.prompt_ids,
            response_ids=trajectory.ids[prompt:],
            response_mask=trajectory.mask[prompt:],
            response_logprobs=[0.0 if lp is None else lp for lp in trajectory.sampler_logprobs[prompt:]],
            reward_score=trajectory.reward,
            num_turns=1 + len(trajectory.turns) + observations,  # verl counts user, assistant and tool turns
            metrics=AgentLoopMetrics(
                generate_sequences=engine.seconds,
                tool_calls=trajectory.seconds - engine.seconds,
                num_preempted=engine.num_preempted,
            ),
            extra_fields={
                **engine.extra_fields,
                "turn_scores": [turn.reward for turn in trajectory.turns],
                "tool_rewards": [],
                "episode_status": trajectory.status,
            },
        )


def write_dataset(
    path: str | Path, env: str = "multihop-qa", tasks: Sequence[int] | None = None, **env_kwargs: Any
) -> Path:
    """Write a verl dataset (parquet) whose rows pose the environment's tasks to :class:`AgentenvAgentLoop`.

    One row per task (default: all of them): ``prompt`` (the environment's first message, for
    verl's length filters and logs), ``data_source`` (``agentenv/<env>``), ``agent_name``
    (``agentenv``), ``reward_model`` (the gold answers, for verl's logs) and ``extra_info.index``
    (the task). ``env_kwargs`` go to ``agentenv.make``; give the agent loop the same ones.
    """
    text_env = agentenv.make(env, **env_kwargs)
    count = len(text_env.tasks) if text_env.tasks is not None else None
    if tasks is None:
        if count is None:
            raise ValueError(f"{env} has no task list; pass tasks= (the reset seeds)")
        tasks = range(count)
    rows = []
    for task in tasks:
        options = {"index": task} if count is not None else None
        question, info = text_env.reset(seed=None if count is not None else task, options=options)
        rows.append(
            {
                "prompt": [{"role": "user", "content": question}],
                "data_source": f"agentenv/{env}",
                "agent_name": "agentenv",
                "reward_model": {"style": "rule", "ground_truth": list(info.get("answers") or [])},
                "extra_info": {"index": int(task)},
            }
        )
    text_env.close()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Dataset.from_list(rows).to_parquet(str(path))
    return path
