"""The ``agents`` command: argument errors name the problem; ``agents eval`` runs the real model offline."""

import contextlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from agents.cli import build_parser, main
from agents.cli import train as train_cli

ROOT = Path(__file__).resolve().parents[2]


def run_main(capsys, *argv):
    with pytest.raises(SystemExit) as exit_info:
        main(list(argv))
    return exit_info.value.code, capsys.readouterr().err


def test_subcommands_are_listed_and_one_is_required(capsys):
    code, err = run_main(capsys)
    assert code == 2 and "the following arguments are required: COMMAND" in err
    assert "eval" in build_parser().format_help()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--env", "multihop-qa", "--samples", "2"],
            "--samples 2 with greedy decoding repeats one answer; add --temperature 1.0",
        ),
        (["--env", "multihop-qa", "--limit", "0"], "--limit must be >= 1, got 0"),
        (["--env", "multihop-qa", "--concurrency", "0"], "--concurrency must be >= 1, got 0"),
        (
            ["--env", "multihop-qa", "--env-arg", "example"],
            "--env-arg takes KEY=VALUE (e.g. require_boxed=false), got 'example'",
        ),
        (["--env", " , "], "--env needs at least one environment id"),
        (["--env", "multihop-qa,nope-qa"], "No environment registered as 'nope-qa'"),
        (["--env", "multihop-qa", "--engine", "openai"], "--engine openai needs --base-url"),
        (["--env", "multihop-qa", "--model", "/no/such/folder"], "model path '/no/such/folder' is not a directory"),
        (
            ["--env", "multihop-qa", "--judge-model", "m"],
            "--judge-model applies only with --grader judge (the grader is 'em')",
        ),
        (
            ["--env", "multihop-qa", "--judge-model", "m", "--judge-cache", "c.jsonl"],
            "--judge-model, --judge-cache apply only with --grader judge",
        ),
        (["--env", "multihop-qa", "--grader", "judge"], "--grader judge needs --judge-model: a local model"),
        (
            ["--env", "multihop-qa", "--grader", "judge", "--judge-model", "m", "--judge-max-tokens", "0"],
            "--judge-max-tokens must be >= 1, got 0",
        ),
        (
            ["--env", "multihop-qa", "--grader", "judge", "--judge-model", "m", "--judge-timeout", "0"],
            "--judge-timeout must be > 0 seconds, got 0.0",
        ),
        (
            ["--env", "multihop-qa", "--grader", "judge", "--judge-model", "m", "--judge-engine", "openai"],
            "a judge on --judge-engine openai needs --judge-base-url",
        ),
    ],
)
def test_bad_eval_arguments_exit_2_naming_the_problem(capsys, argv, message):
    code, err = run_main(capsys, "eval", *argv)
    assert code == 2
    assert err.startswith("agents eval: error: ") and message in err


def test_an_unknown_engine_is_refused_by_the_parser(capsys):
    code, err = run_main(capsys, "eval", "--env", "multihop-qa", "--engine", "tgi")
    assert code == 2 and "invalid choice: 'tgi'" in err
    code, err = run_main(capsys, "eval", "--env", "multihop-qa", "--grader", "llm")
    assert code == 2 and "argument --grader: invalid choice: 'llm' (choose from 'em', 'judge')" in err


# -- a fast command line: help, version, errors before anything loads -----------------------------

PROBE = """
import contextlib, io, json, sys
from agents.cli import main
out, err = io.StringIO(), io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
    try:
        code = main(sys.argv[1:])
    except SystemExit as exited:
        code = exited.code
print(json.dumps({"code": code, "out": out.getvalue(), "err": err.getvalue(),
                  "loaded": sorted({name.split(".")[0] for name in sys.modules})}))
"""


def probe(*argv):
    """``agents ARGV`` in a fresh interpreter: its exit code, output, and the top-level modules it loaded."""
    result = subprocess.run([sys.executable, "-c", PROBE, *argv], cwd=ROOT, capture_output=True, text=True, check=True)
    return json.loads(result.stdout)


