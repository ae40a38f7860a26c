"""Techniques benchmark: each memory technique alone, then stacked, through the real `memfit` CLI.

    python benchmarks/bench_techniques.py                            # ~23M Llama, seq 1024, 2 samples a step (~7 min on 2 free CPU cores, 18 on a busy pair)
    python benchmarks/bench_techniques.py --out docs/benchmarks.md   # also write the tables into the docs (one subsection per machine)
    python benchmarks/bench_techniques.py --quick                    # toy model, seq 128, three rows: a smoke run in about 35 s
    python benchmarks/bench_techniques.py --only baseline,checkpointing,stack-qlora

Each row is a set of `memfit train` flags on top of a plain baseline (fp32, AdamW, no
checkpointing, the loss over the full logits). The first rows switch on one technique
each; the stacked rows add them one after another, in the order of the usual advice:
mixed precision, gradient checkpointing, an 8-bit optimizer, a smaller micro-batch with
gradient accumulation, LoRA, QLoRA (4-bit base), and last the chunked loss.

Every row runs twice, each time in a fresh process started from the command line:

- `python -m memfit train ...` for speed and process memory: tokens/s is the median of
  memfit's per-step `tokens_per_second` (metrics.jsonl) after the warm-up steps; the
  peak is memfit's own per-step peak from the summary line (CPU: VmHWM, reset at every
  step; CUDA: max allocated), and the process's VmHWM over its whole life (from
  `wait4`, loading and the final save included).
- `python -m memfit profile --json --steps 2 ...` for the live tensor bytes, counted by
  the tracker and split into parameters, gradients, optimizer state, activations and
  other. Two steps, because the optimizer state only exists from the end of the first.

`--quick` runs every command in this script's process instead (one after another, through memfit's own `main`),
so torch is imported once; its "process peak RSS" is then the highest so far.

What ran instead of what was asked (no bitsandbytes, offload on a CPU, ...) is read from
the `fallbacks` field of the metrics' summary line and shown in the table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    MODEL_SHAPES,
    default_label,
    environment,
    machine_description,
    markdown_table,
    resolve_device,
    save_model,
    today,
    write_section,
)

SECTION = "Techniques, one by one and stacked"
MIB = 1024**2
SEED = 0

# The baseline every row starts from: memfit's settings with every memory technique off.
BASELINE: dict[str, Any] = {
    "precision": "fp32",
    "optimizer": "adamw",
    "gradient_checkpointing": "off",
    "loss_chunk_size": 0,
    "seed": SEED,
}

# (name, label, flags on top of the baseline): one technique each.
SINGLE_ROWS: list[tuple[str, str, dict[str, Any]]] = [
    ("baseline", "baseline (fp32, AdamW, no checkpointing, full logits)", {}),
    ("amp", "`--precision amp` (bf16 autocast)", {"precision": "amp"}),
    ("checkpointing", "`--gradient-checkpointing full`", {"gradient_checkpointing": "full"}),
    ("8bit", "`--optimizer adamw-8bit`", {"optimizer": "adamw-8bit"}),
    ("accumulation", "micro-batch halved, `--gradient-accumulation-steps 2`", {"accumulation": 2}),
    ("chunked-loss", "`--loss-chunk-size 512`", {"loss_chunk_size": 512}),
    ("selective", "`--gradient-checkpointing selective`", {"gradient_checkpointing": "selective"}),
    (
        "optimizer-in-backward",
        "`--optimizer-in-backward --max-grad-norm 0`",
        {"optimizer_in_backward": True, "max_grad_norm": 0},
    ),
    (
        "offload",
        "`--activation-offload --optimizer-offload --max-grad-norm 0`",
        {"activation_offload": True, "optimizer_offload": True, "max_grad_norm": 0},
    ),
]

# (name, label, flags added to the previous stacked row).
STACK_STEPS: list[tuple[str, str, dict[str, Any]]] = [
    (
        "stack-checkpointing",
        "stacked: `--precision amp --gradient-checkpointing full`",
        {"precision": "amp", "gradient_checkpointing": "full"},
    ),
    ("stack-8bit", "stacked: + `--optimizer adamw-8bit`", {"optimizer": "adamw-8bit"}),
    ("stack-accumulation", "stacked: + micro-batch halved, accumulation 2", {"accumulation": 2}),
    ("stack-lora", "stacked: + `--lora-r 16`", {"lora_r": 16, "lora_alpha": 32}),
    ("stack-qlora", "stacked: + `--quantize 4bit` (QLoRA)", {"quantize": "4bit"}),
    ("stack-chunked-loss", "stacked: + `--loss-chunk-size 512`", {"loss_chunk_size": 512}),
]

QUICK_ROWS = ("baseline", "offload", "stack-qlora")


def all_rows() -> list[tuple[str, str, dict[str, Any]]]:
    """The single rows, then the stacked rows with their flags accumulated."""
    rows = list(SINGLE_ROWS)
    stacked: dict[str, Any] = {}
    for name, label, flags in STACK_STEPS:
        stacked = {**stacked, **flags}
        rows.append((name, label, dict(stacked)))
    return rows


ROW_NAMES = [row[0] for row in all_rows()]


# ---------------------------------------------------------------------------
# One row: a train run and a profile run, each a fresh `python -m memfit` process
# ---------------------------------------------------------------------------


def memfit_flags(args: argparse.Namespace, model_dir: Path, cache_dir: Path, row_flags: dict[str, Any]) -> list[str]:
    """The command-line flags of a row: the baseline, the row's techniques, the run's shape."""
    settings = {**BASELINE, **row_flags}
    accumulation = settings.pop("accumulation", 1)
    # The same samples per optimizer step in every row: accumulation splits them into smaller micro-batches.
    settings["batch_size"] = max(1, args.batch_size // accumulation)
    settings["gradient_accumulation_steps"] = accumulation
    settings |= {"model": str(model_dir), "seq_len": args.seq_len, "cache_dir": str(cache_dir)}
    return [
        f"--{name.replace('_', '-')}={str(value).lower() if isinstance(value, bool) else value}"
        for name, value in settings.items()
    ]


def run_measured(command: list[str], log_path: Path, env: dict[str, str], timeout: float) -> tuple[int, int, str]:
    """Run `command`; return its exit code, its peak RSS over its whole life (bytes, from wait4) and its stdout."""
    with open(log_path, "w") as stderr, tempfile.TemporaryFile("w+") as stdout:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, env={**os.environ, **env})
        deadline = time.monotonic() + timeout
        while True:
            pid, status, usage = os.wait4(process.pid, os.WNOHANG)
            if pid:
                break
            if time.monotonic() > deadline:
                process.kill()
                pid, status, usage = os.wait4(process.pid, 0)
                break
            time.sleep(0.2)
        process.returncode = os.waitstatus_to_exitcode(status)  # reaped here, so that Popen does not wait again
        stdout.seek(0)
        return process.returncode, usage.ru_maxrss * 1024, stdout.read()  # ru_maxrss is in KiB on Linux


def run_here(args: list[str], stdout_path: str, stderr_path: str) -> tuple[int, int]:
    """`memfit ARGS` through memfit's own `main` in this process, fds 1 and 2 in files; its exit code and the
    process's peak RSS so far (bytes)."""
    import resource

    from memfit.cli.main import main as memfit_main

    with open(stdout_path, "w") as out, open(stderr_path, "w") as err:
        sys.stdout.flush()
        sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            code = memfit_main(args)
        except SystemExit as exit_:
            code = exit_.code if isinstance(exit_.code, int) else 1
        except BaseException:  # reported through the log, as a failed process would
            import traceback

            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
    return code or 0, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def run_in_this_process(command: list[str], log_path: Path, env: dict[str, str], timeout: float) -> tuple[int, int, str]:
    """--quick's stand-in for run_measured: the memfit command through memfit's own main in this script's process
    (torch is imported once), its environment set around it; the same exit code and stdout, the process's peak RSS
    so far. `timeout` is run_measured's: a command here runs to its end."""
    assert command[1:3] == ["-m", "memfit"], command
    out_path = log_path.with_suffix(".stdout")
    variables = {name: value for name, value in env.items() if name != "PYTHONPATH"}  # memfit is imported already
    with environment(variables):
        code, peak = run_here(command[3:], str(out_path), str(log_path))
    return code, peak, out_path.read_text()


