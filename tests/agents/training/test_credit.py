"""Credit assignment against the formulas of docs/algorithms/credit.md (eqs. 19–31), with exact numbers."""

import itertools
import math
import random

import pytest

from agents.rollout.tree import RolloutTree
from agents.training.credit import (
    ADVANTAGES,
    BACKUPS,
    grpo_advantages,
    grpo_credit,
    tree_grpo_advantages,
    tree_grpo_credit,
    turnwise_credit,
)

EPS = 1e-6


def turn(tree, parent, entropy, reward=None, tokens=1):
    """A turn whose node entropy is exactly ``entropy`` (every token has log-prob -entropy)."""
    return tree.add_turn(
        parent,
        obs_ids=[0] if parent is not tree.root else [],
        action_ids=[1] * tokens,
        sampler_logprobs=[-entropy] * tokens,
        terminal=reward is not None,
        reward=reward,
    )


def softmax(*xs):
    exps = [math.exp(x) for x in xs]
    return [e / sum(exps) for e in exps]


# ---- GRPO --------------------------------------------------------------------------------------


def test_grpo_uses_the_unbiased_std_by_default():
    std = math.sqrt(1 / 3)  # rewards 1,0,0,1: mean 0.5, Σ(r-mean)^2 = 1, /(n-1) = 1/3
    expected = [0.5 / (std + EPS), -0.5 / (std + EPS), -0.5 / (std + EPS), 0.5 / (std + EPS)]
    assert grpo_advantages([1, 0, 0, 1]) == pytest.approx(expected, abs=1e-12)
    assert grpo_advantages([1, 0, 0, 1])[0] == pytest.approx(0.866024, abs=1e-6)


def test_grpo_population_std_option():
    expected = [x / (0.5 + EPS) for x in (0.5, -0.5, -0.5, 0.5)]  # population std 0.5
    assert grpo_advantages([1, 0, 0, 1], unbiased=False) == pytest.approx(expected, abs=1e-12)


def test_grpo_group_of_one_and_all_equal_rewards():
    assert grpo_advantages([0.7]) == [0.7 / (1 + EPS)]  # mean 0, std 1 (verl)
    assert grpo_advantages([0.7], unbiased=False) == [0.0]
    assert grpo_advantages([1.0, 1.0, 1.0]) == [0.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="empty group"):
        grpo_advantages([])


def test_grpo_credit_pools_all_leaves_of_the_prompt():
    trees = [RolloutTree([1]), RolloutTree([1])]
    leaves = [
        turn(trees[0], trees[0].root, 0.5, reward=1.0),
        turn(trees[0], trees[0].root, 0.5, reward=0.0),
        turn(trees[1], trees[1].root, 0.5, reward=0.0),
    ]
    grpo_credit(trees)
    assert [leaf.advantage for leaf in leaves] == pytest.approx(grpo_advantages([1.0, 0.0, 0.0]), abs=0)
    with pytest.raises(TypeError, match="as a sequence"):
        grpo_credit(trees[0])
    with pytest.raises(ValueError, match="no finished leaves"):
        grpo_credit([RolloutTree([1])])


# ---- Tree-GRPO ---------------------------------------------------------------------------------


def test_tree_grpo_sums_intra_tree_and_prompt_zscores():
    result = tree_grpo_advantages([[1.0, 0.0], [1.0]])
    tree_std = math.sqrt(0.5)  # tree 1: mean 0.5, unbiased std sqrt(0.5)
    prompt_mean, prompt_std = 2 / 3, math.sqrt(1 / 3)  # all leaves 1,0,1
    expected = [
        [
            0.5 / (tree_std + EPS) + (1 - prompt_mean) / (prompt_std + EPS),
            -0.5 / (tree_std + EPS) + (0 - prompt_mean) / (prompt_std + EPS),
        ],
        [1.0 / (1 + EPS) + (1 - prompt_mean) / (prompt_std + EPS)],  # a tree of one leaf: mean 0, std 1
    ]
    assert result[0] == pytest.approx(expected[0], abs=1e-12)
    assert result[1] == pytest.approx(expected[1], abs=1e-12)
    assert result[1][0] == pytest.approx(1.577349, abs=1e-6)


