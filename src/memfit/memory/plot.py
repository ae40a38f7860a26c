"""A picture of one training step's memory: live bytes stacked by category over time.

`plot_timeline(tracker.timeline(), "memory.png")` writes a PNG (matplotlib, Agg
backend, so no display is needed). The x axis counts tracker events (operators and
frees that changed the live bytes), not seconds; dotted lines mark where a phase
(forward, backward, optimizer) begins.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from memfit.errors import UsageError
from memfit.memory.categories import CATEGORIES, NO_PHASE
from memfit.units import GIB, MIB, format_bytes

_COLORS = {
    "parameters": "#4c72b0",
    "gradients": "#dd8452",
    "optimizer_states": "#55a868",
    "activations": "#c44e52",
    "recomputed_activations": "#e8a0a2",
    "activation_gradients": "#8172b3",
    "logits": "#ccb974",
    "other": "#8c8c8c",
}


def _import_pyplot():
    try:
        import matplotlib
    except ImportError as error:
        raise UsageError(
            "--plot needs matplotlib: pip install 'memfit[plot]' (or matplotlib), or leave --plot out"
        ) from error
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as pyplot

    return pyplot


def plot_timeline(
    timeline: Sequence[tuple[int, str, dict[str, int]]],
    path: str | Path,
    title: str | None = None,
    unit: str = "auto",
) -> Path:
    """Draw `timeline` (from `MemoryTracker.timeline()`) as a stacked area chart in `path`.

    Args:
        timeline: samples (event_index, phase, {category: bytes}).
        path: where to write the image; the suffix picks the format (.png, .svg, .pdf).
        title: first line of the title; the peak is always added.
        unit: "GiB", "MiB" or "auto" (GiB when the peak reaches 1 GiB, else MiB).

    Returns:
        The path written.

    Raises:
        UsageError: matplotlib is not installed, or the timeline is empty.
    """
    if not timeline:
        raise UsageError("no memory timeline to plot: track at least one step (memfit profile --steps 1)")
    pyplot = _import_pyplot()
    path = Path(path)
    # Repeat the last sample one event later so that the final state gets a width.
    timeline = [*timeline, (timeline[-1][0] + 1, timeline[-1][1], timeline[-1][2])]
    indices = [sample[0] for sample in timeline]
    totals = [sum(sample[2].values()) for sample in timeline]
    peak = max(totals)
    peak_at = indices[totals.index(peak)]
    if unit == "auto":
        unit = "GiB" if peak >= GIB else "MiB"
    scale = {"GiB": GIB, "MiB": MIB}[unit]
    layers = [[sample[2].get(category, 0) / scale for sample in timeline] for category in CATEGORIES]

    figure, axes = pyplot.subplots(figsize=(11, 5), dpi=110)
    try:
        axes.stackplot(
            indices,
            layers,
            labels=list(CATEGORIES),
            colors=[_COLORS[category] for category in CATEGORIES],
            step="post",
            alpha=0.9,
        )
        top = peak / scale
        previous_phase = None
        span = max(indices[-1] - indices[0], 1)
        for index, phase, _ in timeline:
            # Gaps between phases (a step's bookkeeping) get no line of their own.
            if phase != previous_phase and phase != NO_PHASE:
                axes.axvline(index, color="black", linestyle=":", linewidth=1)
                near_end = index - indices[0] > 0.9 * span  # keep the label inside the axes
                label = f"{phase} " if near_end else f" {phase}"
                axes.text(index, top * 1.02, label, fontsize=8, va="bottom", ha="right" if near_end else "left")
            previous_phase = phase
        axes.axhline(top, color="black", linewidth=0.8, alpha=0.5)
        axes.annotate(
            f"peak {format_bytes(peak, unit)}", (peak_at, top), textcoords="offset points", xytext=(4, -12), fontsize=8
        )
        axes.set_ylim(0, top * 1.12 if top > 0 else 1)
        axes.set_xlim(indices[0], max(indices[-1], indices[0] + 1))
        axes.set_xlabel("tracker event (operators and frees that changed live memory)")
        axes.set_ylabel(f"live tensor memory ({unit})")
        heading = title or "memory of one training step"
        axes.set_title(f"{heading}\npeak {format_bytes(peak, unit)} of live tensors")
        axes.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize=8, frameon=False)
        axes.grid(axis="y", alpha=0.3)
        figure.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        figure.savefig(path)
    finally:
        pyplot.close(figure)
    return path
