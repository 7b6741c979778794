"""RolloutTree: structure, training paths, collation, save/load, rendering."""

import asyncio
import math

import numpy as np
import pytest
import torch

from agents.rollout.tree import FORMAT, RolloutTree
from agents.training.batch import collate


def small_tree() -> RolloutTree:
    """root [1,2,3] -> a (7,8) -> {a1 (obs 4, act 10), a2 (obs 4, act 11)}; root -> b (9)."""
    tree = RolloutTree([1, 2, 3], env="env-root")
    a = tree.add_turn(tree.root, action_ids=[7, 8], sampler_logprobs=[-0.1, -0.5], env="env-a")
    tree.add_turn(tree.root, action_ids=[9], sampler_logprobs=[-0.2], terminal=True, reward=0.0)
    tree.add_turn(
        a,
        obs_ids=[4],
        action_ids=[10],
        sampler_logprobs=[-0.4],
        terminal=True,
        reward=1.0,
        token_entropies=[1.5],
        info={"finish": "answer"},
    )
    a2 = tree.add_turn(a, obs_ids=[4, 5], action_ids=[11, 12, 13], sampler_logprobs=[-0.3, -0.6, -0.9])
    a2.finish(reward=-1.0)
    return tree


def test_structure_ids_depths_siblings_and_order():
    tree = small_tree()
    a, b, a1, a2 = (tree.node(i) for i in (1, 2, 3, 4))
    assert [n.id for n in tree.nodes()] == [1, 3, 4, 2]  # depth-first, children in creation order
    assert [n.id for n in tree.leaves()] == [3, 4, 2]
    assert len(tree) == 4
    assert (tree.root.depth, a.depth, a1.depth, b.depth) == (0, 1, 2, 1)
    assert a1.siblings == [a2] and a.siblings == [b] and tree.root.siblings == []
    assert a1.parent is a and a.parent is tree.root and tree.root.is_root and not a.is_root
    assert a1.terminal and not a.terminal
    assert tree.root.env == "env-root" and a.env == "env-a" and a1.env is None
    assert a1.token_entropies == [1.5] and a1.info == {"finish": "answer"}


def test_node_entropy_is_mean_negative_sampler_logprob():
    tree = small_tree()
    assert tree.node(4).entropy == pytest.approx(0.6, abs=1e-15)  # -(-0.3 - 0.6 - 0.9) / 3
    assert tree.node(1).entropy == pytest.approx(0.3, abs=1e-15)
    with pytest.raises(ValueError, match="root is the prompt"):
        tree.root.entropy


def test_prefixes_are_shared_not_copied():
    tree = small_tree()
    a, a2 = tree.node(1), tree.node(4)
    assert a2.obs_ids == [4, 5] and a2.action_ids == [11, 12, 13]  # only its own segment
    assert a2.context_ids() == [1, 2, 3, 7, 8, 4, 5, 11, 12, 13]
    assert a2.parent.context_ids() + a2.obs_ids == [1, 2, 3, 7, 8, 4, 5]  # a sibling's context
    assert tree.root.context_ids() == [1, 2, 3]
    assert [n.id for n in a2.lineage()] == [0, 1, 4]
    # The shared turn a is one object under both leaves.
    assert tree.node(3).parent is a2.parent is a


def test_paths_turn_advantages_masks_weights_and_logprobs():
    tree = small_tree()
    for node, adv in zip(tree.nodes(), (-0.1, 1.0, -1.0, 0.5)):  # ids 1, 3, 4, 2
        node.advantage = adv
    paths = tree.paths()
    assert [p.leaf.id for p in paths] == [3, 4, 2]
    p = paths[1]  # a -> a2
    assert p.ids == [1, 2, 3, 7, 8, 4, 5, 11, 12, 13]
    assert p.mask == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    assert p.advantages == [0, 0, 0, -0.1, -0.1, 0, 0, -1.0, -1.0, -1.0]
    assert p.turn_ids == [0, 0, 0, 1, 1, 4, 4, 4, 4, 4]
    assert p.weights == [0, 0, 0, 0.5, 0.5, 0, 0, 1, 1, 1]  # turn a is on two leaf paths
    assert [x for x, m in zip(p.sampler_logprobs, p.mask) if m] == [-0.1, -0.5, -0.3, -0.6, -0.9]
    assert all(math.isnan(x) for x, m in zip(p.sampler_logprobs, p.mask) if not m)
    assert p.reward == -1.0 and p.leaf is tree.node(4)
    assert paths[2].ids == [1, 2, 3, 9] and paths[2].weights == [0, 0, 0, 1.0]
    # the de-duplication weights of a shared turn sum to one over the paths
    assert sum(path.weights[3] for path in paths[:2]) == 1.0


