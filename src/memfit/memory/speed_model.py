"""How long one training step takes, predicted: the speed model the planner ranks configurations by.

`estimated_step_seconds` turns a configuration into seconds from the hardware FLOPs it runs
(`memfit.models.flops`), the device's rate and the costs that FLOPs do not show (small
micro-batches, 8-bit optimizer state on a CPU, the chunked loss, host transfers). Each
constant below cites the measurement it comes from; every training run logs this
prediction beside the measured step time, so the model is checked on every run.
"""

from __future__ import annotations

from typing import Any

from memfit.config import TrainConfig
from memfit.gpus import GpuSpec
from memfit.memory.estimator import Estimate

UTILISATION = 0.45
"""Fraction of the GPU's peak rate a well-fed training step reaches."""
NOMINAL_TFLOPS = 100.0
"""Rate assumed without a GPU preset: only relative speeds are meaningful then."""
FEEDING_TOKENS = {"cuda": 512, "cpu": 80}
"""Tokens per micro-batch at which a step runs at half its full rate (`tokens / (tokens + this)`).

On a GPU a small micro-batch leaves it idle between small kernels. A CPU has no launch
latency to hide and loses much less: with benchmarks/bench_speed_ranking.py (22.9M-parameter
Llama, seq 128, CPU, 2 cores, one thread, 2026-11-23) micro-batch 1 x 4 ran at 0.56 to 0.83x
of 4 x 1 over six paired configurations (median 0.72), which 80 tokens reproduces (0.71x);
the GPU figure of 512 predicted 0.40x there.
"""
OPTIMIZER_STEP_FLOPS = {("cpu", "8bit"): 1300.0}
"""Extra cost of one optimizer step per trainable parameter over AdamW, in FLOPs at the step's matmul rate.

8-bit AdamW on a CPU dequantizes and requantizes its state element by element in the
bitsandbytes CPU code: benchmarks/bench_speed_ranking.py (22.9M-parameter Llama, seq 128,
CPU, 2 cores, one thread, 2026-11-23) measured it at 0.73x of AdamW without checkpointing
and 0.74x with full checkpointing; 1300 FLOPs per parameter gives 0.74x and 0.75x (the
planner's former `x 1.01` predicted 0.99x). On a GPU its fused kernel is about as fast as
AdamW's (not measured by memfit): a 1 % tie-break there keeps plain AdamW first where both fit.
"""
CHUNKED_LOSS_COST = {"cpu": 1.2}
"""How much more than its FLOPs the chunked loss's recomputed head costs, by device (1 where absent).

On a CPU the per-chunk checkpoint and fp32 projection are partly memory-bound: same
benchmark, the chunked loss ran at 0.67 to 0.88x of full logits over six paired
configurations (median 0.83, 0.74x for the plain one) against 0.85 to 0.87x from its FLOPs
alone; 1.2x its FLOPs gives 0.82 to 0.84x. Not measured on a GPU.
"""


def estimated_step_seconds(changes: dict[str, Any], config: TrainConfig, est: Estimate, gpu: GpuSpec | None,
                           hf_config: Any, *, device: str | None = None) -> float:
    """Seconds of one optimizer step: FLOPs over the device's rate, plus host transfers.

    Training FLOPs are the hardware FLOPs of `memfit.models.flops.flops_per_token`: every
    matmul forward and backward (LoRA: no weight gradients for the frozen base), attention,
    and what is recomputed (the checkpointed blocks' forward, the head again with chunked
    loss), + one MLP forward per step with tiled MLP, QLoRA dequantization +25 %. Small
    micro-batches use the device less well (FEEDING_TOKENS), 8-bit AdamW costs extra per
    parameter on a CPU (OPTIMIZER_STEP_FLOPS), and the chunked loss more than its FLOPs
    there (CHUNKED_LOSS_COST). Host transfers (activation offload, optimizer offload, paged
    state) are added in full at the host link's rate: an upper bound, since their copies
    overlap compute.

    `device` is "cpu" or "cuda"; by default "cpu" without a GPU preset (a plan with only a
    memory budget runs where memory is the host's), "cuda" with one.
    """
    from memfit.memory.activations import architecture_of
    from memfit.models.flops import flops_per_token

    device = device or ("cpu" if gpu is None else "cuda")
    arch = architecture_of(hf_config)
    seq = changes.get("seq_len", config.data.seq_len)
    micro = changes.get("batch_size", config.training.batch_size)
    accumulation = changes.get("gradient_accumulation_steps", 1)
    tokens = micro * seq * accumulation
    lora_rank = changes.get("lora_r", config.lora.lora_r)
    chunked = bool(changes.get("loss_chunk_size", 0))
    per_token = flops_per_token(hf_config, seq, lora_rank=lora_rank,
                                checkpointing=changes.get("gradient_checkpointing", "off"), chunked_loss=chunked)
    hardware = per_token.hardware
    if chunked:
        hardware += (CHUNKED_LOSS_COST.get(device, 1.0) - 1.0) * per_token.head_forward
    mlp_forward = (3 if arch.gated_mlp else 2) * 2 * arch.hidden * arch.intermediate * arch.layers
    tiled = mlp_forward if changes.get("tiled_mlp") else 0
    flops = tokens * (hardware + tiled)
    if changes.get("quantize", "none") == "4bit":
        flops *= 1.25
    tflops = gpu.peak_tflops if gpu is not None else NOMINAL_TFLOPS
    rate = tflops * 1e12 * UTILISATION
    feeding = micro * seq / (micro * seq + FEEDING_TOKENS[device])
    seconds = flops / (rate * feeding)
    trainable = est.details["trainable_parameter_count"]
    if changes.get("optimizer", "adamw").endswith("8bit"):
        if (device, "8bit") in OPTIMIZER_STEP_FLOPS:
            seconds += trainable * OPTIMIZER_STEP_FLOPS[(device, "8bit")] / rate
        else:
            seconds *= 1.01
    link = (gpu.host_link_gbps if gpu is not None else 16.0) * 1e9
    if changes.get("optimizer_offload"):
        seconds += 8 * trainable / link + trainable / 2e9  # gradients down, weights up, CPU AdamW
    if changes.get("activation_offload"):
        seconds += accumulation * est.details.get("pcie_bytes_per_micro_batch", 0) / link
    if changes.get("optimizer") == "paged-adamw-8bit" and gpu is not None:
        # the state pages come in for the step and go out again for the next forward
        seconds += 2 * est.host_breakdown.get("optimizer_states", 0) / link
    return seconds
