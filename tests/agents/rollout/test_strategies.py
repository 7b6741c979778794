"""Rollout strategies and the tree-rollout loop, with a byte-level tokenizer and a ScriptedEngine.

Chains use a small ToolEnv with a ``lookup`` tool; the stateful-branching tests run the real
``python-math`` environment (a sandboxed Python session forked with the env).
"""

import asyncio
import json
import math
from collections import Counter

import numpy as np
import pytest

import agentenv
from agentenv import TokenEnv, ToolEnv
from agentenv.datasets import Example
from agents.engines.base import SamplingParams
from agents.engines.scripted import ScriptedEngine, ScriptedTurn
from agents.rollout import Episode, RolloutConfig, TurnRecord
from agents.rollout.strategies import (
    SEGMENT_ENTROPY,
    Branch,
    BranchEvent,
    Budget,
    Chain,
    EntropyBalancedBranching,
    EntropyBranching,
    EntropyTree,
    PromptTrees,
    RandomTree,
    branch_probability,
    global_samples,
    penalized_branch_probability,
    segment_entropy,
)
from agents.rollout.tree import RolloutTree
from agents.rollout.tree_loop import TreeConfig, rollout_trees

EOS = 2


class ByteTokenizer:
    """Bytes as ids (offset by 10) and a chat template of <role>…</role> tags."""

    all_special_ids = [EOS]
    eos_token_id = EOS

    def encode(self, text, add_special_tokens=False):
        return [b + 10 for b in text.encode()]

    def decode(self, ids, skip_special_tokens=False):
        return bytes(i - 10 for i in ids if i >= 10).decode(errors="replace")

    def apply_chat_template(self, messages, chat_template=None, tokenize=False, add_generation_prompt=True):
        return "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages) + "<assistant>"


TOK = ByteTokenizer()
LOOKUP = "<lookup>x</lookup>"  # 18 tokens
ANSWER = "<answer> \\boxed{42} </answer>"  # 29 tokens, the right answer (reward 1)
OBS = TOK.encode("\n<result>\nx is 42\n</result>\n")


def lookup(term: str) -> str:
    """Look a term up.

    Args:
        term: what to look up.
    """
    return f"{term} is 42"


TASKS = [Example(id=f"q{i}", question=f"What is x{i}?", answers=("42",)) for i in range(4)]


def qa_env(max_tool_calls: int = 3) -> TokenEnv:
    return TokenEnv(ToolEnv(TASKS, [lookup], prompt_template="Q: {question}", max_tool_calls=max_tool_calls), TOK)


def episodes(count: int = 1) -> list[Episode]:
    return [Episode(qa_env(), options={"index": i}) for i in range(count)]


def results_in(ids) -> int:
    return TOK.decode(ids).count("<result>")


def turn(text: str, h: float = 0.5, top=None) -> ScriptedTurn:
    """A scripted turn whose every token has log-prob −h, so that its node entropy H(n) is h."""
    n = len(TOK.encode(text))
    return ScriptedTurn(text=text, logprobs=-h, top_logprobs=top if top is not None else [[(11, -h)]] * n)


def lookups_then_answer(calls: int = 1, answer: str = ANSWER):
    """A script: ``calls`` lookups, then the answer."""
    return lambda ids: turn(LOOKUP) if results_in(ids) < calls else turn(answer)


def engine_for(script) -> ScriptedEngine:
    return ScriptedEngine(script, tokenizer=TOK)


def contexts(tree: RolloutTree) -> Counter:
    """The context each turn of the tree was sampled from."""
    return Counter(tuple(node.parent.context_ids() + node.obs_ids) for node in tree.nodes())


# -- Chain ------------------------------------------------------------------------------------


async def test_chain_runs_n_independent_chains_from_the_prompt():
    engine = engine_for(lookups_then_answer())
    [prompt] = await rollout_trees(engine, episodes(), Chain(3), TreeConfig(seed=0))

    assert prompt.error is None and len(prompt.trees) == 1
    tree = prompt.trees[0]
    assert len(tree.root.children) == 3 and len(tree) == 6 and len(tree.leaves()) == 3
    expected = tree.prompt_ids + TOK.encode(LOOKUP) + OBS + TOK.encode(ANSWER)
    for leaf in tree.leaves():
        assert leaf.context_ids() == expected  # exactly the sampled ids and the env's observation ids
        assert (leaf.reward, leaf.depth, leaf.info["status"], leaf.info["tool_calls"]) == (1.0, 2, "terminated", 1)
    stats = prompt.stats[0]
    assert (stats.turns, stats.tokens, stats.tool_calls, stats.forks) == (6, 3 * (18 + 29), 3, 3)
    prompt_length = len(tree.prompt_ids)
    assert stats.context_tokens == 3 * (prompt_length + (prompt_length + 18 + len(OBS)))
    assert all(node.env is None for node in tree.nodes())  # nothing kept after the rollout
    assert contexts(tree) == Counter(tuple(ids) for ids, _ in engine.calls)
    assert len({params.seed for _, params in engine.calls}) == 6  # one seed per (branch, turn)
    assert prompt.metrics[0]["leaves"] == 3 and prompt.metrics[0]["token_ratio"] == 1.0


