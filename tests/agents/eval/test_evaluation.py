"""Evaluation: exact EM, F1, pass@k and pooled averages over real QA envs, with a scripted engine."""

import json
import math
from collections import Counter

import pytest

import agentenv
from agentenv.graders import normalize_answer
from agents.engines.base import SamplingParams
from agents.engines.scripted import ScriptedEngine
from agents.eval.evaluation import POOLED, build_episodes, evaluate, pass_at_k, pass_ks, transcript
from agents.rollout import RolloutConfig

EOS = "<|im_end|>"


@pytest.fixture(scope="module")
def tok():
    from agents.models import load_tokenizer

    return load_tokenizer("smollm2-135m")


def tasks(env_id):
    return agentenv.make(env_id).tasks


def answering(tok, plan):
    """A script: ``plan(question) -> list of replies`` for that question's successive calls, in turn."""
    calls = Counter()

    def script(prompt_ids):
        prompt = tok.decode(prompt_ids)
        question = prompt.split("Question: ")[1].split("\n")[0]
        replies = plan(question)
        reply = replies[min(calls[question], len(replies) - 1)]
        calls[question] += 1
        if isinstance(reply, Exception):
            raise reply
        return reply

    return script


def answer(text):
    return f"<think>I know it.</think>\n<answer> \\boxed{{{text}}} </answer>{EOS}"


def test_pass_at_k_is_the_unbiased_estimator():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - math.comb(3, 2) / math.comb(5, 2)) == pytest.approx(0.7)
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                expected = 1.0 if n - c < k else 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)
    assert (pass_at_k(4, 0, 2), pass_at_k(4, 4, 1)) == (0.0, 1.0)
    with pytest.raises(ValueError, match="0 <= c <= n and 1 <= k <= n"):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError, match="0 <= c <= n and 1 <= k <= n"):
        pass_at_k(3, 1, 4)


def test_pass_ks_are_one_powers_of_two_and_the_sample_count():
    assert [pass_ks(n) for n in (1, 2, 3, 4, 5, 8)] == [[1], [1, 2], [1, 2, 3], [1, 2, 4], [1, 2, 4, 5], [1, 2, 4, 8]]


def plan_engine(tok, plan):
    return ScriptedEngine(answering(tok, plan), tokenizer=tok, eos_token_ids=[tok.eos_token_id])


def f1_plus_one_word(gold):
    g = len(normalize_answer(gold).split())
    return 2 * g / (2 * g + 1)  # precision g/(g+1), recall 1


