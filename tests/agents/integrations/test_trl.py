"""agents.integrations.trl: our losses inside TRL's GRPOTrainer, agentenv episodes as its rollout_func."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")  # rollout_func is experimental in TRL 1.16

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig

import agentenv
from agentenv.wrappers import TokenEnv
from agents.engines.base import Engine
from agents.engines.hf import HFEngine
from agents.engines.scripted import ScriptedEngine, ScriptedTurn
from agents.integrations.trl import AgentEnvRollout, AgentsGRPOTrainer, environment_reward
from agents.models import load_tokenizer, resolve_model
from agents.training.losses import aepo_loss, atpo_loss

LOSSES = {"atpo": atpo_loss, "aepo": aepo_loss}


def config(out, **overrides) -> GRPOConfig:
    settings = dict(
        output_dir=str(out),
        per_device_train_batch_size=4,
        num_generations=2,
        max_completion_length=64,
        use_cpu=True,
        report_to="none",
        save_strategy="no",
        logging_steps=1,
        gradient_checkpointing=False,
        seed=0,
    )
    return GRPOConfig(**{**settings, **overrides})


def varied_reward(completion_ids, **kwargs):
    """A reward that differs between any two different completions, so that the advantages are not all zero."""
    return [sum(ids) / len(ids) / 1e4 for ids in completion_ids]


def tiny_trainer(model_path, out, loss_type, **overrides) -> AgentsGRPOTrainer:
    return AgentsGRPOTrainer(
        model=model_path,
        reward_funcs=varied_reward,
        args=config(out, loss_type=loss_type, **overrides),
        train_dataset=Dataset.from_dict({"prompt": ["a"] * 4}),
    )


def random_batch(trainer, rows=4, prompt=5, completion=12, seed=0):
    """TRL's inputs to _compute_loss: left-padded prompts, right-padded completions, observation gaps in tool_mask."""
    g = torch.Generator().manual_seed(seed)
    vocab = trainer.model.config.vocab_size
    prompt_mask = torch.ones(rows, prompt, dtype=torch.long)
    prompt_mask[0, :2] = 0
    completion_mask = torch.ones(rows, completion, dtype=torch.long)
    completion_mask[1, 9:] = 0
    tool_mask = torch.ones(rows, completion, dtype=torch.long)
    tool_mask[:, 3:6] = 0  # an observation between two turns
    tool_mask[2, 8:10] = 0  # and a second one
    return {
        "prompt_ids": torch.randint(0, vocab, (rows, prompt), generator=g),
        "prompt_mask": prompt_mask,
        "completion_ids": torch.randint(0, vocab, (rows, completion), generator=g),
        "completion_mask": completion_mask,
        "tool_mask": tool_mask,
        "advantages": torch.randn(rows, generator=g),
        "num_items_in_batch": (completion_mask * tool_mask).sum() + 7,  # the other micro-batch's tokens too
    }


def scored(trainer, inputs):
    ids = torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], dim=1)
    attention = torch.cat([inputs["prompt_mask"], inputs["completion_mask"]], dim=1)
    return trainer._get_per_token_logps_and_entropies(
        trainer.model, ids, attention, inputs["completion_ids"].size(1), compute_entropy=True
    )[:2]


@pytest.mark.parametrize("loss_type", ["atpo", "aepo"])
def test_the_override_is_our_loss_on_trls_tensors_in_value_and_gradient(tiny_model, tmp_path, loss_type):
    trainer = tiny_trainer(
        tiny_model, tmp_path, loss_type, gradient_accumulation_steps=2, per_device_train_batch_size=2
    )
    trainer.current_gradient_accumulation_steps = 2  # set by the training loop
    trainer.model.train()
    inputs = random_batch(trainer)
    with torch.no_grad():
        logprobs, _ = scored(trainer, inputs)
    # an update ago: ratios away from 1, some beyond the clip range
    inputs["old_per_token_logps"] = logprobs + 0.05 * torch.randn(
        logprobs.shape, generator=torch.Generator().manual_seed(1)
    )
    parameters = [p for p in trainer.model.parameters() if p.requires_grad]

    loss = trainer.compute_loss(trainer.model, inputs)
    loss.backward()
    grads = [p.grad.clone() for p in parameters]
    trainer.model.zero_grad()

    logprobs, entropy = scored(trainer, inputs)
    mask = inputs["completion_mask"] * inputs["tool_mask"]
    ours, metrics = LOSSES[loss_type](
        logprobs,
        inputs["old_per_token_logps"],
        inputs["advantages"][:, None].expand_as(logprobs),
        mask,
        entropy=entropy,
    )
    # the micro-batch's weight among the two accumulated (docs/algorithms/training.md eq. 58)
    share = mask.sum() / inputs["num_items_in_batch"] if loss_type == "aepo" else 0.5
    (ours * share).backward()
    assert abs(loss.item() - (ours * share).item()) < 1e-6
    for got, want in zip(grads, (p.grad for p in parameters)):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    assert trainer._metrics["train"][f"{loss_type}/loss"] == [pytest.approx(metrics["loss"], abs=1e-7)]
    if loss_type == "atpo":
        assert metrics["turns"] == 9  # 4 rows × 2 turns + row 2's third
        assert metrics["clipped_turns"] > 0


