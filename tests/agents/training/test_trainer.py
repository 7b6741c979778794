"""Trainer logic on a tiny randomly initialised Llama: log-probs, updates, accumulation, LoRA, KL, sync, resume."""

import json
import math
import random
import re

import numpy as np
import pytest
import torch
from transformers import LlamaForCausalLM

import agents.progress
from agents.models import CPU_BFLOAT16_VARIABLE, tiny_llama
from agents.rollout.tree import RolloutTree, TrainingPath
from agents.training.batch import collate
from agents.training.forward import _decoder_and_head
from agents.training.losses import aepo_loss
from agents.training.trainer import Trainer, TrainerConfig

VOCAB = 50


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    """A 2-layer Llama with tied embeddings (like SmolLM2), identical for the same seed."""
    return tiny_llama(seed, vocab_size=VOCAB)


def make_paths(seed: int = 1) -> list[TrainingPath]:
    """Four paths of different lengths from two trees; the first tree shares a first turn."""
    rng = random.Random(seed)

    def ids(n):
        return [rng.randrange(1, VOCAB) for _ in range(n)]

    def logprobs(n):
        return [-rng.uniform(0.5, 4.0) for _ in range(n)]

    trees = []
    tree = RolloutTree(ids(6))
    shared = tree.add_turn(tree.root, action_ids=ids(5), sampler_logprobs=logprobs(5))
    tree.add_turn(shared, obs_ids=ids(3), action_ids=ids(4), sampler_logprobs=logprobs(4), terminal=True, reward=1.0)
    tree.add_turn(shared, obs_ids=ids(3), action_ids=ids(7), sampler_logprobs=logprobs(7), terminal=True, reward=0.0)
    trees.append(tree)
    tree = RolloutTree(ids(4))
    tree.add_turn(tree.root, action_ids=ids(9), sampler_logprobs=logprobs(9), terminal=True, reward=1.0)
    tree.add_turn(tree.root, action_ids=ids(2), sampler_logprobs=logprobs(2), terminal=True, reward=-1.0)
    trees.append(tree)
    for tree in trees:
        for node in tree.nodes():
            node.advantage = node.reward if node.terminal else 0.5
    return [path for tree in trees for path in tree.paths()]


