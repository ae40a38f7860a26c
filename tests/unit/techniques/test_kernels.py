"""Fused kernels: visible fallback on CPU, liger called as memfit needs it, the fused loss equals the plain one."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, LlamaConfig

import memfit.techniques.kernels as kernels
from memfit.techniques.kernels import apply_kernels, fused_loss_problem, fused_loss_sum
from memfit.techniques.loss import causal_lm_loss_sum

CPU = torch.device("cpu")


def _model(**overrides):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, **overrides)
    model = AutoModelForCausalLM.from_config(config)
    model.train()
    return model


def _batch():
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 97, (2, 16), generator=generator)
    labels = input_ids.clone()
    labels[1, 10:] = -100  # padding carries no loss
    return input_ids, labels


def test_none_changes_nothing():
    choice = apply_kernels(_model(), "none", CPU)
    assert choice.description == "none" and choice.reason == "" and choice.holds_logits


def test_liger_on_cpu_falls_back_with_one_log_line(caplog):
    with caplog.at_level(logging.INFO, logger="memfit"):
        choice = apply_kernels(_model(), "liger", CPU)
    assert choice.description == "none" and "CUDA" in choice.reason
    lines = [r for r in caplog.records if "kernels" in r.getMessage()]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING


def test_liger_on_cpu_in_a_run_is_noted_once_in_the_fallbacks(caplog):
    fallbacks = {}
    with caplog.at_level(logging.INFO, logger="memfit"):
        apply_kernels(_model(), "liger", CPU, fallbacks)
    assert "CUDA" in fallbacks["kernels"] and "PyTorch's kernels ran" in fallbacks["kernels"]
    assert not caplog.records  # the loop logs the fallbacks, once


def test_auto_on_cpu_falls_back_quietly(caplog):
    fallbacks = {}
    with caplog.at_level(logging.INFO, logger="memfit"):
        choice = apply_kernels(_model(), "auto", CPU, fallbacks)
    assert choice.description == "none" and "CUDA" in choice.reason
    assert not caplog.records and not fallbacks


def _reference_fused_loss_module():
    """A stand-in for liger_kernel.transformers with liger's call signatures, computed by PyTorch."""

    class FusedLinearCrossEntropy(torch.nn.Module):
        def __init__(self, ignore_index=-100, reduction="mean", softcap=None, **_):
            super().__init__()
            self.ignore_index, self.reduction, self.softcap = ignore_index, reduction, softcap

        def forward(self, lin_weight, _input, target, bias=None):
            logits = F.linear(_input, lin_weight, bias).float()
            if self.softcap:
                logits = torch.tanh(logits / self.softcap) * self.softcap
            return F.cross_entropy(logits, target, ignore_index=self.ignore_index, reduction=self.reduction)

    calls = []
    package = types.ModuleType("liger_kernel")
    transformers = types.ModuleType("liger_kernel.transformers")
    monkey_patch = types.ModuleType("liger_kernel.transformers.monkey_patch")
    transformers.LigerFusedLinearCrossEntropyLoss = FusedLinearCrossEntropy
    monkey_patch._apply_liger_kernel_to_instance = lambda model, **kwargs: calls.append((model, kwargs))
    monkey_patch.MODEL_TYPE_TO_APPLY_LIGER_FN = {"llama": None}
    modules = {"liger_kernel": package, "liger_kernel.transformers": transformers,
               "liger_kernel.transformers.monkey_patch": monkey_patch}
    return modules, calls


@pytest.fixture
def fake_liger(monkeypatch):
    modules, calls = _reference_fused_loss_module()
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    # Pretend the device is CUDA with the package installed: only the dispatch is under test here.
    monkeypatch.setattr(kernels, "liger_unavailable_reason", lambda device, model_type: "")
    return calls


def test_liger_patches_the_blocks_but_not_the_models_forward_or_loss(fake_liger):
    model = _model()
    choice = apply_kernels(model, "liger", torch.device("cuda"))
    assert choice.description == "liger: rms_norm, swiglu, rope, fused_linear_cross_entropy"
    assert not choice.holds_logits
    (patched, options), = fake_liger
    assert patched is model
    assert options == {"rms_norm": True, "swiglu": True, "rope": True, "cross_entropy": False,
                       "fused_linear_cross_entropy": False}


