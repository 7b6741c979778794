"""The embedded model resolves, converts and loads offline; other names resolve or fail clearly."""

import json
import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import huggingface_hub.constants
import pytest
import torch

from agents import models
from agents.models import (
    DEFAULT_MODEL,
    AttentionShape,
    ModelNotAvailableError,
    release_openmp_threads,
    torch_libgomp,
)

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def test_attention_shape_reads_configs_and_their_json():
    from transformers import LlamaConfig, Qwen3Config

    # SmolLM2-135M's config.json: 9 query heads sharing 3 key-value heads, 576 / 9 = 64 dimensions.
    smollm2 = {"num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576}
    assert AttentionShape.of(smollm2) == AttentionShape(9, 3, 64)
    assert AttentionShape.of(LlamaConfig(**smollm2)) == AttentionShape(9, 3, 64)
    # No key-value heads given: one per query head (multi-head attention).
    assert AttentionShape.of({"num_attention_heads": 8, "hidden_size": 512}) == AttentionShape(8, 8, 64)
    assert AttentionShape.of({"num_attention_heads": 8, "num_key_value_heads": None, "hidden_size": 512}).kv_heads == 8
    # Qwen3 gives head_dim, which is not hidden_size / heads (Qwen3-4B: 2560 / 32 = 80, head_dim 128).
    qwen3 = {"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 2560, "head_dim": 128}
    assert AttentionShape.of(qwen3) == AttentionShape(32, 8, 128)
    assert AttentionShape.of(Qwen3Config(**qwen3)) == AttentionShape(32, 8, 128)


@pytest.fixture(scope="module")
def tokenizer():
    return models.load_tokenizer(DEFAULT_MODEL)


@pytest.fixture(scope="module")
def model():
    return models.load_model(DEFAULT_MODEL)


def test_chat_template_renders_the_smollm2_format(tokenizer):
    text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
    assert len(tokenizer) == 49152


@pytest.mark.slow
def test_embedded_checkpoint_is_float32_transformers_format(model):
    folder = models.resolve_model(DEFAULT_MODEL)
    assert folder == models.cache_root() / DEFAULT_MODEL
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json", "chat_template.jinja"):
        assert (folder / name).is_file(), name
    assert "quantization_config" not in (folder / "config.json").read_text()
    assert model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert not model.training


@pytest.mark.slow
def test_greedy_generation_is_deterministic_and_sensible(model, tokenizer):
    inputs = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    first = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    second = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    assert torch.equal(first, second)
    new_ids = first[0, inputs["input_ids"].shape[1] :]
    assert tokenizer.decode(new_ids) == "The capital of France is Paris.<|im_end|>"


def test_local_directory_resolves_to_itself(tmp_path):
    assert models.resolve_model(str(tmp_path)) == tmp_path


def test_missing_local_path_names_what_to_give(tmp_path):
    with pytest.raises(ModelNotAvailableError, match="not a directory.*smollm2-135m"):
        models.resolve_model(str(tmp_path / "missing"))


def test_hub_id_offline_fails_naming_the_embedded_default(monkeypatch, tmp_path):
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(ModelNotAvailableError, match="could not fetch.*'smollm2-135m' works without network"):
        models.resolve_model("HuggingFaceTB/SmolLM2-360M-Instruct")


def test_invalid_hub_id_is_rejected():
    with pytest.raises(ModelNotAvailableError, match="neither a known model name"):
        models.resolve_model("not a valid//id")


def test_cache_root_follows_agentenv_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("AGENTENV_CACHE", str(tmp_path))
    assert models.cache_root() == tmp_path / "models"
    monkeypatch.delenv("AGENTENV_CACHE")
    assert models.cache_root() == models.Path.home() / ".cache" / "agentenv" / "models"


@pytest.mark.slow
def test_a_first_load_on_trainer_rank_1_converts_a_checkpoint_every_rank_loads(tmp_path, gloo_ranks):
    # transformers 5.19's save_pretrained writes nothing on a torch.distributed rank other than 0: a
    # conversion through it left a folder marked done with no config and no weights (issue 46).
    code = (
        "import sys, torch, torch.distributed as dist\n"
        "from agents.models import load_model\n"
        "rank = int(sys.argv[1])\n"
        "dist.init_process_group('gloo', init_method='file://' + sys.argv[2], rank=rank, world_size=2)\n"
        "if rank == 1:\n"
        "    load_model()  # the first load of an empty cache, on rank 1 alone\n"
        "dist.barrier()\n"
        "model = load_model()\n"
        "print(sum(p.numel() for p in model.parameters()), model.model.embed_tokens.weight.double().sum().item())\n"
        "dist.barrier()\n"
        "dist.destroy_process_group()\n"
    )
    env = {**os.environ, "AGENTENV_CACHE": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1"}
    first, second = (out.split() for out in gloo_ranks(code, env))
    assert first == second and first[0] == "134515008"
    folder = tmp_path / "cache" / "models" / DEFAULT_MODEL
    config = json.loads((folder / "config.json").read_text())
    assert (config["model_type"], config["architectures"]) == ("llama", ["LlamaForCausalLM"])
    assert sorted(p.name for p in folder.iterdir()) == [
        "agentenv_conversion.json",
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ]


def test_a_converted_folder_that_lost_its_weights_is_rebuilt(monkeypatch, tmp_path, caplog):
    from safetensors.torch import save_file

    def write_tokenizer(folder):
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (folder / name).write_text("{}")

    def convert(name, folder):  # the files the check reads, as a real conversion writes them
        write_tokenizer(folder)
        (folder / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
        save_file({"w": torch.zeros(1)}, str(folder / "model.safetensors"))

    monkeypatch.setenv("AGENTENV_CACHE", str(tmp_path))
    folder = tmp_path / "models" / DEFAULT_MODEL
    folder.mkdir(parents=True)
    write_tokenizer(folder)
    (folder / "agentenv_conversion.json").write_text("{}")  # what a rank-1 conversion left: no config, no weights
    monkeypatch.setattr(models, "_convert_checkpoint", convert)
    assert models.resolve_tokenizer(DEFAULT_MODEL) == tmp_path / "models" / f"{DEFAULT_MODEL}-tokenizer"
    with caplog.at_level(logging.WARNING, logger="agentenv.cache"):
        assert models.resolve_model(DEFAULT_MODEL) == folder
    assert caplog.text.count("rebuilding") == 1 and "config.json" in caplog.text
    assert json.loads((folder / "agentenv_conversion.json").read_text())["name"] == DEFAULT_MODEL
    assert models.resolve_tokenizer(DEFAULT_MODEL) == folder


def test_the_checkpoint_check_names_what_is_missing(tmp_path):
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / name).write_text("{}")
    with pytest.raises(FileNotFoundError, match="config.json"):
        models._check_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(ValueError, match="config.json has no model_type"):
        models._check_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ValueError, match="config.json has no architectures"):
        models._check_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama", "architectures": ["LlamaForCausalLM"]}')
    with pytest.raises(Exception, match="model.safetensors"):
        models._check_checkpoint(tmp_path)


@pytest.mark.slow
def test_tokenizer_alone_converts_without_the_weights(monkeypatch, tmp_path):
    monkeypatch.setenv("AGENTENV_CACHE", str(tmp_path))
    tokenizer = models.load_tokenizer(DEFAULT_MODEL)
    assert sorted(p.name for p in (tmp_path / "models").iterdir() if not p.name.endswith(".lock")) == [
        "smollm2-135m-tokenizer"
    ]
    assert tokenizer("</search>").input_ids == [9617, 7916, 46]


def test_generic_tokenizer_loads_without_torch_and_equals_autotokenizer(tokenizer):
    import json

    from transformers import AutoTokenizer

    # A rollout worker that only tokenizes must not pay for torch (AutoTokenizer's import pulls it in).
    code = (
        "import sys; from agents.models import load_tokenizer; t = load_tokenizer(); "
        "print(type(t).__name__, 'torch' in sys.modules, 'sklearn' in sys.modules, t.encode('</search>'))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(" ", 3)
    assert out[:3] == ["TokenizersBackend", "False", "False"] and json.loads(out[3]) == [9617, 7916, 46]
    auto = AutoTokenizer.from_pretrained(models.resolve_tokenizer(DEFAULT_MODEL))
    assert type(auto) is type(tokenizer) and auto.get_vocab() == tokenizer.get_vocab()
    assert auto.special_tokens_map == tokenizer.special_tokens_map
    text = "Who wrote <search>the Iliad</search>? \u00e9\u00e8 12345"
    chat = [*CHAT, {"role": "assistant", "content": text}]
    assert auto.apply_chat_template(chat) == tokenizer.apply_chat_template(chat)
    assert auto.encode(text) == tokenizer.encode(text) and auto.decode(auto.encode(text)) == text


def test_tiny_llama_is_a_seeded_two_layer_llama_whose_config_can_be_changed():
    from agents.models import tiny_llama

    a, b, other = tiny_llama(3), tiny_llama(3), tiny_llama(4, vocab_size=40, num_hidden_layers=1)
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert not torch.equal(a.model.layers[0].mlp.up_proj.weight, tiny_llama(4).model.layers[0].mlp.up_proj.weight)
    assert (a.config.num_hidden_layers, a.config.vocab_size, a.config.tie_word_embeddings) == (2, 50, True)
    assert (other.config.vocab_size, len(other.model.layers), a.training) == (40, 1, False)
    assert sum(p.numel() for p in a.parameters()) < 40_000


def _process_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(torch_libgomp() is None or torch.get_num_threads() < 2, reason="torch on GNU OpenMP, 2+ threads")
def test_release_openmp_threads_ends_the_calling_threads_helpers():
    # torch's own libgomp, not the copy scikit-learn ships (loaded with transformers)
    path = torch_libgomp()
    assert path is not None and (Path(torch.__file__).parent in path.parents or "-packages" not in str(path))
    counts = {}

    def work():
        torch.ones(1 << 22).add_(1)  # a parallel region: this thread gets a team of helper threads
        counts["team"] = _process_threads()
        release_openmp_threads()
        deadline = time.monotonic() + 5
        while _process_threads() >= counts["team"] and time.monotonic() < deadline:
            time.sleep(0.01)
        counts["released"] = _process_threads()
        torch.ones(1 << 22).add_(1)  # and a new team when it computes again
        counts["again"] = _process_threads()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    helpers = torch.get_num_threads() - 1
    assert counts["released"] == counts["team"] - helpers
    assert counts["again"] == counts["team"]


def test_the_embedded_gguf_file_is_the_shipped_q4_1_file():
    path = models.embedded_gguf_file(DEFAULT_MODEL)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.read_bytes()[:4] == b"GGUF"