def test_paths_leaf_mode_broadcasts_the_leaf_advantage():
    tree = small_tree()
    for leaf, adv in zip(tree.leaves(), (0.7, -0.7, 0.0)):
        leaf.advantage = adv
    paths = tree.paths(advantage="leaf")
    assert paths[0].advantages == [0, 0, 0, 0.7, 0.7, 0, 0.7]
    assert paths[1].advantages == [0, 0, 0, -0.7, -0.7, 0, 0, -0.7, -0.7, -0.7]
    with pytest.raises(ValueError, match="node 1 has no advantage.*advantage='leaf'"):
        tree.paths()  # the internal turn a has no advantage of its own
    with pytest.raises(ValueError, match="'turn' or 'leaf'"):
        tree.paths(advantage="token")


def test_paths_require_advantages_and_rewards():
    tree = small_tree()
    with pytest.raises(ValueError, match="node 3 has no advantage: run credit assignment"):
        tree.paths(advantage="leaf")
    tree.node(3).reward = None
    with pytest.raises(ValueError, match="leaf 3 has no reward"):
        tree.paths()


def test_add_turn_rejects_bad_input_with_clear_errors():
    tree = small_tree()
    a = tree.node(1)
    with pytest.raises(ValueError, match="logprobs has 1 values but the action has 2 tokens"):
        tree.add_turn(a, action_ids=[1, 2], sampler_logprobs=[-0.1])
    with pytest.raises(ValueError, match="positive: give log-probabilities"):
        tree.add_turn(a, action_ids=[1], sampler_logprobs=[0.7])
    with pytest.raises(ValueError, match="logprobs\\[0\\] must be a finite number"):
        tree.add_turn(a, action_ids=[1], sampler_logprobs=[float("-inf")])
    with pytest.raises(ValueError, match="at least one sampled action token"):
        tree.add_turn(a, action_ids=[], sampler_logprobs=[])
    with pytest.raises(ValueError, match="obs_ids\\[1\\] = -3 is not a token id"):
        tree.add_turn(a, obs_ids=[1, -3], action_ids=[1], sampler_logprobs=[-1.0])
    with pytest.raises(ValueError, match="action_ids\\[0\\] = 1.5 is not a token id"):
        tree.add_turn(a, action_ids=[1.5], sampler_logprobs=[-1.0])
    with pytest.raises(ValueError, match="action_ids\\[1\\] = True is not a token id"):
        tree.add_turn(a, action_ids=[1, True], sampler_logprobs=[-1.0, -1.0])
    with pytest.raises(ValueError, match="token_entropies\\[0\\] must be a finite number, got nan"):
        tree.add_turn(a, action_ids=[1], sampler_logprobs=[-1.0], token_entropies=[float("nan")])
    with pytest.raises(ValueError, match="token_entropies has 2 values"):
        tree.add_turn(a, action_ids=[1], sampler_logprobs=[-1.0], token_entropies=[0.1, 0.2])
    with pytest.raises(ValueError, match="node 3 ended its episode"):
        tree.add_turn(tree.node(3), action_ids=[1], sampler_logprobs=[-1.0])
    with pytest.raises(ValueError, match="terminal turn needs its episode's reward"):
        tree.add_turn(a, action_ids=[1], sampler_logprobs=[-1.0], terminal=True)
    with pytest.raises(ValueError, match="not terminal"):
        tree.add_turn(a, action_ids=[1], sampler_logprobs=[-1.0], reward=1.0)
    with pytest.raises(ValueError, match="reward must be a finite number"):
        tree.add_turn(a, action_ids=[1], sampler_logprobs=[-1.0], terminal=True, reward=float("nan"))
    with pytest.raises(ValueError, match="not in this tree"):
        tree.add_turn(small_tree().node(1), action_ids=[1], sampler_logprobs=[-1.0])
    with pytest.raises(ValueError, match="already has children"):
        a.finish(1.0)
    with pytest.raises(ValueError, match="only a turn can end"):
        tree.root.finish(1.0)
    assert len(tree) == 4  # nothing was added by the failed calls


