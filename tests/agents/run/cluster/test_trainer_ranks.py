"""Trainer ranks (FSDP2 over a gloo group of Ray actors) give the one process's updates, checkpoints and resumes.

The tiny random Llama of tests/agents/training/test_trainer.py (tied embeddings, like SmolLM2) goes to
the ranks as a saved folder. Micro-batches of one sequence over mini-batches of 3 and 2 make the
ranks' counts unequal in the first (rank 1 runs a pass that contributes nothing) and equal in the
second.
"""

import os
import random

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from agents.models import tiny_llama
from agents.rollout.tree import RolloutTree, TrainingPath
from agents.run.cluster.trainer_ranks import TrainerGroup
from agents.training.trainer import Trainer, TrainerConfig

VOCAB = 50


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    return tiny_llama(seed, vocab_size=VOCAB)


def make_paths(seed: int, trees: int = 2, vocab: int = VOCAB, length: int = 5) -> list[TrainingPath]:
    """Paths of trees with a shared first turn and two leaves each (rewards 1 and 0)."""
    rng = random.Random(seed)

    def ids(n):
        return [rng.randrange(1, vocab) for _ in range(n)]

    def logprobs(n):
        return [-rng.uniform(0.5, 4.0) for _ in range(n)]

    paths = []
    for _ in range(trees):
        tree = RolloutTree(ids(length))
        shared = tree.add_turn(tree.root, action_ids=ids(length), sampler_logprobs=logprobs(length))
        for reward, n in ((1.0, length - 1), (0.0, length + 2)):
            tree.add_turn(
                shared, obs_ids=ids(3), action_ids=ids(n), sampler_logprobs=logprobs(n), terminal=True, reward=reward
            )
        for node in tree.nodes():
            node.advantage = node.reward - 0.5 if node.terminal else 0.25
        paths += tree.paths()
    return paths


def config(**overrides) -> TrainerConfig:
    values = {"lr": 1e-3, "progress": False, "report_to": ("none",), "micro_batch_size": 1, "mini_batches": 2}
    return TrainerConfig(**{**values, **overrides})


BATCH_A = make_paths(1)[:5]  # mini-batches of 3 and 2 sequences
BATCH_B = make_paths(2)[:5]


def assert_weights_equal(state, model, atol):
    own = {name: tensor.detach() for name, tensor in model.state_dict().items()}
    assert set(state) == set(own)
    difference = max(float((state[name].float() - own[name].float()).abs().max()) for name in own)
    assert difference <= atol, difference
    return difference


def assert_same_record(record, expected, grad_norm_rel=1e-6):
    assert record["policy/loss"] == pytest.approx(expected["policy/loss"], rel=1e-6)
    assert record["optim/grad_norm"] == pytest.approx(expected["optim/grad_norm"], rel=grad_norm_rel)
    for name, value in expected.items():
        if not name.startswith(("time/", "throughput/", "optim/grad_norm")):
            assert record[name] == pytest.approx(value, rel=1e-6, abs=1e-9), name