async def test_seeds_make_the_rollout_reproducible():
    async def seeds(seed):
        engine = engine_for(lookups_then_answer(2))
        [prompt] = await rollout_trees(engine, episodes(), RandomTree(M=2, N=2, L=2, K=3), TreeConfig(seed=seed))
        return [params.seed for _, params in engine.calls], [tree.to_dict() for tree in prompt.trees]

    first, again, other = await seeds(0), await seeds(0), await seeds(1)
    assert first == again
    assert first[0] != other[0]
    nothing = await seeds(None)
    assert set(nothing[0]) == {None}


class TimedEngine(ScriptedEngine):
    """A ScriptedEngine that sleeps ``delay(params.seed)`` seconds per call and logs when calls start and end."""

    def __init__(self, script, delay):
        super().__init__(script, tokenizer=TOK)
        self.delay = delay
        self.log: list[tuple[str, int | None]] = []

    async def generate(self, prompt_ids, params):
        self.log.append(("start", params.seed))
        await asyncio.sleep(self.delay(params.seed))
        completion = await super().generate(prompt_ids, params)
        self.log.append(("end", params.seed))
        return completion


def turn_seed(seed: int, prompt: int, branch: int, turn: int) -> int:
    """The seed the loop gives turn ``turn`` of branch ``branch`` (docs: the tree loop's module docstring)."""
    return int(np.random.SeedSequence(seed, spawn_key=(prompt, branch + 1, turn)).generate_state(1)[0])


class InStep(Chain):
    """Chain, but with an ``after_turn`` of its own: the loop then keeps its turns to the steps."""

    def after_turn(self, prompt, branch, node, turn, ended):
        return []


async def test_turns_run_ahead_of_the_steps_when_nothing_else_decides_them():
    # Branch 1's first turn is slow. Run ahead, branch 0 takes its second turn meanwhile;
    # kept to the steps (a strategy with its own after_turn), it waits for the slow turn.
    slow = turn_seed(0, 0, 1, 0)

    async def order(strategy):
        engine = TimedEngine(lookups_then_answer(), lambda seed: 0.2 if seed == slow else 0.0)
        [prompt] = await rollout_trees(engine, episodes(), strategy, TreeConfig(seed=0))
        return engine.log.index(("start", turn_seed(0, 0, 0, 1))) < engine.log.index(("end", slow)), prompt

    ahead, tree = await order(Chain(2))
    in_step, stepped = await order(InStep(2))
    assert (ahead, in_step) == (True, False)
    assert tree.trees[0].to_dict() == stepped.trees[0].to_dict()  # the same tree, recorded in the same order
    assert (tree.step, tree.stats[0].turns) == (stepped.step, stepped.stats[0].turns) == (2, 4)


async def test_turns_run_ahead_grow_the_same_trees_as_turns_in_steps():
    # Content-only script (entropy and length from the context), random latencies: run-ahead
    # EntropyTree and RandomTree record the trees, events and stats that steps record.
    def script(ids):
        h = 0.1 * (1 + sum(ids) % 7)
        return turn(f"<lookup>{sum(ids) % 5}</lookup>", h=h) if results_in(ids) < 2 else turn(ANSWER, h=0.2)

    def delay(seed):
        return (seed % 5) * 0.002

    class InStepTree(EntropyTree):
        def after_turn(self, prompt, branch, node, turn, ended):
            return []

    class InStepRandom(RandomTree):
        def after_turn(self, prompt, branch, node, turn, ended):
            return []

    for ahead, in_step in (
        (EntropyTree(M=4, L=2, K=3), InStepTree(M=4, L=2, K=3)),
        (RandomTree(M=2, N=2, L=2, K=3), InStepRandom(M=2, N=2, L=2, K=3)),
    ):
        runs = []
        for strategy in (ahead, in_step):
            results = await rollout_trees(TimedEngine(script, delay), episodes(2), strategy, TreeConfig(seed=5))
            runs.append(
                [
                    ([tree.to_dict() for tree in prompt.trees], prompt.events, prompt.step, prompt.stats[0].turns)
                    for prompt in results
                ]
            )
        assert runs[0] == runs[1]
        assert all(len(trees[0]["nodes"]) > 4 for trees, *_ in runs[0])


