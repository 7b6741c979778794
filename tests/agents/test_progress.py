"""Progress of the long phases: plain lines on a stream that is no terminal, tqdm bars on one.

The lines are checked exactly under a fake clock; the rollout's counts with a scripted engine (no
model), and a whole run with the tiny random Llama of the shared fixtures.
"""

import io
import re
import sys
import time

import pytest

import agentenv
import agents.progress
from agentenv import TokenEnv, ToolEnv
from agentenv.datasets import Example
from agents.engines.scripted import ScriptedEngine, ScriptedTurn
from agents.progress import LogLines, phase, progress_bar
from agents.rollout import Episode
from agents.rollout.strategies import (
    Budget,
    Chain,
    EntropyBalancedBranching,
    EntropyBranching,
    EntropyTree,
    RandomTree,
)
from agents.rollout.tree_loop import TreeConfig, planned_branches, rollout_trees
from agents.run.config import TrainConfig, merge
from agents.run.train import train


class Clock:
    """A fake ``monotonic``: ``now`` seconds, moved by the test."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> Clock:
    fake = Clock()
    monkeypatch.setattr(agents.progress, "monotonic", fake)
    return fake


def lines(stream: io.StringIO) -> list[str]:
    return stream.getvalue().splitlines()


# -- lines ------------------------------------------------------------------------------------


def test_lines_name_the_phase_and_count_with_rate_and_eta(clock):
    out = io.StringIO()
    bar = progress_bar("rollout step 3", 4, unit="leaves", file=out, interval=0)
    assert isinstance(bar, LogLines)
    for _ in range(2):
        clock.now += 0.5
        bar.update()
    clock.now += 3.0
    bar.set_postfix(reward="0.250", refresh=False)
    bar.update(2)
    bar.close()
    bar.close()  # a second close prints nothing
    assert lines(out) == [
        "rollout step 3: 0/4 leaves",
        "rollout step 3: 1/4 leaves after 00:00, 2.0 leaves/s, ETA 00:01",
        "rollout step 3: 2/4 leaves after 00:01, 2.0 leaves/s, ETA 00:01",
        "rollout step 3: 4/4 leaves after 00:04, 1.0 leaves/s, ETA 00:00, reward=0.250",
        "rollout step 3: 4/4 leaves in 00:04, 1.0 leaves/s, reward=0.250",
    ]


def test_lines_come_at_most_every_interval_and_slow_rates_read_as_seconds_each(clock):
    out = io.StringIO()
    with progress_bar("train", 10, unit="steps", initial=2, file=out, interval=30) as bar:
        for _ in range(3):
            clock.now += 20.0
            bar.update()
    assert lines(out) == [
        "train: 2/10 steps",  # a resumed run counts from its step
        "train: 4/10 steps after 00:40, 20.0 s each, ETA 02:00",  # 40 s after the first line; the one at 20 s is skipped
        "train: 5/10 steps in 01:00, 20.0 s each",
    ]


def test_the_innermost_phase_prints_its_line_again_while_its_count_stands_still():
    out = io.StringIO()
    with progress_bar("train", 2, unit="steps", file=out, interval=0.05):
        with progress_bar("eval", 2, unit="episodes", file=out, interval=0.05):
            time.sleep(0.35)  # no episode ends: the evaluation still says it runs, the steps' bar waits
        inner = len(lines(out))
        time.sleep(0.35)
    printed = lines(out)
    assert printed[:2] == ["train: 0/2 steps", "eval: 0/2 episodes"]
    assert all(re.fullmatch(r"eval: 0/2 episodes after 00:00", line) for line in printed[2 : inner - 1])
    assert inner - 3 >= 2 and printed[inner - 1] == "eval: 0/2 episodes in 00:00"
    assert all(re.fullmatch(r"train: 0/2 steps after 00:0\d", line) for line in printed[inner:-1])
    assert len(printed) - inner - 1 >= 2 and printed[-1].startswith("train: 0/2 steps in ")


def test_a_transient_phase_shows_in_a_log_only_once_it_runs_past_the_interval(clock):
    out = io.StringIO()
    with progress_bar("update step 1", 2, unit="micro-batches", leave=False, file=out, interval=30) as bar:
        clock.now += 10.0
        bar.update(2)
    assert lines(out) == []  # ten seconds: no line at all
    with progress_bar("update step 2", 2, unit="micro-batches", leave=False, file=out, interval=30) as bar:
        clock.now += 31.0
        bar.update()
        clock.now += 9.0
        bar.update()
    assert lines(out) == [
        "update step 2: 1/2 micro-batches after 00:31, 31.0 s each, ETA 00:31",
        "update step 2: 2/2 micro-batches in 00:40, 20.0 s each",
    ]


def test_forty_sft_steps_write_forty_lines_and_the_heartbeats_to_a_log(clock):
    """The loop of agents.sft.train: the steps' bar, each step's update bar (transient), then the step's note."""
    out = io.StringIO()
    with progress_bar("train", 40, unit="steps", file=out, interval=30) as steps:
        for step in range(1, 41):
            with progress_bar(
                f"update step {step}", 2, unit="micro-batches", leave=False, file=out, interval=30
            ) as bar:
                for _ in range(2):
                    clock.now += 0.5
                    bar.update()
            print(f"step {step}/40: loss 1.0000", file=out)
            steps.update()
    printed = lines(out)
    assert [line for line in printed if line.startswith("step ")] == [f"step {k}/40: loss 1.0000" for k in range(1, 41)]
    assert [line for line in printed if not line.startswith("step ")] == [
        "train: 0/40 steps",
        "train: 30/40 steps after 00:30, 1.0 steps/s, ETA 00:10",  # the heartbeat, every 30 s
        "train: 40/40 steps in 00:40, 1.0 steps/s",
    ]


