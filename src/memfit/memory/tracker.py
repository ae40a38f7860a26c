"""Exact live-tensor accounting on the training device, by category, phase and module.

`MemoryTracker` watches every aten operator (a `TorchDispatchMode`) and every tensor
autograd saves for backward (`saved_tensors_hooks`). It counts each storage once,
at its real `nbytes()`, however many views point to it, and forgets it when the
storage is freed (a weak reference on the storage). It works the same on CPU (where
there are no allocator statistics) and CUDA.

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
`attach`, at phase ends and `end_step`; other tensors when an operator reads them).
What it does not count: the allocator's cache and fragmentation, the CUDA context,
workspaces that kernels allocate internally, and non-tensor memory.

Cost: a Python call per operator, so a step runs a few times slower while tracking.
Nothing is installed when no tracker is entered.

With `cap_bytes`, the tracker raises `torch.OutOfMemoryError` at the operator whose
outputs would take live bytes past the cap (see `memfit.memory.cap`). The outputs of
that operator are not counted; everything the failed attempt made is uncounted as
soon as the caller drops it (let the exception go out of scope), so a caller can
catch the error, free, and retry.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memfit.memory.cap import cap_exceeded_error
from memfit.memory.categories import (
    ACTIVATIONS,
    CATEGORIES,
    GRADIENTS,
    NO_PHASE,
    OPTIMIZER_STATES,
    OTHER,
    PARAMETERS,
    PeakSnapshot,
    PhaseMemory,
    StepMemory,
    TensorInfo,
    Timeline,
    empty_breakdown,
)
from memfit.memory.storage_records import PeakRecord, SavedTensor, StorageRecord, optimizers_within

__all__ = ["CATEGORIES", "MemoryTracker", "PeakSnapshot", "PhaseMemory", "StepMemory", "TensorInfo"]

NO_MODULE = "(outside modules)"
EXISTING_OP = "(existing)"


class _AccountingMode(TorchDispatchMode):
    """Sees every aten operator: counts the storages it reads and allocates."""

    def __init__(self, tracker: MemoryTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.tracker._adopt_inputs(args, kwargs)
        out = func(*args, **kwargs)
        error = self.tracker._account_outputs(func, out)
        if error is not None:
            del out  # the traceback must not keep the refused outputs alive
            try:
                raise error
            finally:
                # A local naming the exception would make frame -> error -> traceback ->
                # frame a cycle, keeping every tensor of the failed attempt until gc runs.
                error = None
        return out


class MemoryTracker:
    """Counts live tensor bytes on one device by category, per phase and per module.

    Args:
        device: the training device; storages elsewhere are ignored.
        cap_bytes: emulated memory cap; an operator whose outputs would pass it raises
            `torch.OutOfMemoryError` (none by default).
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
        self._records: dict[int, StorageRecord] = {}
        # Frees and released saves, queued by callbacks and applied at safe points.
        self._events: collections.deque = collections.deque()
        self._by_category = empty_breakdown()
        self._current = 0
        # Run peak, and the snapshot taken at the first decrease after a new peak.
        self._births = 0
        self._run_peak = PeakRecord(0, empty_breakdown(), 0)
        self._peak_phase = NO_PHASE
        self._peak_step = 0
        self._peak_dirty = False
        self._snapshot: PeakSnapshot | None = None
        self._snapshot_peak = PeakRecord(0, empty_breakdown(), 0)
        self._snapshot_records: list[tuple[StorageRecord, str]] = []
        self._activation_max = 0
        self._activation_dirty = False
        self._module_activations: dict[str, int] = {}
        self._module_inputs: dict[str, int] = {}
        # Current step.
        self._step = 0
        self._step_peak = PeakRecord(0, empty_breakdown(), 0)
        self._phase_stack: list[str] = []
        self._phase_stats: dict[str, PeakRecord] = {}
        self._timeline = Timeline(max_timeline_samples)
        self._late_roles: list[tuple[int, int, int, str, str]] = []  # for the timeline, at the next _classify
        self._peak_timeline: Timeline | None = None
        self._last_timeline: Timeline | None = None
        # Model and optimizer.
        self._module_stack: list[str] = []
        self._model: nn.Module | None = None
        self._optimizer: torch.optim.Optimizer | None = None
        self._hook_handles: list = []
        self._depth = 0
        self._mode: _AccountingMode | None = None
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
        root_name = type(model).__name__
        for name, module in model.named_modules():
            qualified = name or root_name
            self._hook_handles.append(
                module.register_forward_pre_hook(self._make_pre_hook(qualified), with_kwargs=True)
            )
            self._hook_handles.append(module.register_forward_hook(self._make_post_hook(qualified), always_call=True))
        grad_hook = self._make_grad_hook()
        for parameter in model.parameters():
            if parameter.requires_grad:
                self._hook_handles.append(parameter.register_post_accumulate_grad_hook(grad_hook))
        self._classify()

    def detach(self) -> None:
        """Stop watching the model and optimizer (counts already made stay)."""
        for handle in self._hook_handles:
            handle.remove()
        self._hook_handles.clear()
        self._model = None
        self._optimizer = None
        self._module_stack.clear()

    def __enter__(self) -> MemoryTracker:
        self._depth += 1
        if self._depth == 1:
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._saved_hooks.__enter__()
            self._mode = _AccountingMode(self)
            self._mode.__enter__()
            self._classify()
        return self

    def __exit__(self, *exc_info) -> None:
        self._depth -= 1
        if self._depth == 0:
            self._mode.__exit__(*exc_info)
            self._saved_hooks.__exit__(*exc_info)
            self._mode = None
            self._saved_hooks = None
            self._module_stack.clear()
            self._classify()

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Attribute what happens inside to phase `name` ("forward", "backward", ...)."""
        self._flush()
        self._phase_stack.append(name)
        stats = self._phase_stats.get(name)
        if stats is None:
            self._phase_stats[name] = PeakRecord(self._current, dict(self._by_category), self._births)
        else:  # entered again (next micro-batch), maybe higher than before
            stats.raise_to(self._current, self._by_category, self._births)
        try:
            yield
        finally:
            self._phase_stack.pop()
            self._classify()

    def end_step(self) -> StepMemory:
        """Close the current step: return its memory and reset the per-step peak."""
        self._classify()
        phases = [PhaseMemory(name, stats.peak, dict(stats.breakdown)) for name, stats in self._phase_stats.items()]
        result = StepMemory(
            step=self._step,
            peak_bytes=self._step_peak.peak,
            breakdown=dict(self._step_peak.breakdown),
            phases=phases,
            live_bytes_at_end=self._current,
            live_breakdown_at_end=dict(self._by_category),
        )
        if self._peak_step == self._step:
            self._peak_timeline = self._timeline
        self._last_timeline = self._timeline
        self._timeline = Timeline(self.max_timeline_samples)
        self._phase_stats = {}
        self._step += 1
        self._step_peak = PeakRecord(self._current, dict(self._by_category), self._births)
        self._sample()
        return result

    @property
    def current_bytes(self) -> int:
        """Live tensor bytes on the device now."""
        self._flush()
        return self._current

    @property
    def peak_bytes(self) -> int:
        """The most live tensor bytes seen since tracking started."""
        self._flush()
        return self._run_peak.peak

    def breakdown(self) -> dict[str, int]:
        """Live bytes now, by category."""
        self._flush()
        return dict(self._by_category)

    def peak_snapshot(self) -> PeakSnapshot:
        """The largest live storages at the run's peak, and activation bytes by module."""
        self._flush()
        self._settle()
        if self._snapshot is None:
            self._capture_peak()
        top_tensors = []
        for record, category in self._snapshot_records:
            # A role found later (optimizer state, gradient) was already its role then.
            info = self._describe(record)
            info.category = record.role if record.role != OTHER else category
            top_tensors.append(info)
        return dataclasses.replace(
            self._snapshot,
            breakdown=dict(self._snapshot_peak.breakdown),
            top_tensors=top_tensors,
            activation_peak_bytes=self._activation_max,
            module_activation_bytes=dict(self._module_activations),
            module_input_bytes=dict(self._module_inputs),
        )

    def timeline(self, which: str = "peak") -> list[tuple[int, str, dict[str, int]]]:
        """Samples (event_index, phase, {category: bytes}) of one step, for plotting.

        `which`: "peak" (the step where the run's peak happened), "last" (the last
        completed step) or "current" (the step in progress). A sample is taken after
        every operator or free that changed the live bytes.
        """
        self._flush()
        if which == "peak":
            timeline = self._peak_timeline or self._timeline
        elif which == "last":
            timeline = self._last_timeline or self._timeline
        elif which == "current":
            timeline = self._timeline
        else:
            raise ValueError(f"timeline(which=...) must be 'peak', 'last' or 'current', not {which!r}")
        return timeline.samples()

    def live_tensors(self, count: int | None = None) -> list[TensorInfo]:
        """The live storages now, largest first (all of them unless `count`)."""
        self._flush()
        records = list(self._records.values())
        records.sort(key=lambda record: record.nbytes, reverse=True)
        return [self._describe(record) for record in records[:count]]

    # ------------------------------------------------------------ storage counting

    def _storage_of(self, tensor: torch.Tensor) -> torch.UntypedStorage | None:
        try:
            storage = tensor.untyped_storage()
        except (RuntimeError, NotImplementedError, TypeError):
            return None  # sparse, nested, or a subclass without a plain storage
        device = storage.device
        if device.type != self.device.type:
            return None
        if self.device.index is not None and device.index != self.device.index:
            return None
        return storage

    def _track(self, storage: torch.UntypedStorage, tensor: torch.Tensor, op: str) -> StorageRecord:
        """The record of `storage`, counting it first if it is new (or was resized)."""
        key = storage._cdata
        record = self._records.get(key)
        nbytes = storage.nbytes()
        if record is not None:
            if nbytes != record.nbytes:
                self._apply(record.category, nbytes - record.nbytes)
                record.nbytes = nbytes
            return record
        module = self._module_stack[-1] if self._module_stack else NO_MODULE
        phase = self._phase_stack[-1] if self._phase_stack else NO_PHASE
        record = StorageRecord(key, self._births, nbytes, tensor, op, module, phase)
        self._births += 1
        events = self._events
        record.ref = weakref.ref(storage, lambda ref, key=key: events.append(("free", key, ref)))
        self._records[key] = record
        self._apply(OTHER, nbytes)
        return record

    def _adopt_inputs(self, args: tuple, kwargs: dict) -> None:
        self._flush()
        for leaf in tree_leaves((args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                storage = self._storage_of(leaf)
                if storage is not None and storage._cdata not in self._records:
                    self._track(storage, leaf, EXISTING_OP)

    def _account_outputs(self, func, out) -> torch.OutOfMemoryError | None:
        """Count the outputs of `func`; return the cap error instead if they do not fit."""
        self._flush()
        new: dict[int, tuple[torch.UntypedStorage, torch.Tensor]] = {}
        for leaf in tree_leaves(out):
            if not isinstance(leaf, torch.Tensor):
                continue
            storage = self._storage_of(leaf)
            if storage is None:
                continue
            key = storage._cdata
            if key in self._records:
                self._track(storage, leaf, "")  # in-place or view: only a resize counts
            elif key not in new:
                new[key] = (storage, leaf)
        if not new:
            self._sample()
            return None
        if self.cap_bytes is not None:
            requested = sum(storage.nbytes() for storage, _ in new.values())
            if self._current + requested > self.cap_bytes:
                return cap_exceeded_error(requested, self._current, self.cap_bytes)
        op = str(func.overloadpacket)
        for storage, tensor in new.values():
            self._track(storage, tensor, op)
        self._sample()
        return None

    def _flush(self) -> None:
        """Apply the frees and released saves that callbacks have queued."""
        events = self._events
        changed = False
        while events:
            kind, item, ref = events.popleft()
            changed = True
            if kind == "free":
                record = self._records.get(item)
                if record is None or record.ref is not ref:
                    continue  # the address was reused by a storage counted since
                self._apply(record.category, -record.nbytes)
                del self._records[item]
            else:
                record = item
                self._settle()
                before = record.category
                record.saved -= 1
                # A storage already freed is no longer counted: nothing to move.
                if self._records.get(record.key) is record:
                    self._move(record.nbytes, before, record.category)
        if changed:
            self._sample()

    def _apply(self, category: str, delta: int) -> None:
        """Change the live bytes of `category`; keep peaks and snapshots up to date."""
        if delta < 0:
            # The live set is about to shrink: if it was a new peak, describe it now.
            if self._peak_dirty:
                self._capture_peak()
            if self._activation_dirty and category == ACTIVATIONS:
                self._capture_activations()
        self._by_category[category] += delta
        self._current += delta
        if delta <= 0:
            return
        if category == ACTIVATIONS and self._by_category[ACTIVATIONS] > self._activation_max:
            self._activation_max = self._by_category[ACTIVATIONS]
            self._activation_dirty = True
        self._step_peak.raise_to(self._current, self._by_category, self._births)
        for name in self._phase_stack:
            self._phase_stats[name].raise_to(self._current, self._by_category, self._births)
        if self._run_peak.raise_to(self._current, self._by_category, self._births):
            self._peak_phase = self._phase_stack[-1] if self._phase_stack else NO_PHASE
            self._peak_step = self._step
            self._peak_dirty = True

    def _settle(self) -> None:
        """Take pending snapshots now, before a record changes category under them."""
        if self._peak_dirty:
            self._capture_peak()
        if self._activation_dirty:
            self._capture_activations()

    def _move(self, nbytes: int, source: str, target: str) -> None:
        if nbytes and source != target:
            self._apply(source, -nbytes)
            self._apply(target, nbytes)

    def _set_role(self, record: StorageRecord, role: str) -> None:
        self._settle()
        before = record.category
        record.role = role
        self._move(record.nbytes, before, record.category)
        if role != OTHER and before in (ACTIVATIONS, OTHER):
            # Optimizer state made lazily in the first step is only recognized after it:
            # give past peaks it was part of the right breakdown.
            for peak in (self._run_peak, self._step_peak, *self._phase_stats.values()):
                peak.reclassify(record, before, role)
            if self._snapshot is not None:
                self._snapshot_peak.reclassify(record, before, role)
            self._late_roles.append((record.born, self._timeline.next_index, record.nbytes, before, role))

    def _sample(self) -> None:
        phase = self._phase_stack[-1] if self._phase_stack else NO_PHASE
        self._timeline.record(phase, tuple(self._by_category[category] for category in CATEGORIES), self._births)

    # ---------------------------------------------------------------- snapshots

    def _describe(self, record: StorageRecord) -> TensorInfo:
        return TensorInfo(
            shape=record.shape,
            dtype=record.dtype,
            bytes=record.nbytes,
            category=record.category,
            op=record.op,
            module=record.module,
            phase=record.phase,
        )

    def _capture_peak(self) -> None:
        self._peak_dirty = False
        records = list(self._records.values())
        largest = heapq.nlargest(self.top_tensors, records, key=lambda record: record.nbytes)
        peak = self._run_peak
        self._snapshot_peak = PeakRecord(peak.peak, dict(peak.breakdown), peak.born)
        self._snapshot_records = [(record, record.category) for record in largest]
        self._snapshot = PeakSnapshot(
            peak_bytes=peak.peak,
            breakdown=self._snapshot_peak.breakdown,
            phase=self._peak_phase,
            step=self._peak_step,
            top_tensors=[],
        )

    def _capture_activations(self) -> None:
        self._activation_dirty = False
        by_module: dict[str, int] = collections.defaultdict(int)
        for record in list(self._records.values()):
            if record.category == ACTIVATIONS:
                by_module[record.module] += record.nbytes
        self._module_activations = dict(by_module)

    # ------------------------------------------------------------ classification

    def _classify(self) -> None:
        """Give parameters, gradients and optimizer state their roles (walks them all)."""
        self._flush()
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
        for key, record in list(self._records.items()):
            role = roles.get(key, OTHER)
            if record.role != role:
                self._set_role(record, role)
        if self._late_roles:
            self._timeline.reclassify(self._late_roles)
            self._late_roles = []
        self._sample()

    def _claim(self, tensor: torch.Tensor, role: str, roles: dict[int, str]) -> None:
        storage = self._storage_of(tensor)
        if storage is None:
            return
        key = storage._cdata
        if key not in self._records:
            self._track(storage, tensor, EXISTING_OP)
        if key not in roles:  # the first role claimed wins: parameters, gradients, optimizer state
            roles[key] = role

    def _on_grad_ready(self, parameter: torch.Tensor) -> None:
        if self._depth == 0 or parameter.grad is None:
            return
        storage = self._storage_of(parameter.grad)
        if storage is None:
            return
        self._flush()
        record = self._track(storage, parameter.grad, EXISTING_OP)
        if record.role == OTHER:
            self._set_role(record, GRADIENTS)
            self._sample()

    # ----------------------------------------------------- saved tensors, modules

    def _pack(self, tensor: torch.Tensor):
        storage = self._storage_of(tensor)
        if storage is None:
            return tensor.detach()  # not on our device; detached for the reason below
        self._flush()
        record = self._track(storage, tensor, EXISTING_OP)
        self._settle()
        before = record.category
        record.saved += 1
        self._move(record.nbytes, before, record.category)
        # Keep a detached alias: holding the tensor itself would hold its grad_fn,
        # which holds this object: a cycle through C++ that never gets collected.
        return SavedTensor(tensor.detach(), record, self._events)

    @staticmethod
    def _unpack(packed):
        return packed.tensor if isinstance(packed, SavedTensor) else packed

    # The hooks live on the model and reach the tracker through a weak reference:
    # model -> hook -> tracker -> model would be a cycle that keeps a whole model (and
    # its GPU memory) alive until the garbage collector happens to run.

    def _make_pre_hook(self, name: str):
        tracker_ref = weakref.ref(self)

        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            tracker = tracker_ref()
            if tracker is None or tracker._depth == 0:
                return
            tracker._module_stack.append(name)
            for value in (*args, *kwargs.values()):
                if isinstance(value, torch.Tensor):
                    tracker._module_inputs[name] = value.nbytes
                    break

        return pre_hook

    def _make_post_hook(self, name: str):
        tracker_ref = weakref.ref(self)

        def post_hook(module: nn.Module, args: tuple, output) -> None:
            tracker = tracker_ref()
            # Pop down to this module: always_call runs this even when forward raised.
            if tracker is not None and name in tracker._module_stack:
                while tracker._module_stack and tracker._module_stack.pop() != name:
                    pass

        return post_hook

    def _make_grad_hook(self):
        tracker_ref = weakref.ref(self)

        def grad_hook(parameter: torch.Tensor) -> None:
            tracker = tracker_ref()
            if tracker is not None:
                tracker._on_grad_ready(parameter)

        return grad_hook
