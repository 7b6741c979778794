"""Training configuration: defaults, presets, files, overrides, the effective config and its checks."""

import json

import pytest

from agents.learners import AT2PO, LEARNERS, GRPOCredit, Learner
from agents.rollout.strategies import Budget, Chain, EntropyTree
from agents.run.config import (
    RESUMABLE,
    TrainConfig,
    build,
    effective_config,
    load_config_file,
    merge,
    parse_overrides,
    preset,
    resolve,
)
from agents.training.losses import gspo_loss


def config_with(*layers) -> TrainConfig:
    values = TrainConfig().to_dict()
    for layer in layers:
        values = merge(values, layer)
    return TrainConfig.from_dict(values)


def test_the_defaults_are_the_papers_budgets():
    parts = build(TrainConfig())
    assert parts.learner.strategy == EntropyTree(M=10, L=2, K=6, alpha=0.05)
    assert (parts.trainer.lr, parts.trainer.weight_decay, parts.trainer.max_grad_norm) == (1e-6, 0.01, 1.0)
    assert (parts.trainer.mini_batches, parts.trainer.loss, parts.trainer.total_steps) == (8, "atpo", 100)
    assert (parts.tree.rollout.max_prompt_tokens, parts.tree.rollout.max_response_tokens) == (2000, 6192)
    assert parts.tree.rollout.sampling.temperature == 1.0 and parts.tree.seed is None
    assert TrainConfig().prompts_per_step == 64


def test_presets_layer_over_the_defaults_per_algorithm():
    demo = config_with(preset("cpu-demo", "grpo"), {"algo": "grpo"})
    parts = build(demo)
    assert parts.learner.strategy == Chain(6) and parts.learner.kl_coef == 0.001
    assert (demo.steps, demo.prompts_per_step, demo.budget_reward) == (3, 2, -1.0)
    assert (parts.trainer.lr, parts.trainer.mini_batches, parts.tree.rollout.max_response_tokens) == (5e-5, 1, 256)
    assert parts.trainer.old_logprobs == "recompute" and parts.tree.rollout.sampling.temperature == 0.6
    assert demo.env_kwargs == {
        "reward": "at2po",
        "max_tool_calls": 2,
        "topk": 1,
        "result_chars": 300,
        "example": True,
        "require_boxed": False,
    }
    assert preset_leaves("cpu-demo") == dict.fromkeys(LEARNERS, 6)  # one rollout budget for every learner
    paper = config_with(preset("paper", "aepo"), {"algo": "aepo"})
    assert paper.env_kwargs == {"reward": "at2po"} and paper.budget_reward == -1.0
    assert paper.trainer == {"mini_batches": 8, "gradient_checkpointing": True, "micro_batch_tokens": 8192}
    assert build(paper).learner.strategy.k == 16
    with pytest.raises(ValueError, match="unknown preset 'gpu'; choose one of paper, cpu-demo, cpu-arithmetic$"):
        preset("gpu", "at2po")


def preset_leaves(name: str) -> dict[str, int]:
    """Leaves per prompt of every learner under the preset ``name``."""
    strategies = {algo: build(config_with(preset(name, algo), {"algo": algo})).learner.strategy for algo in LEARNERS}
    return {
        "at2po": strategies["at2po"].M + strategies["at2po"].L * strategies["at2po"].K,
        "aepo": strategies["aepo"].k,
        "grpo": strategies["grpo"].n,
        # each tree: one chain plus N per round, K of them kept
        "tree-grpo": strategies["tree-grpo"].M
        * min(strategies["tree-grpo"].K, 1 + strategies["tree-grpo"].L * strategies["tree-grpo"].N),
        "arpo": strategies["arpo"].n,
    }


def test_the_arithmetic_preset_is_the_probes_recipe_with_eight_leaves_for_every_learner():
    config = config_with(preset("cpu-arithmetic", "aepo"), {"algo": "aepo"})
    parts = build(config)
    assert (config.env, config.holdout, config.eval_questions, config.prompts_per_step) == (
        "python-math:arithmetic",
        500,
        200,
        8,
    )
    assert (config.dynamic_sampling, config.max_sampled_prompts, config.max_rollout_tokens) == (True, 32, 40_000)
    assert (parts.trainer.lr, parts.trainer.mini_batches, parts.tree.rollout.sampling.temperature) == (2e-5, 1, 1.0)
    assert (parts.tree.rollout.sampling.max_new_tokens, parts.tree.rollout.max_response_tokens) == (64, 192)
    assert config.env_kwargs == {"max_tool_calls": 2}
    assert preset_leaves("cpu-arithmetic") == dict.fromkeys(LEARNERS, 8)


