"""The training loop on a tiny random Llama with a byte-level tokenizer: task order, learning, resume, folders.

The model is a real transformers checkpoint on disk (2 layers, 259-token byte vocabulary), so
the run goes through the same code as with a real model: HFEngine sharing the trainer's model,
rollout trees, credit, trainer steps, checkpoints and held-out evaluation.
"""

import dataclasses
import itertools
import json
import re
import struct
import zipfile

import pytest
import torch
from safetensors.torch import load_file

import agentenv
from agents.cli import main
from agents.learners import AEPO, GRPOCredit, Learner
from agents.models import ModelNotAvailableError
from agents.rollout.strategies import Chain
from agents.run.config import TrainConfig, merge
from agents.run.steps import rollout_seed
from agents.run.task_order import TaskOrder
from agents.run.train import train
from agents.training.checkpoint import verify_checkpoint
from agents.training.metrics import read_jsonl


class Letters(agentenv.Env):
    """``turns`` turns; the reward at the end is the fraction of all answered characters that are a-z.

    A random byte-level model writes a letter about one time in ten, so rewards differ within a group.
    With ``signal_every`` k > 0 only the tasks (seeds) divisible by k are scored so; the others pay 0.5
    whatever is said, so their groups have no signal.
    """

    def __init__(self, turns: int = 1, signal_every: int = 0, render_mode=None):
        super().__init__(render_mode=render_mode)
        self.turns, self.signal_every = turns, signal_every

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.said = []
        self.flat = bool(self.signal_every) and seed % self.signal_every != 0
        return "Write letters.", {}

    def step(self, action):
        self.said.append(action)
        text = "".join(self.said)
        done = len(self.said) == self.turns
        letters = sum("a" <= ch <= "z" for ch in text)
        score = 0.5 if self.flat else letters / max(1, len(text))
        return "", score if done else 0.0, done, False, {}


@pytest.fixture(scope="module", autouse=True)
def letters(module_envs):
    module_envs("train-tests/letters-v0", Letters)


def letters_config(model: str, **changes) -> TrainConfig:
    """GRPO on letters: 2 prompts × 6 chains of 6 tokens per step, a learning rate for a tiny model."""
    values = merge(
        TrainConfig(algo="grpo").to_dict(),
        {
            "env": "train-tests/letters",
            "model": model,
            "steps": 2,
            "prompts_per_step": 2,
            "holdout": 4,
            "eval_questions": 4,
            "checkpoint_every": 1,
            "strategy": changes.pop("strategy", {"n": 6}),
            "trainer": {"lr": 3e-2, "mini_batches": 1, "micro_batch_size": 12, "report_to": ["none"]},
            "sampling": {"max_new_tokens": 6},
            "rollout": {"max_response_tokens": 6},
            "loss": {"kl_coef": 0.0},
        },
    )
    return TrainConfig.from_dict(merge(values, changes))


# -- task order -------------------------------------------------------------------------------


def test_task_order_trains_on_a_fresh_permutation_of_the_tasks_after_the_held_out_ones_each_epoch():
    order = TaskOrder(tasks=7, holdout=3, seed=0)
    first = order.take(3) + order.take(1)
    assert sorted(first) == [3, 4, 5, 6]  # one epoch: every training task once, none held out
    assert order.position() == {"epoch": 1, "offset": 0}
    second = order.take(4)
    assert sorted(second) == [3, 4, 5, 6] and second != first  # a new permutation
    again = TaskOrder(tasks=7, holdout=3, seed=0)
    assert again.take(4) == first and again.take(4) == second  # the seed fixes the order
    assert TaskOrder(tasks=7, holdout=3, seed=1).take(4) != first


def test_task_order_crosses_epochs_and_resumes_from_its_position():
    order = TaskOrder(tasks=5, holdout=1, seed=3)
    taken = order.take(3)
    position = order.position()
    rest = order.take(6)  # 1 left in epoch 0, then 4 of epoch 1, then 1 of epoch 2
    assert position == {"epoch": 0, "offset": 3} and order.position() == {"epoch": 2, "offset": 1}
    assert sorted(taken + rest[:1]) == [1, 2, 3, 4] and sorted(rest[1:5]) == [1, 2, 3, 4]
    resumed = TaskOrder(tasks=5, holdout=1, seed=3, **position)
    assert resumed.take(6) == rest


