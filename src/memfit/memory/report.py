"""The profile report: where the bytes went, what to switch on, and whether memory leaks.

`build_report(steps, snapshot, device, context)` turns what `MemoryTracker` measured
into a `ProfileReport`; `report.to_dict()` is the `memfit profile --json` object and
`render(report)` the text a person reads. Advice (`memfit.memory.advice`) is computed from the measurement:
each entry says how many bytes a technique would save at the peak, estimated from
the measured categories, modules and tensors (an estimate, not a promise: run
`memfit profile` again with the flag to see the real figure).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from memfit.memory.advice import ReportContext, _percent, advise, block_activations
from memfit.memory.categories import (
    CATEGORIES,
    OTHER,
    PeakSnapshot,
    PhaseMemory,
    StepMemory,
    TensorInfo,
    empty_breakdown,
)
from memfit.units import GIB, MIB, format_bytes

__all__ = ["ProfileReport", "ReportContext", "build_report", "detect_leak", "render"]


@dataclass
class ProfileReport:
    """A memory profile of a few training steps (see `to_dict` for the JSON form)."""

    device: str
    steps: int
    peak_bytes: int
    breakdown: dict[str, int]
    phases: list[PhaseMemory]
    top_modules: list[tuple[str, int]]
    top_tensors: list[TensorInfo]
    advice: list[dict]
    leak: dict | None
    peak_step: int = 0
    peak_phase: str = ""
    activation_peak_bytes: int = 0
    step_peak_bytes: list[int] = field(default_factory=list)
    live_bytes_at_end: list[int] = field(default_factory=list)
    blocks: list[tuple[str, int]] = field(default_factory=list)
    peak_modules: list[tuple[str, str, int]] = field(default_factory=list)
    """(module, category, bytes) at the peak for what forward and backward made, largest first."""
    host_bytes_at_peak: int = 0
    host_peak_bytes: int = 0
    """Host memory held on purpose (offloaded copies): at the device peak, and its own peak."""

    def to_dict(self) -> dict:
        """The JSON object of `memfit profile --json` (all sizes in bytes)."""
        return {
            "device": self.device,
            "steps": self.steps,
            "peak_bytes": self.peak_bytes,
            "breakdown": {category: self.breakdown.get(category, 0) for category in CATEGORIES},
            "phases": [phase.to_dict() for phase in self.phases],
            "top_modules": [{"module": name, "activation_bytes": size} for name, size in self.top_modules],
            "top_tensors": [tensor.to_dict() for tensor in self.top_tensors],
            "advice": [dict(entry) for entry in self.advice],
            "leak": dict(self.leak) if self.leak else None,
            "peak_step": self.peak_step,
            "peak_phase": self.peak_phase,
            "activation_peak_bytes": self.activation_peak_bytes,
            "step_peak_bytes": list(self.step_peak_bytes),
            "live_bytes_at_end": list(self.live_bytes_at_end),
            "blocks": [{"module": name, "activation_bytes": size} for name, size in self.blocks],
            "peak_modules": [
                {"module": name, "category": category, "bytes": size} for name, category, size in self.peak_modules
            ],
            "host_bytes_at_peak": self.host_bytes_at_peak,
            "host_peak_bytes": self.host_peak_bytes,
        }


def build_report(
    steps: Sequence[StepMemory],
    snapshot: PeakSnapshot,
    device: str,
    context: ReportContext | None = None,
    top: int = 10,
) -> ProfileReport:
    """Summarize tracked steps and the peak snapshot into a report with advice.

    The peak and its breakdown are those of the highest step (or of the snapshot
    when no step was closed); the top tensors are those alive at the run's peak.
    """
    context = context or ReportContext()
    if steps:
        highest = max(steps, key=lambda step: step.peak_bytes)
        peak_bytes, breakdown, peak_step = highest.peak_bytes, dict(highest.breakdown), highest.step
    else:
        peak_bytes, breakdown, peak_step = snapshot.peak_bytes, dict(snapshot.breakdown), snapshot.step
    report = ProfileReport(
        device=str(device),
        steps=len(steps),
        peak_bytes=peak_bytes,
        breakdown={**empty_breakdown(), **breakdown},
        phases=_merge_phases(steps),
        top_modules=snapshot.top_modules(top),
        top_tensors=list(snapshot.top_tensors[:top]),
        advice=[],
        leak=detect_leak([step.live_bytes_at_end for step in steps]),
        peak_step=peak_step,
        peak_phase=snapshot.phase,
        activation_peak_bytes=snapshot.activation_peak_bytes,
        step_peak_bytes=[step.peak_bytes for step in steps],
        live_bytes_at_end=[step.live_bytes_at_end for step in steps],
        blocks=list(block_activations(snapshot).items()),
        peak_modules=peak_modules(snapshot, top),
        host_bytes_at_peak=snapshot.host_bytes,
        host_peak_bytes=max([snapshot.host_peak_bytes, *(step.host_peak_bytes for step in steps)]),
    )
    report.advice = advise(report.breakdown, peak_bytes, snapshot, context)
    return report


def peak_modules(snapshot: PeakSnapshot, top: int = 10) -> list[tuple[str, str, int]]:
    """The largest (module, category, bytes) at the peak among what forward and backward made."""
    rows = [
        (module, category, size)
        for category, sizes in snapshot.module_bytes.items()
        if category != OTHER
        for module, size in sizes.items()
        if size > 0
    ]
    rows.sort(key=lambda row: row[2], reverse=True)
    return rows[:top]


def _merge_phases(steps: Sequence[StepMemory]) -> list[PhaseMemory]:
    merged: dict[str, PhaseMemory] = {}
    for step in steps:
        for phase in step.phases:
            known = merged.get(phase.name)
            if known is None or phase.peak_bytes > known.peak_bytes:
                merged[phase.name] = PhaseMemory(phase.name, phase.peak_bytes, dict(phase.breakdown))
    return list(merged.values())


# -------------------------------------------------------------------------- leak


def detect_leak(live_bytes_at_end: Sequence[int], min_steps: int = 3) -> dict | None:
    """A warning when live bytes at the end of each step keep growing, else None.

    The first step is left out when there are enough steps (it creates optimizer
    state); the rest must grow at every step, each time by more than a small
    tolerance (0.1% of the live bytes, at least 1 KiB), over at least `min_steps`.
    """
    series = list(live_bytes_at_end)
    if len(series) > min_steps:
        series = series[1:]
    if len(series) < min_steps:
        return None
    tolerance = max(1024, series[0] // 1000)
    growth = [after - before for before, after in zip(series[:-1], series[1:], strict=True)]
    if not all(delta > tolerance for delta in growth):
        return None
    per_step = sum(growth) // len(growth)
    return {
        "growth_bytes_per_step": per_step,
        "steps": len(series),
        "first_bytes": series[0],
        "last_bytes": series[-1],
        "message": (
            f"live memory grew by about {format_bytes(per_step)} per step over {len(series)} steps "
            f"({format_bytes(series[0])} -> {format_bytes(series[-1])}): something keeps tensors "
            f"from step to step (a list of losses kept without .item(), a growing cache)"
        ),
    }


# ------------------------------------------------------------------------ render


def _unit_for(peak_bytes: int) -> str:
    return "GiB" if peak_bytes >= GIB // 2 else "MiB" if peak_bytes >= MIB else "KiB"


def render(report: ProfileReport) -> str:
    """The report as plain text: peak, categories, phases, modules, tensors, advice."""
    unit = _unit_for(report.peak_bytes)

    def size(num_bytes: int) -> str:
        return format_bytes(num_bytes, unit).rjust(12)

    peak = report.peak_bytes
    lines = [
        f"memory profile on {report.device}, {report.steps} step(s): live tensor bytes ({unit} = 1024-based)",
        f"peak {format_bytes(peak, unit)} in step {report.peak_step} ({report.peak_phase})",
    ]
    for category in CATEGORIES:
        part = report.breakdown.get(category, 0)
        lines.append(f"  {category:<24}{size(part)}  {_percent(part, peak).rjust(4)}")
    if report.host_peak_bytes:
        lines.append(
            f"host memory (offloaded copies, not in the peak): {format_bytes(report.host_bytes_at_peak, unit)} "
            f"at the peak, {format_bytes(report.host_peak_bytes, unit)} at most"
        )
    if report.phases:
        lines.append("phases (peak of each):")
        for phase in report.phases:
            largest = max(phase.breakdown, key=phase.breakdown.get) if phase.breakdown else "-"
            lines.append(f"  {phase.name:<18}{size(phase.peak_bytes)}  largest: {largest}")
    if report.blocks:
        sizes = [size for _, size in report.blocks]
        largest_name, largest = max(report.blocks, key=lambda item: item[1])
        lines.append(
            f"activations per block: {len(sizes)} blocks, {format_bytes(sum(sizes) // len(sizes), unit)} on average "
            f"(largest {largest_name}: {format_bytes(largest, unit)})"
        )
    if report.top_modules:
        lines.append(
            f"modules holding the most activations (of {format_bytes(report.activation_peak_bytes, unit)} "
            f"at their peak; each tensor counts for the innermost module that made it):"
        )
        for name, num_bytes in report.top_modules:
            lines.append(f"  {name:<40}{size(num_bytes)}")
    if report.peak_modules:
        lines.append("what holds the peak, by module (a recompute or backward counts for the module that ran it):")
        for name, category, num_bytes in report.peak_modules:
            lines.append(f"  {name:<40}{size(num_bytes)}  {category}")
    if report.top_tensors:
        lines.append("largest tensors alive at the peak:")
        for tensor in report.top_tensors:
            shape = "x".join(str(dim) for dim in tensor.shape) or "scalar"
            lines.append(
                f"  {shape:<16} {tensor.dtype:<9}{size(tensor.bytes)}  {tensor.category:<22} "
                f"{tensor.op:<32} {tensor.module}"
            )
    if report.advice:
        lines.append("advice:")
        lines.extend(f"  - {entry['message']}" for entry in report.advice)
    else:
        lines.append("advice: nothing large to cut; the peak is spread over the categories above")
    if report.leak:
        lines.append(f"warning: {report.leak['message']}")
    return "\n".join(lines)