def test_overrides_reach_every_part_by_name():
    config = config_with(
        parse_overrides(
            [
                "strategy.K=3",
                "credit.backup=leaf_mean",
                "loss.eps_high=0.01",
                "loss.kl_coef=0.002",
                "loss.entropy_coef=1e-3",
                "trainer.lr=1e-5",
                "sampling.max_new_tokens=64",
                "rollout.budget.tokens=4000",
                "rollout.turn_timeout=30",
                "env_kwargs.reward=f1",
                "steps=7",
            ]
        )
    )
    parts = build(config)
    assert parts.learner.strategy.K == 3 and parts.learner.credit.backup == "leaf_mean"
    assert parts.learner.loss_kwargs == {"eps_high": 0.01}
    assert (parts.trainer.kl_coef, parts.trainer.entropy_coef, parts.trainer.lr) == (0.002, 1e-3, 1e-5)
    assert parts.tree.rollout.sampling.max_new_tokens == 64 and parts.tree.budget == Budget(tokens=4000)
    assert (parts.tree.turn_timeout, config.env_kwargs, parts.trainer.total_steps) == (30, {"reward": "f1"}, 7)


def test_parse_overrides_reads_values_as_yaml_with_floats_in_any_notation():
    assert parse_overrides(["trainer.lr=1e-5", "a=true", "b=null", "c=[1, 2]", "d=text", "e=3", "f.g.h=0.5"]) == {
        "trainer": {"lr": 1e-5},
        "a": True,
        "b": None,
        "c": [1, 2],
        "d": "text",
        "e": 3,
        "f": {"g": {"h": 0.5}},
    }
    with pytest.raises(ValueError, match="--set takes KEY=VALUE"):
        parse_overrides(["trainer.lr"])
    with pytest.raises(ValueError, match="--set takes KEY=VALUE"):
        parse_overrides(["trainer..lr=1"])


@pytest.mark.parametrize(
    "layer, message",
    [
        ({"strategy": {"n": 3}}, "EntropyTree has no field n; its fields are M, L, K, alpha, root_candidate"),
        ({"trainer": {"learning_rate": 1.0}}, "trainer has no setting 'learning_rate'; the settings are lr, "),
        ({"trainer": {"kl_coef": 0.1}}, "trainer.kl_coef is set by the run"),
        ({"sampling": {"seed": 1}}, "sampling.seed is set by the run"),
        ({"sampling": {"temperature": 0.0}}, "sampling.temperature is 0"),
        ({"rollout": {"budget": {"token": 5}}}, "rollout.budget has no setting 'token'"),
        ({"algo": "ppo"}, "unknown algo 'ppo'; choose one of at2po, aepo, grpo, tree-grpo, arpo"),
    ],
)
def test_bad_settings_are_named_with_what_to_do(layer, message):
    with pytest.raises(ValueError, match=message):
        build(config_with(layer))


def test_bad_top_level_values_are_refused_when_the_config_is_made():
    with pytest.raises(ValueError, match="unknown config key 'lr'; the keys are algo, env"):
        TrainConfig.from_dict({"lr": 1e-5})
    with pytest.raises(ValueError, match="eval_questions=20 is more than the 10 held-out tasks"):
        TrainConfig(holdout=10, eval_questions=20)
    with pytest.raises(ValueError, match="steps must be an int >= 1, got 0"):
        TrainConfig(steps=0)
    with pytest.raises(ValueError, match="unknown engine 'sglang'"):
        TrainConfig(engine="sglang")