def test_task_order_without_a_task_list_counts_seeds_past_the_held_out_ones():
    order = TaskOrder(tasks=None, holdout=10, seed=0)
    assert order.take(3) == [10, 11, 12] and order.take(2) == [13, 14]
    assert order.position() == {"epoch": 0, "offset": 5}
    with pytest.raises(ValueError, match="has 5 tasks and holdout=5 keeps them all"):
        TaskOrder(tasks=5, holdout=5, seed=0)


def test_rollout_seeds_differ_per_step_and_repeat_per_run():
    assert rollout_seed(0, 1) == rollout_seed(0, 1)
    assert len({rollout_seed(0, step) for step in range(1, 50)} | {rollout_seed(1, 1)}) == 50


# -- the loop ---------------------------------------------------------------------------------


async def test_training_raises_the_reward_and_writes_the_run_folder(tiny_model, tmp_path):
    notes = []
    result = await train(
        letters_config(tiny_model, steps=6, checkpoint_every=3, eval_every=3),
        tmp_path / "run",
        progress=False,
        log=notes.append,
    )

    rewards = [record["reward/mean"] for record in result.history]
    heldout = [h.scores["reward"].mean for h in result.heldout]
    assert len(rewards) == 6 and sum(rewards[3:]) > 1.5 * sum(rewards[:3]) > 0, rewards  # more letters as it trains
    assert [h.step for h in result.heldout] == [0, 3, 6]
    assert heldout[2] > heldout[0] + 0.3, heldout  # greedy answers on held-out prompts too
    run = tmp_path / "run"
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000003", "step_000006"]
    assert result.checkpoint == run / "checkpoints" / "step_000006" and result.steps == 6
    assert (run / "checkpoints" / "step_000006" / "model" / "config.json").is_file()  # a transformers checkpoint
    state = json.loads((run / "checkpoints" / "step_000006" / "trainer_state.json").read_text())
    assert state["data_position"] == {"epoch": 0, "offset": 12}  # seeds 4 … 15: 6 steps × 2 prompts
    assert [r["step"] for r in read_jsonl(run / "metrics.jsonl")] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in read_jsonl(run / "heldout" / "metrics.jsonl")] == [0, 3, 6]
    for image in ("curves.png", "heldout.png"):
        assert (run / image).read_bytes()[:4] == b"\x89PNG"
    saved = json.loads((run / "config.json").read_text())
    assert saved["strategy"] == {"n": 6} and saved["trainer"]["lr"] == 3e-2 and saved["algo"] == "grpo"
    record = result.history[0]
    assert record["tree/leaves_per_prompt"] == 6 and record["batch/sequences"] == 12
    assert record["tokens/generated"] == record["tokens/action"] and record["time/rollout_s"] > 0
    assert any(note.startswith("step 3: checkpoint") for note in notes)


async def test_resume_continues_with_the_same_tasks_seeds_and_weights(tiny_model, tmp_path):
    straight = await train(
        letters_config(tiny_model, steps=3, eval_questions=0), tmp_path / "a", progress=False, log=lambda note: None
    )
    await train(
        letters_config(tiny_model, steps=2, eval_questions=0), tmp_path / "b", progress=False, log=lambda note: None
    )
    notes = []
    resumed = await train(
        letters_config(tiny_model, steps=3, eval_questions=0),
        tmp_path / "b",
        resume=True,
        progress=False,
        log=notes.append,
    )

    assert notes[0].startswith(f"resumed {tmp_path / 'b'} at step 2")
    assert resumed.steps == 3 and [r["step"] for r in resumed.history] == [1, 2, 3]
    same = ("reward/mean", "reward/std", "tokens/generated", "tokens/trained", "policy/loss", "optim/grad_norm")
    for name in same:
        assert resumed.history[-1][name] == straight.history[-1][name], name
    weights_a = load_file(tmp_path / "a" / "checkpoints" / "step_000003" / "model" / "model.safetensors")
    weights_b = load_file(tmp_path / "b" / "checkpoints" / "step_000003" / "model" / "model.safetensors")
    assert weights_a.keys() == weights_b.keys()
    assert all(torch.equal(weights_a[name], weights_b[name]) for name in weights_a)


