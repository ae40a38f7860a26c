"""Optimizer step in backward: the same parameters as a normal step, never all gradients at once."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from memfit.errors import UsageError
from memfit.techniques.optimizer_in_backward import OptimizerInBackward, check_optimizer_in_backward


def small_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(50, 16), nn.Linear(16, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 50))


def loss_of(model: nn.Module, step: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 50, (4, 12), generator=generator)
    logits = model(tokens[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, 50), tokens[:, 1:].reshape(-1))


def groups_of(model: nn.Module) -> list[dict]:
    matrices = [p for p in model.parameters() if p.ndim >= 2]
    vectors = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0}]


def make_adamw(groups):
    return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), foreach=False)


def test_parameters_equal_the_normal_step_after_several_steps():
    reference, model = small_model(), small_model()
    normal = make_adamw(groups_of(reference))
    in_backward = OptimizerInBackward(groups_of(model), make_adamw)
    schedule = [torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)) for opt in (normal, in_backward)]

    for step in range(5):
        loss_of(reference, step).backward()
        normal.step()
        normal.zero_grad()
        loss_of(model, step).backward()
        in_backward.step()
        in_backward.zero_grad()
        for scheduler in schedule:
            scheduler.step()

    for (name, expected), actual in zip(reference.named_parameters(), model.parameters(), strict=True):
        assert torch.equal(actual, expected), name
        assert actual.grad is None  # freed in backward
    assert in_backward.param_groups[0]["lr"] == normal.param_groups[0]["lr"] == pytest.approx(1e-2 / 6)


def install_gradient_meter(model: nn.Module) -> list[int]:
    """Record the total .grad bytes each time a gradient lands.

    Installed before OptimizerInBackward, these hooks run first, so they see the new
    gradient before it is consumed and freed: the worst moment.
    """
    parameters = list(model.parameters())
    readings: list[int] = []
    for parameter in parameters:
        parameter.register_post_accumulate_grad_hook(
            lambda _p: readings.append(sum(p.grad.nbytes for p in parameters if p.grad is not None))
        )
    return readings


def test_at_most_one_gradient_is_alive_at_a_time():
    baseline_model, model = small_model(), small_model()
    all_gradient_bytes = sum(p.nbytes for p in model.parameters())
    largest_gradient_bytes = max(p.nbytes for p in model.parameters())

    baseline_readings = install_gradient_meter(baseline_model)
    loss_of(baseline_model, 0).backward()
    readings = install_gradient_meter(model)
    OptimizerInBackward(model.parameters(), make_adamw)
    loss_of(model, 0).backward()

    assert max(baseline_readings) == all_gradient_bytes
    assert max(readings) == largest_gradient_bytes  # only the gradient just produced
    assert all(p.grad is None for p in model.parameters())


def test_state_dict_round_trip_continues_identically():
    first, second = small_model(), small_model()
    optimizer = OptimizerInBackward(first.parameters(), make_adamw)
    loss_of(first, 0).backward()
    second.load_state_dict(first.state_dict())
    restored = OptimizerInBackward(second.parameters(), make_adamw)
    restored.load_state_dict(copy.deepcopy(optimizer.state_dict()))  # as if read back from disk
    loss_of(first, 1).backward()
    loss_of(second, 1).backward()
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_schedule_after_a_resume_sets_the_rate_the_hooks_use():
    """A scheduler stepping a restored optimizer changes the per-parameter rates (a cosine schedule resumes)."""
    first, second = small_model(), small_model()
    optimizer = OptimizerInBackward(first.parameters(), make_adamw)
    loss_of(first, 0).backward()
    restored = OptimizerInBackward(second.parameters(), make_adamw)
    restored.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    scheduler = torch.optim.lr_scheduler.LambdaLR(restored, lambda step: 0.5)
    scheduler.step()
    assert all(group["lr"] == pytest.approx(5e-3) for inner in restored.optimizers.values()
               for group in inner.param_groups)


def test_load_state_dict_from_a_plain_optimizer_is_refused():
    model = small_model()
    optimizer = OptimizerInBackward(model.parameters(), make_adamw)
    with pytest.raises(ValueError, match="per-parameter"):
        optimizer.load_state_dict(make_adamw(small_model().parameters()).state_dict())


def test_remove_restores_normal_gradients_and_frozen_parameters_are_skipped():
    model = small_model()
    model[0].weight.requires_grad_(False)
    optimizer = OptimizerInBackward(model, make_adamw)  # a model works as well as its parameters
    assert model[0].weight not in optimizer.optimizers
    optimizer.remove()
    loss_of(model, 0).backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize(
    ("kwargs", "advice"),
    [
        ({"accumulation_steps": 4, "max_grad_norm": 0.0}, "--gradient-accumulation-steps 1 with a larger --batch-size"),
        ({"accumulation_steps": 1, "max_grad_norm": 1.0}, "--max-grad-norm 0"),
        ({"accumulation_steps": 1, "max_grad_norm": 0.0, "uses_grad_scaler": True}, "--precision bf16"),
    ],
)
def test_incompatible_settings_say_what_to_do(kwargs, advice):
    with pytest.raises(UsageError, match=advice):
        check_optimizer_in_backward(**kwargs)
    check_optimizer_in_backward(1, 0.0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_backward_peak_drops_by_about_all_gradients():
    def build():
        torch.manual_seed(0)
        return nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)]).cuda()

    inputs = torch.randn(64, 2048, device="cuda")
    peaks = {}
    for in_backward in (False, True):
        model = build()
        optimizer = (
            OptimizerInBackward(model.parameters(), make_adamw) if in_backward else make_adamw(model.parameters())
        )
        for _ in range(2):  # the second step has optimizer state in both cases
            loss = model(inputs).square().mean()
            torch.cuda.synchronize()
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss.backward()
            torch.cuda.synchronize()
            peaks[in_backward] = torch.cuda.max_memory_allocated() - before
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        del model, optimizer, loss
    weight_bytes = 2048 * 2048 * 4
    all_gradient_bytes = 8 * (weight_bytes + 2048 * 4)
    print(f"backward peak: {peaks[False] / 2**20:.1f} MiB with AdamW after backward,"
          f" {peaks[True] / 2**20:.1f} MiB in backward (all gradients: {all_gradient_bytes / 2**20:.1f} MiB)")
    assert peaks[False] > 0.95 * all_gradient_bytes, peaks
    # One gradient plus the per-parameter AdamW step's temporaries, instead of all eight.
    assert peaks[True] < 3.5 * weight_bytes, peaks