def direct_scores(model, path: TrainingPath) -> tuple[torch.Tensor, torch.Tensor]:
    """log π(ids[t] | ids[<t]) and the entropy of that distribution, from one unpadded forward pass."""
    ids = torch.tensor([path.ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    log_p = logits.log_softmax(-1)
    logprobs = torch.cat([torch.zeros(1), log_p.gather(-1, ids[0, 1:, None]).squeeze(-1)])
    entropy = torch.cat([torch.zeros(1), -(log_p.exp() * log_p).sum(-1)])
    return logprobs, entropy


def with_sampler_logprobs(paths, model, shift=lambda index: 0.0) -> list[TrainingPath]:
    """The paths with sampler_logprobs set to the model's own log-probs plus ``shift(action token index)``."""
    out, index = [], 0
    for path in paths:
        exact, _ = direct_scores(model, path)
        old = []
        for t, m in enumerate(path.mask):
            old.append(float(exact[t]) + shift(index) if m else math.nan)
            index += m
        out.append(
            TrainingPath(path.ids, path.mask, path.advantages, old, path.turn_ids, path.weights, path.reward, path.leaf)
        )
    return out


async def run_step(trainer, paths, **kwargs):
    return await trainer.step(paths, **kwargs)


def config(**overrides) -> TrainerConfig:
    return TrainerConfig(**{"lr": 1e-3, "progress": False, "report_to": ("none",), **overrides})


@pytest.mark.parametrize("packing", ["padded", "flat", "tree"])
def test_logprobs_equal_a_direct_forward_pass(packing):
    model, paths = tiny_model(), make_paths()
    trainer = Trainer(model, config(packing=packing, micro_batch_size=3))
    scores = trainer.compute_logprobs(paths)
    assert scores.shape == (4, max(len(p.ids) for p in paths))
    for row, path in enumerate(paths):
        expected, _ = direct_scores(model, path)
        torch.testing.assert_close(scores[row, : len(path.ids)], expected, atol=1e-5, rtol=1e-5)
        assert (scores[row, len(path.ids) :] == 0).all()


@pytest.mark.parametrize("packing", ["padded", "flat", "tree"])
async def test_entropy_metric_is_the_exact_token_mean_entropy_of_action_tokens(packing):
    model, paths = tiny_model(), make_paths()
    entropies = []
    for path in paths:
        _, entropy = direct_scores(model, path)
        entropies += [float(h) for h, m in zip(entropy, path.mask) if m]
    trainer = Trainer(model, config(packing=packing, micro_batch_size=3))  # ppo_clip: token-mean
    metrics = await trainer.step(paths)
    assert metrics["policy/entropy"] == pytest.approx(sum(entropies) / len(entropies), rel=1e-5)
    assert metrics["tokens/action"] == len(entropies) == 32


async def test_positive_advantage_raises_and_negative_lowers_a_sequences_logprob():
    model = tiny_model()
    paths = make_paths()[2:]  # rewards +1 and -1, one turn each: advantages +1 and -1
    assert [p.reward for p in paths] == [1.0, -1.0]
    trainer = Trainer(model, config(lr=1e-3))
    before = trainer.compute_logprobs(paths)
    await trainer.step(paths)
    after = trainer.compute_logprobs(paths)
    mask = collate(paths, 0).mask.bool()
    change = [float((after[row] - before[row])[mask[row]].sum()) for row in range(2)]
    assert change[0] > 0 > change[1]


def gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("loss", ["ppo_clip", "atpo", "gspo"])
@pytest.mark.parametrize("packing", ["padded", "flat", "tree"])
async def test_gradient_accumulation_over_micro_batches_equals_one_big_batch(loss, packing):
    # Sampler log-probs off by ±0.3 so that ratios differ from 1 and some tokens clip.
    paths = with_sampler_logprobs(make_paths(), tiny_model(), shift=lambda i: 0.3 * (-1) ** i)
    results = []
    for micro_batch_size in (4, 1):
        trainer = Trainer(
            tiny_model(),
            config(
                loss=loss, old_logprobs="sampler", micro_batch_size=micro_batch_size, packing=packing, max_grad_norm=1e9
            ),
        )
        metrics = await trainer.step(paths)
        results.append((metrics, gradients(trainer)))
    (one_metrics, one_grads), (accumulated_metrics, accumulated_grads) = results
    assert one_grads.keys() == accumulated_grads.keys() and len(one_grads) > 10
    for name in one_grads:
        torch.testing.assert_close(accumulated_grads[name], one_grads[name], atol=1e-6, rtol=1e-4)
    assert accumulated_metrics["policy/loss"] == pytest.approx(one_metrics["policy/loss"], abs=1e-6)
    assert accumulated_metrics["optim/grad_norm"] == pytest.approx(one_metrics["optim/grad_norm"], rel=1e-5)
    assert one_metrics["policy/clip_frac_low"] + one_metrics["policy/clip_frac_high"] > 0
    if loss == "atpo":  # counts are summed over micro-batches: 3 distinct turns... per path: 2+2+1+1
        assert accumulated_metrics["policy/turns"] == one_metrics["policy/turns"] == 6


async def test_mini_batches_make_several_updates_and_later_ones_see_a_changed_policy():
    trainer = Trainer(tiny_model(), config(loss="ppo_clip", mini_batches=2, micro_batch_size=1))
    metrics = await trainer.step(make_paths())
    assert metrics["optim/updates"] == 2
    assert trainer.optimizer.state[trainer.trainable_parameters[0]]["step"] == 2
    # The second mini-batch is trained against old log-probs of the policy before the first
    # update, so its ratios are no longer exactly 1.
    assert metrics["policy/ratio_mean"] != 1.0
    with pytest.raises(ValueError, match="mini_batches=5 but the batch has only 4 sequences"):
        await Trainer(tiny_model(), config(mini_batches=5)).step(make_paths())


@pytest.mark.parametrize("mode", ["recompute", "sampler"])
async def test_mismatch_report_gives_max_and_mean_absolute_difference(mode):
    model, paths = tiny_model(), make_paths()
    deltas = [0.0] * 32
    deltas[3], deltas[10], deltas[26] = 0.5, -0.25, 0.125
    shifted = with_sampler_logprobs(paths, model, shift=lambda i: deltas[i])
    trainer = Trainer(model, config(old_logprobs=mode, micro_batch_size=3))
    metrics = await trainer.step(shifted)
    assert metrics["mismatch/tokens"] == 32
    assert metrics["mismatch/max_abs"] == pytest.approx(0.5, abs=1e-5)
    assert metrics["mismatch/mean_abs"] == pytest.approx(0.875 / 32, abs=1e-5)


async def test_recomputed_old_logprobs_make_the_first_ratio_exactly_one():
    paths = with_sampler_logprobs(make_paths(), tiny_model(), shift=lambda i: 1.0)
    recompute = await Trainer(tiny_model(), config()).step(paths)
    sampler = await Trainer(tiny_model(), config(old_logprobs="sampler")).step(paths)
    assert recompute["policy/ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert sampler["policy/ratio_mean"] == pytest.approx(1 / math.e, rel=1e-4)  # r = exp(log π − (log π + 1))


@pytest.mark.parametrize("mini_batches", [1, 2])
async def test_one_update_a_batch_takes_old_logprobs_from_its_own_pass(mini_batches, monkeypatch):
    # One update a batch: π_old is the weights of the update itself, so the recompute is the
    # update's forward pass, detached: no scoring pass, and the update of exact π_old log-probs.
    model, reference = tiny_model(), tiny_model()
    paths = with_sampler_logprobs(make_paths(), reference)
    trainer = Trainer(model, config(loss="ppo_clip", mini_batches=mini_batches, micro_batch_size=1))
    exact = Trainer(
        reference, config(loss="ppo_clip", mini_batches=mini_batches, micro_batch_size=1, old_logprobs="sampler")
    )
    scored = []
    score = trainer.forward.score
    monkeypatch.setattr(trainer.forward, "score", lambda *a, **k: scored.append(1) or score(*a, **k))
    metrics = await trainer.step(paths)
    await exact.step(paths)
    assert len(scored) == (0 if mini_batches == 1 else 1)
    assert metrics["mismatch/tokens"] == 32 and metrics["mismatch/max_abs"] < 1e-5
    for mine, theirs in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5)  # lr 1e-3: Adam moves a weight ±1e-3


async def test_aepo_gets_the_exact_token_entropy_for_its_entropy_aware_advantage():
    model, paths = tiny_model(), make_paths()
    batch = collate(paths, 0)
    logprobs, entropy = zip(*(direct_scores(model, p) for p in paths))
    pad = batch.ids.shape[1]
    logprobs = torch.stack([torch.nn.functional.pad(x, (0, pad - len(x))) for x in logprobs])
    entropy = torch.stack([torch.nn.functional.pad(x, (0, pad - len(x))) for x in entropy])
    expected, _ = aepo_loss(logprobs, logprobs, batch.advantages, batch.mask, entropy=entropy)
    without, _ = aepo_loss(logprobs, logprobs, batch.advantages, batch.mask, entropy_aware_advantage=False)
    assert float(expected) != pytest.approx(float(without), abs=1e-4)  # the entropy term matters here
    metrics = await Trainer(model, config(loss="aepo", micro_batch_size=4)).step(paths)
    assert metrics["policy/loss"] == pytest.approx(float(expected), abs=1e-5)


async def test_entropy_bonus_raises_the_entropy():
    paths = make_paths()
    for path in paths:
        path.advantages = [0.0] * len(path.advantages)  # only the bonus drives the update
    trainer = Trainer(tiny_model(), config(lr=1e-2, entropy_coef=1.0))
    first = await trainer.step(paths)
    second = await trainer.step(paths)
    assert second["policy/entropy"] > first["policy/entropy"]


async def test_kl_to_a_frozen_copy_of_the_initial_policy():
    trainer = Trainer(tiny_model(), config(lr=1e-2, kl_coef=0.5))
    first = await trainer.step(make_paths())
    second = await trainer.step(make_paths())
    assert first["policy/kl_ref"] == 0.0  # the policy equals its reference before the first update
    assert second["policy/kl_ref"] > 1e-6
    assert second["policy/loss"] == pytest.approx(second["policy/pg_loss"] + 0.5 * second["policy/kl_ref"], abs=1e-6)
    reference = dict(trainer.ref_model.named_parameters())
    changed = [n for n, p in trainer.model.named_parameters() if not torch.equal(p, reference[n])]
    assert changed  # the policy moved; the reference did not train
    assert not any(p.requires_grad for p in trainer.ref_model.parameters())


async def test_dedup_shared_turns_scales_advantages_by_the_path_weights():
    paths = make_paths()
    weighted = [
        TrainingPath(
            p.ids,
            p.mask,
            [a * w for a, w in zip(p.advantages, p.weights)],
            p.sampler_logprobs,
            p.turn_ids,
            p.weights,
            p.reward,
            p.leaf,
        )
        for p in paths
    ]
    assert weighted[0].advantages != paths[0].advantages  # the shared first turn has weight 1/2
    dedup = Trainer(tiny_model(), config(dedup_shared_turns=True, max_grad_norm=1e9))
    manual = Trainer(tiny_model(), config(max_grad_norm=1e9))
    await dedup.step(paths)
    await manual.step(weighted)
    for (name, a), b in zip(gradients(dedup).items(), gradients(manual).values()):
        torch.testing.assert_close(a, b, msg=name)


async def test_lora_trains_only_the_adapter_weights_and_syncs_merged_weights():
    model = tiny_model()
    base_before = {name: p.detach().clone() for name, p in model.named_parameters()}
    received = {}

    class Receiver:  # an engine that only records what it is sent
        supports_sleep = False

        async def update_weights(self, state_dict):
            received.update({name: t.clone() for name, t in state_dict.items()})

    trainer = Trainer(model, config(lr=1e-2, lora_rank=4, lora_target_modules=["q_proj", "v_proj"]), engine=Receiver())
    assert trainer.trainable_parameters and all(
        "lora_" in n for n, p in trainer.model.named_parameters() if p.requires_grad
    )
    lora_b_before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if "lora_B" in n}
    await trainer.step(make_paths())
    for name, p in trainer.model.named_parameters():
        if "lora_" in name:
            continue
        original = name.removeprefix("base_model.model.").replace(".base_layer", "")
        assert torch.equal(p, base_before[original]), name
    assert all(not torch.equal(p, lora_b_before[n]) for n, p in trainer.model.named_parameters() if "lora_B" in n)
    # The engine got W + ΔW for the adapted layers under the plain model's names; a plain copy of
    # the model with those weights computes what the LoRA policy computes.
    assert sorted(received) == [f"model.layers.{i}.self_attn.{m}.weight" for i in (0, 1) for m in ("q_proj", "v_proj")]
    plain = tiny_model()
    plain.load_state_dict(received, strict=False)
    torch.testing.assert_close(
        Trainer(plain, config()).compute_logprobs(make_paths()),
        trainer.compute_logprobs(make_paths()),
        atol=1e-5,
        rtol=1e-5,
    )


def test_lora_merges_only_plain_linear_adapters_into_the_engine_weights():
    trainer = Trainer(tiny_model(), config(lora_rank=4, lora_target_modules=["q_proj", "embed_tokens"]))
    with pytest.raises(ValueError, match=r"model\.embed_tokens: a LoRA Embedding adapter, but only plain linear"):
        trainer.engine_state_dict()


async def test_lora_kl_reference_is_the_base_model_with_adapters_off():
    trainer = Trainer(tiny_model(), config(lr=1e-2, lora_rank=4, kl_coef=0.1))
    assert trainer.ref_model is None  # no copy: the adapters are switched off instead
    first = await trainer.step(make_paths())
    second = await trainer.step(make_paths())
    assert first["policy/kl_ref"] == 0.0 and second["policy/kl_ref"] > 0


async def test_engine_sharing_the_model_needs_no_copy_and_others_get_the_state_dict():
    class SharingEngine:
        supports_sleep = False

        def __init__(self, model):
            self.model = model

        async def update_weights(self, state_dict):
            raise AssertionError("an engine that shares the model must not be sent weights")

    model = tiny_model()
    trainer = Trainer(model, config(), engine=SharingEngine(model))
    assert trainer.shares_weights_with_engine
    await trainer.step(make_paths())

    sent = []

    class CopyingEngine:
        supports_sleep = False

        async def update_weights(self, state_dict):
            sent.append({name: t.clone() for name, t in state_dict.items()})

    trainer.engine = CopyingEngine()
    await trainer.step(make_paths())
    assert len(sent) == 1
    state = trainer.model.state_dict()
    assert sent[0].keys() == state.keys()
    assert all(torch.equal(sent[0][name], state[name]) for name in state)
    with pytest.raises(TypeError, match="coroutine update_weights"):
        trainer.engine = object()

    class Unsaid:
        async def update_weights(self, state_dict):
            pass

    with pytest.raises(TypeError, match="engine must say whether it sleeps through updates .* Unsaid does not"):
        trainer.engine = Unsaid()


async def test_step_merges_the_callers_rollout_numbers(tmp_path):
    trainer = Trainer(tiny_model(), config(report_to=("tensorboard",)), out_dir=tmp_path)
    metrics = await trainer.step(make_paths(), {"time/rollout_s": 4.0, "tokens/generated": 100, "reward/em": 0.25})
    assert metrics["reward/mean"] == 0.25 and metrics["reward/std"] == pytest.approx(math.sqrt(0.6875))
    assert metrics["reward/em"] == 0.25
    assert metrics["throughput/rollout_tokens_per_s"] == 25.0
    assert metrics["time/step_s"] == pytest.approx(
        4.0 + metrics["time/old_logprobs_s"] + metrics["time/update_s"] + metrics["time/sync_s"]
    )
    assert metrics["tokens/trained"] == sum(len(p.ids) for p in make_paths()) == 58
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(records) == 1 and records[0]["step"] == 1 and records[0]["reward/em"] == 0.25
    assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    weights = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(ValueError, match=r"rollout_metrics names \['policy/x', 'reward/mean'\]"):
        await trainer.step(make_paths(), {"reward/mean": 1.0, "policy/x": 2.0})
    assert trainer.step_count == 1 and all(torch.equal(a, b) for a, b in zip(weights, trainer.model.parameters()))
    trainer.close()


async def test_resume_from_a_checkpoint_continues_bit_identically(tmp_path):
    paths = [make_paths(seed) for seed in (1, 2, 3)]
    cfg = config(lr=1e-2, mini_batches=2, micro_batch_size=1)
    original = Trainer(tiny_model(), cfg, out_dir=tmp_path / "a")
    for step in range(2):
        await original.step(paths[step])
    checkpoint = original.save_checkpoint(data_position={"next_row": 8, "epoch": 0})
    assert checkpoint == tmp_path / "a" / "checkpoints" / "step_000002"
    assert (checkpoint / "curves.png").is_file() and (tmp_path / "a" / "curves.png").is_file()
    rng_after_save = (random.random(), np.random.rand(), torch.rand(3))
    third = await original.step(paths[2])

    resumed = Trainer(tiny_model(seed=99), cfg, out_dir=tmp_path / "a")  # different initial weights
    position = resumed.resume(checkpoint)
    assert position == {"next_row": 8, "epoch": 0}
    assert resumed.step_count == 2
    assert (random.random(), np.random.rand()) == rng_after_save[:2] and torch.equal(torch.rand(3), rng_after_save[2])
    resumed.resume(checkpoint)  # rewind the generators again for the step itself
    again = await resumed.step(paths[2])
    for (name, a), b in zip(original.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), name
    assert again["policy/loss"] == third["policy/loss"]
    assert again["optim/grad_norm"] == third["optim/grad_norm"]
    state_a, state_b = original.optimizer.state_dict()["state"], resumed.optimizer.state_dict()["state"]
    assert all(torch.equal(state_a[k]["exp_avg_sq"], state_b[k]["exp_avg_sq"]) for k in state_a)
    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]  # the first run's step 3 was replaced