async def test_resume_refuses_a_changed_run_and_a_new_run_refuses_a_used_folder(tiny_model, tmp_path):
    config = letters_config(tiny_model, steps=1, eval_questions=0)
    await train(config, tmp_path, progress=False, log=lambda note: None)
    with pytest.raises(
        FileExistsError,
        match=re.escape(
            "already holds a training run (its newest checkpoint is step_000001); continue it with --resume"
        ),
    ):
        await train(config, tmp_path, progress=False)
    changed = letters_config(tiny_model, steps=2, eval_questions=0, trainer={"lr": 1e-3})
    with pytest.raises(ValueError, match="these settings differ from it: trainer.lr; drop them"):
        await train(changed, tmp_path, resume=True, progress=False)
    # How the update is split in memory may change (a run out of memory resumes with smaller micro-batches).
    smaller = letters_config(tiny_model, steps=2, eval_questions=0, trainer={"micro_batch_tokens": 64})
    assert (await train(smaller, tmp_path, resume=True, progress=False, log=lambda note: None)).steps == 2
    # So may how many episodes roll out at once (a run out of memory during its rollouts resumes with fewer).
    fewer = letters_config(tiny_model, steps=3, eval_questions=0, rollout={"concurrency": 1})
    assert (await train(fewer, tmp_path, resume=True, progress=False, log=lambda note: None)).steps == 3
    with pytest.raises(FileNotFoundError, match="holds no checkpoint to resume from"):
        await train(config, tmp_path / "empty", resume=True, progress=False)
    with pytest.raises(
        ValueError, match="trained with algo 'grpo', but this run asks for 'at2po'; the algorithm differs"
    ):
        await train(dataclasses.replace(config, algo="at2po"), tmp_path, resume=True, progress=False)


def test_agents_train_resume_with_another_algo_names_both_and_the_fix(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(TrainConfig(algo="grpo").to_dict()))
    with pytest.raises(SystemExit) as exited:
        main(["train", "--out", str(tmp_path), "--resume", "--algo", "at2po", "--no-progress"])
    assert exited.value.code == 2
    error = capsys.readouterr().err
    assert f"--resume continues the run in {tmp_path}, trained with algo 'grpo', but this run asks for 'at2po'" in error
    assert "resume with --algo grpo (or without --algo), or train the other algorithm in a new run folder" in error


def damage_pickle(archive):
    """Overwrite the pickle of a torch.save archive, its directory intact: only torch.load notices."""
    data = bytearray(archive.read_bytes())
    info = next(i for i in zipfile.ZipFile(archive).infolist() if i.filename.endswith("data.pkl"))
    name_length, extra_length = struct.unpack("<HH", data[info.header_offset + 26 : info.header_offset + 30])
    start = info.header_offset + 30 + name_length + extra_length
    data[start : start + info.file_size] = b"X" * info.file_size
    archive.write_bytes(bytes(data))


