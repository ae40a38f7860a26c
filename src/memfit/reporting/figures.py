"""The charts of a report, as plotly figures (plotly is optional: `require_plotly` says so in one line).

Numbers are rounded to 5 significant digits and step curves longer than
`MAX_CURVE_POINTS` are averaged (rates) or maximized (memory) per bucket of steps, so a
long run's report stays small; events (OOM recoveries, resumes) keep their exact steps.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from memfit.errors import UsageError
from memfit.memory.categories import CATEGORIES
from memfit.reporting.run_data import RunData
from memfit.units import GIB, MIB

MAX_CURVE_POINTS = 2000

CATEGORY_COLORS = {
    "parameters": "#4c72b0",
    "gradients": "#dd8452",
    "optimizer_states": "#55a868",
    "activations": "#c44e52",
    "recomputed_activations": "#e79a9c",
    "activation_gradients": "#8172b3",
    "logits": "#937860",
    "other": "#8c8c8c",
}
RUN_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#17becf", "#8c564b", "#e377c2")
OOM_COLOR = "#d62728"
RESUME_COLOR = "#2ca02c"

# Byte fields of a step record drawn on the memory panel: (field, label, host memory?).
MEMORY_FIELDS = (
    ("peak_allocated_bytes", "device: peak allocated", False),
    ("peak_reserved_bytes", "device: peak reserved", False),
    ("tracked_peak_bytes", "live tensors (tracker)", False),
    ("host_peak_rss_bytes", "host: process peak RSS", True),
)

# What plotly draws its figures with; no link out, no logo, nothing fetched.
PLOTLY_CONFIG = {"displaylogo": False, "responsive": True, "modeBarButtonsToRemove": ["select2d", "lasso2d"]}


def require_plotly():
    """The plotly package, or a UsageError that says how to get it."""
    try:
        import plotly  # noqa: F401
        import plotly.graph_objects as go
    except ImportError:
        raise UsageError("the HTML report needs plotly: pip install 'memfit[report]' (or plotly)") from None
    return go


def plotly_available() -> bool:
    try:
        require_plotly()
    except UsageError:
        return False
    return True


def rounded(value: float | None, digits: int = 5) -> float | None:
    if value is None or not math.isfinite(value) or value == 0:
        return value
    return round(value, digits - 1 - int(math.floor(math.log10(abs(value)))))


def byte_unit(max_bytes: float) -> tuple[str, int]:
    return ("GiB", GIB) if max_bytes >= GIB else ("MiB", MIB)


def downsample(xs: Sequence[int], ys: Sequence[float], how: str = "mean", limit: int = MAX_CURVE_POINTS):
    """At most `limit` points: each bucket of consecutive steps becomes its last step and its mean (or max, min)."""
    if len(xs) <= limit:
        return list(xs), list(ys)
    size = -(-len(xs) // limit)
    out_x, out_y = [], []
    for start in range(0, len(xs), size):
        chunk = ys[start : start + size]
        out_x.append(xs[min(start + size, len(xs)) - 1])
        out_y.append(max(chunk) if how == "max" else min(chunk) if how == "min" else sum(chunk) / len(chunk))
    return out_x, out_y


def memory_series(run: RunData) -> list[tuple[str, list[int], list[float], bool]]:
    """(label, steps, bytes, host?) for each memory field the run's steps carry."""
    device_is_cpu = str(run.facts.get("device", "cpu")).startswith("cpu")
    fields = list(MEMORY_FIELDS)
    # On CPU, "peak_memory_bytes" is the process peak RSS; on CUDA it repeats peak allocated.
    if device_is_cpu:
        fields.append(("peak_memory_bytes", "host: process peak RSS", True))
    elif not run.series("peak_allocated_bytes")[0]:
        fields.append(("peak_memory_bytes", "device: peak", False))
    found = []
    sampled = run.sampled_steps  # the default tracks one early step: its "curve" is one point, named so and put last
    for key, label, host in fields:
        xs, ys = run.series(key)
        if xs:
            if key == "tracked_peak_bytes" and sampled:
                label = label.replace("(tracker)", f"(tracker, step {', '.join(map(str, sorted(sampled)))})")
            found.append((label, xs, ys, host))
    # What compares over the steps comes first (memfit compare overlays each run's first series).
    return sorted(found, key=lambda series: len(series[1]) == 1 and len(run.steps) > 1)


def _panels(run: RunData) -> list[tuple[str, str]]:
    panels = [
        ("loss", "loss"),
        ("reward", "reward"),  # online RL (--task grpo): the mean reward of each step's completions
        ("lr", "learning rate"),
        ("grad_norm", "gradient norm"),
        ("tokens_per_second", "tokens/s"),
    ]
    if mfu_series(run)[0]:
        panels.append(("mfu", "MFU (% of device peak)"))
    panels.append(("memory", "peak memory"))
    if run.series("micro_batch_size")[0]:
        panels.append(("micro_batch_size", "micro-batch size"))
    return [(key, title) for key, title in panels if (memory_series(run) if key == "memory" else run.series(key)[0])]