async def test_a_cancelled_rollout_stops_the_branches_running_ahead_and_closes_their_states():
    # Branch 1's first turn hangs; branch 0 runs its whole episode ahead, keeping a state per
    # turn that no step has recorded. Cancelling the rollout closes every env the loop forked.
    forks = []

    class Tracked(TokenEnv):
        closed = False

        def fork(self):
            forks.append(super().fork())  # a copy of this class: forks are tracked too
            return forks[-1]

        def close(self):
            self.closed = True
            super().close()

    hang = turn_seed(0, 0, 1, 0)
    engine = TimedEngine(lookups_then_answer(3), lambda seed: 60.0 if seed == hang else 0.0)
    episode = Episode(Tracked(qa_env().env, TOK), options={"index": 0})
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(rollout_trees(engine, [episode], EntropyTree(M=2, L=1, K=1), TreeConfig(seed=0)), 0.5)
    assert ("end", turn_seed(0, 0, 0, 3)) in engine.log  # branch 0 had answered, ahead of step 1
    assert len(forks) > 4 and all(env.closed for env in forks)


# -- RandomTree (Tree-GRPO) -------------------------------------------------------------------


async def test_random_tree_expands_nodes_as_new_children_and_keeps_k_leaves():
    engine = engine_for(lookups_then_answer(2))  # chains of three turns
    [prompt] = await rollout_trees(engine, episodes(), RandomTree(M=2, N=2, L=1, K=3), TreeConfig(seed=3))

    assert [len(tree.leaves()) for tree in prompt.trees] == [3, 3]  # 1 chain + N expansions, K = 3 kept
    assert len(prompt.events) == 4 and {event.kind for event in prompt.events} == {"branch"}
    calls = Counter(tuple(ids) for ids, _ in engine.calls)
    assert (
        sum((contexts(tree) for tree in prompt.trees), Counter()) == calls
    )  # every turn from its node's exact context
    for tree in prompt.trees:
        for node in tree.nodes():  # siblings saw the same observation: expansion continued after it
            assert all(sibling.obs_ids == node.obs_ids for sibling in node.siblings)


async def test_random_tree_prunes_to_k_leaves_and_still_counts_what_it_sampled():
    engine = engine_for(lookups_then_answer(2))
    [prompt] = await rollout_trees(engine, episodes(), RandomTree(M=1, N=3, L=2, K=4), TreeConfig(seed=0))

    tree, stats = prompt.trees[0], prompt.stats[0]
    assert len(tree.leaves()) == 4  # 1 + 2·3 = 7 leaves grown, 4 kept
    assert stats.turns == len(engine.calls) > len(tree)
    assert stats.tokens == sum(len(TOK.encode(LOOKUP if results_in(ids) < 2 else ANSWER)) for ids, _ in engine.calls)
    assert prompt.metrics[0]["tokens_generated"] == stats.tokens


# -- EntropyTree (AT²PO) ----------------------------------------------------------------------


async def test_entropy_tree_grows_22_leaves_per_prompt_with_fewer_tokens_than_22_chains():
    def script(ids):
        return turn(LOOKUP, h=0.1 * (1 + len(ids) % 7)) if results_in(ids) < 2 else turn(ANSWER, h=0.2)

    results = await rollout_trees(engine_for(script), episodes(2), EntropyTree(), TreeConfig(seed=0))

    assert [len(prompt.trees) for prompt in results] == [1, 1]
    assert [len(prompt.trees[0].leaves()) for prompt in results] == [22, 22]  # M + L·K = 10 + 2·6
    for prompt in results:
        assert len([event for event in prompt.events if event.kind == "branch"]) == 12
        assert prompt.metrics[0]["leaves"] == 22
        assert prompt.stats[0].tokens < prompt.metrics[0]["chain_tokens"]  # branches share their prefixes


class ContextScript:
    """Answers by the number of earlier calls with the same context, so identical contexts differ."""

    def __init__(self, answer):
        self.answer = answer
        self.seen: Counter = Counter()

    def __call__(self, ids):
        key = tuple(ids)
        self.seen[key] += 1
        return self.answer(TOK.decode(ids), results_in(ids), self.seen[key] - 1)


