"""The screenshot of an HTML run report shown in the README and docs/report.md.

Trains the built-in tiny model with the tracker on, under an emulated memory cap that
makes the first micro-batch split (OOMs recovered); removes the checkpoints after 2/3 of
the steps, as if the run had died there, and resumes to the end; then opens the report.html that `memfit train` wrote in headless Chromium and saves a
PNG of its top part. Prints the commands, the machine, the date and the load, to be
named beside the picture.

    python benchmarks/make_report_screenshot.py --out docs/report-screenshot.png

About 3 minutes on 2 busy CPU cores; needs plotly and a Chromium binary.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_description, today  # noqa: E402

COMMON = ["--model", "tiny", "--seq-len", "128", "--batch-size", "8", "--loss-chunk-size", "0", "--track-memory"]


def memfit(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "memfit", *args]
    print("$ memfit " + " ".join(shlex.quote(arg) for arg in args), flush=True)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"memfit failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/report-screenshot.png", help="where to write the PNG")
    parser.add_argument("--run-dir", default=None, help="output directory of the run (default: a temporary one)")
    parser.add_argument("--steps", type=int, default=18, help="optimizer steps in all (the run resumes at 2/3)")
    parser.add_argument("--height", type=int, default=2100, help="pixels of the page to keep, from the top")
    args = parser.parse_args()

    from memfit.reporting.browser import check_page, find_chromium

    if find_chromium() is None:
        sys.exit("no Chromium binary: apt-get install chromium")
    run_dir = Path(args.run_dir or tempfile.mkdtemp(prefix="memfit-report-"))
    probe = run_dir / "probe"
    memfit("train", *COMMON, "--max-steps", "1", "--no-report", "--output-dir", str(probe))
    summary = json.loads((probe / "metrics.jsonl").read_text().splitlines()[-1])
    breakdown = summary["tracked_breakdown"]
    state = breakdown["parameters"] + breakdown["gradients"] + breakdown["optimizer_states"]
    # Room for state and 3/4 of the first step's compute: a micro-batch of 8 does not fit, 4 does.
    cap = state + (summary["tracked_peak_bytes"] - state) * 3 // 4
    run = run_dir / "run"
    capped = [*COMMON, "--memory-cap", str(cap), "--max-steps", str(args.steps), "--output-dir", str(run)]
    memfit("train", *capped, "--save-every", str(max(1, args.steps // 3)))
    # As if the run had died after its checkpoint at 2/3: the later checkpoint goes, the metrics stay.
    kept = max(1, args.steps // 3) * 2
    for checkpoint in (run / "checkpoints").glob("step-*"):
        if int(checkpoint.name.split("-")[1]) > kept:
            shutil.rmtree(checkpoint)
    memfit("train", *capped, "--resume", "auto")

    check = check_page(run / "report.html", max_screenshot_height=args.height)
    if check.console_errors or check.blocked_requests:
        sys.exit(f"the report misbehaved: errors {check.console_errors}, blocked requests {check.blocked_requests}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(check.screenshot)
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    size = (run / "report.html").stat().st_size
    print(f"wrote {out} ({len(check.screenshot) // 1024} KiB) from {run / 'report.html'} ({size / 1024**2:.2f} MiB)")
    print(f"machine: {machine_description('cpu')}")
    print(f"date: {today()}; load average (1, 5, 15 min): {load}; memory cap {cap} bytes")


if __name__ == "__main__":
    main()
