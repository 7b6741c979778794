"""agents.integrations.verl inside verl 0.9.1's own machinery (installed without its pins; see pyproject.toml).

verl's registries return our losses, estimator and agent loop after its own plug-in loading; the losses
equal agents.training.losses in value and gradient on random batches; the estimator, run by verl's
compute_advantage, gives the turn-wise credit's exact numbers; the example config composes on verl's
ppo_trainer.yaml. The slow test runs AgentenvAgentLoop through verl's AgentLoopWorker, LLMServerClient
and load balancer (Ray) against an engine server actor on loopback, which stands in for verl's vLLM
replica (a GPU actor) with this project's HFEngine on a tiny model.
"""

import asyncio
import functools
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from tensordict import TensorDict
from verl.protocol import DataProto
from verl.trainer.config import AlgoConfig
from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla, get_adv_estimator_fn, get_policy_loss_fn
from verl.trainer.ppo.ray_trainer import compute_advantage
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils import tensordict_utils as tu
from verl.utils.config import omega_conf_to_dataclass, validate_config
from verl.workers.utils.padding import no_padding_2_padding

import agentenv
import agents.integrations.verl as plugin
from agentenv.wrappers import TokenEnv
from agents.training.losses import aepo_loss, atpo_loss

CONFIG_DIR = Path(plugin.__file__).parent
VERL_DEFAULTS = Path(sys.modules["verl"].__file__).parent / "trainer" / "config" / "_generated_ppo_trainer.yaml"
AEPO = [
    "actor_rollout_ref.actor.policy_loss.loss_mode=aepo",
    "actor_rollout_ref.actor.clip_ratio_low=0.2",
    "actor_rollout_ref.actor.clip_ratio_high=0.2",
    "actor_rollout_ref.actor.loss_agg_mode=token-mean",
    "actor_rollout_ref.actor.calculate_entropy=true",
]


@functools.cache
def example_config(*overrides: str):
    """The example config composed on verl's ppo_trainer.yaml, as `verl.trainer.main_ppo` composes it."""
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        return compose(config_name="verl_example", overrides=list(overrides))


def actor_config(*overrides: str):
    """verl's actor config dataclass (a fresh one: verl writes the global batch info into it)."""
    return omega_conf_to_dataclass(example_config(*overrides).actor_rollout_ref.actor)


