"""Dynamic sampling (agents.run.steps.sample_with_signal) on hand-made trees: which prompts a step keeps and what it cost."""

import asyncio

import numpy as np
import pytest

from agents.rollout.strategies import PromptTrees
from agents.rollout.strategies.base import TreeStats
from agents.rollout.tree import RolloutTree
from agents.run.config import TrainConfig
from agents.run.steps import has_signal, round_seed, sample_with_signal


def prompt(task: int, rewards: list[float], tokens: int = 10, statuses: list[str] | None = None) -> PromptTrees:
    """Task ``task``'s tree: one leaf per reward, ``tokens`` sampled for it in all."""
    tree = RolloutTree([1, 2])
    for number, reward in enumerate(rewards):
        leaf = tree.add_turn(tree.root, action_ids=[3], sampler_logprobs=[-0.5], terminal=True, reward=reward)
        if statuses is not None:
            leaf.info["status"] = statuses[number]
    stats = TreeStats()
    stats.tokens = tokens
    return PromptTrees(index=task, key=task, trees=[tree], rng=np.random.default_rng(0), stats=[stats])


class Script:
    """A rollout whose tasks in ``signal`` get leaves of differing rewards, the others all 0; it records each call."""

    def __init__(self, signal: set[int]) -> None:
        self.signal, self.calls = signal, []

    async def __call__(self, tasks: list[int], round: int) -> list[PromptTrees]:
        self.calls.append((list(tasks), round))
        return [prompt(task, [0.0, 1.0] if task in self.signal else [0.0, 0.0], tokens=task) for task in tasks]


class Order:
    """The run's task order from ``start`` on."""

    def __init__(self, start: int) -> None:
        self.next = start

    def take(self, n: int) -> list[int]:
        taken = list(range(self.next, self.next + n))
        self.next += n
        return taken


def test_prompts_without_signal_are_replaced_by_the_next_tasks_scaled_by_the_share_with_signal():
    roll, order = Script(signal={1, 4, 6, 9}), Order(4)
    kept, metrics = asyncio.run(sample_with_signal(roll, [0, 1, 2, 3], order.take, most=12, budget_reward=None))
    # Round 0: 1 of 4 has signal, 3 missing → 3 × 4/1 = 12 more, capped at 12 − 4 = 8 (tasks 4-11).
    assert roll.calls == [([0, 1, 2, 3], 0), ([4, 5, 6, 7, 8, 9, 10, 11], 1)]
    assert [p.key for p in kept] == [1, 4, 6, 9] and order.next == 12
    dropped_tokens = sum(range(12)) - (1 + 4 + 6 + 9)
    assert metrics == {
        "sampling/rounds": 2.0,
        "sampling/prompts": 12.0,
        "sampling/prompts_kept": 4.0,
        "sampling/prompts_dropped": 8.0,
        "sampling/signal_frac": 4 / 12,
        "sampling/tokens": float(sum(range(12))),
        "sampling/tokens_dropped": float(dropped_tokens),
    }


def test_surplus_prompts_with_signal_are_dropped_so_every_step_trains_on_the_same_number():
    roll, order = Script(signal={0, 2, 3, 4}), Order(2)
    kept, metrics = asyncio.run(sample_with_signal(roll, [0, 1], order.take, most=6, budget_reward=None))
    # 1 of 2 with signal: 1 missing → 1 × 2/1 = 2 more (tasks 2, 3), both with signal; the step needs one.
    assert roll.calls == [([0, 1], 0), ([2, 3], 1)]
    assert [p.key for p in kept] == [0, 2] and metrics["sampling/prompts_dropped"] == 2.0


def test_a_step_whose_first_prompts_all_have_signal_rolls_out_nothing_more():
    roll, order = Script(signal={0, 1}), Order(2)
    kept, metrics = asyncio.run(sample_with_signal(roll, [0, 1], order.take, most=6, budget_reward=None))
    assert roll.calls == [([0, 1], 0)] and order.next == 2
    assert [p.key for p in kept] == [0, 1] and metrics["sampling/rounds"] == 1.0
    assert metrics["sampling/prompts_dropped"] == metrics["sampling/tokens_dropped"] == 0.0


def test_without_any_signal_the_step_stops_at_the_cap_and_keeps_its_first_prompts():
    roll, order = Script(signal=set()), Order(2)
    kept, metrics = asyncio.run(sample_with_signal(roll, [0, 1], order.take, most=5, budget_reward=None))
    # Nothing with signal: each round asks for missing × sampled / 1, capped by what is left of 5.
    assert roll.calls == [([0, 1], 0), ([2, 3, 4], 1)]
    assert [p.key for p in kept] == [0, 1] and metrics["sampling/prompts_kept"] == 2.0
    assert metrics["sampling/signal_frac"] == 0.0 and metrics["sampling/prompts_dropped"] == 3.0