@pytest.mark.slow  # the real SmolLM2 tokenizer
async def test_em_f1_errors_and_pooled_average_over_two_real_envs(tok):
    hotpot, wiki = tasks("multihop-qa")[:3], tasks("multihop-qa:2wiki")[:3]
    gold = {t.question: t.answers[0] for t in [*hotpot, *wiki]}

    def plan(question):
        if question == hotpot[2].question:  # searches, then the gold answer plus one word
            return [
                "<think>Search first.</think>\n<search>Big Stone Gap director</search>",
                answer(gold[question] + " extra"),
            ]
        if question == wiki[1].question:
            return [RuntimeError("engine lost")]
        if question == wiki[2].question:
            return [answer("zzz")]
        return [answer(gold[question])]

    lines = []
    report = await evaluate(
        plan_engine(tok, plan),
        tok,
        ["multihop-qa", "multihop-qa:2wiki"],
        limit=3,
        on_trajectory=lambda t: lines.append(json.dumps(t.to_dict(tok))),
        progress=False,
    )

    rows = dict(report.rows())
    assert list(rows) == ["multihop-qa", "multihop-qa:2wiki", POOLED]
    h, w, pooled = rows["multihop-qa"], rows["multihop-qa:2wiki"], rows[POOLED]
    assert (h["questions"], h["episodes"], h["em"], h["errors"]) == (3, 3, pytest.approx(2 / 3), 0)
    assert h["f1"] == pytest.approx((2 + f1_plus_one_word(gold[hotpot[2].question])) / 3)
    assert (w["em"], w["f1"], w["errors"], w["format_ok"]) == (
        pytest.approx(1 / 3),
        pytest.approx(1 / 3),
        1,
        pytest.approx(2 / 3),
    )
    assert pooled["questions"] == 6 and pooled["em"] == pytest.approx(3 / 6) and pooled["errors"] == 1
    assert h["pass@1"] == h["em"] and "pass@2" not in h
    assert h["turns"] == pytest.approx(4 / 3) and h["tool_calls"] == pytest.approx(1 / 3)

    by_question = {(q.env_id, q.index): q for r in report.envs.values() for q in r.questions}
    assert by_question[("multihop-qa:2wiki", 1)].samples[0].status == "error"
    assert by_question[("multihop-qa:2wiki", 1)].samples[0].error == "RuntimeError: engine lost"
    assert by_question[("multihop-qa", 0)].id == hotpot[0].id and by_question[("multihop-qa", 0)].answers == [
        "Chief of Protocol"
    ]

    # Trajectories: in episode order in the report, one JSON line each as they finished.
    assert [t.key for t in report.trajectories] == [
        (e, i, 0) for e in ("multihop-qa", "multihop-qa:2wiki") for i in range(3)
    ]
    records = {tuple(r["key"]): r for r in map(json.loads, lines)}
    assert len(records) == 6
    searched = records[("multihop-qa", 2, 0)]
    assert searched["grade"]["answer"] == gold[hotpot[2].question] + " extra" and searched["reward"] == 0.0
    assert sum(searched["mask"]) == len([lp for lp in searched["sampler_logprobs"] if lp is not None])
    assert searched["text"].count("\n<result>\nPage 1: ") == 1 and searched["text"].endswith(EOS)
    assert records[("multihop-qa:2wiki", 1, 0)]["error"] == "RuntimeError: engine lost"

    table = report.table().splitlines()
    assert table[0].split() == [
        "env",
        "questions",
        "EM",
        "%",
        "F1",
        "%",
        "format",
        "ok",
        "%",
        "errors",
        "turns",
        "tool",
        "calls",
        "action",
        "tok",
        "in",
        "results",
        "%",
        "=",
        "example",
        "%",
        "echoes",
        "q",
        "%",
        "repeated",
        "%",
    ]
    assert table[2].split()[:3] == ["multihop-qa", "3", "66.67"]
    assert table[4].split()[:5] == ["average", "(pooled)", "6", "50.00", f"{100 * pooled['f1']:.2f}"]

    saved = json.loads(json.dumps(report.to_dict()))
    assert saved["results"][POOLED]["em"] == pytest.approx(0.5) and len(saved["questions"]) == 6
    assert saved["sampling"]["temperature"] == 0


@pytest.mark.slow  # the real SmolLM2 tokenizer
async def test_pass_at_k_from_sampled_answers(tok):
    hotpot = tasks("multihop-qa")[:4]
    correct = {t.question: i for i, t in enumerate(hotpot)}  # question i: the first i of 3 samples are right
    gold = {t.question: t.answers[0] for t in hotpot}

    def plan(question):
        return [answer(gold[question])] * correct[question] + [answer("wrong")] * 3

    rollout = RolloutConfig(sampling=SamplingParams(temperature=1.0))
    report = await evaluate(
        plan_engine(tok, plan), tok, ["multihop-qa"], limit=4, samples=3, rollout=rollout, progress=False
    )
    ((name, m),) = report.rows()
    # c = 0, 1, 2, 3 of n = 3 (question 3 answers right all three times: min(3, 3)).
    assert m["questions"] == 4 and m["episodes"] == 12
    assert m["pass@1"] == pytest.approx((0 + 1 / 3 + 2 / 3 + 1) / 4) == pytest.approx(m["em"])
    assert m["pass@2"] == pytest.approx((0 + (1 - 1 / 3) + 1 + 1) / 4)
    assert m["pass@3"] == pytest.approx(3 / 4)
    assert "pass@3 %" in report.table().splitlines()[0]


def test_pooled_average_weighs_each_question_not_each_env():
    from agents.eval.evaluation import EnvResult, EvalReport, QuestionResult, Sample

    def q(env, i, em):
        return QuestionResult(env, i, None, None, [], [Sample(em, em, em, True, None, "terminated", None, 1, 0, 5, 5)])

    big = EnvResult("big", [q("big", i, 1.0 if i < 3 else 0.0) for i in range(4)], 1)  # 3/4
    small = EnvResult("small", [q("small", 0, 0.0)], 1)  # 0/1
    report = EvalReport({"big": big, "small": small}, 1, SamplingParams(temperature=0), [])
    rows = dict(report.rows())
    assert rows["big"]["em"] == 0.75 and rows["small"]["em"] == 0.0
    assert rows[POOLED]["em"] == pytest.approx(3 / 5)  # not (0.75 + 0) / 2