def random_batch(seed: int, rows: int = 4, tokens: int = 24):
    """Log-probs near the old ones (so some turns clip at 3e-3), advantages, and masks of several turns."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(rows, tokens, generator=g, dtype=torch.float64) * 3
    new = old + 0.01 * torch.randn(rows, tokens, generator=g, dtype=torch.float64)
    advantages = torch.randn(rows, tokens, generator=g, dtype=torch.float64)
    mask = (torch.rand(rows, tokens, generator=g) < 0.7).long()
    mask[:, 0] = 1  # every row has a turn
    return new, old, advantages, mask


def value_and_grad(loss_fn, logprobs):
    leaf = logprobs.clone().requires_grad_()
    loss = loss_fn(leaf)
    loss.backward()
    return loss.detach(), leaf.grad


# ---- verl finds the plug-in ------------------------------------------------------------------------


def test_verl_loads_the_plugin_through_its_entry_point():
    # A fresh interpreter that imports only verl: registration must come from verl's plug-in loading.
    probe = (
        "from verl.trainer.ppo import core_algos as c\n"
        "from verl.experimental.agent_loop.agent_loop import _agent_loop_registry as r\n"
        "print(c.get_policy_loss_fn('atpo').__module__, c.get_policy_loss_fn('aepo').__module__, "
        "c.get_adv_estimator_fn('at2po_turnwise').__module__, r['agentenv']['_target_'])"
    )
    env = {**os.environ, "VERL_USE_EXTERNAL_PLUGINS": "agentenv"}  # only our entry point, by its name
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, env=env)
    assert out.stdout.split() == ["agents.integrations.verl"] * 3 + ["agents.integrations.verl.AgentenvAgentLoop"]


# ---- policy losses ------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
def test_verl_atpo_equals_ours_in_value_and_gradient(seed, agg):
    new, old, advantages, mask = random_batch(seed)
    config = actor_config(f"actor_rollout_ref.actor.loss_agg_mode={agg}")
    verl_loss = get_policy_loss_fn(config.policy_loss.loss_mode)
    got, got_grad = value_and_grad(lambda lp: verl_loss(old, lp, advantages, mask, agg, config, None)[0], new)
    want, want_grad = value_and_grad(
        lambda lp: atpo_loss(lp, old, advantages, mask, eps_low=3e-3, eps_high=4e-3, agg=agg)[0], new
    )
    assert torch.allclose(got, want, rtol=0, atol=1e-6)
    assert torch.allclose(got_grad, want_grad, rtol=0, atol=1e-6)
    _, metrics = verl_loss(old, new, advantages, mask, agg, config, None)
    assert metrics["actor/policy/clipped_turns"] > 0  # the batch does exercise the clip


@pytest.mark.parametrize("agg", ["seq-mean-token-mean", "token-mean"])
def test_micro_batches_sum_to_the_global_batch_loss_as_verl_normalises(agg):
    # verl sums the micro-batches' losses; with its global batch info they add up to the batch's loss.
    new, old, advantages, mask = random_batch(7, rows=6)
    config = actor_config(f"actor_rollout_ref.actor.loss_agg_mode={agg}")
    config.global_batch_info.update(dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=len(mask))

    def micro_batches(lp):
        return sum(
            get_policy_loss_fn("atpo")(old[part], lp[part], advantages[part], mask[part], agg, config, None)[0]
            for part in (slice(0, 2), slice(2, 6))
        )

    got, got_grad = value_and_grad(micro_batches, new)
    want, want_grad = value_and_grad(lambda lp: atpo_loss(lp, old, advantages, mask, agg=agg)[0], new)
    assert torch.allclose(got, want, rtol=0, atol=1e-6)
    assert torch.allclose(got_grad, want_grad, rtol=0, atol=1e-6)


def test_rollout_correction_weights_on_the_advantages_are_verl_s_weights_on_the_loss():
    # The identity the plug-in relies on, checked on verl's own PPO loss (dual clip included).
    new, old, advantages, mask = random_batch(3)
    new = old + 0.5 * torch.randn_like(old, dtype=torch.float64)  # ratios beyond 1 ± ε and beyond c
    weights = torch.rand_like(old)
    config = actor_config("actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.2")

    def vanilla(lp, advantages, weights=None):
        return compute_policy_loss_vanilla(old, lp, advantages, mask, config=config, rollout_is_weights=weights)[0]

    on_loss = value_and_grad(lambda lp: vanilla(lp, advantages, weights), new)
    on_adv = value_and_grad(lambda lp: vanilla(lp, advantages * weights), new)
    assert torch.allclose(on_loss[0], on_adv[0], rtol=0, atol=1e-9)
    assert torch.allclose(on_loss[1], on_adv[1], rtol=0, atol=1e-9)


def packed_step(seed: int, rows: int = 3, prompt: int = 4, response: int = 6):
    """What verl's engine hands a loss function: flat (unpadded) model outputs and the padded batch."""
    g = torch.Generator().manual_seed(seed)
    flat_logprobs = -torch.rand(rows * (prompt + response), generator=g, dtype=torch.float64)
    flat_entropy = torch.rand(rows * (prompt + response), generator=g, dtype=torch.float64) * 2
    mask = (torch.rand(rows, response, generator=g) < 0.7).long()
    mask[:, 0] = 1
    data = TensorDict(
        {
            "prompts": torch.ones(rows, prompt, dtype=torch.long),
            "responses": torch.ones(rows, response, dtype=torch.long),
            "attention_mask": torch.ones(rows, prompt + response, dtype=torch.long),
            "response_mask": mask,
            "old_log_probs": -torch.rand(rows, response, generator=g, dtype=torch.float64),
            "advantages": torch.randn(rows, response, generator=g, dtype=torch.float64),
        },
        batch_size=rows,
    )
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(mask.sum()), global_batch_size=rows)
    return flat_logprobs, flat_entropy, data