async def test_entropy_tree_resamples_the_top_k_by_entropy_minus_sibling_penalty():
    # M = 4 chains: lookup c<k> (H1[k]), lookup (H2[k]), answer. First turns carry 3 siblings
    # (penalty 0.15), second turns none. A resampled second turn answers at once.
    h1, h2 = [0.72, 0.20, 0.30, 0.10], [0.80, 0.65, 0.60, 0.50]

    def answer(text, results, repeat):
        if results == 0:
            return turn(f"<lookup>c{repeat}</lookup>", h=h1[repeat]) if repeat < 4 else turn(ANSWER, h=0.3)
        chain = int(text.split("<lookup>c")[1][0])
        if results == 1 and repeat == 0:
            return turn(f"<lookup>d{chain}</lookup>", h=h2[chain])
        return turn(ANSWER, h=0.3)

    engine = engine_for(ContextScript(answer))
    [prompt] = await rollout_trees(engine, episodes(), EntropyTree(M=4, L=2, K=3, alpha=0.05), TreeConfig(seed=0))

    tree = prompt.trees[0]
    firsts = tree.root.children[:4]
    seconds = [first.children[0] for first in firsts]
    # Round 1 scores: seconds 0.80, 0.65, 0.60, 0.50; firsts 0.72 − 0.15 = 0.57, …; the prompt −0.15.
    # Top 3: seconds 0, 1, 2 (0.57 loses to 0.60 only because of the sibling penalty).
    # Round 2: seconds 0 and 1 now have a sibling: 0.75, 0.60, first 0 0.57, second 2 0.55 → 0, 1, first 0.
    assert [len(first.children) for first in firsts] == [3, 3, 2, 1]
    assert len(tree.root.children) == 5  # the fifth: first turn 0 resampled in round 2
    assert len(tree.leaves()) == 4 + 2 * 3
    assert [(event.step, event.depth) for event in prompt.events] == [(3, 1)] * 3 + [(4, 1), (4, 1), (4, 0)]
    assert [event.source_entropy for event in prompt.events] == pytest.approx([0.80, 0.65, 0.60, 0.80, 0.65, 0.72])
    for second in seconds[:3]:  # each sibling resampled the turn from exactly its context
        for sibling in second.siblings:
            assert sibling.obs_ids == second.obs_ids and sibling.action_ids == TOK.encode(ANSWER)


def test_entropy_tree_scores_turns_that_did_not_end_and_the_prompt():
    tree = RolloutTree([1, 2, 3])
    state = object()  # a stand-in for the kept environment state
    a = tree.add_turn(tree.root, action_ids=[5, 6], sampler_logprobs=[-0.2, -0.6], env=state)  # H = 0.4
    b = tree.add_turn(tree.root, action_ids=[7], sampler_logprobs=[-0.9], env=state)  # H = 0.9
    tree.add_turn(tree.root, action_ids=[8], sampler_logprobs=[-2.0], env=state, terminal=True, reward=0.0)  # an answer
    a1 = tree.add_turn(a, obs_ids=[4], action_ids=[9], sampler_logprobs=[-0.5], env=state)  # H = 0.5, no sibling
    tree.add_turn(a1, obs_ids=[4], action_ids=[9], sampler_logprobs=[-0.1], env=state, terminal=True, reward=1.0)
    tree.add_turn(b, obs_ids=[4], action_ids=[9], sampler_logprobs=[-0.1], env=state, terminal=True, reward=1.0)

    strategy = EntropyTree(M=3, L=1, K=2, alpha=0.1)
    scores = strategy.scores(tree)
    assert [node for node, _ in scores] == [tree.root, a, b, a1]  # breadth-first; answers never qualify
    assert [score for _, score in scores] == pytest.approx([-0.2, 0.2, 0.7, 0.5])
    assert strategy.select(tree) == [b, a1]
    assert EntropyTree(K=6, alpha=0.1).select(tree) == [b, a1, a, tree.root, b, a1]  # repeats when short
    assert [node for node, _ in EntropyTree(root_candidate=False).scores(tree)] == [a, b, a1]


# -- EntropyBranching (ARPO) ------------------------------------------------------------------


def test_segment_entropy_is_the_top_k_entropy_of_the_first_tokens_over_ln_v():
    half_quarter = [(1, math.log(0.5)), (2, math.log(0.25))]  # −Σ p log p = ln 2
    tops = [half_quarter] * 3
    assert segment_entropy(tops, vocab_size=4) == pytest.approx(3 * math.log(2) / math.log(4))  # 1.5
    assert segment_entropy(tops, vocab_size=4, window=2) == pytest.approx(1.0)
    assert segment_entropy(tops, vocab_size=4, reduce="mean") == pytest.approx(0.5)
    assert segment_entropy([], vocab_size=4) == 0.0
    with pytest.raises(ValueError, match="vocab_size"):
        segment_entropy(tops, vocab_size=1)


