"""The charts of `memfit compare`: several runs overlaid, one colour per run."""

from __future__ import annotations

from collections.abc import Sequence

from memfit.reporting.figures import (
    CATEGORY_COLORS,
    RUN_COLORS,
    byte_unit,
    downsample,
    line_trace,
    memory_series,
    ordered_categories,
    require_plotly,
    rounded,
)
from memfit.reporting.run_data import RunData


def compare_figure(runs: Sequence[RunData]):
    """Loss, tokens/s and peak memory of several runs, overlaid (one colour per run)."""
    go = require_plotly()
    from plotly.subplots import make_subplots

    titles = ("loss", "tokens/s", "peak memory")
    figure = make_subplots(rows=3, cols=1, shared_xaxes=True, subplot_titles=titles, vertical_spacing=0.08)
    peak_all = max([max(ys) for run in runs for _, _, ys, _ in memory_series(run)] or [1])
    unit, scale = byte_unit(peak_all)
    for number, run in enumerate(runs):
        color = RUN_COLORS[number % len(RUN_COLORS)]
        first = True
        for row, key in ((1, "loss"), (2, "tokens_per_second")):
            xs, ys = downsample(*run.series(key))
            if xs:
                figure.add_trace(
                    line_trace(go, xs, ys, run.name, color, legendgroup=run.name, showlegend=first), row, 1
                )
                first = False
        series = memory_series(run)
        # The device peak when there is one, else what the tracker or the process measured.
        if series:
            label, xs, ys, host = series[0]
            xs, ys = downsample(xs, ys, "max")
            figure.add_trace(
                line_trace(
                    go,
                    xs,
                    [y / scale for y in ys],
                    f"{run.name}: {label}",
                    color,
                    "dot" if host else None,
                    legendgroup=run.name,
                    showlegend=first,
                    hover_unit=f" {unit}",
                ),
                3,
                1,
            )
    figure.update_yaxes(title_text=unit, rangemode="tozero", row=3, col=1)
    figure.update_xaxes(title_text="step", row=3, col=1)
    figure.update_layout(
        height=860, template="plotly_white", hovermode="x unified", margin={"l": 60, "r": 20, "t": 40, "b": 40}
    )
    return figure


def compare_breakdown_figure(runs: Sequence[RunData]):
    """The tracked breakdown at each run's peak, one stacked bar per run; None when no run was tracked."""
    go = require_plotly()
    measured = [
        (run.name, run.memory["profile"]["breakdown"]) for run in runs if run.memory and run.memory.get("profile")
    ]
    if not measured:
        return None
    names = [
        name
        for name in ordered_categories([n for _, b in measured for n in b])
        if any(b.get(name) for _, b in measured)
    ]
    unit, scale = byte_unit(max(sum(b.values()) for _, b in measured))
    figure = go.Figure()
    for name in names:
        figure.add_trace(
            go.Bar(
                y=[run for run, _ in measured],
                x=[rounded(b.get(name, 0) / scale) for _, b in measured],
                orientation="h",
                name=name.replace("_", " "),
                marker={"color": CATEGORY_COLORS.get(name)},
                hovertemplate=f"%{{x}} {unit}<extra>{name.replace('_', ' ')}</extra>",
            )
        )
    figure.update_layout(
        barmode="stack",
        height=140 + 45 * len(measured),
        template="plotly_white",
        xaxis_title=f"live tensors at the peak ({unit})",
        margin={"l": 150, "r": 20, "t": 20, "b": 40},
        legend={"orientation": "h", "y": 1.15},
        yaxis={"autorange": "reversed"},
    )
    return figure
