"""Tree attention (``agents.training.tree_attention``): training on the packed tree gives the same log-probs,
losses and gradients as every path forwarded alone.

(The packed row itself, ``agents.training.packing``, has its own test file, test_packing.py.)

Random rollout trees of many shapes (one leaf, chains sharing the prompt, single-child chains,
deep and wide trees, leaves of very different lengths) go through the trainer with
``packing="tree"`` and with ``packing="padded"`` (each path its own row); everything the loss
sees must agree: per-token log-probs and entropies, every loss with every aggregation mode, the
KL term and the entropy bonus, the gradients, and the weights after an AT²PO step.
"""

import copy
import json
import math
import os
import random

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right
from transformers import LlamaForCausalLM

import agents.training.tree_attention as tree_attention_module
from agents.models import AttentionShape, tiny_llama
from agents.rollout.tree import RolloutTree, TrainingPath
from agents.training.batch import collate
from agents.training.losses import AGGREGATIONS, LOSSES
from agents.training.packing import pack_paths
from agents.training.trainer import Trainer, TrainerConfig
from agents.training.tree_attention import attention_shape, choose_kernel, kernel_unavailable

VOCAB = 50
# (depth, branching): one leaf, chains sharing the prompt, one long single-child chain, deep, wide.
SHAPES = [(1, 1), (1, 6), (6, 1), (3, 3), (6, 2), (2, 6)]


def tiny_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    # Larger weights than the default 0.02 give peaked, varied next-token distributions: AEPO
    # standardises the entropies (eq. 36), which amplifies float rounding when they are all ≈ log V.
    values = {"vocab_size": VOCAB, "max_position_embeddings": 1024, "initializer_range": 0.5, **overrides}
    return tiny_llama(seed, **values)


def random_tree(rng: random.Random, depth: int, branching: int, vocab: int = VOCAB) -> RolloutTree:
    """A tree ``depth`` turns deep whose nodes have 1 to ``branching`` children; some branches end early.

    Actions are 1-12 tokens, one in five 30-60 (leaves of very different lengths), observations 0-5;
    sampler log-probs are off the model's so that ratios differ from 1 and some tokens clip.
    """

    def ids(n: int) -> list[int]:
        return [rng.randrange(1, vocab) for _ in range(n)]

    tree = RolloutTree(ids(rng.randint(2, 12)))

    def grow(node, level: int) -> None:
        children = rng.randint(1, branching)
        for _ in range(children):
            n = rng.randint(30, 60) if rng.random() < 0.2 else rng.randint(1, 12)
            last = level == depth or (level > 1 and rng.random() < 0.25)
            child = tree.add_turn(
                node,
                obs_ids=ids(rng.randint(0, 5)) if level > 1 else [],
                action_ids=ids(n),
                sampler_logprobs=[-rng.uniform(0.5, 5.0) for _ in range(n)],
                terminal=last,
                reward=rng.choice([0.0, 1.0]) if last else None,
            )
            child.advantage = rng.gauss(0.0, 1.0)
            if not last:
                grow(child, level + 1)

    grow(tree.root, 1)
    return tree


def random_trees(seed: int, depth: int, branching: int, trees: int = 2, vocab: int = VOCAB) -> list[RolloutTree]:
    rng = random.Random(seed)
    return [random_tree(rng, depth, branching, vocab) for _ in range(trees)]


def tree_paths(seed: int, depth: int, branching: int, trees: int = 2, vocab: int = VOCAB) -> list[TrainingPath]:
    return [path for tree in random_trees(seed, depth, branching, trees, vocab) for path in tree.paths()]


def tree_tokens(tree: RolloutTree) -> int:
    """Every node's tokens once: what a packed row of the tree holds (fewer where siblings begin alike)."""
    return len(tree.root.obs_ids) + sum(len(node.obs_ids) + len(node.action_ids) for node in tree.nodes())


def config(**overrides) -> TrainerConfig:
    values = {
        "lr": 1e-3,
        "progress": False,
        "report_to": ["none"],
        "old_logprobs": "sampler",
        "max_grad_norm": 1e9,
        "micro_batch_size": 64,
        **overrides,
    }
    return TrainerConfig(**values)


def gradients(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in trainer.model.named_parameters() if p.grad is not None}


# -- the kernels ----------------------------------------------------------------------------