def test_a_lora_model_is_patched_through_its_peft_wrapper(fake_liger):
    pytest.importorskip("peft")
    from memfit.config import LoraConfig
    from memfit.techniques.lora import apply_lora

    lm = _model()
    wrapped, _ = apply_lora(lm, LoraConfig(lora_r=2), gradient_checkpointing=False)
    apply_kernels(wrapped, "liger", torch.device("cuda"))
    (patched, _), = fake_liger
    assert patched is lm


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_fused_loss_equals_the_plain_loss_and_gradients(fake_liger, softcap):
    model = _model(final_logit_softcapping=softcap) if softcap else _model()
    input_ids, labels = _batch()
    if softcap:
        from memfit.techniques.loss import chunked_causal_lm_loss_sum

        def plain(m, i, lab):  # the plain loss ignores softcapping; the chunked one applies it
            return chunked_causal_lm_loss_sum(m, i, lab, None, 1024)
    else:
        def plain(m, i, lab):
            return causal_lm_loss_sum(m, i, lab)
    expected = plain(model, input_ids, labels)
    expected.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss = fused_loss_sum(model, input_ids, labels)
    loss.backward()
    torch.testing.assert_close(loss, expected)
    for name, parameter in model.named_parameters():
        torch.testing.assert_close(parameter.grad, grads[name], msg=name)


def test_a_wrapped_head_keeps_the_plain_loss(fake_liger, caplog):
    model = _model()
    model.lm_head = torch.nn.Sequential(model.lm_head)
    assert "Sequential" in fused_loss_problem(model)
    with caplog.at_level(logging.WARNING, logger="memfit"):
        choice = apply_kernels(model, "liger", torch.device("cuda"))
    assert choice.description == "liger: rms_norm, swiglu, rope" and choice.holds_logits
    assert "no fused loss" in caplog.text


@pytest.mark.gpu
def test_real_liger_kernels_keep_the_numbers_on_cuda():
    pytest.importorskip("liger_kernel")
    device = torch.device("cuda")
    plain, fused = _model().to(device), _model().to(device)
    choice = apply_kernels(fused, "liger", device)
    assert "fused_linear_cross_entropy" in choice.kernels
    input_ids, labels = (t.to(device) for t in _batch())
    expected = causal_lm_loss_sum(plain, input_ids, labels)
    expected.backward()
    loss = choice.fused_loss(fused, input_ids, labels)
    loss.backward()
    torch.testing.assert_close(loss, expected, rtol=1e-4, atol=1e-4)
    for (name, a), (_, b) in zip(plain.named_parameters(), fused.named_parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-3, atol=1e-4, msg=name)


def test_a_tiled_mlp_stays_tiled_when_liger_replaces_its_forward(fake_liger, monkeypatch):
    """liger's SwiGLU sets each MLP instance's forward: the tiling put there before must survive, with liger's
    forward running tile by tile (on the GPU the untiled MLP cost 10 GiB more at 131,072 tokens)."""
    from memfit.techniques.tiled_mlp import apply_tiled_mlp, find_mlps

    calls = []

    def liger_like_swiglu(self, x):  # liger's LigerSwiGLUMLP.forward, computed by PyTorch
        calls.append(x.shape[-2])
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    def patch_like_liger(model, **options):
        for mlp in find_mlps(model):
            mlp.forward = types.MethodType(liger_like_swiglu, mlp)

    monkeypatch.setattr(sys.modules["liger_kernel.transformers.monkey_patch"], "_apply_liger_kernel_to_instance",
                        patch_like_liger)
    reference = _model()
    model = _model()
    apply_tiled_mlp(model, 4)
    apply_kernels(model, "liger", torch.device("cuda"))
    input_ids, labels = _batch()
    out = model(input_ids=input_ids).logits
    assert calls and set(calls) == {4}, f"the MLP ran over {sorted(set(calls))} tokens at a time, not 16 / 4 tiles"
    torch.testing.assert_close(out, reference(input_ids=input_ids).logits, rtol=1e-5, atol=1e-5)
    calls.clear()
    out.float().square().sum().backward()  # the recompute in backward also runs liger's forward per tile
    assert calls and set(calls) == {4}