async def test_resume_falls_back_past_damaged_checkpoints_and_continues_exactly(tiny_model, tmp_path):
    config = letters_config(tiny_model, steps=3, eval_questions=0, keep_checkpoints=None)  # all three to damage
    await train(config, tmp_path, progress=False, log=lambda note: None)
    checkpoints = tmp_path / "checkpoints"
    straight = load_file(checkpoints / "step_000003" / "model" / "model.safetensors")
    (checkpoints / "step_000003" / "model" / "config.json").write_text("{")  # the checks before loading see it
    damage_pickle(checkpoints / "step_000002" / "trainer_state.pt")  # only loading sees it
    (checkpoints / ".step_000004.writing").mkdir()  # what an interrupted save of an older version left
    (checkpoints / ".step_000004.writing" / "__0_0.distcp").write_bytes(b"x" * 1000)

    notes = []
    resumed = await train(config, tmp_path, resume=True, progress=False, log=notes.append)

    assert notes[0] == (
        f"removed {checkpoints / '.step_000004.writing'}, the temporary folder of a checkpoint save that was interrupted"
    )
    assert notes[1].startswith(
        f"--resume skips checkpoint {checkpoints / 'step_000003'}: "
        f"{checkpoints / 'step_000003' / 'model' / 'config.json'} is corrupt (it is not valid JSON ("
    )
    assert notes[2].startswith(
        f"--resume skips checkpoint {checkpoints / 'step_000002'}: "
        f"{checkpoints / 'step_000002' / 'trainer_state.pt'} is corrupt (torch.load failed ("
    )
    assert notes[1].endswith("; trying the one before it") and notes[2].endswith("; trying the one before it")
    assert notes[3] == f"resumed {tmp_path} at step 1 from {checkpoints / 'step_000001'}"
    assert resumed.steps == 3 and [r["step"] for r in resumed.history] == [1, 2, 3]
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step_000001", "step_000002", "step_000003"]
    for step in (2, 3):  # written again, whole
        verify_checkpoint(checkpoints / f"step_00000{step}")
    again = load_file(checkpoints / "step_000003" / "model" / "model.safetensors")
    assert all(torch.equal(again[name], straight[name]) for name in straight)