@pytest.mark.slow  # the real SmolLM2 tokenizer
async def test_evaluation_refuses_meaningless_setups(tok):
    engine = plan_engine(tok, lambda question: [answer("x")])
    with pytest.raises(ValueError, match="set a temperature above 0"):
        await evaluate(engine, tok, ["multihop-qa"], limit=1, samples=2, progress=False)
    with pytest.raises(ValueError, match="limit must be >= 1"):
        await evaluate(engine, tok, ["multihop-qa"], limit=0, progress=False)
    with pytest.raises(ValueError, match="listed twice"):
        await evaluate(engine, tok, ["multihop-qa", "multihop-qa"], limit=1, progress=False)
    with pytest.raises(agentenv.UnknownEnvError, match="multihop-qa"):
        await evaluate(engine, tok, ["multihop-q"], limit=1, progress=False)


@pytest.mark.slow  # the real SmolLM2 tokenizer
def test_episodes_of_an_env_share_nothing_but_the_task_list(tok):
    episodes = build_episodes("multihop-qa:2wiki", tok, limit=2, samples=2)
    assert [e.key for e in episodes] == [("multihop-qa:2wiki", i, s) for i in range(2) for s in range(2)]
    assert [dict(e.options) for e in episodes] == [{"index": 0}, {"index": 0}, {"index": 1}, {"index": 1}]
    assert len({id(e.env) for e in episodes}) == 4 and len({id(e.env.tasks) for e in episodes}) == 1


@pytest.mark.slow  # the real SmolLM2 tokenizer
async def test_transcript_shows_each_turn_with_its_source_and_the_grade(tok):
    hotpot = tasks("multihop-qa")[:1]
    plan = lambda question: ["<search>Kiss and Tell</search>", answer("Chief of Protocol")]  # noqa: E731
    report = await evaluate(plan_engine(tok, plan), tok, ["multihop-qa"], limit=1, progress=False)
    text = transcript(report.trajectories[0], tok)
    lines = text.splitlines()
    assert lines[0].startswith("--- prompt (") and hotpot[0].question in text
    assert any(line.startswith("--- turn 1: model (") and "stopped at '</search>'" in line for line in lines)
    assert any(line.startswith("--- turn 1: environment (") for line in lines)
    assert "Page 1: " in text
    assert (
        lines[-1] == "--- terminated: reward 1, answer 'Chief of Protocol', gold ['Chief of Protocol'], EM 1, F1 1.00"
    )


async def test_heldout_scores_a_budget_cut_episode_with_the_training_budget_reward(tok):
    from agents.eval.heldout import evaluate_heldout

    hotpot = tasks("multihop-qa")[:3]
    gold = {t.question: t.answers[0] for t in hotpot}
    rambling = "<think>" + "and then " * 40  # no answer, no tool call: runs into the budget

    def plan(question):
        return [
            answer(gold[question])
            if question == hotpot[0].question
            else answer("zzz")
            if question == hotpot[1].question
            else rambling
        ]

    rollout = RolloutConfig(sampling=SamplingParams(temperature=0, max_new_tokens=64), max_response_tokens=100)
    scores = {}
    for budget_reward in (None, -1.0):
        held = await evaluate_heldout(
            plan_engine(tok, plan),
            tok,
            "multihop-qa",
            questions=3,
            rollout=rollout,
            step=0,
            env_kwargs={"reward": "at2po"},
            budget_reward=budget_reward,
            progress=False,
        )
        scores[budget_reward] = held.scores
    # AT²PO's reward: 1 right, 0 wrong, and the cut episode 0 (the env's: unfinished) or -1 (training's).
    assert scores[None]["reward"].mean == pytest.approx(1 / 3)
    assert scores[-1.0]["reward"].mean == pytest.approx(0.0)
    assert scores[-1.0]["em"].mean == pytest.approx(1 / 3) and scores[-1.0]["format_ok"].mean == pytest.approx(2 / 3)
    # No search, so no answer was found in a result; two answers, to two questions, neither repeated.
    names = ("tool_calls", "in_results", "equals_example", "echoes_question", "repeated")
    assert [scores[-1.0][name].mean for name in names] == [0] * 5


