"""Is the planner's speed model right about order? Predicted vs measured tokens/s over a grid.

    python benchmarks/bench_speed_ranking.py                            # 20M Llama, seq 256, 14 configurations x 2 passes
    python benchmarks/bench_speed_ranking.py --out docs/benchmarks.md   # also write the section into the docs
    python benchmarks/bench_speed_ranking.py --quick                    # toy model: a smoke run

The grid is what `memfit plan` searches on one device: gradient checkpointing (off,
selective, full) x chunked loss (off, 1024 tokens) x micro-batch (1 or 4 samples, with
accumulation keeping 4 samples per step), plus 8-bit AdamW on two of them. For each
configuration the planner's `estimated_step_seconds` gives a predicted step time (so a
predicted tokens/s), and memfit trains it for a few steps: the measured tokens/s is the
median of the metrics' per-step figure after warm-up. Every configuration runs between two
runs of the reference configuration (the first of the grid) and counts as its ratio to
their mean, so a load that drifts on a shared machine cancels; the grid runs twice, the
second time in reverse order, and each ratio is the median of its passes.

Reported: Spearman's rank correlation between predicted and measured tokens/s (1: the
same order), the table, and the pairs the model orders wrongly by more than the noise.
With `--compile`, the plain baseline is also run with `--compile` and the speed ratio is
reported (torch.compile's gain, which the planner does not model).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    MODEL_SHAPES,
    default_label,
    machine_description,
    markdown_table,
    median,
    save_model,
    today,
    write_section,
)

SECTION = "Speed model: predicted against measured order"
EFFECTIVE_BATCH = 4


def grid() -> list[dict[str, Any]]:
    configurations = []
    for checkpointing in ("off", "selective", "full"):
        for chunk in (0, 1024):
            for micro in (4, 1):
                configurations.append(
                    {"gradient_checkpointing": checkpointing, "loss_chunk_size": chunk, "batch_size": micro}
                )
    for checkpointing in ("off", "full"):
        configurations.append(
            {"gradient_checkpointing": checkpointing, "loss_chunk_size": 0, "batch_size": 4, "optimizer": "adamw-8bit"}
        )
    return configurations


def label_of(changes: dict[str, Any]) -> str:
    parts = [f"checkpointing {changes['gradient_checkpointing']}"]
    parts.append(f"chunked loss {changes['loss_chunk_size']}" if changes["loss_chunk_size"] else "full logits")
    parts.append(f"micro-batch {changes['batch_size']} x {EFFECTIVE_BATCH // changes['batch_size']}")
    if changes.get("optimizer"):
        parts.append(changes["optimizer"])
    if changes.get("compile"):
        parts.append("--compile")
    return ", ".join(parts)


def _config(model_dir: Path, workdir: Path, name: str, changes: dict[str, Any], args: argparse.Namespace):
    from memfit.config_loading import load_config

    overrides = {
        "model": str(model_dir),
        "seq_len": args.seq_len,
        "max_steps": args.steps,
        "seed": 0,
        "precision": "fp32",
        "optimizer": "adamw",
        "output_dir": str(workdir / name),
        "cache_dir": str(workdir / "cache"),
        "log_every": 10**6,
        "report": False,
        **changes,
        "gradient_accumulation_steps": EFFECTIVE_BATCH // changes["batch_size"],
    }
    return load_config(overrides={k: str(v) for k, v in overrides.items()})


def predicted_seconds(config, changes: dict[str, Any]) -> float:
    """The planner's step time for `changes` (no GPU preset: its nominal rate; only the order matters)."""
    from memfit.models.presets import resolve_model_config
    from memfit.prediction.estimator import estimate
    from memfit.prediction.speed_model import estimated_step_seconds

    hf_config = resolve_model_config(config.model.model, False)
    plan_changes = {**changes, "gradient_accumulation_steps": EFFECTIVE_BATCH // changes["batch_size"]}
    plan_changes.setdefault("optimizer", "adamw")
    est = estimate(config, hf_config=hf_config)
    return estimated_step_seconds(plan_changes, config, est, None, hf_config)


def measure(config, warmup: int, clock: str = "wall") -> dict[str, Any]:
    """Train `config`; tokens/s per step after `warmup` from the metrics (wall clock), or with clock="cpu" from
    this process's CPU time between step records (one thread: it leaves out the time other jobs held the cores)."""
    from memfit.train import metrics
    from memfit.train.loop import train
    from memfit.train.metrics import read_metrics

    cpu_stamps: list[float] = []
    original_log = metrics.JsonlLogger.log

    def log(self, record: dict[str, Any]) -> None:  # instrumentation only: CPU time at each step's end
        if record.get("event") == "start" or ("event" not in record and "step" in record):
            cpu_stamps.append(time.process_time())
        original_log(self, record)

    metrics.JsonlLogger.log = log
    started = time.perf_counter()
    try:
        result = train(config)
    finally:
        metrics.JsonlLogger.log = original_log
    records = [r for r in read_metrics(Path(config.output.output_dir) / "metrics.jsonl") if "event" not in r]
    if clock == "cpu":
        rates = [r["tokens"] / max(cpu_stamps[k + 1] - cpu_stamps[k], 1e-9)
                 for k, r in enumerate(records) if k >= warmup and k + 1 < len(cpu_stamps)]
    else:
        rates = [r["tokens_per_second"] for r in records[warmup:]]
    return {
        "tokens_per_second": median(rates),
        "step_rates": rates,
        "mfu": median([r.get("mfu") for r in records[warmup:] if r.get("mfu") is not None]),
        "optimizer": result.summary.get("optimizer"),
        "seconds": time.perf_counter() - started,
    }


def ranks(values: list[float]) -> list[float]:
    """Ranks 1..n, ties sharing their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    result = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            result[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return result


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    mean_a, mean_b = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - mean_a) * (y - mean_b) for x, y in zip(ra, rb, strict=True))
    var_a = sum((x - mean_a) ** 2 for x in ra)
    var_b = sum((y - mean_b) ** 2 for y in rb)
    return cov / (var_a * var_b) ** 0.5 if var_a and var_b else float("nan")


def wrong_pairs(rows: list[dict[str, Any]], noise: float) -> list[str]:
    """Pairs the model orders one way and the measurement the other, by more than `noise` (a fraction)."""
    found = []
    for i, a in enumerate(rows):
        for b in rows[i + 1 :]:
            predicted = a["predicted_tokens_per_second"] / b["predicted_tokens_per_second"]
            measured = a["relative"] / b["relative"]
            if (predicted > 1) != (measured > 1) and abs(measured - 1) > noise and abs(predicted - 1) > 0.01:
                found.append(
                    f"{a['label']} vs {b['label']}: predicted {predicted:.2f}x, measured {measured:.2f}x"
                )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run (default 4)")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of tokens/s (default 1)")
    parser.add_argument("--seq-len", type=int, default=256, help="tokens per sample (default 256)")
    parser.add_argument("--passes", type=int, default=2, help="runs of the grid, alternately reversed (default 2)")
    parser.add_argument("--noise", type=float, default=0.10, help="measured differences below this are ties (0.10)")
    parser.add_argument("--compile", action="store_true", help="also time the baseline with --compile")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall", help="tokens/s by wall clock (the"
                        " metrics' figure) or by this process's CPU time (steadier on a shared machine)")
    parser.add_argument("--quick", action="store_true", help="toy model, seq 64, 2 steps, 1 pass")
    parser.add_argument("--threads", type=int, help="torch threads (default torch's; 1 keeps a crowded machine from"
                        " thrashing)")
    parser.add_argument("--out", help="markdown file to write the section into (e.g. docs/benchmarks.md)")
    parser.add_argument("--json", help="also write the raw results to this JSON file")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.seq_len, args.passes = 2, 1, 64, 1
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")  # this benchmark is about the CPU
    import logging

    logging.getLogger("memfit").setLevel(logging.ERROR)
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    load_start = os.getloadavg()
    shape = "quick" if args.quick else "20m"
    configurations = grid()
    with tempfile.TemporaryDirectory(prefix="memfit-speed-") as tmp:
        workdir = Path(tmp)
        model_dir = workdir / "model"
        parameters = save_model(model_dir, shape)
        measured: dict[int, list[dict]] = {i: [] for i in range(len(configurations))}
        predicted: dict[int, float] = {}
        runs = 0

        def run(i: int, tag: str) -> dict:
            nonlocal runs
            runs += 1
            changes = configurations[i]
            config = _config(model_dir, workdir, f"run-{runs}", changes, args)
            predicted.setdefault(i, predicted_seconds(config, changes))
            result = measure(config, args.warmup, args.clock)
            print(f"[{tag}] {label_of(changes)}: {result['tokens_per_second']:.0f} tokens/s"
                  f" (predicted step {predicted[i]:.3g} s; {result['seconds']:.0f} s)", file=sys.stderr)
            return result

        # Paired design: the reference configuration (index 0) runs before and after every other
        # one, and each is measured as a ratio to the mean of its two neighbours, so a load that
        # drifts over minutes cancels out of the ratios.
        for number in range(args.passes):
            order = list(range(1, len(configurations)))
            if number % 2:
                order.reverse()
            before = run(0, f"pass {number + 1}, reference")
            measured[0].append({**before, "relative": 1.0})
            for i in order:
                result = run(i, f"pass {number + 1}")
                after = run(0, f"pass {number + 1}, reference")
                reference = (before["tokens_per_second"] + after["tokens_per_second"]) / 2
                measured[i].append({**result, "relative": result["tokens_per_second"] / reference})
                measured[0].append({**after, "relative": 1.0})
                before = after
        compile_ratio = None
        if args.compile:
            base = {"gradient_checkpointing": "off", "loss_chunk_size": 0, "batch_size": 4}
            timings = {}
            for compiled in (False, True):
                changes = {**base, "compile": compiled}
                config = _config(model_dir, workdir, f"compile-{compiled}-{len(timings)}", changes, args)
                timings.setdefault(compiled, []).append(measure(config, args.warmup, args.clock)["tokens_per_second"])
            compile_ratio = (median(timings[True]), median(timings[False]))
    load_end = os.getloadavg()

    tokens_per_step = EFFECTIVE_BATCH * args.seq_len
    rows = []
    for i, changes in enumerate(configurations):
        runs = measured[i]
        rows.append({
            "label": label_of(changes),
            "changes": changes,
            "predicted_seconds": predicted[i],
            "predicted_tokens_per_second": tokens_per_step / predicted[i],
            "tokens_per_second": median([r["tokens_per_second"] for r in runs]),
            "relative": median([r["relative"] for r in runs]),
            "per_pass": [r["relative"] for r in runs],
            "spread": [r["tokens_per_second"] for r in runs],
            "mfu": median([r["mfu"] for r in runs if r["mfu"] is not None]),
            "optimizer_ran": runs[0]["optimizer"],
        })
    rho = spearman([r["predicted_tokens_per_second"] for r in rows], [r["relative"] for r in rows])
    wrong = wrong_pairs(rows, args.noise)
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "spearman": rho, "compile": compile_ratio,
                                               "load": [load_start, load_end]}, indent=1))
    reference_predicted = rows[0]["predicted_tokens_per_second"]
    table = markdown_table(
        ["configuration", "predicted vs reference", "measured vs reference", "measured tokens/s", "MFU",
         "ratio per pass"],
        [[r["label"] + ("" if str(r["optimizer_ran"]).startswith(r["changes"].get("optimizer", "adamw")) else
                        f" ({r['optimizer_ran']} ran)"),
          f"{r['predicted_tokens_per_second'] / reference_predicted:.2f}", f"{r['relative']:.2f}",
          f"{r['tokens_per_second']:.0f}", f"{r['mfu']:.4f}" if r["mfu"] is not None else "-",
          (", ".join(f"{v:.2f}" for v in r["per_pass"]) if r is not rows[0] else
           f"{len(r['spread'])} runs, {min(r['spread']):.0f} to {max(r['spread']):.0f} tokens/s")] for r in rows],
    )
    command = "python benchmarks/bench_speed_ranking.py " + " ".join(argv if argv is not None else sys.argv[1:])
    shape_text = MODEL_SHAPES[shape]
    body = [
        f"Model: Llama-shaped, {parameters / 1e6:.1f}M parameters ({shape_text['num_hidden_layers']} blocks of width"
        f" {shape_text['hidden_size']}, vocabulary {shape_text['vocab_size']}), fp32, seq-len {args.seq_len},"
        f" {EFFECTIVE_BATCH} samples per optimizer step, {args.steps} steps per run of which {args.warmup} warm-up,"
        f" {args.passes} passes over the grid (the second reversed); every configuration runs between two runs of"
        " the reference (the first row) and is measured as a ratio to their mean, so a load that drifts cancels;"
        " medians of the passes"
        f"{f'; {args.threads} torch thread(s)' if args.threads else ''}"
        f"{'; tokens/s by CPU time (the process, one thread), not wall clock' if args.clock == 'cpu' else ''}.",
        "",
        f"**Spearman rank correlation, predicted vs measured tokens/s: {rho:.2f}** over {len(rows)} configurations.",
        "",
        table,
        "",
    ]
    if wrong:
        body += [f"Pairs ordered wrongly by more than {args.noise:.0%} of measured speed ({len(wrong)}):", ""]
        body += [f"- {line}" for line in wrong[:12]] + ([f"- ... and {len(wrong) - 12} more"] if len(wrong) > 12 else [])
        body.append("")
    if compile_ratio:
        body += [f"`--compile` on the first configuration (one run each, right after the grid): {compile_ratio[0]:.0f} vs"
                 f" {compile_ratio[1]:.0f} tokens/s, **{compile_ratio[0] / compile_ratio[1]:.2f}x** (compile time is in"
                 " the warm-up steps, outside the figure).", ""]
    body += [
        f"Command: `{command.strip()}`",
        "",
        f"Machine: {machine_description('cpu')}; load average (1 min) {load_start[0]:.1f} at the start,"
        f" {load_end[0]:.1f} at the end",
        "",
        f"Date: {today()}",
    ]
    text = "\n".join(body)
    print(text)
    if args.out:
        write_section(args.out, SECTION, text, subheading=default_label("cpu"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