def test_trainer_errors_name_the_setting_and_the_fix():
    with pytest.raises(ValueError, match="loss ppo_clip_loss has no parameter eps"):
        Trainer(tiny_model(), config(loss_kwargs={"eps": 0.1}))
    with pytest.raises(ValueError, match=r"loss_kwargs sets \['kl_coef'\], which the trainer supplies"):
        Trainer(tiny_model(), config(loss_kwargs={"kl_coef": 0.1}))
    with pytest.raises(ValueError, match="set TrainerConfig.total_steps"):
        Trainer(tiny_model(), config(lr_schedule="cosine"))

    def bare_loss(logprobs, old_logprobs, advantages, mask):
        return (-(advantages * logprobs * mask).sum(), {})

    with pytest.raises(ValueError, match="bare_loss takes no kl_coef, ref_logprobs"):
        Trainer(tiny_model(), config(loss=bare_loss, kl_coef=0.1))
    with pytest.raises(ValueError, match="load the policy in float32"):
        Trainer(tiny_model().to(torch.bfloat16), config())


async def test_a_callable_loss_trains_with_sequence_weighted_accumulation():
    def reinforce(logprobs, old_logprobs, advantages, mask):
        per_sequence = (advantages * logprobs * mask).sum(-1)
        return -per_sequence.mean(), {"sequences_seen": float(mask.shape[0])}

    grads = []
    for micro_batch_size in (4, 1):
        trainer = Trainer(tiny_model(), config(loss=reinforce, micro_batch_size=micro_batch_size, max_grad_norm=1e9))
        metrics = await trainer.step(make_paths())
        grads.append(gradients(trainer))
    assert "policy/entropy" in metrics  # computed by the trainer when the loss does not report it
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-4)


