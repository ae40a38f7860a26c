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

import torch

from memfit.config import TrainConfig
from memfit.distributed.checkpoint_io import load_sharded, save_sharded
from memfit.distributed.context import DistContext
from memfit.distributed.parallel import Parallel, ParallelStepRunner
from memfit.techniques.checkpointing import transformer_blocks
from memfit.train.checkpoint import TrainerState, save_final_model

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


class FullyShardedParallel(Parallel):
    """FSDP2 over all ranks (see the module docstring)."""

    name = "fsdp"
    grads_averaged_across_ranks = True  # FSDP2 reduce-scatters the mean over ranks

    def __init__(
        self,
        config: TrainConfig,
        model: torch.nn.Module,
        dist: DistContext,
        device: torch.device,
        precision,
        notes: dict,
    ):
        super().__init__(config, dist, device)
        offload = config.distributed.fsdp_offload
        units = fully_shard_model(model, dist.world_size, device, precision.autocast_dtype, offload)
        self.units = units
        self.offload = offload
        if config.memory.oom_recovery:
            notes["oom_recovery"] = (
                "off under --sharding fsdp: a rank cannot leave a collective midway; an OOM ends the run"
                " (use --sharding ddp to recover from OOM across ranks)"
            )

    def describe(self) -> str:
        offload = ", CPU offload" if self.offload else ""
        return f"fsdp2 over {self.dist.world_size} ranks ({self.units} units{offload})"

    def attach(self, session) -> None:
        if session.loss_chunk_size:
            # Chunked loss calls the backbone and the head directly, bypassing the root unit's gather.
            session.notes["loss_chunk_size"] = (
                "chunked loss is off under --sharding fsdp (the head is sharded with the root)"
            )
            session.loss_chunk_size = 0

    def make_runner(self, **kwargs):
        kwargs["grads_averaged_across_ranks"] = True
        kwargs["oom_recovery"] = False
        self.runner = ParallelStepRunner(**kwargs)
        return self.runner

    # -- checkpoints ---------------------------------------------------------

    def _state(self, session) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(session.model, session.optimizer.optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def save_checkpoint(self, session, state: TrainerState) -> Path:
        import torch.distributed.checkpoint as dcp

        def write(directory: Path) -> None:
            dcp.save(self._state(session), checkpoint_id=str(directory / "shards"))

        return save_sharded(session.output_dir, state, self.dist, write, session.scheduler, session.config.to_dict())

    def load_checkpoint(self, session, path: Path) -> TrainerState:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        def read(directory: Path) -> None:
            state = self._state(session)
            dcp.load(state, checkpoint_id=str(directory / "shards"))
            set_state_dict(
                session.model,
                session.optimizer.optimizer,
                model_state_dict=state["model"],
                optim_state_dict=state["optimizer"],
            )

        return load_sharded(path, self.dist, read, session.scheduler)

    def save_final(self, session) -> Path | None:
        """Gather the full weights to rank 0 and write one Hugging Face directory there."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        full = get_model_state_dict(session.model, options=options)  # a collective: every rank calls it
        final = None
        if self.dist.is_main:
            final = save_final_model(session.model, session.loaded.tokenizer, session.output_dir / "final", full)
        self.dist.barrier()
        return final
