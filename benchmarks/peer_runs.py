"""What the benchmarks that run memfit beside a TRL trainer share: the step clock, the run summary, the ladder
reading, the ratio cells and the section's closing lines (bench_preference.py, bench_grpo.py).

Each of those scripts runs every configuration in a fresh process (a worker), reads its figures back, and writes one
section of docs/benchmarks.md; what differs is the job, its settings and the unit of work (pairs, steps).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

from _common import PeakWatch, current_rss_bytes, machine_description, median, today

CPU_ONLY = {"CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false", "HF_DATASETS_DISABLE_PROGRESS_BARS": "1"}
"""A worker's environment: the CPU alone, and no tokenizer threads or progress bars beside the step."""


class Clock:
    """Wall and CPU time at the start and at the end of every step, and the peak at the end of each; made once a
    worker's imports are done, it holds the process's RSS at that moment (`import_rss`) and the CPU peak watch the
    tool's loop reports to (`watch`)."""

    def __init__(self):
        self.import_rss = current_rss_bytes()
        self.watch = PeakWatch("cpu")
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.peak = 0

    def tick(self) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())
        self.peak = self.watch.total()

    def figures(self, unit: str, per_step: int, warmup: int, started: float) -> dict[str, Any]:
        """A worker's figures: `unit`s (steps, pairs) per second and per CPU second, the median over the steps after
        `warmup` (tick 0 is the start of step 1), each step's rate, start-up from `started`, the peak, the import
        RSS and the steps timed."""
        steps = range(warmup + 1, len(self.wall))
        wall = [per_step / max(self.wall[k] - self.wall[k - 1], 1e-9) for k in steps]
        cpu = [per_step / max(self.cpu[k] - self.cpu[k - 1], 1e-9) for k in steps]
        return {
            f"{unit}_per_second": median(wall),
            f"{unit}_per_cpu_second": median(cpu),
            "step_rates": wall,
            "startup_seconds": self.wall[0] - started if self.wall else None,
            "peak_bytes": self.peak,
            "import_rss_bytes": self.import_rss,
            "steps": len(self.wall) - 1,
        }


def summarize(results: dict[str, list[dict]], rates: tuple[str, ...], **extra: Any) -> dict[str, dict[str, Any]]:
    """The median of each configuration's runs: its `rates` (the workers' keys), peak, start-up and import RSS, the
    largest load average, and `extra` (name -> function of the runs, for what only one benchmark reports)."""
    summary = {}
    for name, runs in results.items():
        if not runs:
            continue
        summary[name] = {
            **{rate: median([r[rate] for r in runs]) for rate in rates},
            "peak_bytes": median([r["peak_bytes"] for r in runs]),
            "startup_seconds": median([r["startup_seconds"] for r in runs]),
            "import_rss_bytes": median([r["import_rss_bytes"] for r in runs]),
            **{key: read(runs) for key, read in extra.items()},
            "load_average": max(r["load_average"] for r in runs),
            "runs": len(runs),
            "ran": runs[0]["ran"],
        }
    return summary


def save_json(args: argparse.Namespace, content: dict[str, Any]) -> None:
    """Kept up to date as runs end, so an interrupted run leaves what it measured."""
    if not args.json:
        return
    path = Path(args.json)
    existing = json.loads(path.read_text()) if path.exists() else {}
    path.write_text(json.dumps({**existing, **content}, indent=1))


def ratio(value: float | None, reference: float | None) -> str:
    return f"{value / reference:.2f}" if value and reference else "-"


def longest_of(entries: list[dict], cap: int) -> tuple[int | None, float | None, str]:
    """The longest fitting ladder length, the interpolated estimate (None when there is no length over the cap
    to interpolate to) and the estimate as text."""
    fitting = [e for e in entries if e["fits"]]
    best = fitting[-1]["length"] if fitting else None
    over = next((e for e in entries if not e["fits"]), None)
    if over is None:
        return best, None, f">= {best} (the whole ladder fits)" if best else "-"
    if best is None:
        return None, None, f"< {over['length']} (the shortest length is over)"
    low, high = fitting[-1], over
    if not high["completed"] or high["peak_bytes"] <= low["peak_bytes"]:
        return best, None, f"{best} to {high['length']}"
    estimate = low["length"] + (cap - low["peak_bytes"]) * (high["length"] - low["length"]) / (
        high["peak_bytes"] - low["peak_bytes"])
    return best, estimate, f"about {estimate:.0f}"


def what_ran(summary: dict[str, dict[str, Any]], configurations: list[tuple]) -> str:
    """One line: each configuration's techniques as its tool reports them."""
    return "What ran, as each tool reports it: " + "; ".join(
        f"{name}: " + ", ".join(f"{k} {v}" for k, v in summary[name]["ran"].items() if v is not None)
        for name, *_ in configurations if name in summary) + "."


def provenance(command: str, load_start: tuple[float, float, float]) -> list[str]:
    """The section's closing lines: the command, the machine, the date and the load at its start and end."""
    return [
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {machine_description('cpu')}",
        "",
        f"Date: {today()}; load average (1, 5, 15 min) at the start {', '.join(f'{x:.2f}' for x in load_start)},"
        f" at the end {', '.join(f'{x:.2f}' for x in os.getloadavg())}",
    ]
