"""NF4 expert stacks dequantized a group of experts at a time (--expert-dequant-group).

Numerics: a QLoRA model whose stacks are dequantized two experts at a time gives the loss and every adapter
gradient of the same model dequantizing whole stacks; a twin that slices the absmax one expert off fails.
Memory: one grouped matmul's forward and backward on an 8-expert stack, tracked, peaks lower by the experts
not dequantized, and the estimator's dequantized bytes match the tracked peaks.
"""

from __future__ import annotations

import pytest
import torch

from memfit.techniques import expert_dequant_groups
from memfit.techniques.expert_dequant_groups import set_dequant_group
from memfit.techniques.expert_quant import nf4_grouped_mm, quantize_expert_weight
from memfit.techniques.nf4_state import block_absmax
from model_zoo import build_model, randomize_adapters

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

FAMILIES = ["qwen3_moe", "gpt_oss", "mixtral"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("dequant_groups")
    for family in FAMILIES:
        build_model(family).save_pretrained(root / family)
    return root


def _qlora(directory):
    from transformers import AutoModelForCausalLM

    from memfit.config import LoraConfig
    from memfit.techniques.lora import apply_lora, quantization_config

    lora = LoraConfig(lora_r=2, quantize="4bit")
    base = AutoModelForCausalLM.from_pretrained(directory, quantization_config=quantization_config(lora, torch.float32),
                                                device_map={"": "cpu"})
    model, _ = apply_lora(base, lora, gradient_checkpointing=False)
    randomize_adapters(model)
    return model


def _loss_and_grads(model):
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same(model, group):
    expected_loss, expected = _loss_and_grads(model)
    assert set_dequant_group(model, group).startswith(f"4 NF4 expert stacks dequantized {group} expert")
    loss, grads = _loss_and_grads(model)
    assert set(grads) == set(expected) and any("experts" in name for name in grads)
    return abs(loss - expected_loss) <= 1e-6 * abs(expected_loss) and all(
        torch.allclose(grads[name], grad, rtol=1e-5, atol=1e-7) for name, grad in expected.items())


@pytest.mark.parametrize("family", FAMILIES)
def test_grouped_dequantization_gives_the_whole_stacks_loss_and_adapter_gradients(family, saved):
    assert _same(_qlora(saved / family), 2)


def test_a_group_of_one_expert_gives_the_whole_stacks_result(saved):
    """One expert a group: the packed slice's first dimension is 1, which bitsandbytes would read as transposed."""
    assert _same(_qlora(saved / "qwen3_moe"), 1)


def test_fault_twin_a_group_read_with_the_wrong_absmax_is_caught(saved, monkeypatch):
    model = _qlora(saved / "gpt_oss")
    real = expert_dequant_groups.dequantized_experts

    def shifted(weight, first, last, dtype, absmax=None):  # the absmax of the expert before: wrong scales
        absmax = block_absmax(weight.quant_state)
        return real(weight, first, last, dtype, torch.roll(absmax, absmax.numel() // weight.quant_state.shape[0]))

    monkeypatch.setattr(expert_dequant_groups, "dequantized_experts", shifted)
    assert not _same(model, 2)


def _tracked_call(stack, group, tokens):
    """Tracked peak and live-at-start bytes of one forward and backward of nf4_grouped_mm on `tokens`."""
    from memfit.memory.tracker import MemoryTracker

    setattr(stack, expert_dequant_groups.GROUP_ATTRIBUTE, group)
    experts = stack.quant_state.shape[0]
    counts = torch.full((experts,), tokens // experts, dtype=torch.int32)
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(tokens, stack.quant_state.shape[-1], generator=torch.Generator().manual_seed(2),
                    requires_grad=True)
    tracker = MemoryTracker(torch.device("cpu"))
    with tracker:
        start = tracker.current_bytes
        out = nf4_grouped_mm(x, stack, False, offsets)
        (out * out.detach()).sum().backward()  # a dense output gradient, as a loss gives
        step = tracker.end_step()
    return step.peak_bytes - start, out.detach(), x.grad


def test_a_group_dequantizes_that_share_of_the_stack_and_the_estimate_says_so():
    from memfit.prediction.qlora_levers import dequantized_bytes

    experts, rows, columns, tokens = 8, 256, 512, 16
    stack = quantize_expert_weight(torch.nn.Parameter(
        torch.randn(experts, rows, columns, generator=torch.Generator().manual_seed(3)), requires_grad=False))
    whole_peak, whole_out, whole_grad = _tracked_call(stack, 0, tokens)
    group_peak, group_out, group_grad = _tracked_call(stack, 2, tokens)
    assert torch.equal(group_out, whole_out) and torch.equal(group_grad, whole_grad)
    stack_bytes = experts * rows * columns * 4
    # the whole stack's fp32 copy against two experts' copy plus the fp32 absmax
    whole_part, group_part = (dequantized_bytes(stack_bytes // 4, experts, 4, g) for g in (0, 2))
    assert whole_part == stack_bytes and group_part == stack_bytes // 4 + stack_bytes // 64
    saved = whole_peak - group_peak
    assert abs(saved - (whole_part - group_part)) <= 0.05 * (whole_part - group_part), (whole_peak, group_peak)