@pytest.fixture(autouse=True)
def threads_of_a_rank():
    """The single-process trainer computes with one rank's threads (TrainerGroup gives each of 2 ranks half the
    cores): sums over another thread count differ in their last bits, past the records' 1e-6."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // 2))
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny")
    tiny_model().save_pretrained(folder)
    return folder


async def test_two_ranks_train_resume_and_checkpoint_like_one_process(ray_local, tiny_folder, tmp_path):
    # The single process, uninterrupted: A, checkpoint, B.
    single = Trainer(tiny_model(), config(), out_dir=tmp_path / "single")
    expected_a = await single.step(BATCH_A)
    after_a = {name: tensor.detach().clone() for name, tensor in single.model.state_dict().items()}
    single_checkpoint = single.save_checkpoint()
    expected_b = await single.step(BATCH_B)

    group = TrainerGroup(str(tiny_folder), config(), ranks=2, out_dir=tmp_path / "ranks")
    try:
        group.open_steps_bar()  # rank 0's bar (what a run opens before its first rollout)
        # (a) one update at N = 2 is the single process's: metrics and every parameter.
        record = await group.step(BATCH_A)
        assert_same_record(record, expected_a)
        state_a = group.engine_state_dict()
        reference = tiny_model()
        reference.load_state_dict(after_a)
        difference_a = assert_weights_equal(state_a, reference, atol=1e-5)
        assert record["mismatch/tokens"] == expected_a["mismatch/tokens"] > 0

        # (c) the consolidated model/ of the sharded checkpoint loads with transformers and holds those weights.
        checkpoint = group.save_checkpoint(data_position={"next_row": 5})
        assert (checkpoint / "sharded").is_dir() and (checkpoint / "trainer_state.pt").is_file()
        loaded = AutoModelForCausalLM.from_pretrained(checkpoint / "model")
        assert_weights_equal(state_a, loaded, atol=0.0)
        saved = safe_open(checkpoint / "model" / "model.safetensors", "pt").keys()
        assert "model.embed_tokens.weight" in saved and "lm_head.weight" not in saved  # the tied matrix once

        record_b = await group.step(BATCH_B)
        assert_same_record(record_b, expected_b)
        uninterrupted = group.engine_state_dict()
        assert assert_weights_equal(uninterrupted, single.model, atol=1e-5) <= 1e-5

        # (b) N = 2 → N = 1: the next step is the uninterrupted run's.
        resumed = Trainer(tiny_model(seed=7), config(), out_dir=tmp_path / "resumed")
        assert resumed.resume(checkpoint) == {"next_row": 5} and resumed.step_count == 1
        await resumed.step(BATCH_B)
        assert_weights_equal(uninterrupted, resumed.model, atol=1e-6)

        # N = 2 → N = 2 and N = 1 → N = 2 (a single-process checkpoint, resharded).
        assert group.resume(checkpoint) == {"next_row": 5} and group.step_count == 1
        await group.step(BATCH_B)
        again = group.engine_state_dict()
        reference.load_state_dict(uninterrupted)
        assert_weights_equal(again, reference, atol=1e-6)
        group.resume(single_checkpoint)
        await group.step(BATCH_B)
        assert_weights_equal(group.engine_state_dict(), single.model, atol=1e-6)
        print(f"max parameter difference N=2 vs N=1 after one update: {difference_a:.2e}")

        # A rank that fails stops the group with an error that names it and the way on.
        with pytest.raises(
            RuntimeError, match=r"trainer rank \d on node \w+ \(\S+\) failed: .*not a checkpoint folder.*--resume"
        ):
            group.resume(tmp_path / "no-such-checkpoint")
        with pytest.raises(RuntimeError, match="closed"):
            await group.step(BATCH_B)
    finally:
        group.close()


@pytest.mark.parametrize(
    "overrides",
    [
        # LoRA under FSDP, gradient checkpointing, the KL reference = adapters off, the sampler's log-probs.
        {"lora_rank": 4, "gradient_checkpointing": True, "kl_coef": 0.05, "old_logprobs": "sampler"},
        # Full fine-tuning with a KL penalty to a (sharded) frozen copy, packed micro-batches, no chunked head.
        {"kl_coef": 0.05, "packing": "tree", "micro_batch_size": 2, "mini_batches": 1, "score_chunk": None},
    ],
    ids=["lora-checkpointing-kl-sampler", "kl-copy-packing-full-logits"],
)
async def test_two_ranks_match_one_process_with_lora_checkpointing_kl_and_packing(
    ray_local, tiny_folder, tmp_path, overrides
):
    model = tiny_model()
    torch.manual_seed(3)  # LoRA's A matrices, as the ranks draw them with seed=3
    single = Trainer(model, config(**overrides))
    expected = [await single.step(batch) for batch in (BATCH_A, BATCH_B)]
    group = TrainerGroup(str(tiny_folder), config(**overrides), ranks=2, out_dir=tmp_path, seed=3)
    try:
        records = [await group.step(batch) for batch in (BATCH_A, BATCH_B)]
        for record, want in zip(records, expected):
            assert_same_record(record, want)
        state = group.engine_state_dict()  # under LoRA: the adapted layers' merged weights
        want_state = single.engine_state_dict()
        assert set(state) == set(want_state)
        difference = max(float((state[name] - want_state[name]).abs().max()) for name in want_state)
        assert difference <= 1e-5, difference
        refs, size = await group.weight_refs(1 << 16)
        buckets = [ray_local.get(ref) for ref in refs]
        assert sum(t.numel() * t.element_size() for b in buckets for t in b.values()) == size > 0
        assert {name for b in buckets for name in b} <= set(want_state)

        # The sharded checkpoint (under LoRA: the adapter in model/) resumes in one process.
        checkpoint = group.save_checkpoint()
        resumed = Trainer(tiny_model(seed=5), config(**overrides))
        resumed.resume(checkpoint)
        assert resumed.step_count == 2
        resumed_state = resumed.engine_state_dict()
        assert max(float((state[name] - resumed_state[name]).abs().max()) for name in state) == 0.0
        assert (
            checkpoint / "model" / ("adapter_config.json" if overrides.get("lora_rank") else "config.json")
        ).is_file()

        if config(**overrides).mini_batches == 1:
            # A step streamed in parts (asynchronous training): a part of one path on two ranks
            # (rank 1 pads with a zero-share pass), then the rest with the optimiser step.
            await single.accumulate(BATCH_A[:1])
            want = await single.step(BATCH_A[1:])
            await group.accumulate(BATCH_A[:1])
            record = await group.step(BATCH_A[1:])
            assert_same_record(record, want)
            state, want_state = group.engine_state_dict(), single.engine_state_dict()
            assert max(float((state[name] - want_state[name]).abs().max()) for name in want_state) <= 1e-5
    finally:
        group.close()


def smollm_paths(seed: int) -> list[TrainingPath]:
    """Three paths of about 40 tokens with ids of SmolLM2's vocabulary."""
    return make_paths(seed, trees=2, vocab=49152, length=12)[:3]


@pytest.mark.slow
async def test_two_ranks_match_one_process_on_smollm2(ray_local):
    from agents.models import load_model

    overrides = {"lr": 1e-5, "mini_batches": 1}  # three micro-batches: rank 1 pads with a zero-share pass
    single = Trainer(load_model("smollm2-135m"), config(**overrides))
    expected = await single.step(smollm_paths(1))
    group = TrainerGroup("smollm2-135m", config(**overrides), ranks=2, out_dir=None)
    try:
        assert group.tokenizer is not None
        record = await group.step(smollm_paths(1))
        # The summed gradients are the one process's bit for bit, but float32 norms of the 28M-entry
        # embedding gradient carry ~2e-5 of rounding, and over shards it rounds differently (the
        # float64 norm, 8.009235, is nearer the sharded 8.009130 than the one process's 8.009041).
        assert_same_record(record, expected, grad_norm_rel=1e-4)
        difference = assert_weights_equal(group.engine_state_dict(), single.model, atol=1e-5)
        print(
            f"SmolLM2 N=2 vs N=1: max parameter difference {difference:.2e}, loss {record['policy/loss']!r} vs "
            f"{expected['policy/loss']!r}, grad norm {record['optim/grad_norm']!r} vs {expected['optim/grad_norm']!r}"
        )
    finally:
        group.close()
