"""``agents sft``: the sft loss, reading trajectories and chats, filtering, errors, a short run, the command."""

import json
from pathlib import Path

import pytest
import torch

import agentenv
from agentenv.wrappers import TokenEnv
from agents.cli import main
from agents.models import load_model, load_tokenizer
from agents.rollout.episodes import Trajectory, TurnRecord
from agents.sft.train import (
    SFTConfig,
    SFTDataError,
    chat_example,
    load_sft_data,
    sft,
    training_path,
    trajectory_example,
)
from agents.training.losses import LOSSES, sft_loss
from agents.training.trainer_config import TrainerConfig

CHAT = [
    {"role": "system", "content": "Use the search tool."},
    {"role": "user", "content": "Who wrote Hamlet?"},
    {"role": "assistant", "content": "<search>Hamlet author</search>"},
    {"role": "tool", "content": "Hamlet is a tragedy by William Shakespeare."},
    {"role": "assistant", "content": "<answer>Shakespeare</answer>"},
]


# -- the loss ------------------------------------------------------------------------------------


def test_the_sft_loss_is_the_mean_nll_of_the_action_tokens():
    logprobs = torch.tensor([[-1.0, -2.0, -3.0]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    old = torch.tensor([[float("nan"), 5.0, -7.0]])  # ignored, whatever it holds
    advantages = torch.tensor([[3.0, -1.0, 100.0]])  # ignored
    loss, metrics = sft_loss(logprobs, old, advantages, mask)
    assert loss.item() == 2.0
    assert metrics == {"nll": 2.0, "pg_loss": 2.0, "loss": 2.0}
    assert LOSSES["sft"] is sft_loss
    assert TrainerConfig(loss="sft").loss == "sft"


def test_the_sft_gradient_is_that_of_the_mean_nll_and_ignores_advantages_and_old_logprobs():
    generator = torch.Generator().manual_seed(0)
    base = -torch.rand(3, 7, generator=generator, dtype=torch.float64) * 4
    mask = (torch.rand(3, 7, generator=generator) > 0.4).double()
    mask[:, 0] = 1
    gradients = []
    for seed in (1, 2):
        g = torch.Generator().manual_seed(seed)
        logprobs = base.clone().requires_grad_(True)
        loss, _ = sft_loss(logprobs, torch.randn(3, 7, generator=g), torch.randn(3, 7, generator=g), mask)
        loss.backward()
        gradients.append(logprobs.grad)
    reference = base.clone().requires_grad_(True)
    (-(reference * mask).sum() / mask.sum()).backward()
    for gradient in gradients:
        torch.testing.assert_close(gradient, reference.grad, rtol=0, atol=1e-15)
    assert reference.grad[mask == 1].eq(-1 / mask.sum()).all() and reference.grad[mask == 0].eq(0).all()


# -- trajectories --------------------------------------------------------------------------------


def a_trajectory(reward: float = 1.0, turns: int = 2) -> dict:
    """The record `agents eval --save-trajectories` writes for a two-turn episode with prompt [5, 6, 7]."""
    records = [
        TurnRecord([8, 9], [-0.5, -0.25], [10], (3, 5), (5, 6), 0.0, "stop"),
        TurnRecord([11], [-0.125], [], (6, 7), (7, 7), reward, "stop"),
    ][:turns]
    return Trajectory(0, ("multihop-qa", 0, 0), [5, 6, 7], records, "terminated").to_dict()


def test_a_trajectory_keeps_its_exact_ids_turns_and_logprobs():
    example = trajectory_example(a_trajectory())
    assert example.prompt_ids == [5, 6, 7] and example.reward == 1.0 and example.kind == "trajectory"
    assert [tuple(turn) for turn in example.turns] == [([], [8, 9], [-0.5, -0.25]), ([10], [11], [-0.125])]
    path = training_path(example)
    assert path.ids == [5, 6, 7, 8, 9, 10, 11]
    assert path.mask == [0, 0, 0, 1, 1, 0, 1]
    assert [lp for lp, m in zip(path.sampler_logprobs, path.mask) if m] == [-0.5, -0.25, -0.125]
    assert path.advantages == [0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0] and path.reward == 1.0
    assert path.turn_ids == [0, 0, 0, 1, 1, 2, 2]


def test_a_trajectory_saved_with_the_earlier_logprobs_key_reads_the_same():
    record = a_trajectory()
    record["logprobs"] = record.pop("sampler_logprobs")  # as agents eval wrote it before the one vocabulary
    assert trajectory_example(record) == trajectory_example(a_trajectory())
    record["logprobs"] = [-0.5]
    with pytest.raises(SFTDataError, match=r"'logprobs' must be a list as long as 'ids' \(7\) or null"):
        trajectory_example(record)


def test_adjacent_actions_stay_two_turns_by_their_spans():
    record = a_trajectory()
    record["ids"], record["mask"] = [5, 6, 7, 8, 9, 11], [0, 0, 0, 1, 1, 1]
    record["sampler_logprobs"] = [None, None, None, -0.5, -0.25, -0.125]
    record["turns"][0]["obs_span"], record["turns"][1]["action_span"] = [5, 5], [5, 6]
    example = trajectory_example(record)
    assert [turn.action_ids for turn in example.turns] == [[8, 9], [11]]


# -- chats ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer(tiny_model):
    return load_tokenizer(tiny_model)


def decode(tokenizer, ids):
    return tokenizer.decode(ids, skip_special_tokens=False)


def test_an_inline_chat_is_the_prompt_then_actions_and_result_blocks(tokenizer):
    example = chat_example(CHAT, tokenizer)
    prompt = tokenizer.apply_chat_template(CHAT[:2], tokenize=False, add_generation_prompt=True)
    # the prompt as TokenEnv renders it: the template's text with its generation prompt, encoded alone
    assert example.prompt_ids == tokenizer.encode(prompt, add_special_tokens=False)
    assert decode(tokenizer, example.prompt_ids).endswith("Who wrote Hamlet?<|im_end|>\n<|im_start|>assistant\n")
    assert [decode(tokenizer, turn.action_ids) for turn in example.turns] == [
        "<search>Hamlet author</search>",
        "<answer>Shakespeare</answer><|im_end|>",  # the episode's end, where the model stops
    ]
    assert example.turns[1].action_ids[-1] == tokenizer.eos_token_id
    assert [decode(tokenizer, turn.obs_ids) for turn in example.turns] == [
        "",
        "\n<result>\nHamlet is a tragedy by William Shakespeare.\n</result>\n",
    ]
    path = training_path(example)
    trained = [i for i, m in zip(path.ids, path.mask) if m]
    assert decode(tokenizer, trained) == "<search>Hamlet author</search><answer>Shakespeare</answer><|im_end|>"
    # A chat that stops at a tool result has no end: no end-of-sequence token is added.
    unfinished = chat_example(CHAT[:4], tokenizer)
    assert decode(tokenizer, unfinished.turns[-1].action_ids) == "<search>Hamlet author</search>"
    assert path.mask[: len(example.prompt_ids)] == [0] * len(example.prompt_ids)  # generation prompt included


def test_a_turn_chat_trains_on_the_assistant_content_and_its_end_of_turn_token_only(tokenizer):
    example = chat_example(CHAT, tokenizer, observations="turn")
    full = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert decode(tokenizer, example.ids) == full.removesuffix("\n")  # the text after the last action is dropped
    assert [decode(tokenizer, turn.action_ids) for turn in example.turns] == [
        "<search>Hamlet author</search><|im_end|>",
        "<answer>Shakespeare</answer><|im_end|>",
    ]
    # the template's headers and the tool turn are context, the next generation prompt included
    assert decode(tokenizer, example.turns[1].obs_ids) == (
        "\n<|im_start|>tool\nHamlet is a tragedy by William Shakespeare.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert decode(tokenizer, example.prompt_ids).endswith("<|im_start|>assistant\n")
    assert example.num_action_tokens == sum(training_path(example).mask)


class ReplayedChat(agentenv.Env):
    """An environment that asks CHAT's question and answers each action with CHAT's next tool message."""

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.results = [m["content"] for m in CHAT if m["role"] == "tool"]
        return CHAT[1]["content"], {}

    def step(self, action):
        if self.results:
            return self.results.pop(0), 0.0, False, False, {}
        return "", 1.0, True, False, {}


@pytest.mark.parametrize("observations", ["inline", "turn"])
def test_a_chat_trains_on_the_ids_of_the_episode_tokenenv_lays_out(tokenizer, observations):
    example = chat_example(CHAT, tokenizer, observations=observations)
    env = TokenEnv(
        ReplayedChat(),
        tokenizer,
        observations=observations,
        observation_role="tool",
        system_prompt=CHAT[0]["content"],
    )
    prompt_ids, _ = env.reset()
    assert prompt_ids == example.prompt_ids
    for turn in example.turns:
        env.step(turn.action_ids)
    ids, mask = env.sequence()
    assert (ids, mask) == (example.ids, example.mask)
    assert len(example.turns) == 2 and sum(mask) == example.num_action_tokens


# -- the file: filtering and errors ------------------------------------------------------------------


def write_jsonl(path: Path, records) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records), encoding="utf-8")
    return path


def test_min_reward_keeps_the_good_episodes_and_counts_the_rest(tmp_path, tokenizer):
    records = [a_trajectory(1.0), a_trajectory(0.0), a_trajectory(0.5), a_trajectory(1.0), {"messages": CHAT}]
    empty = a_trajectory(1.0)
    empty.update(ids=[5, 6, 7], mask=[0, 0, 0], sampler_logprobs=[None] * 3, turns=[])  # failed before its first turn
    path = write_jsonl(tmp_path / "t.jsonl", [*records, "", empty])
    data = load_sft_data(path, tokenizer, min_reward=1.0)
    assert [(e.kind, e.reward, e.line) for e in data.examples] == [
        ("trajectory", 1.0, 1),
        ("trajectory", 1.0, 4),
        ("chat", None, 5),  # a chat without a reward is kept
    ]
    assert (data.read, data.trajectories, data.chats, data.below_min_reward, data.without_actions) == (6, 5, 1, 2, 1)
    chat_tokens = data.examples[2].num_action_tokens
    assert data.summary() == (
        f"{path}: read 6 records (5 trajectories, 1 chat); kept 3 ({6 + chat_tokens} action tokens), dropped 3 "
        "(2 below --min-reward 1, 1 without action tokens); best reward 1"
    )
    too_long = load_sft_data(path, tokenizer, max_tokens=7)  # the chat is longer than 7 tokens: dropped, not cut
    assert too_long.too_long == 1 and [e.kind for e in too_long.examples] == ["trajectory"] * 4
    assert too_long.summary().endswith(
        "dropped 2 (1 without action tokens, 1 longer than --max-tokens 7); best reward 1"
    )


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (
            '{"text": "hello"}',
            "line 2: no 'messages' list and no trajectory fields ('ids', 'mask', 'turns'); expected a chat "
            '{"messages": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]} or a '
            "trajectory of `agents eval --save-trajectories` (ids, mask, turns, reward)",
        ),
        ('{"messages": [', "line 2: not JSON (Expecting value at column 15); expected a chat"),
        ("[1, 2]", "line 2: a JSON list, not an object; expected a chat"),
        (
            '{"messages": [{"role": "bot", "content": "hi"}]}',
            "line 2: messages[0] must be an object with a 'role' (system, user, assistant, tool) and a string "
            '\'content\', got {"role": "bot", "content": "hi"}',
        ),
        (
            '{"messages": [{"role": "user", "content": "hi"}]}',
            "line 2: no assistant message, so nothing to train on; a chat needs at least one message with role "
            "'assistant' after the prompt",
        ),
        (
            '{"ids": [1, 2, 3]}',
            "line 2: a trajectory record needs 'ids' and 'mask' (lists of one length, mask 1 on action tokens) "
            "and has no 'mask'",
        ),
        (
            '{"ids": [1, 2, 3], "mask": [0, 1]}',
            "line 2: 'mask' must be a list of 0s and 1s as long as 'ids' (3), got [0, 1]",
        ),
        ('{"ids": [1, -2], "mask": [0, 1]}', "line 2: 'ids' must be a list of token ids (ints >= 0), got [1, -2]"),
        (
            '{"ids": [1, 2], "mask": [0, 1], "reward": "yes"}',
            "line 2: 'reward' must be a finite number or null, got \"yes\"",
        ),
    ],
)
def test_a_bad_line_names_the_file_the_line_and_what_is_expected(tmp_path, tokenizer, line, message):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"messages": CHAT}, line])
    with pytest.raises(SFTDataError) as error:
        load_sft_data(path, tokenizer)
    assert str(error.value).startswith(f"{path} {message}")