@pytest.mark.parametrize(
    ("argv", "heavy"),
    [
        (["--help"], {"torch", "transformers", "agentenv"}),
        (["--version"], {"torch", "transformers", "agentenv"}),
        (["train", "--help"], {"torch", "transformers", "agentenv"}),
        (["eval", "--help"], {"torch", "transformers"}),  # its defaults live beside the environments
    ],
)
def test_help_and_version_answer_without_loading_torch(argv, heavy):
    result = probe(*argv)
    assert result["code"] == 0 and result["out"].startswith(("usage: agents", "agents "))
    assert heavy.isdisjoint(result["loaded"]), sorted(heavy & set(result["loaded"]))


def test_an_unknown_env_is_reported_before_anything_loads_or_is_written(tmp_path):
    result = probe("train", "--env", "nope-qa", "--out", str(tmp_path / "run"))
    assert result["code"] == 2 and result["err"].count("\n") == 1
    assert (
        result["err"].startswith("agents train: error: ") and "No environment registered as 'nope-qa'" in result["err"]
    )
    assert {"torch", "transformers"}.isdisjoint(result["loaded"])
    assert not (tmp_path / "run").exists()


def test_both_commands_print_their_version(capsys):
    from agentenv.__main__ import main as agentenv_main

    installed = importlib.metadata.version("agentenv")
    for name, command in (("agents", main), ("agentenv", agentenv_main)):
        with pytest.raises(SystemExit) as exited:
            command(["--version"])
        assert exited.value.code == 0 and capsys.readouterr().out == f"{name} {installed}\n"


def test_train_help_shows_the_defaults_and_names_every_learner(capsys, monkeypatch):
    from agents.learners import LEARNERS

    monkeypatch.setenv("COLUMNS", "400")  # no wrapped lines (textwrap would break cpu-demo at its hyphen)
    with pytest.raises(SystemExit) as exited:
        main(["train", "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    for expected in (
        f"--algo NAME The learner ({', '.join(LEARNERS)}), or the name of a learner passed to train directly "
        "(default at2po).",
        "--steps STEPS Rollout batches to train on (default 100; --preset cpu-demo: 3; --preset cpu-arithmetic: 12).",
        "--holdout HOLDOUT The env's first holdout tasks are never trained on; evaluation uses them "
        "(default 100; --preset cpu-demo: 50; --preset cpu-arithmetic: 500).",
        "--eval-before, --no-eval-before Evaluate before the first step (step 0);",
        "--eval-at-tokens EVAL_AT_TOKENS [EVAL_AT_TOKENS ...] Also evaluate after the step",
        "--keep-checkpoints N Keep the newest this many intact checkpoints,",
        "always stays (default 2).",
        "--ray-address ADDRESS local starts Ray on this machine",
        "--placement {colocated,split} colocated or split",
    ):
        assert expected in text, expected


def test_every_train_flag_sets_a_config_field_or_is_one_of_the_command_s_own():
    """The fitness check of agents train's parser: each top-level TrainConfig field has a flag, generated from
    the config classes, and the flags written by hand are the command's own or the trainer section's two."""
    import dataclasses

    from agents.run.config import SECTIONS, TrainConfig

    parser = build_parser(["train"])
    (train,) = (action.choices["train"] for action in parser._subparsers._group_actions)
    dests = {action.dest for action in train._actions} - {"help"}
    fields = {field.name for field in dataclasses.fields(TrainConfig)} - set(SECTIONS)
    cluster = {dest for dest in dests if dest.startswith("cluster.")}
    own = {"preset", "config", "assignments", "out", "report_to", "wandb_project", "resume", "print_config", "plan"}
    own |= {"device_memory", "no_progress"}
    assert fields <= dests, sorted(fields - dests)
    assert dests - fields - cluster == own
    assert cluster == {f"cluster.{name}" for name in train_cli._CLUSTER_FIELDS}


@pytest.mark.parametrize(
    ("argv", "start"),
    [
        (
            ["eval", "--env", "multihop-qa", "--model", "/no/such/folder", "--env-arg", "topk=0"],
            "agents eval: error: multihop-qa with the options topk=0 (from --env-arg): ",  # before the model
        ),
        (
            ["eval", "--env", "multihop-qa", "--env-arg", "colour=1"],
            "agents eval: error: multihop-qa with the options colour=1 (from --env-arg): ",
        ),
        (
            ["train", "--set", "env_kwargs.colour=1", "--print-config"],
            "agents train: error: multihop-qa with the options colour=1 "
            "(from env_kwargs: --preset, --config or --set env_kwargs.NAME): ",
        ),
        (
            ["train", "--preset", "cpu-demo", "--set", "env_kwargs.topk=0", "--print-config"],
            "agents train: error: multihop-qa with the options reward='at2po', max_tool_calls=2, topk=0, "
            "result_chars=300, example=True, require_boxed=False (from env_kwargs: --preset, --config or --set ",
        ),
        (
            ["train", "--set", "trainer.nope=1", "--print-config"],
            "agents train: error: trainer has no setting 'nope'; the settings are lr, ",
        ),
        (
            ["train", "--set", "trainer.lr", "--print-config"],
            "agents train: error: --set takes KEY=VALUE (e.g. trainer.lr=1e-5), got 'trainer.lr'",
        ),
        (
            ["train", "--algo", "ppo", "--print-config"],
            "agents train: error: unknown algo 'ppo'; choose one of at2po, aepo, grpo, tree-grpo, arpo, "
            "or pass your own learner to agents.run.train.train",
        ),
    ],
)
def test_user_errors_are_one_line_with_the_value_given_and_exit_2(capsys, argv, start):
    code, err = run_main(capsys, *argv)
    assert code == 2 and err.startswith(start), err
    assert err.count("\n") == 1  # one line, no traceback


def test_train_without_a_preset_on_a_cpu_warns_what_the_papers_budget_costs(capsys, monkeypatch, tmp_path):
    import torch

    import agents.run.train

    runs = []

    async def recorded_train(config, out, **options):  # what the command would train, without training it
        runs.append(config)
        return agents.run.train.TrainResult(Path(out), config, 0, None)

    monkeypatch.setattr(agents.run.train, "train", recorded_train)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["train", "--out", str(tmp_path / "papers"), "--no-progress"]) == 0
    assert capsys.readouterr().err == (
        "warning: no --preset and no GPU here, so this is the papers' budget on the CPU: 100 steps of 64 prompts, "
        "6,400 rollout trees (1,067x the 6 of --preset cpu-demo, which take minutes on two cores), responses of up "
        "to 6192 tokens (24x the demo's 256) and 100 held-out questions before and after. For a first run add "
        "--preset cpu-demo; --print-config shows every value\n"
    )
    assert main(["train", "--preset", "cpu-demo", "--out", str(tmp_path / "demo"), "--no-progress"]) == 0
    assert capsys.readouterr().err == "" and [config.steps for config in runs] == [100, 3]


