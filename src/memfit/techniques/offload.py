"""Offloading to host memory: activations saved for backward, and optimizer state.

Activation offload (`--activation-offload`)
    Saves: every tensor autograd saves for backward outside a checkpoint's recompute
    (above `min_bytes`, parameters excluded) leaves device memory during forward and
    comes back for backward. With gradient checkpointing (any mode) that is each
    checkpointed block's input ("offloaded checkpoints"): the device holds the inputs
    of about two blocks (the one being recomputed and the one fetched ahead) instead of
    all of them. Without checkpointing it is every saved activation.
    Costs: a device-to-host copy in forward and a host-to-device copy in backward of
    the offloaded bytes, as much pinned host memory, and host-link bandwidth. On CUDA
    both copies run on a side stream: forward copies overlap the next operators, and
    backward fetches the next tensor to be needed (one block ahead under checkpointing)
    while the current one is used, so compute waits only when the link is slower than
    the block. A tensor saved several times (the same storage, unchanged) is copied once.
    CPU: the same code runs; the "host" copies are filed as host memory by memfit's
    memory accounting (`memfit.techniques.host_memory`), so the tracker and `--memory-cap` show the
    device saving at reduced shapes exactly as a GPU run would have it.

Partial offload (`--activation-offload-blocks N`, with checkpointing)
    Only what the first N transformer blocks save for backward (a checkpointed block:
    its input) goes to host memory; the later blocks and the output head keep theirs on
    the device. Backward needs those first, so it starts without waiting for the host
    link, and the last offloaded block's input is fetched while the first kept block is
    recomputed. A saved leaf that requires grad (the embedding output under LoRA with
    checkpointing) stays: the graph holds it on the device anyway. Saves: N block inputs of device memory instead of all of them; costs N
    block inputs of pinned host memory and 2 x that over the host link per micro-batch,
    so a GPU with memory to spare keeps the rest of its blocks and the host holds less.
    The numerics are those of the plain run (a tensor comes back bit for bit).

Optimizer offload (`--optimizer-offload`, CUDA only, needs torchao)
    Saves: the optimizer state (8 bytes per parameter for AdamW) and the fp32 master
    copy used by the step live in host memory; the step runs on the CPU.
    Costs: each gradient crosses to the host in backward and each parameter comes back
    after the step (2 x 4 bytes per parameter over PCIe per step), and the CPU AdamW
    step time. Gradient clipping cannot be used: the gradients are copied to the host
    as they are produced, before the loop could clip them (`check_optimizer_offload`).
    With `--optimizer-in-backward` see `HostSteppedOptimizer` (any device).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.config import OptimizerConfig
from memfit.errors import UsageError
from memfit.techniques.checkpointing import transformer_blocks
from memfit.techniques.host_memory import host_allocations, mark_host

OPTIMIZER_NO_EFFECT_ON_CPU = "optimizer offload has no effect on CPU: optimizer state already lives in host memory"
DEFAULT_MIN_OFFLOAD_BYTES = 1 << 16  # smaller tensors cost more in copy latency than they free


def _mark_host(tensors) -> None:
    """File tensors made outside `host_allocations` (e.g. from Python numbers) as host memory."""
    for tensor in tensors:
        if isinstance(tensor, torch.Tensor):
            mark_host(tensor)


def _to_host(tensor: torch.Tensor, pin: bool) -> torch.Tensor:
    """An empty host tensor shaped like `tensor` (contiguous), filed as host memory.

    Filed both ways: allocated inside `host_allocations` for a counter running now, and
    marked for one that starts later (an optimizer is built before tracking starts).
    """
    with host_allocations():
        host = torch.empty(tensor.size(), dtype=tensor.dtype, device="cpu", pin_memory=pin)
    _mark_host([host])
    return host


@dataclass(eq=False)
class _Offloaded:
    """One saved tensor in host memory: what autograd holds instead of the tensor."""

    host: torch.Tensor
    device: torch.device
    generation: int
    index: int
    copied: Any = None
    """CUDA event: the device-to-host copy is complete."""
    fetched: torch.Tensor | None = None
    """The tensor brought back ahead of its use (CUDA: on the side stream)."""
    fetched_ready: Any = None
    returned: Any = None
    """Weak reference to the device tensor last handed to autograd (shared by repeated saves)."""

    @property
    def nbytes(self) -> int:
        return self.host.numel() * self.host.element_size()


class ActivationOffload(torch.autograd.graph.saved_tensors_hooks):
    """Context manager: tensors saved for backward inside it go to host memory and back.

    Args:
        model: its parameters (and views of them) are never offloaded.
        min_bytes: tensors smaller than this stay where they are.
        device: only tensors on this device are offloaded (default: any; on a CUDA run
            a CPU tensor is already in host memory).
        prefetch: when a tensor is unpacked, bring back the one saved just before it, so
            that the next block's input arrives while the current block is recomputed
            (False: fetch each tensor when it is needed).
        blocks: offload only what the first `blocks` transformer blocks of `model` (its
            longest nn.ModuleList) save: every tensor saved before the forward of block
            `blocks - 1` has returned (the blocks before and the embedding side
            included). The later blocks and the head keep their tensors on the device;
            the first kept block's input, when unpacked, starts the fetch of the last
            offloaded one. None: offload everything saved. Needs `model`.

    Works on any device; on CUDA the copies use pinned memory and a side stream.
    `offloaded_tensors` and `offloaded_bytes` count what was moved (repeated saves of
    one tensor count once); `fetched_ahead` counts tensors brought back before their use.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        min_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
        device: torch.device | str | None = None,
        prefetch: bool = True,
        blocks: int | None = None,
    ):
        if blocks is not None and (model is None or blocks < 0):
            raise ValueError(f"offloading the first {blocks} blocks needs the model and a count of 0 or more")
        self.blocks = blocks
        self._block_modules = list(transformer_blocks(model)) if blocks is not None else []
        self._block_hooks: list = []
        self._finished = 0  # blocks whose forward has returned in the current forward pass
        self._forward_over = False  # backward has unpacked since the last forward pack
        self._first_kept: weakref.ref | None = None  # the first kept block's input: unpacking it fetches ahead
        self.min_bytes = min_bytes
        self.device_type = torch.device(device).type if device is not None else None
        self.prefetch = prefetch
        self.offloaded_tensors = 0
        self.offloaded_bytes = 0
        self.fetched_ahead = 0
        self._parameter_storages = (
            {p.untyped_storage().data_ptr() for p in model.parameters()} if model is not None else set()
        )
        self._stream = None
        self._generation = 0
        self._records: list[weakref.ref] = []  # this forward's offloads, in the order they were saved
        self._unpacked_since_pack = False
        # (storage key, offset, shape, stride, dtype) -> (storage ref, version, record ref): repeated saves
        self._seen: dict[tuple, tuple[weakref.ref, int, weakref.ref]] = {}
        super().__init__(self._pack, self._unpack)

    def _should_offload(self, tensor: torch.Tensor) -> bool:
        if tensor.layout != torch.strided or type(tensor) not in (torch.Tensor, nn.Parameter):
            return False  # fake, sparse and subclass tensors (DTensor, NF4) stay as they are
        if self.device_type is not None and tensor.device.type != self.device_type:
            return False
        if (
            isinstance(tensor, nn.Parameter)
            or isinstance(tensor._base, nn.Parameter)  # e.g. weight.t() saved by a matmul
            or tensor.untyped_storage().data_ptr() in self._parameter_storages
        ):
            return False  # weights are needed on the device anyway
        return tensor.numel() * tensor.element_size() >= self.min_bytes

    def _side_stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def __enter__(self):
        super().__enter__()
        for index, block in enumerate(self._block_modules):
            self._block_hooks.append(block.register_forward_hook(functools.partial(self._block_returned, index)))
        return self

    def __exit__(self, *exc_info):
        for handle in self._block_hooks:
            handle.remove()
        self._block_hooks = []
        return super().__exit__(*exc_info)

    def _block_returned(self, index: int, module, args, output) -> None:
        if not _in_backward():  # a checkpoint's recompute runs the block again in backward
            self._finished = max(self._finished, index + 1)

    def _keeps_on_device(self, tensor: torch.Tensor) -> bool:
        """Partial offload: whether `tensor`, saved now, belongs to a block after the first `blocks`."""
        if _in_backward():
            return True  # saved by a recompute inside backward (a tiled MLP's): freed before backward ends
        if self._forward_over:  # the first save of a new forward
            self._forward_over = False
            self._finished = 0
            self._first_kept = None
        if tensor.is_leaf and tensor.requires_grad:
            # The graph holds it on the device anyway (the embedding output that LoRA with
            # checkpointing makes require grad): a host copy would free nothing.
            return True
        if self._finished < self.blocks:
            return False
        if self._first_kept is None and self._should_offload(tensor):
            self._first_kept = weakref.ref(tensor)
        return True

    def _pack(self, tensor: torch.Tensor) -> Any:
        if self.blocks is not None and self._keeps_on_device(tensor):
            return tensor
        if not self._should_offload(tensor):
            return tensor
        if self._unpacked_since_pack:  # a new forward: prefetching never crosses into an older graph
            self._unpacked_since_pack = False
            self._generation += 1
            self._records = []
            self._seen.clear()
        storage = tensor.untyped_storage()
        key = (storage._cdata, tensor.storage_offset(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        seen = self._seen.get(key)
        if seen is not None:
            storage_ref, version, record_ref = seen
            record = record_ref()
            if record is not None and storage_ref() is storage and version == tensor._version:
                return record  # the same bytes saved again (e.g. one input of three projections)
        record = self._copy_out(tensor)
        self._seen[key] = (weakref.ref(storage), tensor._version, weakref.ref(record))
        self._records.append(weakref.ref(record))
        self.offloaded_tensors += 1
        self.offloaded_bytes += record.nbytes
        return record

    def _copy_out(self, tensor: torch.Tensor) -> _Offloaded:
        stream = self._side_stream(tensor.device)
        host = _to_host(tensor, pin=stream is not None)
        record = _Offloaded(host, tensor.device, self._generation, len(self._records))
        if stream is None:
            host.copy_(tensor)
            return record
        # The copy runs beside compute; record_stream keeps the allocator from reusing
        # the device memory before the copy has read it.
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
            record.copied = stream.record_event()
        tensor.record_stream(stream)
        return record

    def _unpack(self, packed: Any) -> torch.Tensor:
        self._forward_over = True
        if isinstance(packed, torch.Tensor):
            first_kept = self._first_kept() if self._first_kept is not None else None
            if first_kept is not None and packed is first_kept:
                self._first_kept = None
                if self.prefetch:  # the last offloaded block's input comes while the first kept block runs
                    self._fetch_before(len(self._records))
            return packed
        record: _Offloaded = packed
        self._unpacked_since_pack = True
        previous = record.returned() if record.returned is not None else None
        if previous is not None:
            return previous  # saved several times: every user gets the same device tensor
        tensor = self._bring_back(record)
        record.returned = weakref.ref(tensor)
        if self.prefetch and record.generation == self._generation:
            self._fetch_ahead(record)
        return tensor

    def _bring_back(self, record: _Offloaded) -> torch.Tensor:
        stream = self._side_stream(record.device)
        if record.fetched is not None:
            tensor, record.fetched = record.fetched, None
            if stream is not None:
                compute = torch.cuda.current_stream(record.device)
                compute.wait_event(record.fetched_ready)
                tensor.record_stream(compute)  # allocated on the side stream, used and freed on compute
            return tensor
        if stream is None:
            return torch.empty_like(record.host, device=record.device).copy_(record.host)
        compute = torch.cuda.current_stream(record.device)
        compute.wait_event(record.copied)  # the forward copy must be complete before reading the host buffer
        return record.host.to(record.device, non_blocking=True)

    def _fetch_ahead(self, current: _Offloaded) -> None:
        """Start bringing back the tensor saved last before `current`: the next one backward needs.

        One tensor ahead is one block ahead under checkpointing (a block saves only its
        input); the device then holds two blocks' inputs, never more.
        """
        self._fetch_before(current.index)

    def _fetch_before(self, end: int) -> None:
        """Start bringing back the last live, unused record of this forward saved before index `end`."""
        index = end - 1
        while index >= 0:
            record = self._records[index]()
            index -= 1
            if record is None or record.returned is not None:
                continue  # freed with its graph, or already used
            if record.fetched is not None:
                return
            stream = self._side_stream(record.device)
            if stream is None:
                record.fetched = torch.empty_like(record.host, device=record.device).copy_(record.host)
            else:
                with torch.cuda.stream(stream):  # after this record's forward copy: same stream
                    record.fetched = record.host.to(record.device, non_blocking=True)
                    record.fetched_ready = stream.record_event()
            self.fetched_ahead += 1
            return


def _in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def activation_offload(
    device: torch.device | str,
    model: nn.Module | None = None,
    min_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
    blocks: int | None = None,
) -> tuple[contextlib.AbstractContextManager, str | None]:
    """The context to run forward and backward in, and why it does not run as asked (or None).

    Wrap the forward (the loss computation); backward may run inside or outside it.
    It runs on every device: see the module docstring for what CPU runs show.
    `blocks`: offload only what the first `blocks` transformer blocks save (None: all);
    a model without a list of blocks offloads everything, and the reason says so.
    """
    if blocks is not None:
        try:
            transformer_blocks(model) if model is not None else None
        except ValueError:
            model = None
        if model is None:
            return (ActivationOffload(None, min_bytes=min_bytes, device=device),
                    f"no list of transformer blocks to count {blocks} of: every saved tensor is offloaded")
    return ActivationOffload(model, min_bytes=min_bytes, device=device, blocks=blocks), None


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


class HostSteppedOptimizer:
    """The optimizer of one parameter, stepping a host copy of it: optimizer offload in backward.

    Built by `OptimizerInBackward` through `host_stepped(make_optimizer, device)`, once per
    trainable parameter. When backward completes the parameter's gradient, `step()`
    copies the gradient to host memory, runs the wrapped optimizer on the host copy of
    the parameter (its state is created there), and copies the result back; the caller
    then frees the device gradient.

    Device memory: the parameters and one gradient at a time. Host memory: a copy of
    each parameter and of its gradient (pinned on CUDA) and the optimizer state.
    Costs: per step, each gradient crosses to the host and each parameter back (on the
    compute stream: backward waits for the copy and the host step of each parameter);
    the step itself runs on the CPU. The numbers are the wrapped optimizer's on that
    CPU: on a CPU run they equal the plain run's exactly.

    The host copy follows the parameter: if anything else writes the parameter (loading
    a checkpoint), the next step starts from the parameter's new value.
    """

    def __init__(self, parameter: nn.Parameter, make_optimizer: Callable, pin: bool):
        self.parameter = parameter
        self._pin = pin
        master = _to_host(parameter, pin)
        master.copy_(parameter.detach())
        self.master = nn.Parameter(master)
        self.master.grad = _to_host(parameter, pin)
        with host_allocations():
            self.inner = make_optimizer([self.master])
        self._synced_version = parameter._version

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @torch.no_grad()
    def step(self, closure=None):
        parameter = self.parameter
        if parameter.grad is None:
            return None
        if parameter._version != self._synced_version:
            self.master.copy_(parameter)
        self.master.grad.copy_(parameter.grad)  # blocking on CUDA: the host step reads it next
        with host_allocations():  # the optimizer's state and temporaries are host memory
            self.inner.step()
        _mark_host(value for state in self.inner.state.values() for value in state.values())
        parameter.copy_(self.master, non_blocking=self._pin)
        self._synced_version = parameter._version
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.parameter.grad = None

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        with host_allocations():
            self.inner.load_state_dict(state_dict)
        _mark_host(value for state in self.inner.state.values() for value in state.values())


def host_stepped(make_optimizer: Callable, device: torch.device | str) -> Callable:
    """A per-parameter optimizer factory for `OptimizerInBackward` that steps on the host.

    `make_optimizer` builds the optimizer of a one-element parameter list, as for
    `OptimizerInBackward`; it receives the host copy of the parameter.
    """
    pin = torch.device(device).type == "cuda"

    def make(params: list[nn.Parameter]) -> HostSteppedOptimizer:
        (parameter,) = params
        return HostSteppedOptimizer(parameter, make_optimizer, pin)

    return make
