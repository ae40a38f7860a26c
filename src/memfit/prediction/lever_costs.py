"""Time the frozen-weight levers of a LoRA/QLoRA plan add to a step (prediction/qlora_levers.py has their bytes).

`speed_model.estimated_step_seconds` adds `lever_model_seconds` to a step's seconds before this device's
calibration multiplies them (as it adds the offload traffic), and `trade_offs` prints
`speed_model.lever_step_seconds`, the same figures calibrated, so a plan's predicted step time moves by exactly
what its trade-offs say each lever costs:

- `--embedding-on-host` (techniques/host_embedding.py), per micro-batch: the token ids go to the host (a
  synchronisation), their rows are gathered and copied into pinned memory there, and the rows cross the host
  link: `tokens x (8 / link + hidden x bytes x (1 / link + 2 / HOST_COPY_BYTES_PER_SECOND)) + HOST_SYNC_SECONDS`.
  Backward never reaches the frozen table, and the embedding is outside the checkpointed blocks, so nothing runs
  again. On a CPU the table already is where the step runs (no copy, no synchronisation): 0.
- `--quantize-head` (techniques/nf4_head.py): each call of the head dequantizes all of it (vocab x hidden
  weights, a tile at a time) in forward and again for the input gradient in backward; under the chunked loss
  each chunk is checkpointed, so its forward runs a second time in backward: 3 passes per chunk, 2 unchunked.
  `weights x passes x chunks per micro-batch x accumulation`, at the dequantization rate (CUDA: memory-bound,
  DEQUANT_BYTES_PER_WEIGHT at DEQUANT_BANDWIDTH_SHARE of the card's bandwidth; CPU: DEQUANT_CPU_FLOPS a weight
  at the step's matmul rate). Losing liger's fused linear cross-entropy costs no time here: the speed model
  prices the fused loss as it prices the chunked one (both project the head again in backward).
- `--expert-dequant-group G` (techniques/expert_dequant_groups.py): the same weights are dequantized as for a
  whole stack, but each call of an NF4 stack runs ceil(E / G) group iterations (dequantization, slices, one
  grouped matmul) instead of one and reads the expert offsets on the host once: per call
  `(ceil(E / G) - 1) x GROUP_SECONDS + HOST_SYNC_SECONDS`, over every groupable stack and every call (forward,
  the recompute under full checkpointing, backward, one more forward per tile under tiled experts).
"""

from __future__ import annotations

import math
from typing import Any

from memfit.config import TrainConfig
from memfit.gpus import GpuSpec

HOST_SYNC_SECONDS = {"cuda": 20e-6, "cpu": 0.0}
"""What one host synchronisation costs a step: on CUDA the queue of launched kernels drains and the next ones
start from an empty queue (one launch latency, about 5 to 20 us on current cards and drivers; not measured by
memfit); a CPU has no queue to drain."""
HOST_COPY_BYTES_PER_SECOND = 2e9
"""Host-memory rate of each of the embedding's two passes over its rows (the gather, and the copy into pinned
memory), both into memory allocated for them each forward, as `host_embedding._host_forward` does.
benchmarks/bench_lever_costs.py and the same gather and copy timed alone (4,096 bf16 rows of width 2,880 from a
32,000-row table, 2-core AMD EPYC, 2026-11-26, load average 2-3, best of 7): 1.97 GB/s gathered, 2.17 copied (0.5
GB/s in fp32, and for both passes together in one loaded run). A server's host memory is faster: an upper bound."""
GBPS_PER_TFLOP = 4.0
"""Bandwidth of a GPU without a preset, per dense 16-bit TFLOP/s: the presets' median ratio (T4 4.9, A100 5.0,
H100 3.4, RTX 4090 6.1, L4 2.5 GB/s per TFLOP/s)."""
DEQUANT_BANDWIDTH_SHARE = 0.5
"""Share of the card's memory bandwidth bitsandbytes' NF4 dequantization kernel reaches (an assumption: a
streaming element-wise kernel over 32 MiB tiles; not measured by memfit, which had no GPU for it)."""
DEQUANT_CPU_FLOPS = {"fp32": 150.0, "bf16": 3.0}
"""What dequantizing one NF4 weight costs on a CPU, in FLOPs at the step's matmul rate, by compute dtype.

benchmarks/bench_lever_costs.py (bitsandbytes 0.50.2's CPU backend, a 32 x 2,880 x 256 stack, 2-core AMD EPYC,
AVX2 without bf16 units, torch 2.13, 2026-11-26, load average 2-4 from other jobs, best of 7, three runs): fp32
0.07 to 0.16 G weights a second against a step rate (0.7 of a 1024-cube matmul) of 15 to 21 GFLOP/s, 108 to 211
FLOPs a weight; bf16 0.11 to 0.33 G weights a second against 0.4 to 0.6 GFLOP/s (this CPU emulates bf16
matmuls), 2 to 5. A CPU with bf16 matrix units (AMX) runs bf16 matmuls far faster: there a weight costs more FLOPs than this.
"""
GROUP_SECONDS = {"cuda": 30e-6}
"""What one more dequantization group adds to a call on CUDA: about six kernel launches (the group's
dequantization, the slice of its rows and its cast, its offsets, the grouped matmul, the copy into the output)
at about 5 us of PyTorch's eager dispatch and launch each. Not measured by memfit (no GPU for it)."""
GROUP_CPU_FLOPS = {"fp32": 2.0e7, "bf16": 3.0e5}
"""What one more dequantization group adds to a call on a CPU, in FLOPs at the step's matmul rate.

benchmarks/bench_lever_costs.py (same machine and day): the forward and backward of memfit's NF4 grouped matmul
over 32 small experts, two at a time against the whole stack, 0.66 to 2.1 ms more per extra group in fp32
(10 to 34 MFLOPs at that step's rate) and 0.16 to 1.1 ms in bf16 (0.1 to 0.4 MFLOPs): bitsandbytes' and
the grouped matmul's fixed cost per call, not the weights, which are the same either way.
"""
LEVERS = ("embedding_on_host", "quantize_head", "expert_dequant_group")