def test_keep_checkpoints_takes_a_count_or_all(capsys):
    for flags, kept in (([], 2), (["--keep-checkpoints", "1"], 1), (["--keep-checkpoints", "all"], None)):
        assert main(["train", "--algo", "grpo", *flags, "--print-config"]) == 0
        assert json.loads(capsys.readouterr().out)["keep_checkpoints"] == kept
    code, err = run_main(capsys, "train", "--keep-checkpoints", "0")
    assert code == 2 and err.endswith(
        "argument --keep-checkpoints: takes a number >= 1 (the newest checkpoint always stays) or 'all', got '0'\n"
    )


@pytest.mark.slow
def test_agents_eval_runs_the_embedded_model_offline_and_saves_exact_trajectories(tmp_path):
    """The real command, end to end: a transcript and the table, JSON results, JSONL trajectories
    whose sampler log-probs a fresh forward pass of the model reproduces."""
    import torch

    from agents.models import load_model

    results, saved = tmp_path / "results.json", tmp_path / "trajectories.jsonl"
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "agents",
            "eval",
            "--env",
            "multihop-qa",
            "--model",
            "smollm2-135m",
            "--limit",
            "2",
            "--max-new-tokens",
            "12",
            "--max-response-tokens",
            "40",
            "--concurrency",
            "2",
            "--no-progress",
            "--json",
            str(results),
            "--save-trajectories",
            str(saved),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.startswith("=== transcript: multihop-qa question 0 sample 0\n--- prompt (")
    assert "--- turn 1: model (" in out
    table_head = next(line for line in out.splitlines() if line.startswith("env "))
    assert table_head.split()[:6] == ["env", "questions", "EM", "%", "F1", "%"]
    assert f"results written to {results}" in out and f"2 trajectories written to {saved}" in out

    report = json.loads(results.read_text())
    assert (report["model"], report["engine"], report["envs"], report["limit"]) == (
        "smollm2-135m",
        "hf",
        ["multihop-qa"],
        2,
    )
    assert report["results"]["multihop-qa"]["questions"] == 2 and report["sampling"]["temperature"] == 0
    assert [q["index"] for q in report["questions"]] == [0, 1]

    records = [json.loads(line) for line in saved.read_text().splitlines()]
    assert sorted(tuple(r["key"]) for r in records) == [("multihop-qa", 0, 0), ("multihop-qa", 1, 0)]
    model = load_model("smollm2-135m")
    for record in records:
        ids, mask, logprobs = record["ids"], record["mask"], record["sampler_logprobs"]
        assert len(ids) == len(mask) == len(logprobs) and record["text"].startswith("<|im_start|>system")
        assert record["question"] and record["answers"] and record["status"] in ("terminated", "truncated", "budget")
        assert [lp is None for lp in logprobs] == [m == 0 for m in mask] and sum(mask) > 0
        prompt = mask.index(1)
        assert sum(1 for m in mask[prompt:] if m == 0) + sum(mask) <= 40  # the response budget
        with torch.no_grad():
            fresh = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
        positions = [t for t, m in enumerate(mask) if m]
        recomputed = fresh[torch.tensor(positions) - 1, torch.tensor([ids[t] for t in positions])]
        sampled = torch.tensor([logprobs[t] for t in positions])
        assert (recomputed - sampled).abs().max().item() <= 1e-3


