"""Which attention kernels keep the [batch, heads, seq, seq] probabilities for backward.

Eager attention saves the softmax probabilities of every layer: O(seq^2) bytes per head.
PyTorch SDPA with a fused kernel (CPU flash attention, CUDA flash / memory-efficient)
saves only O(seq) statistics and recomputes the probabilities in backward. These tests
measure it with saved_tensors_hooks on a tiny Llama, and a dispatch mode says which
kernel really ran.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM, LlamaConfig

SEQ, BATCH, HEADS, LAYERS = 128, 2, 4, 2


class AttentionOps(TorchDispatchMode):
    """Names of the softmax/attention operators that ran."""

    def __init__(self):
        super().__init__()
        self.names: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if "attention" in name or ("softmax" in name and "log_softmax" not in name):
            self.names.add(name)
        return func(*args, **(kwargs or {}))


def build(attention: str, dropout: float = 0.0, device: str = "cpu", kv_heads: int = 2):
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=kv_heads,
        vocab_size=256,
        max_position_embeddings=512,
        attention_dropout=dropout,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attention).to(device)
    model.train()
    return model


def saved_for_backward(model, padding: bool = False, device: str = "cpu"):
    """Unique storages saved for backward: list of (shape, bytes); and the kernels that ran."""
    input_ids = torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0)).to(device)
    attention_mask = torch.ones_like(input_ids)
    if padding:
        attention_mask[0, :10] = 0  # left padding: the kernel needs an explicit mask
    saved: dict[int, tuple[tuple[int, ...], int]] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved.setdefault(storage.data_ptr(), (tuple(tensor.shape), storage.nbytes()))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), AttentionOps() as ops:
        loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids).loss
    del loss
    return list(saved.values()), ops.names


def probabilities(saved) -> list[tuple[int, ...]]:
    return [shape for shape, _ in saved if shape == (BATCH, HEADS, SEQ, SEQ)]


def test_eager_attention_saves_the_probabilities_of_every_layer():
    saved, kernels = saved_for_backward(build("eager"))
    assert len(probabilities(saved)) == LAYERS
    assert kernels == {"aten._softmax.default"}


def test_sdpa_on_cpu_runs_flash_attention_and_saves_no_probabilities():
    eager, _ = saved_for_backward(build("eager"))
    saved, kernels = saved_for_backward(build("sdpa"))
    assert kernels == {"aten._scaled_dot_product_flash_attention_for_cpu.default"}
    assert probabilities(saved) == []
    probability_bytes = LAYERS * BATCH * HEADS * SEQ * SEQ * 4
    saving = sum(nbytes for _, nbytes in eager) - sum(nbytes for _, nbytes in saved)
    assert saving >= probability_bytes  # at least the probabilities of all layers


def test_sdpa_with_padding_keeps_only_the_mask_not_the_probabilities():
    saved, kernels = saved_for_backward(build("sdpa"), padding=True)
    assert kernels == {"aten._scaled_dot_product_flash_attention_for_cpu.default"}
    assert probabilities(saved) == []
    masks = [shape for shape, _ in saved if shape == (BATCH, 1, SEQ, SEQ)]
    assert masks  # one [batch, 1, seq, seq] mask shared by all heads


def test_sdpa_with_attention_dropout_falls_back_to_math_and_saves_probabilities():
    saved, kernels = saved_for_backward(build("sdpa", dropout=0.1))
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" not in kernels
    assert len(probabilities(saved)) >= LAYERS


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(
    ("dtype", "kv_heads"),
    # fp32 with grouped-query attention ran the math kernel on an H100 (torch 2.11): the
    # memory-efficient kernel lacks GQA and flash/cuDNN need 16-bit inputs.
    [(torch.bfloat16, 2), (torch.float16, 2), (torch.float32, HEADS)],
)
def test_sdpa_on_cuda_uses_a_fused_kernel_without_probabilities(dtype, kv_heads):
    model = build("sdpa", device="cuda", kv_heads=kv_heads).to(dtype)
    saved, kernels = saved_for_backward(model, device="cuda")
    fused = {
        "aten._scaled_dot_product_flash_attention.default",
        "aten._scaled_dot_product_efficient_attention.default",
        "aten._scaled_dot_product_cudnn_attention.default",
    }
    assert kernels & fused, kernels
    assert probabilities(saved) == []
