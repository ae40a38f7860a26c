"""One self-contained HTML file per report: styles, plotly.js and the data inline, nothing fetched.

`render_report(run)` is the page of one run, `render_compare(runs)` the page of several
runs overlaid; `write_html(path, page)` writes either atomically. Every text that comes
from a run is escaped.
"""

from __future__ import annotations

import datetime
import html
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from memfit.reporting import compare, figures
from memfit.reporting.plan_trials import plan_trials_html
from memfit.reporting.run_data import RunData
from memfit.tasks import describe_task, task_class
from memfit.units import format_bytes

_STYLE = """
body { font-family: -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 0; color: #222; background: #f6f7f9; }
main { max-width: 1200px; margin: 0 auto; padding: 16px 24px 40px; }
h1 { font-size: 1.5em; margin: 12px 0 2px; } h2 { font-size: 1.15em; margin: 28px 0 8px; border-bottom: 1px solid #ddd; }
.sub { color: #666; font-size: 0.9em; }
.cards { display: grid; grid-template-columns: repeat(auto-fill, minmax(170px, 1fr)); gap: 10px; margin: 14px 0; }
.card { background: #fff; border: 1px solid #e2e4e8; border-radius: 6px; padding: 8px 12px; }
.card .label { color: #666; font-size: 0.78em; text-transform: uppercase; letter-spacing: .03em; }
.card .value { font-size: 1.25em; font-weight: 600; margin-top: 2px; } .card .note { color: #666; font-size: 0.8em; }
table { border-collapse: collapse; background: #fff; font-size: 0.9em; margin: 6px 0; }
td, th { border: 1px solid #e2e4e8; padding: 4px 10px; text-align: left; vertical-align: top; }
th { background: #f0f1f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
.chart { background: #fff; border: 1px solid #e2e4e8; border-radius: 6px; margin: 8px 0; padding: 4px; }
.warn { background: #fff4e5; border-left: 4px solid #f0a030; padding: 6px 10px; margin: 6px 0; }
.ok { background: #eef7ee; border-left: 4px solid #55a868; padding: 6px 10px; margin: 6px 0; }
.twocol { display: grid; grid-template-columns: 1fr 1fr; gap: 16px; } @media (max-width: 900px) { .twocol { grid-template-columns: 1fr; } }
footer { color: #777; font-size: 0.8em; margin-top: 30px; }
"""

_SIZE_MARK = "@@REPORT_SIZE@@"


def _e(value: Any) -> str:
    return html.escape(str(value), quote=True)


def _bytes(value: Any) -> str:
    return format_bytes(value) if isinstance(value, (int, float)) and value else "-"


def _number(value: float | None, digits: int = 4) -> str:
    if value is None:
        return "-"
    return f"{value:.{digits}g}" if abs(value) < 1e5 else f"{value:,.0f}"


