"""LoRA and QLoRA: gradients and optimizer state only for adapters; same start; save and merge."""

from __future__ import annotations

import warnings

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from memfit.config import LoraConfig
from memfit.errors import UsageError
from memfit.techniques import lora as lora_module
from memfit.techniques.lora import (
    LoraSummary,
    apply_lora,
    load_adapter_weights,
    quantization_config,
    resolve_lora_targets,
    save_adapter,
)
from memfit.techniques.lora_merge import merge_and_save
from tiny_llama import tiny_llama

pytest.importorskip("peft")

LLAMA_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")



def batch(seed: int = 0, rows: int = 4, seq: int = 32) -> torch.Tensor:
    return torch.randint(0, 256, (rows, seq), generator=torch.Generator().manual_seed(seed))


def loss_of(model, input_ids) -> torch.Tensor:
    return model(input_ids=input_ids, labels=input_ids).loss


def gradient_and_optimizer_bytes(model, optimizer) -> tuple[int, int]:
    gradients = sum(p.grad.nbytes for p in model.parameters() if p.grad is not None)
    states = sum(
        value.nbytes
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor) and value.numel() > 1  # the moments, not the step counter
    )
    return gradients, states


def one_step(model) -> tuple[int, int]:
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    loss_of(model, batch()).backward()
    optimizer.step()
    return gradient_and_optimizer_bytes(model, optimizer)


def test_gradients_and_adam_state_exist_only_for_the_adapters():
    full_model = tiny_llama()
    full_bytes = sum(p.nbytes for p in full_model.parameters())
    full_gradients, full_states = one_step(full_model)

    model, summary = apply_lora(tiny_llama(), LoraConfig(lora_r=4), gradient_checkpointing=False)
    adapter_bytes = sum(p.nbytes for p in model.parameters() if p.requires_grad)
    lora_gradients, lora_states = one_step(model)

    assert full_gradients == full_bytes and full_states == 2 * full_bytes
    assert lora_gradients == adapter_bytes and lora_states == 2 * adapter_bytes
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)
    assert lora_gradients + lora_states < 0.2 * (full_gradients + full_states)
    assert summary.trainable_parameters * 4 == adapter_bytes


@pytest.mark.numerics
def test_initial_loss_equals_the_base_model():
    base = tiny_llama()
    input_ids = batch()
    with torch.no_grad():
        expected = loss_of(base, input_ids)
    model, _ = apply_lora(base, LoraConfig(lora_r=8), gradient_checkpointing=False)
    with torch.no_grad():
        assert torch.equal(loss_of(model, input_ids), expected)  # B starts at zero


def test_auto_targets_every_block_linear_but_not_the_head():
    model = tiny_llama()
    targets = resolve_lora_targets(model, "auto")
    assert len(targets) == 2 * len(LLAMA_LINEARS)
    assert {name.rsplit(".", 1)[-1] for name in targets} == set(LLAMA_LINEARS)
    assert "lm_head" not in targets and resolve_lora_targets(model, "all-linear") == targets
    assert resolve_lora_targets(model, "q_proj, v_proj") == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.v_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.self_attn.v_proj",
    ]


def test_unknown_target_lists_the_valid_names():
    with pytest.raises(UsageError, match="valid names: .*down_proj.*q_proj") as error:
        resolve_lora_targets(tiny_llama(), "q_proj,query")
    assert "query" in str(error.value) and "lm_head" not in str(error.value)