def test_tree_grpo_all_equal_rewards_give_zero():
    assert tree_grpo_advantages([[0.5, 0.5], [0.5, 0.5, 0.5]]) == [[0.0, 0.0], [0.0, 0.0, 0.0]]


def test_tree_grpo_credit_fills_leaves_of_each_tree():
    trees = [RolloutTree([1]), RolloutTree([1])]
    a = turn(trees[0], trees[0].root, 0.5)
    leaves0 = [turn(trees[0], a, 0.5, reward=1.0), turn(trees[0], a, 0.5, reward=0.0)]
    leaves1 = [turn(trees[1], trees[1].root, 0.5, reward=1.0)]
    tree_grpo_credit(trees)
    expected = tree_grpo_advantages([[1.0, 0.0], [1.0]])
    assert [leaf.advantage for leaf in leaves0] == expected[0]
    assert [leaf.advantage for leaf in leaves1] == expected[1]
    assert a.advantage is None  # trajectory-level credit: train with paths(advantage="leaf")
    assert trees[0].paths(advantage="leaf")[1].advantages == [0.0, expected[0][1], 0.0, expected[0][1]]


# ---- AT²PO turn-wise credit --------------------------------------------------------------------


def worked_example():
    """docs/algorithms/credit.md "Turn-wise worked example", extended: root -> a, b; a -> a1 (r̂ = +1, H = 0.4), a2 (r̂ = -1, H = 0.6); b -> b1 (0)."""
    tree = RolloutTree([1, 2])
    a = turn(tree, tree.root, 0.3, tokens=2)
    b = turn(tree, tree.root, 0.2)
    a1 = turn(tree, a, 0.4, reward=1.0)
    a2 = turn(tree, a, 0.6, reward=-1.0)
    b1 = turn(tree, b, 0.5, reward=0.0)
    return tree, a, b, a1, a2, b1


def test_worked_example_of_algorithms_md():
    tree, a, b, a1, a2, b1 = worked_example()
    turnwise_credit(tree, normalize_leaves=False)  # r̂ given directly, as in the example
    w1, w2 = softmax(0.4, 0.6)
    assert (round(w1, 3), round(w2, 3)) == (0.450, 0.550)
    assert a.value == pytest.approx(w1 * 1 + w2 * -1, abs=1e-15)
    assert round(a.value, 2) == -0.10 and a.value == pytest.approx(-0.0996680, abs=1e-7)
    path = tree.paths()[0]  # a -> a1
    assert path.leaf is a1
    assert path.advantages == [0, 0, a.value, a.value, 0, 1.0]  # tokens of a get -0.10, of a1 +1
    assert b.value == 0.0 and b.advantage == 0.0
    wa, wb = softmax(0.3, 0.2)
    assert tree.root.value == pytest.approx(wa * a.value + wb * 0.0, abs=1e-15)
    assert tree.root.advantage is None


def test_leaf_normalisation_uses_population_std():
    tree, a, b, a1, a2, b1 = worked_example()
    turnwise_credit(tree)
    std = math.sqrt(2 / 3)  # leaves 1, -1, 0: mean 0, population variance 2/3
    assert [a1.value, a2.value, b1.value] == pytest.approx([1 / (std + EPS), -1 / (std + EPS), 0.0], abs=1e-12)
    w1, w2 = softmax(0.4, 0.6)
    assert a.value == pytest.approx((w1 - w2) / (std + EPS), abs=1e-12)


def deep_tree():
    """root -> x (H .2) -> {x1 (H .1) -> {x11 (H .3, r 1), x12 (H .9, r 0)}, x2 (H .5, r 0)};
    root -> y (H .7, r 1).  Leaves are not normalised in these tests."""
    tree = RolloutTree([1])
    x = turn(tree, tree.root, 0.2)
    y = turn(tree, tree.root, 0.7, reward=1.0)
    x1 = turn(tree, x, 0.1)
    x2 = turn(tree, x, 0.5, reward=0.0)
    x11 = turn(tree, x1, 0.3, reward=1.0)
    x12 = turn(tree, x1, 0.9, reward=0.0)
    return tree, dict(x=x, y=y, x1=x1, x2=x2, x11=x11, x12=x12)


