"""What a run would run, and the bytes of its state: the first half of an estimate.

`resolve_run` turns a TrainConfig into the choices that decide memory on the target device
(precision, attention, checkpointing, loss chunk, optimizer, LoRA, offload, kernels) as the
training loop would resolve them; `state_parts` gives the full bytes of parameters,
gradients, optimizer state and step temporaries for that shape; `apply_sharding` divides
what each sharding mode spreads over the ranks. `memfit.prediction.estimator` puts these
together with the activation moment into an estimate.
"""

from __future__ import annotations

import math
from typing import Any

from memfit.config import TrainConfig
from memfit.errors import UsageError
from memfit.gpus import GpuSpec
from memfit.models.optimizer_state import SMALL_STATE_OPTIMIZERS
from memfit.models.state_bytes import (
    BNB_8BIT_BLOCK,
    NF4_BYTES_PER_PARAM,
    ParameterInventory,
    optimizer_state_bytes_for_shapes,
    optimizer_step_temporary_bytes,
    small_state_optimizer_bytes,
)
from memfit.prediction.activations import Precision, architecture_of
from memfit.resolution.resolve import resolve
from memfit.techniques.resolved_run import ResolvedRun

SHARDINGS = ("none", "ddp", "zero1", "zero2", "zero3", "fsdp")


def host_available_bytes() -> int | None:
    """Memory available on this machine now, or None when it cannot be read."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # psutil missing or no /proc: the check is skipped, not guessed
        try:
            with open("/proc/meminfo") as handle:
                for line in handle:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
    return None


def host_breakdown(run: RunShape, parts: dict[str, Any], host_activations: float) -> dict[str, int]:
    """Host bytes by part: offloaded activations, optimizer state (and fp32 master weights) off the device."""
    optimizer = 0.0
    if run.optimizer_offload:
        # the CPU step keeps its state and an fp32 copy of every trainable weight
        optimizer = parts["optimizer_states_full"] + 4 * parts["trainable_count"]
    elif run.paged_optimizer:
        optimizer = parts["optimizer_states_full"]
    return {"activations": int(host_activations), "optimizer_states": int(optimizer)}


RunShape = ResolvedRun
"""The estimator's name for the resolved run (memfit.techniques.resolved_run)."""


def tiled_mlp_available() -> bool:
    """Whether this memfit has the tiled MLP (memfit.techniques.tiled_mlp)."""
    import importlib.util

    return importlib.util.find_spec("memfit.techniques.tiled_mlp") is not None


def resolve_mlp_tiles(tiled_mlp: int | None, seq_len: int) -> int:
    """Tiles of the MLP as the training run resolves them (None: automatic past a length); 0 when untiled."""
    if not tiled_mlp_available():
        return 0
    from memfit.techniques.tiled_mlp import tiles_for

    tiles = tiles_for(seq_len, tiled_mlp)
    return tiles if tiles > 1 else 0


def resolve_run(config: TrainConfig, hf_config: Any, gpu: GpuSpec | None) -> RunShape:
    """What the training loop would run for `config` on `gpu` (or this machine without one): the registry's
    resolver (memfit.resolution.resolve), for a device described by a GPU preset."""
    import torch

    device_type = "cuda" if gpu is not None or torch.cuda.is_available() else "cpu"
    bf16_ok = gpu.bf16 if gpu is not None else device_type == "cpu" or torch.cuda.is_bf16_supported()
    return resolve(config, hf_config, device_type, bf16_supported=bf16_ok)


def sharding_of(config: TrainConfig, sharding: str) -> str:
    if sharding != "none":
        if sharding not in SHARDINGS:
            raise UsageError(f"sharding must be one of {', '.join(SHARDINGS)}, got {sharding!r}")
        return sharding
    if config.distributed.zero_stage:
        return f"zero{config.distributed.zero_stage}"
    return config.distributed.sharding


