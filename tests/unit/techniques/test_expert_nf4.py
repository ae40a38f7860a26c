"""QLoRA on fused MoE experts: the 3-D expert stacks held in NF4 and dequantized one at a time.

The reference is the same model with every NF4 stack dequantized into a plain parameter (the weights the NF4
bytes stand for): logits and every adapter gradient equal to fp32 rounding. Memory: the NF4 bytes are what the
estimate says to the byte and about a quarter of bf16's; only one dequantized stack is ever live, which a twin
that keeps the dequantized stack for backward breaks (more live, a higher tracked peak). A QLoRA run resumes
to the uninterrupted run's adapters, its NF4 base rebuilt from the model's weights.
"""

from __future__ import annotations

import copy
import logging
import math

import pytest
import torch
from torch import nn

from memfit.config import LoraConfig
from memfit.models.experts import EXPERT_PARAMETERS
from memfit.techniques import expert_quant
from memfit.techniques.expert_quant import dequantized, is_nf4
from memfit.techniques.lora import apply_lora, quantization_config
from memfit.techniques.nf4_state import nf4_bytes
from model_zoo import ZOO, build_model, randomize_adapters
from tracked_step import tracked_step

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

FAMILIES = ["qwen3_moe", "gpt_oss", "mixtral"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> a directory with its tiny model, saved once for this file's QLoRA loads."""
    root = tmp_path_factory.mktemp("nf4")
    directories = {}
    for family in FAMILIES:
        build_model(family).save_pretrained(root / family)
        directories[family] = root / family
    return directories


def _tokens(seed: int = 0, rows: int = 2, length: int = 24) -> torch.Tensor:
    return torch.randint(0, 256, (rows, length), generator=torch.Generator().manual_seed(seed))


def _qlora(directory, targets: str = "auto", caplog=None):
    """The tiny model loaded 4-bit by bitsandbytes and wrapped by memfit's QLoRA, adapters' B made non-zero."""
    from transformers import AutoModelForCausalLM

    lora = LoraConfig(lora_r=2, quantize="4bit", lora_targets=targets)
    base = AutoModelForCausalLM.from_pretrained(directory, quantization_config=quantization_config(lora, torch.float32),
                                                device_map={"": "cpu"})
    model, _ = apply_lora(base, lora, gradient_checkpointing=False)
    randomize_adapters(model)
    return model


def _nf4_stacks(model) -> list[torch.Tensor]:
    return [w for m in model.modules() for w in (getattr(m, n, None) for n in EXPERT_PARAMETERS) if is_nf4(w)]


def _dequantized_reference(model):
    """A copy whose NF4 stacks are plain (frozen) parameters holding the dequantized values.

    The copy's forwards are set up anew: a deep copy keeps the bound forwards of the original's modules. Experts
    without adapters run transformers' own forward, adapted ones the split forward of their own adapters.
    """
    from memfit.techniques.expert_lora import apply_split_lora

    reference = copy.deepcopy(model)
    for module in reference.modules():
        module.__dict__.pop("forward", None)
    for module in reference.modules():
        for name in EXPERT_PARAMETERS:
            weight = getattr(module, name, None)
            if is_nf4(weight):
                setattr(module, name, nn.Parameter(dequantized(weight), requires_grad=False))
    assert not _nf4_stacks(reference)
    apply_split_lora(reference)
    return reference


def _logits_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    output = model(input_ids=tokens, labels=tokens)
    output.loss.backward()
    return output.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-6) -> bool:
    return bool(expected.norm() > 0) and bool((actual - expected).norm() <= rtol * expected.norm())


@pytest.mark.parametrize("family", FAMILIES)
def test_nf4_experts_equal_a_model_holding_the_dequantized_weights(family, saved, caplog):
    with caplog.at_level(logging.INFO, logger="memfit"):
        model = _qlora(saved[family])
    assert any("experts nf4 in 2 of 2 experts modules (4 fused weights)" in r.message for r in caplog.records)
    assert len(_nf4_stacks(model)) == 4 and expert_quant.experts_precision(model) == "experts nf4"
    reference = _dequantized_reference(model)
    assert expert_quant.experts_precision(reference) == "experts fp32"
    tokens = _tokens()
    logits, grads = _logits_and_grads(model, tokens)
    expected_logits, expected = _logits_and_grads(reference, tokens)
    assert _close(logits, expected_logits)
    assert set(grads) == set(expected) and all("lora_" in name for name in grads)  # the NF4 base gets none
    # layer 0's attention adapters see the experts' input gradient of layer 0 and 1: the backward's transpose
    assert any("layers.0.self_attn" in name for name in grads)
    for name, grad in expected.items():
        assert _close(grads[name], grad), name