def test_trls_own_loss_types_stay_trls_and_what_our_losses_lack_is_refused(tiny_model, tmp_path):
    trainer = tiny_trainer(tiny_model, tmp_path, "dapo")
    assert trainer.loss_fn is None
    with pytest.raises(ValueError, match="loss_kwargs are hyper-parameters of this project's losses"):
        AgentsGRPOTrainer(model=tiny_model, reward_funcs=varied_reward, args=config(tmp_path), loss_kwargs={"agg": "x"})
    for setting, message in [
        ({"epsilon": 0.003}, "set eps_low in loss_kwargs"),
        ({"top_entropy_quantile": 0.2}, "would split ATPO's turns"),
        ({"importance_sampling_level": "sequence"}, "define their own level"),
    ]:
        with pytest.raises(ValueError, match=message):
            tiny_trainer(tiny_model, tmp_path, "atpo", **setting)
    with pytest.raises(ValueError, match="which the trainer supplies"):
        AgentsGRPOTrainer(
            model=tiny_model,
            reward_funcs=varied_reward,
            args=config(tmp_path, loss_type="atpo"),
            loss_kwargs={"kl_coef": 1},
        )


def test_the_rollout_returns_the_sampled_ids_with_the_observations_masked_and_the_env_reward(tiny_model, tmp_path):
    trainer = tiny_trainer(tiny_model, tmp_path, "atpo", max_completion_length=512)
    tokenizer = trainer.processing_class
    env = TokenEnv(agentenv.make("multihop-qa", topk=1, result_chars=120), tokenizer)
    im_start = tokenizer.convert_tokens_to_ids("<|im_start|>")
    search = tokenizer.encode("<search> Kiss and Tell </search>", add_special_tokens=False)
    search = search[:3] + [im_start] + search[3:]  # a special token: a decode → encode round trip would drop it
    answer = tokenizer.encode(r"<answer> \boxed{Chief of Protocol} </answer>", add_special_tokens=False)

    def script(context):
        return ScriptedTurn(token_ids=answer if "</result>\n" in tokenizer.decode(context) else search, logprobs=-0.5)

    rollout = AgentEnvRollout(env, engine=lambda _: ScriptedEngine(script, tokenizer=tokenizer))
    dataset = rollout.dataset([0, 1])
    assert dataset["task"] == [0, 1] and "Kiss and Tell" in dataset["prompt"][0]

    out = rollout([dataset["prompt"][0]] * 2 + [dataset["prompt"][1]] * 2, trainer)

    prompt_0, _ = env.fork().reset(options={"index": 0})
    assert out["prompt_ids"][0] == prompt_0
    assert out["env_reward"] == [1.0, 1.0, 0.0, 0.0]  # task 0's answer is Chief of Protocol, task 1's is not
    assert environment_reward(out["env_reward"]) == out["env_reward"]
    for ids, mask, logprobs in zip(out["completion_ids"], out["env_mask"], out["logprobs"]):
        observation = len(ids) - len(search) - len(answer)
        assert ids[: len(search)] == search and ids[len(ids) - len(answer) :] == answer  # exactly as sampled
        assert mask == [1] * len(search) + [0] * observation + [1] * len(answer)
        assert tokenizer.decode(ids[len(search) : len(search) + observation]).startswith("\n<result>\nPage 1:")
        assert logprobs == [-0.5] * len(search) + [0.0] * observation + [-0.5] * len(answer)
    with pytest.raises(ValueError, match="build train_dataset with rollout.dataset"):
        rollout(["a prompt of no task"], trainer)


class Recording(Engine):
    """The trainer's HFEngine, recording every (context, completion) it samples."""

    def __init__(self, inner: HFEngine) -> None:
        self.inner = inner
        self.samples: list[tuple[tuple[int, ...], tuple[int, ...]]] = []

    async def generate(self, prompt_ids, params):
        completion = await self.inner.generate(prompt_ids, params)
        self.samples.append((tuple(prompt_ids), tuple(completion.token_ids)))
        return completion

    async def close(self) -> None:
        await self.inner.close()


class Logs(TrainerCallback):
    def __init__(self) -> None:
        self.logs: list[dict] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