def mfu_series(run: RunData) -> tuple[list[int], list[float]]:
    """The steps' MFU as train/speed.py recorded it: each a fraction of a measured peak (a preset's datasheet figure
    or the matmul probe, measured again where a step beat it: a dotted line). Nothing when the run's summary left
    MFU out (a step beat every measurement of the peak, so the earlier figures were against a peak too low), or
    for metrics written before that, whose probed peak was raised to the steps' own rate (their curve sat at 100 %)."""
    summary = run.summary or {}
    if summary.get("mfu_note") or "raised to a measured step" in str(run.facts.get("peak_flops_source", "")):
        return [], []
    return run.series("mfu")


def line_trace(go, xs, ys, name, color=None, dash=None, legendgroup=None, showlegend=True, hover_unit=""):
    return go.Scatter(
        x=list(xs),
        y=[rounded(y) for y in ys],
        mode="lines+markers" if len(xs) <= 60 else "lines",
        name=name,
        line={"color": color, "dash": dash, "width": 1.6},
        marker={"size": 4},
        legendgroup=legendgroup,
        showlegend=showlegend,
        hovertemplate=f"%{{y}}{hover_unit}<extra>{name}</extra>",
    )


def curves_figure(run: RunData):
    """Loss, learning rate, grad norm, tokens/s, (MFU), peak memory and micro-batch over steps, events marked."""
    go = require_plotly()
    from plotly.subplots import make_subplots

    panels = _panels(run)
    columns = 2
    rows = max(1, -(-len(panels) // columns))
    figure = make_subplots(
        rows=rows, cols=columns, subplot_titles=[title for _, title in panels], vertical_spacing=0.12 / rows * 2
    )
    for position, (key, _) in enumerate(panels):
        row, col = position // columns + 1, position % columns + 1
        if key == "memory":
            series = memory_series(run)
            unit, scale = byte_unit(max(max(ys) for _, _, ys, _ in series))
            for index, (label, xs, ys, host) in enumerate(series):
                xs, ys = downsample(xs, ys, "max")
                color = RUN_COLORS[(index + 2) % len(RUN_COLORS)]
                figure.add_trace(
                    line_trace(
                        go, xs, [y / scale for y in ys], label, color, "dot" if host else None, hover_unit=f" {unit}"
                    ),
                    row,
                    col,
                )
            figure.update_yaxes(title_text=unit, row=row, col=col, rangemode="tozero")
        else:
            xs, ys = mfu_series(run) if key == "mfu" else run.series(key)
            xs, ys = downsample(xs, ys, "min" if key == "micro_batch_size" else "mean")
            if key == "mfu":
                ys = [100 * y for y in ys]  # the metrics keep a fraction of the device's peak
                for step in run.series("peak_flops_per_second")[0]:  # a step beat the probe: measured again
                    figure.add_vline(x=step, line={"color": "#8c8c8c", "dash": "dot", "width": 1}, row=row, col=col)
            figure.add_trace(line_trace(go, xs, ys, key.replace("_", " "), RUN_COLORS[0], showlegend=False), row, col)
            if key == "loss" and run.evaluations:  # the eval loss on the same axes (a token-weighted mean, like the loss)
                evals = [(e["step"], e["eval_loss"]) for e in run.evaluations if isinstance(e.get("eval_loss"), (int, float))]
                figure.add_trace(line_trace(go, [s for s, _ in evals], [v for _, v in evals], "eval loss", RUN_COLORS[1],
                                            dash="dash"), row, col)
            if key == "lr":
                figure.update_yaxes(exponentformat="e", row=row, col=col)
        figure.update_xaxes(title_text="step" if position >= len(panels) - columns else None, row=row, col=col)
    _mark_events(go, figure, run)
    figure.update_xaxes(matches="x")  # one step axis: zooming one panel zooms them all
    if run.steps and run.steps[-1]["step"] <= 12:
        figure.update_xaxes(dtick=1)  # whole steps, not 1.2, 1.4, ...
    figure.update_layout(
        height=300 * rows,
        margin={"l": 60, "r": 20, "t": 50, "b": 40},
        hovermode="x unified",
        legend={"orientation": "h", "y": -0.08 / rows * 2},
        template="plotly_white",
    )
    return figure


def event_label(event: dict[str, Any]) -> str:
    message = event.get("message")
    if message:
        return str(message)
    parts = [f"out of memory in {event.get('phase', '?')}"]
    if "old_micro_batch_size" in event:
        parts.append(f"micro-batch {event['old_micro_batch_size']} -> {event.get('new_micro_batch_size')}")
    if event.get("action"):
        parts.append(str(event["action"]))
    return ", ".join(parts)


def _mark_events(go, figure, run: RunData) -> None:
    """Vertical lines on every panel at OOM recoveries and resumes, and hoverable markers on the loss panel."""
    loss_by_step = dict(zip(*run.series("loss"), strict=True))
    groups = (
        (
            "OOM recovered",
            OOM_COLOR,
            "dot",
            "x",
            [(event.get("step"), event_label(event)) for event in run.oom_events],
        ),
        (
            "resumed",
            RESUME_COLOR,
            "dash",
            "triangle-up",
            [(r["step"], f"resumed from {r['from']}") for r in run.resumes],
        ),
    )
    for name, color, dash, symbol, marks in groups:
        marks = [(step, text) for step, text in marks if isinstance(step, int)]
        if not marks:
            continue
        for step in sorted({step for step, _ in marks}):
            figure.add_vline(x=step, line={"color": color, "dash": dash, "width": 1}, row="all", col="all")
        figure.add_trace(
            go.Scatter(
                x=[step for step, _ in marks],
                y=[rounded(loss_by_step.get(step, loss_by_step.get(step + 1))) for step, _ in marks],
                mode="markers",
                name=name,
                marker={"color": color, "size": 11, "symbol": symbol, "line": {"width": 1}},
                text=[text for _, text in marks],
                hovertemplate="step %{x}: %{text}<extra>" + name + "</extra>",
            ),
            1,
            1,
        )


def breakdown_figure(breakdown: dict[str, int], estimate: dict[str, Any] | None = None):
    """Bytes per category at the peak, measured, with the estimate beside it when there is one."""
    go = require_plotly()
    estimated = (estimate or {}).get("breakdown") or {}
    names = [
        name
        for name in ordered_categories(list(breakdown) + list(estimated))
        if breakdown.get(name) or estimated.get(name)
    ]
    unit, scale = byte_unit(max([*breakdown.values(), *estimated.values(), 1]))
    labels = [name.replace("_", " ") for name in names]
    figure = go.Figure()
    figure.add_trace(
        go.Bar(
            y=labels,
            x=[rounded(breakdown.get(name, 0) / scale) for name in names],
            orientation="h",
            name="measured",
            marker={"color": [CATEGORY_COLORS.get(name, "#999999") for name in names]},
            hovertemplate=f"%{{x}} {unit}<extra>measured</extra>",
        )
    )
    if estimated:
        figure.add_trace(
            go.Bar(
                y=labels,
                x=[rounded(estimated.get(name, 0) / scale) for name in names],
                orientation="h",
                name=f"estimated ({estimate.get('method', 'analytical')})",
                marker={"color": "#bbbbbb"},
                hovertemplate=f"%{{x}} {unit}<extra>estimated</extra>",
            )
        )
    figure.update_layout(
        barmode="group",
        height=90 + 40 * len(names) * (2 if estimated else 1),
        template="plotly_white",
        margin={"l": 150, "r": 20, "t": 20, "b": 40},
        xaxis_title=unit,
        yaxis={"autorange": "reversed"},
        legend={"orientation": "h", "y": 1.08},
        showlegend=bool(estimated),
    )
    return figure


def ordered_categories(names: list[str]) -> list[str]:
    known = [name for name in CATEGORIES if name in names]
    return known + [name for name in dict.fromkeys(names) if name not in known]


def timeline_figure(timeline: dict[str, Any]):
    """Live bytes of one step stacked by category, phases marked; drag to zoom, the slider below to pan."""
    go = require_plotly()
    index = timeline.get("event_index") or []
    sizes = timeline.get("bytes") or {}
    names = [name for name in ordered_categories(list(sizes)) if any(sizes[name])]
    totals = [sum(sizes[name][i] for name in names) for i in range(len(index))]
    unit, scale = byte_unit(max(totals, default=1))
    figure = go.Figure()
    for name in names:
        figure.add_trace(
            go.Scatter(
                x=index,
                y=[rounded(value / scale, 4) for value in sizes[name]],
                name=name.replace("_", " "),
                mode="lines",
                stackgroup="memory",
                line={"width": 0.5, "shape": "hv", "color": CATEGORY_COLORS.get(name)},
                hovertemplate=f"%{{y}} {unit}<extra>{name.replace('_', ' ')}</extra>",
            )
        )
    phases = timeline.get("phases") or []
    span = max((index[-1] - index[0]) if index else 1, 1)
    labelled_at = None
    for start, phase in phases:
        if phase.startswith("("):  # bookkeeping between phases gets no line of its own
            continue
        figure.add_vline(x=start, line={"color": "black", "dash": "dot", "width": 1})
        # With many micro-batches the phases repeat: name them where the labels do not overlap.
        if labelled_at is None or start - labelled_at > 0.06 * span:
            figure.add_annotation(
                x=start, y=1.0, yref="paper", text=phase, showarrow=False, xanchor="left", yanchor="bottom"
            )
            labelled_at = start
    if totals:
        peak = max(totals)
        figure.add_annotation(
            x=index[totals.index(peak)],
            y=peak / scale,
            text=f"peak {peak / scale:.1f} {unit}",
            showarrow=True,
            arrowhead=2,
        )
    figure.update_layout(
        height=420,
        template="plotly_white",
        hovermode="x unified",
        margin={"l": 60, "r": 20, "t": 40, "b": 40},
        xaxis={
            "title": "tracker event (operators and frees that changed live memory)",
            "rangeslider": {"visible": True},
        },
        yaxis={"title": f"live tensor memory ({unit})", "rangemode": "tozero"},
    )
    return figure
