"""Who this process is in a run: rank, world size, and the few collectives the loop needs.

Without a launcher there is no process group and every collective is the identity.
Under torchrun (WORLD_SIZE > 1) the process group is started here: gloo on CPU,
NCCL on CUDA.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


@dataclass
class DistContext:
    rank: int = 0
    world_size: int = 1
    context_parallel: int = 1
    """Ranks one sequence is split over (memfit.distributed.context_parallel); they read the same samples."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def data_rank(self) -> int:
        """This rank's place among the data-parallel groups: which samples it reads."""
        return self.rank // self.context_parallel

    @property
    def data_world_size(self) -> int:
        """Data-parallel groups: the world over the context-parallel size."""
        return self.world_size // self.context_parallel

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def all_reduce_sum(self, value: float, device: torch.device | None = None) -> float:
        if not self.enabled:
            return value
        import torch.distributed as dist

        tensor = torch.tensor([float(value)], dtype=torch.float64, device=device or _collective_device())
        dist.all_reduce(tensor)
        return tensor.item()

    def all_reduce_max(self, value: float, device: torch.device | None = None) -> float:
        if not self.enabled:
            return value
        import torch.distributed as dist

        tensor = torch.tensor([float(value)], dtype=torch.float64, device=device or _collective_device())
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.item()

    def all_reduce_tensor_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        """The elementwise sum of `tensor` over the ranks, on the host (moved to the backend's device for the sum)."""
        if not self.enabled:
            return tensor
        return summed_over_world(tensor)

    def barrier(self) -> None:
        if self.enabled:
            import torch.distributed as dist

            dist.barrier()


def summed_over_world(tensor: torch.Tensor) -> torch.Tensor:
    """The elementwise sum of `tensor` over every rank of the initialized process group, on the host."""
    import torch.distributed as dist

    moved = tensor.to(_collective_device())
    dist.all_reduce(moved)
    return moved.cpu()


def _collective_device() -> torch.device:
    """Where small collective tensors live: NCCL only moves CUDA tensors, gloo CPU ones."""
    import torch.distributed as dist

    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init_distributed(device: torch.device | None = None) -> DistContext:
    """Start the process group when launched by torchrun; a single-process context otherwise."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistContext()
    import torch.distributed as dist

    if device is not None and device.type == "cuda":
        torch.cuda.set_device(device)  # before NCCL starts, so each rank's communicator uses its own GPU
    if not dist.is_initialized():
        backend = "nccl" if device is not None and device.type == "cuda" else "gloo"
        dist.init_process_group(backend=backend)
    return DistContext(rank=dist.get_rank(), world_size=dist.get_world_size())