@contextlib.contextmanager
def answering_server(answer):
    """An OpenAI-compatible completions server on 127.0.0.1 that answers every request with the ids
    ``answer``; yields its port and the list of request bodies it received."""
    import asyncio
    import threading

    from aiohttp import web

    requests = []

    async def completions(request):
        body = await request.json()
        requests.append(body)
        return web.json_response(
            {
                "choices": [
                    {
                        "token_ids": answer,
                        "finish_reason": "stop",
                        "stop_reason": None,
                        "logprobs": {"token_logprobs": [-0.25] * len(answer), "top_logprobs": None},
                    }
                ]
            }
        )

    loop = asyncio.new_event_loop()
    app = web.Application()
    app.router.add_post("/v1/completions", completions)
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        yield port, requests
    finally:
        asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result()
        loop.call_soon_threadsafe(loop.stop)
        thread.join()


@pytest.mark.slow  # the real SmolLM2 tokenizer
def test_agents_eval_talks_to_an_openai_compatible_server(tmp_path, capsys):
    """--engine openai against a server on 127.0.0.1 that answers every request with one final answer."""
    from agents.models import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    answer = tok.encode("<answer> \\boxed{Chief of Protocol} </answer>", add_special_tokens=False) + [tok.eos_token_id]
    with answering_server(answer) as (port, requests):
        saved = tmp_path / "t.jsonl"
        code = main(
            [
                "eval",
                "--env",
                "multihop-qa",
                "--engine",
                "openai",
                "--base-url",
                f"http://127.0.0.1:{port}",
                "--model",
                "smollm2-135m",
                "--limit",
                "2",
                "--no-progress",
                "--save-trajectories",
                str(saved),
                "--env-arg",
                "example=true",
                "--env-arg",
                "require_boxed=false",
            ]
        )
    out = capsys.readouterr().out
    assert code == 0
    assert out.splitlines()[-2].split()[:4] == ["multihop-qa", "2", "50.00", "50.00"]  # question 0's gold answer
    assert len(requests) == 2 and {r["model"] for r in requests} == {"smollm2-135m"}
    prompt = tok.decode(requests[0]["prompt"])  # the --env-arg options reached the env
    assert "Example:\nQuestion: In which country" in prompt and "for example <answer> Beijing </answer>" in prompt
    assert all(r["stop"] == ["</search>"] and r["temperature"] == 0 and r["max_tokens"] == 512 for r in requests)
    records = [json.loads(line) for line in saved.read_text().splitlines()]
    assert sorted(r["ids"][-len(answer) :] == answer for r in records) == [True, True]
    assert all(r["sampler_logprobs"][-len(answer) :] == [-0.25] * len(answer) for r in records)


