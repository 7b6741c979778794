"""The optimiser: trainable parameters, AdamW and its schedule, the clipped step (docs/algorithms/training.md "AdamW and gradient clipping")."""

import contextlib
import math

import pytest
import torch

from agents.training.optimizer import adamw_and_schedule, clipped_step, trainable_parameters
from agents.training.trainer_config import TrainerConfig

CPU = torch.device("cpu")


def config(**overrides) -> TrainerConfig:
    return TrainerConfig(**{"lr": 1e-3, "progress": False, "report_to": ("none",), **overrides})


def parameters_with_grads(*grads) -> list[torch.nn.Parameter]:
    """One float32 parameter of ones per gradient, holding that gradient."""
    parameters = []
    for grad in grads:
        parameter = torch.nn.Parameter(torch.ones(len(grad)))
        parameter.grad = torch.tensor(grad)
        parameters.append(parameter)
    return parameters


class Recorder:
    """A weights_changing context that logs its entry and exit, and an optimiser step between them."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.events: list[str] = []
        optimizer.register_step_pre_hook(lambda *_: self.events.append("step"))

    @contextlib.contextmanager
    def context(self):
        self.events.append("enter")
        yield
        self.events.append("exit")


def test_trainable_parameters_are_those_with_requires_grad_in_model_order():
    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1))
    model[0].bias.requires_grad_(False)
    model[1].weight.requires_grad_(False)
    assert [p.shape for p in trainable_parameters(model)] == [(3, 2), (1,)]
    assert trainable_parameters(model)[0] is model[0].weight and trainable_parameters(model)[1] is model[1].bias


def test_trainable_parameters_refuse_a_frozen_model_and_name_every_wrong_dtype_once():
    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model.requires_grad_(False)
    with pytest.raises(ValueError, match="the model has no parameter with requires_grad=True, so there is nothing"):
        trainable_parameters(model)
    model.requires_grad_(True)
    model[0].to(torch.float16)
    model[1].to(torch.bfloat16)
    # the names sorted and each once, though two parameters of each dtype are wrong
    with pytest.raises(ValueError, match=r"^trainable parameters are torch\.bfloat16, torch\.float16; load the"):
        trainable_parameters(model)
    model[0].requires_grad_(False)
    model[1].requires_grad_(False)  # a frozen base may be in any dtype (LoRA over a bfloat16 base)
    assert len(trainable_parameters(model)) == 2


def test_adamw_takes_its_hyper_parameters_from_the_config():
    parameters = parameters_with_grads([1.0])
    cfg = config(lr=3e-4, adam_betas=(0.8, 0.95), adam_eps=1e-6, weight_decay=0.1)
    optimizer, _ = adamw_and_schedule(parameters, cfg, CPU)
    assert isinstance(optimizer, torch.optim.AdamW)
    defaults = optimizer.defaults
    assert (defaults["lr"], defaults["betas"], defaults["eps"], defaults["weight_decay"]) == (
        3e-4,
        (0.8, 0.95),
        1e-6,
        0.1,
    )
    assert optimizer.param_groups[0]["params"] == parameters


def test_adamw_is_fused_by_default_on_cuda_only_and_as_configured_otherwise():
    parameters = parameters_with_grads([1.0])
    # None, not False, off the fused path: torch then picks its multi-tensor default
    assert adamw_and_schedule(parameters, config(), CPU)[0].defaults["fused"] is None
    # only the device's type decides the default; the CPU parameters take torch's fused CPU kernel
    assert adamw_and_schedule(parameters, config(), torch.device("cuda", 0))[0].defaults["fused"] is True
    assert (
        adamw_and_schedule(parameters, config(fused_adamw=False), torch.device("cuda", 0))[0].defaults["fused"] is None
    )
    assert adamw_and_schedule(parameters, config(fused_adamw=True), CPU)[0].defaults["fused"] is True


def lrs(optimizer, scheduler, updates: int) -> list[float]:
    """The learning rate before each of ``updates`` scheduler steps, then after the last."""
    values = []
    for _ in range(updates):
        values.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return [*values, optimizer.param_groups[0]["lr"]]


def test_constant_schedule_keeps_the_learning_rate():
    optimizer, scheduler = adamw_and_schedule(parameters_with_grads([1.0]), config(lr=1e-3), CPU)
    assert lrs(optimizer, scheduler, 3) == [1e-3] * 4


def test_warm_up_rises_linearly_over_warmup_steps_updates():
    cfg = config(lr=1e-3, lr_schedule="constant_with_warmup", warmup_steps=4)
    optimizer, scheduler = adamw_and_schedule(parameters_with_grads([1.0]), cfg, CPU)
    assert lrs(optimizer, scheduler, 5) == pytest.approx([0.0, 2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3], abs=1e-15)


def test_a_decaying_schedule_spans_total_steps_times_mini_batches_times_epochs_updates():
    # 1 step x 2 mini-batches x 2 epochs = 4 updates: linear decay to 0 at the fourth
    cfg = config(lr=1e-3, lr_schedule="linear", total_steps=1, mini_batches=2, epochs=2)
    optimizer, scheduler = adamw_and_schedule(parameters_with_grads([1.0]), cfg, CPU)
    assert lrs(optimizer, scheduler, 4) == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4, 0.0], abs=1e-15)


def test_schedule_errors_name_the_setting_to_change():
    parameters = parameters_with_grads([1.0])
    with pytest.raises(ValueError, match="lr_schedule 'constant' has no warm-up; use 'constant_with_warmup' with"):
        adamw_and_schedule(parameters, config(warmup_steps=3), CPU)
    with pytest.raises(ValueError, match="lr_schedule 'linear' decays over the run; set TrainerConfig.total_steps"):
        adamw_and_schedule(parameters, config(lr_schedule="linear"), CPU)


def test_clipped_step_clips_the_whole_gradient_to_max_norm_and_returns_the_norm_before():
    # gradients 3 and 4 in two parameters: one norm of 5 over both, clipped to 1
    parameters = parameters_with_grads([3.0], [4.0])
    optimizer = torch.optim.SGD(parameters, lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 0.5**update)
    recorder = Recorder(optimizer)
    norm = clipped_step(parameters, optimizer, scheduler, 1.0, recorder.context())
    assert norm == pytest.approx(5.0, abs=1e-6)
    assert [p.grad.item() for p in parameters] == pytest.approx([0.6, 0.8], abs=1e-6)
    # SGD with lr 1 moves each weight by its clipped gradient, inside weights_changing
    assert [p.item() for p in parameters] == pytest.approx([0.4, 0.2], abs=1e-6)
    assert recorder.events == ["enter", "step", "exit"]
    assert optimizer.param_groups[0]["lr"] == 0.5  # the schedule stepped once


def test_clipped_step_leaves_a_gradient_under_the_max_norm_as_it_is():
    parameters = parameters_with_grads([0.3, 0.4])
    optimizer = torch.optim.SGD(parameters, lr=1.0)
    norm = clipped_step(
        parameters, optimizer, torch.optim.lr_scheduler.ConstantLR(optimizer, 1.0), 1.0, contextlib.nullcontext()
    )
    assert norm == pytest.approx(0.5, abs=1e-7)
    assert parameters[0].grad.tolist() == pytest.approx([0.3, 0.4], abs=1e-7)
    assert parameters[0].tolist() == pytest.approx([0.7, 0.6], abs=1e-7)


# torch warns of a schedule stepped before its optimiser: here that is the point
@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")
@pytest.mark.parametrize("bad", [math.inf, math.nan])
def test_clipped_step_skips_the_update_of_a_non_finite_gradient_but_steps_the_schedule(bad):
    parameters = parameters_with_grads([bad, 1.0])
    optimizer = torch.optim.SGD(parameters, lr=1.0)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda update: 0.5**update)
    recorder = Recorder(optimizer)
    norm = clipped_step(parameters, optimizer, scheduler, 1.0, recorder.context())
    assert not math.isfinite(norm) and (math.isnan(norm) == math.isnan(bad))
    assert parameters[0].tolist() == [1.0, 1.0]  # the weights are not corrupted
    assert recorder.events == []  # the weights never start changing
    assert optimizer.param_groups[0]["lr"] == 0.5