def test_sampler_logprob_gap_compares_action_tokens_and_counts_nan_as_infinite():
    from types import SimpleNamespace

    import torch

    from agents.eval.evaluation import sampler_logprob_gap

    logits = torch.tensor([[[0.0, 1.0, 2.0], [2.0, 0.0, 0.0], [0.0, 0.0, 3.0]]])  # [1, positions, vocab]

    class Model:
        device = torch.device("cpu")

        def __call__(self, ids):
            return SimpleNamespace(logits=logits)

    fresh = torch.log_softmax(logits[0], -1)
    ids, mask = [0, 2, 0], [0, 1, 1]  # tokens 1 and 2 are actions, scored by positions 0 and 1
    exact = [None, fresh[0, 2].item(), fresh[1, 0].item()]
    off = [None, exact[1] + 0.25, exact[2]]
    broken = [None, exact[1], math.nan]
    gap, count = sampler_logprob_gap(Model(), [SimpleNamespace(ids=ids, mask=mask, sampler_logprobs=exact)])
    assert count == 2 and gap < 1e-6  # log Z subtracted rather than log_softmax: one float32 ulp at most
    # At temperature 2 the same logits give other log-probs: the gap is against the scaled distribution.
    halved = [
        None,
        torch.log_softmax(logits[0] / 2, -1)[0, 2].item(),
        torch.log_softmax(logits[0] / 2, -1)[1, 0].item(),
    ]
    assert (
        sampler_logprob_gap(Model(), [SimpleNamespace(ids=ids, mask=mask, sampler_logprobs=halved)], temperature=2.0)[0]
        < 1e-6
    )
    assert sampler_logprob_gap(Model(), [SimpleNamespace(ids=ids, mask=mask, sampler_logprobs=off)])[
        0
    ] == pytest.approx(0.25)
    assert sampler_logprob_gap(Model(), [SimpleNamespace(ids=ids, mask=mask, sampler_logprobs=broken)])[0] == math.inf


# -- the LLM judge (--grader judge): AEPO's and ARPO's scoring of deep-search benchmarks.


def judge_model(replies):
    """An async judge model: the reply for the predicted answer in its prompt (an exception is raised)."""
    prompts = []

    async def ask(prompt):
        prompts.append(prompt)
        reply = replies[prompt.split("Predicted Answer: ")[1].split("\n")[0]]
        if isinstance(reply, Exception):
            raise reply
        return reply

    ask.prompts = prompts
    return ask


