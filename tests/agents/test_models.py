"""The embedded model resolves, converts and loads offline; other names resolve or fail clearly."""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import huggingface_hub.constants
import pytest
import torch

from agents import models
from agents.models import DEFAULT_MODEL, ModelNotAvailableError

CHAT = [{"role": "user", "content": "What is the capital of France?"}]


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


def test_crashed_conversion_leaves_no_checkpoint(monkeypatch, tmp_path):
    monkeypatch.setenv("AGENTENV_CACHE", str(tmp_path))

    def half_then_crash(folder):
        (folder / "model.safetensors").write_bytes(b"half")
        raise RuntimeError("killed mid-conversion")

    with pytest.raises(RuntimeError, match="killed mid-conversion"):
        models._cached("some-model", half_then_crash)
    assert sorted(p.name for p in (tmp_path / "models").iterdir()) == ["some-model.lock"]

    built = []
    folder = models._cached("some-model", lambda f: (built.append(f), models._write_record(f, DEFAULT_MODEL, f)))
    assert folder == tmp_path / "models" / "some-model" and len(built) == 1
    assert models._cached("some-model", lambda f: built.append(f)) == folder and len(built) == 1


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
    import subprocess
    import sys

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