async def test_bfloat16_compute_keeps_float32_weights_and_close_logprobs(monkeypatch):
    paths = make_paths()
    exact = Trainer(tiny_model(), config()).compute_logprobs(paths)
    assert Trainer(tiny_model(), config()).compute_dtype == torch.float32  # "auto" on a CPU without bfloat16 units
    monkeypatch.setenv(CPU_BFLOAT16_VARIABLE, "1")  # "auto" on one with them: autocast, as on a GPU
    trainer = Trainer(tiny_model(), config())
    assert trainer.compute_dtype == torch.bfloat16
    approximate = trainer.compute_logprobs(paths)
    assert approximate.dtype == torch.float32
    assert 0 < float((approximate - exact).abs().max()) < 0.1
    await trainer.step(paths)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())


async def test_progress_counts_steps_and_micro_batches(capsys, monkeypatch):
    monkeypatch.setattr(agents.progress, "LINE_INTERVAL", 0.0)  # a line at every count (stderr is no terminal here)
    trainer = Trainer(tiny_model(), config(progress=True, total_steps=3, micro_batch_size=2))
    await trainer.step(make_paths())
    trainer.close()
    heads = [re.sub(r" (in|after) \d\d:\d\d.*", "", line) for line in capsys.readouterr().err.splitlines()]
    assert heads == [
        "train: 0/3 steps",  # from the start of the first step
        "update step 1: 0/2 micro-batches",
        "update step 1: 1/2 micro-batches",
        "update step 1: 2/2 micro-batches",
        "update step 1: 2/2 micro-batches",  # the final line
        "train: 1/3 steps",
        "train: 1/3 steps",
    ]