async def test_the_judge_decides_judge_score_and_pass_at_k_and_unjudged_answers_count_apart(tok):
    from agentenv.judge import Judge

    hotpot = tasks("multihop-qa")[:4]
    gold = {t.question: t.answers[0] for t in hotpot}
    answers = {
        hotpot[0].question: gold[hotpot[0].question],  # identical to the gold: correct without a call
        hotpot[1].question: "zzz",  # the judge says Incorrect
        hotpot[2].question: gold[hotpot[2].question] + " indeed",  # not EM; the judge says Correct
        hotpot[3].question: "boom",  # the judge model fails on every try: unjudged
    }
    ask = judge_model(
        {"zzz": "Incorrect", gold[hotpot[2].question] + " indeed": "Correct", "boom": RuntimeError("judge down")}
    )
    judge = Judge(ask, "test-judge", retry_delay=0)
    seen = []
    report = await evaluate(
        plan_engine(tok, lambda question: [answer(answers[question])]),
        tok,
        ["multihop-qa"],
        limit=4,
        judge=judge,
        on_trajectory=lambda t: seen.append((t.key, t.info["judge"]["verdict"])),
        progress=False,
    )
    ((name, m),) = report.rows()
    assert m["em"] == pytest.approx(1 / 4)
    # The judge: mean over the questions it decided, (1 + 0 + 1) / 3; the failure is unjudged, not a 0.
    assert m["judge"] == pytest.approx(2 / 3) and m["unjudged"] == 1
    assert m["pass@1"] == pytest.approx(2 / 3)  # from the judge's verdicts, over judged samples
    questions = report.envs["multihop-qa"].questions
    assert [q.samples[0].judge for q in questions] == ["correct", "incorrect", "correct", "unjudged"]
    assert questions[3].samples[0].judge_detail == "the judge call failed (3 tries); last: RuntimeError: judge down"
    assert report.judge == {
        "model": "test-judge",
        "requests": 4,
        "no_answer": 0,
        "exact": 1,
        "cached": 0,
        "calls": 5,  # 1 + 1 + 3 tries
        "failed_calls": 3,
        "correct": 2,
        "incorrect": 1,
        "unjudged": 1,
        "prompt_tokens": 0,
        "completion_tokens": 0,
        "seconds": report.judge["seconds"],
    }
    assert len(ask.prompts) == 5
    assert f"Question: {hotpot[1].question}\nGolden Answer: {gold[hotpot[1].question]}\nPredicted Answer: zzz\n" in {
        p.split("\n\n")[1] for p in ask.prompts
    }
    # Each trajectory is handed on once judged, its verdict in info["judge"].
    assert sorted(seen) == [
        (("multihop-qa", i, 0), v) for i, v in enumerate(["correct", "incorrect", "correct", "unjudged"])
    ]
    table = report.table().splitlines()
    assert table[0].split()[:9] == ["env", "questions", "EM", "%", "F1", "%", "judge", "%", "unjudged"]
    assert table[2].split()[:3] == ["multihop-qa", "4", "25.00"] and table[2].split()[4:6] == ["66.67", "1"]
    assert transcript(report.trajectories[3], tok).endswith(
        ", judge unjudged (the judge call failed (3 tries); last: RuntimeError: judge down)"
    )
    saved = json.loads(json.dumps(report.to_dict()))
    assert saved["grader"] == "judge" and saved["judge"]["calls"] == 5
    assert saved["results"]["multihop-qa"]["judge"] == pytest.approx(2 / 3)
    assert [q["judge"] for q in saved["questions"]] == [1.0, 0.0, 1.0, None]

    # The same judge again: its verdicts are cached, and the report counts this evaluation's work only.
    again = await evaluate(
        plan_engine(tok, lambda question: [answer(answers[question])]),
        tok,
        ["multihop-qa"],
        limit=4,
        judge=judge,
        progress=False,
    )
    assert (again.judge["cached"], again.judge["calls"], again.judge["requests"]) == (2, 3, 4)


def test_judge_pass_at_k_counts_judged_samples_only():
    from agents.eval.evaluation import EnvResult, QuestionResult, Sample

    def sample(verdict):
        return Sample(0.0, 0.0, 0.0, True, "x", "terminated", None, 1, 0, 5, 5, judge=verdict)

    # Question 0: 3 judged (1 correct) of 4; question 1: 1 judged of 4, too few for pass@2.
    q0 = QuestionResult("e", 0, None, None, [], [sample(v) for v in ("correct", "incorrect", "incorrect", "unjudged")])
    q1 = QuestionResult("e", 1, None, None, [], [sample(v) for v in ("correct", "unjudged", "unjudged", "unjudged")])
    for q in (q0, q1):
        q.grader = "judge"
    m = EnvResult("e", [q0, q1], 4).metrics()
    assert m["judge"] == pytest.approx((1 / 3 + 1) / 2) and m["unjudged"] == 4
    assert m["pass@1"] == pytest.approx((1 / 3 + 1) / 2)
    assert m["pass@2"] == pytest.approx(1 - math.comb(2, 2) / math.comb(3, 2))  # q0 only: 1 - C(2,2)/C(3,2)
    assert math.isnan(m["pass@4"])  # no question has 4 judged samples
    assert q0.pass_at(4) is None and q0.correct == 1


async def test_the_judge_needs_environments_with_questions_and_gold_answers(tok, module_envs):
    from agentenv.judge import Judge

    class Chat(agentenv.Env):
        def reset(self, *, seed=None, options=None):
            super().reset(seed=seed)
            return "Say hi.", {}

        def step(self, action):
            return "", 1.0, True, False, {}

    module_envs("test/chat-no-tasks", Chat)
    with pytest.raises(ValueError, match="'test/chat-no-tasks' has no task list of questions and answers"):
        await evaluate(
            plan_engine(tok, lambda question: ["hi"]),
            tok,
            ["test/chat-no-tasks"],
            limit=1,
            judge=Judge(judge_model({}), "m"),
            progress=False,
        )