def test_the_effective_config_lists_every_value_and_rebuilds_the_same_run(tmp_path):
    config = config_with(preset("cpu-demo", "aepo"), {"algo": "aepo"}, parse_overrides(["loss.eps_low=0.1"]))
    effective = effective_config(config, build(config))
    assert effective.strategy["k"] == 6 and effective.strategy["beta"] == 0.5
    assert effective.credit == {"eps": 1e-6, "unbiased": True}
    assert effective.loss == {
        "eps_low": 0.1,
        "eps_high": 0.2,
        "dual_clip": 3.0,
        "clip_balanced": True,
        "entropy_aware_advantage": True,
        "entropy_advantage_coef": 0.2,
        "agg": "token-mean",
        "kl_coef": 0.0,
        "entropy_coef": 0.0,
        "behaviour_weight_cap": None,
    }
    assert effective.trainer["lr"] == 5e-5 and "loss" not in effective.trainer
    assert effective.rollout["budget"] == {"leaves": None, "tool_calls": None, "tokens": None}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(effective.to_dict()))
    again = TrainConfig.from_dict(load_config_file(path))
    assert effective_config(again, build(again)).changed(effective) == []
    rebuilt = build(again)
    assert rebuilt.learner.loss_kwargs["eps_low"] == 0.1 and rebuilt.trainer.lr == 5e-5


def test_config_files_in_yaml_and_json(tmp_path):
    (tmp_path / "run.yaml").write_text("algo: grpo\nsteps: 3\ntrainer:\n  lr: 1.0e-5\nstrategy:\n  n: 4\n")
    config = TrainConfig.from_dict(merge(TrainConfig().to_dict(), load_config_file(tmp_path / "run.yaml")))
    assert build(config).learner.strategy == Chain(4) and config.trainer == {"mini_batches": 8, "lr": 1e-5}
    (tmp_path / "bad.yaml").write_text("algo: [grpo\n")
    with pytest.raises(ValueError, match="is not valid YAML"):
        load_config_file(tmp_path / "bad.yaml")
    (tmp_path / "run.toml").write_text("algo = 'grpo'")
    with pytest.raises(ValueError, match="must end in .yaml, .yml or .json"):
        load_config_file(tmp_path / "run.toml")
    with pytest.raises(ValueError, match="does not exist"):
        load_config_file(tmp_path / "missing.json")
    (tmp_path / "list.json").write_text("[1]")
    with pytest.raises(ValueError, match="must hold a mapping"):
        load_config_file(tmp_path / "list.json")


def test_changed_names_the_differing_values_by_their_dotted_path():
    a = TrainConfig()
    b = config_with({"steps": 5, "trainer": {"lr": 2e-6}, "strategy": {"K": 3}})
    assert a.changed(b) == ["steps", "strategy.K", "trainer.lr"]


def test_a_learner_of_your_own_takes_the_config_sections_too():
    mine = Learner(strategy=Chain(3), credit=GRPOCredit(), loss=gspo_loss, name="mine")
    parts = build(config_with(parse_overrides(["algo=mine", "strategy.n=5", "loss.eps_high=5e-4"])), learner=mine)
    assert parts.learner.strategy == Chain(5) and parts.trainer.loss is gspo_loss
    assert build(config_with({"loss": {"eps_high": 5e-4}}), learner=mine).learner.loss_kwargs == {"eps_high": 5e-4}
    effective = effective_config(TrainConfig(), build(TrainConfig(), learner=mine))
    assert effective.algo == "mine"
    assert effective.loss == {
        "eps_low": 3e-4,
        "eps_high": 4e-4,
        "agg": "seq-mean-token-mean",
        "kl_coef": 0.0,
        "entropy_coef": 0.0,
        "behaviour_weight_cap": None,
    }
    assert build(TrainConfig(), learner=AT2PO(name="x")).learner.name == "x"


@pytest.mark.parametrize(("strategy", "size"), [(EntropyTree(M=2, L=1, K=2), "M"), (Chain(4), "n")])
def test_a_preset_never_replaces_the_strategy_sizes_of_a_learner_passed_in(strategy, size):
    mine = Learner(strategy=strategy, credit=GRPOCredit(), name="mine")
    with pytest.raises(ValueError) as conflict:  # the README's trap: a config resolved for at2po
        build(resolve(preset_name="cpu-demo"), learner=mine)
    assert str(conflict.value) == (
        "the config's strategy section {'M': 4, 'L': 1, 'K': 2} is for algo 'at2po' (a preset fills it with the "
        "sizes of that learner's strategy), but the learner passed in is 'mine', whose strategy is "
        f"{strategy!r}: the section would replace its sizes; resolve the config for your learner with "
        "agents.run.config.resolve(..., learner=yours), which leaves a preset's strategy sizes out, or set algo to "
        "'mine' to apply the section to it"
    )

    config = resolve(preset_name="cpu-demo", learner=mine)  # the preset's shared settings, your sizes
    assert (config.algo, config.strategy, config.steps, config.trainer["lr"]) == ("mine", {}, 3, 5e-5)
    assert build(config, learner=mine).learner.strategy == strategy
    assert effective_config(config, build(config, learner=mine)).algo == "mine"
    resized = resolve(preset_name="cpu-demo", learner=mine, assignments=[f"strategy.{size}=3"])
    assert getattr(build(resized, learner=mine).learner.strategy, size) == 3  # your own --set still applies


