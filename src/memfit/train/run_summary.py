"""The run summary printed at the end of `memfit train`: what ran, the loss, the peak memory."""

from __future__ import annotations

from memfit.train.speed import speed_line
from memfit.units import format_bytes


def memory_report(summary: dict) -> str:
    """A few lines: what ran, the loss, the peak (measured), and the tracked breakdown if any."""
    lines = ["", "memfit memory report"]
    lines.append(
        f"  device {summary['device']} | precision {summary['precision']} | optimizer {summary['optimizer']}"
        f" | attention {summary['attention']} | checkpointing {summary['gradient_checkpointing']}"
    )
    if summary.get("rope_scaling"):
        lines.append(f"  RoPE scaling {summary['rope_scaling']} (a context-extension fine-tune)")
    if summary.get("first_loss") is not None:
        lines.append(f"  loss {summary['first_loss']:.4f} -> {summary['final_loss']:.4f} over {summary['steps']} steps")
    if summary.get("eval_loss") is not None:
        lines.append(f"  eval loss {summary['eval_loss']:.4f} (perplexity {summary['eval_perplexity']:,.2f}) at step"
                     f" {summary['eval_step']}, over {summary['eval_tokens']:,} target tokens")
    if summary.get("best_dir"):
        lines.append(f"  best eval loss {summary['best_eval_loss']:.4f} at step {summary['best_eval_step']}:"
                     f" model in {summary['best_dir']}")
    peak = summary.get("peak_memory_bytes")
    label = "peak allocated (CUDA)" if str(summary["device"]).startswith("cuda") else "process peak RSS"
    if peak:
        lines.append(f"  {label}: {format_bytes(peak)}")
    tracked = summary.get("tracked_breakdown")
    if summary.get("tracked_peak_bytes"):
        lines.append(f"  tracked tensor peak: {format_bytes(summary['tracked_peak_bytes'])}")
        if tracked:
            total = sum(tracked.values()) or 1
            parts = ", ".join(f"{name} {format_bytes(value)} ({100 * value / total:.0f}%)" for name, value in tracked.items() if value)
            lines.append(f"    at the peak: {parts}")
    if speed_line(summary):
        lines.append(speed_line(summary))
    if summary.get("micro_batch_size") and summary.get("oom_events"):
        lines.append(f"  out-of-memory events recovered: {summary['oom_events']} (micro-batch now {summary['micro_batch_size']})")
    for technique, note in (summary.get("fallbacks") or {}).items():
        lines.append(f"  note: {technique}: {note}")
    lines.append("  where the bytes go, step by step: memfit profile (same flags)")
    return "\n".join(lines)
