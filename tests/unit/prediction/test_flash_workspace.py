"""The flash kernel's backward buffers: counted on CUDA, where an H100 measured them, and nowhere else."""

from __future__ import annotations

from dataclasses import replace

from memfit.config_loading import load_config
from memfit.gpus import GpuSpec
from memfit.models.presets import resolve_model_config
from memfit.prediction.activations import Precision, architecture_of, flash_backward_workspace_bytes
from memfit.prediction.estimator import estimate
from memfit.units import GIB

H100 = GpuSpec("h100-measured", 85017493504, True, 100.0, 100.0, 32.0)
# benchmarks/gpu_truth.sh long-context on an H100 (2026-11-25, docs/benchmarks.md): four Llama-3.1-8B blocks,
# QLoRA r32 on every linear, 131,072 tokens, checkpoints offloaded, tiled MLP x32, chunked loss, no liger
MEASURED_MAX_ALLOCATED = 21_622_053_888
LONG_CONTEXT_QLORA = {"seq_len": 131072, "batch_size": 1, "dtype": "bf16", "precision": "bf16",
                      "gradient_checkpointing": "full", "lora_r": 32, "lora_targets": "all-linear", "quantize": "4bit",
                      "optimizer": "adamw-8bit", "activation_offload": True, "tiled_mlp": 32, "kernels": "none",
                      "loss_chunk_size": 1024}


def _four_blocks_of_llama_31_8b(directory) -> str:
    config = resolve_model_config("llama-3.1-8b")
    config.num_hidden_layers = 4
    config.save_pretrained(directory)
    return str(directory)


def test_long_context_qlora_estimate_meets_the_h100_allocator(tmp_path):
    model = _four_blocks_of_llama_31_8b(tmp_path)
    est = estimate(load_config(overrides={"model": model, **LONG_CONTEXT_QLORA}), gpu=H100)
    allocated = est.details["allocated_peak_bytes"]
    # without the flash backward's 4 GiB the estimate was 19.5 % short of the allocator
    assert abs(allocated / MEASURED_MAX_ALLOCATED - 1) <= 0.05, allocated / MEASURED_MAX_ALLOCATED


def test_the_workspace_is_the_fp32_dq_and_the_expanded_dk_dv_of_grouped_query_attention():
    arch = architecture_of(resolve_model_config("llama-3.1-8b"))  # 32 query heads, 8 key-value heads of 128
    bf16 = Precision(2, 2, 2, 0, 0)
    tokens = 131072
    assert flash_backward_workspace_bytes(arch, bf16, tokens, "sdpa", "cuda") == (4 + 2 * 2) * 4096 * tokens  # 4 GiB
    assert flash_backward_workspace_bytes(arch, bf16, tokens, "sdpa", "cuda") == 4 * GIB
    # the CPU's kernels, fp32 attention (the memory-efficient kernel) and eager attention allocate none of it
    assert flash_backward_workspace_bytes(arch, bf16, tokens, "sdpa", "cpu") == 0
    assert flash_backward_workspace_bytes(arch, Precision(4, 4, 4, 0, 0), tokens, "sdpa", "cuda") == 0
    assert flash_backward_workspace_bytes(arch, bf16, tokens, "eager", "cuda") == 0
    # without grouped-query attention dK and dV are computed at their own width
    mha = replace(arch, kv_heads=arch.heads)
    assert flash_backward_workspace_bytes(mha, bf16, tokens, "sdpa", "cuda") == 4 * 4096 * tokens


def test_fp32_sdpa_with_grouped_query_attention_on_cuda_is_estimated_as_the_math_kernel(tmp_path):
    """No fp32 flash kernel and no GQA in the memory-efficient one: PyTorch's math kernel keeps the probabilities."""
    from tiny_llama import tiny_llama_config

    def activations(kv_heads: int, attention: str, precision: str = "fp32", gpu=H100) -> int:
        directory = tmp_path / f"kv{kv_heads}"
        hf_config = tiny_llama_config(hidden=128)
        hf_config.num_key_value_heads = kv_heads
        hf_config.save_pretrained(directory)
        config = load_config(overrides={"model": str(directory), "seq_len": 2048, "batch_size": 1,
                                        "precision": precision, "attention": attention})
        return estimate(config, gpu=gpu).breakdown["activations"]

    assert activations(2, "sdpa") == activations(2, "eager")  # GQA in fp32: the math kernel, as eager
    assert activations(4, "sdpa") < activations(4, "eager") / 2  # no GQA: the memory-efficient kernel
    assert activations(2, "sdpa", "bf16") < activations(2, "eager", "bf16") / 2  # bf16: the flash kernel