async def test_a_registered_loss_is_chosen_by_name_in_the_trainer_the_learner_and_the_run_config():
    from agents.learners import GRPOCredit, Learner
    from agents.rollout.strategies import Chain
    from agents.run.config import TrainConfig, build, effective_config
    from agents.training.losses import LOSSES, ppo_clip_loss, register_loss

    @register_loss("scaled_ppo_clip_test")
    def scaled_ppo_clip(logprobs, old_logprobs, advantages, mask, factor: float = 2.0):
        """PPO-clip times ``factor``: its gradient is exactly ``factor`` times PPO-clip's."""
        loss, metrics = ppo_clip_loss(logprobs, old_logprobs, advantages, mask)
        return factor * loss, {**metrics, "loss": factor * metrics["loss"]}

    try:
        assert LOSSES["scaled_ppo_clip_test"] is scaled_ppo_clip
        with pytest.raises(ValueError, match="already registered"):
            register_loss("scaled_ppo_clip_test", ppo_clip_loss)
        grads = {}
        for loss, kwargs in (("ppo_clip", {}), ("scaled_ppo_clip_test", {"factor": 3.0})):
            trainer = Trainer(tiny_model(), config(loss=loss, loss_kwargs=kwargs, max_grad_norm=1e9))
            await trainer.step(make_paths())
            grads[loss] = gradients(trainer)
        for name, grad in grads["ppo_clip"].items():
            torch.testing.assert_close(grads["scaled_ppo_clip_test"][name], 3.0 * grad, atol=1e-7, rtol=1e-5)

        learner = Learner(strategy=Chain(2), credit=GRPOCredit(), loss="scaled_ppo_clip_test", name="scaled")
        parts = build(TrainConfig(loss={"factor": 4.0}), learner=learner)
        assert (parts.trainer.loss, parts.trainer.loss_kwargs) == ("scaled_ppo_clip_test", {"factor": 4.0})
        assert effective_config(TrainConfig(), build(TrainConfig(), learner=learner)).loss["factor"] == 2.0
    finally:
        LOSSES.pop("scaled_ppo_clip_test", None)
    with pytest.raises(ValueError, match="unknown loss 'scaled_ppo_clip_test'"):
        TrainerConfig(loss="scaled_ppo_clip_test")