def lever_model_seconds(changes: dict[str, Any], config: TrainConfig, hf_config: Any, device: str, compute: str,
                        rate: float, link_bytes_per_second: float, gpu: GpuSpec | None = None) -> dict[str, float]:
    """Seconds each lever that is on adds to one optimizer step, before this device's calibration (empty: none on).

    `changes`: the plan's flat changes over `config` (a lever, the shape and the checkpointing read from
    `changes` first); `rate`: the step's matmul rate in FLOP/s (what the CPU figures are written in);
    `compute`: 'bf16' or 'fp32'.
    """
    on = [lever for lever in LEVERS if changes.get(lever, _configured(config, lever))]
    if not on or hf_config is None or not changes.get("lora_r", config.lora.lora_r):
        return {}  # (the shape is read only where a lever is on: every plan of every family passes here)
    shape = _Shape(changes, config, hf_config)
    untied = not shape.arch.tied_embeddings and shape.arch.vocab  # a tied table and head stay (the techniques' rule)
    costs = {}
    if shape.on("embedding_on_host") and untied:  # a CPU step reads the rows where they are: nothing to copy
        costs["embedding_on_host"] = shape.accumulation * embedding_seconds(
            shape.tokens, shape.arch.hidden, shape.weight_bytes, link_bytes_per_second) if device == "cuda" else 0.0
    if shape.on("quantize_head") and shape.quantize == "4bit" and untied and not shape.arch.hidden % 2:
        weights = head_dequantized_weights(shape.arch.vocab * shape.arch.hidden, shape.tokens, shape.chunk)
        costs["quantize_head"] = shape.accumulation * dequantization_seconds(weights, device, compute, rate, gpu)
    group = changes.get("expert_dequant_group", config.memory.expert_dequant_group)
    if group and shape.quantize == "4bit":
        launches, syncs = group_launches(hf_config, shape.lora_r, group, shape.calls_per_stack())
        if device == "cuda":
            seconds = launches * GROUP_SECONDS["cuda"] + syncs * HOST_SYNC_SECONDS["cuda"]
        else:
            seconds = launches * GROUP_CPU_FLOPS.get(compute, GROUP_CPU_FLOPS["fp32"]) / rate
        costs["expert_dequant_group"] = shape.accumulation * seconds
    return costs


def embedding_seconds(tokens: int, hidden: int, weight_bytes: int, link_bytes_per_second: float) -> float:
    """One micro-batch's host lookup on CUDA: ids down, rows gathered and pinned on the host, rows up, one sync."""
    rows = tokens * hidden * weight_bytes
    return (8 * tokens + rows) / link_bytes_per_second + 2 * rows / HOST_COPY_BYTES_PER_SECOND + HOST_SYNC_SECONDS[
        "cuda"]


def head_dequantized_weights(head_weights: int, tokens: int, chunk: int) -> int:
    """Weights the NF4 head dequantizes in one micro-batch: the whole head per pass, 3 passes per checkpointed chunk
    (forward, its recompute, the input gradient), 2 for one unchunked call (forward, the input gradient)."""
    if chunk and chunk < tokens:
        return head_weights * 3 * math.ceil(tokens / chunk)
    return head_weights * (3 if chunk else 2)