def test_the_kernel_is_per_path_for_paths_of_very_different_lengths_and_batched_for_alike_ones():
    uneven = torch.tensor([[1] * 400 + [2] * 50, [1] * 20 + [3] * 40 + [0] * 390])
    assert choose_kernel(pack_paths(uneven, (uneven > 0).long())) == "per-path"  # 101k + 40·60 + 2 calls < 2·450·450
    alike = torch.tensor([[1, 2, 3, k, k + 1] for k in range(4, 40)])
    assert choose_kernel(pack_paths(alike, torch.ones_like(alike))) == "batched"


def long_rows() -> tuple:
    long = torch.ones(2, 600, dtype=torch.long)
    long[1, 300:] = 2  # the rows share 300 tokens: 900 packed
    short = pack_paths(long, torch.ones_like(long))
    longer = pack_paths(torch.cat([long, long + 2]), torch.ones(4, 600, dtype=torch.long))
    assert (short.tokens, longer.tokens) == (900, 1800)
    return short, longer


def test_on_cuda_rows_run_varlen_in_16_bits_else_flex_when_long_and_heads_allow():
    short, longer = long_rows()
    wide, narrow = AttentionShape(9, 3, 64), AttentionShape(4, 2, 8)
    for row in (short, longer):  # varlen (flash) needs 16-bit inputs; torch here has it
        assert choose_kernel(row, "cuda", shape=wide, compute_dtype=torch.bfloat16) == "varlen"
    assert choose_kernel(short, "cuda", shape=wide) != "flex" and choose_kernel(longer, "cuda", shape=wide) == "flex"
    # Inductor's flex kernel cannot compile a head dimension of 8 (the H200 run's failure).
    assert choose_kernel(longer, "cuda", shape=narrow) == choose_kernel(longer, "cpu") != "flex"
    for device in ("cpu", "cuda"):
        assert choose_kernel(longer, device, shape=narrow, compute_dtype=torch.bfloat16) != "flex"
    assert choose_kernel(longer, "cpu", shape=wide, compute_dtype=torch.bfloat16) != "varlen"
    assert choose_kernel(longer) != "flex"


def test_a_forced_kernel_that_cannot_run_here_is_refused_at_trainer_start():
    with pytest.raises(ValueError, match=r"tree_kernel='varlen' cannot run here: varlen runs on CUDA only"):
        Trainer(tiny_model(), config(packing="tree", tree_kernel="varlen"))
    assert kernel_unavailable("varlen", "cuda", None, torch.float32) == (
        "varlen runs flash attention, which needs a 16-bit compute dtype, not torch.float32"
    )
    assert kernel_unavailable("flex", "cuda", AttentionShape(4, 2, 8), torch.bfloat16) == (
        "FlexAttention's compiled kernel needs a head dimension >= 16; the model's is 8"
    )
    assert kernel_unavailable("flex", "cpu", AttentionShape(4, 2, 8), torch.float32) is None  # eager on CPU
    with pytest.raises(ValueError, match=r"tree_kernel must be one of 'auto', 'per-path', .*got 'fast'"):
        config(tree_kernel="fast")
    assert attention_shape(tiny_model()) == AttentionShape(4, 2, 8)


def test_the_flex_mask_lets_each_place_see_exactly_its_path_up_to_itself():
    """The preorder intervals give the same visibility as "on my path, at a depth up to mine"."""
    for seed in range(5):
        batch = collate(tree_paths(seed, 4, 3, trees=3), 0)
        packed = pack_paths(batch.ids, batch.attention_mask)
        enter, exit = (torch.tensor(v) for v in tree_attention_module._preorder(packed.previous.tolist()))
        sees = (enter[None, :] <= enter[:, None]) & (enter[:, None] < exit[None, :])  # [q, k]
        on_path = torch.zeros(len(packed.lengths), packed.tokens, dtype=torch.bool)
        for row, length in enumerate(packed.lengths):
            on_path[row, packed.where[row, :length]] = True
        owner = torch.repeat_interleave(torch.tensor([n - s for s, n in zip(packed.starts, packed.lengths)]))
        depth = packed.positions[0]
        expected = on_path[owner][:, :] & (depth[None, :] <= depth[:, None])
        assert torch.equal(sees, expected)
        assert sorted(enter.tolist()) == list(range(packed.tokens))