def test_add_turn_accepts_tensors_and_numpy_and_rounds_tiny_positive_logprobs():
    tree = RolloutTree(torch.tensor([5, 6]))
    node = tree.add_turn(
        tree.root,
        action_ids=np.array([3, 4]),
        sampler_logprobs=torch.tensor([-0.5, 1e-7]),
        terminal=True,
        reward=np.float32(1.0),
    )
    assert tree.prompt_ids == [5, 6] and node.action_ids == [3, 4]
    assert node.sampler_logprobs == [-0.5, 0.0] and node.reward == 1.0
    assert all(type(x) is int for x in node.action_ids)
    mixed = tree.add_turn(tree.root, action_ids=[7, np.int64(8)], sampler_logprobs=[-1.0, np.float32(-0.5)])
    assert [type(x) for x in mixed.action_ids] == [int, int] and [type(x) for x in mixed.sampler_logprobs] == [
        float,
        float,
    ]


async def test_concurrent_coroutines_grow_one_tree_consistently():
    tree = RolloutTree([1])

    async def episode(branch: int) -> None:
        node = tree.root
        for turn in range(5):
            await asyncio.sleep(0)  # interleave with the other episodes
            node = tree.add_turn(node, obs_ids=[turn], action_ids=[branch], sampler_logprobs=[-1.0])
        node.finish(float(branch))

    await asyncio.gather(*(episode(b) for b in range(20)))
    assert len(tree) == 100 and len(tree.leaves()) == 20
    assert sorted(n.id for n in tree.nodes()) == list(range(1, 101))
    assert sorted(leaf.reward for leaf in tree.leaves()) == [float(b) for b in range(20)]
    for leaf in tree.leaves():  # each chain holds only its own branch's actions
        assert {n.action_ids[0] for n in leaf.lineage()[1:]} == {int(leaf.reward)}


def test_prune_keeps_chosen_leaves_and_their_paths():
    tree = small_tree()
    dangling = tree.add_turn(tree.node(2).parent, action_ids=[1], sampler_logprobs=[-1.0])  # unfinished branch
    tree.prune([tree.node(4)])
    assert [n.id for n in tree.nodes()] == [1, 4]
    assert tree.node(1).children == [tree.node(4)]
    for gone in (2, 3, dangling.id):
        with pytest.raises(KeyError, match=f"no node with id {gone}"):
            tree.node(gone)
    with pytest.raises(ValueError, match="not in this tree"):
        tree.add_turn(dangling, action_ids=[1], sampler_logprobs=[-1.0])
    with pytest.raises(ValueError, match="prune keeps leaves only"):
        tree.prune([tree.node(1)])
    assert tree.add_turn(tree.root, action_ids=[2], sampler_logprobs=[-1.0]).id == 6  # ids are never reused


def test_save_load_round_trips_everything_but_env(tmp_path):
    tree = small_tree()
    for node in tree.nodes():
        node.value, node.advantage = node.id / 10, -node.id / 10
    tree.root.value, tree.root.info = 0.25, {"question": "q?", "answers": ["x"]}
    tree.save(tmp_path / "tree.json")
    loaded = RolloutTree.load(tmp_path / "tree.json")
    assert loaded.to_dict() == tree.to_dict()
    assert loaded.to_dict()["format"] == FORMAT
    assert loaded.root.env is None and loaded.node(1).env is None
    assert loaded.node(4).sampler_logprobs == [-0.3, -0.6, -0.9] and loaded.node(3).token_entropies == [1.5]
    assert loaded.render() == tree.render()
    assert loaded.add_turn(loaded.node(1), action_ids=[1], sampler_logprobs=[-1.0]).id == 5


def test_a_tree_saved_in_the_first_format_loads_its_logprobs_as_the_sampler_s():
    tree = small_tree()
    data = tree.to_dict()
    data["format"] = "agents.RolloutTree/1"
    for record in data["nodes"]:  # format 1 saved the sampler's log-probs as "logprobs"
        record["logprobs"] = record.pop("sampler_logprobs")
    assert RolloutTree.from_dict(data).to_dict() == tree.to_dict() and FORMAT == "agents.RolloutTree/2"