def test_backup_child_softmax_by_hand():
    tree, n = deep_tree()
    turnwise_credit(tree, backup="child_softmax", normalize_leaves=False)
    s = softmax(0.3, 0.9)
    v_x1 = s[0] * 1 + s[1] * 0
    s = softmax(0.1, 0.5)
    v_x = s[0] * v_x1 + s[1] * 0
    s = softmax(0.2, 0.7)
    v_root = s[0] * v_x + s[1] * 1
    assert (n["x1"].value, n["x"].value, tree.root.value) == pytest.approx((v_x1, v_x, v_root), abs=1e-15)
    assert n["x1"].value == pytest.approx(0.354344, abs=1e-6)


def test_backup_child_mean_by_hand():
    tree, n = deep_tree()
    turnwise_credit(tree, backup="child_mean", normalize_leaves=False)
    assert n["x1"].value == 0.5 and n["x"].value == 0.25 and tree.root.value == 0.625


def test_backup_leaf_mean_by_hand():
    tree, n = deep_tree()
    turnwise_credit(tree, backup="leaf_mean", normalize_leaves=False)
    # x: leaves x11 (1), x12 (0), x2 (0); root: those and y (1)
    assert n["x1"].value == 0.5 and n["x"].value == pytest.approx(1 / 3, abs=1e-15) and tree.root.value == 0.5


def test_backup_entropy_linear_by_hand():
    tree, n = deep_tree()
    turnwise_credit(tree, backup="entropy_linear", normalize_leaves=False)
    v_x1 = 0.3 / 1.2 * 1 + 0.9 / 1.2 * 0
    v_x = 0.1 / 0.6 * v_x1 + 0.5 / 0.6 * 0
    v_root = 0.2 / 0.9 * v_x + 0.7 / 0.9 * 1
    assert (n["x1"].value, n["x"].value, tree.root.value) == pytest.approx((v_x1, v_x, v_root), abs=1e-15)
    assert n["x1"].value == pytest.approx(0.25, abs=1e-15)


def test_entropy_linear_with_zero_entropy_children_is_uniform():
    tree = RolloutTree([1])
    a = turn(tree, tree.root, 0.0)
    turn(tree, a, 0.0, reward=1.0)
    turn(tree, a, 0.0, reward=0.0)
    turnwise_credit(tree, backup="entropy_linear", normalize_leaves=False)
    assert a.value == 0.5 and tree.root.value == 0.5


@pytest.mark.parametrize(
    "advantage, formula",
    [
        ("node_value", lambda v, p, r: v),
        ("value_minus_parent", lambda v, p, r: v - p),
        ("value_minus_root", lambda v, p, r: v - r),
        ("sum", lambda v, p, r: (v - p) + (v - r)),
    ],
)
def test_advantage_options_by_hand(advantage, formula):
    tree, n = deep_tree()
    turnwise_credit(tree, backup="child_mean", advantage=advantage, normalize_leaves=False)
    values = {"x": 0.25, "y": 1.0, "x1": 0.5, "x2": 0.0, "x11": 1.0, "x12": 0.0}
    parents = {"x": 0.625, "y": 0.625, "x1": 0.25, "x2": 0.25, "x11": 0.5, "x12": 0.5}
    for name, node in n.items():
        assert node.advantage == pytest.approx(formula(values[name], parents[name], 0.625), abs=1e-15), name
    assert tree.root.advantage is None


def test_sum_option_on_the_worked_example():
    tree, a, b, a1, a2, b1 = worked_example()
    turnwise_credit(tree, advantage="sum", normalize_leaves=False)
    root = tree.root.value
    assert a1.advantage == pytest.approx((1 - a.value) + (1 - root), abs=1e-15)
    assert a.advantage == pytest.approx(2 * (a.value - root), abs=1e-15)  # a's parent is the root


