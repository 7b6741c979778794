"""Fixtures shared by the test packages."""

import os
import subprocess
import sys

# The suite checks the sampler's log-probs against float32 forward passes to 1e-5: HFEngine generates in float32
# here, as on a CPU without bfloat16 units, in this process and those it starts (Ray workers, the CLI); the tests
# of the bfloat16 default set it themselves.
os.environ["AGENTENV_CPU_BFLOAT16"] = "0"

import gymnasium
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

import agentenv
from agentenv.registration import registry
from agents.models import tiny_llama

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    """A random 2-layer Llama and a byte-level tokenizer with a chat template, saved as a checkpoint folder."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    backend = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>"],
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    model = tiny_llama(
        vocab_size=len(tokenizer),
        max_position_embeddings=4096,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture
def gloo_ranks(tmp_path):
    """``run(code, env=None)``: ``code`` in two fresh interpreters, ranks 0 and 1 of a gloo group (``sys.argv``:
    the rank, then a rendezvous file for ``init_method="file://" + sys.argv[2]``); their stdouts, once both
    exited with 0 (else their stderr in the failure)."""

    def run(code: str, env: dict[str, str] | None = None) -> list[str]:
        ranks = [
            subprocess.Popen(
                [sys.executable, "-c", code, str(rank), str(tmp_path / "rendezvous")],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(2)
        ]
        outputs = [rank.communicate(timeout=300) for rank in ranks]
        assert [rank.returncode for rank in ranks] == [0, 0], [err[-2000:] for _, err in outputs]
        return [out for out, _ in outputs]

    return run


@pytest.fixture(scope="module")
def module_envs():
    """``agentenv.register`` for one test module: its environments leave both registries at the module's end.

    Pytest imports every test module before running any, so a module-level ``register`` would show a
    test environment to every other module (``agentenv list`` included).
    """
    ours, gyms = dict(registry._specs), dict(gymnasium.registry)
    yield agentenv.register
    registry._specs.clear()
    registry._specs.update(ours)
    gymnasium.registry.clear()
    gymnasium.registry.update(gyms)