def _card(label: str, value: str, note: str = "") -> str:
    note_html = f'<div class="note">{_e(note)}</div>' if note else ""
    return (
        f'<div class="card"><div class="label">{_e(label)}</div><div class="value">{_e(value)}</div>{note_html}</div>'
    )


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]], numeric: Sequence[int] = ()) -> str:
    head = "".join(f"<th>{_e(cell)}</th>" for cell in header)
    body = "".join(
        "<tr>"
        + "".join(f"<td{' class=num' if i in numeric else ''}>{_e(cell)}</td>" for i, cell in enumerate(row))
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _chart(figure, div_id: str) -> str:
    return (
        '<div class="chart">'
        + figure.to_html(full_html=False, include_plotlyjs=False, div_id=div_id, config=figures.PLOTLY_CONFIG)
        + "</div>"
    )


def _page(title: str, subtitle: str, body: str) -> str:
    import plotly
    from plotly.offline import get_plotlyjs

    generated = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    from memfit import __version__

    footer = (
        f"<footer>made by memfit {_e(__version__)} on {generated} with plotly {_e(plotly.__version__)} (inline, works offline); "
        f"this file: {_SIZE_MARK}</footer>"
    )
    return (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        '<meta name="viewport" content="width=device-width, initial-scale=1">'
        f"<title>{_e(title)}</title><style>{_STYLE}</style>"
        f'<script type="text/javascript">{get_plotlyjs()}</script></head>'
        f'<body><main><h1>{_e(title)}</h1><div class="sub">{_e(subtitle)}</div>{body}{footer}</main></body></html>\n'
    )


def _with_size(page: str) -> str:
    """Fill in the page's own size (the figure barely moves it: one more pass settles it)."""
    size = len(page.encode("utf-8"))
    for _ in range(2):
        text = format_bytes(size)
        size = len(page.replace(_SIZE_MARK, text).encode("utf-8"))
    return page.replace(_SIZE_MARK, format_bytes(size))


# ------------------------------------------------------------------ one run


def glance(run: RunData) -> list[tuple[str, str, str]]:
    """(label, value, note) of the cards at the top of the report."""
    facts = run.facts
    cards = [("model", str(facts.get("model", "?")), f"{facts.get('device', '?')} x {facts.get('world_size', 1)}")]
    if run.task.get("name") not in (None, "causal-lm"):
        cards.append(("task", str(run.task["name"]), str(run.task.get("head") or "")))
    steps = run.steps[-1]["step"] if run.steps else 0
    finished = run.summary is not None or run.kind == "profile"
    cards.append(("steps", str(steps), "finished" if finished else "no summary: the run did not finish"))
    if run.final_loss is not None:
        cards.append(
            ("final loss", _number(run.final_loss), f"from {_number(run.first_loss)} at step {run.steps[0]['step']}")
        )
    if run.evaluations:
        last, summary = run.evaluations[-1], run.summary or {}
        task = task_class(run.task)  # words the eval: perplexity over target tokens, or accuracy, F1, ... over samples
        count = task.eval_count(last)
        scores = task.eval_scores(last)
        note = f"at step {last['step']}" + (f" over {count}" if count else "")
        if "perplexity" in task.eval_metrics and scores:
            note = f"{scores.pop(0)} {note}"  # perplexity, with the loss it is the exp of
        if summary.get("best_eval_step") is not None:
            note += f"; best {_number(summary.get('best_eval_loss'))} at step {summary['best_eval_step']}, kept in best/"
        cards.append(("eval loss", _number(last.get("eval_loss")), note))
        if scores:  # the task's metrics (memfit.tasks.metrics)
            cards.append(("eval metrics", scores[0], ", ".join([*scores[1:], f"at step {last['step']}"])))
    speed = run.typical_tokens_per_second()
    if speed is not None:
        cards.append(("tokens/s", _number(speed, 4), "median over steps after the first"))
    mfu = run.typical_mfu()
    if mfu is not None:
        cards.append(("MFU", f"{_number(100 * mfu, 3)}%", "median model FLOPs utilization"))
    summary = run.summary or {}
    if summary.get("measured_step_seconds") and summary.get("predicted_step_seconds"):
        measured, predicted = summary["measured_step_seconds"], summary["predicted_step_seconds"]
        cards.append(
            (
                "step time",
                f"{_number(measured, 3)} s",
                f"measured; memfit's speed model predicted {_number(predicted, 3)} s",
            )
        )
    for label, _, ys, host in figures.memory_series(run):
        if not label.startswith("device: peak reserved"):
            name = "peak " + label.split(": ")[-1].replace("peak ", "")
            cards.append((name, format_bytes(max(ys)), "host memory" if host else "device memory"))
    estimate = (run.memory or {}).get("estimate") or {}
    measured = ((run.memory or {}).get("profile") or {}).get("peak_bytes")
    if estimate.get("peak_bytes"):  # beside the tracker's peak: what memfit predicted without running it
        ratio = f"; measured {measured / estimate['peak_bytes']:.2f}x" if measured else ""
        cards.append(("estimated peak", format_bytes(estimate["peak_bytes"]),
                      f"memfit estimate ({estimate.get('method', 'analytical')}, +-{100 * (estimate.get('error_band') or 0):.0f}%){ratio}"))
    oom = len(run.oom_events)
    if oom or run.kind == "train":
        cards.append(("OOM recovered", str(oom), "micro-batch split, update unchanged" if oom else "none needed"))
    if run.resumes:
        cards.append(("resumed", str(len(run.resumes)), "at step " + ", ".join(str(r["step"]) for r in run.resumes)))
    if run.summary and run.summary.get("wall_seconds") is not None:
        cards.append(("wall time", f"{run.summary['wall_seconds']:.1f} s", "last launch"))
    return cards


def configuration_rows(run: RunData) -> list[tuple[str, str]]:
    """What really ran (from the metrics) and the settings saved with the checkpoint."""
    facts, config = run.facts, run.config or {}
    last = run.steps[-1] if run.steps else {}
    rows = [("model", facts.get("model"))]
    if run.task:  # what is learned: the head, what the loss is normalised by, what evaluation reports
        rows.append(("task", describe_task(run.task, evaluated=bool(run.evaluations))))
    rows.append(("data", config.get("dataset") or ("bundled corpus" if config else None)))
    if facts.get("data"):  # the data as the task reads it: a table's samples and labels, or the fine-tuning format
        rows.append(("data as read", task_class(run.task).describe_data(facts["data"])))
    precision = facts.get("precision")
    if facts.get("precision_reason"):
        precision = f"{precision} ({facts['precision_reason']})"
    rows += [
        ("device", f"{facts.get('device', '?')}, {facts.get('world_size', 1)} rank(s)"),
        ("precision", precision),
        ("optimizer", facts.get("optimizer")),
        ("attention kernel", facts.get("attention")),
        ("gradient checkpointing", facts.get("gradient_checkpointing")),
        ("loss chunk size", facts.get("loss_chunk_size") or "off" if "loss_chunk_size" in facts else None),
        # what each technique of the registry says about the run (resolution.resolve.report)
        ("techniques", ", ".join(f"{name.replace('_', ' ')} {value}" for name, value in facts["techniques"].items())
         if facts.get("techniques") else None),
    ]
    changes = [event for event in run.events if event.get("event") == "run_changed"]
    if changes:  # what changed while running (an OOM escalation, compiled blocks run eager), step by step
        rows.append(("changed while running", "; ".join(
            f"step {event.get('step', '?')}: {event.get('technique')} {event.get('from')} -> {event.get('to')}"
            f" ({event.get('reason')})" for event in changes)))
    if last.get("micro_batch_size"):
        rows.append(
            (
                "batch",
                f"micro-batch {last['micro_batch_size']} x {last.get('gradient_accumulation_steps', 1)} accumulation"
                f" x {facts.get('world_size', 1)} rank(s) = {facts.get('effective_batch_size', '?')} samples of {facts.get('seq_len', '?')} tokens",
            )
        )
    if config:
        lora = "off" if not config.get("lora_r") else f"rank {config['lora_r']}, alpha {config.get('lora_alpha')}"
        if config.get("quantize") not in (None, "none"):
            lora += f", base weights {config['quantize']}"
        offload = [
            name
            for name in ("optimizer_offload", "activation_offload", "fsdp_offload", "zero_offload")
            if config.get(name)
        ]
        rows += [
            ("LoRA", lora),
            ("offload", ", ".join(name.replace("_", " ") for name in offload) or "off"),
            ("optimizer in backward", "on" if config.get("optimizer_in_backward") else "off"),
            ("learning rate", f"{config.get('lr')} ({config.get('lr_schedule')}, warmup {config.get('warmup_steps')})"),
            ("memory cap", _bytes(config.get("memory_cap")) if config.get("memory_cap") else "none"),
        ]
        if (config.get("eval_dataset") or config.get("eval_fraction")) and config.get("eval_strategy") != "no":
            held = config.get("eval_dataset") or f"{config['eval_fraction']:.0%} of the training rows held out"
            when = "each epoch" if config.get("eval_strategy") == "epoch" else (
                f"every {config['eval_every']} steps" if config.get("eval_every") else None)
            last = run.evaluations[-1] if run.evaluations else {}
            batch = f", eval batch {last['eval_batch_size']}" if last.get("eval_batch_size") else ""
            rows.append(("evaluation", f"{held}, {when + ' and ' if when else ''}at the end{batch}"
                         + ("; best model kept in best/" if config.get("save_best") else "")))
    return [(name, str(value)) for name, value in rows if value is not None]


def fallbacks_and_choices(run: RunData) -> tuple[dict[str, str], dict[str, str]]:
    """(what fell back from what was asked, and why; settings memfit chose from what was asked).

    The metrics' "fallbacks" hold both; "derived_settings" names the second kind (config.derived: clipping off
    under --optimizer-in-backward, the parts of --chunked-training, ...). An entry whose text changed since it
    was derived (the technique then fell back at run time) is a fallback.
    """
    fallbacks = dict(run.facts.get("fallbacks") or {})
    derived = run.facts.get("derived_settings") or {}
    chosen = {name: note for name, note in fallbacks.items() if derived.get(name) == note}
    return {name: note for name, note in fallbacks.items() if name not in chosen}, chosen


def _fallbacks_html(run: RunData) -> str:
    fallbacks, chosen = fallbacks_and_choices(run)
    parts = [f'<div class="warn"><b>{_e(name)}</b>: {_e(note)}</div>' for name, note in fallbacks.items()]
    if not fallbacks:
        parts.append('<div class="ok">Everything ran as asked: no fallback.</div>')
    if chosen:
        parts.append('<div class="sub">Chosen by memfit from what was asked (not fallbacks): '
                     + "; ".join(f"<b>{_e(name)}</b>: {_e(note)}" for name, note in chosen.items()) + "</div>")
    return "".join(parts)


COMPLETIONS_SHOWN = 6
"""Sampled completions an online-RL run's page shows (the last ones written to completions.jsonl)."""


def _completions_html(run: RunData) -> str:
    """A few of the completions an online-RL run (--task grpo) sampled, with their prompts and rewards."""
    source = Path(run.source)
    path = (source if source.is_dir() else source.parent) / "completions.jsonl"
    if not path.is_file():
        return ""
    shown = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    rows = [[item.get("step"), item.get("prompt"), item.get("completion"), item.get("reward")]
            for item in shown[-COMPLETIONS_SHOWN:]]
    return "<h2>Sampled completions</h2>" + _table(["step", "prompt", "completion", "reward"], rows, numeric=(0, 3))


def _events_html(run: RunData) -> str:
    rows = [(event.get("step"), "out of memory, recovered", figures.event_label(event)) for event in run.oom_events]
    rows += [(r["step"], "resumed", f"from {r['from']}") for r in run.resumes]
    if not rows:
        return ""
    rows.sort(key=lambda row: row[0] if isinstance(row[0], int) else -1)
    return "<h2>Events</h2>" + _table(["step", "event", "what happened"], rows, numeric=[0])


def _memory_html(run: RunData) -> str:
    record = run.memory
    if not record or not record.get("profile"):
        breakdown = (run.summary or {}).get("tracked_breakdown")
        hint = (
            ""
            if run.kind != "train"
            else (
                '<div class="sub">The tracker did not run: a run tracks one early step by default, unless '
                "--no-track-memory, --compile, several ranks or --no-report turn it off. Run with --track-memory (every "
                "step) or memfit profile for the memory at the peak beside the estimate, the timeline of a step, the "
                "modules and the largest tensors at the peak, and advice.</div>"
            )
        )
        if breakdown:
            return "<h2>Memory at the peak</h2>" + _chart(figures.breakdown_figure(breakdown), "breakdown") + hint
        return "<h2>Memory at the peak</h2>" + (hint or '<div class="sub">The tracker did not run.</div>')
    profile, estimate = record["profile"], record.get("estimate")
    peak = profile.get("peak_bytes") or 1
    sampled = (run.summary or {}).get("tracked_step")
    which = (f" The tracker ran on step {sampled} alone (the default: one early step, where the optimizer state "
             "already exists; --track-memory tracks every step, --no-track-memory none)." if sampled else "")
    parts = [
        "<h2>Memory at the peak</h2>",
        f'<div class="sub">Live tensor bytes counted by the tracker on {_e(profile.get("device"))}: peak '
        f"{_e(format_bytes(peak))} in step {_e(record.get('peak_step', profile.get('peak_step')))} ({_e(profile.get('peak_phase'))}).{_e(which)}</div>",
    ]
    breakdown = profile.get("breakdown") or {}
    estimated = (estimate or {}).get("breakdown") or {}
    rows = []
    for name in figures.ordered_categories(list(breakdown) + list(estimated)):
        if breakdown.get(name) or estimated.get(name):
            row = [
                name.replace("_", " "),
                _bytes(breakdown.get(name, 0)),
                f"{100 * breakdown.get(name, 0) / peak:.0f}%",
            ]
            rows.append(row + ([_bytes(estimated.get(name, 0))] if estimate else []))
    total = ["peak", _bytes(peak), "100%"]
    if estimate:
        band = estimate.get("error_band") or 0
        total.append(f"{_bytes(estimate.get('peak_bytes'))} (+-{100 * band:.0f}%)")
    header = ["category", "measured", "share"] + (
        [f"estimated ({estimate.get('method', 'analytical')})"] if estimate else []
    )
    parts.append('<div class="twocol"><div>' + _table(header, rows + [total], numeric=[1, 2, 3]))
    if estimate:
        ratio = (f" The measured peak is {peak / estimate['peak_bytes']:.2f}x the estimate."
                 if estimate.get("peak_bytes") else "")
        parts.append(
            '<div class="sub">The estimate is memfit\'s prediction for this configuration at micro-batch '
            f"{_e(estimate.get('micro_batch_size', '?'))} (memfit estimate, {_e(estimate.get('method', 'analytical'))} "
            f"method, peak in {_e(estimate.get('peak_phase') or '?')}), made without running it.{_e(ratio)}</div>"
        )
    parts.append("</div><div>" + _chart(figures.breakdown_figure(breakdown, estimate), "breakdown") + "</div></div>")
    timeline = record.get("timeline") or {}
    if timeline.get("event_index"):
        kept, recorded = len(timeline["event_index"]), timeline.get("samples_recorded", len(timeline["event_index"]))
        thinned = f" ({kept} of {recorded} samples kept, the highest of each stretch)" if recorded > kept else ""
        parts.append(
            f'<h2>One step, stacked by category</h2><div class="sub">Step {_e(timeline.get("step"))}, where the peak '
            f"happened; dotted lines mark where each phase begins{_e(thinned)}. Drag to zoom, double-click to reset.</div>"
        )
        parts.append(_chart(figures.timeline_figure(timeline), "timeline"))
    modules = profile.get("top_modules") or []
    tensors = profile.get("top_tensors") or []
    if modules or tensors:
        parts.append('<div class="twocol"><div><h2>Modules holding the most activations</h2>')
        parts.append(
            _table(["module", "activation bytes"], [(m["module"], _bytes(m["activation_bytes"])) for m in modules], [1])
        )
        parts.append("</div><div><h2>Largest tensors at the peak</h2>")
        parts.append(
            _table(
                ["shape", "dtype", "size", "category", "made by", "module"],
                [
                    (
                        "x".join(map(str, t["shape"])) or "scalar",
                        t["dtype"],
                        _bytes(t["bytes"]),
                        t["category"],
                        t["op"],
                        t["module"],
                    )
                    for t in tensors
                ],
                [2],
            )
        )
        parts.append("</div></div>")
    parts.append("<h2>Advice</h2>")
    advice = profile.get("advice") or []
    if advice:
        parts.append(
            _table(
                ["technique", "flag", "saves about", "why"],
                [(a["technique"], a["flag"], _bytes(a["saves_bytes"]), a["message"]) for a in advice],
                [2],
            )
        )
    else:
        parts.append('<div class="ok">Nothing large to cut: the peak is spread over the categories above.</div>')
    if profile.get("leak"):
        parts.append(f'<div class="warn">{_e(profile["leak"]["message"])}</div>')
    return "".join(parts)


def render_report(run: RunData) -> str:
    """The HTML page of one run."""
    figures.require_plotly()
    what = "memfit profile" if run.kind == "profile" else "memfit run"
    title = f"{what}: {run.facts.get('model', run.name)}"
    cards = "".join(_card(*card) for card in glance(run))
    body = [f'<div class="cards">{cards}</div>', "<h2>Configuration that ran</h2>"]
    body.append(_table(["setting", "value"], configuration_rows(run)))
    body.append("<h2>Fallbacks</h2>" + _fallbacks_html(run))
    body.append(plan_trials_html(run.events))  # a planned run: what its trials measured and what won
    if run.steps:
        marks = (
            "; OOM recoveries (red, dotted) and resumes (green, dashed) are marked"
            if run.oom_events or run.resumes
            else ""
        )
        body.append(f'<h2>Over the steps</h2><div class="sub">Hover for values, drag to zoom{_e(marks)}.</div>')
        body.append(_chart(figures.curves_figure(run), "curves"))
    body.append(_completions_html(run))
    body.append(_events_html(run))
    body.append(_memory_html(run))
    return _with_size(_page(title, f"{run.source}", "".join(body)))


# ------------------------------------------------------------------ several runs


def render_compare(runs: Sequence[RunData]) -> str:
    """The HTML page of several runs overlaid: a table of what each ran and got, then the curves."""
    figures.require_plotly()
    header = [
        "run",
        "precision",
        "optimizer",
        "checkpointing",
        "batch",
        "final loss",
        "tokens/s",
        "peak memory",
        "OOM",
        "fallbacks",
    ]
    rows = []
    for run in runs:
        facts = run.facts
        last = run.steps[-1] if run.steps else {}
        series = figures.memory_series(run)
        peak = f"{format_bytes(max(series[0][2]))} ({series[0][0]})" if series else "-"
        rows.append(
            (
                run.name,
                facts.get("precision", "-"),
                facts.get("optimizer", "-"),
                facts.get("gradient_checkpointing", "-"),
                f"{last.get('micro_batch_size', '?')} x {last.get('gradient_accumulation_steps', '?')}",
                _number(run.final_loss),
                _number(run.typical_tokens_per_second()),
                peak,
                len(run.oom_events),
                "; ".join(f"{k}: {v}" for k, v in fallbacks_and_choices(run)[0].items()) or "none",
            )
        )
    body = [
        "<h2>Runs</h2>",
        _table(header, rows, numeric=[5, 6, 7, 8]),
        '<div class="sub">Sources: ' + ", ".join(f"{_e(run.name)} = {_e(run.source)}" for run in runs) + "</div>",
        '<h2>Over the steps</h2><div class="sub">Click a run in the legend to hide it; hover for values, drag to zoom.</div>',
        _chart(compare.compare_figure(runs), "compare"),
    ]
    breakdown = compare.compare_breakdown_figure(runs)
    if breakdown is not None:
        body += ["<h2>Memory at the peak, by category</h2>", _chart(breakdown, "compare-breakdown")]
    title = f"memfit compare: {len(runs)} runs"
    return _with_size(_page(title, " vs ".join(run.name for run in runs), "".join(body)))


def write_html(path: str | Path, page: str) -> Path:
    """Write a page atomically (a reader never sees half a report)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_text(page, encoding="utf-8")
    os.replace(temporary, path)
    return path
