"""The frozen reference copy (--reference copy) sharded over the ranks like the policy it is a copy of.

Under --sharding fsdp and DeepSpeed ZeRO-3 each rank holds 1/N of the policy's weights; a whole copy of them on
every rank for the reference would cost N times the policy's share. So the copy is sharded the same way:

- FSDP2: `fully_shard_model` (distributed/fsdp.py) on the copy, on the run's ranks, with the policy's
  mixed-precision and offload policies: one unit per transformer block, then the root. A block's weights are
  all-gathered just before its no-grad forward and freed after it. The root unit (embeddings, final norm, head)
  stays gathered after the forward, since the chunked log-probabilities run the head after it
  (techniques/sequence_logprobs.py); the reference pass frees it when the pass ends (`reference_pass`). No
  optimizer, no gradients: nothing else is made.
- ZeRO-3: `deepspeed.initialize` on the copy with the run's ZeRO-3 config and no optimizer (its "optimizer" and
  "scheduler" sections and optimizer offload dropped), in eval mode: DeepSpeed partitions every parameter above the
  config's `stage3_param_persistence_threshold` and gathers a module's parameters around its forward.

Under one process, DDP and ZeRO-1/2 the copy stays whole, as the policy's weights are whole there.
Numerics: the same weights, all-gathered whole for each forward: the copy's log-probabilities are the whole copy's.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass
from typing import Any

import torch

log = logging.getLogger("memfit")

FSDP = "fsdp"
ZERO3 = "zero-3"


@dataclass(frozen=True)
class CopySharding:
    """How the frozen copy is spread over the ranks, and what one rank holds of it."""

    engine: str
    """fsdp or zero-3: the engine whose sharding the copy follows."""
    ranks: int
    """Ranks the copy is sharded over."""
    whole_bytes: int
    """Bytes of the whole copy (weights and buffers)."""
    rank_bytes: int
    """Bytes of the copy this rank holds between passes: its shards, the persistent parameters and the buffers."""

    def describe(self) -> str:
        return (f"sharded over {self.ranks} ranks ({self.engine}): {self.rank_bytes / 2**20:,.1f} MiB a rank of"
                f" {self.whole_bytes / 2**20:,.1f} MiB")


SHARDED_WEIGHTS = ("fsdp", "zero3")
"""The estimator's sharding modes (prediction/run_shape.py) whose ranks each hold a share of the weights."""


def copy_bytes_per_rank(copy_bytes: float, sharding: str, world_size: int) -> float:
    """The estimate of a frozen copy's bytes on each rank: its share under the estimator's `sharding` fsdp or zero3
    (the copy sharded as the policy is), the whole copy under none, ddp, zero1 and zero2."""
    return copy_bytes / world_size if sharding in SHARDED_WEIGHTS and world_size > 1 else copy_bytes


def copy_sharding_engine(distributed: Any, world_size: int) -> str | None:
    """fsdp or zero-3 when the run's engine shards the weights over `world_size` ranks, else None (a whole copy)."""
    if world_size < 2:
        return None
    if distributed.deepspeed or distributed.zero_stage is not None:
        return ZERO3 if _zero_stage(distributed) == 3 else None
    return FSDP if distributed.sharding == "fsdp" else None


def shard_copy(reference: torch.nn.Module, whole_bytes: int, config: Any,
               device: torch.device) -> tuple[torch.nn.Module, CopySharding | None]:
    """`reference` (a frozen copy of `whole_bytes` bytes) sharded as the run `config` shards its policy, and how;
    unchanged and None where the policy's weights are whole on every rank."""
    import torch.distributed as dist

    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    engine = copy_sharding_engine(config.distributed, world_size)
    if engine == FSDP:
        reference = _fully_shard(reference, config, device, world_size)
    elif engine == ZERO3:
        reference = _zero3(reference, config, device, world_size)
    else:
        return reference, None
    return reference, CopySharding(engine, world_size, whole_bytes, rank_bytes(reference))


def shard_reference_copy(reference: torch.nn.Module | None, cost: Any, config: Any) -> torch.nn.Module | None:
    """The task's frozen copy sharded as the run shards its policy (`shard_copy`) when `cost.mode` is copy; `cost`
    (techniques.reference_model.ReferenceCost) learns how and the bytes a rank holds. Any other reference unchanged."""
    if reference is None or cost.mode != "copy" or config is None:
        return reference
    device = next(reference.parameters()).device
    reference, sharding = shard_copy(reference, cost.copy_bytes, config, device)
    if sharding is not None:
        cost.copy_sharding, cost.copy_ranks, cost.copy_rank_bytes = sharding.engine, sharding.ranks, sharding.rank_bytes
    return reference


def rank_bytes(reference: torch.nn.Module) -> int:
    """Bytes of `reference` this rank holds between passes: each FSDP2 parameter's local shard, each ZeRO-3
    parameter's partition (or the whole of a persistent one), and the buffers."""
    total = 0
    for parameter in reference.parameters():
        held = getattr(parameter, "ds_tensor", None)  # ZeRO-3's partition; the parameter itself is empty between uses
        if held is None or getattr(parameter, "ds_persist", False):
            held = parameter.to_local() if hasattr(parameter, "to_local") else parameter
        total += held.numel() * held.element_size()
    return total + sum(buffer.numel() * buffer.element_size() for buffer in reference.buffers())


def _fully_shard(reference: torch.nn.Module, config: Any, device: torch.device, world_size: int) -> torch.nn.Module:
    from memfit.distributed.fsdp import fully_shard_model
    from memfit.techniques.precision import run_precision

    compute_dtype = run_precision(config, device).autocast_dtype
    fully_shard_model(reference, world_size, device, compute_dtype, config.distributed.fsdp_offload)
    return reference


def _zero3(reference: torch.nn.Module, config: Any, device: torch.device, world_size: int) -> torch.nn.Module:
    import deepspeed

    from memfit.distributed.zero import deepspeed_config, read_deepspeed_file
    from memfit.techniques.precision import run_precision

    distributed = config.distributed
    user = read_deepspeed_file(distributed.deepspeed) if distributed.deepspeed else None
    data_world_size = world_size // max(1, distributed.context_parallel)  # as the policy's engine counts the step
    ds_config = deepspeed_config(config, world_size, config.accumulation_for(data_world_size),
                                 run_precision(config, device).name, user, {}, device)
    ds_config = inference_config(ds_config)
    engine, *_ = deepspeed.initialize(model=reference, config=ds_config)
    engine.eval()  # DeepSpeed's eval returns nothing
    return engine


def inference_config(ds_config: dict[str, Any]) -> dict[str, Any]:
    """The run's ZeRO-3 DeepSpeed config for a module that never trains: no optimizer, scheduler or optimizer
    offload (nothing to step), the parameters partitioned as the policy's are."""
    result = copy.deepcopy(ds_config)
    for section in ("optimizer", "scheduler"):
        result.pop(section, None)
    zero = result.setdefault("zero_optimization", {})
    zero.pop("offload_optimizer", None)
    zero["stage"] = 3
    return result


def _zero_stage(distributed: Any) -> int | None:
    if distributed.zero_stage is not None:
        return int(distributed.zero_stage)
    if not distributed.deepspeed:
        return None
    from memfit.distributed.zero import read_deepspeed_file

    try:
        return int(read_deepspeed_file(distributed.deepspeed).get("zero_optimization", {}).get("stage", 2))
    except Exception:  # an unreadable file: the engine reports it in its own words
        return None