async def test_a_learner_of_your_own_trains_through_the_same_loop(tiny_model, tmp_path):
    calls = []

    def sign_credit(trees):
        """Advantage +1 for a leaf above the prompt's median reward, −1 below, 0 at it."""
        leaves = [leaf for tree in trees for leaf in tree.leaves()]
        median = sorted(leaf.reward for leaf in leaves)[len(leaves) // 2]
        for leaf in leaves:
            leaf.advantage = float((leaf.reward > median) - (leaf.reward < median))
        calls.append(len(leaves))
        return [path for tree in trees for path in tree.paths(advantage="leaf")]

    def plain_pg_loss(logprobs, old_logprobs, advantages, mask):
        """REINFORCE: −A·log π averaged over action tokens."""
        loss = -(advantages * logprobs * mask).sum() / mask.sum()
        return loss, {"reinforce": loss.item()}

    mine = Learner(strategy=Chain(4), credit=sign_credit, loss=plain_pg_loss, name="sign-reinforce")
    result = await train(
        letters_config(tiny_model, algo="sign-reinforce", steps=2, eval_questions=2, strategy={}, eval_before=False),
        tmp_path,
        learner=mine,
        progress=False,
        log=lambda note: None,
    )
    assert calls == [4, 4, 4, 4]  # 2 steps × 2 prompts, 4 leaves each
    assert [h.step for h in result.heldout] == [2]  # after training only
    assert all("policy/reinforce" in record for record in result.history)
    assert json.loads((tmp_path / "config.json").read_text())["credit"] == {}
    assert result.config.algo == "sign-reinforce" and result.config.strategy == {"n": 4}


async def test_aepo_trains_with_the_entropy_aware_advantage_on(tiny_model, tmp_path):
    """AEPO's loss gets the trainer's token entropies: switching the entropy-aware advantage off changes the loss."""

    def aepo(flag, folder):
        learner = AEPO(strategy=Chain(4), loss_kwargs={"clip_balanced": True, "entropy_aware_advantage": flag})
        return train(
            letters_config(tiny_model, algo="aepo", steps=1, eval_questions=0, strategy={}),
            tmp_path / folder,
            learner=learner,
            progress=False,
            log=lambda note: None,
        )

    on, off = await aepo(True, "on"), await aepo(False, "off")
    assert on.history[0]["reward/mean"] == off.history[0]["reward/mean"]  # the same samples
    assert on.history[0]["policy/pg_loss"] != pytest.approx(off.history[0]["policy/pg_loss"], abs=1e-9)


async def test_budget_reward_scores_the_paths_the_token_budget_ended(tiny_model, tmp_path):
    # Three turns to go, but the 6 response tokens are spent in the first: every path ends without an answer.
    config = letters_config(tiny_model, steps=1, eval_questions=0, budget_reward=-1.0, env_kwargs={"turns": 3})
    result = await train(config, tmp_path, progress=False, log=lambda note: None)
    record = result.history[0]
    assert record["rollout/budget_cut_frac"] == 1.0
    assert record["reward/mean"] == record["reward/max"] == -1.0
    assert record["tree/reward_max"] == 0.0  # what the environment itself had paid so far


async def test_dynamic_sampling_trains_only_on_prompts_with_signal_and_resumes_exactly(tiny_model, tmp_path):
    def config(steps: int) -> TrainConfig:
        # A third of the tasks can score differently; up to 6 prompts a step to find 2 of them.
        return letters_config(
            tiny_model,
            steps=steps,
            eval_questions=0,
            dynamic_sampling=True,
            max_sampled_prompts=6,
            env_kwargs={"signal_every": 3},
        )

    notes: list[str] = []
    straight = await train(config(3), tmp_path / "a", progress=False, log=notes.append)
    for record in straight.history:
        assert record["tree/signal_frac"] == 1.0 and record["tree/reward_spread"] > 0
        assert record["sampling/prompts"] == record["sampling/prompts_kept"] + record["sampling/prompts_dropped"]
        assert record["sampling/prompts"] > 2 and record["batch/sequences"] == 2 * 6  # 2 prompts × 6 chains
        assert record["sampling/tokens"] > record["tokens/generated"] == record["tokens/action"]
        assert record["policy/loss"] != 0.0
    step_notes = [note for note in notes if note.startswith("step 1/3:")]
    assert "dynamic sampling kept 2 of" in step_notes[0] and "NO SIGNAL" not in step_notes[0]

    await train(config(2), tmp_path / "b", progress=False, log=lambda note: None)
    resumed = await train(config(3), tmp_path / "b", resume=True, progress=False, log=lambda note: None)
    for name in ("sampling/prompts", "sampling/tokens", "reward/mean", "policy/loss", "optim/grad_norm"):
        assert resumed.history[-1][name] == straight.history[-1][name], name
    weights_a = load_file(tmp_path / "a" / "checkpoints" / "step_000003" / "model" / "model.safetensors")
    weights_b = load_file(tmp_path / "b" / "checkpoints" / "step_000003" / "model" / "model.safetensors")
    assert all(torch.equal(weights_a[name], weights_b[name]) for name in weights_a)


async def test_the_rollout_bar_counts_the_leaves_of_every_prompt_dynamic_sampling_rolls_out(
    tiny_model, tmp_path, monkeypatch
):
    class Bar:  # what progress_bar returns, recording where each step's bar ended
        def __init__(self, desc, total, **_):
            self.desc, self.total, self.n = desc, total, 0

        def update(self, n=1):
            self.n += n

        def __enter__(self):
            return self

        def __exit__(self, *_):
            ended.append((self.desc, self.n, self.total))

    ended: list[tuple[str, int, int]] = []
    monkeypatch.setattr("agents.run.steps.progress_bar", Bar)
    config = letters_config(
        tiny_model,
        steps=2,
        eval_questions=0,
        dynamic_sampling=True,
        max_sampled_prompts=6,
        env_kwargs={"signal_every": 3},
    )
    result = await train(config, tmp_path / "a", progress=False, log=lambda note: None)
    sampled = [int(record["sampling/prompts"]) for record in result.history]
    assert max(sampled) > 2  # prompts were dropped and replaced
    assert ended == [(f"rollout step {s + 1}", 6 * n, 6 * n) for s, n in enumerate(sampled)]  # 6 chains each


async def test_a_rollout_token_budget_ends_the_run_after_the_step_that_reaches_it(tiny_model, tmp_path):
    # 2 prompts × 6 chains of at most 6 tokens: at most 72 tokens a step, so 100 is reached in step 2.
    notes: list[str] = []
    config = letters_config(tiny_model, steps=5, eval_questions=2, checkpoint_every=10, max_rollout_tokens=100)
    result = await train(config, tmp_path / "a", progress=False, log=notes.append)
    tokens = [record["sampling/tokens"] for record in result.history]
    assert result.steps == len(tokens) == 2 and tokens[0] < 100 <= sum(tokens)
    assert [held.step for held in result.heldout] == [0, 2] and result.checkpoint.name == "step_000002"
    assert f"step 2: {int(sum(tokens))} rollout tokens reach max_rollout_tokens=100; the run ends" in notes
    # Resumed with a larger budget, it counts the tokens sampled before the checkpoint.
    resumed = await train(
        dataclasses.replace(config, max_rollout_tokens=int(sum(tokens)) + 1),
        tmp_path / "a",
        resume=True,
        progress=False,
        log=lambda note: None,
    )
    assert resumed.steps == 3


async def test_held_out_scores_come_at_the_steps_that_reach_each_budget_point(tiny_model, tmp_path):
    config = letters_config(tiny_model, steps=4, eval_questions=2, checkpoint_every=10)
    first = await train(config, tmp_path / "a", progress=False, log=lambda note: None)
    spent = list(itertools.accumulate(int(record["sampling/tokens"]) for record in first.history))
    assert [held.step for held in first.heldout] == [0, 4]
    # points inside step 2's tokens and exactly at step 3's total: evaluated after steps 2 and 3, then the last
    points = (spent[0] + 1, spent[2])
    again = await train(
        dataclasses.replace(config, eval_at_tokens=points), tmp_path / "b", progress=False, log=lambda note: None
    )
    assert [int(record["sampling/tokens"]) for record in again.history] == [
        int(record["sampling/tokens"]) for record in first.history
    ]
    assert [held.step for held in again.heldout] == [0, 2, 3, 4]
    with pytest.raises(ValueError, match=r"eval_at_tokens must be increasing, got \[5, 3\]"):
        dataclasses.replace(config, eval_at_tokens=(5, 3))
    with pytest.raises(ValueError, match="eval_at_tokens must be a list of token counts >= 1, got \\(0,\\)"):
        dataclasses.replace(config, eval_at_tokens=(0,))


async def test_a_step_without_signal_says_so_in_its_line(tiny_model, tmp_path):
    notes: list[str] = []
    config = letters_config(tiny_model, steps=1, eval_questions=0, env_kwargs={"signal_every": 10**9})
    result = await train(config, tmp_path, progress=False, log=notes.append)  # task seeds 4, 5: both flat
    assert result.history[0]["tree/signal_frac"] == 0.0 and result.history[0]["policy/pg_loss"] == 0.0
    assert "NO SIGNAL: every prompt's leaves got the same reward" in next(n for n in notes if n.startswith("step 1/1"))


# -- run folders: failed starts, lost steps, bounded checkpoints --------------------------------


async def test_a_run_that_stopped_before_its_first_step_is_no_run_to_protect(tiny_model, tmp_path):
    out = tmp_path / "run"
    with pytest.raises((TypeError, ValueError), match="colour"):  # a bad option: nothing is written
        await train(letters_config(tiny_model, env_kwargs={"colour": 1}), out, progress=False)
    assert not out.exists()
    with pytest.raises(ModelNotAvailableError):  # a model that is not there fails after config.json is written
        await train(letters_config("/no/such/model"), out, progress=False, log=lambda note: None)
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]

    config = letters_config(tiny_model, steps=1, eval_questions=0)
    with pytest.raises(FileNotFoundError) as refused:
        await train(config, out, resume=True, progress=False)
    assert str(refused.value) == (
        f"{out} holds no checkpoint to resume from (no step of a run there was trained); start the run without --resume"
    )
    notes = []
    result = await train(config, out, progress=False, log=notes.append)  # the retry without --resume runs
    assert notes[0] == (
        f"{out} held a run that stopped before its first step (no checkpoint, no trained step): starting anew, "
        "in place of its config.json"
    )
    assert result.steps == 1 and json.loads((out / "config.json").read_text())["model"] == tiny_model