@pytest.mark.parametrize("loss", ["ppo_clip", "atpo"])
async def test_token_budget_micro_batches_give_the_same_update_as_sequence_counts(loss):
    paths = with_sampler_logprobs(make_paths(), tiny_model(), shift=lambda i: 0.3 * (-1) ** i)
    weights = []
    for split in ({"micro_batch_size": 4}, {"micro_batch_size": 4, "micro_batch_tokens": 26}):
        trainer = Trainer(
            tiny_model(), config(loss=loss, old_logprobs="sampler", max_grad_norm=1e9, packing="padded", **split)
        )
        assert len(trainer.forward.micro_batches(torch.arange(4), collate(paths, 0).attention_mask.sum(-1))) == (
            1 if len(split) == 1 else 3
        )
        metrics = await trainer.step(paths)
        weights.append({name: p.detach().clone() for name, p in trainer.model.named_parameters()})
    for name, value in weights[0].items():
        # AdamW's first step moves each weight by about lr = 1e-3 whatever its gradient's size, so
        # float32 rounding of a near-zero gradient summed in another order shows up to ~1e-6 (1.07e-6
        # measured on one CPU): 1e-5 is 1% of the step.
        torch.testing.assert_close(weights[1][name], value, atol=1e-5, rtol=0)
    assert math.isfinite(metrics["policy/loss"])


@pytest.mark.parametrize("lora", [False, True])
async def test_gradient_checkpointing_recomputes_each_layer_and_gives_the_same_gradients(lora):
    paths = with_sampler_logprobs(make_paths(), tiny_model(), shift=lambda i: 0.3 * (-1) ** i)
    grads, calls = [], []
    # None: no checkpointing; 1.0: every layer recomputed; 0.5: the first of the two layers only.
    for fraction in (None, 1.0, 0.5):
        extra = {"lora_rank": 4} if lora else {}
        checkpointing = {"gradient_checkpointing": fraction is not None, "checkpoint_layers": fraction or 1.0}
        trainer = Trainer(tiny_model(), config(old_logprobs="sampler", max_grad_norm=1e9, **checkpointing, **extra))
        counts = []
        for layer in trainer.base_model.model.layers:  # module hooks do not fire on the replay; a wrapped forward does
            mlp, count = layer.mlp, []
            mlp.forward = lambda *args, forward=mlp.forward, count=count, **kwargs: (
                count.append(1),
                forward(*args, **kwargs),
            )[1]
            counts.append(count)
        await trainer.step(paths)
        grads.append(gradients(trainer))
        calls.append([len(count) for count in counts])
        assert not any(m.training for m in trainer.model.modules())  # eval mode again after the update
    # One micro-batch: a forward pass of each layer, plus the recomputation of the checkpointed ones.
    assert calls == [[1, 1], [2, 2], [2, 1]]
    assert grads[0].keys() == grads[1].keys() == grads[2].keys() and grads[0]
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-5, rtol=0)
        torch.testing.assert_close(grads[2][name], grad, atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match=r"checkpoint_layers must be a fraction in \(0, 1\], got 0"):
        config(checkpoint_layers=0)


@pytest.mark.parametrize("packing", ["padded", "flat", "tree"])
async def test_action_only_chunked_scoring_gives_the_full_logits_update(packing):
    # The output layer on action positions alone, 3 at a time and recomputed in the backward pass,
    # against the model's full logits: the same old log-probs, metrics and gradients.
    paths = with_sampler_logprobs(make_paths(), tiny_model(), shift=lambda i: 0.3 * (-1) ** i)
    runs = []
    for chunk in (None, 3):
        trainer = Trainer(
            tiny_model(), config(packing=packing, score_chunk=chunk, max_grad_norm=1e9, entropy_coef=0.01)
        )
        assert (_decoder_and_head(trainer.model) is not None) is True
        batch = collate(paths, 0)
        old = trainer.forward.score(trainer.model, batch, trainer.forward.plan(batch))
        metrics = await trainer.step(paths)
        runs.append((old, metrics, gradients(trainer)))
    (old_full, metrics_full, grads_full), (old_chunked, metrics_chunked, grads_chunked) = runs
    mask = collate(paths, 0).mask.bool()
    torch.testing.assert_close(old_chunked[mask], old_full[mask], atol=1e-6, rtol=0)
    assert (old_chunked[~mask] == 0).all()
    for name in ("policy/loss", "policy/entropy", "mismatch/max_abs"):
        assert metrics_chunked[name] == pytest.approx(metrics_full[name], abs=1e-6)
    for name, grad in grads_full.items():
        torch.testing.assert_close(grads_chunked[name], grad, atol=1e-6, rtol=1e-5)