@pytest.mark.parametrize("seed", range(3))
def test_aepo_through_the_loss_function_hook_equals_ours(seed):
    flat_logprobs, flat_entropy, data = packed_step(seed)
    config = actor_config(*AEPO)
    got, got_grad = value_and_grad(
        lambda lp: plugin.aepo_ppo_loss(config, {"log_probs": lp, "entropy": flat_entropy}, data)[0], flat_logprobs
    )

    def ours(lp):
        padded = no_padding_2_padding(lp, data)
        entropy = no_padding_2_padding(flat_entropy, data)
        return aepo_loss(padded, data["old_log_probs"], data["advantages"], data["response_mask"], entropy=entropy)[0]

    want, want_grad = value_and_grad(ours, flat_logprobs)
    assert torch.allclose(got, want, rtol=0, atol=1e-6)
    assert torch.allclose(got_grad, want_grad, rtol=0, atol=1e-6)


def test_aepo_without_the_hook_or_the_entropy_says_what_to_set():
    new, old, advantages, mask = random_batch(0)
    with pytest.raises(RuntimeError, match="set_loss_fn"):
        get_policy_loss_fn("aepo")(old, new, advantages, mask, "token-mean", actor_config(*AEPO), None)
    flat_logprobs, _, data = packed_step(0)
    with pytest.raises(ValueError, match="calculate_entropy=true"):
        plugin.aepo_ppo_loss(actor_config(*AEPO), {"log_probs": flat_logprobs}, data)
    with pytest.raises(ValueError, match="loss_mode=aepo"):
        plugin.aepo_ppo_loss(actor_config(), {"log_probs": flat_logprobs}, data)


def test_an_aggregation_we_do_not_have_is_refused():
    new, old, advantages, mask = random_batch(0)
    config = actor_config("actor_rollout_ref.actor.loss_agg_mode=token-sum")
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        get_policy_loss_fn("atpo")(old, new, advantages, mask, "token-sum", config, None)


# ---- turn-wise credit ------------------------------------------------------------------------------


def test_turns_are_the_runs_of_the_response_mask():
    assert plugin.turn_spans(torch.tensor([0, 1, 1, 0, 0, 1, 0, 1, 1])) == [(1, 3), (5, 6), (7, 9)]
    assert plugin.turn_spans(torch.tensor([0, 0])) == []


def test_verl_s_compute_advantage_gives_the_turnwise_credit():
    # Two prompts; verl's rows are chains, so every turn of a row carries its leaf's z-score
    # over the prompt's rows with the population σ (docs/algorithms/credit.md eqs. 23, 28).
    mask = torch.tensor(
        [
            [1, 1, 0, 0, 1, 1, 0],
            [1, 0, 1, 1, 1, 0, 0],
            [1, 1, 1, 0, 0, 0, 0],
            [0, 1, 1, 0, 1, 0, 0],
            [1, 1, 0, 1, 0, 0, 0],
        ]
    )
    rewards = torch.zeros(5, 7)
    for row, reward in enumerate([1.0, 0.0, 0.0, 0.5, 1.0]):
        rewards[row, int(mask[row].nonzero().max())] = reward  # verl's score sits on the last token
    data = DataProto.from_dict(
        tensors={"token_level_rewards": rewards, "response_mask": mask},
        non_tensors={"uid": np.array(["a", "a", "a", "b", "b"], dtype=object)},
    )
    out = compute_advantage(data, adv_estimator="at2po_turnwise", config=AlgoConfig(adv_estimator="at2po_turnwise"))
    third = math.sqrt(2 / 9)  # population σ of (1, 0, 0)
    per_row = [(2 / 3) / (third + 1e-6), (-1 / 3) / (third + 1e-6), (-1 / 3) / (third + 1e-6)]
    per_row += [-0.25 / (0.25 + 1e-6), 0.25 / (0.25 + 1e-6)]
    expected = torch.tensor(per_row).unsqueeze(-1) * mask
    assert torch.allclose(out.batch["advantages"], expected, rtol=0, atol=1e-6)
    assert torch.equal(out.batch["returns"], out.batch["advantages"])