def test_a_learner_named_like_a_shipped_one_keeps_its_sizes_and_a_misfit_section_says_why():
    small = AT2PO(strategy=EntropyTree(M=2, L=1, K=1))
    assert build(resolve(preset_name="cpu-demo", learner=small), learner=small).learner.strategy.M == 2
    with pytest.raises(ValueError, match="the config names algo 'grpo', but it is resolved for the learner 'at2po'"):
        resolve(values={"algo": "grpo"}, learner=small)
    chains = Learner(strategy=Chain(4), credit=GRPOCredit(), name="grpo")
    with pytest.raises(ValueError) as misfit:  # named like grpo, so grpo's preset sizes apply: they must fit
        build(resolve(preset_name="cpu-demo", values={"algo": "grpo", "strategy": {"k": 6}}), learner=chains)
    assert str(misfit.value) == (
        "strategy Chain has no field k; its fields are n: the config's strategy section {'n': 6, 'k': 6} does not "
        "fit the learner passed in (Chain(n=4)); leave the section empty to keep the learner's own sizes "
        "(agents.run.config.resolve(..., learner=yours) leaves a preset's out)"
    )


def test_keep_checkpoints_is_a_count_or_none_and_may_change_on_resume():
    assert TrainConfig().keep_checkpoints == 2 and resolve(preset_name="cpu-demo").keep_checkpoints == 2
    assert TrainConfig(keep_checkpoints=None).keep_checkpoints is None  # every checkpoint stays
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="keep_checkpoints must be an int >= 1 .*, or None to keep every"):
            TrainConfig(keep_checkpoints=bad)
    assert TrainConfig().changed(TrainConfig(keep_checkpoints=5)) == ["keep_checkpoints"]
    assert "keep_checkpoints" in RESUMABLE


def test_resolve_layers_defaults_preset_file_flags_and_set_in_that_order(tmp_path):
    (tmp_path / "run.yaml").write_text("steps: 9\nprompts_per_step: 5\ntrainer:\n  lr: 3.0e-5\n  micro_batch_size: 2\n")
    config = resolve(
        preset_name="cpu-demo",
        file=tmp_path / "run.yaml",
        values={"algo": "grpo", "prompts_per_step": 3},
        assignments=["trainer.lr=4e-5"],
    )
    assert config.algo == "grpo" and config.strategy == {"n": 6}  # the preset of the algorithm the flags name
    assert (config.steps, config.prompts_per_step) == (9, 3)  # file over preset, flags over file
    assert config.trainer == {
        "mini_batches": 1,
        "micro_batch_size": 2,
        "lr": 4e-5,  # --set over everything
    }
    resumed = resolve(base=config.to_dict(), values={"steps": 12})
    assert resumed.changed(config) == ["steps"]
    assert resolve().to_dict() == TrainConfig().to_dict()


def test_agents_train_prints_the_effective_config_and_names_bad_arguments(capsys):
    from agents.cli import main

    assert (
        main(["train", "--algo", "tree-grpo", "--preset", "cpu-demo", "--set", "loss.eps_high=0.28", "--print-config"])
        == 0
    )
    printed = json.loads(capsys.readouterr().out)
    assert printed["strategy"] == {"M": 2, "N": 2, "L": 1, "K": 3} and printed["loss"]["eps_high"] == 0.28
    assert printed["credit"] == {"eps": 1e-6}
    for argv, message in [
        (["train", "--resume"], "--resume needs --out"),
        (["train", "--set", "strategy.Q=1", "--print-config"], "strategy EntropyTree has no field Q"),
        (["train", "--set", "sampling.temperature=0", "--print-config"], "sampling.temperature is 0"),
        (["train", "--out", "/nonexistent/run", "--resume"], "holds no config.json"),
    ]:
        with pytest.raises(SystemExit) as exit_info:
            main(argv)
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err