def state_parts(config: TrainConfig, run: RunShape, inventory: ParameterInventory) -> dict[str, Any]:
    """Full bytes of parameters, gradients, optimizer state and the step temporaries."""
    wb = run.weight_bytes
    if run.lora_r:
        from memfit.prediction.experts import expert_adapter_shapes

        trainable_shapes = inventory.adapter_shapes + expert_adapter_shapes(inventory, config.lora.lora_targets)
        trainable_bytes = 4  # PEFT keeps adapters in fp32
        base = inventory.total * wb
        if run.quantize == "4bit":
            base -= inventory.linear_params * (wb - NF4_BYTES_PER_PARAM)
        elif run.quantize == "8bit":
            base -= inventory.linear_params * (wb - 1 - 4 / 4096)  # int8 + one fp32 scale per row (about)
        parameters = base + 4 * sum(math.prod(s) for s in trainable_shapes)
    else:
        trainable_shapes = inventory.shapes
        trainable_bytes = wb
        parameters = inventory.total * wb
    trainable = sum(math.prod(s) for s in trainable_shapes)
    fused_step = run.optimizer == "adamw" and run.optimizer_impl in ("auto", "fused")
    if run.optimizer in SMALL_STATE_OPTIMIZERS:  # GaLore, APOLLO, Adam-mini, 4-bit AdamW
        optimizer = small_state_optimizer_bytes(config.optimizer, inventory, trainable_bytes, run.optimizer_in_backward,
                                                lora=bool(run.lora_r))
    else:
        optimizer = optimizer_state_bytes_for_shapes(run.optimizer, trainable_shapes, trainable_bytes, config.optimizer.momentum, fused_step)
    if not fused_step and run.optimizer == "adamw" and run.device_type == "cpu":
        optimizer += 4 * len(trainable_shapes)  # the step counters live on the CPU
    if run.optimizer_in_backward and run.optimizer in ("adamw-8bit", "paged-adamw-8bit"):
        optimizer += 2 * BNB_8BIT_BLOCK * 4 * (len(trainable_shapes) - 1)  # one pair of quantization maps per optimizer
    off_device = run.optimizer_offload or run.paged_optimizer
    return {
        "parameters": parameters,
        "gradients": trainable * trainable_bytes,
        "optimizer_states": 0 if off_device else optimizer,
        "optimizer_states_full": optimizer,
        "largest_trainable": max((math.prod(s) for s in trainable_shapes), default=0),
        "optimizer_temporaries": optimizer_step_temporary_bytes(run, trainable_shapes, trainable_bytes),
        "trainable_count": trainable,
        "trainable_shapes": trainable_shapes,
        "trainable_bytes": trainable_bytes,
    }


def precision_of(run: RunShape) -> Precision:
    compute = 2 if run.autocast or run.weight_bytes == 2 else 4
    # CPU autocast leaves SDPA out of its bf16 list: it runs on the fp32 output of RoPE.
    attention = 4 if run.autocast and run.device_type == "cpu" and run.weight_bytes == 4 else compute
    return Precision(compute=compute, residual=run.weight_bytes, attention=attention, lora_rank=run.lora_r,
                     adapter_input=adapter_input_bytes(run), efficient_norm=run.efficient_norm)


def adapter_input_bytes(run: RunShape) -> int:
    """Bytes per element of the copy of its input each adapter keeps (see Precision.adapter_input)."""
    if run.autocast and run.weight_bytes == 4:
        # autocast's 16-bit cast for the adapter's matmul: the adapters reading the norms' fp32
        # outputs run PEFT's path; counted so for every adapter (o and down run memfit's: less)
        return 2
    if run.efficient_lora:
        return 0  # the input itself, kept anyway
    return 2 if run.autocast else 4


def apply_sharding(moment: dict, parts: dict, sharding: str, world_size: int, hf_config, run: RunShape,
                    cache: float = 0.0) -> dict:
    """Divide what each sharding mode spreads over the ranks (DDP: nothing, and nothing added)."""
    moment = dict(moment)
    # memfit's DDP engine sums each gradient in place, one collective per tensor with no flat
    # bucket (distributed/parallel.py), so a replicated rank holds what one process holds.
    if world_size == 1 or sharding in ("none", "ddp"):
        return moment
    divide = {"zero1": ("optimizer_states",), "zero2": ("optimizer_states", "gradients"),
              "zero3": ("optimizer_states", "gradients", "parameters"), "fsdp": ("optimizer_states", "gradients", "parameters")}
    for key in divide[sharding]:
        moment[key] = moment[key] / world_size
    if "parameters" in divide[sharding]:
        # sharded parameters are gathered (and cast) one block at a time
        moment["activations"] = max(0.0, moment["activations"] - cache * (1 - 1 / world_size))
        # One block gathered in full for compute, the next prefetched.
        layers = architecture_of(hf_config).layers
        moment["other"] += 2 * parts["parameters"] / max(1, layers)
    return moment