async def test_a_run_whose_steps_were_lost_before_a_checkpoint_names_the_way_out(tiny_model, tmp_path):
    config = letters_config(tiny_model, steps=1, eval_questions=0)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')  # two steps, then a crash
    lost = f"{tmp_path} holds a run that trained 2 steps but stopped before its first checkpoint, so there is nothing"
    with pytest.raises(FileExistsError) as refused:
        await train(config, tmp_path, progress=False)
    assert str(refused.value) == (
        f"{lost} to resume; to start it again there, delete the folder first (rm -r {tmp_path}), or choose another --out"
    )
    with pytest.raises(FileNotFoundError) as refused:
        await train(config, tmp_path, resume=True, progress=False)
    assert str(refused.value) == (
        f"{lost} to resume; to start it again without --resume, delete the folder first (rm -r {tmp_path}), "
        "or choose another --out"
    )
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "config.json").write_text('{"name": "my project"}')  # not a run's: never cleared
    with pytest.raises(FileExistsError, match="config.json is not the configuration of a training run"):
        await train(config, tmp_path, progress=False)
    assert (tmp_path / "config.json").read_text() == '{"name": "my project"}'


async def test_a_preset_s_strategy_sizes_never_replace_a_learner_s_own(tiny_model, tmp_path):
    mine = Learner(strategy=Chain(4), credit=GRPOCredit(), name="mine")
    with pytest.raises(ValueError, match=re.escape("the config's strategy section {'n': 6} is for algo 'grpo'")):
        await train(letters_config(tiny_model), tmp_path / "run", learner=mine, progress=False)
    assert not (tmp_path / "run").exists()  # refused before anything was written