def test_arpo_branch_probability_is_clamped_linear_in_the_entropy_change():
    assert branch_probability(0.0) == 0.5
    assert branch_probability(1.0) == pytest.approx(0.7)
    assert branch_probability(-1.0) == pytest.approx(0.3)
    assert branch_probability(3.0) == 1.0  # 1.1 clamped
    assert branch_probability(-3.0) == 0.0  # −0.1 clamped
    assert branch_probability(1.0, base=0.2, weight=0.5) == pytest.approx(0.7)


class Draws:
    """An injected random generator: ``random()`` returns the given numbers in order."""

    def __init__(self, *values):
        self.values = list(values)

    def random(self):
        return self.values.pop(0)


def hand_prompt(*draws, started=0):
    tree = RolloutTree([1, 2, 3])
    prompt = PromptTrees(index=0, key=None, trees=[tree], rng=Draws(*draws), started=started)
    prompt.notes["vocab_size"] = 4
    return prompt


def branch_at(prompt, action_logprob_tops, notes=None, turns=1, kind="chain"):
    """A branch whose latest turn is a new first turn with the given per-token top log-probs."""
    tree = prompt.trees[0]
    node = tree.add_turn(
        tree.root,
        action_ids=[5] * len(action_logprob_tops),
        sampler_logprobs=[-0.1] * len(action_logprob_tops),
        env="state-before",
    )
    branch = Branch(
        number=0,
        tree=0,
        kind=kind,
        parent=node,
        obs_ids=[9],
        env="state-after",
        ids=[1, 2, 3],
        turns=turns,
        last=node,
        notes=dict(notes or {}),
    )
    record = TurnRecord(
        action_ids=node.action_ids,
        sampler_logprobs=node.sampler_logprobs,
        obs_ids=[9],
        action_span=(3, 4),
        obs_span=(4, 5),
        reward=0.0,
        finish_reason="stop",
        top_logprobs=action_logprob_tops,
    )
    return branch, node, record


HALF_QUARTER = [(1, math.log(0.5)), (2, math.log(0.25))]


def test_arpo_branches_with_probability_from_the_path_s_entropy_change():
    strategy = EntropyBranching(n=16, N=8)
    prompt = hand_prompt(0.69, 0.71)
    # Two tokens of entropy ln 2 each over ln 4: H_t = 1.0; the path's first segment had 0.0.
    branch, node, record = branch_at(prompt, [HALF_QUARTER] * 2, notes={"h_initial": 0.0})
    [point] = strategy.after_turn(prompt, branch, node, record, ended=False)  # p = 0.7 > 0.69
    assert node.info[SEGMENT_ENTROPY] == pytest.approx(1.0) and node.info["copies"] == 1
    assert (point.parent, point.env, tuple(point.obs_ids), point.kind, point.source) == (
        node,
        "state-after",
        (9,),
        "branch",
        node,
    )  # a copy of the current prefix, tool result included
    assert point.notes == {"h_initial": 0.0}
    assert strategy.after_turn(prompt, branch, node, record, ended=False) == []  # 0.71 > 0.7

    first, node, record = branch_at(prompt := hand_prompt(0.49, 0.51), [HALF_QUARTER] * 2)
    assert len(strategy.after_turn(prompt, first, node, record, ended=False)) == 1  # first segment: ΔH = 0, p = 0.5
    assert first.notes == {"h_initial": pytest.approx(1.0)}  # H_initial is this path's first segment
    assert strategy.after_turn(prompt, first, node, record, ended=False) == []


def test_arpo_draws_nothing_when_the_budget_is_used_or_the_episode_ended():
    strategy = EntropyBranching(n=16, N=8)
    prompt = hand_prompt(started=16)  # no draws available: drawing would fail
    branch, node, record = branch_at(prompt, [HALF_QUARTER])
    assert strategy.after_turn(prompt, branch, node, record, ended=False) == []
    prompt = hand_prompt()
    branch, node, record = branch_at(prompt, [HALF_QUARTER])
    assert strategy.after_turn(prompt, branch, node, record, ended=True) == []
    assert node.info[SEGMENT_ENTROPY] == pytest.approx(0.5)  # still measured


def test_arpo_paper_timing_resamples_the_segment_after_a_tool_result():
    strategy = EntropyBranching(measure="segment_after")
    assert strategy.keeps_turn_states
    prompt = hand_prompt(0.0)
    branch, first, record = branch_at(prompt, [HALF_QUARTER])
    assert strategy.after_turn(prompt, branch, first, record, ended=False) == []  # no tool result before it
    second = prompt.trees[0].add_turn(first, obs_ids=[9], action_ids=[5], sampler_logprobs=[-0.1], env="state-before-2")
    branch.last = branch.parent = second
    [point] = strategy.after_turn(prompt, branch, second, record, ended=True)  # measured even on an answer
    assert (point.parent, point.env, tuple(point.obs_ids), point.source) == (first, "state-before-2", (9,), second)


