"""Offloaded checkpoints on a GPU: step time with and without offload, measured beside the speed model.

    python benchmarks/bench_offload_overlap.py --out docs/benchmarks.md            # Llama-3.2-1B, seq 4096, batch 1 and 2
    python benchmarks/bench_offload_overlap.py --models llama-3.2-1b,llama-3.2-3b --out docs/benchmarks.md
    python benchmarks/bench_offload_overlap.py --device cpu --models tiny --seq-len 256 --batch-sizes 1 --steps 3

Each row trains `--steps` optimizer steps of a preset (random weights of the real shape, byte tokens,
bf16 weights and compute, full checkpointing: the "full checkpointing" and "offloaded checkpoints"
settings of bench_gpu_estimates.py) in a fresh process, through memfit's own step
(`_common.timed_steps`), and reports the median step seconds after `--warmup` steps, tokens/s,
`torch.cuda.max_memory_allocated` and the process's peak RSS (pinned host buffers included) over
the steps. The rows of one model and batch:

- checkpointing only;
- `--activation-offload`: each block's input goes to pinned host memory on a side stream in forward
  and comes back one block ahead in backward (memfit.techniques.offload);
- the same offload with its prefetch off (`ActivationOffload(prefetch=False)`, the class's own
  argument; memfit has no flag for it): each input is fetched on the compute stream when backward
  needs it, which shows what the prefetch buys.

Beside each row: the ratio to the checkpointing-only row (goal: under 1.10 where the link keeps
up), the bytes the offload moved per micro-batch (counted by the offload context) against the
estimate's `pcie_bytes_per_micro_batch` (out in forward + back in backward), and two predicted step
times: the planner's (`memfit.prediction.speed_model.estimated_step_seconds` with this GPU's
preset, the figure `memfit plan` ranks by: it adds the offload's bytes in full at the preset's host
link rate, an upper bound) and the run's own (`predicted_step_seconds` of the metrics, the
planner's model at this device's peak, as `memfit train` logs it; GPU only). "Link keeps up" is the
estimate's verdict: each direction's half of the bytes crosses the link (at the preset's rate) in
less time than the pass it overlaps, the forward (a quarter of a fully checkpointed step's
predicted compute: forward, recomputed forward, backward at twice the forward).

On a CPU the same code runs (the offload's copies are host-to-host; the tiny model in seconds): a
smoke run of the path, not a measurement of overlap.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    byte_corpus,
    default_label,
    emit_result,
    machine_description,
    markdown_table,
    median,
    resolve_device,
    run_worker,
    timed_steps,
    today,
    write_section,
)
from bench_gpu_estimates import VARIANTS  # noqa: E402

SECTION = "Offload overlap on a GPU"
MIB, GIB = 1024**2, 1024**3
GOAL = 1.10  # offloaded step time over checkpointing only, where the link keeps up
ROWS: dict[str, dict[str, Any]] = {
    "checkpointing only": {"variant": "full checkpointing", "offload": None},
    "+ --activation-offload": {"variant": "offloaded checkpoints", "offload": "prefetch"},
    "+ offload, prefetch off": {"variant": "offloaded checkpoints", "offload": "no prefetch"},
}


def _config(spec: dict[str, Any]):
    from memfit.config_loading import load_config

    model = spec["model"] if spec["model"] == "tiny" else f"preset:{spec['model']}"
    return load_config(overrides={
        "model": model, "dataset": spec["dataset"], "seq_len": spec["seq_len"], "batch_size": spec["batch_size"],
        "max_steps": spec["steps"], "output_dir": spec["output_dir"], "cache_dir": spec["cache_dir"],
        "report": False, **VARIANTS[ROWS[spec["row"]]["variant"]],
    })


def _predicted(config, session, gpu) -> dict[str, Any]:
    """The planner's step seconds for this config with and without the offload, and its link verdict."""
    from memfit.prediction.estimator import estimate
    from memfit.prediction.speed_model import estimated_step_seconds

    hf_config = session.model.config
    device = session.device.type
    changes = {"batch_size": config.training.batch_size, "gradient_accumulation_steps": 1,
               "precision": config.memory.precision, "dtype": config.model.dtype,
               "gradient_checkpointing": config.memory.gradient_checkpointing,
               "loss_chunk_size": session.run.loss_chunk_size, "tiled_mlp": config.memory.tiled_mlp or 0,
               "optimizer": config.optimizer.optimizer}
    seconds, estimates = {}, {}
    for offload in (True, False):
        est = estimate(config.replace(activation_offload=offload), gpu=gpu, hf_config=hf_config)
        estimates[offload] = est
        seconds[offload] = estimated_step_seconds({**changes, "activation_offload": offload}, config, est, gpu,
                                                  hf_config, device=device, calibrate=False)
    moved = int(estimates[True].details.get("pcie_bytes_per_micro_batch", 0))
    link = (gpu.host_link_gbps if gpu is not None else 16.0) * 1e9
    return {"planner_offload_seconds": seconds[True], "planner_plain_seconds": seconds[False],
            "estimated_pcie_bytes": moved, "link_gbps": link / 1e9, "link_seconds_one_way": moved / 2 / link,
            # forward copies (half the bytes) overlap the forward, a quarter of a fully checkpointed step's compute
            "link_keeps_up": moved / 2 / link <= seconds[False] / 4,
            "estimated_host_activation_bytes": int(estimates[True].host_breakdown.get("activations", 0))}


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One row, in its own process: build the run, train its steps under the row's offload, time them."""
    from memfit.gpus import local_gpu
    from memfit.techniques.offload import ActivationOffload, activation_offload
    from memfit.train.loop import run_facts
    from memfit.train.setup import build_session
    from memfit.train.speed import SpeedMeter

    config = _config(spec)
    session = build_session(config)
    kind = ROWS[spec["row"]]["offload"]
    context = None
    if kind == "prefetch":  # what memfit train runs under --activation-offload (train/loop.py)
        context, reason = activation_offload(session.device, model=session.model)
        if reason:
            session.fallbacks["activation_offload"] = reason
    elif kind == "no prefetch":
        context = ActivationOffload(session.model, device=session.device, prefetch=False)
    gpu = local_gpu() if session.device.type == "cuda" else None
    prediction = _predicted(config, session, gpu)
    # On a CPU the run's peak comes from a matmul probe that takes longer than the whole smoke run
    run_prediction = SpeedMeter.from_session(session).predicted_step_seconds if gpu is not None else None
    timed = timed_steps(session, spec["steps"], context)
    warm = timed["seconds"][spec["warmup"]:]
    tokens = [result.input_tokens for result in timed["results"]][spec["warmup"]:]
    facts = run_facts(session)
    return {
        "step_seconds": median(warm), "tokens_per_second": sum(tokens) / sum(warm) if warm else None,
        "first_step_seconds": timed["seconds"][0], "max_allocated_bytes": timed["max_allocated_bytes"],
        "host_peak_bytes": timed["host_peak_bytes"],
        "oom_events": sum(1 for r in timed["results"] for e in r.events if e.get("event") == "oom"),
        "offloaded_bytes_per_micro_batch": (2 * context.offloaded_bytes // spec["steps"]) if context is not None else 0,
        "fetched_ahead": context.fetched_ahead if context is not None else 0,
        "run_predicted_seconds": run_prediction,
        "ran": {key: facts.get(key) for key in ("precision", "attention", "gradient_checkpointing", "loss_chunk_size",
                                                "kernels", "fallbacks")},
        **prediction,
    }


def _row(model: str, batch: int, label: str, r: dict[str, Any] | None, base: dict[str, Any] | None,
         why: str) -> list[str]:
    if r is None:
        return [model, str(batch), label] + ["-"] * 9 + [why]
    ratio = r["step_seconds"] / base["step_seconds"] if base else None
    offloaded = label != "checkpointing only"
    planned = r["planner_offload_seconds"] if offloaded else r["planner_plain_seconds"]
    allocated = r["max_allocated_bytes"]
    if not offloaded:
        verdict = "reference"
    elif not r["link_keeps_up"]:
        verdict = "link-bound by the estimate"
    elif ratio is None:
        verdict = "-"
    else:
        verdict = f"{'meets' if ratio <= GOAL else 'MISSES'} the goal (< {GOAL:.2f}x)"
    if r["oom_events"]:
        verdict += f"; {r['oom_events']} out-of-memory recoveries"
    moved = (f"{r['offloaded_bytes_per_micro_batch'] / MIB:,.0f} / {r['estimated_pcie_bytes'] / MIB:,.0f}"
             if offloaded else "-")
    return [model, str(batch), label, f"{r['step_seconds']:.3f}", f"{r['tokens_per_second']:,.0f}",
            "-" if ratio is None else f"{ratio:.3f}", "-" if allocated is None else f"{allocated / MIB:,.0f}",
            f"{r['host_peak_bytes'] / MIB:,.0f}", moved, f"{planned:.3g}",
            "-" if r["run_predicted_seconds"] is None else f"{r['run_predicted_seconds']:.3g}",
            f"{'yes' if r['link_keeps_up'] else 'no'} ({r['link_seconds_one_way'] * 1e3:.1f} ms each way at"
            f" {r['link_gbps']:.0f} GB/s)", verdict]


HEADERS = ["model", "batch", "row", "median step (s)", "tokens/s", "vs checkpointing only", "max allocated MiB",
           "peak RSS MiB", "moved per micro-batch MiB (measured / estimated)", "planner predicted (s)",
           "run's predicted (s)", "link keeps up (estimate)", "verdict"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama-3.2-1b", help="presets, comma-separated ('tiny' too)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch-sizes", default="1,2", help="micro-batches to measure, comma-separated")
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per row, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps left out of the medians")
    parser.add_argument("--rows", default=None, help=f"subset of: {', '.join(ROWS)} (comma-separated)")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--row-timeout", type=float, default=240, help="seconds one row may take")
    parser.add_argument("--out", default=None, help="write the table into this markdown file")
    parser.add_argument("--json", default=None, help="also write every figure to this JSON file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        emit_result(worker(json.loads(args.worker)))
        return 0
    rows = list(ROWS) if args.rows is None else [r.strip() for r in args.rows.split(",")]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"unknown row {unknown[0]!r}; choose from: {', '.join(ROWS)}")
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} leaves no step after --warmup {args.warmup}")
    device = resolve_device(args.device)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    command = "python benchmarks/bench_offload_overlap.py " + " ".join(argv if argv is not None else sys.argv[1:])
    env = {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}
    table, raw = [], []
    with tempfile.TemporaryDirectory(prefix="memfit-offload-overlap-") as tmp:
        workdir = Path(tmp)
        dataset = byte_corpus(workdir, args.seq_len * max(batches) * (args.steps + 2))
        for model in [m.strip() for m in args.models.split(",")]:
            for batch in batches:
                base = None
                for label in rows:
                    spec = {"model": model, "row": label, "dataset": dataset, "seq_len": args.seq_len,
                            "batch_size": batch, "steps": args.steps, "warmup": args.warmup,
                            "output_dir": str(workdir / f"run-{len(raw)}"), "cache_dir": str(workdir / "cache"),
                            "name": f"{model} batch {batch} {label}"}
                    measured, why = None, ""
                    try:
                        measured = run_worker(__file__, spec, timeout=args.row_timeout, env=env)
                    except Exception as error:  # noqa: BLE001 - a failed row is a finding: recorded, the rest runs
                        why = f"FAILED: {str(error).strip().splitlines()[-1][:160]}"
                    if label == "checkpointing only":
                        base = measured
                    table.append(_row(model, batch, label, measured, base, why))
                    raw.append({"model": model, "batch_size": batch, "row": label, "measured": measured, "why": why})
                    print(" | ".join(table[-1]), file=sys.stderr, flush=True)
                    if args.json:
                        Path(args.json).write_text(json.dumps(raw, indent=1, default=str))
    body = "\n".join([
        f"Preset shapes, random weights, bf16 weights and compute, full checkpointing, seq {args.seq_len},"
        f" {args.steps} steps of which {args.warmup} warm-up (medians over the rest), each row a fresh process."
        " Moved per micro-batch: what the offload context copied out and back, against the estimate's"
        " `pcie_bytes_per_micro_batch`. Planner predicted: `estimated_step_seconds` with this GPU's preset"
        " (offload bytes added in full at the host link's rate); run's predicted: the `predicted_step_seconds`"
        " memfit train logs.",
        "",
        markdown_table(HEADERS, table),
        "",
        f"Command: `{command.strip()}`",
        "",
        f"Machine: {machine_description(device)}",
        "",
        f"Date: {today()}",
    ])
    print(body)
    if args.out:
        write_section(args.out, SECTION, body, subheading=default_label(device))
    return 0


if __name__ == "__main__":
    sys.exit(main())
