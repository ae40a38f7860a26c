"""Tokens/s of a training step from two source trees, alternated in one run, and their ratio.

A refactoring must not slow training down. This script trains the same small job with `memfit train` from two
source trees, a base (before) and a head (after), alternating them A B A B ... for `--rounds` rounds, each run in
a fresh Python process with PYTHONPATH set to its tree. It reports each tree's median steady-state tokens/s and
the ratio head / base (above 1: the head is faster), with the machine's CPU, the date and the load average.

    python benchmarks/step_speed_ab.py --base /tmp/before/src --head src           # 3-4 minutes on 2 CPU cores
    python benchmarks/step_speed_ab.py --base /tmp/before/src --head src --quick   # toy model, under a minute
    python benchmarks/step_speed_ab.py --base /tmp/before/src --head src --json ab.json

The job: the Llama-shaped "20m" model of benchmarks/_common.py (22.9M parameters, a 32000-token vocabulary),
built once with a fixed seed and saved, trained from that directory on the bundled corpus (byte tokens, wrapped
windows) with memfit's defaults: 2 samples of 256 tokens a step, 12 steps of which the first 3 are warm-up.
`--flags` adds training flags to both trees' runs (say, a technique whose path changed). `--quick`: the toy
shape of _common.py (0.1M parameters), samples of 128 tokens, 50 steps (10 warm-up), 2 rounds.

Timing: this script times the steps, not memfit, so that both trees are timed by the same code whatever the head
changed: a global optimizer-step hook of torch (`torch.optim.optimizer.register_optimizer_step_post_hook`) stamps
the end of every optimizer step, and a step's time is the gap between its stamp and the previous one (everything
the loop does between two updates: logging, data, forward, backward, clipping, the update). Start-up, the first
`--warmup` steps and the final save are left out. A run's figure is the median over its steps of tokens / step time; a tree's, the
median over its runs. The ratio is of those medians; the ratio of each round's pair is listed too, since a drift
in the machine's load moves both runs of a round alike. Both trees' last losses and what they say ran are shown:
different losses mean the two trees did not train the same steps, and the ratio compares different work.

Torch runs `--threads` intra-op threads (default 1): on a shared machine one thread is far steadier than two
that compete with other work, and a refactoring's cost is mostly Python on one thread anyway. Timings taken under
a load average above the number of cores are noisy; the report says so.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import runpy
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import MODEL_SHAPES, emit_result, machine_description, run_worker, save_model  # noqa: E402

SEED = 0
# What the run summary says ran: the same in both trees, or the two did not run the same job.
RAN = ("precision", "optimizer", "attention", "gradient_checkpointing", "loss_chunk_size", "kernels", "compile")


# ---------------------------------------------------------------------------
# Worker: one run of `memfit train`, in a fresh process whose PYTHONPATH is one tree
# ---------------------------------------------------------------------------


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Run `python -m memfit train FLAGS` in this process and time its optimizer steps with torch's hook."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    import memfit

    stamps: list[float] = []
    register_optimizer_step_post_hook(lambda *_: stamps.append(time.perf_counter()))
    sys.argv = ["memfit", "train", *spec["flags"]]
    try:
        runpy.run_module("memfit", run_name="__main__", alter_sys=True)
        code: Any = 0
    except SystemExit as stop:
        code = stop.code
    if code not in (0, None):
        raise RuntimeError(f"memfit train exited {code}")
    records = [json.loads(line) for line in (Path(spec["output_dir"]) / "metrics.jsonl").read_text().splitlines()
               if line.strip()]
    steps = [record for record in records if "event" not in record and "step" in record]
    summary = next((record for record in records if record.get("event") == "summary"), {})
    if len(stamps) != len(steps):  # a step the hook did not see (or an extra one): the gaps would not be steps
        raise RuntimeError(f"{len(stamps)} optimizer steps timed, {len(steps)} logged: this script times runs with"
                           " one optimizer step a training step (not --optimizer-in-backward's one per parameter)")
    rates = [steps[k]["tokens"] / (stamps[k] - stamps[k - 1]) for k in range(max(spec["warmup"], 1), len(stamps))]
    return {
        "memfit": str(Path(memfit.__file__).parent),
        "tokens_per_second": statistics.median(rates),
        "step_rates": rates,
        # memfit's own figure, for reference only: the head may measure it differently
        "memfit_tokens_per_second": statistics.median(s["tokens_per_second"] for s in steps[spec["warmup"]:]),
        "last_loss": steps[-1]["loss"],
        "ran": {key: summary.get(key) for key in RAN},
    }


# ---------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, help="source tree of the 'before' state (its src/ directory)")
    parser.add_argument("--head", type=Path, default=Path(__file__).resolve().parent.parent / "src",
                        help="source tree of the 'after' state (default: this checkout's src/)")
    parser.add_argument("--rounds", type=int, help="base-head pairs of runs (default 3; --quick 2)")
    parser.add_argument("--steps", type=int, help="optimizer steps per run (default 12; --quick 50)")
    parser.add_argument("--warmup", type=int, help="first steps left out (default 3; --quick 10)")
    parser.add_argument("--seq-len", type=int, help="tokens per sample (default 256; --quick 128)")
    parser.add_argument("--batch-size", type=int, default=2, help="samples per step (default 2)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1; 0: torch's own)")
    parser.add_argument("--flags", default="", help="more `memfit train` flags for both trees, one string")
    parser.add_argument("--quick", action="store_true",
                        help="toy model (0.1M parameters), shorter samples, 2 rounds: under a minute")
    parser.add_argument("--json", type=Path, help="also write the figures of every run to this JSON file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return args
    if args.base is None:
        parser.error("--base is required")
    for tree in (args.base, args.head):
        if not (tree / "memfit" / "__init__.py").is_file():
            parser.error(f"{tree}: no memfit package there (give the src/ directory of a checkout)")
    quick = args.quick
    args.shape = "quick" if quick else "20m"
    args.rounds = args.rounds or (2 if quick else 3)
    args.steps = args.steps or (50 if quick else 12)
    args.warmup = args.warmup if args.warmup is not None else (10 if quick else 3)
    args.seq_len = args.seq_len or (128 if quick else 256)
    if args.warmup >= args.steps - 1:
        parser.error(f"--warmup ({args.warmup}) leaves fewer than 2 of --steps ({args.steps}) to time")
    return args


def train_flags(args: argparse.Namespace, model_dir: Path, output_dir: Path, cache_dir: Path) -> list[str]:
    return ["--model", str(model_dir), "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
            "--max-steps", str(args.steps), "--seed", str(SEED), "--output-dir", str(output_dir),
            "--cache-dir", str(cache_dir), "--log-every", "1000000",
            # Nothing around the steps that one tree might do and the other not: no report, no tracked step.
            "--no-report", "--no-track-memory", "--no-disk-check", *args.flags.split()]


def run_rounds(args: argparse.Namespace, workdir: Path) -> tuple[list[dict[str, Any]], int]:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    model_dir = workdir / "model"
    parameters = save_model(model_dir, args.shape, SEED)
    trees = {"base": args.base.resolve(), "head": args.head.resolve()}
    runs = []
    for number in range(1, args.rounds + 1):
        for side, tree in trees.items():  # A B A B ...: both trees see the same drift in the machine's load
            env = {"PYTHONPATH": str(tree), "CUDA_VISIBLE_DEVICES": "", "TOKENIZERS_PARALLELISM": "false",
                   "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                   # memfit's own caches (the matmul probe's rating, say) under the run, not shared between trees
                   "MEMFIT_CACHE_DIR": str(workdir / f"memfit-cache-{side}")}
            if args.threads > 0:
                env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads))
            # Each tree tokenizes the corpus once, into a cache of its own (its cache format is its own business).
            spec = {"name": f"{side} round {number}", "warmup": args.warmup,
                    "output_dir": str(workdir / f"run-{number}-{side}"),
                    "flags": train_flags(args, model_dir, workdir / f"run-{number}-{side}",
                                         workdir / f"tokens-{side}")}
            started = time.monotonic()
            result = run_worker(__file__, spec, env=env)
            result.update(side=side, round=number, tree=str(tree), seconds=time.monotonic() - started,
                          load_average=os.getloadavg()[0])
            if Path(result["memfit"]).resolve() != tree / "memfit":
                raise RuntimeError(f"the {side} run imported memfit from {result['memfit']}, not from {tree}")
            runs.append(result)
            print(f"[{len(runs)}/{2 * args.rounds}] {side}: {result['tokens_per_second']:.0f} tokens/s,"
                  f" last loss {result['last_loss']:.6f} ({result['seconds']:.0f} s,"
                  f" load average {result['load_average']:.1f})", file=sys.stderr, flush=True)
            if args.json:  # kept up to date, so an interrupted run leaves what it measured
                args.json.write_text(json.dumps({"runs": runs}, indent=1))
    return runs, parameters


def summarize(args: argparse.Namespace, runs: list[dict[str, Any]], parameters: int, load_at_start: float,
              seconds: float) -> dict[str, Any]:
    sides = {side: [run for run in runs if run["side"] == side] for side in ("base", "head")}
    medians = {side: statistics.median(run["tokens_per_second"] for run in chosen) for side, chosen in sides.items()}
    pairs = [head["tokens_per_second"] / base["tokens_per_second"]
             for base, head in zip(sides["base"], sides["head"], strict=True)]
    shape = MODEL_SHAPES[args.shape]
    return {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": machine_description("cpu"),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "load_average": {"start": load_at_start, "end": os.getloadavg()[0],
                         "max_after_a_run": max(run["load_average"] for run in runs)},
        "job": {"model": f"Llama-shaped '{args.shape}': {parameters / 1e6:.1f}M parameters,"
                         f" {shape['num_hidden_layers']} blocks of width {shape['hidden_size']},"
                         f" vocabulary {shape['vocab_size']}",
                "seq_len": args.seq_len, "batch_size": args.batch_size, "steps": args.steps,
                "warmup": args.warmup, "threads": args.threads or "torch's default", "flags": args.flags},
        "rounds": args.rounds,
        "base": {"tree": str(args.base.resolve()), "tokens_per_second": medians["base"],
                 "runs": [run["tokens_per_second"] for run in sides["base"]]},
        "head": {"tree": str(args.head.resolve()), "tokens_per_second": medians["head"],
                 "runs": [run["tokens_per_second"] for run in sides["head"]]},
        "ratio": medians["head"] / medians["base"],
        "round_ratios": pairs,
        "same_losses": len({run["last_loss"] for run in runs}) == 1,
        "same_settings": len({json.dumps(run["ran"], sort_keys=True) for run in runs}) == 1,
        "seconds": seconds,
        "runs": runs,
    }


def report(summary: dict[str, Any]) -> str:
    job, load = summary["job"], summary["load_average"]
    runs = summary["runs"]
    losses = {side: sorted({run["last_loss"] for run in runs if run["side"] == side}) for side in ("base", "head")}
    lines = [
        f"Step speed, base vs head: {job['model']}; {job['batch_size']} x {job['seq_len']} tokens a step,"
        f" {job['steps']} steps of which the first {job['warmup']} are left out; threads: {job['threads']}"
        + (f"; flags: {job['flags']}" if job["flags"] else ""),
        "",
    ]
    for side in ("base", "head"):
        figures = summary[side]
        lines.append(f"  {side}  {figures['tokens_per_second']:8.1f} tokens/s (median of"
                     f" {', '.join(f'{rate:.1f}' for rate in figures['runs'])})  {figures['tree']}")
    lines += [
        f"  head / base: {summary['ratio']:.3f} (each round: {', '.join(f'{r:.3f}' for r in summary['round_ratios'])})",
        "  last loss: " + ("the same in every run: " + f"{runs[0]['last_loss']:.6f}" if summary["same_losses"] else
                           f"DIFFERENT: base {losses['base']}, head {losses['head']} (the trees trained different steps)"),
    ]
    if not summary["same_settings"]:
        lines.append("  what ran DIFFERS: " + "; ".join(f"{run['side']}: {run['ran']}" for run in runs[:2]))
    busy = load["max_after_a_run"] > summary["cores"]
    lines += [
        "",
        f"Machine: {summary['machine']}",
        f"Load average (1 minute): {load['start']:.2f} at the start, {load['end']:.2f} at the end, at most"
        f" {load['max_after_a_run']:.2f} after a run" + (f" (above the {summary['cores']} cores: noisy)" if busy else ""),
        f"Date: {summary['date']}; {summary['rounds']} rounds in {summary['seconds']:.0f} s",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        emit_result(worker(json.loads(args.worker)))
        return 0
    started, load_at_start = time.monotonic(), os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="memfit-speed-ab-") as workdir:
        runs, parameters = run_rounds(args, Path(workdir))
    summary = summarize(args, runs, parameters, load_at_start, time.monotonic() - started)
    print(report(summary))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