async def test_keep_checkpoints_bounds_the_run_folder_and_resume_continues_exactly(tiny_model, tmp_path):
    straight = await train(
        letters_config(tiny_model, steps=3, eval_questions=0, keep_checkpoints=None),
        tmp_path / "a",
        progress=False,
        log=lambda note: None,
    )
    assert len(list((tmp_path / "a" / "checkpoints").iterdir())) == 3  # None: every checkpoint stays

    notes = []
    kept = letters_config(tiny_model, steps=2, eval_questions=0, keep_checkpoints=1)
    await train(kept, tmp_path / "b", progress=False, log=notes.append)
    checkpoints = tmp_path / "b" / "checkpoints"
    assert [p.name for p in checkpoints.iterdir()] == ["step_000002"]
    resumed = await train(
        dataclasses.replace(kept, steps=3), tmp_path / "b", resume=True, progress=False, log=notes.append
    )
    assert [note for note in notes if "removed" in note] == [
        f"step 2: removed checkpoint {checkpoints / 'step_000001'} (keep_checkpoints=1)",
        f"step 3: removed checkpoint {checkpoints / 'step_000002'} (keep_checkpoints=1)",
    ]
    assert [p.name for p in checkpoints.iterdir()] == ["step_000003"]
    assert resumed.history[-1]["policy/loss"] == straight.history[-1]["policy/loss"]  # resumed from the newest
    a = load_file(tmp_path / "a" / "checkpoints" / "step_000003" / "model" / "model.safetensors")
    b = load_file(checkpoints / "step_000003" / "model" / "model.safetensors")
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_placement_json_comes_from_the_backends_placement_and_rendezvous(tmp_path):
    from agents.models import tiny_llama
    from agents.run.train import _record_placement
    from agents.training.trainer import Trainer
    from agents.training.trainer_config import TrainerConfig

    class Ranks:  # what TrainerGroup gives the TrainerBackend contract
        local = None
        placement = [{"rank": 0, "node": "0123456789abcdef", "ip": "10.0.0.1", "pid": 7}]
        rendezvous = ("10.0.0.1", 29500)

    class Here:  # LocalRollout's: its engine runs in this process
        placement: list = []

    lines: list[str] = []
    _record_placement(tmp_path, Ranks(), Here(), lines.append)
    assert json.loads((tmp_path / "placement.json").read_text()) == {
        "trainer_ranks": Ranks.placement,
        "rollout_workers": [],
        "rendezvous": "10.0.0.1:29500",
    }
    assert lines == ["trainer rank 0 on node 0123456789ab (10.0.0.1), pid 7"]
    (tmp_path / "placement.json").unlink()
    trainer = Trainer(tiny_llama(), TrainerConfig(progress=False, report_to=("none",)))
    assert trainer.local is trainer and trainer.placement == [] and trainer.rendezvous is None
    _record_placement(tmp_path, trainer, Here(), lines.append)  # everything in this process: nothing to record
    assert not (tmp_path / "placement.json").exists() and len(lines) == 1