async def test_arpo_fills_n_rollouts_with_branches_then_refills():
    always = EntropyBranching(n=4, N=2, base_probability=1.0, entropy_weight=0.0)
    [prompt] = await rollout_trees(engine_for(lookups_then_answer(2)), episodes(), always, TreeConfig(seed=0))
    tree = prompt.trees[0]
    assert len(tree.leaves()) == 4 and len(tree.root.children) == 2
    assert [len(first.children) for first in tree.root.children] == [2, 2]  # both chains branched after turn 1
    assert [(event.kind, event.step, event.depth) for event in prompt.events] == [("branch", 1, 1)] * 2

    never = EntropyBranching(n=3, N=1, base_probability=0.0, entropy_weight=0.0)
    [prompt] = await rollout_trees(engine_for(lookups_then_answer(2)), episodes(), never, TreeConfig(seed=0))
    assert len(prompt.trees[0].root.children) == 3 and len(prompt.trees[0].leaves()) == 3
    assert [(event.kind, event.step) for event in prompt.events] == [("refill", 3), ("refill", 6)]  # one at a time

    at_once = EntropyBranching(n=3, N=1, base_probability=0.0, entropy_weight=0.0, refill="all")
    [prompt] = await rollout_trees(engine_for(lookups_then_answer(2)), episodes(), at_once, TreeConfig(seed=0))
    assert [(event.kind, event.step) for event in prompt.events] == [("refill", 3), ("refill", 3)]


async def test_arpo_asks_the_engine_for_top_k_log_probs():
    engine = engine_for(lookups_then_answer(1))
    await rollout_trees(engine, episodes(), EntropyBranching(n=2, N=2), TreeConfig(seed=0))
    assert {params.logprobs_topk for _, params in engine.calls} == {10}


# -- EntropyBalancedBranching (AEPO) ----------------------------------------------------------


def test_aepo_global_samples_split_by_pre_monitoring():
    sigma = 1 / (1 + math.exp(-0.5 * (1.0 - 0.2)))  # σ(β·(H_root − H_tool)) = 0.5987
    assert global_samples(16, h_root=1.0, h_tool=0.2) == math.floor(16 * sigma) + 1 == 10
    assert global_samples(16, h_root=0.2, h_tool=1.0) == 7  # ⌊16·0.4013⌋ + 1
    assert global_samples(16, h_root=0.0, h_tool=200.0) == 1  # clamped below
    assert global_samples(16, h_root=200.0, h_tool=0.0) == 16  # ⌊16·1⌋ + 1 clamped to k


def test_aepo_branch_probability_has_the_consecutive_branch_penalty():
    assert penalized_branch_probability(0.5, consecutive=0) == pytest.approx(0.6)
    assert penalized_branch_probability(0.5, consecutive=4) == pytest.approx(0.6 * 0.8)
    assert penalized_branch_probability(0.5, consecutive=25) == 0.0  # max(0, 1 − 1.25)
    assert penalized_branch_probability(5.0, consecutive=0) == 1.0


def test_aepo_penalises_consecutive_branchings_on_a_path():
    strategy = EntropyBalancedBranching(k=16)
    # ΔH = 0: p = 0.5 at l = 0, 0.475 at l = 1, 0.45 at l = 2.
    prompt = hand_prompt(0.49, 0.47, 0.48)
    branch, node, record = branch_at(prompt, [HALF_QUARTER], notes={"h_initial": 0.5})
    [copy] = strategy.after_turn(prompt, branch, node, record, ended=False)  # 0.49 < 0.5
    assert branch.notes["consecutive"] == 1 and copy.notes["consecutive"] == 1
    assert len(strategy.after_turn(prompt, branch, node, record, ended=False)) == 1  # 0.47 < 0.475
    assert strategy.after_turn(prompt, branch, node, record, ended=False) == []  # 0.48 > 0.45
    assert branch.notes["consecutive"] == 0  # a decision without a branch ends the run


def test_aepo_can_count_branchings_per_prompt_as_the_official_code():
    strategy = EntropyBalancedBranching(k=16, penalty_count="prompt")
    prompt = hand_prompt(0.42, 0.43)
    prompt.step = 3
    prompt.events += [BranchEvent(0, step, "branch", 1) for step in (1, 2, 2, 3)]  # 3 in earlier steps
    branch, node, record = branch_at(prompt, [HALF_QUARTER], notes={"h_initial": 0.5})  # ΔH = 0
    # p = 0.5·(1 − 0.05·3) = 0.425 whatever this path did (path counting would give 0.5).
    assert len(strategy.after_turn(prompt, branch, node, record, ended=False)) == 1  # 0.42 < 0.425
    assert strategy.after_turn(prompt, branch, node, record, ended=False) == []  # 0.43 > 0.425


