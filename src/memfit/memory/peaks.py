"""Peaks of live device bytes (run, step, phase), the snapshot at the run's peak, and step timelines.

`PeakBook` listens to a `LiveStorages` counter (`memfit.memory.live_storage`) and keeps
what the memory tracker reports: it is the tracker's memory of the past, while the
counter holds the present. Host bytes (offloaded copies) have peaks of their own and
never enter the device figures.
"""

from __future__ import annotations

import collections
import heapq
import weakref

from memfit.memory.categories import (
    ACTIVATIONS,
    CATEGORIES,
    COMPUTE_CATEGORIES,
    DEVICE,
    HOST,
    NO_PHASE,
    PeakSnapshot,
    Timeline,
    empty_breakdown,
)
from memfit.memory.live_storage import LiveStorages
from memfit.memory.storage_records import PeakRecord, StorageRecord


class PeakBook:
    """Run, step and phase peaks of live device bytes; the run peak's snapshot; timelines.

    A snapshot of what is alive is taken lazily, at the first decrease after a new run
    peak: taking one at every new peak would cost a walk of all storages per operator.
    """

    def __init__(self, storages: LiveStorages, top_tensors: int, max_timeline_samples: int) -> None:
        # A proxy: the counter holds this book as its listener, and a cycle would outlive both.
        self.storages = weakref.proxy(storages)
        self.top_tensors = top_tensors
        self.max_timeline_samples = max_timeline_samples
        self.phase_stack: list[str] = []
        self.step = 0
        # Run peak, and the snapshot taken at the first decrease after a new peak.
        self.run_peak = PeakRecord(0, empty_breakdown(), 0)
        self.peak_phase = NO_PHASE
        self.peak_step = 0
        self._peak_dirty = False
        self.snapshot: PeakSnapshot | None = None
        self.snapshot_peak = PeakRecord(0, empty_breakdown(), 0)
        self.snapshot_records: list[tuple[StorageRecord, str]] = []
        self.activation_max = 0
        self._activation_dirty = False
        self.module_activations: dict[str, int] = {}
        self.host_peak = 0
        self.step_host_peak = 0
        # Current step.
        self.step_peak = PeakRecord(0, empty_breakdown(), 0)
        self.phase_stats: dict[str, PeakRecord] = {}
        self.timeline = Timeline(max_timeline_samples)
        self.late_roles: list[tuple[int, int, int, str, str]] = []  # for the timeline, at the next walk
        self.peak_timeline: Timeline | None = None
        self.last_timeline: Timeline | None = None

    @property
    def phase(self) -> str:
        return self.phase_stack[-1] if self.phase_stack else NO_PHASE

    # ------------------------------------------------------------ listener

    def before_change(self, place: str, category: str, delta: int) -> None:
        if place != DEVICE or delta >= 0:
            return
        # The live set is about to shrink: if it was a new peak, describe it now.
        if self._peak_dirty:
            self.capture_peak()
        if self._activation_dirty and category == ACTIVATIONS:
            self._capture_activations()

    def after_change(self, place: str, category: str, delta: int) -> None:
        if delta <= 0:
            return
        storages = self.storages
        if place == HOST:
            self.host_peak = max(self.host_peak, storages.live[HOST])
            self.step_host_peak = max(self.step_host_peak, storages.live[HOST])
            return
        by_category, current, born = storages.totals[DEVICE], storages.live[DEVICE], storages.births
        if category == ACTIVATIONS and by_category[ACTIVATIONS] > self.activation_max:
            self.activation_max = by_category[ACTIVATIONS]
            self._activation_dirty = True
        self.step_peak.raise_to(current, by_category, born)
        for name in self.phase_stack:
            self.phase_stats[name].raise_to(current, by_category, born)
        if self.run_peak.raise_to(current, by_category, born):
            self.peak_phase = self.phase
            self.peak_step = self.step
            self._peak_dirty = True

    def before_recategorize(self, record: StorageRecord) -> None:
        self.settle()

    def recategorized(self, record: StorageRecord, source: str, target: str) -> None:
        if record.place != DEVICE or source not in COMPUTE_CATEGORIES or target in COMPUTE_CATEGORIES:
            return
        # Optimizer state made lazily in the first step is only recognized after it (and a
        # gradient after backward made it): give past peaks it was part of the right breakdown.
        for peak in (self.run_peak, self.step_peak, *self.phase_stats.values()):
            peak.reclassify(record, source, target)
        if self.snapshot is not None:
            self.snapshot_peak.reclassify(record, source, target)
        self.late_roles.append((record.born, self.timeline.next_index, record.nbytes, source, target))

    # ------------------------------------------------------------ phases and steps

    def enter_phase(self, name: str) -> None:
        self.phase_stack.append(name)
        storages = self.storages
        stats = self.phase_stats.get(name)
        current, by_category = storages.live[DEVICE], storages.totals[DEVICE]
        if stats is None:
            self.phase_stats[name] = PeakRecord(current, dict(by_category), storages.births)
        else:  # entered again (next micro-batch), maybe higher than before
            stats.raise_to(current, by_category, storages.births)

    def exit_phase(self) -> None:
        self.phase_stack.pop()

    def close_step(self) -> tuple[PeakRecord, dict[str, PeakRecord], int]:
        """End the step: returns its peak, its phase peaks and its host peak; starts the next."""
        result = (self.step_peak, self.phase_stats, self.step_host_peak)
        if self.peak_step == self.step:
            self.peak_timeline = self.timeline
        self.last_timeline = self.timeline
        self.timeline = Timeline(self.max_timeline_samples)
        self.phase_stats = {}
        self.step += 1
        storages = self.storages
        self.step_peak = PeakRecord(storages.live[DEVICE], dict(storages.totals[DEVICE]), storages.births)
        self.step_host_peak = storages.live[HOST]
        self.sample()
        return result

    def sample(self) -> None:
        by_category = self.storages.totals[DEVICE]
        self.timeline.record(self.phase, tuple(by_category[c] for c in CATEGORIES), self.storages.births)

    def apply_late_roles(self) -> None:
        if self.late_roles:
            self.timeline.reclassify(self.late_roles)
            self.late_roles = []

    def timeline_of(self, which: str) -> Timeline:
        if which == "peak":
            return self.peak_timeline or self.timeline
        if which == "last":
            return self.last_timeline or self.timeline
        if which == "current":
            return self.timeline
        raise ValueError(f"timeline(which=...) must be 'peak', 'last' or 'current', not {which!r}")

    # ------------------------------------------------------------ snapshots

    def settle(self) -> None:
        """Take pending snapshots now, before a record changes category under them."""
        if self._peak_dirty:
            self.capture_peak()
        if self._activation_dirty:
            self._capture_activations()

    def capture_peak(self) -> None:
        self._peak_dirty = False
        records = [record for record in self.storages.records.values() if record.place == DEVICE]
        largest = heapq.nlargest(self.top_tensors, records, key=lambda record: record.nbytes)
        module_bytes: dict[str, dict[str, int]] = {
            category: collections.defaultdict(int) for category in COMPUTE_CATEGORIES
        }
        for record in records:
            by_module = module_bytes.get(record.category)
            if by_module is not None:
                by_module[record.module] += record.nbytes
        peak = self.run_peak
        self.snapshot_peak = PeakRecord(peak.peak, dict(peak.breakdown), peak.born)
        self.snapshot_records = [(record, record.category) for record in largest]
        self.snapshot = PeakSnapshot(
            peak_bytes=peak.peak,
            breakdown=self.snapshot_peak.breakdown,
            phase=self.peak_phase,
            step=self.peak_step,
            top_tensors=[],
            module_bytes={category: dict(sizes) for category, sizes in module_bytes.items() if sizes},
            host_bytes=self.storages.live[HOST],
        )

    def _capture_activations(self) -> None:
        self._activation_dirty = False
        by_module: dict[str, int] = collections.defaultdict(int)
        for record in list(self.storages.records.values()):
            if record.place == DEVICE and record.category == ACTIVATIONS:
                by_module[record.module] += record.nbytes
        self.module_activations = dict(by_module)