def test_nothing_left_after_filtering_says_how_many_were_read_and_the_best_reward(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "t.jsonl", [a_trajectory(0.0), a_trajectory(0.5)])
    with pytest.raises(SFTDataError) as error:
        load_sft_data(path, tokenizer, min_reward=1.0)
    assert str(error.value) == (
        f"{path}: no example left to train on: read 2 records, dropped 2 below --min-reward 1; "
        "the best reward seen is 0.5"
    )
    with pytest.raises(FileNotFoundError) as missing:
        load_sft_data(tmp_path / "none.jsonl", tokenizer)
    assert str(missing.value).startswith(f"{tmp_path / 'none.jsonl'}: no such file; --data takes a JSONL file")


# -- a short run ---------------------------------------------------------------------------------------


def mean_nll(model, paths) -> float:
    """The mean NLL of the paths' action tokens under ``model`` (eq. 80), computed directly."""
    total, count = 0.0, 0
    with torch.no_grad():
        for path in paths:
            ids = torch.tensor([path.ids])
            logprobs = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            scores = logprobs.gather(-1, ids[0, 1:, None])[:, 0]
            mask = torch.tensor(path.mask[1:], dtype=torch.bool)
            total -= float(scores[mask].sum())
            count += int(mask.sum())
    return total / count