def test_shared_turns_from_node_ids_back_up_with_the_entropy_softmax():
    # The worked example (docs/algorithms/credit.md eqs. 32–34): first turn a, answers a1 (r = 1, H = 0.4)
    # and a2 (r = 0, H = 0.6); both rows hold a (node 1) then their own answer.
    mask = torch.tensor([[1, 1, 0, 1, 1], [1, 1, 0, 1, 1]])
    rewards = torch.tensor([[0, 0, 0, 0, 1.0], [0, 0, 0, 0, 0.0]])
    logprobs = torch.tensor([[-1.0, -1.0, 0.0, -0.4, -0.4], [-1.0, -1.0, 0.0, -0.6, -0.6]])
    estimator = get_adv_estimator_fn("at2po_turnwise")
    advantages, _ = estimator(rewards, mask, index=["q", "q"], node_ids=[[1, 2], [1, 3]], rollout_log_probs=logprobs)
    v_leaf = 0.5 / (0.5 + 1e-6)
    w_a1, w_a2 = (math.exp(0.4) / (math.exp(0.4) + math.exp(0.6)), math.exp(0.6) / (math.exp(0.4) + math.exp(0.6)))
    v_a = w_a1 * v_leaf - w_a2 * v_leaf  # ≈ −0.0997
    expected = torch.tensor([[v_a, v_a, 0, v_leaf, v_leaf], [v_a, v_a, 0, -v_leaf, -v_leaf]])
    assert torch.allclose(advantages, expected, rtol=0, atol=1e-6)
    with pytest.raises(ValueError, match="rollout_log_probs"):
        estimator(rewards, mask, index=["q", "q"], node_ids=[[1, 2], [1, 3]])


# ---- the example config ----------------------------------------------------------------------------


def leaf_keys(config, prefix=""):
    for key, value in config.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            yield from leaf_keys(value, path + ".")
        else:
            yield path


def test_the_example_config_composes_on_verl_s_trainer_config():
    example = OmegaConf.to_container(OmegaConf.load(CONFIG_DIR / "verl_example.yaml"))
    own = [key for key in leaf_keys(example) if not key.startswith(("hydra.", "defaults"))]
    defaults = OmegaConf.load(VERL_DEFAULTS)

    def known(key):  # a key of verl's defaults, set or left "???" for the user
        parent, _, leaf = key.rpartition(".")
        node = OmegaConf.select(defaults, parent)
        return node is not None and (leaf in node or OmegaConf.is_missing(node, leaf))

    unknown = [key for key in own if not known(key)]
    assert unknown == [], f"keys verl's ppo_trainer.yaml does not have: {unknown}"

    config = example_config()
    for key in own:
        assert OmegaConf.select(config, key) == OmegaConf.select(OmegaConf.create(example), key), key
    # verl.trainer.main_ppo's own checks, before it starts anything: no critic, no reference model.
    assert not need_critic(config) and not need_reference_policy(config)
    validate_config(config=config, use_reference_policy=False, use_critic=False)
    actor = omega_conf_to_dataclass(config.actor_rollout_ref.actor)  # verl's own validation of the section
    rollout = omega_conf_to_dataclass(config.actor_rollout_ref.rollout)
    assert (actor.policy_loss.loss_mode, actor.clip_ratio_low, actor.clip_ratio_high) == ("atpo", 0.003, 0.004)
    assert get_policy_loss_fn(actor.policy_loss.loss_mode) is plugin.atpo_policy_loss
    assert get_adv_estimator_fn(config.algorithm.adv_estimator) is plugin.turnwise_advantages
    assert rollout.agent.default_agent_loop == "agentenv"
    assert (rollout.prompt_length, rollout.response_length) == (2000, 6192)


# ---- the agent loop, run by verl's agent-loop machinery ------------------------------------------------


@pytest.fixture(scope="module")
def ray_local():
    import ray

    started = not ray.is_initialized()
    if started:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    if started:
        ray.shutdown()