def test_save_load_keeps_ids_after_pruning(tmp_path):
    tree = small_tree()
    tree.prune([tree.node(4), tree.node(2)])
    tree.save(tmp_path / "t.json")
    loaded = RolloutTree.load(tmp_path / "t.json")
    assert [n.id for n in loaded.nodes()] == [1, 4, 2]
    assert loaded.add_turn(loaded.root, action_ids=[1], sampler_logprobs=[-1.0]).id == 5


def test_load_and_save_reject_bad_data(tmp_path):
    with pytest.raises(ValueError, match="expected format"):
        RolloutTree.from_dict({"format": "something else"})
    data = small_tree().to_dict()
    del data["nodes"][2]["sampler_logprobs"]
    with pytest.raises(ValueError, match="lacks the field 'sampler_logprobs'"):
        RolloutTree.from_dict(data)
    data = small_tree().to_dict()
    data["nodes"][3]["parent"] = 99
    with pytest.raises(ValueError, match="names parent 99"):
        RolloutTree.from_dict(data)
    tree = small_tree()
    tree.node(1).info["handle"] = object()
    with pytest.raises(ValueError, match="JSON cannot store"):
        tree.save(tmp_path / "bad.json")


def test_render_draws_shape_and_numbers():
    tree = small_tree()
    tree.node(1).value, tree.node(1).advantage = -0.1, -0.1
    assert tree.render() == "\n".join(
        [
            "root: prompt 3 tok, 4 turns, 3 leaves",
            "├─ #1 d1 obs 0 act 2 H=0.300 V=-0.100 A=-0.100",
            "│  ├─ #3 d2 obs 1 act 1 H=0.400 r=1.000 leaf",
            "│  └─ #4 d2 obs 2 act 3 H=0.600 r=-1.000 leaf",
            "└─ #2 d1 obs 0 act 1 H=0.200 r=0.000 leaf",
        ]
    )
    decoded = tree.render(decode=lambda ids: "tok" + "-".join(map(str, ids)), width=6)
    assert decoded.splitlines()[1].endswith("A=-0.100 'tok7-8'")


def test_collate_right_pads_aligned_tensors():
    tree = small_tree()
    for leaf, adv in zip(tree.leaves(), (0.5, -0.5, 0.0)):
        leaf.advantage = adv
    batch = collate(tree.paths(advantage="leaf"), pad_id=99)
    assert batch.ids.tolist() == [
        [1, 2, 3, 7, 8, 4, 10, 99, 99, 99],
        [1, 2, 3, 7, 8, 4, 5, 11, 12, 13],
        [1, 2, 3, 9, 99, 99, 99, 99, 99, 99],
    ]
    assert batch.attention_mask.tolist()[2] == [1, 1, 1, 1, 0, 0, 0, 0, 0, 0]
    assert batch.mask.tolist()[0] == [0, 0, 0, 1, 1, 0, 1, 0, 0, 0]
    assert batch.advantages.tolist()[1] == [0, 0, 0, -0.5, -0.5, 0, 0, -0.5, -0.5, -0.5]
    assert torch.allclose(batch.sampler_logprobs[1], torch.tensor([0, 0, 0, -0.1, -0.5, 0, 0, -0.3, -0.6, -0.9]))
    assert not batch.sampler_logprobs.isnan().any()
    assert batch.turn_ids.tolist()[0] == [0, 0, 0, 1, 1, 3, 3, -1, -1, -1]
    assert batch.weights.tolist()[0] == [0, 0, 0, 0.5, 0.5, 0, 1, 0, 0, 0]
    assert batch.rewards.tolist() == [1.0, -1.0, 0.0]
    dtypes = (batch.ids.dtype, batch.mask.dtype, batch.sampler_logprobs.dtype)
    assert dtypes == (torch.int64, torch.float32, torch.float32)
    assert batch.to("cpu").ids.equal(batch.ids)
    with pytest.raises(ValueError, match="at least one training path"):
        collate([], pad_id=0)
    with pytest.raises(ValueError, match="pad_id must be a non-negative token id"):
        collate(tree.paths(advantage="leaf"), pad_id=-1)