def test_a_phase_of_unknown_size_counts_without_an_eta(clock):
    out = io.StringIO()
    with progress_bar("rollout step 1", None, unit="leaves", file=out, interval=0) as bar:
        clock.now += 1.0
        bar.update(3)
    assert lines(out) == [
        "rollout step 1: 0 leaves",
        "rollout step 1: 3 leaves after 00:01, 3.0 leaves/s",
        "rollout step 1: 3 leaves in 00:01, 3.0 leaves/s",
    ]


def test_a_phase_without_counts_says_when_it_starts_and_how_long_it_took(clock):
    out = io.StringIO()
    with phase("loading model smollm2-135m", file=out):
        clock.now += 4.25
    assert lines(out) == ["loading model smollm2-135m", "loading model smollm2-135m: done in 4.2 s"]


def test_progress_false_shows_nothing_and_the_default_goes_to_stderr(capsys):
    with progress_bar("eval", 2, unit="episodes", show=False, interval=0) as bar:
        bar.update(2)
    with phase("loading model x", show=False):
        pass
    assert capsys.readouterr().err == ""
    with progress_bar("eval", 1, unit="episodes", show=True, interval=0) as bar:
        bar.update()
    assert capsys.readouterr().err.splitlines()[0] == "eval: 0/1 episodes"


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_a_tqdm_bar_with_rate_and_eta():
    out = Terminal()
    with progress_bar("rollout step 1", 3, unit="leaves", file=out) as bar:
        assert not isinstance(bar, LogLines)
        bar.update(3)
    drawn = out.getvalue()
    assert "\r" in drawn and re.search(r"rollout step 1: 100%\|.*\| 3/3 \[\d\d:\d\d<\d\d:\d\d", drawn)


# -- the rollout ------------------------------------------------------------------------------

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
TASKS = [Example(id=f"q{i}", question=f"What is x{i}?", answers=("42",)) for i in range(4)]


def lookup(term: str) -> str:
    """Look a term up.

    Args:
        term: what to look up.
    """
    return f"{term} is 42"


def turn(text: str) -> ScriptedTurn:
    """A scripted turn with log-probs, entropies and top log-probs (what every strategy may ask for)."""
    n = len(TOK.encode(text))
    return ScriptedTurn(text=text, logprobs=-0.5, token_entropies=0.5, top_logprobs=[[(11, -0.5)]] * n)


def script(ids):
    """One lookup, then the answer."""
    looked_up = "<result>" in TOK.decode(ids)
    return turn("<answer> \\boxed{42} </answer>" if looked_up else "<lookup>x</lookup>")


def episodes(indices) -> list[Episode]:
    env = TokenEnv(ToolEnv(TASKS, [lookup], prompt_template="Q: {question}", max_tool_calls=2), TOK)
    return [Episode(env.fork(), options={"index": i}) for i in indices]


async def counted_rollout(strategy, indices, config=None):
    """The rollout with its counts as a line stream (interval 0); returns the results, the lines and the total."""
    config = config or TreeConfig(seed=0)
    total = planned_branches(strategy, config) * len(indices)
    out = io.StringIO()
    with progress_bar("rollout step 1", total, unit="leaves", file=out, interval=0) as bar:
        results = await rollout_trees(
            ScriptedEngine(script, tokenizer=TOK), episodes(indices), strategy, config, on_branches=bar.update
        )
    return results, lines(out), total


def counts(printed: list[str]) -> list[str]:
    return [re.match(r"rollout step 1: (\d+/\d+) leaves", line).group(1) for line in printed]