# -- MuSiQue-Full: answers scored on answerable questions only; the answerability metric of
# evaluate_v1.0.py (GroupAnswerSufficiencyMetric) of StonyBrookNLP/musique over the pairs.


def test_musique_answerability_pairs_twins_and_scores_answers_on_answerable_questions_only():
    from agents.eval.evaluation import EnvResult, QuestionResult, Sample, answerability

    def q(index, qid, answerable, answer, em):
        s = Sample(em, em, em, True, answer, "terminated", None, 1, 0, 5, 5)
        return QuestionResult("e", index, qid, None, [], [s], answerable=answerable)

    questions = [
        q(0, "p1", True, "A", 1.0),  # pair 1: right answer, and the twin says unanswerable: both right
        q(1, "p1", False, "Unanswerable.", 1.0),  # SQuAD-normalised: "unanswerable"
        q(2, "p2", True, "B", 1.0),  # pair 2: right answer, but the twin claims an answer: suff 0
        q(3, "p2", False, "B", 0.0),
        q(4, "p3", True, "unanswerable", 0.0),  # pair 3: says unanswerable when it is answerable: suff 0
        q(5, "p3", False, "unanswerable", 1.0),
        q(6, "p4", True, "wrong", 0.0),  # no twin among these questions: EM only
        q(7, "p5", True, None, 0.0),  # pair 5: no answer does not claim unanswerable: suff 0
        q(8, "p5", False, None, 0.0),
    ]
    assert answerability(questions) == {
        "pairs": 4,
        "suff": pytest.approx(1 / 4),
        "ans_suff_em": pytest.approx(1 / 4),
        "ans_suff_f1": pytest.approx(1 / 4),
    }
    m = EnvResult("e", questions, 1).metrics()
    # EM over the 5 answerable questions (MuSiQue's answer_em): pair 1 and pair 2 right.
    assert (m["questions"], m["unanswerable"], m["em"], m["pairs"]) == (9, 4, pytest.approx(2 / 5), 4)
    assert m["pass@1"] == pytest.approx(2 / 5)


def musique_full(tmp_path):
    rows = []
    for n, (question, answer) in enumerate([("Who is Q1?", "Alpha"), ("Who is Q2?", "Beta")]):
        for answerable in (True, False):
            rows.append(
                {
                    "id": f"2hop__{n}",
                    # Twins share their question in MuSiQue; the contrast mark lets the script tell them apart.
                    "question": question if answerable else question.replace("?", " (contrast)?"),
                    "answer": answer,
                    "answer_aliases": [],
                    "answerable": answerable,
                    "paragraphs": [
                        {"idx": 0, "title": "T", "paragraph_text": f"{answer} is Q.", "is_supporting": True}
                    ],
                }
            )
    path = tmp_path / "musique_full.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


async def test_musique_full_evaluation_reads_answerability_from_the_tasks(tok, tmp_path, module_envs):
    from agentenv.datasets import load_examples
    from agentenv.tool_env import ToolEnv

    path = musique_full(tmp_path)
    module_envs("test/musique-full", lambda: ToolEnv(load_examples(path, unanswerable="include")))
    replies = {
        "Who is Q1?": "Alpha",  # pair 0: right, and its twin says unanswerable
        "Who is Q1 (contrast)?": "unanswerable",
        "Who is Q2?": "Beta",  # pair 1: right, but its twin answers too
        "Who is Q2 (contrast)?": "Beta",
    }
    report = await evaluate(
        plan_engine(tok, lambda question: [answer(replies[question])]), tok, ["test/musique-full"], progress=False
    )
    ((name, m),) = report.rows()
    assert (m["questions"], m["unanswerable"], m["em"], m["pairs"]) == (4, 2, 1.0, 2)
    assert (m["suff"], m["ans_suff_em"], m["ans_suff_f1"]) == (0.5, 0.5, 0.5)
    table = report.table().splitlines()
    assert "Suff %" in table[0] and "AnsSuff F1 %" in table[0]
    assert [q.answerable for q in report.envs["test/musique-full"].questions] == [True, False, True, False]