async def test_two_steps_lower_the_nll_and_leave_a_loadable_checkpoint(tmp_path, tiny_model, tokenizer):
    records = [
        {"messages": CHAT, "reward": 1.0},
        {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<answer>4</answer>"}]},
        a_trajectory(),
    ]
    data = write_jsonl(tmp_path / "examples.jsonl", records)
    out = tmp_path / "run"
    notes: list[str] = []
    config = SFTConfig(epochs=2, batch_size=3, lr=1e-3, report_to=("none",))
    alien = write_jsonl(tmp_path / "alien.jsonl", [{**a_trajectory(), "ids": [5, 6, 7, 8, 9, 10, 10**6]}])
    with pytest.raises(SFTDataError) as error:
        await sft(alien, tiny_model, out, config, progress=False, log=notes.append)
    assert str(error.value) == (
        f"{alien} line 1: token id 1000000 is outside the model's vocabulary of 259; the trajectories were "
        "written with another model's tokenizer"
    )
    assert not out.exists()
    notes.clear()
    result = await sft(data, tiny_model, out, config, progress=False, log=notes.append)

    assert result.steps == 2 and result.checkpoint == out / "checkpoints" / "step_000002"
    assert result.model_dir.is_dir() and (out / "curves.png").is_file()
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [1, 2] and [r["sft/epoch"] for r in metrics] == [1.0, 2.0]
    assert metrics[1]["policy/loss"] < metrics[0]["policy/loss"]  # the NLL before each update: down
    assert metrics[0]["batch/sequences"] == 3 and metrics[0]["optim/updates"] == 1
    assert metrics[0]["reward/mean"] == pytest.approx(2 / 3)  # the chat's and the trajectory's 1, the other chat's 0
    saved = json.loads((out / "sft.json").read_text())
    assert saved["records"]["kept"] == 3 and saved["config"]["lr"] == 1e-3
    assert notes[0].startswith(f"{data}: read 3 records (1 trajectory, 2 chats); kept 3")
    assert notes[2].startswith("step 1/2 (epoch 1/2): loss ") and notes[-1] == f"step 2: checkpoint {result.checkpoint}"

    paths = [training_path(example) for example in result.data.examples]
    before, after = mean_nll(load_model(tiny_model), paths), mean_nll(load_model(str(result.model_dir)), paths)
    print(f"mean NLL of the training examples' action tokens: {before:.4f} before, {after:.4f} after")
    assert before == pytest.approx(metrics[0]["policy/loss"], rel=1e-5)  # the trainer's loss is eq. 80 too
    assert after < before - 0.1

    with pytest.raises(FileExistsError, match="already holds a run .its newest checkpoint is step_000002"):
        await sft(data, tiny_model, out, config, progress=False, log=notes.append)


# -- the command -----------------------------------------------------------------------------------

# The command's help and errors, in a fresh interpreter: tests/agents/test_cli.py.


def test_the_command_trains_and_prints_the_final_model(tmp_path, tiny_model, capsys):
    data = write_jsonl(tmp_path / "t.jsonl", [{"messages": CHAT}])
    out = tmp_path / "run"
    argv = ["sft", "--data", str(data), "--model", tiny_model, "--out", str(out), "--epochs", "1"]
    assert main([*argv, "--report-to", "none", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert f"final model: {out / 'checkpoints' / 'step_000001' / 'model'}\n" in printed
    assert "held-out" not in printed  # no RL run named: no evaluation
    run = ["--preset", "cpu-demo", "--eval-questions", "1", "--set", "rollout.max_response_tokens=8"]
    again = ["sft", "--data", str(data), "--model", tiny_model, "--out", str(tmp_path / "run2"), "--epochs", "1"]
    assert main([*again, "--report-to", "none", "--no-progress", *run]) == 0
    lines = capsys.readouterr().out.splitlines()
    table = lines.index(
        "=== held-out questions (greedy; never trained on), before and after fine-tuning, 95% intervals"
    )
    assert lines[table + 1].split() == ["held-out", "score", "before", "(step", "0)", "after", "sft", "(step", "1)"]
    assert lines[table + 3].split() == ["questions", "1", "1"]


async def test_the_rl_runs_held_out_questions_are_scored_before_and_after(tmp_path, tiny_model):
    from agents.run.config import resolve

    data = write_jsonl(tmp_path / "t.jsonl", [{"messages": CHAT}])
    out = tmp_path / "run"
    run = resolve(
        preset_name="cpu-demo",
        values={"eval_questions": 2},
        assignments=["sampling.max_new_tokens=8", "rollout.max_response_tokens=16"],
    )
    notes: list[str] = []
    config = SFTConfig(epochs=1, lr=1e-3, report_to=("none",))
    result = await sft(data, tiny_model, out, config, heldout=run, progress=False, log=notes.append)
    assert [(h.step, h.questions) for h in result.heldout] == [(0, 2), (1, 2)]
    records = [json.loads(line) for line in (out / "heldout" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1] and (out / "heldout.png").is_file()
    # Random weights never write the answer format within 16 tokens: every episode is cut by the budget,
    # and scored with the run's budget reward (-1), as agents train scores it.
    assert [h.scores["reward"].mean for h in result.heldout] == [run.budget_reward] * 2 == [-1.0] * 2
    assert notes[2].startswith("step 0: held-out (2 questions of multihop-qa) em 0.000 [0.000, 0.658]")
    assert notes[-1].startswith("step 1: held-out (2 questions of multihop-qa) em 0.000")
