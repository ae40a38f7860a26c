"""Exact live-tensor accounting on the training device, by category, phase and module.

`MemoryTracker` counts through the live-storage core (`memfit.memory.live_storage`: a
`TorchDispatchMode` that sees every aten operator, and a hook on
`UntypedStorage.resize_`) and watches every tensor autograd saves for backward
(`saved_tensors_hooks`). Each storage counts once, at its real `nbytes()`, however
many views point to it, and is forgotten when it is freed (a weak reference). It
works the same on CPU (where there are no allocator statistics), on CUDA, and on fake
tensors (the traced estimate runs memfit's step under it).

    tracker = MemoryTracker(device)
    tracker.attach(model, optimizer)
    with tracker:
        for batch in batches:
            with tracker.phase("forward"): loss = ...
            with tracker.phase("backward"): loss.backward()
            with tracker.phase("optimizer"): optimizer.step(); optimizer.zero_grad()
            step_memory = tracker.end_step()
    tracker.peak_bytes, tracker.peak_snapshot(), tracker.timeline()

What it counts: tensor storages on `device`, including those made before tracking
started once it sees them (parameters, gradients and optimizer state are walked at
`attach`, at phase ends and `end_step`; other tensors when an operator reads them),
filed under the categories of `memfit.memory.categories`. Tensors made by a
checkpointed block's recompute and by backward get categories of their own and the
module that made them: the recompute's module, or the module whose backward ran
(the last module whose output's gradient arrived). Host copies made by offloading
(`memfit.techniques.host_memory`) are counted apart: `host_bytes`, `host_peak_bytes`.
What it does not count: the allocator's cache and fragmentation, the CUDA context,
workspaces that kernels allocate internally, and non-tensor memory.

Cost: a Python call per operator, so a step runs a few times slower while tracking.
Nothing is installed when no tracker is entered.

With `cap_bytes`, the tracker raises `torch.OutOfMemoryError` at the operator whose
outputs would take live device bytes past the cap (see `memfit.memory.cap`). The
outputs of that operator are not counted; everything the failed attempt made is
uncounted as soon as the caller drops it (let the exception go out of scope), so a
caller can catch the error, free, and retry.
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from memfit.memory.categories import (
    CATEGORIES,
    DEVICE,
    GRADIENTS,
    HOST,
    OPTIMIZER_STATES,
    OTHER,
    PARAMETERS,
    PeakSnapshot,
    PhaseMemory,
    StepMemory,
    TensorInfo,
)
from memfit.memory.live_storage import EXISTING_OP, LiveStorages
from memfit.memory.modules import ModuleWatcher
from memfit.memory.peaks import PeakBook
from memfit.memory.storage_records import SavedTensor, StorageRecord, optimizers_within

__all__ = ["CATEGORIES", "MemoryTracker", "PeakSnapshot", "PhaseMemory", "StepMemory", "TensorInfo"]

# A numbered path component marks a block of a stack: model.layers.3, transformer.h.3.
_IN_BLOCK = re.compile(r"\.\d+(\.|$)")


class MemoryTracker:
    """Counts live tensor bytes on one device by category, per phase and per module.

    Args:
        device: the training device; storages elsewhere are ignored (host copies aside).
        cap_bytes: emulated memory cap on device bytes; an operator whose outputs would
            pass it raises `torch.OutOfMemoryError` (none by default).
        top_tensors: how many of the largest storages the peak snapshot keeps.
        max_timeline_samples: bound on the samples kept for one step's timeline
            (older samples are thinned, keeping the higher of each pair).
    """

    def __init__(
        self,
        device: torch.device | str,
        cap_bytes: int | None = None,
        *,
        top_tensors: int = 20,
        max_timeline_samples: int = 4000,
    ) -> None:
        self.device = torch.device(device)
        self.cap_bytes = cap_bytes
        self.top_tensors = top_tensors
        self.max_timeline_samples = max_timeline_samples
        self.storages = LiveStorages(self.device, cap_bytes)
        self._book = PeakBook(self.storages, top_tensors, max_timeline_samples)
        self.storages.listener = self._book
        self.storages.after_operator = self._book.sample
        # Through a weak reference: tracker -> storages -> tracker would be a cycle that
        # keeps the tracker (and what its hooks reach) alive until the garbage collector runs.
        tracker_ref = weakref.ref(self)

        def describe_birth(record: StorageRecord, tensor: torch.Tensor | None) -> None:
            tracker = tracker_ref()
            if tracker is not None:
                tracker._describe_birth(record, tensor)

        self.storages.describe_birth = describe_birth
        self._modules = ModuleWatcher(self)
        self._vocab_size: int | None = None
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._depth = 0
        self._saved_hooks: torch.autograd.graph.saved_tensors_hooks | None = None

    # ----------------------------------------------------------------- public API

    def attach(self, model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Watch `model` (module attribution, gradients) and `optimizer` (its state).

        Call again after building a new optimizer or wrapping the model; existing
        parameters, gradients and optimizer state are counted right away.
        """
        self.detach()
        self._model = model
        self._optimizer = optimizer
        self._vocab_size = _vocab_size(model)
        self._modules.attach(model)
        self._classify()

    def detach(self) -> None:
        """Stop watching the model and optimizer (counts already made stay)."""
        self._modules.detach()
        self._model = None
        self._optimizer = None

    def __enter__(self) -> MemoryTracker:
        self._depth += 1
        if self._depth == 1:
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_hooks.__enter__()
            self.storages.__enter__()
            self._classify()
        return self

    def __exit__(self, *exc_info) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.storages.__exit__(*exc_info)
            self._saved_hooks.__exit__(*exc_info)
            self._saved_hooks = None
            self._modules.stack.clear()
            self._classify()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute what happens inside to phase `name` ("forward", "backward", ...)."""
        self.storages.flush()
        self._book.enter_phase(name)
        try:
            yield
        finally:
            self._book.exit_phase()
            self._modules.forget_backward()
            self._classify()

    def end_step(self) -> StepMemory:
        """Close the current step: return its memory and reset the per-step peak."""
        self._classify()
        step = self._book.step
        peak, phase_stats, host_peak = self._book.close_step()
        return StepMemory(
            step=step,
            peak_bytes=peak.peak,
            breakdown=dict(peak.breakdown),
            phases=[PhaseMemory(name, stats.peak, dict(stats.breakdown)) for name, stats in phase_stats.items()],
            live_bytes_at_end=self.storages.live[DEVICE],
            live_breakdown_at_end=dict(self.storages.totals[DEVICE]),
            host_peak_bytes=host_peak,
            host_bytes_at_end=self.storages.live[HOST],
        )

    @property
    def current_bytes(self) -> int:
        """Live tensor bytes on the device now."""
        self.storages.flush()
        return self.storages.live[DEVICE]

    @property
    def peak_bytes(self) -> int:
        """The most live tensor bytes on the device seen since tracking started."""
        self.storages.flush()
        return self._book.run_peak.peak

    @property
    def host_bytes(self) -> int:
        """Bytes held in host memory on purpose (offloaded copies) now."""
        self.storages.flush()
        return self.storages.live[HOST]

    @property
    def host_peak_bytes(self) -> int:
        """The most host bytes (offloaded copies) seen since tracking started."""
        self.storages.flush()
        return self._book.host_peak

    def breakdown(self) -> dict[str, int]:
        """Live device bytes now, by category."""
        self.storages.flush()
        return dict(self.storages.totals[DEVICE])

    def peak_snapshot(self) -> PeakSnapshot:
        """The largest live storages at the run's peak, and compute bytes by module."""
        self.storages.flush()
        book = self._book
        book.settle()
        if book.snapshot is None:
            book.capture_peak()
        top_tensors = []
        for record, category in book.snapshot_records:
            # A role found later (optimizer state, gradient) was already its role then.
            info = _describe(record)
            info.category = record.role if record.role != OTHER else category
            top_tensors.append(info)
        return dataclasses.replace(
            book.snapshot,
            breakdown=dict(book.snapshot_peak.breakdown),
            top_tensors=top_tensors,
            activation_peak_bytes=book.activation_max,
            module_activation_bytes=dict(book.module_activations),
            module_input_bytes=dict(self._modules.inputs),
            host_peak_bytes=book.host_peak,
        )

    def timeline(self, which: str = "peak") -> list[tuple[int, str, dict[str, int]]]:
        """Samples (event_index, phase, {category: bytes}) of one step, for plotting.

        `which`: "peak" (the step where the run's peak happened), "last" (the last
        completed step) or "current" (the step in progress). A sample is taken after
        every operator or free that changed the live bytes.
        """
        self.storages.flush()
        return self._book.timeline_of(which).samples()

    def live_tensors(self, count: int | None = None) -> list[TensorInfo]:
        """The live device storages now, largest first (all of them unless `count`)."""
        self.storages.flush()
        records = [record for record in self.storages.records.values() if record.place == DEVICE]
        records.sort(key=lambda record: record.nbytes, reverse=True)
        return [_describe(record) for record in records[:count]]

    # ------------------------------------------------------------ what made a storage

    def _describe_birth(self, record: StorageRecord, tensor: torch.Tensor | None) -> None:
        record.phase = self._book.phase
        module, recomputed, backward = self._modules.where()
        record.module = module
        if record.op != EXISTING_OP:  # a storage first seen now, not made now, was made before
            record.recomputed, record.backward = recomputed, backward
        vocab = self._vocab_size
        if vocab and tensor is not None and tensor.dim() >= 2 and tensor.shape[-1] == vocab:
            # Inside a block (model.layers.3...) a [..., vocab] tensor is an MLP width that happens to match.
            record.logits = not _IN_BLOCK.search(record.module)

    # ------------------------------------------------------------ roles

    def _classify(self) -> None:
        """Give parameters, gradients and optimizer state their roles (walks them all)."""
        storages = self.storages
        storages.flush()
        roles: dict[int, str] = {}
        if self._model is not None:
            for parameter in self._model.parameters():
                self._claim(parameter, PARAMETERS, roles)
            for parameter in self._model.parameters():
                if parameter.grad is not None:
                    self._claim(parameter.grad, GRADIENTS, roles)
        for optimizer in optimizers_within(self._optimizer):
            for state in list(optimizer.state.values()):
                for leaf in tree_leaves(state):
                    if isinstance(leaf, torch.Tensor):
                        self._claim(leaf, OPTIMIZER_STATES, roles)
        for key, record in list(storages.records.items()):
            role = roles.get(key, OTHER)
            if record.role != role:
                storages.update(record, role=role)
        self._book.apply_late_roles()
        self._book.sample()

    def _claim(self, tensor: torch.Tensor, role: str, roles: dict[int, str]) -> None:
        record = self.storages.track(tensor)
        if record is not None and record.key not in roles:  # first role claimed wins
            roles[record.key] = role

    @property
    def active(self) -> bool:
        """Inside `with tracker:`."""
        return self._depth > 0

    def parameter_in_use(self, parameter: torch.Tensor) -> None:
        self._give_role(parameter, PARAMETERS)

    def gradient_ready(self, gradient: torch.Tensor) -> None:
        self._give_role(gradient, GRADIENTS)

    def _give_role(self, tensor: torch.Tensor, role: str) -> None:
        """File one storage under `role` now, unless it already has a role."""
        self.storages.flush()
        record = self.storages.track(tensor)
        if record is not None and record.role == OTHER:
            self.storages.update(record, role=role)
            self._book.sample()

    # ----------------------------------------------------- saved tensors

    def _pack(self, tensor: torch.Tensor):
        self.storages.flush()
        record = self.storages.track(tensor)
        if record is None:
            return tensor.detach()  # not counted here; detached for the reason below
        self.storages.update(record, saved=record.saved + 1)
        # Keep a detached alias: holding the tensor itself would hold its grad_fn,
        # which holds this object: a cycle through C++ that never gets collected.
        return SavedTensor(tensor.detach(), record, self.storages.events)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, SavedTensor) else packed


def _describe(record: StorageRecord) -> TensorInfo:
    return TensorInfo(
        shape=record.shape,
        dtype=record.dtype,
        bytes=record.nbytes,
        category=record.category,
        op=record.op,
        module=record.module,
        phase=record.phase,
    )


def _vocab_size(model: nn.Module) -> int | None:
    """The vocabulary size, to recognize logits by their last dimension; None if ambiguous."""
    getter = getattr(model, "get_output_embeddings", None)
    try:
        head = getter() if getter is not None else None
    except (AttributeError, NotImplementedError):
        head = None
    weight = getattr(head, "weight", None)
    if weight is None or weight.dim() != 2:
        return None
    vocab, hidden = weight.shape
    return vocab if vocab != hidden else None  # a square head would make every hidden state "logits"