def test_single_children_pass_the_value_through():
    tree = RolloutTree([1])
    a = turn(tree, tree.root, 0.3)
    b = turn(tree, a, 0.8)
    c = turn(tree, b, 0.1, reward=1.0)
    d = turn(tree, tree.root, 0.4, reward=0.0)
    for backup in BACKUPS:
        turnwise_credit(tree, backup=backup)
        assert a.value == b.value == c.value == pytest.approx(0.5 / (0.5 + EPS), abs=1e-12), backup
        assert d.value == pytest.approx(-0.5 / (0.5 + EPS), abs=1e-12)


def test_ties_in_entropy_make_softmax_equal_to_mean():
    tree = RolloutTree([1])
    a = turn(tree, tree.root, 0.5)
    for reward in (1.0, 0.0, 0.0):
        turn(tree, a, 0.5, reward=reward)
    turnwise_credit(tree, backup="child_softmax", normalize_leaves=False)
    assert a.value == pytest.approx(1 / 3, abs=1e-15)


def test_one_leaf_tree_gets_zero_everywhere():
    tree = RolloutTree([1])
    a = turn(tree, tree.root, 0.5)
    leaf = turn(tree, a, 0.5, reward=1.0)
    for backup, advantage in itertools.product(BACKUPS, ADVANTAGES):
        turnwise_credit(tree, backup=backup, advantage=advantage)
        assert (leaf.value, a.value, tree.root.value, leaf.advantage, a.advantage) == (0.0, 0.0, 0.0, 0.0, 0.0)


def test_all_equal_rewards_give_zero_everywhere():
    tree, n = deep_tree()
    for leaf in tree.leaves():
        leaf.reward = 1.0
    for backup, advantage in itertools.product(BACKUPS, ADVANTAGES):
        turnwise_credit(tree, backup=backup, advantage=advantage)
        assert all(node.value == 0.0 and node.advantage == 0.0 for node in tree.nodes())


def random_tree(rng: random.Random) -> RolloutTree:
    tree = RolloutTree([1])
    frontier = [tree.root]
    while frontier:
        node = frontier.pop()
        for _ in range(rng.choice([1, 1, 2, 3]) if node.depth < 3 else 0):
            child = turn(tree, node, rng.choice([0.0, 0.0, 0.5, rng.uniform(0, 5)]))
            frontier.append(child)
        if not node.children and not node.is_root:
            node.finish(rng.choice([-1.0, 0.0, 1.0, 1.0]))
    return tree


def test_no_nan_for_any_option_on_random_trees():
    rng = random.Random(0)
    for _ in range(30):
        tree = random_tree(rng)
        for backup, advantage, normalize in itertools.product(BACKUPS, ADVANTAGES, (True, False)):
            turnwise_credit(tree, backup=backup, advantage=advantage, normalize_leaves=normalize)
            values = [tree.root.value] + [x for node in tree.nodes() for x in (node.value, node.advantage)]
            assert all(math.isfinite(x) for x in values)
            assert all(math.isfinite(a) for path in tree.paths() for a in path.advantages)


def test_turnwise_credit_rejects_unfinished_trees_and_unknown_options():
    tree, *_ = worked_example()
    with pytest.raises(ValueError, match="unknown backup 'softmax'; choose one of child_softmax"):
        turnwise_credit(tree, backup="softmax")
    with pytest.raises(ValueError, match="unknown advantage 'gae'"):
        turnwise_credit(tree, advantage="gae")
    open_turn = turn(tree, tree.root, 0.5)
    with pytest.raises(ValueError, match=f"node {open_turn.id} has no children and did not end its episode"):
        turnwise_credit(tree)
    tree.prune(tree.leaves())
    turnwise_credit(tree)  # the abandoned branch is gone
    tree.node(3).reward = float("nan")
    with pytest.raises(ValueError, match="leaf 3 has reward nan"):
        turnwise_credit(tree)
    with pytest.raises(ValueError, match="no finished leaves"):
        turnwise_credit(RolloutTree([1]))
