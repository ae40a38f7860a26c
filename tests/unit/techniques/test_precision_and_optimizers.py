"""Mixed precision and 8-bit AdamW: measured memory effect, and numerics close to the fp32 reference."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from memfit.config import OptimizerConfig
from memfit.errors import UsageError
from memfit.techniques.optimizers import (
    build_optimizer,
    lr_multiplier,
    measured_optimizer_state_bytes,
    parameter_groups,
)
from memfit.techniques.precision import resolve_precision


def _model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=257, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return AutoModelForCausalLM.from_config(config)


def _saved_activation_bytes(model, input_ids, precision) -> tuple[int, float]:
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), precision.autocast(torch.device("cpu")):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    return sum(seen.values()), loss.item()


@pytest.mark.numerics
def test_bf16_autocast_shrinks_activations_and_keeps_the_loss():
    # Large enough that activations, not the bf16 weight copies autocast also saves, dominate.
    input_ids = torch.randint(0, 256, (8, 128), generator=torch.Generator().manual_seed(0))
    model = _model()
    fp32_bytes, fp32_loss = _saved_activation_bytes(model, input_ids, resolve_precision("fp32", torch.device("cpu")))
    bf16_bytes, bf16_loss = _saved_activation_bytes(model, input_ids, resolve_precision("bf16", torch.device("cpu")))
    assert bf16_bytes < 0.8 * fp32_bytes
    assert bf16_loss == pytest.approx(fp32_loss, rel=1e-2)


def test_precision_choice_on_cpu():
    cpu = torch.device("cpu")
    assert resolve_precision("auto", cpu).name == "fp32"
    assert resolve_precision("amp", cpu).name == "bf16"
    with pytest.raises(UsageError, match="25x slower"):
        resolve_precision("fp16", cpu)


@pytest.mark.parametrize("gpu", ["t4", "rtx-4090"])  # without and with bf16
@pytest.mark.parametrize("requested", ["auto", "amp", "fp32", "bf16", "fp16"])
def test_the_estimate_resolves_precision_with_the_training_policy(gpu, requested):
    """One precision policy: the estimate of a GPU preset gets what training on that GPU would run."""
    from transformers import LlamaConfig

    from memfit.config_loading import load_config
    from memfit.gpus import get_gpu
    from memfit.prediction.run_shape import resolve_run
    from memfit.techniques.precision import choose_precision

    spec = get_gpu(gpu)
    config = load_config(overrides={"precision": requested})
    try:
        expected = choose_precision(requested, "cuda", spec.bf16)
    except UsageError as error:
        with pytest.raises(UsageError, match=str(error)[:30]):
            resolve_run(config, LlamaConfig(vocab_size=256), spec)
        return
    run = resolve_run(config, LlamaConfig(vocab_size=256), spec)
    assert run.autocast == (expected.name if expected.autocast_dtype is not None else None)


def _train(optimizer_name, steps=5):
    model = _model()
    choice = build_optimizer(parameter_groups(model, 0.0), OptimizerConfig(optimizer=optimizer_name, lr=1e-3), torch.device("cpu"))
    input_ids = torch.randint(0, 256, (4, 64), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(steps):
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        choice.optimizer.step()
        choice.optimizer.zero_grad()
        losses.append(loss.item())
    return choice, model, losses


def test_8bit_adamw_state_is_about_a_quarter():
    pytest.importorskip("bitsandbytes")
    full, model, full_losses = _train("adamw")
    eight, _, eight_losses = _train("adamw-8bit")
    assert eight.name == "adamw-8bit (bitsandbytes)" and eight.reason == ""
    full_bytes, eight_bytes = measured_optimizer_state_bytes(full.optimizer), measured_optimizer_state_bytes(eight.optimizer)
    num_params = sum(p.numel() for p in model.parameters())
    assert full_bytes >= 8 * num_params
    # bitsandbytes keeps tensors under 4096 elements (norms) in 32 bits; the matrices take 2 bytes/param + scales.
    assert eight_bytes < 0.3 * full_bytes
    assert eight_losses[-1] < eight_losses[0]
    assert eight_losses[-1] == pytest.approx(full_losses[-1], rel=0.02)


@pytest.mark.numerics
def test_adamw_kernels_give_the_same_update():
    results = {}
    for impl in ("fused", "foreach", "for-loop"):
        model = _model()
        choice = build_optimizer(parameter_groups(model, 0.01), OptimizerConfig(optimizer_impl=impl), torch.device("cpu"))
        input_ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        choice.optimizer.step()
        results[impl] = [p.detach().clone() for p in model.parameters()]
    for impl in ("foreach", "for-loop"):
        for a, b in zip(results["fused"], results[impl], strict=True):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_schedule_shapes():
    assert lr_multiplier(0, 100, 10, "cosine") == pytest.approx(0.1)
    assert lr_multiplier(9, 100, 10, "cosine") == pytest.approx(1.0)
    assert lr_multiplier(100, 100, 10, "cosine") == pytest.approx(0.1)
    assert lr_multiplier(55, 100, 10, "linear") == pytest.approx(0.55)
    assert lr_multiplier(55, 100, 0, "constant") == 1.0