def engine_server_class(ray):
    """A Ray actor with the generate() of verl's rollout servers, sampling with HFEngine."""
    from verl.workers.rollout.replica import TokenOutput

    @ray.remote
    class EngineServer:
        def __init__(self, model: str):
            from agents.engines.hf import HFEngine

            self.engine = HFEngine(model)
            self.calls: list[tuple[list[int], list[int], list[float]]] = []

        async def generate(self, prompt_ids, sampling_params, request_id, image_data=None, video_data=None, **_):
            from agents.engines.base import SamplingParams

            params = SamplingParams(
                temperature=sampling_params["temperature"],
                top_p=sampling_params["top_p"],
                top_k=sampling_params["top_k"],
                max_new_tokens=sampling_params["max_tokens"],
                stop=tuple(sampling_params["stop"]),
                stop_token_ids=tuple(sampling_params["stop_token_ids"]),
            )
            done = await self.engine.generate(prompt_ids, params)
            self.calls.append((list(prompt_ids), done.token_ids, done.logprobs))
            return TokenOutput(token_ids=done.token_ids, log_probs=done.logprobs, extra_fields={"global_steps": 1})

        def sampled(self):
            return self.calls

    return EngineServer


@pytest.mark.slow
def test_verl_s_agent_loop_worker_plays_multihop_qa_episodes_with_the_sampled_ids(tiny_model, tmp_path, ray_local):
    from transformers import AutoTokenizer
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn
    from verl.workers.rollout.llm_server import LLMServerClient
    from verl.workers.rollout.router import get_router_handle

    # An entry of verl's agent_loop_config_path file: our loop with short turns, so episodes have several.
    loops = tmp_path / "agent_loops.yaml"
    loops.write_text(
        "- name: agentenv_short\n  _target_: agents.integrations.verl.AgentenvAgentLoop\n  max_new_tokens: 40\n"
    )
    config = example_config(
        f"actor_rollout_ref.model.path={tiny_model}",
        "data.max_prompt_length=2048",
        "data.max_response_length=320",
        f"actor_rollout_ref.rollout.agent.agent_loop_config_path={loops}",
        "actor_rollout_ref.rollout.agent.num_workers=1",
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tasks = [3, 4]
    dataset = RLHFDataset(str(plugin.write_dataset(tmp_path / "val.parquet", tasks=tasks)), tokenizer, config.data)
    batch = DataProto.from_single_dict(collate_fn([dataset[i] for i in range(len(tasks))]), meta_info={})
    batch.non_tensor_batch["agent_name"] = np.array(["agentenv_short"] * len(tasks), dtype=object)

    server = engine_server_class(ray_local).remote(tiny_model)
    client = LLMServerClient(config, load_balancer_handle=get_router_handle(servers={"127.0.0.1": server}))
    out = asyncio.run(AgentLoopWorker(config, client).generate_sequences(batch))
    sampled = {tuple(prompt): (ids, logprobs) for prompt, ids, logprobs in ray_local.get(server.sampled.remote())}

    for row, task in enumerate(tasks):
        prompt, _ = TokenEnv(agentenv.make("multihop-qa"), tokenizer).reset(options={"index": task})
        attention = out.batch["attention_mask"][row].bool()
        width = out.batch["prompts"].shape[1]
        assert out.batch["input_ids"][row, :width][attention[:width]].tolist() == prompt  # the env's own prompt
        length = int(attention[width:].sum())
        response = out.batch["responses"][row, :length].tolist()
        mask = out.batch["response_mask"][row, :length].tolist()
        logprobs = out.batch["rollout_log_probs"][row, :length].tolist()
        position, turns = 0, 0
        while position < length:  # each action is exactly what the server sampled after its context
            ids, sampler_logprobs = sampled[tuple(prompt + response[:position])]
            end = position + len(ids)
            assert response[position:end] == ids and mask[position:end] == [1] * len(ids)
            assert logprobs[position:end] == pytest.approx(sampler_logprobs, abs=1e-6)
            position, turns = end, turns + 1
            while position < length and mask[position] == 0:  # the observation the env returned
                position += 1
        assert turns >= 2 and 0 in mask
        assert out.non_tensor_batch["episode_status"][row] in ("terminated", "truncated", "budget")
        assert out.batch["rm_scores"][row].nonzero().flatten().tolist() in ([], [length - 1])
