"""Offloading to host memory: the activations saved for backward.

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

Optimizer offload: memfit.techniques.optimizer_offload.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from memfit.techniques.checkpointing import transformer_blocks
from memfit.techniques.host_memory import empty_host_like

DEFAULT_MIN_OFFLOAD_BYTES = 1 << 16  # smaller tensors cost more in copy latency than they free


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
        host = empty_host_like(tensor, pin=stream is not None)
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


def _resolve(facts, run) -> dict:
    memory = facts.config.memory
    return {"activation_offload": memory.activation_offload,
            "activation_offload_blocks": memory.activation_offload_blocks if memory.activation_offload else None}


def _speed_terms(run, facts) -> float:
    """The saved activations cross the host link in every micro-batch, out in forward and back in backward; counted
    in full (an upper bound: the copies overlap compute where they can)."""
    if not run.activation_offload:
        return 0.0
    return facts.accumulation * facts.activation_transfer_bytes / facts.link_bytes_per_second


def _technique():
    from memfit.techniques.technique import Technique

    return Technique(
        name="activation_offload", stage="step", settings=("activation_offload", "activation_offload_blocks"),
        after=("gradient_checkpointing",), resolve=_resolve, speed_terms=_speed_terms,
        report=lambda run: ({"activation_offload": run.activation_offload_blocks or "all"}
                            if run.activation_offload else {}),
        summary="saved activations go to host memory in forward and come back in backward: the link's time",
    )


TECHNIQUE = _technique()