@pytest.mark.slow  # the real SmolLM2-135M as the judge: one short greedy generation on CPU
def test_agents_eval_grader_judge_asks_the_embedded_model_and_reports_what_it_did(tmp_path, capsys):
    """A served policy that always answers "Chief of Protocol" (question 0's gold, not question 1's)
    and --grader judge with the embedded model on --judge-engine hf: question 0 is identical to its
    gold (no call), question 1 costs one judge generation."""
    from agentenv.judge import parse_verdict
    from agents.models import load_tokenizer

    tok = load_tokenizer("smollm2-135m")
    answer = tok.encode("<answer> \\boxed{Chief of Protocol} </answer>", add_special_tokens=False) + [tok.eos_token_id]
    results, saved, cache = tmp_path / "r.json", tmp_path / "t.jsonl", tmp_path / "verdicts.jsonl"
    argv = [
        "eval",
        "--env",
        "multihop-qa",
        "--limit",
        "2",
        "--no-progress",
        "--grader",
        "judge",
        "--judge-model",
        "smollm2-135m",
        "--judge-engine",
        "hf",
        "--judge-max-tokens",
        "6",
        "--judge-cache",
        str(cache),
        "--json",
        str(results),
        "--save-trajectories",
        str(saved),
    ]
    with answering_server(answer) as (port, requests):
        argv += ["--engine", "openai", "--base-url", f"http://127.0.0.1:{port}", "--model", "smollm2-135m"]
        code = main(argv)
    out = capsys.readouterr().out
    assert code == 0 and len(requests) == 2
    report = json.loads(results.read_text())
    judge = report["judge"]
    assert report["grader"] == "judge" and judge["model"] == "smollm2-135m"
    assert (judge["requests"], judge["exact"], judge["calls"], judge["failed_calls"]) == (2, 1, 1, 0)
    assert 0 < judge["completion_tokens"] <= 6 and judge["prompt_tokens"] > 100
    records = {tuple(r["key"]): r for r in map(json.loads, saved.read_text().splitlines())}
    first, second = records[("multihop-qa", 0, 0)]["judge"], records[("multihop-qa", 1, 0)]["judge"]
    assert first == {
        "verdict": "correct",
        "source": "exact",
        "reply": None,
        "detail": "identical to a gold answer",
        "cached": False,
    }
    # The embedded model's reply, read by ARPO's rule; whatever it said, it is accounted for.
    assert second["source"] == "judge" and (second["verdict"], second["detail"]) == parse_verdict(second["reply"])
    metrics = report["results"]["multihop-qa"]
    assert metrics["unjudged"] == (second["verdict"] == "unjudged")
    assert metrics["judge"] == (1.0 + (second["verdict"] == "correct")) / (2 - metrics["unjudged"])
    assert (
        "judge smollm2-135m: 2 answers; 1 model calls (0 failed), 0 from the cache, 1 identical to a gold answer" in out
    )
    assert len(cache.read_text().splitlines()) == (second["verdict"] != "unjudged")


def test_sft_help_lists_the_flags_without_loading_torch():
    result = probe("sft", "--help")
    assert result["code"] == 0 and result["out"].startswith("usage: agents sft")
    for flag in ("--data", "--model", "--out", "--min-reward", "--epochs", "--lr", "--batch-size", "--max-tokens"):
        assert flag in result["out"]
    assert "--seed" in result["out"] and "(default 2)" in result["out"]
    assert {"torch", "transformers"}.isdisjoint(result["loaded"])
    assert "sft" in probe("--help")["out"]


def test_a_missing_data_file_exits_2_in_one_line(tmp_path):
    result = probe("sft", "--data", str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "run"))
    assert result["code"] == 2 and result["err"].count("\n") == 1
    assert result["err"] == (
        f"agents sft: error: --data {tmp_path / 'none.jsonl'}: no such file (a JSONL file of trajectories from "
        "agents eval --save-trajectories, or of chats)\n"
    )
    assert {"torch", "transformers"}.isdisjoint(result["loaded"]) and not (tmp_path / "run").exists()


def test_a_bad_sft_setting_exits_2_in_one_line(tmp_path):
    data = tmp_path / "t.jsonl"
    data.write_text('{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}\n')
    result = probe("sft", "--data", str(data), "--out", str(tmp_path / "x"), "--batch-size", "0")
    assert result["code"] == 2
    assert result["err"] == "agents sft: error: SFTConfig.batch_size must be an int >= 1, got 0\n"