def test_gpt2_conv1d_layers_get_adapters_and_the_tied_head_does_not():
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=64))
    targets = resolve_lora_targets(model, "auto")
    assert {name.rsplit(".", 1)[-1] for name in targets} == {"c_attn", "c_proj", "c_fc"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT notes that Conv1D stores weights transposed
        _, summary = apply_lora(model, LoraConfig(lora_r=2), gradient_checkpointing=False)
    assert summary.modules == len(targets) == 8


def test_summary_line():
    summary = LoraSummary(rank=16, modules=14, trainable_parameters=520_000, total_parameters=124_000_000)
    assert summary.describe() == "LoRA r=16 on 14 modules: 0.52M trainable of 124M (0.42%)"


def test_quantization_configs():
    assert quantization_config(LoraConfig(lora_r=8), torch.float32) is None
    four = quantization_config(LoraConfig(lora_r=8, quantize="4bit"), torch.bfloat16)
    assert four.load_in_4bit and four.bnb_4bit_quant_type == "nf4" and four.bnb_4bit_use_double_quant
    assert four.bnb_4bit_compute_dtype == torch.bfloat16
    assert quantization_config(LoraConfig(lora_r=8, quantize="8bit"), torch.float32).load_in_8bit


def test_missing_bitsandbytes_says_how_to_install(monkeypatch):
    real = lora_module.importlib.util.find_spec
    monkeypatch.setattr(
        lora_module.importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else real(name, *a)
    )
    with pytest.raises(UsageError, match=r"pip install memfit\[bnb\]"):
        quantization_config(LoraConfig(lora_r=8, quantize="4bit"), torch.float32)


def train(model, steps: int, lr: float = 1e-2) -> list[float]:
    model.train()  # as the loop does; from_pretrained returns a model in eval mode
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    input_ids = batch(seed=3, rows=2, seq=32)
    losses = []
    for _ in range(steps):
        loss = loss_of(model, input_ids)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama().save_pretrained(directory)
    return directory


def load_4bit(directory):
    pytest.importorskip("bitsandbytes")
    config = quantization_config(LoraConfig(lora_r=8, quantize="4bit"), torch.float32)
    return AutoModelForCausalLM.from_pretrained(directory, quantization_config=config, device_map={"": "cpu"})


@pytest.mark.numerics
@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
def test_qlora_4bit_trains_on_cpu(saved_llama, checkpointing):
    base = load_4bit(saved_llama)
    assert type(base.model.layers[0].self_attn.q_proj.weight).__name__ == "Params4bit"
    if checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model, summary = apply_lora(base, LoraConfig(lora_r=8, quantize="4bit"), gradient_checkpointing=checkpointing)
    assert summary.quantize == "4bit" and summary.describe().startswith("QLoRA (4-bit base) r=8 on 14 modules")

    # The value that matters: the 4-bit model computes what its dequantized weights compute,
    # and the adapters get the same gradients as on that fp32 model.
    reference = dequantized_copy(saved_llama, base)
    if checkpointing:
        reference.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    torch.manual_seed(1)
    reference, _ = apply_lora(reference, LoraConfig(lora_r=8), gradient_checkpointing=checkpointing)
    adapters = {name: p for name, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():  # the same adapters, with B non-zero so every adapter gradient is non-trivial
        for name, p in reference.named_parameters():
            if p.requires_grad:
                torch.nn.init.normal_(p, std=0.05)
                adapters[name].copy_(p)
    model.train(), reference.train()
    input_ids = batch(seed=3, rows=2, seq=32)
    loss, expected_loss = loss_of(model, input_ids), loss_of(reference, input_ids)
    loss.backward()
    expected_loss.backward()
    print(f"QLoRA loss {loss.item():.7f}, on the dequantized base {expected_loss.item():.7f}")
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
    for name, p in reference.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(adapters[name].grad, p.grad, rtol=1e-4, atol=1e-6, msg=name)
    assert all(p.grad is None for p in model.parameters() if not p.requires_grad)


def dequantized_copy(directory, quantized):
    """The fp32 model whose quantized linear weights are replaced by the 4-bit model's, dequantized."""
    import bitsandbytes.functional as bnb_functional

    model = AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    quantized_modules = dict(quantized.named_modules())
    replaced = 0
    with torch.no_grad():
        for name, module in model.named_modules():
            weight = getattr(quantized_modules.get(name), "weight", None)
            if type(weight).__name__ == "Params4bit":
                module.weight.copy_(bnb_functional.dequantize_4bit(weight.data, weight.quant_state).float())
                replaced += 1
    assert replaced == 14  # every linear of the 2 blocks
    return model


@pytest.mark.numerics
def test_merge_and_save_round_trip(tmp_path):
    model, _ = apply_lora(tiny_llama(), LoraConfig(lora_r=4, lora_alpha=8), gradient_checkpointing=False)
    train(model, steps=3)  # B is no longer zero: the merge must fold a real update in
    input_ids = batch(seed=5)
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=input_ids).logits

    merge_and_save(model, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=input_ids).logits, expected, rtol=1e-4, atol=1e-5)
    assert not any("lora" in name for name, _ in merged.named_parameters())
    with torch.no_grad():  # the live model is left as it was
        torch.testing.assert_close(model(input_ids=input_ids).logits, expected, rtol=0, atol=0)


def test_adapter_save_and_load_round_trip(tmp_path):
    model, _ = apply_lora(tiny_llama(), LoraConfig(lora_r=4), gradient_checkpointing=False)
    train(model, steps=2)
    save_adapter(model, tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()

    fresh, _ = apply_lora(tiny_llama(), LoraConfig(lora_r=4), gradient_checkpointing=False)
    load_adapter_weights(fresh, tmp_path / "adapter")
    input_ids = batch(seed=6)
    with torch.no_grad():
        torch.testing.assert_close(fresh(input_ids=input_ids).logits, model(input_ids=input_ids).logits)


def test_merge_of_a_4bit_base_writes_a_dequantized_model(saved_llama, tmp_path):
    model, _ = apply_lora(load_4bit(saved_llama), LoraConfig(lora_r=4, quantize="4bit"), gradient_checkpointing=False)
    train(model, steps=2)
    input_ids = batch(seed=7)
    with torch.no_grad():  # still in train mode (lora_dropout is 0): bitsandbytes' exact fp32 path
        expected = model(input_ids=input_ids).logits

    merge_and_save(model, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert getattr(merged.config, "quantization_config", None) is None
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=input_ids).logits, expected, rtol=1e-4, atol=1e-5)

    # An eval-mode forward on a CPU with AVX512-BF16 repacks the 4-bit weights in place, for
    # bitsandbytes' bf16 inference kernel (slightly lossy); the merge must undo the packing.
    model.eval()
    with torch.no_grad():
        model(input_ids=input_ids)
    merge_and_save(model, tmp_path / "merged-after-eval")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged-after-eval")
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=input_ids).logits, expected, rtol=1e-2, atol=1e-2)