def dequantization_seconds(weights: float, device: str, compute: str, rate: float, gpu: GpuSpec | None) -> float:
    """Seconds to dequantize `weights` NF4 weights to the compute dtype."""
    if device != "cuda":
        return weights * DEQUANT_CPU_FLOPS.get(compute, DEQUANT_CPU_FLOPS["fp32"]) / rate
    out_bytes = 2 if compute == "bf16" else 4
    per_weight = 0.5 + out_bytes + 2 * 4 / 64  # packed in, dequantized out, the fp32 absmax made and read
    return weights * per_weight / (DEQUANT_BANDWIDTH_SHARE * gpu_bandwidth(gpu))


def gpu_bandwidth(gpu: GpuSpec | None) -> float:
    """The card's memory bandwidth in bytes a second: its preset's figure, else GBPS_PER_TFLOP of its peak (without a
    spec, of the speed model's nominal 100 TFLOP/s: only relative speeds mean anything there)."""
    if gpu is not None and gpu.memory_gbps:
        return gpu.memory_gbps * 1e9
    return GBPS_PER_TFLOP * (gpu.peak_tflops if gpu is not None else 100.0) * 1e9


def group_launches(hf_config: Any, lora_r: int, group: int, calls_per_stack: int) -> tuple[int, int]:
    """(extra group iterations, host synchronisations) of one micro-batch's NF4 expert calls at `group` experts a
    group: every stack the technique groups (G below its experts, whole 64-weight blocks an expert) adds
    ceil(E / G) - 1 iterations and one read of the offsets per call."""
    from memfit.models.state_bytes import parameter_inventory
    from memfit.prediction.qlora_levers import NF4_BLOCK

    launches = syncs = 0
    for _, lora_a, lora_b in parameter_inventory(hf_config, lora_r).expert_adapters:
        experts = lora_a[0] // lora_r
        per_expert = lora_a[1] * lora_b[0]
        if not 0 < group < experts or per_expert % NF4_BLOCK:
            continue  # dequantized whole, as the technique leaves it
        launches += (math.ceil(experts / group) - 1) * calls_per_stack
        syncs += calls_per_stack
    return launches, syncs


def _configured(config: TrainConfig, lever: str) -> Any:
    """The config's own setting of a lever (the head's is a LoRA field, the others memory fields)."""
    return getattr(config.lora if lever == "quantize_head" else config.memory, lever)


class _Shape:
    """What the lever costs read of a plan: tokens per micro-batch, the loss chunk, checkpointing, tiles, dtypes."""

    def __init__(self, changes: dict[str, Any], config: TrainConfig, hf_config: Any):
        from memfit.prediction.encoders import architecture_for
        from memfit.techniques.loss import default_loss_chunk_size

        self.changes, self.config = changes, config
        self.arch = architecture_for(hf_config)
        self.seq = changes.get("seq_len", config.data.seq_len_or_default)
        micro = changes.get("batch_size", config.training.batch_size)
        self.tokens = micro * self.seq
        self.accumulation = changes.get("gradient_accumulation_steps", 1)
        self.lora_r = changes.get("lora_r", config.lora.lora_r)
        self.quantize = changes.get("quantize", config.lora.quantize)
        dtype = changes.get("dtype", config.model.dtype)
        self.weight_bytes = 4 if dtype == "fp32" else 2
        chunk = changes.get("loss_chunk_size", config.memory.loss_chunk_size)
        if chunk is None or chunk == 1:  # automatic, or a run's own prediction marking "chunked": the chunk it runs
            chunk = config.memory.loss_chunk_size if (config.memory.loss_chunk_size or 0) > 1 else (
                default_loss_chunk_size(self.arch.vocab, self.seq, micro))
        self.chunk = chunk or 0

    def on(self, lever: str) -> bool:
        return bool(self.changes.get(lever, _configured(self.config, lever)))

    def calls_per_stack(self) -> int:
        """Calls of each expert stack in one micro-batch: forward and backward, the recompute under full
        checkpointing, each once per tile under tiled experts with one more forward a tile (tiled MLP's recompute)."""
        from memfit.prediction.run_shape import resolve_mlp_tiles

        recompute = self.changes.get("gradient_checkpointing", self.config.memory.gradient_checkpointing) == "full"
        tiles = resolve_mlp_tiles(self.changes.get("tiled_mlp", self.config.memory.tiled_mlp), self.seq)
        return max(1, tiles) * (2 + recompute + (1 if tiles else 0))