class SleepingEngine:
    """Records what a trainer asks of an engine that can sleep (vLLM's sleep mode on a GPU)."""

    supports_sleep = True

    def __init__(self, trainer_params=None):
        self.calls, self.trainer_params = [], trainer_params

    async def sleep(self, level=1):
        self.calls.append(f"sleep {level}")

    async def wake_up(self):
        grads = [p.grad for p in self.trainer_params()] if self.trainer_params else []
        self.calls.append("wake_up" + (", gradients freed" if all(g is None for g in grads) else ""))

    async def update_weights(self, state_dict):
        self.calls.append(f"update_weights {len(state_dict)}")


@pytest.mark.parametrize(("lora", "level"), [(False, 2), (True, 1)])
async def test_an_engine_that_can_sleep_sleeps_through_the_update_and_wakes_for_the_sync(lora, level):
    trainer = Trainer(tiny_model(), config(lora_rank=4 if lora else 0))
    engine = SleepingEngine(lambda: trainer.trainable_parameters)
    trainer.engine = engine
    await trainer.step(make_paths())
    tensors = len(trainer.engine_state_dict())
    assert engine.calls == [f"sleep {level}", "wake_up, gradients freed", f"update_weights {tensors}"]
    # Level 2 drops every weight, so the sync must carry them all: the full state dict, not LoRA's part.
    assert (tensors == len(trainer.model.state_dict())) is (not lora)

    kept = Trainer(tiny_model(), config(sleep_engine=False))
    kept.engine = awake = SleepingEngine()
    await kept.step(make_paths())
    assert awake.calls == [f"update_weights {len(kept.engine_state_dict())}"]
    assert any(p.grad is not None for p in kept.trainable_parameters)  # kept for inspection


async def test_lora_over_a_bfloat16_base_trains_like_the_float32_base():
    # Two steps each: the adapters (float32, with their AdamW state) move the same way within
    # bfloat16's rounding of the base's matmuls.
    paths = with_sampler_logprobs(make_paths(), tiny_model(), shift=lambda i: 0.3 * (-1) ** i)
    runs = {}
    for dtype in (torch.float32, torch.bfloat16):
        trainer = Trainer(tiny_model().to(dtype), config(lora_rank=4, old_logprobs="sampler"))
        assert trainer.compute_dtype == dtype and {p.dtype for p in trainer.trainable_parameters} == {torch.float32}
        losses = [(await trainer.step(paths))["policy/loss"] for _ in range(2)]
        runs[dtype] = (losses, trainer.compute_logprobs(paths))
    (losses32, logprobs32), (losses16, logprobs16) = runs[torch.float32], runs[torch.bfloat16]
    assert all(math.isfinite(loss) for loss in losses16)
    assert losses16 == pytest.approx(losses32, abs=1e-3)  # measured: 1.1e-4
    mask = collate(paths, 0).mask.bool()
    assert (logprobs16 - logprobs32)[mask].abs().max() < 1e-2  # measured: 1.8e-3
    with pytest.raises(ValueError, match="base_dtype='bfloat16' needs LoRA"):
        TrainerConfig(base_dtype="bfloat16")


async def test_fused_adamw_gives_the_same_update():
    paths = with_sampler_logprobs(make_paths(), tiny_model(), shift=lambda i: 0.3 * (-1) ** i)
    weights = []
    for fused in (False, True):
        trainer = Trainer(tiny_model(), config(fused_adamw=fused, old_logprobs="sampler"))
        assert trainer.optimizer.defaults["fused"] is (True if fused else None)
        for _ in range(2):
            await trainer.step(paths)
        weights.append({name: p.detach().clone() for name, p in trainer.model.named_parameters()})
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, atol=1e-6, rtol=0)


@pytest.mark.parametrize("loss", ["ppo_clip", "atpo", "aepo"])
async def test_decoupled_objective_weights_by_proximal_over_sampler(loss):
    # The sampler's log-probs 0.3 above the policy's own: π_prox/π_behav = exp(-0.3) on every token.
    paths = with_sampler_logprobs(make_paths(), tiny_model(), shift=lambda i: 0.3)
    plain = await Trainer(tiny_model(), config(loss=loss)).step(paths)
    decoupled = await Trainer(tiny_model(), config(loss=loss, decoupled=True)).step(paths)
    assert decoupled["policy/behaviour_weight_mean"] == pytest.approx(math.exp(-0.3), rel=1e-5)
    assert decoupled["policy/behaviour_dropped_frac"] == 0.0
    assert "policy/behaviour_weight_mean" not in plain
    # recomputed π_old: the ratio is 1 in the first update either way, so only the weight differs
    assert decoupled["policy/pg_loss"] == pytest.approx(plain["policy/pg_loss"] * math.exp(-0.3), rel=1e-5)


async def test_decoupled_objective_hands_the_loss_the_samplers_logprobs():
    paths = with_sampler_logprobs(make_paths(), tiny_model(), shift=lambda i: 0.1 * i)
    seen = []

    def loss_fn(logprobs, old_logprobs, advantages, mask, *, behaviour_logprobs=None):
        seen.append(behaviour_logprobs[mask.bool()].tolist())
        return (logprobs * mask).sum() * 0.0, {}

    await Trainer(tiny_model(), config(loss=loss_fn, decoupled=True, micro_batch_size=4, packing="padded")).step(paths)
    sampler = [lp for path in paths for lp, m in zip(path.sampler_logprobs, path.mask) if m]
    assert seen[0] == pytest.approx(sampler, abs=1e-6)  # float32 of the sampler's values