async def test_aepo_pre_monitoring_sets_the_global_chains():
    question = [HALF_QUARTER] * 7  # "<think>": 7 tokens of entropy ln 2 → H_root = 7·ln2/ln4 = 3.5
    certain = [(11, 0.0)]  # a certain token: entropy 0

    def answer(text, results, repeat):
        if results == 0 and repeat == 0:
            return turn("<think>", top=question)  # the question-only sample comes first
        if results == 0:
            return turn(LOOKUP, top=[certain] * 18)
        return turn(ANSWER, top=[certain] * 29)

    engine = engine_for(ContextScript(answer))
    strategy = EntropyBalancedBranching(k=8, vocab_size=4, base_probability=0.0, entropy_weight=0.0)
    [prompt] = await rollout_trees(engine, episodes(), strategy, TreeConfig(seed=0))

    m = math.floor(8 / (1 + math.exp(-0.5 * 3.5))) + 1  # ⌊8·σ(1.75)⌋ + 1 = 7
    assert prompt.notes["h_root_topk"] == pytest.approx(3.5) and prompt.notes["h_tool_topk"] == 0.0
    assert prompt.notes["global_samples"] == m == 7
    assert engine.calls[0][1].max_new_tokens == 50  # the question-only sample
    assert prompt.premonitor_tokens == 7 + 18 + 29  # the sample and the discarded probe episode
    assert prompt.tokens == prompt.stats[0].tokens + prompt.premonitor_tokens
    tree = prompt.trees[0]
    assert len(tree.leaves()) == 8 and [event.kind for event in prompt.events] == ["refill"]  # p = 0: no branch


# -- budgets, failures, configuration --------------------------------------------------------


async def test_leaf_budget_refuses_branches_past_it():
    config = TreeConfig(seed=0, budget=Budget(leaves=3))
    [prompt] = await rollout_trees(engine_for(lookups_then_answer()), episodes(), Chain(5), config)
    assert len(prompt.trees[0].leaves()) == 3 and prompt.started == 3 and prompt.refused == 2
    assert prompt.budget_exhausted == ["leaves"]


async def test_token_budget_is_shared_by_the_branches_and_never_exceeded():
    config = TreeConfig(seed=0, budget=Budget(tokens=80))
    engine = engine_for(lookups_then_answer())
    [prompt] = await rollout_trees(engine, episodes(), Chain(2), config)
    # Step 1: 40 tokens each, the lookups use 18. Step 2: 22 each cut the answers (29 tokens).
    assert [params.max_new_tokens for _, params in engine.calls] == [40, 40, 22, 22]
    assert prompt.tokens == 80 and prompt.budget_exhausted == ["tokens"]
    leaves = prompt.trees[0].leaves()
    assert [(leaf.info["status"], leaf.reward, len(leaf.action_ids)) for leaf in leaves] == [("budget", 0.0, 22)] * 2
    assert prompt.stats[0].budget_cuts == 2


async def test_tool_call_budget_runs_at_most_as_many_turns_as_calls_left():
    config = TreeConfig(seed=0, budget=Budget(tool_calls=2))
    engine = engine_for(lookups_then_answer(2))
    [prompt] = await rollout_trees(engine, episodes(), Chain(3), config)
    assert len(engine.calls) == 2 and prompt.tool_calls == 2  # the third chain never got a turn
    assert [leaf.info["status"] for leaf in prompt.trees[0].leaves()] == ["budget", "budget"]
    assert (prompt.stats[0].budget_cuts, prompt.stats[0].dropped) == (3, 1)


async def test_a_failing_turn_abandons_its_branch_only():
    def answer(text, results, repeat):
        if results == 1 and repeat == 1:
            raise RuntimeError("engine down")
        return turn(LOOKUP) if results == 0 else turn(ANSWER)

    [prompt] = await rollout_trees(engine_for(ContextScript(answer)), episodes(), Chain(2), TreeConfig(seed=0))
    tree = prompt.trees[0]
    assert prompt.error is None and prompt.stats[0].errors == ["RuntimeError: engine down"]
    assert len(tree.leaves()) == 1 and len(tree) == 2  # the dead end was pruned
    assert prompt.stats[0].dropped == 1


async def test_a_prompt_that_cannot_start_is_recorded():
    config = TreeConfig(rollout=RolloutConfig(max_prompt_tokens=5))
    [prompt] = await rollout_trees(engine_for(lookups_then_answer()), episodes(), Chain(2), config)
    assert prompt.error.startswith("ValueError: the prompt has") and prompt.leaves == []