COMPILE_COUNT = """
import json, random, sys
import torch
from torch._dynamo.testing import CompileCounter
import agents.training.tree_attention as tree_attention
from agents.models import AttentionShape
from agents.training.batch import collate
from agents.training.packing import pack_paths
sys.path.insert(0, sys.argv[1])
from test_tree_attention import tree_paths

counter = CompileCounter()
tree_attention.COMPILE_BACKENDS = {"cpu": counter}
shape = AttentionShape(4, 2, 16)
tree_attention.warm_up_flex(shape, torch.device("cpu"), torch.float32)
counts, sizes = [counter.frame_count], []
rng = random.Random(0)
for i in range(12):
    paths = tree_paths(100 + i, rng.randint(1, 6), rng.randint(1, 6), trees=rng.randint(1, 4))
    batch = collate(paths, 0)
    packed = pack_paths(batch.ids, batch.attention_mask)
    q = torch.randn(1, shape.heads, packed.tokens, shape.head_dim)
    k, v = (torch.randn(1, shape.kv_heads, packed.tokens, shape.head_dim) for _ in "kv")
    with torch.no_grad():
        out = tree_attention._flex(packed, q, k, v, shape.head_dim**-0.5, True)
    assert out.shape == q.shape
    counts.append(counter.frame_count)
    sizes.append([len(paths), packed.tokens])
print(json.dumps({"counts": counts, "sizes": sizes}))
"""