@pytest.fixture(scope="module")
def smollm2_run(tmp_path_factory):
    """Two GRPOTrainer steps with the ATPO loss on SmolLM2-135M, multi-turn multihop-qa episodes from AgentEnvRollout.

    2 prompts × 2 generations, turns of at most 8 tokens in a 64-token response budget; both steps
    train on the one rollout (num_iterations=2), so the second step's ratios are not 1.
    """
    model = str(resolve_model("smollm2-135m"))
    tokenizer = load_tokenizer("smollm2-135m")
    engines: list[Recording] = []

    def engine(trainer):
        engines.append(Recording(HFEngine(trainer.model, tokenizer, seed=0)))
        return engines[-1]

    rollout = AgentEnvRollout(
        TokenEnv(agentenv.make("multihop-qa", topk=1, result_chars=120), tokenizer), max_new_tokens=8, engine=engine
    )
    outputs, scoring = [], []

    def recorded_rollout(prompts, trainer):
        outputs.append(rollout(prompts, trainer))
        return outputs[-1]

    logs = Logs()
    trainer = AgentsGRPOTrainer(
        model=model,
        reward_funcs=[environment_reward, varied_reward],
        args=config(
            tmp_path_factory.mktemp("trl"), loss_type="atpo", max_steps=2, num_iterations=2, learning_rate=1e-5
        ),
        train_dataset=rollout.dataset([0, 1]),
        processing_class=tokenizer,
        rollout_func=recorded_rollout,
        callbacks=[logs],
    )
    score, compute_loss = trainer._get_per_token_logps_and_entropies, trainer.compute_loss

    def recorded_compute_loss(model, inputs, **kwargs):
        def recorded_score(*args, **kwargs):
            result = score(*args, **kwargs)
            scoring.append({**inputs, "logprobs": result[0].detach().clone()})
            return result

        trainer._get_per_token_logps_and_entropies = recorded_score
        try:
            return compute_loss(model, inputs, **kwargs)
        finally:
            trainer._get_per_token_logps_and_entropies = score

    trainer.compute_loss = recorded_compute_loss
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    try:
        trainer.train()
    finally:
        rollout.close()
    after = dict(trainer.model.named_parameters())
    return {
        "logs": [log for log in logs.logs if "loss" in log],
        "scoring": scoring,
        "outputs": outputs,
        "samples": engines[0].samples,
        "tokenizer": tokenizer,
        "changed": [name for name in before if not torch.equal(before[name], after[name])],
    }


@pytest.mark.slow
def test_two_grpo_trainer_steps_log_the_atpo_loss_of_trls_tensors_and_change_the_weights(smollm2_run):
    logs, scoring = smollm2_run["logs"], smollm2_run["scoring"]
    assert len(logs) == len(scoring) == 2
    for log, batch in zip(logs, scoring):
        logprobs = batch["logprobs"]
        old = batch.get("old_per_token_logps", logprobs)
        mask = batch["completion_mask"] * batch["tool_mask"]
        loss, metrics = atpo_loss(logprobs, old, batch["advantages"][:, None].expand_as(logprobs), mask)
        assert log["loss"] == pytest.approx(loss.item(), rel=1e-5, abs=1e-9)
        assert log["atpo/turns"] == metrics["turns"] > 4  # multi-turn: more turns than completions
    assert logs[1]["atpo/ratio_mean"] != 1.0  # the second step trains an update after the rollout
    assert smollm2_run["changed"], "no weight changed in two steps"


@pytest.mark.slow
def test_the_rollout_gave_trl_the_sampled_ids_and_masked_the_observations(smollm2_run):
    (out,) = smollm2_run["outputs"]
    tokenizer = smollm2_run["tokenizer"]
    derived = []
    for prompt, ids, mask in zip(out["prompt_ids"], out["completion_ids"], out["env_mask"]):
        assert len(ids) == len(mask) <= 64
        runs, start = [], 0
        for t in range(1, len(mask) + 1):  # maximal runs of equal mask values
            if t == len(mask) or mask[t] != mask[start]:
                runs.append((start, t, mask[start]))
                start = t
        for start, end, value in runs:
            if value:  # an action: the context it was sampled from, and its ids
                derived.append((tuple(prompt + ids[:start]), tuple(ids[start:end])))
            else:  # an observation, wrapped by TokenEnv (and perhaps cut by the budget)
                text = tokenizer.decode(ids[start:end])
                assert text.startswith("\n<result>\n") or "\n<result>\n".startswith(text)
    assert sorted(derived) == sorted(smollm2_run["samples"])  # every sampled action, exactly, and nothing else
    batch = smollm2_run["scoring"][0]
    env_mask = {tuple(mask) for mask in out["env_mask"]}
    assert {
        tuple(row[: int(n)]) for row, n in zip(batch["tool_mask"].tolist(), batch["completion_mask"].sum(-1))
    } == env_mask
