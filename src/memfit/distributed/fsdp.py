"""FSDP2 (`torch.distributed.fsdp.fully_shard`): parameters, gradients and optimizer state sharded.

Each transformer block becomes one FSDP unit, then the root takes what is left
(embeddings, final norm, head). A unit's parameters are all-gathered just before its
forward and freed after it (again in backward), and its gradients are reduce-scattered
as soon as backward leaves it, so a rank holds 1/N of the parameters, gradients and
optimizer state plus one or two whole blocks at a time.

- Gradient checkpointing is applied before wrapping; the recomputed forward unshards again.
- bf16 (--precision bf16 / amp): `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`,
  the sharded master weights and optimizer stay fp32.
- --fsdp-offload: `CPUOffloadPolicy`: shards, gradients and the optimizer step live on the CPU.
- LoRA: frozen base weights and trainable adapters share units; only the adapters get gradients.
- Checkpoints: torch.distributed.checkpoint (each rank writes its shards) plus memfit's
  trainer state; the final model is gathered to rank 0 and written with save_pretrained.

Under FSDP2 every forward and backward exchanges shards between ranks, so a rank that
runs out of memory midway cannot drop out without leaving the others waiting in a
collective: OOM recovery is off under --sharding fsdp and an OOM ends the run (exit 3);
use --sharding ddp to rehearse OOM recovery across ranks.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from memfit.checkpoint_files import TrainerState, save_final_model
from memfit.config import TrainConfig
from memfit.distributed.checkpoint_io import load_sharded, load_whole_into_shards, save_sharded
from memfit.distributed.context import DistContext
from memfit.distributed.memory import gradient_bytes
from memfit.distributed.parallel import LocalStepEngine, gather_events
from memfit.techniques.checkpointing import transformer_blocks

log = logging.getLogger("memfit")


def fully_shard_model(
    model: torch.nn.Module,
    world_size: int,
    device: torch.device,
    compute_dtype: torch.dtype | None = None,
    offload: bool = False,
) -> int:
    """Shard `model` in place: one FSDP2 unit per transformer block, then the root.

    Returns the number of units. `compute_dtype` (bf16/fp16) sets the mixed-precision
    policy; `offload` keeps shards and the optimizer step on the CPU.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs: dict = {"mesh": init_device_mesh(device.type, (world_size,))}
    if compute_dtype is not None:
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    if offload:
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=device.type == "cuda")
    blocks = transformer_blocks(model)
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    return len(blocks) + 1


class FullyShardedEngine(LocalStepEngine):
    """FSDP2 over all ranks (see the module docstring). The local step (backward, clipping over the
    sharded gradients, the optimizer step on the shards) is a one-process engine's (`local`)."""

    name = "fsdp"
    recovers_from_oom = False  # every pass exchanges shards: a rank cannot redo a micro-batch alone

    def __init__(self, local, config: TrainConfig, dist: DistContext, device: torch.device, precision, fallbacks: dict):
        super().__init__(local, dist, device)
        self.compute_dtype = precision.autocast_dtype
        self.offload = config.distributed.fsdp_offload
        self.units = 0
        if config.memory.oom_recovery:
            fallbacks["oom_recovery"] = (
                "off under --sharding fsdp: a rank cannot leave a collective midway; an OOM ends the run"
                " (use --sharding ddp to recover from OOM across ranks)"
            )

    def describe(self) -> str:
        offload = ", CPU offload" if self.offload else ""
        return f"fsdp2 over {self.dist.world_size} ranks ({self.units} units{offload})"

    def prepare(self, model: torch.nn.Module, build_optimizer):
        """Shard `model` in place, then build the optimizer over the shards."""
        self.units = fully_shard_model(model, self.dist.world_size, self.device, self.compute_dtype, self.offload)
        return self.local.prepare(model, build_optimizer)

    def loss_normalizer(self, target_tokens: int) -> float:
        # FSDP2 reduce-scatters the mean over ranks: scale up by the ranks to get the sum.
        return self.dist.all_reduce_sum(target_tokens) / self.dist.world_size

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        self.local.backward(loss, last_micro_batch)

    def reduce_gradients(self) -> None:
        pass  # FSDP2 reduce-scatters each unit's gradients during backward

    def agree_after_micro_batches(self, micro_batch_size: int, events: list[dict]) -> tuple[int, list[dict]]:
        return micro_batch_size, gather_events(self.dist, events)

    def clip_and_step(self):
        self.gradient_bytes_seen = gradient_bytes(self.local.trainable)
        norm = self.local.clip_and_step()
        # The norm of sharded gradients is a replicated DTensor: the plain tensor goes back to the step.
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    def use_per_parameter_kernels(self) -> None:
        raise RuntimeError("FSDP2 does not recover from out-of-memory (recovers_from_oom is False)")

    # -- files -----------------------------------------------------------------

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def save_checkpoint(self, output_dir: Path, state: TrainerState, scheduler: Any, config_dict: dict) -> Path:
        import torch.distributed.checkpoint as dcp

        def write(directory: Path) -> None:
            dcp.save(self._state(), checkpoint_id=str(directory / "shards"))

        return save_sharded(output_dir, state, self.dist, write, scheduler, config_dict)

    def load_checkpoint(self, path: Path, scheduler: Any) -> TrainerState:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        def read(directory: Path) -> None:
            state = self._state()
            dcp.load(state, checkpoint_id=str(directory / "shards"))
            set_state_dict(
                self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"]
            )

        if not (path / "shards").is_dir() and (path / "model.safetensors").is_file():  # written by one process
            return load_whole_into_shards(path, self.model, self.optimizer, scheduler, self.dist)
        return load_sharded(path, self.dist, read, scheduler, reshards=True)  # any number of ranks

    def save_final_model(self, directory: Path, tokenizer: Any) -> Path | None:
        """Gather the full weights to rank 0 and write one Hugging Face directory there."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(self.model, options=options)  # a collective: every rank calls it
        final = None
        if self.dist.is_main:
            final = save_final_model(self.model, tokenizer, directory, full)
        self.dist.barrier()
        return final
