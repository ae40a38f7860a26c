"""Offloading to host memory: activations saved for backward, and optimizer state.

Activation offload (`--activation-offload`, CUDA only)
    Saves: every tensor autograd saves for backward (above `min_bytes`, parameters
    excluded) leaves GPU memory during forward and comes back for backward; the GPU
    holds about one layer's activations instead of all of them.
    Costs: a device-to-host copy in forward and a host-to-device copy in backward of
    all saved bytes, pinned host memory of the same size, and PCIe bandwidth. The
    forward copies run on a side stream and overlap with compute; the backward copies
    are on the compute stream, so backward waits for them. Worth it at long sequences
    when checkpointing's recompute is the alternative. With full checkpointing there is
    little left to offload (checkpointed blocks save nothing but their inputs).

Optimizer offload (`--optimizer-offload`, CUDA only, needs torchao)
    Saves: the optimizer state (8 bytes per parameter for AdamW) and the fp32 master
    copy used by the step live in host memory; the step runs on the CPU.
    Costs: each gradient crosses to the host in backward and each parameter comes back
    after the step (2 x 4 bytes per parameter over PCIe per step), and the CPU AdamW
    step time. Gradient clipping cannot be used: the gradients are copied to the host
    as they are produced, before the loop could clip them (`check_optimizer_offload`).

On CPU both do nothing (everything already lives in host memory): the functions return
a no-op and the reason, which the loop logs.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch
from torch import nn

from memfit.config import OptimizerConfig
from memfit.errors import UsageError

NO_EFFECT_ON_CPU = "activation offload has no effect on CPU: activations already live in host memory"
OPTIMIZER_NO_EFFECT_ON_CPU = "optimizer offload has no effect on CPU: optimizer state already lives in host memory"
DEFAULT_MIN_OFFLOAD_BYTES = 1 << 16  # smaller tensors cost more in copy latency than they free


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: tensors saved for backward inside it go to host memory and back.

    Args:
        model: its parameters (and views of them) are never offloaded.
        min_bytes: tensors smaller than this stay where they are.
        force: also copy CPU tensors into fresh host storage (no memory effect; lets
            tests run the pack/unpack path without a GPU).

    `offloaded_tensors` and `offloaded_bytes` count what was moved.
    """

    def __init__(self, model: nn.Module | None = None, min_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES, force: bool = False):
        self.min_bytes = min_bytes
        self.force = force
        self.offloaded_tensors = 0
        self.offloaded_bytes = 0
        self._parameter_storages = (
            {p.untyped_storage().data_ptr() for p in model.parameters()} if model is not None else set()
        )
        self._stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        super().__init__(self._pack, self._unpack)

    def _should_offload(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type == "cpu" and not self.force:
            return False
        if tensor.device.type not in ("cpu", "cuda") or tensor.layout != torch.strided:
            return False
        if (
            isinstance(tensor, nn.Parameter)
            or isinstance(tensor._base, nn.Parameter)  # e.g. weight.t() saved by a matmul
            or tensor.untyped_storage().data_ptr() in self._parameter_storages
        ):
            return False  # weights are needed on the device anyway
        return tensor.numel() * tensor.element_size() >= self.min_bytes

    def _pack(self, tensor: torch.Tensor) -> Any:
        if not self._should_offload(tensor):
            return tensor
        self.offloaded_tensors += 1
        self.offloaded_bytes += tensor.numel() * tensor.element_size()
        if tensor.device.type == "cpu":  # forced path: a copy in fresh storage
            host = torch.empty(tensor.size(), dtype=tensor.dtype)
            host.copy_(tensor)
            return (tensor.device, host, None)
        host = torch.empty(tensor.size(), dtype=tensor.dtype, pin_memory=True)
        # The copy runs beside compute; record_stream keeps the allocator from reusing
        # the device memory before the copy has read it.
        self._stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(self._stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(self._stream)
        return (tensor.device, host, self._stream.record_event())

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        device, host, copied = packed
        if device.type == "cpu":
            return host
        stream = torch.cuda.current_stream(device)
        stream.wait_event(copied)  # the forward copy must be complete before reading the host buffer
        return host.to(device, non_blocking=True)


def activation_offload(
    device: torch.device | str,
    model: nn.Module | None = None,
    min_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
    force: bool = False,
) -> tuple[contextlib.AbstractContextManager, str | None]:
    """The context to run forward and backward in, and why it does nothing (or None).

    Wrap the forward (the loss computation); backward may run inside or outside it.
    On CPU, unless `force`, it is a no-op with a reason for the log.
    """
    device = torch.device(device)
    if device.type == "cuda" or force:
        return ActivationOffload(model, min_bytes=min_bytes, force=force), None
    if device.type == "cpu":
        return contextlib.nullcontext(), NO_EFFECT_ON_CPU
    return contextlib.nullcontext(), f"activation offload supports CUDA only; it is off on {device.type}"


def check_optimizer_offload(device: torch.device | str, max_grad_norm: float) -> None:
    """Raise UsageError for settings that optimizer offload on CUDA would silently ignore."""
    if torch.device(device).type == "cuda" and max_grad_norm > 0:
        raise UsageError(
            "--optimizer-offload copies gradients to the CPU as backward produces them, before clipping:"
            " set --max-grad-norm 0, or drop --optimizer-offload"
        )


# Options of a device optimizer that must not be carried to its CPU twin.
_DEVICE_ONLY_OPTIONS = ("fused", "foreach", "capturable", "differentiable")


def optimizer_offload(
    optimizer: torch.optim.Optimizer,
    groups: list[dict[str, Any]],
    optimizer_config: OptimizerConfig | None,
    device: torch.device | str,
) -> tuple[torch.optim.Optimizer, str | None]:
    """The same optimizer with its state and step on the CPU, or `optimizer` and why not.

    Args:
        optimizer: the optimizer built for the device (its state is created lazily, so
            it has cost nothing yet); its class and options are reused.
        groups: the parameter groups it was built from.
        optimizer_config: checked for gradient clipping (see `check_optimizer_offload`).
        device: the training device.
    Returns:
        On CUDA, torchao's `CPUOffloadOptimizer` (parameters under 4096 elements stay on
        the GPU with an ordinary optimizer) and None. Otherwise `optimizer` unchanged and
        the reason: CPU (no effect), torchao missing, or an optimizer class that is not
        one of torch's. The result works with LR schedulers, `state_dict()`, `zero_grad()`.
    Raises:
        UsageError: gradient clipping is on (CUDA only).
    """
    device = torch.device(device)
    if device.type != "cuda":
        if device.type == "cpu":
            return optimizer, OPTIMIZER_NO_EFFECT_ON_CPU
        return optimizer, f"optimizer offload supports CUDA only, not {device.type}"
    if optimizer_config is not None:
        check_optimizer_offload(device, optimizer_config.max_grad_norm)
    optimizer_class = type(optimizer)
    if not optimizer_class.__module__.startswith("torch.optim"):
        return (
            optimizer,
            f"optimizer offload runs torch optimizers on the CPU; {optimizer_class.__name__} stays on the GPU",
        )
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError:
        return (
            optimizer,
            "torchao is not installed, so the optimizer state stays on the GPU (pip install memfit[torchao])",
        )
    accepted = inspect.signature(optimizer_class.__init__).parameters
    options = {
        key: value
        for key, value in optimizer.defaults.items()
        if key in accepted and key not in _DEVICE_ONLY_OPTIONS  # AdamW's defaults hold more than it takes
    }
    # torchao takes the "params" out of the groups it is given: hand it copies.
    own_groups = [{**group, "params": list(group["params"])} for group in groups]
    return CPUOffloadOptimizer(own_groups, optimizer_class, offload_gradients=False, **options), None
