"""Learners as compositions: the papers' defaults, exact credit through the wrappers, and bringing your own.

Rollouts run on a ScriptedEngine over a small ToolEnv with a byte-level tokenizer, so every
reward and entropy is known.
"""

import dataclasses
import json
import math

import pytest

from agentenv import TokenEnv, ToolEnv
from agentenv.datasets import Example
from agents.engines.scripted import ScriptedEngine, ScriptedTurn
from agents.learners import (
    AEPO,
    ARPO,
    AT2PO,
    GRPO,
    LEARNERS,
    Learner,
    TreeGRPO,
)
from agents.rollout import Episode
from agents.rollout.strategies import (
    Chain,
    EntropyBalancedBranching,
    EntropyBranching,
    EntropyTree,
    RandomTree,
)
from agents.rollout.tree import RolloutTree, TrainingPath
from agents.rollout.tree_loop import TreeConfig, rollout_trees
from agents.training.credit import GRPOCredit, TreeGRPOCredit, TurnwiseCredit, grpo_advantages, tree_grpo_advantages
from agents.training.losses import ppo_clip_loss


class ByteTokenizer:
    """Bytes as ids (offset by 10) and a chat template of <role>…</role> tags."""

    all_special_ids = [2]
    eos_token_id = 2

    def encode(self, text, add_special_tokens=False):
        return [b + 10 for b in text.encode()]

    def decode(self, ids, skip_special_tokens=False):
        return bytes(i - 10 for i in ids if i >= 10).decode(errors="replace")

    def apply_chat_template(self, messages, chat_template=None, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<assistant>"


TOK = ByteTokenizer()
LOOKUP = "<lookup>x</lookup>"
RIGHT, WRONG = "<answer> \\boxed{42} </answer>", "<answer> \\boxed{7} </answer>"


def lookup(term: str) -> str:
    """Look a term up.

    Args:
        term: what to look up.
    """
    return f"{term} is 42"


def episode(index: int = 0) -> Episode:
    tasks = [Example(id=f"q{i}", question=f"What is x{i}?", answers=("42",)) for i in range(2)]
    return Episode(TokenEnv(ToolEnv(tasks, [lookup], prompt_template="Q: {question}"), TOK), options={"index": index})


def alternating_answers():
    """One lookup, then the right and the wrong answer in turn (every token log-prob −0.5)."""
    answers = iter([RIGHT, WRONG] * 50)
    return lambda ids: ScriptedTurn(text=LOOKUP if "<result>" not in TOK.decode(ids) else next(answers), logprobs=-0.5)


# -- the papers' learners ---------------------------------------------------------------------


def test_the_five_learners_are_the_papers_compositions():
    at2po, aepo, grpo, tree_grpo, arpo = AT2PO(), AEPO(), GRPO(), TreeGRPO(), ARPO()
    assert at2po.strategy == EntropyTree(M=10, L=2, K=6, alpha=0.05)
    assert at2po.credit == TurnwiseCredit(backup="child_softmax", advantage="node_value", normalize_leaves=True)
    assert (at2po.loss, at2po.loss_kwargs, at2po.kl_coef) == ("atpo", {}, 0.0)
    assert aepo.strategy == EntropyBalancedBranching(k=16)
    assert (aepo.credit, aepo.loss, aepo.kl_coef) == (GRPOCredit(), "aepo", 0.0)
    assert aepo.loss_kwargs == {"clip_balanced": True, "entropy_aware_advantage": True}
    assert (grpo.strategy, grpo.credit, grpo.loss, grpo.kl_coef) == (Chain(16), GRPOCredit(), "ppo_clip", 0.001)
    assert (tree_grpo.strategy, tree_grpo.credit) == (RandomTree(M=2, N=2, L=1, K=3), TreeGRPOCredit())
    assert (tree_grpo.loss, tree_grpo.kl_coef) == ("ppo_clip", 0.0)
    assert (arpo.strategy, arpo.credit, arpo.loss) == (EntropyBranching(n=16, N=8), GRPOCredit(), "ppo_clip")
    assert {name: cls().name for name, cls in LEARNERS.items()} == {
        "at2po": "at2po",
        "aepo": "aepo",
        "grpo": "grpo",
        "tree-grpo": "tree-grpo",
        "arpo": "arpo",
    }


def test_trainer_config_carries_the_learners_loss_and_kl():
    config = GRPO().trainer_config(lr=3e-6, mini_batches=2)
    assert (config.loss, config.kl_coef, config.lr, config.mini_batches) == ("ppo_clip", 0.001, 3e-6, 2)
    config = AEPO().trainer_config()
    assert config.loss_kwargs == {"clip_balanced": True, "entropy_aware_advantage": True}
    with pytest.raises(ValueError, match="kl_coef belongs to the learner"):
        GRPO().trainer_config(kl_coef=0.0)


def test_configure_sets_fields_by_name_and_names_the_fields_of_a_part_that_lacks_one():
    learner = AT2PO().configure(
        strategy={"M": 4, "K": 2}, credit={"backup": "leaf_mean"}, loss={"eps_high": 0.01}, kl_coef=0.002
    )
    assert learner.strategy == EntropyTree(M=4, L=2, K=2) and learner.credit.backup == "leaf_mean"
    assert (learner.loss_kwargs, learner.kl_coef, learner.name) == ({"eps_high": 0.01}, 0.002, "at2po")
    assert AT2PO().strategy.M == 10  # the original is unchanged
    with pytest.raises(ValueError, match="EntropyTree has no field n; its fields are M, L, K, alpha, root_candidate"):
        AT2PO().configure(strategy={"n": 3})
    with pytest.raises(ValueError, match="backup must be one of"):
        AT2PO().configure(credit={"backup": "max"})


def test_learner_parts_are_checked():
    with pytest.raises(TypeError, match="strategy must be an agents.rollout.strategies.Strategy"):
        Learner(strategy="tree", credit=GRPOCredit())
    with pytest.raises(TypeError, match="credit must be a callable"):
        Learner(strategy=Chain(2), credit=3)
    with pytest.raises(ValueError, match="unknown loss 'ppo'"):
        Learner(strategy=Chain(2), credit=GRPOCredit(), loss="ppo")
    with pytest.raises(ValueError, match="kl_coef must be a finite number >= 0"):
        GRPO(kl_coef=-1.0)


def test_describe_is_json_ready_and_names_every_part():
    described = json.loads(json.dumps(AT2PO(loss=ppo_clip_loss).describe()))
    assert described["strategy"] == {
        "class": "agents.rollout.strategies.entropy_tree.EntropyTree",
        "M": 10,
        "L": 2,
        "K": 6,
        "alpha": 0.05,
        "root_candidate": True,
    }
    assert described["loss"] == "agents.training.losses.ppo_clip_loss"
    assert Learner(Chain(2), credit=lambda trees: []).describe()["credit"]["function"].endswith("<lambda>")


# -- credit wrappers: exact advantages on the paths --------------------------------------------


def worked_example() -> RolloutTree:
    """docs/algorithms/credit.md "Turn-wise worked example": first turn a with leaves a1 (H = 0.4) and a2 (H = 0.6)."""
    tree = RolloutTree([1, 2])
    a = tree.add_turn(tree.root, action_ids=[3, 4], sampler_logprobs=[-0.1, -0.3])
    tree.add_turn(a, obs_ids=[5], action_ids=[6], sampler_logprobs=[-0.4], terminal=True, reward=1.0)
    tree.add_turn(a, obs_ids=[5], action_ids=[7], sampler_logprobs=[-0.6], terminal=True, reward=0.0)
    return tree


def test_turnwise_credit_gives_each_turn_its_backed_up_value():
    paths = TurnwiseCredit()([worked_example()])
    z = 0.5 / (0.5 + 1e-6)  # leaves z-scored in the tree: (1 − 0.5) / (0.5 + ε)
    w1, w2 = math.exp(0.4) / (math.exp(0.4) + math.exp(0.6)), math.exp(0.6) / (math.exp(0.4) + math.exp(0.6))
    v_a = w1 * z - w2 * z  # −0.0997: softmax(0.4, 0.6) = 0.450, 0.550
    assert [path.ids for path in paths] == [[1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 7]]
    assert paths[0].advantages == pytest.approx([0, 0, v_a, v_a, 0, z], abs=1e-12)
    assert paths[1].advantages == pytest.approx([0, 0, v_a, v_a, 0, -z], abs=1e-12)
    assert v_a == pytest.approx(-0.0997, abs=1e-4)


def test_grpo_and_tree_grpo_credit_broadcast_the_leaf_advantage_over_the_path():
    trees = [worked_example(), worked_example()]
    trees[1].leaves()[1].reward = 1.0
    paths = GRPOCredit()(trees)
    expected = grpo_advantages([1.0, 0.0, 1.0, 1.0])
    assert [path.advantages[2] for path in paths] == pytest.approx(expected)
    assert all(
        path.advantages[2] == path.advantages[3] == path.advantages[5] and path.advantages[4] == 0 for path in paths
    )
    paths = TreeGRPOCredit()(trees)
    assert [path.advantages[-1] for path in paths] == pytest.approx(
        [a for tree in tree_grpo_advantages([[1.0, 0.0], [1.0, 1.0]]) for a in tree]
    )


def test_assign_credit_refuses_a_credit_that_returns_no_paths():
    learner = GRPO(credit=lambda trees: {"advantages": [1.0]})
    with pytest.raises(TypeError, match="must return a list of agents.rollout.tree.TrainingPath"):
        learner.assign_credit([worked_example()])


# -- a learner's parts drive a real rollout, and any of them can be replaced ------------------


async def test_at2po_strategy_and_credit_on_a_scripted_rollout():
    learner = AT2PO().configure(strategy={"M": 2, "L": 1, "K": 2})
    [prompt] = await rollout_trees(
        ScriptedEngine(alternating_answers(), tokenizer=TOK), [episode()], learner.strategy, TreeConfig(seed=0)
    )
    paths = learner.assign_credit(prompt.trees)
    assert len(paths) == 4  # M + L·K leaves
    assert sorted(path.reward for path in paths) == [0.0, 0.0, 1.0, 1.0]
    assert sorted((leaf.info["grade"]["em"], leaf.info["grade"]["answer"]) for leaf in prompt.leaves) == [
        (0.0, "7"),
        (0.0, "7"),
        (1.0, "42"),
        (1.0, "42"),
    ]  # the env's grade is kept on the leaf
    for path in paths:  # the answer turn carries the leaf's z-score; right answers are positive
        z = path.advantages[-1]
        assert z == pytest.approx(1 / (1 + 2e-6) if path.reward == 1.0 else -1 / (1 + 2e-6))


async def test_bring_your_own_credit_and_loss_into_a_papers_learner():
    seen = []

    def reward_is_the_advantage(trees):
        """A custom credit: every action token carries its leaf's raw reward."""
        seen.append(len(trees))
        for tree in trees:
            for leaf in tree.leaves():
                leaf.advantage = leaf.reward
        return [path for tree in trees for path in tree.paths(advantage="leaf")]

    learner = AT2PO(
        credit=reward_is_the_advantage, loss=ppo_clip_loss, loss_kwargs={"eps_high": 0.28}, name="at2po-raw-reward"
    ).configure(strategy={"M": 2, "L": 1, "K": 1})
    assert isinstance(learner.strategy, EntropyTree) and learner.loss is ppo_clip_loss
    [prompt] = await rollout_trees(
        ScriptedEngine(alternating_answers(), tokenizer=TOK), [episode()], learner.strategy, TreeConfig(seed=0)
    )
    paths = learner.assign_credit(prompt.trees)
    assert seen == [1] and len(paths) == 3
    assert all(isinstance(path, TrainingPath) and set(path.advantages) == {0.0, path.reward} for path in paths)
    config = learner.trainer_config()
    assert (config.loss, config.loss_kwargs) == (ppo_clip_loss, {"eps_high": 0.28})


def test_a_learner_from_scratch_is_a_dataclass_like_the_papers():
    mine = Learner(strategy=RandomTree(M=1, N=1, L=1, K=2), credit=GRPOCredit(unbiased=False), loss="gspo")
    assert mine.name == "custom" and dataclasses.replace(mine, name="mine").name == "mine"
    assert mine.trainer_config().loss == "gspo"
