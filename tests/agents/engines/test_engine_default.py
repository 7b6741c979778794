"""The engine `--preset paper` chooses: vLLM on a GPU where it is installed, HFEngine with a warning on a GPU
without it, HFEngine on a CPU; an engine any layer names is kept."""

import importlib.util

import pytest
import torch

from agents.run import config as config_module
from agents.run.config import resolve

WARNING = "warning: HFEngine generates ~10x slower than vLLM on a GPU; install vllm for --preset paper\n"


@pytest.fixture
def machine(monkeypatch):
    """Set whether CUDA is available and vLLM importable."""

    def set_machine(cuda: bool, vllm: bool) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        real_find_spec = importlib.util.find_spec
        monkeypatch.setattr(
            config_module.importlib.util,
            "find_spec",
            lambda name, *args: (
                (real_find_spec("json") if vllm else None) if name == "vllm" else real_find_spec(name, *args)
            ),
        )

    return set_machine


@pytest.mark.parametrize(
    ("cuda", "vllm", "engine", "warning"),
    [(True, True, "vllm", ""), (True, False, "hf", WARNING), (False, True, "hf", ""), (False, False, "hf", "")],
)
def test_preset_paper_generates_with_vllm_on_a_gpu_that_has_it(machine, capsys, cuda, vllm, engine, warning):
    machine(cuda, vllm)
    assert resolve(preset_name="paper").engine == engine
    assert capsys.readouterr().err == warning


def test_an_engine_named_by_any_layer_or_a_cpu_device_stays(machine, capsys, tmp_path):
    machine(cuda=True, vllm=True)
    assert resolve(preset_name="paper", values={"engine": "hf"}).engine == "hf"
    assert resolve(preset_name="paper", assignments=["engine=hf"]).engine == "hf"
    file = tmp_path / "run.yaml"
    file.write_text("engine: hf\n")
    assert resolve(preset_name="paper", file=file).engine == "hf"
    assert resolve(preset_name="paper", values={"device": "cpu"}).engine == "hf"
    # A resumed run keeps its saved engine.
    saved = resolve().to_dict()
    assert saved["engine"] == "hf" and resolve(base=saved, preset_name="paper").engine == "hf"
    # Other presets and none keep the default.
    assert resolve(preset_name="cpu-demo").engine == "hf" and resolve().engine == "hf"
    machine(cuda=True, vllm=False)
    assert resolve(preset_name="paper", values={"engine": "hf"}).engine == "hf"
    assert capsys.readouterr().err == ""  # HFEngine chosen by name: no warning
