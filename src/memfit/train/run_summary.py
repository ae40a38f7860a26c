"""The run summary printed at the end of `memfit train`: what ran, the loss, the peak memory.

The task of the run (its facts in the summary line: memfit.tasks) words the eval line: perplexity
over target tokens for a causal or masked LM, accuracy, F1, MCC and AUROC over samples for a
classifier, MSE and correlations for a regression. A resumed run says where it resumed.
"""

from __future__ import annotations

from memfit.tasks import task_class
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
    lines += loss_lines(summary)
    lines += eval_lines(summary)
    if summary.get("best_dir"):
        lines.append(f"  best eval loss {summary['best_eval_loss']:.4f} at step {summary['best_eval_step']}:"
                     f" model in {summary['best_dir']}")
    lines += memory_lines(summary)
    if speed_line(summary):
        lines.append(speed_line(summary))
    if summary.get("micro_batch_size") and summary.get("oom_events"):
        lines.append(f"  out-of-memory events recovered: {summary['oom_events']} (micro-batch now {summary['micro_batch_size']})")
    for technique, note in (summary.get("fallbacks") or {}).items():
        lines.append(f"  note: {technique}: {note}")
    lines.append("  where the bytes go, step by step: memfit profile (same flags)")
    return "\n".join(lines)


def loss_lines(summary: dict) -> list[str]:
    """The training loss from the run's first step to its last; a resumed run says where this launch began."""
    final, steps = summary.get("final_loss"), summary.get("steps")
    if final is None:
        return []
    resumed_at = summary.get("resumed_at_step")
    if resumed_at is None:
        first = summary.get("first_loss")
        return [f"  loss {first:.4f} -> {final:.4f} over {steps} steps"] if first is not None else []
    launch = f"resumed at step {resumed_at}: loss {summary['launch_first_loss']:.4f} -> {final:.4f} over steps" \
             f" {resumed_at + 1}-{steps}"
    if summary.get("first_loss") is None:  # the metrics of the run's first steps are gone
        return [f"  {launch}"]
    return [f"  loss {summary['first_loss']:.4f} (step 1) -> {final:.4f} (step {steps}); {launch}"]


def eval_lines(summary: dict) -> list[str]:
    """The last evaluation, as the run's task words it (memfit.tasks.Task.eval_scores, eval_count)."""
    if summary.get("eval_loss") is None:
        return []
    task = task_class(summary.get("task"))
    count = task.eval_count(summary)
    line = f"  eval loss {summary['eval_loss']:.4f} at step {summary['eval_step']}" + (f" over {count}" if count else "")
    scores = task.eval_scores(summary)
    if scores:
        line += ": " + ", ".join(scores)
    elif "perplexity" not in task.eval_metrics:  # the task's metrics stream needs scikit-learn
        line += " (no metrics: pip install 'memfit[tasks]' for them)"
    return [line]


def memory_lines(summary: dict) -> list[str]:
    """The measured peak, the tracker's peak and breakdown, and memfit's estimate beside it."""
    lines = []
    peak = summary.get("peak_memory_bytes")
    label = "peak allocated (CUDA)" if str(summary["device"]).startswith("cuda") else "process peak RSS"
    if peak:
        lines.append(f"  {label}: {format_bytes(peak)}")
    tracked = summary.get("tracked_breakdown")
    if summary.get("tracked_peak_bytes"):
        which = (f" (step {summary['tracked_step']}, the one step tracked by default; --track-memory tracks every step)"
                 if summary.get("tracked_step") else "")
        lines.append(f"  tracked tensor peak: {format_bytes(summary['tracked_peak_bytes'])}{which}")
        if tracked:
            total = sum(tracked.values()) or 1
            parts = ", ".join(f"{name} {format_bytes(value)} ({100 * value / total:.0f}%)" for name, value in tracked.items() if value)
            lines.append(f"    at the peak: {parts}")
        estimate = summary.get("estimated_peak_bytes")
        if estimate:
            band = summary.get("estimate_error_band") or 0
            lines.append(f"    memfit's estimate: {format_bytes(estimate)} (+-{100 * band:.0f}%,"
                         f" {summary.get('estimate_method') or 'analytical'}); measured"
                         f" {summary['tracked_peak_bytes'] / estimate:.2f}x of it")
    return lines