def test_flex_attention_compiles_once_for_rows_of_any_length_and_path_count():
    """Dynamo's own count: after the warm-up, 12 rows of 1 to 40 paths and 76 to 9,554 places
    (padded to 2 to 75 blocks) compile nothing more. On CPU the eager backend stands in for
    inductor (FlexAttention's backward pass needs a GPU: the no-gradient pass is counted). In a
    fresh interpreter: dynamo's caches and guards are per process, and other tests compile too."""
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    run = subprocess.run(
        [sys.executable, "-c", COMPILE_COUNT, str(here)],
        capture_output=True,
        text=True,
        cwd=here.parents[2],
        env={**os.environ, "PYTHONPATH": str(here.parents[2])},
        check=True,
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["counts"] == [2] * 13  # the block mask and the attention, compiled by the warm-up only
    assert len({tuple(size) for size in result["sizes"]}) == 12
    assert min(tokens for _, tokens in result["sizes"]) < 128 < 9000 < max(tokens for _, tokens in result["sizes"])


@pytest.mark.parametrize(("depth", "branching"), [(1, 6), (6, 1), (3, 3), (2, 6)])
def test_flex_attentions_logprobs_equal_the_padded_paths(depth, branching, monkeypatch):
    """FlexAttention's block mask over the whole row (the GPU kernel; on CPU PyTorch runs it
    forward only, so this checks the old log-probs' pass) gives every leaf's log-probs."""
    trees = random_trees(10 * depth + branching, depth, branching)
    batch = collate([path for tree in trees for path in tree.paths()], 0)
    padded = Trainer(tiny_model(), config(packing="padded")).compute_logprobs(batch)
    flex_calls, flex = [], tree_attention_module._flex
    monkeypatch.setattr(tree_attention_module, "_flex", lambda *args: (flex_calls.append(1), flex(*args))[1])
    trainer = Trainer(tiny_model(), config(packing="tree", tree_kernel="flex"))
    # 1e-5 plus float32 rounding of the value (|log-probs| ≈ 12 on random weights): FlexAttention
    # sums the softmax in another order than SDPA.
    torch.testing.assert_close(trainer.compute_logprobs(batch), padded, atol=1e-5, rtol=2e-6)
    assert [micro.kernel for micro in trainer.forward.plan(batch).micro_batches] == ["flex"]  # one pass, by flex
    assert len(flex_calls) == trainer.model.config.num_hidden_layers  # its every attention call


def test_varlens_layout_gives_per_path_attention(monkeypatch):
    """varlen runs flash attention on CUDA only; here a reference of its contract (each sequence's
    queries against its keys, causal aligned to the last key) checks what the kernel hands it."""

    def reference(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, **options):
        assert options == {"window_size": (-1, 0), "enable_gqa": True} and q.dtype == k.dtype == v.dtype
        assert (max_q, max_k) == (int(cu_q.diff().max()), int(cu_k.diff().max())) and cu_q.dtype == torch.int32
        outs = []
        for i in range(len(cu_q) - 1):
            qs, ks, vs = (
                t[a:b].transpose(0, 1)
                for t, (a, b) in ((q, cu_q[i : i + 2]), (k, cu_k[i : i + 2]), (v, cu_k[i : i + 2]))
            )
            bias = causal_lower_right(qs.shape[1], ks.shape[1])
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, bias, scale=scale, enable_gqa=True).transpose(0, 1))
        return torch.cat(outs)

    monkeypatch.setattr(tree_attention_module, "_varlen_attention", lambda: (reference, {"window_size": (-1, 0)}, True))
    batch = collate(tree_paths(5, 3, 3), 0)
    packed = pack_paths(batch.ids, batch.attention_mask)
    q = torch.randn(1, 4, packed.tokens, 16)
    k, v = (torch.randn(1, 2, packed.tokens, 16) for _ in "kv")
    want = tree_attention_module._per_path(packed, q, k, v, 0.25, True)
    torch.testing.assert_close(tree_attention_module._varlen(packed, q, k, v, 0.25, True), want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's backward pass and varlen need a GPU")
@pytest.mark.parametrize("kernel", ["flex", "varlen", "per-path"])
async def test_on_cuda_a_long_rows_update_gives_the_padded_loss_and_gradients(kernel):
    paths = tree_paths(4, 6, 3, trees=6)  # more than FLEX_MIN_TOKENS packed
    # Head dimension 16, the least inductor's flex kernel compiles; bfloat16 compute for varlen (flash).
    dtype = "bfloat16" if kernel == "varlen" else "float32"
    results = {}
    for packing in ("padded", "tree"):
        model = tiny_model(hidden_size=64).cuda()
        trainer = Trainer(model, config(packing=packing, tree_kernel=kernel, loss="atpo", compute_dtype=dtype))
        metrics = await trainer.step(paths)
        results[packing] = (metrics, {k: v.cpu() for k, v in gradients(trainer).items()})
    (tree_metrics, tree_grads), (padded_metrics, padded_grads) = results["tree"], results["padded"]
    if kernel != "per-path":
        assert tree_metrics[f"batch/tree_{kernel}_passes"] == 1.0
    # bfloat16 keeps 8 bits of mantissa: 2^-8 relative, summed over the row; float32 as on CPU.
    rel, atol = (1e-2, 1e-2) if dtype == "bfloat16" else (1e-5, 1e-4)
    assert tree_metrics["policy/loss"] == pytest.approx(padded_metrics["policy/loss"], rel=rel, abs=atol)
    for name in padded_grads:
        torch.testing.assert_close(tree_grads[name], padded_grads[name], atol=atol, rtol=10 * rel)


# -- exactness on the tiny model ----------------------------------------------------------------


@pytest.mark.parametrize(("depth", "branching"), SHAPES)
@pytest.mark.parametrize("kernel", ["per-path", "batched"])
def test_every_leafs_logprobs_and_entropies_equal_the_padded_paths(depth, branching, kernel):
    trees = random_trees(10 * depth + branching, depth, branching)
    paths = [path for tree in trees for path in tree.paths()]
    batch = collate(paths, 0)
    scores = {}
    for packing in ("padded", "tree"):
        trainer = Trainer(tiny_model(), config(packing=packing, tree_kernel=kernel))
        everything = trainer.compute_logprobs(batch)
        everyone = trainer.forward.micro_batch(batch, torch.arange(len(paths)))  # the whole batch in one pass
        actions, entropy = trainer.forward(trainer.model, batch, everyone)
        scores[packing] = (everything, actions, entropy)
    for tree, padded in zip(scores["tree"], scores["padded"]):
        # float32 in another summation order: up to 1.3e-5 on entropies near 12 (1.1e-6 relative) on one CPU.
        torch.testing.assert_close(tree, padded, atol=1e-5, rtol=1e-5)
    packed = pack_paths(batch.ids, batch.attention_mask)
    assert packed.tokens <= sum(tree_tokens(tree) for tree in trees) <= int(batch.attention_mask.sum())


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("agg", AGGREGATIONS)
@pytest.mark.parametrize("regulariser", ["none", "kl", "entropy"])
async def test_every_loss_aggregation_kl_and_entropy_bonus_gives_the_padded_loss_and_gradients(loss, agg, regulariser):
    paths = tree_paths(7, 3, 3)
    extra = {"kl": {"kl_coef": 0.05}, "entropy": {"entropy_coef": 0.01}, "none": {}}[regulariser]
    results = {}
    for packing in ("padded", "tree"):
        trainer = Trainer(tiny_model(), config(packing=packing, loss=loss, loss_kwargs={"agg": agg}, **extra))
        if regulariser == "kl":  # a reference that differs from the policy, so the KL term is not 0
            trainer.ref_model.load_state_dict(tiny_model(1).state_dict())
        metrics = await trainer.step(paths)
        results[packing] = (metrics, gradients(trainer))
    (tree_metrics, tree_grads), (padded_metrics, padded_grads) = results["tree"], results["padded"]
    assert tree_metrics["policy/loss"] == pytest.approx(padded_metrics["policy/loss"], rel=1e-6, abs=1e-9)
    for name in ("policy/entropy", "policy/kl_ref", "policy/pg_loss", "policy/clip_frac_low", "policy/clip_frac_high"):
        if name in padded_metrics:
            assert tree_metrics[name] == pytest.approx(padded_metrics[name], rel=1e-5, abs=1e-7), name
    if regulariser == "kl":
        assert padded_metrics["policy/kl_ref"] > 1e-3
    assert tree_grads.keys() == padded_grads.keys() and len(tree_grads) > 10
    for name in padded_grads:
        # float32 rounding grows with the gradient: 1e-5 up to gradients of 10 (ppo_clip's here reach 9.6,
        # sft's, all of one sign, 27.6)
        scale = max(1.0, padded_grads[name].abs().max().item() / 10)
        torch.testing.assert_close(tree_grads[name], padded_grads[name], atol=1e-5 * scale, rtol=1e-4)


async def tree_and_padded(make_model, paths, **settings):
    """An AT²PO step on ``paths`` packed as a tree and padded, each on a fresh model: (log-probs, metrics, gradients)."""
    results = {}
    for packing in ("tree", "padded"):
        trainer = Trainer(make_model(), config(packing=packing, loss="atpo", **settings))
        scores = trainer.compute_logprobs(paths)
        metrics = await trainer.step(paths)
        results[packing] = (scores, metrics, gradients(trainer))
    return results["tree"], results["padded"]


async def test_under_bfloat16_compute_on_a_cpu_the_packed_tree_gives_the_padded_update_to_bfloat16s_precision():
    # "auto" on a CPU with bfloat16 units: autocast over float32 weights, as on a GPU.
    paths = tree_paths(7, 3, 3)
    (tree_scores, tree_metrics, tree_grads), (padded_scores, padded_metrics, padded_grads) = await tree_and_padded(
        tiny_model, paths, compute_dtype="bfloat16"
    )
    # bfloat16 keeps 8 bits: products summed in another order (one packed row, or padded rows) differ by a few
    # of its roundings, 2^-8 relative each
    torch.testing.assert_close(tree_scores, padded_scores, atol=2e-2, rtol=1e-2)
    assert tree_metrics["policy/loss"] == pytest.approx(padded_metrics["policy/loss"], rel=1e-2, abs=1e-3)
    for name in padded_grads:
        scale = max(1.0, padded_grads[name].abs().max().item())
        torch.testing.assert_close(tree_grads[name], padded_grads[name], atol=2e-2 * scale, rtol=5e-2)


async def test_a_step_packs_each_micro_batch_once_for_all_its_passes(monkeypatch):
    # Recomputed old log-probs, a KL reference and two epochs over two mini-batches: four passes over
    # every micro-batch, all on the one packing the step planned.
    import agents.training.forward as forward_module

    packed_rows = []

    def counted_pack_paths(ids, attention_mask, **kwargs):
        packed_rows.append(ids.shape[0])
        return pack_paths(ids, attention_mask, **kwargs)

    monkeypatch.setattr(forward_module, "pack_paths", counted_pack_paths)
    paths = tree_paths(3, 4, 3, trees=3)
    batch = collate(paths, 0)
    settings = {"old_logprobs": "recompute", "kl_coef": 0.05, "epochs": 2, "mini_batches": 2, "micro_batch_size": 3}
    trainer = Trainer(tiny_model(), config(packing="tree", **settings))
    splits = [
        trainer.forward.micro_batches(rows, batch.attention_mask.sum(-1), batch.ids)
        for rows in torch.arange(len(paths)).tensor_split(2)
    ]
    metrics = await trainer.step(paths)
    assert len(packed_rows) == sum(len(split) for split in splits) >= 4  # once per micro-batch
    assert sum(packed_rows) == len(paths)  # every path packed once
    packed_tokens = sum(pack_paths(batch.ids[rows], batch.attention_mask[rows]).tokens for s in splits for rows in s)
    assert metrics["batch/tokens_forwarded"] == 2 * packed_tokens  # both epochs' update passes
    assert metrics["policy/kl_ref"] > 0 and math.isfinite(metrics["policy/loss"])


async def test_trees_split_over_micro_batches_by_packed_tokens_give_the_same_update():
    paths = tree_paths(3, 4, 3, trees=3)
    batch = collate(paths, 0)
    lengths = batch.attention_mask.sum(-1)
    results, splits = [], []
    for packing, budget in (("padded", None), ("tree", None), ("tree", 120)):
        trainer = Trainer(tiny_model(), config(packing=packing, micro_batch_size=4, micro_batch_tokens=budget))
        splits.append(trainer.forward.micro_batches(torch.arange(len(paths)), lengths, batch.ids))
        metrics = await trainer.step(paths)
        results.append((metrics["policy/loss"], gradients(trainer)))
    padded_split, tree_split, budget_split = splits
    assert len(tree_split) < len(padded_split) and len(budget_split) > len(tree_split)
    for group in budget_split:
        packed = pack_paths(batch.ids[group], batch.attention_mask[group])
        assert packed.tokens <= 120 or len(group) == 1
    (loss, grads), *others = results
    for other_loss, other_grads in others:
        assert other_loss == pytest.approx(loss, rel=1e-6)
        for name, value in grads.items():
            torch.testing.assert_close(other_grads[name], value, atol=1e-5, rtol=1e-4)


async def test_an_at2po_step_on_the_packed_tree_leaves_the_weights_of_the_padded_step():
    from agents.learners import AT2PO

    paths = tree_paths(11, 4, 3, trees=3)
    learner = AT2PO()
    weights = []
    for packing in ("padded", "tree"):
        trainer_config = learner.trainer_config(lr=1e-3, progress=False, report_to=("none",), packing=packing)
        trainer = Trainer(tiny_model(), trainer_config)
        metrics = await trainer.step(paths)
        weights.append({name: p.detach().clone() for name, p in trainer.model.named_parameters()})
        assert math.isfinite(metrics["policy/loss"]) and trainer_config.loss == "atpo"
    for name, value in weights[0].items():
        torch.testing.assert_close(weights[1][name], value, atol=1e-5, rtol=0)
    assert any(not torch.equal(weights[0][name], tiny_model().state_dict()[name]) for name in weights[0])


def test_a_model_whose_attention_bypasses_transformers_interface_is_refused():
    model = tiny_model()
    model.config._attn_implementation = "eager"
    with pytest.raises(ValueError, match="attn_implementation='eager'.*attn_implementation='sdpa'"):
        Trainer(model, config(packing="tree"))
    with pytest.raises(ValueError, match="packing must be 'tree', 'flat' or 'padded', got 'trie'"):
        config(packing="trie")
    assert config(packing=True).packing == "flat" and config(packing=False).packing == "padded"


def test_an_engine_sharing_the_model_generates_as_before_once_tree_attention_is_on():
    model = tiny_model()
    ids = torch.tensor([[3, 4, 5, 6, 0, 0], [7, 8, 9, 10, 11, 12]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).logits
        Trainer(model, config(packing="tree")).compute_logprobs(tree_paths(1, 2, 2))
        after = model(input_ids=ids, attention_mask=mask).logits
    assert model.config._attn_implementation == "agents_tree+sdpa"
    torch.testing.assert_close(after * mask[..., None], before * mask[..., None], atol=1e-6, rtol=0)


async def test_gradient_checkpointing_recomputes_the_tree_attention():
    paths = tree_paths(5, 3, 3)
    grads = []
    for checkpointing in (False, True):
        model = copy.deepcopy(tiny_model())
        trainer = Trainer(model, config(packing="tree", gradient_checkpointing=checkpointing))
        await trainer.step(paths)
        grads.append(gradients(trainer))
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-6, rtol=1e-5)


# -- the real model -----------------------------------------------------------------------------


@pytest.mark.slow
async def test_smollm2_packed_tree_gives_the_padded_logprobs_loss_and_gradients():
    from agents.models import load_model

    model = load_model("smollm2-135m")
    paths = tree_paths(2, 3, 3, trees=1, vocab=model.config.vocab_size)
    (tree_scores, tree_metrics, tree_grads), (padded_scores, padded_metrics, padded_grads) = await tree_and_padded(
        lambda: copy.deepcopy(model), paths
    )
    # Random ids make log-probs of about -14, where float32 over 30 layers keeps about 6 digits.
    torch.testing.assert_close(tree_scores, padded_scores, atol=1e-5, rtol=2e-6)
    assert tree_metrics["policy/loss"] == pytest.approx(padded_metrics["policy/loss"], rel=1e-6)
    for name in padded_grads:
        torch.testing.assert_close(tree_grads[name], padded_grads[name], atol=1e-5, rtol=1e-4)
