"""Demonstrations for the cold start: training tasks played with the env's demo actions, kept when grounded."""

import json

import pytest

import agentenv
from agentenv.graders import normalize_answer
from agents.cli import main
from agents.models import load_tokenizer
from agents.sft.demonstrations import DemonstrationCounts, demonstration, write_demonstrations
from agents.sft.train import load_sft_data

#: The cpu-demo's tool settings with Search-R1's plain answer: the top passage, 300 characters.
ENV_KWARGS = {"reward": "at2po", "max_tool_calls": 2, "topk": 1, "result_chars": 300, "require_boxed": False}


def test_a_demonstration_searches_the_question_and_answers_with_the_gold_answer():
    env = agentenv.make("multihop-qa", **ENV_KWARGS)
    record = demonstration(env, 54)
    task = env.unwrapped.tasks[54]
    prompt = env.reset(options={"index": 54})[0]
    assert [m["role"] for m in record["messages"]] == ["user", "assistant", "tool", "assistant"]
    user, search, result, answer = (m["content"] for m in record["messages"])
    assert user == prompt  # the prompt RL poses for this task
    assert search == f"<think>I will use search.</think>\n<search>{task.question}</search>"
    assert result.startswith("Page 1: Teen Titans Go! (TV series)\n")
    assert answer == "<answer> Teen Titans Go! </answer>" == f"<answer> {task.answers[0]} </answer>"
    assert (record["reward"], record["index"], record["id"], record["grounded"]) == (1.0, 54, task.id, True)
    # Task 0's search does not return its answer ("Chief of Protocol"): right, but not grounded.
    missed = demonstration(env, 0)
    assert (missed["reward"], missed["grounded"]) == (1.0, False)
    assert "protocol" not in missed["messages"][2]["content"].lower()


def test_only_grounded_demonstrations_of_training_tasks_are_written(tmp_path):
    path = tmp_path / "demos.jsonl"
    counts = write_demonstrations("multihop-qa", path, env_kwargs=ENV_KWARGS, holdout=50, limit=20)
    assert counts == DemonstrationCounts(tasks=20, written=7, not_grounded=13)
    assert counts.summary() == (
        "7 demonstrations of 20 training tasks; 13 dropped because their tools did not return the answer"
    )
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["index"] for r in records] == [54, 56, 57, 62, 65, 68, 69]  # all past the 50 held out
    for record in records:
        result, answer = record["messages"][2]["content"], record["messages"][3]["content"]
        gold = answer.removeprefix("<answer> ").removesuffix(" </answer>")
        assert f" {normalize_answer(gold)} " in f" {normalize_answer(result)} " and record["reward"] == 1.0
        assert "grounded" not in record


@pytest.mark.slow  # the real SmolLM2 tokenizer
def test_agents_sft_reads_them_as_chats_with_the_answer_and_search_trained_on(tmp_path):
    path = tmp_path / "demos.jsonl"
    write_demonstrations("multihop-qa", path, env_kwargs=ENV_KWARGS, holdout=50, limit=20)
    tokenizer = load_tokenizer("smollm2-135m")
    data = load_sft_data(path, tokenizer)
    assert len(data.examples) == 7
    example = data.examples[0]
    actions = [tokenizer.decode(turn.action_ids) for turn in example.turns]
    assert actions == [
        "<think>I will use search.</think>\n<search>Which of Tara Strong major voice role in animated series is an "
        'American animated television series based on the DC Comics fictional superhero team, the "Teen Titans"?'
        "</search>",
        "<answer> Teen Titans Go! </answer><|im_end|>",  # and the model stops
    ]
    assert tokenizer.decode(example.turns[1].obs_ids).startswith("\n<result>\nPage 1: Teen Titans Go! (TV series)\n")


def test_bad_requests_say_what_was_wrong(tmp_path):
    with pytest.raises(ValueError, match="holdout=500 keeps all 500 tasks of multihop-qa for evaluation"):
        write_demonstrations("multihop-qa", tmp_path / "d.jsonl", holdout=500)
    with pytest.raises(ValueError, match="limit must be a positive number of tasks .* got 0"):
        write_demonstrations("multihop-qa", tmp_path / "d.jsonl", limit=0)

    class NoDemo:
        unwrapped = object()

    with pytest.raises(TypeError, match="object has no demo_actions"):
        demonstration(NoDemo(), 0)


def test_the_command_takes_the_rl_runs_env_options_and_holdout(tmp_path, capsys):
    out = tmp_path / "demos.jsonl"
    preset = ["--preset", "cpu-demo"]
    code = main(["demonstrations", *preset, "--limit", "20", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    assert printed.splitlines() == [
        f"7 demonstrations of 20 training tasks; 13 dropped because their tools did not return the answer; "
        f"written to {out}",
        f"fine-tune on them: agents sft --data {out} --out RUN ...",
    ]
    first = json.loads(out.read_text().splitlines()[0])
    assert first["index"] == 54  # the preset holds out 50
    assert "Example:\nQuestion: In which country" in first["messages"][0]["content"]  # its example=True
    # agents train's settings, as agents train takes them: --set reaches the env's options.
    assert (
        main(["demonstrations", *preset, "--set", "env_kwargs.example=false", "--limit", "5", "--out", str(out)]) == 0
    )
    assert "Example:" not in json.loads(out.read_text().splitlines()[0])["messages"][0]["content"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        main(["demonstrations", "--set", "env_kwargs.topk=0", "--out", str(out)])
    assert exit_info.value.code == 2
    assert "topk" in capsys.readouterr().err
