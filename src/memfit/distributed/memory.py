"""What each rank holds of the model: parameter, gradient and optimizer-state bytes.

Under FSDP2 parameters and gradients are DTensors whose local shard is what a rank
stores; under DeepSpeed ZeRO the engine keeps its own partitions. These functions count
the local bytes only, so they show what sharding saves (about 1/N of each under FSDP2).
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_leaves


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """The part of `tensor` stored by this rank (the local shard of a DTensor)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


def unique_bytes(tensors) -> int:
    seen: set[int] = set()
    total = 0
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        tensor = local_tensor(tensor)
        if tensor.numel() == 0:
            continue
        key = tensor.data_ptr()  # tied weights count once
        if key in seen:
            continue
        seen.add(key)
        total += tensor.numel() * tensor.element_size()
    return total


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of the parameters this rank stores (a ZeRO-3 partition counts as its `ds_tensor`)."""
    return unique_bytes(getattr(p, "ds_tensor", p) for p in model.parameters())


def gradient_bytes(parameters) -> int:
    """Bytes of the gradients currently held for `parameters` on this rank."""
    return unique_bytes(p.grad for p in parameters if p.grad is not None)


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors (moments, steps) on this rank."""
    return unique_bytes(tree_leaves([dict(state) for state in optimizer.state.values()]))