def test_bad_configuration_is_refused_with_the_reason():
    with pytest.raises(ValueError, match="TreeConfig.seed"):
        TreeConfig(rollout=RolloutConfig(sampling=SamplingParams(seed=1)))
    with pytest.raises(ValueError, match="TreeConfig.turn_timeout"):
        TreeConfig(rollout=RolloutConfig(episode_timeout=5.0))
    with pytest.raises(TypeError, match="agents.rollout.RolloutConfig"):
        TreeConfig(rollout=SamplingParams())
    with pytest.raises(ValueError, match="Budget.tokens"):
        Budget(tokens=0)
    with pytest.raises(ValueError, match="EntropyTree.K"):
        EntropyTree(K=0)
    with pytest.raises(ValueError, match="measure"):
        EntropyBranching(measure="later")
    with pytest.raises(ValueError, match="penalty_count"):
        EntropyBalancedBranching(penalty_count="tree")


async def test_keep_states_keeps_each_turn_s_starting_state():
    config = TreeConfig(rollout=RolloutConfig(keep_states=True), seed=0)
    [prompt] = await rollout_trees(engine_for(lookups_then_answer()), episodes(), Chain(2), config)
    for node in prompt.trees[0].nodes():
        ids, _ = node.env.sequence()
        assert ids == node.parent.context_ids() + node.obs_ids  # the state the turn was sampled in


# -- stateful branching in a real Python sandbox ----------------------------------------------


@pytest.fixture
def math_env(tmp_path):
    data = tmp_path / "half.jsonl"
    data.write_text(json.dumps({"problem": "What is 1 divided by 2?", "answer": "\\frac{1}{2}"}) + "\n")
    env = TokenEnv(agentenv.make("python-math", data=str(data)), TOK)
    yield env
    env.close()


SHOW = "<python>print(sorted(n for n in ('before', 'main', 'branch') if n in globals()))</python>"


@pytest.mark.slow
async def test_a_resampled_turn_branches_the_python_session(math_env):
    # One chain: set `before`; set `main`; show the session; answer. The second turn is resampled
    # (EntropyTree, K = 1): the sibling sets `branch` instead, in a fork of the session after `before`.
    def answer(text, results, repeat):
        if "before = 1" not in text:
            return turn("<python>before = 1</python>", h=0.1)
        if "main = 1" not in text and "branch = 1" not in text:
            return turn("<python>main = 1</python>", h=0.9) if repeat == 0 else turn("<python>branch = 1</python>")
        if text.count("print(sorted") == 0:
            return turn(SHOW, h=0.1)
        return turn("<answer>\\boxed{0.5}</answer>", h=0.1)

    strategy = EntropyTree(M=1, L=1, K=1, root_candidate=False)
    [prompt] = await rollout_trees(engine_for(ContextScript(answer)), [Episode(math_env)], strategy, TreeConfig(seed=0))

    tree = prompt.trees[0]
    assert prompt.error is None and prompt.stats[0].errors == []
    shown = sorted(TOK.decode(leaf.obs_ids) for leaf in tree.leaves())
    assert shown == ["\n<result>\n['before', 'branch']\n</result>\n", "\n<result>\n['before', 'main']\n</result>\n"]
    assert [leaf.reward for leaf in tree.leaves()] == [1.0, 1.0]
    assert all(node.env is None for node in tree.nodes())  # the kept sandboxes were closed


@pytest.mark.slow
async def test_a_copied_prefix_branches_the_python_session(math_env):
    # ARPO copies the path after its first tool result; each copy then sets its own variable.
    def answer(text, results, repeat):
        if "before = 1" not in text:
            return turn("<python>before = 1</python>")
        if "main = 1" not in text and "branch = 1" not in text:
            return turn("<python>main = 1</python>" if repeat == 0 else "<python>branch = 1</python>")
        if "print(sorted" not in text:
            return turn(SHOW)
        return turn("<answer>\\boxed{0.5}</answer>")

    strategy = EntropyBranching(n=2, N=1, base_probability=1.0, entropy_weight=0.0)
    [prompt] = await rollout_trees(engine_for(ContextScript(answer)), [Episode(math_env)], strategy, TreeConfig(seed=0))

    tree = prompt.trees[0]
    assert prompt.error is None and prompt.stats[0].errors == []
    first = tree.root.children[0]
    assert len(tree.root.children) == 1 and len(first.children) == 2  # branched after the first tool result
    shown = sorted(TOK.decode(leaf.obs_ids) for leaf in tree.leaves())
    assert shown == ["\n<result>\n['before', 'branch']\n</result>\n", "\n<result>\n['before', 'main']\n</result>\n"]