def failure(what: str, code: int, log_path: Path) -> RuntimeError:
    tail = "\n".join(log_path.read_text().strip().splitlines()[-15:])
    return RuntimeError(f"{what} failed (exit {code}):\n{tail}")


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The per-step records and the summary line of a metrics.jsonl."""
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    steps = [r for r in records if "event" not in r and "step" in r]
    summary = next(r for r in records if r.get("event") == "summary")
    return steps, summary


def run_row(
    args: argparse.Namespace,
    name: str,
    row_flags: dict[str, Any],
    workdir: Path,
    env: dict[str, str],
    run_measured=run_measured,
) -> dict[str, Any]:
    flags = memfit_flags(args, workdir / "model", workdir / "cache", row_flags)
    output_dir = workdir / f"run-{name}"
    train = [
        sys.executable,
        "-m",
        "memfit",
        "train",
        *flags,
        f"--max-steps={args.steps}",
        f"--output-dir={output_dir}",
        "--log-every=1000000",
    ]
    code, process_peak, _ = run_measured(train, workdir / f"{name}-train.log", env, args.timeout)
    if code != 0:
        raise failure(f"{name}: memfit train", code, workdir / f"{name}-train.log")
    steps, summary = read_metrics(output_dir / "metrics.jsonl")
    rates = [float(s["tokens_per_second"]) for s in steps[args.warmup :]]

    profile = [sys.executable, "-m", "memfit", "profile", *flags, f"--steps={args.profile_steps}", "--json", "--top=3"]
    code, _, stdout = run_measured(profile, workdir / f"{name}-profile.log", env, args.timeout)
    if code != 0:
        raise failure(f"{name}: memfit profile", code, workdir / f"{name}-profile.log")
    tracked = json.loads(stdout)
    return {
        "command": "memfit train " + " ".join(f for f in flags if not f.startswith(("--model=", "--cache-dir="))),
        "tokens_per_second": statistics.median(rates) if rates else None,
        "step_rates": rates,
        "peak_bytes": summary.get("peak_memory_bytes"),
        "process_peak_bytes": process_peak,
        "first_loss": steps[0]["loss"],
        "final_loss": summary.get("final_loss"),
        "ran": {
            key: summary.get(key)
            for key in ("precision", "optimizer", "gradient_checkpointing", "loss_chunk_size", "attention")
        },
        "micro_batch_size": summary.get("micro_batch_size"),
        "fallbacks": summary.get("fallbacks") or {},
        "tracked_peak_bytes": tracked["peak_bytes"],
        "tracked_breakdown": tracked["breakdown"],
        "tracked_peak_phase": tracked.get("peak_phase"),
        "tracked_activation_peak_bytes": tracked.get("activation_peak_bytes"),
        "tracked_step_peak_bytes": tracked.get("step_peak_bytes"),
    }


# ---------------------------------------------------------------------------
# Driver and report
# ---------------------------------------------------------------------------


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps of each train run (default 4)")
    parser.add_argument("--warmup", type=int, default=1, help="first steps left out of tokens/s (default 1)")
    parser.add_argument("--profile-steps", type=int, default=2, help="steps of each tracked profile run (default 2)")
    parser.add_argument("--batch-size", type=int, default=2, help="samples per optimizer step (default 2)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per sample (default 1024)")
    parser.add_argument(
        "--quick", action="store_true", help="toy model, seq-len 128, 2 steps, rows " + ",".join(QUICK_ROWS)
    )
    parser.add_argument("--only", help="comma-separated rows to run (default all): " + ", ".join(ROW_NAMES))
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="auto: cuda when present")
    parser.add_argument("--out", help="markdown file to write the results into (e.g. docs/benchmarks.md)")
    parser.add_argument("--label", help="title of this run's subsection in --out (default: 'CPU, N cores' or the GPU)")
    parser.add_argument("--json", help="also write the raw results of every row to this JSON file")
    parser.add_argument(
        "--timeout", type=float, default=900, help="seconds allowed for one memfit process (default 900)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.warmup, args.seq_len = min(args.steps, 2), 1, 128
        args.only = args.only or ",".join(QUICK_ROWS)
    if args.warmup >= args.steps:
        parser.error(f"--warmup ({args.warmup}) must be smaller than --steps ({args.steps})")
    unknown = set(args.only.split(",")) - set(ROW_NAMES) if args.only else set()
    if unknown:
        parser.error(f"unknown rows {', '.join(sorted(unknown))}; known: {', '.join(ROW_NAMES)}")
    return args


def ratio(value: float | None, reference: float | None) -> str:
    return f"{value / reference:.2f}" if value and reference else "-"


def mib(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value / MIB:.0f}" if value >= 100 * MIB else f"{value / MIB:.1f}"


def fallback_note(result: dict[str, Any]) -> str:
    """What ran instead of what the row asked for, from the metrics' `fallbacks`."""
    return "; ".join(f"{technique}: {note}" for technique, note in result["fallbacks"].items()) or "-"