def test_rounds_of_at_least_min_round_prompts_take_the_orders_next_tasks():
    roll, order = Script(signal={3, 5}), Order(2)
    kept, metrics = asyncio.run(sample_with_signal(roll, [0, 1], order.take, most=7, budget_reward=None, least=4))
    # Round 0: the step's 2 tasks and the order's next 2; 1 of 4 with signal, 1 missing → 1 × 4/1 = 4 ≥ 4 more,
    # capped at 7 − 4 = 3 (eq. 83). The kept prompts are the first with signal in task order.
    assert roll.calls == [([0, 1, 2, 3], 0), ([4, 5, 6], 1)]
    assert [p.key for p in kept] == [3, 5] and order.next == 7 and metrics["sampling/rounds"] == 2.0
    roll, order = Script(signal={0, 1}), Order(2)
    kept, _ = asyncio.run(sample_with_signal(roll, [0, 1], order.take, most=6, budget_reward=None, least=3))
    assert roll.calls == [([0, 1, 2], 0)] and [p.key for p in kept] == [0, 1]  # the surplus prompt is dropped
    roll, order = Script(signal={2}), Order(2)
    asyncio.run(sample_with_signal(roll, [0, 1], order.take, most=8, budget_reward=None, least=2))
    # 0 of 2, then eq. 82 asks 2 × 2/1 = 4 (more than least): least only raises a round, never lowers it
    assert roll.calls == [([0, 1], 0), ([2, 3, 4, 5], 1), ([6, 7], 2)]


def test_the_budget_reward_counts_before_the_signal_is_judged():
    cut = prompt(0, [0.0, 0.0], statuses=["budget", "done"])  # one leaf ran out of tokens, one answered wrong
    assert not has_signal(cut)

    async def roll(tasks: list[int], round: int) -> list[PromptTrees]:
        return [prompt(0, [0.0, 0.0], statuses=["budget", "done"])]

    kept, metrics = asyncio.run(sample_with_signal(roll, [0], Order(1).take, most=1, budget_reward=-1.0))
    assert [leaf.reward for leaf in kept[0].leaves] == [-1.0, 0.0] and metrics["sampling/signal_frac"] == 1.0


def test_a_prompt_that_failed_to_roll_out_has_no_signal():
    failed = PromptTrees(index=0, key=0, trees=[], rng=np.random.default_rng(0), error="ValueError: bad")
    assert not has_signal(failed)


def test_each_round_has_its_own_seed_and_the_first_is_the_steps():
    assert round_seed(7, 0) == 7
    assert len({round_seed(7, r) for r in range(1, 20)} | {7}) == 20
    assert round_seed(7, 3) == round_seed(7, 3) != round_seed(8, 3)


def test_dynamic_sampling_settings_are_checked():
    assert TrainConfig(prompts_per_step=4, dynamic_sampling=True).sampled_prompts == 12
    assert TrainConfig(prompts_per_step=4, max_sampled_prompts=5).sampled_prompts == 5
    with pytest.raises(ValueError, match=r"max_sampled_prompts must be an int >= prompts_per_step \(4\).*got 3"):
        TrainConfig(prompts_per_step=4, max_sampled_prompts=3)
    with pytest.raises(ValueError, match="min_round_prompts must be an int >= 1, got 0"):
        TrainConfig(min_round_prompts=0)
    with pytest.raises(ValueError, match="dynamic_sampling must be true or false, got 'yes'"):
        TrainConfig(dynamic_sampling="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_staleness=1 has later steps take their tasks.*set max_staleness=0"):
        TrainConfig(dynamic_sampling=True, max_staleness=1)


class NoRollout:
    """A rollout backend with no metrics of its own (the driver's)."""

    def metrics(self):
        return {}


def test_a_step_says_which_turns_and_prompts_failed_and_why_not_only_how_many(capsys):
    from agents.run.steps import _rollout_record

    lost_branches = prompt(0, [0.0, 1.0])
    lost_branches.stats[0].errors += ["ConnectionError: search reset", "ConnectionError: search reset"]
    failed = PromptTrees(index=1, key=1, trees=[], rng=np.random.default_rng(0), error="ValueError: bad task")
    record = _rollout_record(NoRollout(), [0, 1], [lost_branches, failed], seconds=1.0, paths=2)
    assert record["tree/prompt_errors"] == 1.0
    assert capsys.readouterr().out == (
        "rollout: 3 turn(s) or prompt(s) failed and were abandoned (tree/errors, tree/prompt_errors): "
        "ConnectionError: search reset (x2); ValueError: bad task\n"
    )
    _rollout_record(NoRollout(), [0], [prompt(0, [0.0, 1.0])], seconds=1.0, paths=2)
    assert capsys.readouterr().out == ""