def test_experts_without_adapters_are_held_in_nf4_too(saved):
    model = _qlora(saved["qwen3_moe"], targets="q_proj,v_proj")
    assert len(_nf4_stacks(model)) == 4
    reference = _dequantized_reference(model)
    tokens = _tokens()
    (logits, grads), (expected_logits, expected) = _logits_and_grads(model, tokens), _logits_and_grads(reference, tokens)
    assert _close(logits, expected_logits)
    for name, grad in expected.items():
        assert _close(grads[name], grad), name


def test_merge_writes_the_dequantized_experts_with_their_adapters_folded_in(saved, tmp_path):
    """The merged model (plain transformers, no bitsandbytes) computes what the QLoRA model computes."""
    from transformers import AutoModelForCausalLM

    from memfit.techniques.lora_merge import merge_and_save

    model = _qlora(saved["gpt_oss"])
    tokens = _tokens()
    with torch.no_grad():
        expected = model(input_ids=tokens).logits
    merge_and_save(model, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert merged.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float32
    with torch.no_grad():
        assert _close(merged(input_ids=tokens).logits, expected, 1e-5)


def test_experts_held_as_mxfp4_blocks_stay_as_loaded_and_the_log_says_why():
    """gpt-oss loaded with its MXFP4 checkpoint keeps packed uint8 blocks run by their own kernel: left alone."""
    from transformers.integrations.mxfp4 import Mxfp4GptOssExperts

    from memfit.techniques.expert_lora import quantize_fused_experts

    model = build_model("gpt_oss").requires_grad_(False)  # a QLoRA base is frozen
    model.model.layers[0].mlp.experts = Mxfp4GptOssExperts(model.config)
    blocks = model.model.layers[0].mlp.experts.gate_up_proj
    line = quantize_fused_experts(model)
    assert line.startswith("experts nf4 in 1 of 2 experts modules (2 fused weights); kept as loaded: 1 ("), line
    assert "gate_up_proj held as torch.uint8 blocks (MXFP4" in line
    assert model.model.layers[0].mlp.experts.gate_up_proj is blocks
    assert expert_quant.experts_precision(model) == "experts nf4, experts uint8 blocks"


def test_tiled_experts_over_nf4_experts_equal_the_untiled_nf4_model(saved):
    """Tiled experts (--tiled-mlp) run the NF4 forward per tile and recompute it in backward: same sums."""
    from memfit.techniques.tiled_experts import apply_tiled_experts

    plain, tiled = _qlora(saved["gpt_oss"]), _qlora(saved["gpt_oss"])
    adapters = {n: p for n, p in plain.named_parameters() if "lora_" in n}
    with torch.no_grad():
        for name, parameter in tiled.named_parameters():
            if name in adapters:
                parameter.copy_(adapters[name])
    assert apply_tiled_experts(tiled, 3).startswith("3 tiles on the experts of 2 of 2 MoE layers")
    tokens = _tokens()
    (logits, grads), (expected_logits, expected) = _logits_and_grads(tiled, tokens), _logits_and_grads(plain, tokens)
    assert _close(logits, expected_logits, 1e-5)
    assert set(grads) == set(expected)
    for name, grad in expected.items():
        assert _close(grads[name], grad, 1e-5), name


def test_fault_twin_a_wrong_input_gradient_is_caught(saved, monkeypatch):
    """The same comparison with a backward that doubles the input gradient fails: the test above can fail."""
    model = _qlora(saved["qwen3_moe"])
    reference = _dequantized_reference(model)
    tokens = _tokens()
    _, expected = _logits_and_grads(reference, tokens)
    original = expert_quant._Nf4GroupedMm.backward

    def doubled(ctx, grad_output):
        grad_input, *rest = original(ctx, grad_output)
        return (2 * grad_input, *rest)

    monkeypatch.setattr(expert_quant._Nf4GroupedMm, "backward", staticmethod(doubled))
    _, grads = _logits_and_grads(model, tokens)
    assert not all(_close(grads[name], grad) for name, grad in expected.items())


def test_nf4_bytes_are_the_estimates_to_the_byte_and_a_quarter_of_bf16():
    import bitsandbytes.functional as bnb_functional

    from memfit.memory.tracker import MemoryTracker
    from memfit.prediction.experts import nf4_stack_bytes as predicted_bytes

    for shape in [(4, 64, 32), (8, 100, 30), (16, 256, 32)]:
        tracker = MemoryTracker(torch.device("cpu"))
        with tracker:
            # bitsandbytes keeps one 1 KiB map per device, shared by every quantization: let the tracker see it
            # (and the 16-bit weight) before counting what one stack adds
            bnb_functional.quantize_4bit(torch.randn(64), blocksize=64, compress_statistics=True, quant_type="nf4")
            weight = nn.Parameter(torch.randn(shape, generator=torch.Generator().manual_seed(0)).bfloat16(),
                                  requires_grad=False)
            before = tracker.current_bytes
            nf4 = expert_quant.quantize_expert_weight(weight)
            measured = tracker.current_bytes - before
        assert measured == nf4_bytes(nf4) == predicted_bytes(weight.numel()), shape
        assert 0.25 < measured / weight.nbytes < 0.27 + 1100 / weight.nbytes, shape
        assert torch.equal(expert_quant.quantize_expert_weight(weight).data, nf4.data)  # deterministic: a resume rebuilds it


def _big_experts_model():
    """Qwen3-MoE with 16 experts of width 128: the expert stacks outweigh the activations, as in real MoEs."""
    from transformers import AutoModelForCausalLM

    config = ZOO["qwen3_moe"]()
    config.num_experts, config.moe_intermediate_size = 16, 128
    torch.manual_seed(0)
    model, _ = apply_lora(AutoModelForCausalLM.from_config(config), LoraConfig(lora_r=4), gradient_checkpointing=False)
    from memfit.techniques.expert_lora import quantize_fused_experts

    assert quantize_fused_experts(model).startswith("experts nf4 in 2 of 2")
    randomize_adapters(model)
    return model


class _KeepsDequantized(torch.autograd.Function):
    """The fault twin: saves the dequantized stack for backward, as a plain grouped matmul of it would."""

    @staticmethod
    def forward(ctx, x, weight, transposed, offsets, dtype):
        stack = expert_quant._as_in_out(expert_quant.dequantized(weight, dtype), transposed)
        ctx.save_for_backward(stack, offsets)
        ctx.input_dtype = x.dtype
        return expert_quant._grouped_mm(x, stack, offsets)

    @staticmethod
    def backward(ctx, grad_output):
        stack, offsets = ctx.saved_tensors
        return expert_quant._grouped_mm(grad_output, stack.transpose(-2, -1), offsets).to(ctx.input_dtype), \
            None, None, None, None


def _live_stacks_and_peak(model, monkeypatch) -> tuple[int, int]:
    """(most dequantized stacks the tracker saw alive at once, tracked peak bytes) over one forward and backward."""
    from memfit.memory.tracker import MemoryTracker

    tracker = MemoryTracker(torch.device("cpu"))
    # by size: a stack is dequantized flat (nf4_state.dequantize_nf4), then seen in its 3-D shape
    sizes = {w.quant_state.shape.numel() for w in _nf4_stacks(model)}
    most = 0
    original = expert_quant.dequantized

    def counted(weight, dtype=None):
        nonlocal most
        stack = original(weight, dtype)
        live = [t for t in tracker.live_tensors() if math.prod(t.shape) in sizes and t.op.endswith("dequantize_4bit")]
        most = max(most, len(live))
        return stack

    monkeypatch.setattr(expert_quant, "dequantized", counted)
    step = tracked_step(model, _tokens(rows=1, length=16), tracker)
    monkeypatch.setattr(expert_quant, "dequantized", original)
    return most, step.peak_bytes


def test_one_dequantized_stack_is_live_and_a_twin_that_keeps_them_peaks_higher(monkeypatch):
    model = _big_experts_model()
    stacks = [dequantized(w).nbytes for w in _nf4_stacks(model)]
    most, peak = _live_stacks_and_peak(model, monkeypatch)
    assert most == 1, f"{most} dequantized stacks alive at once"

    twin = _big_experts_model()  # built alike (a deep copy would keep the original's bound forwards)
    monkeypatch.setattr(expert_quant, "_Nf4GroupedMm", _KeepsDequantized)
    twin_most, twin_peak = _live_stacks_and_peak(twin, monkeypatch)
    assert twin_most == len(stacks) == 4
    # the twin holds every stack through backward; the real one at most the largest, for one matmul
    assert twin_peak - peak >= sum(stacks) - max(stacks), (peak, twin_peak, stacks)


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_qlora_estimate_is_within_the_decoders_band_of_the_tracked_step(family, text_file, tmp_path):
    """docs/accuracy.md's MoE shapes (4 layers, hidden 128, 8 experts of width 96) under QLoRA as it runs: bf16,
    full checkpointing, every expert stack in NF4; a `memfit profile` step against the analytical estimate."""
    import sys
    from pathlib import Path

    from transformers import AutoModelForCausalLM

    from memfit.config_loading import load_config
    from memfit.models.tiny import byte_tokenizer
    from memfit.prediction.estimator import ERROR_BAND
    from tracked_against_estimate import peaks_and_estimates

    benchmarks = Path(__file__).resolve().parents[3] / "benchmarks"
    sys.path.insert(0, str(benchmarks))
    try:
        import bench_moe_estimate_accuracy as bench
    finally:
        sys.path.remove(str(benchmarks))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(bench.architectures()[family]).save_pretrained(tmp_path / "model")
    byte_tokenizer().save_pretrained(tmp_path / "model")
    config = load_config(overrides=dict(
        model=str(tmp_path / "model"), dataset=str(text_file), seq_len=128, batch_size=2, lora_r=8, quantize="4bit",
        dtype="bf16", gradient_checkpointing="full", max_steps=2, report=False, output_dir=str(tmp_path / "run")))
    peaks, estimates = peaks_and_estimates({family: config})
    assert abs(estimates[family] / peaks[family] - 1) <= ERROR_BAND["analytical"], (estimates, peaks)


def test_a_qlora_run_on_nf4_experts_resumes_exactly(text_file, tmp_path, caplog):
    """Only the adapters are saved; the resumed run rebuilds the NF4 experts from the model and ends with the
    uninterrupted run's adapter weights (SGD, no clipping: a wrong base would change them)."""
    import json
    import shutil

    from safetensors.torch import load_file

    from memfit.checkpoint_files import list_checkpoints
    from memfit.config_loading import load_config
    from memfit.train.loop import train
    from model_zoo import save_family

    directory = save_family("mixtral", tmp_path / "model")

    def config(out, **extra):
        return load_config(overrides=dict(
            model=str(directory), dataset=str(text_file), seq_len=32, batch_size=2, max_steps=2, lora_r=4,
            quantize="4bit", packing=False, report=False, optimizer="sgd", momentum=0.0, max_grad_norm=0.0, lr=1.0,
            warmup_steps=0, lr_schedule="constant", output_dir=str(out), **extra))

    with caplog.at_level(logging.INFO, logger="memfit"):
        straight = train(config(tmp_path / "straight"))
    assert any("experts nf4 in 2 of 2" in r.message for r in caplog.records)
    start = json.loads((tmp_path / "straight" / "metrics.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and start["experts_weights"] == "experts nf4"  # the metrics say what ran
    train(config(tmp_path / "killed", save_every=1))
    checkpoints = list_checkpoints(tmp_path / "killed")
    for checkpoint in checkpoints:
        if checkpoint.name != "step-1":
            shutil.rmtree(checkpoint)
        else:
            saved_tensors = [name for path in checkpoint.rglob("*.safetensors") for name in load_file(str(path))]
            assert saved_tensors and not any("experts" in n and "lora_" not in n for n in saved_tensors), saved_tensors
    shutil.rmtree(tmp_path / "killed" / "final")
    (tmp_path / "killed" / "metrics.jsonl").unlink()
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="memfit"):
        resumed = train(config(tmp_path / "killed", resume="auto"))
    assert any("experts nf4 in 2 of 2" in r.message for r in caplog.records)  # rebuilt on load
    expected = load_file(str(straight.final_dir / "adapter_model.safetensors"))
    got = load_file(str(resumed.final_dir / "adapter_model.safetensors"))
    assert any(float(t.abs().max()) > 0 for n, t in expected.items() if "experts" in n and "lora_B" in n)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=0, msg=name)