def report(
    args: argparse.Namespace, device: str, results: dict[str, dict], parameters: int, command: str, loads: list[str]
) -> str:
    shape = MODEL_SHAPES["quick" if args.quick else "20m"]
    base = results.get("baseline", {})
    peak_name = "peak allocated, steps (MiB)" if device == "cuda" else "peak RSS, steps (MiB)"
    speed_rows, tracked_rows = [], []
    for name, label, _ in all_rows():
        if name not in results:
            continue
        r = results[name]
        speed_rows.append(
            [
                label,
                f"{r['tokens_per_second']:.0f}" if r["tokens_per_second"] else "-",
                ratio(r["tokens_per_second"], base.get("tokens_per_second")),
                mib(r["peak_bytes"]),
                ratio(r["peak_bytes"], base.get("peak_bytes")),
                mib(r["process_peak_bytes"]),
                mib(r["tracked_peak_bytes"]),
                ratio(r["tracked_peak_bytes"], base.get("tracked_peak_bytes")),
                f"{r['first_loss']:.4f}",
                fallback_note(r),
            ]
        )
        breakdown = r["tracked_breakdown"]
        tracked_rows.append(
            [
                label,
                *(
                    mib(breakdown.get(c))
                    for c in ("parameters", "gradients", "optimizer_states", "activations", "other")
                ),
                mib(r["tracked_peak_bytes"]),
                str(r["tracked_peak_phase"]),
            ]
        )
    speed = markdown_table(
        [
            "row",
            "tokens/s",
            "vs base",
            peak_name,
            "vs base",
            "process peak RSS (MiB)",
            "tracked peak (MiB)",
            "vs base",
            "loss at step 1",
            "ran instead",
        ],
        speed_rows,
    )
    tracked = markdown_table(
        ["row", "parameters", "gradients", "optimizer state", "activations", "other", "tracked peak", "phase"],
        tracked_rows,
    )
    lines = [
        f"Model: Llama-shaped, {parameters / 1e6:.1f}M parameters ({shape['num_hidden_layers']} blocks of width"
        f" {shape['hidden_size']}, MLP {shape['intermediate_size']}, vocabulary {shape['vocab_size']}, tied embeddings),"
        f" saved once and loaded by every run. Data: the bundled corpus, windows of {args.seq_len} tokens,"
        f" {args.batch_size} samples per optimizer step (rows with accumulation: micro-batch"
        f" {max(1, args.batch_size // 2)} x 2). Train runs: {args.steps} steps, tokens/s the median of memfit's"
        f" per-step figure after {args.warmup} warm-up step(s). Tracked runs: `memfit profile --json --steps"
        f" {args.profile_steps}` with the same flags."
        + (" --quick: every command in one process, its process peak RSS the highest so far." if args.quick else ""),
        "",
        speed,
        "",
        "Tracked live tensors at the peak (MiB), by category:",
        "",
        tracked,
        "",
        f"Command: `{command}`",
        "",
        f"Machine: {machine_description(device)}; load average (1 min) {loads[0]} at the start, {loads[1]} at the end",
        "",
        f"Date: {today()}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = resolve_device(args.device)
    env = {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}
    env |= {
        "TOKENIZERS_PARALLELISM": "false",
        "PYTHONPATH": os.pathsep.join(
            filter(None, [str(Path(__file__).resolve().parents[1] / "src"), os.environ.get("PYTHONPATH")])
        ),
    }
    wanted = set(args.only.split(",")) if args.only else set(ROW_NAMES)
    rows = [row for row in all_rows() if row[0] in wanted]
    loads = [f"{os.getloadavg()[0]:.1f}"]
    started = time.perf_counter()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="memfit-bench-techniques-") as name:
        workdir = Path(name)
        parameters = save_model(workdir / "model", "quick" if args.quick else "20m", SEED)
        runner = run_in_this_process if args.quick else run_measured
        for number, (row, _, flags) in enumerate(rows, 1):
            row_started = time.perf_counter()
            results[row] = result = run_row(args, row, flags, workdir, env, runner)
            if args.json:  # kept up to date, so an interrupted run leaves what it measured
                Path(args.json).write_text(json.dumps(results, indent=1))
            print(
                f"[{number}/{len(rows)}] {row}: {result['tokens_per_second'] or 0:.0f} tokens/s, peak"
                f" {mib(result['peak_bytes'])} MiB, tracked {mib(result['tracked_peak_bytes'])} MiB"
                f" ({time.perf_counter() - row_started:.0f} s)",
                file=sys.stderr,
            )
    loads.append(f"{os.getloadavg()[0]:.1f}")
    command = "python benchmarks/bench_techniques.py " + " ".join(sys.argv[1:] if argv is None else argv)
    body = report(args, device, results, parameters, command.strip(), loads)
    print(body)
    print(f"\n(benchmark took {time.perf_counter() - started:.0f} s)", file=sys.stderr)
    if args.out:
        write_section(args.out, SECTION, body, args.label or default_label(device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