def test_engine_kwargs_reach_the_engine_and_are_checked_for_hf():
    config = config_with({"engine_kwargs": {"prefix_cache_tokens": 0}})
    build(config)  # an HFEngine setting
    assert effective_config(config, build(config)).engine_kwargs == {"prefix_cache_tokens": 0}
    with pytest.raises(ValueError, match="engine_kwargs has no setting 'gpu_memory_utilization' for the hf engine"):
        build(config_with({"engine_kwargs": {"gpu_memory_utilization": 0.5}}))
    with pytest.raises(ValueError, match="engine_kwargs.seed is set by the run"):
        config_with({"engine_kwargs": {"seed": 3}})
    build(config_with({"engine": "vllm", "engine_kwargs": {"gpu_memory_utilization": 0.5}}))  # vLLM checks its own


def test_a_run_takes_the_engines_that_load_the_trainer_s_weights():
    from agents.engines.factory import ENGINES, make_engine

    assert ENGINES == ("hf", "vllm", "openai")  # one list: agents eval's --engine and agents train's
    with pytest.raises(
        ValueError, match="engine 'openai' samples from a server's model, which cannot load the trainer"
    ):
        TrainConfig(engine="openai")
    with pytest.raises(ValueError, match="unknown engine 'tgi'; choose one of hf, vllm, openai"):
        TrainConfig(engine="tgi")
    with pytest.raises(ValueError, match="unknown engine 'tgi'; choose one of hf, vllm, openai"):
        make_engine("tgi", "smollm2-135m", concurrency=1)


def test_vllm_beside_the_trainer_gets_the_memory_the_optimiser_state_leaves():
    from agents.engines.vllm import colocated_memory_share

    gib = 2**30
    # 141 GiB H200, 100 GiB free after the weights, 32 GiB of AdamW state to come: 0.9 x 68 / 141.
    assert colocated_memory_share(100 * gib, 141 * gib, 32 * gib) == round(0.9 * 68 / 141, 3) == 0.434
    with pytest.raises(ValueError, match="leaving vLLM no room; train with LoRA"):
        colocated_memory_share(40 * gib, 80 * gib, 38 * gib)


def test_make_engine_passes_vllm_its_arguments_and_the_colocated_share(monkeypatch):
    import functools
    from types import SimpleNamespace

    import torch

    from agents.engines.vllm import VLLMEngine
    from agents.run.backends import run_engine

    made = []
    original = VLLMEngine.__init__

    @functools.wraps(original)
    def record(self, *args, **kwargs):
        made.append((args, kwargs))

    monkeypatch.setattr(VLLMEngine, "__init__", record)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (100 * 2**30, 141 * 2**30))
    parameters = [torch.nn.Parameter(torch.zeros(2**28))]  # 1 GiB of float32: 2 GiB of AdamW state
    trainer = SimpleNamespace(device=torch.device("cuda", 0), trainable_parameters=parameters)
    config = config_with({"engine": "vllm", "engine_kwargs": {"enforce_eager": True, "kv_cache_gib": None}})
    notes = []
    run_engine(config, build(config).tree.rollout, trainer, notes.append)
    ((args, kwargs),) = made
    assert args == (config.model,) and kwargs["engine_args"] == {"enforce_eager": True}  # kv_cache_gib set: no share
    assert (kwargs["max_num_seqs"], kwargs["max_model_len"], kwargs["kv_cache_gib"]) == (64, 2000 + 6192, None)
    made.clear()
    config = config_with({"engine": "vllm"})
    run_engine(config, build(config).tree.rollout, trainer, notes.append)
    assert made[0][1]["engine_args"] == {"gpu_memory_utilization": round(0.9 * 98 / 141, 3)}
    assert "gpu_memory_utilization 0.63" in notes[-1] and "2.0 GiB kept for the optimiser state" in notes[-1]
    assert made[0][1]["weight_transfer"] == "ipc"  # beside a CUDA trainer: vLLM's own transfer
    made.clear()
    config = config_with({"engine": "vllm", "engine_kwargs": {"weight_transfer": None}})
    run_engine(config, build(config).tree.rollout, trainer, notes.append)
    assert made[0][1]["weight_transfer"] is None  # the user's choice stands


