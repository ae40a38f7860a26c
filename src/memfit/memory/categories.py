"""The categories of training memory, and the records the memory tracker hands out
(steps, phases, tensors, the peak snapshot, the timeline of a step).

The one category set of memfit: the tracker (`memfit profile`), the traced estimate
and the analytical estimate (`memfit estimate`) all report these. Every byte counted
belongs to exactly one of them:

- ``parameters``: storages of the model's parameters (trainable or frozen; under FSDP2
  the gathered full parameters while a block has them).
- ``gradients``: storages currently held in a parameter's ``.grad``.
- ``optimizer_states``: tensors in ``optimizer.state`` (Adam moments, step counters, ...).
- ``activations``: tensors autograd keeps for the backward pass, while it keeps them.
- ``recomputed_activations``: tensors a checkpointed block makes again in backward
  (its recompute), until backward has used them.
- ``activation_gradients``: what backward makes outside a recompute: the gradients of
  activations flowing back and the temporaries of backward kernels.
- ``logits``: tensors shaped [..., vocab]: the logits, their fp32 copies and softmax,
  and their gradient.
- ``other``: everything else: inputs, buffers, forward temporaries not saved, the
  optimizer step's temporaries.

A storage that is both a parameter and saved for backward (a weight saved by a matmul)
counts as a parameter: a role (parameters, gradients, optimizer state) wins over what
made the storage.

Bytes are also either on the *device* (counted in every figure above and against the
emulated cap) or in *host* memory on purpose (offloaded copies, see `memfit.techniques.host_memory`),
reported beside them.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

PARAMETERS = "parameters"
GRADIENTS = "gradients"
OPTIMIZER_STATES = "optimizer_states"
ACTIVATIONS = "activations"
RECOMPUTED_ACTIVATIONS = "recomputed_activations"
ACTIVATION_GRADIENTS = "activation_gradients"
LOGITS = "logits"
OTHER = "other"

CATEGORIES = (
    PARAMETERS,
    GRADIENTS,
    OPTIMIZER_STATES,
    ACTIVATIONS,
    RECOMPUTED_ACTIVATIONS,
    ACTIVATION_GRADIENTS,
    LOGITS,
    OTHER,
)

# The categories that storages made by forward or backward compute fall in (not state).
COMPUTE_CATEGORIES = (ACTIVATIONS, RECOMPUTED_ACTIVATIONS, ACTIVATION_GRADIENTS, LOGITS, OTHER)

# Where a counted storage lives.
DEVICE = "device"
HOST = "host"

# The phase name of what happens outside any `MemoryTracker.phase(...)` block.
NO_PHASE = "(no phase)"
# The module name of what is made outside any module's forward (and outside backward).
NO_MODULE = "(outside modules)"


def empty_breakdown() -> dict[str, int]:
    """A breakdown with every category at zero bytes, in `CATEGORIES` order."""
    return {category: 0 for category in CATEGORIES}


@dataclass
class PhaseMemory:
    """Memory of one phase of a step (forward, backward, optimizer, or any name).

    `peak_bytes` is the most live bytes seen while the phase ran; `breakdown` splits
    that moment by category. A phase entered several times in one step (micro-batches)
    is merged: the highest peak wins.
    """

    name: str
    peak_bytes: int
    breakdown: dict[str, int]

    def to_dict(self) -> dict:
        return {"name": self.name, "peak_bytes": self.peak_bytes, "breakdown": dict(self.breakdown)}


@dataclass
class StepMemory:
    """What one training step used, returned by `MemoryTracker.end_step()`.

    Attributes:
        step: index of the step since tracking started (0-based).
        peak_bytes: most live tensor bytes at any moment of the step.
        breakdown: bytes per category at that moment.
        phases: per-phase peaks, in the order the phases were first entered.
        live_bytes_at_end: live bytes when the step ended (what stays between steps).
        live_breakdown_at_end: the same by category.
        host_peak_bytes: most bytes held in host memory on purpose (offloaded copies)
            at any moment of the step; not part of `peak_bytes`.
        host_bytes_at_end: host bytes when the step ended.
    """

    step: int
    peak_bytes: int
    breakdown: dict[str, int]
    phases: list[PhaseMemory]
    live_bytes_at_end: int
    live_breakdown_at_end: dict[str, int] = field(default_factory=empty_breakdown)
    host_peak_bytes: int = 0
    host_bytes_at_end: int = 0

    def to_dict(self) -> dict:
        return {
            "step": self.step,
            "peak_bytes": self.peak_bytes,
            "breakdown": dict(self.breakdown),
            "phases": [phase.to_dict() for phase in self.phases],
            "live_bytes_at_end": self.live_bytes_at_end,
            "live_breakdown_at_end": dict(self.live_breakdown_at_end),
            "host_peak_bytes": self.host_peak_bytes,
            "host_bytes_at_end": self.host_bytes_at_end,
        }


@dataclass
class TensorInfo:
    """One live storage: the tensor that created it, what it is and where it came from.

    `shape` and `dtype` are those of the first tensor seen on the storage; `bytes` is
    the storage's real size (all views of it together count once). `op` is the aten
    operator that allocated it ("(existing)" when it was there before tracking saw it
    made); `module` is the innermost module whose forward was running then.
    """

    shape: tuple[int, ...]
    dtype: str
    bytes: int
    category: str
    op: str
    module: str
    phase: str

    def to_dict(self) -> dict:
        return {
            "shape": list(self.shape),
            "dtype": self.dtype,
            "bytes": self.bytes,
            "category": self.category,
            "op": self.op,
            "module": self.module,
            "phase": self.phase,
        }


@dataclass
class PeakSnapshot:
    """What was alive at the run's peak, and where the activations came from.

    Attributes:
        peak_bytes: the run's peak of live tensor bytes.
        breakdown: bytes per category at the peak.
        phase: the phase running at the peak.
        step: the step (0-based) in which the peak happened.
        top_tensors: the largest storages alive at the peak, largest first.
        activation_peak_bytes: the most activation bytes alive at any moment.
        module_activation_bytes: activation bytes per module at that moment; each
            storage counts for the innermost module whose forward created it.
        module_input_bytes: bytes of the first tensor input of each module's last
            forward (a transformer block's hidden states), used to estimate what
            checkpointing would keep.
        module_bytes: at the peak, bytes per module for each compute category
            (`COMPUTE_CATEGORIES`): {category: {module: bytes}}. A recomputed
            activation belongs to the module whose recompute made it, an activation
            gradient to the module whose backward was running.
        host_bytes: bytes in host memory (offloaded copies) at the peak.
        host_peak_bytes: the most host bytes at any moment of the run.
    """

    peak_bytes: int
    breakdown: dict[str, int]
    phase: str
    step: int
    top_tensors: list[TensorInfo]
    activation_peak_bytes: int = 0
    module_activation_bytes: dict[str, int] = field(default_factory=dict)
    module_input_bytes: dict[str, int] = field(default_factory=dict)
    module_bytes: dict[str, dict[str, int]] = field(default_factory=dict)
    host_bytes: int = 0
    host_peak_bytes: int = 0

    def top_modules(self, count: int = 10) -> list[tuple[str, int]]:
        """The `count` modules holding the most activation bytes, largest first."""
        ranked = sorted(self.module_activation_bytes.items(), key=lambda item: item[1], reverse=True)
        return [(name, size) for name, size in ranked[:count] if size > 0]


class Timeline:
    """Samples of live bytes by category through one step, at most `max_samples` of them.

    Each sample is (event_index, phase, sizes in `CATEGORIES` order); the event index
    counts changes of the live bytes since the step began. Past `max_samples`, pairs
    of samples merge into the higher one and later samples are taken per window of
    twice as many events, so the step stays evenly covered and its peak survives.
    """

    def __init__(self, max_samples: int = 4000) -> None:
        self.max_samples = max(16, max_samples)
        # (event_index, phase, sizes, born): `born` counts the storages first seen by then.
        self._samples: list[tuple[int, str, tuple[int, ...], int]] = []
        self._stride = 1
        self._window: tuple[int, str, tuple[int, ...], int] | None = None
        self._window_events = 0
        self._events = 0
        self._last: tuple[int, ...] | None = None

    def record(self, phase: str, sizes: tuple[int, ...], born: int = 0) -> None:
        """Add a sample unless the sizes did not change since the last one."""
        if sizes == self._last:
            return
        self._last = sizes
        sample = (self._events, phase, sizes, born)
        self._events += 1
        if self._window is None or sum(sizes) > sum(self._window[2]):
            self._window = sample
        self._window_events += 1
        if self._window_events < self._stride:
            return
        self._samples.append(self._window)
        self._window, self._window_events = None, 0
        if len(self._samples) > self.max_samples:
            samples = self._samples
            self._samples = [max(samples[i : i + 2], key=lambda item: sum(item[2])) for i in range(0, len(samples), 2)]
            self._stride *= 2

    @property
    def next_index(self) -> int:
        """The event index the next sample will get."""
        return self._events

    def reclassify(self, moves: list[tuple[int, int, int, str, str]]) -> None:
        """Give storages recognized late their category in the samples taken before.

        `moves`: (born, until, nbytes, source, target) per storage: it was alive from
        its first sight (`born`) on, and counted under `source` in samples whose event
        index is below `until`.
        """
        samples = self._samples + ([self._window] if self._window is not None else [])
        borns = [sample[3] for sample in samples]
        indices = [sample[0] for sample in samples]
        groups: dict[tuple[str, str], list[int]] = {}
        for born, until, nbytes, source, target in moves:
            # Samples [first, last) saw the storage alive under `source`.
            first, last = bisect.bisect_right(borns, born), bisect.bisect_left(indices, until)
            if first < last:
                change = groups.setdefault((source, target), [0] * (len(samples) + 1))
                change[first] += nbytes
                change[last] -= nbytes
        for (source, target), change in groups.items():
            source_at, target_at = CATEGORIES.index(source), CATEGORIES.index(target)
            moved = 0
            for position, sample in enumerate(samples):
                moved += change[position]
                amount = min(moved, sample[2][source_at])
                if amount > 0:
                    sizes = list(sample[2])
                    sizes[source_at] -= amount
                    sizes[target_at] += amount
                    samples[position] = (sample[0], sample[1], tuple(sizes), sample[3])
        if self._window is not None:
            self._window = samples.pop()
        self._samples = samples
        self._last = None

    def samples(self) -> list[tuple[int, str, dict[str, int]]]:
        """The samples as (event_index, phase, {category: bytes})."""
        samples = self._samples + ([self._window] if self._window is not None else [])
        return [(index, phase, dict(zip(CATEGORIES, sizes, strict=True))) for index, phase, sizes, _ in samples]

    def __len__(self) -> int:
        return len(self._samples) + (self._window is not None)
