"""The report's section on a planned run's trials: each candidate's predicted and measured step and peak, and why
one won (the `plan_trials` line of metrics.jsonl, written by memfit.train.trials)."""

from __future__ import annotations

from html import escape
from typing import Any

from memfit.units import format_bytes


def plan_trials_html(events: list[dict[str, Any]]) -> str:
    """An <h2> section with one row per candidate, or '' when the run was not planned with trials."""
    record = next((e for e in events if e.get("event") == "plan_trials"), None)
    if record is None:
        return ""
    rows = []
    for candidate in record.get("candidates") or []:
        plan = candidate.get("plan") or {}
        what = (f"micro-batch {plan.get('batch_size')} x {plan.get('gradient_accumulation_steps')}, checkpointing"
                f" {plan.get('gradient_checkpointing')}, {plan.get('optimizer') or 'adamw'}"
                f"{', loss chunk ' + str(plan['loss_chunk_size']) if plan.get('loss_chunk_size') else ''}"
                f"{', optimizer in backward' if plan.get('optimizer_in_backward') else ''}")
        cells = [what, _seconds(candidate.get("predicted_seconds")), _bytes(candidate.get("estimated_peak_bytes")),
                 _seconds(candidate.get("measured_seconds")), _bytes(candidate.get("peak_bytes")),
                 candidate.get("status", "")]
        rows.append("<tr>" + "".join(f"<td>{escape(str(c))}</td>" for c in cells) + "</tr>")
    header = "".join(f"<th>{h}</th>" for h in ("candidate", "predicted s/step", "estimated peak", "measured s/step",
                                                "measured peak", "trial"))
    return (f"<h2>Plan trials</h2><div class=\"sub\">Chosen by {escape(str(record.get('chosen_by')))}:"
            f" {escape(str(record.get('why')))}</div><table><thead><tr>{header}</tr></thead><tbody>"
            + "".join(rows) + "</tbody></table>")


def _seconds(value: Any) -> str:
    return f"{value:.3g}" if isinstance(value, (int, float)) and value else "-"


def _bytes(value: Any) -> str:
    return format_bytes(value) if isinstance(value, (int, float)) and value else "-"