def test_decoupled_objective_needs_recomputed_logprobs_and_a_loss_that_takes_them():
    with pytest.raises(ValueError, match="decoupled=True needs old_logprobs='recompute'"):
        config(decoupled=True, old_logprobs="sampler")

    def plain(logprobs, old_logprobs, advantages, mask):
        return logprobs.sum() * 0.0, {}

    with pytest.raises(ValueError, match="takes no behaviour_logprobs, so it cannot apply .* decoupled objective"):
        Trainer(tiny_model(), config(loss=plain, decoupled=True))


@pytest.mark.parametrize(
    ("loss", "extra"),
    [("ppo_clip", {}), ("atpo", {}), ("aepo", {"entropy_coef": 0.01}), ("ppo_clip", {"kl_coef": 0.05})],
)
async def test_accumulated_parts_give_the_whole_batchs_update(loss, extra):
    # Asynchronous training streams a step's batch prompt by prompt: the parts' forward and
    # backward passes run as they arrive, and step(rest) takes the one optimiser step. Parts that
    # are the whole batch's micro-batches (two padded paths each) give its very passes.
    paths = with_sampler_logprobs(make_paths(), tiny_model(), shift=lambda i: 0.2 * (-1) ** i)
    cfg = config(loss=loss, decoupled=True, micro_batch_size=2, packing="padded", **extra)
    whole_trainer = Trainer(tiny_model(), cfg)
    whole = await whole_trainer.step(paths)
    parted = Trainer(tiny_model(), cfg)
    await parted.accumulate(paths[:2])
    assert all(p.grad is not None for p in parted.trainable_parameters)  # the passes ran; no optimiser step yet
    torch.testing.assert_close(
        parted.model.model.embed_tokens.weight, tiny_model().model.embed_tokens.weight, atol=0, rtol=0
    )
    streamed = await parted.step(paths[2:])
    assert_same_gradients(parted, whole_trainer)
    for name in ("policy/pg_loss", "policy/entropy", "policy/behaviour_weight_mean", "optim/grad_norm"):
        assert streamed[name] == pytest.approx(whole[name], rel=1e-6), name
    for name in ("tokens/action", "tokens/trained", "batch/sequences", "optim/updates", "reward/mean", "reward/std"):
        assert streamed[name] == whole[name], name
    assert streamed["tokens/action"] == 32 and streamed["optim/updates"] == 1.0


@pytest.mark.parametrize("loss", ["ppo_clip", "atpo"])
async def test_accumulated_parts_of_any_size_give_the_whole_batchs_gradient(loss):
    # Parts that cut across the micro-batches: the same gradient (each pass weighted by its loss
    # units, the sum divided by the batch's). A loss with micro-batch statistics (AEPO's entropy
    # normalisation) depends on the micro-batches, in one step as in parts.
    paths = with_sampler_logprobs(make_paths(), tiny_model(), shift=lambda i: 0.2 * (-1) ** i)
    cfg = config(loss=loss, decoupled=True, micro_batch_size=2)
    whole_trainer, parted = Trainer(tiny_model(), cfg), Trainer(tiny_model(), cfg)
    await whole_trainer.step(paths)
    await parted.accumulate(paths[:1])
    await parted.accumulate(paths[1:3])
    await parted.step(paths[3:])
    assert_same_gradients(parted, whole_trainer)


def assert_same_gradients(trainer, other):
    """The gradients the optimisers stepped with (the weights are the wrong check: AdamW's first
    step moves a weight by lr·sign(g), so a rounding difference of a near-zero gradient shows as 2·lr)."""
    grads = dict(trainer.model.named_parameters())
    for name, value in other.model.named_parameters():
        torch.testing.assert_close(grads[name].grad, value.grad, atol=1e-7, rtol=1e-4)


async def test_a_step_after_accumulate_may_bring_no_paths_and_the_next_step_starts_afresh():
    paths = make_paths()
    whole_trainer, parted = Trainer(tiny_model(), config()), Trainer(tiny_model(), config())
    for _ in range(2):  # the second step must not see the first one's gradients
        whole = await whole_trainer.step(paths)
        await parted.accumulate(paths[:2])
        await parted.accumulate(paths[2:])
        streamed = await parted.step([])
        assert streamed["optim/grad_norm"] == pytest.approx(whole["optim/grad_norm"], rel=1e-5)
        assert streamed["batch/sequences"] == 4.0
    with pytest.raises(ValueError, match="got no paths and none were accumulated"):
        await parted.step([])


async def test_accumulate_needs_one_optimiser_update_a_step():
    for overrides in ({"mini_batches": 2}, {"epochs": 2}):
        trainer = Trainer(tiny_model(), config(**overrides))
        with pytest.raises(ValueError, match=r"needs one optimiser update a step, but mini_batches=\d and epochs=\d"):
            await trainer.accumulate(make_paths())