def test_vllm_weight_transfer_source_sends_each_storage_once_cast_as_it_goes():
    pytest.importorskip("vllm")
    import torch

    from agents.engines.vllm import VLLMEngine, _StateDictSource

    embedding = torch.randn(5, 3)
    state = {"embed.weight": embedding, "norm.weight": torch.ones(3), "head.weight": embedding, "step": torch.tensor(4)}
    source = _StateDictSource(state, torch.bfloat16)
    meta = source.metadata()
    items = list(source)
    assert [m.name for m in meta] == [name for name, _ in items] == ["embed.weight", "norm.weight", "step"]
    assert [m.dtype for m in meta] == [t.dtype for _, t in items] == [torch.bfloat16, torch.bfloat16, torch.int64]
    assert [tuple(m.shape) for m in meta] == [(5, 3), (3,), ()]
    assert torch.equal(items[0][1], embedding.to(torch.bfloat16)) and embedding.dtype == torch.float32
    assert [names for names, _ in source.iter_groups()] == [["embed.weight"], ["norm.weight"], ["step"]]
    with pytest.raises(ValueError, match="moves CUDA tensors; on CPU leave it None"):
        VLLMEngine("smollm2-135m", weight_transfer="ipc")
    with pytest.raises(ValueError, match="weight_transfer must be one of None, ipc, got 'nccl'"):
        VLLMEngine("smollm2-135m", weight_transfer="nccl")


def test_weights_reach_vllm_once_per_storage_in_its_dtype_through_a_folder_with_room(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from agents.engines.vllm import engine_tensors, transfer_folder

    model = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=50,
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            tie_word_embeddings=True,
        )
    )
    state = {**model.state_dict(), "step": torch.tensor(3)}
    tensors = engine_tensors(state, "bfloat16")
    assert "lm_head.weight" not in tensors and "model.embed_tokens.weight" in tensors  # tied: sent once
    assert len(tensors) == len(state) - 1 and tensors["step"].dtype == torch.int64
    assert {t.dtype for name, t in tensors.items() if name != "step"} == {torch.bfloat16}
    torch.testing.assert_close(tensors["model.norm.weight"].float(), state["model.norm.weight"], atol=1e-2, rtol=0)

    shm, disk = tmp_path / "shm", tmp_path / "disk"
    shm.mkdir(), disk.mkdir()
    usage = namedtuple("usage", "total used free")
    free = {str(shm): 64 * 2**20, str(disk): 8 * 2**30}  # Docker's default /dev/shm, a roomy disk
    monkeypatch.setattr(shutil, "disk_usage", lambda place: usage(0, 0, free[str(place)]))
    assert transfer_folder(2**20, (str(shm), str(disk))) == str(disk)  # 1 MiB + 64 MiB slack: not in 64 MiB
    free[str(shm)] = 2**30
    assert transfer_folder(2**20, (str(shm), str(disk))) == str(shm)
    with pytest.raises(OSError, match=r"no room for the 16.00 GiB weights file .*--shm-size"):
        transfer_folder(16 * 2**30, (str(shm), str(disk)))


def test_the_decoupled_objective_is_a_trainer_setting_with_its_cap_a_loss_setting():
    parts = build(resolve(assignments=["trainer.decoupled=true", "loss.behaviour_weight_cap=5"]))
    assert parts.trainer.decoupled is True
    assert parts.trainer.loss == "atpo" and parts.trainer.loss_kwargs["behaviour_weight_cap"] == 5
    # the sampler's log-probs as π_old leave no proximal policy to clip around
    with pytest.raises(ValueError, match="decoupled=True needs old_logprobs='recompute'"):
        build(resolve(assignments=["trainer.decoupled=true", "trainer.old_logprobs=sampler"]))


@pytest.mark.parametrize(("switch", "reporters"), [(True, ("tensorboard",)), (False, ("none",))])
def test_a_config_file_from_before_report_to_keeps_its_tensorboard_choice(switch, reporters):
    saved = TrainConfig().to_dict()
    saved["trainer"] = {"mini_batches": 8, "tensorboard": switch}
    assert tuple(build(TrainConfig.from_dict(saved)).trainer.report_to) == reporters