@pytest.mark.parametrize(
    "strategy",
    [
        Chain(3),
        EntropyTree(M=2, L=1, K=2),
        RandomTree(M=2, N=2, L=1, K=2),
        EntropyBranching(n=4, N=2, base_probability=1.0, entropy_weight=0.0, vocab_size=300),
        EntropyBalancedBranching(k=4, vocab_size=300),
    ],
    ids=lambda strategy: type(strategy).__name__,
)
async def test_the_rollout_counts_the_leaves_of_the_steps_budget_as_they_end(strategy):
    results, printed, total = await counted_rollout(strategy, [0, 1])
    assert all(prompt.error is None and prompt.started == total // 2 for prompt in results)
    # one line as each branch ends, then the final line
    assert counts(printed) == [f"{k}/{total}" for k in range(total + 1)] + [f"{total}/{total}"]
    assert printed[-1].startswith(f"rollout step 1: {total}/{total} leaves in ")


async def test_the_branches_a_prompt_never_ran_count_when_it_ends():
    # Prompt 1 names no task (its reset fails); the budget refuses a third chain of prompt 0.
    results, printed, total = await counted_rollout(Chain(3), [0, 99], TreeConfig(seed=0, budget=Budget(leaves=2)))
    assert total == 4 and results[1].error is not None and results[0].started == 2
    assert sorted(counts(printed)) == counts(printed) and counts(printed)[-2:] == ["4/4", "4/4"]


# -- a run ------------------------------------------------------------------------------------


class Letters(agentenv.Env):
    """One turn; the reward is the fraction of the answer's characters that are a-z."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return "Write letters.", {}

    def step(self, action):
        return "", sum("a" <= ch <= "z" for ch in action) / max(1, len(action)), True, False, {}


@pytest.fixture(scope="module", autouse=True)
def letters(module_envs):
    module_envs("progress-tests/letters-v0", Letters)


def letters_config(model: str) -> TrainConfig:
    """GRPO: 1 step of 2 prompts × 3 chains of 4 tokens, 2 held-out episodes before and after."""
    values = {
        "env": "progress-tests/letters",
        "model": model,
        "steps": 1,
        "prompts_per_step": 2,
        "holdout": 2,
        "eval_questions": 2,
        "strategy": {"n": 3},
        "trainer": {"mini_batches": 1, "micro_batch_size": 6, "report_to": ["none"]},
        "sampling": {"max_new_tokens": 4},
        "rollout": {"max_response_tokens": 4},
        "loss": {"kl_coef": 0.0},
    }
    return TrainConfig.from_dict(merge(TrainConfig(algo="grpo").to_dict(), values))


async def test_a_run_written_to_a_file_shows_every_phase_from_the_start(tiny_model, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(agents.progress, "LINE_INTERVAL", 0.0)
    await train(letters_config(tiny_model), tmp_path, log=lambda line: print(f"NOTE {line}", file=sys.stderr))
    err = capsys.readouterr().err.splitlines()

    def first(prefix: str) -> int:
        return next(i for i, line in enumerate(err) if line.startswith(prefix))

    assert err[0] == f"loading model {tiny_model}"
    assert re.fullmatch(rf"loading model {re.escape(tiny_model)}: done in \d+\.\d s", err[1])
    # the steps' bar is there before the first evaluation, rollout and step
    assert err[2] == "train: 0/1 steps" and first("eval: 0/2 episodes") == 3
    assert first("eval: 0/2") < first("NOTE step 0: held-out") < first("rollout step 1: 0/6 leaves")
    rollout = [re.match(r"rollout step 1: (\d+)/6 leaves", line) for line in err]
    assert [int(m.group(1)) for m in rollout if m] == [0, 1, 2, 3, 4, 5, 6, 6]
    assert first("rollout step 1: 6/6 leaves in") < first("update step 1: 0/1 micro-batches")
    assert first("update step 1: 1/1 micro-batches in") < first("train: 1/1 steps") < first("NOTE step 1/1")
    step_line = err[first("train: 1/1")]
    assert re.fullmatch(r"train: 1/1 steps after \d\d:\d\d, .*, reward=-?\d\.\d{3}, loss=-?\d\.\d{4}", step_line)
    assert sum(line == "eval: 0/2 episodes" for line in err) == 2  # before and after
    assert err[-1].startswith("train: 1/1 steps in ")  # closed with the run
    # transformers' own bars, whose carriage returns would garble a log file, are off
    assert not any("\r" in line or "Loading weights" in line or "Writing model shards" in line for line in err)


async def test_a_run_without_progress_prints_nothing(tiny_model, tmp_path, capsys):
    await train(letters_config(tiny_model), tmp_path, progress=False, log=lambda line: None)
    captured = capsys.readouterr()
    assert (captured.out, captured.err) == ("", "")
