"""The estimator against the CUDA allocator: real training steps of preset shapes, technique by technique.

    python benchmarks/bench_gpu_estimates.py --out docs/benchmarks.md              # 1B and 3B, every variant
    python benchmarks/bench_gpu_estimates.py --models llama-3.1-8b --out docs/benchmarks.md
    python benchmarks/bench_gpu_estimates.py --device cpu --models tiny --steps 2  # the path, on a CPU

Each row trains `--steps` optimizer steps of a preset (random weights of the real shape, byte tokens)
through `memfit.train.profiling.profile_run`, the code `memfit profile` runs, in a fresh process, and
sets beside `memfit estimate`'s figures:

- the estimate of allocated tensor bytes against `torch.cuda.max_memory_allocated` (goal: within 5%),
- the device estimate (allocated + CUDA context + allocator slack, what `memfit plan` budgets) against
  `max_memory_reserved` plus the context this process holds (what decides an out-of-memory error:
  the estimate must not be below it where the plan says a run fits).

A row whose estimate does not fit the GPU is not run; the table says so. On a CPU the tracker's peak
stands in for the allocator (a smoke run of the path; the figures of docs/accuracy.md come from
bench_estimate_accuracy.py there).
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
    emit_result,
    machine_description,
    markdown_table,
    resolve_device,
    run_worker,
    today,
    write_section,
)

MIB = 1024**2
# Every variant is a bf16 model (weights, gradients, AdamW state) at --seq-len x --batch-size; what each adds is
# the one technique named. Checkpointing is on from the second row, as every long-context plan has it.
PLAIN = {"dtype": "bf16", "precision": "bf16", "gradient_checkpointing": "off", "loss_chunk_size": 0,
         "tiled_mlp": 0}
CHECKPOINTED = {**PLAIN, "gradient_checkpointing": "full"}
VARIANTS: dict[str, dict[str, Any]] = {
    "bf16 plain": PLAIN,
    "full checkpointing": CHECKPOINTED,
    "LoRA r16": {**CHECKPOINTED, "lora_r": 16},
    "QLoRA r16 nf4": {**CHECKPOINTED, "lora_r": 16, "quantize": "4bit"},
    "chunked loss 1024": {**CHECKPOINTED, "loss_chunk_size": 1024},
    "offloaded checkpoints": {**CHECKPOINTED, "activation_offload": True},
    "tiled MLP x4": {**CHECKPOINTED, "tiled_mlp": 4},
    "optimizer in backward": {**CHECKPOINTED, "optimizer_in_backward": True},
    "8-bit AdamW": {**CHECKPOINTED, "optimizer": "adamw-8bit"},
}
# The long-context QLoRA frontier as `memfit plan --maximize seq-len` configures it for a 24 GiB GPU, with liger's
# fused loss (what `--kernels auto` picks where liger-kernel is installed) and with memfit's chunked loss instead.
FRONTIER = {**CHECKPOINTED, "lora_r": 32, "lora_targets": "all-linear", "quantize": "4bit", "optimizer": "adamw-8bit",
            "activation_offload": True, "tiled_mlp": 32}
VARIANTS["frontier QLoRA + liger"] = {**FRONTIER, "kernels": "liger", "loss_chunk_size": 0}
VARIANTS["frontier QLoRA + chunked loss"] = {**FRONTIER, "kernels": "none", "loss_chunk_size": 1024}
DEFAULT_VARIANTS = [name for name in VARIANTS if not name.startswith("frontier")]


def _config(spec: dict[str, Any]):
    from memfit.config_loading import load_config

    model = spec.get("model_dir") or (spec["model"] if spec["model"] == "tiny" else f"preset:{spec['model']}")
    return load_config(overrides={
        "model": model, "dataset": spec["dataset"], "seq_len": spec["seq_len"], "batch_size": spec["batch_size"],
        "max_steps": spec["steps"], "output_dir": spec["output_dir"], "report": False, "log_every": 1,
        **VARIANTS[spec["variant"]],
    })


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One row, in its own process: train the steps, read the allocator (or the tracker on a CPU)."""
    import torch

    from memfit.train.profiling import profile_run

    report, extra = profile_run(_config(spec))
    result: dict[str, Any] = {"tracked_peak_bytes": report.to_dict()["peak_bytes"], "ran": extra.get("run"),
                              "losses": extra.get("losses")}
    if spec["device"] == "cuda":
        free, total = torch.cuda.mem_get_info()
        reserved_now = torch.cuda.memory_reserved()
        result.update(max_allocated_bytes=torch.cuda.max_memory_allocated(),
                      max_reserved_bytes=torch.cuda.max_memory_reserved(),
                      # what the process holds beyond the caching allocator: the CUDA context and libraries' buffers
                      context_bytes=max(0, (total - free) - reserved_now), total_bytes=total)
    return result


def _estimate(spec: dict[str, Any]) -> tuple[int, int, bool | None]:
    """(allocated tensor bytes, device bytes with the context and slack, fits the GPU) as memfit plans them."""
    from memfit.gpus import GpuSpec
    from memfit.prediction.estimator import estimate

    gpu = None
    if spec["device"] == "cuda":
        import torch

        total = torch.cuda.get_device_properties(0).total_memory
        gpu = GpuSpec("local", total, torch.cuda.is_bf16_supported(), 100.0, 100.0, 32.0)
    result = estimate(_config(spec), gpu=gpu)
    allocated = result.details.get("allocated_peak_bytes", result.peak_bytes)
    return allocated, result.peak_bytes, result.fits


def _row(model: str, variant: str, spec: dict[str, Any], est: tuple[int, int, bool | None],
         measured: dict[str, Any] | None, why: str = "") -> list[str]:
    allocated, device, _ = est
    if measured is None:
        return [model, variant, f"{allocated / MIB:,.0f}", "-", "-", f"{device / MIB:,.0f}", "-", "-", why]
    truth = measured.get("max_allocated_bytes", measured["tracked_peak_bytes"])
    held = measured.get("max_reserved_bytes", truth) + measured.get("context_bytes", 0)
    verdict = "ok" if abs(allocated / truth - 1) <= 0.05 else "off by more than 5%"
    if device < held:
        verdict += "; device estimate BELOW what the process held"
    return [model, variant, f"{allocated / MIB:,.0f}", f"{truth / MIB:,.0f}", f"{100 * (allocated / truth - 1):+.1f}%",
            f"{device / MIB:,.0f}", f"{held / MIB:,.0f}", f"{100 * (device / held - 1):+.1f}%", verdict]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="llama-3.2-1b,llama-3.2-3b", help="presets, comma-separated ('tiny' too)")
    parser.add_argument("--variants", default=None, help=f"subset of: {', '.join(VARIANTS)} (comma-separated)")
    parser.add_argument("--layers", type=int, default=None, help="keep only the first N blocks of each preset (same"
                        " width and vocabulary): the per-block figures of a long context in minutes")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--row-timeout", type=float, default=300, help="seconds one row may take")
    parser.add_argument("--out", default=None, help="write the table into this markdown file, one subsection per model")
    parser.add_argument("--json", default=None, help="also write every figure to this JSON file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        emit_result(worker(json.loads(args.worker)))
        return 0
    device = resolve_device(args.device)
    variants = DEFAULT_VARIANTS if args.variants is None else [v.strip() for v in args.variants.split(",")]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"unknown variant {unknown[0]!r}; choose from: {', '.join(VARIANTS)}")
    command = "python benchmarks/bench_gpu_estimates.py " + " ".join(argv if argv is not None else sys.argv[1:])
    everything: dict[str, list[dict[str, Any]]] = {}
    with tempfile.TemporaryDirectory(prefix="memfit-gpu-estimates-") as tmp:
        workdir = Path(tmp)
        dataset = byte_corpus(workdir, args.seq_len * args.batch_size * (args.steps + 2))
        for model in [m.strip() for m in args.models.split(",")]:
            rows, raw = [], []
            model_dir, label = None, model
            if args.layers:
                from bench_peers import save_preset_model

                model_dir = str(workdir / f"{model}-{args.layers}-blocks")
                save_preset_model(Path(model_dir), model, args.layers)
                label = f"{model}, first {args.layers} blocks"
            for variant in variants:
                spec = {"model": model, "variant": variant, "dataset": dataset, "seq_len": args.seq_len,
                        "batch_size": args.batch_size, "steps": args.steps, "device": device,
                        "output_dir": str(workdir / f"{model}-{len(raw)}"), "name": f"{model} {variant}",
                        "model_dir": model_dir}
                est = _estimate(spec)
                measured, why = None, ""
                if device == "cuda" and est[2] is False:
                    why = "the estimate does not fit this GPU: not run"
                else:
                    try:
                        measured = run_worker(__file__, spec, timeout=args.row_timeout)
                    except Exception as error:  # noqa: BLE001 - a failed row is a finding: recorded, the rest runs
                        why = f"FAILED: {str(error).strip().splitlines()[-1][:160]}"
                rows.append(_row(label, variant, spec, est, measured, why))
                raw.append({"variant": variant, "estimate": est, "measured": measured, "why": why})
                print(" | ".join(rows[-1]), file=sys.stderr, flush=True)
                everything[label] = raw
                body = _write(args, label, command, device, rows, everything)
            print(body)
    return 0


def _write(args, label: str, command: str, device: str, rows: list[list[str]], everything: dict) -> str:
    """The table so far (rewritten after every row: a run cut short keeps what it measured)."""
    headers = ["model", "variant", "estimated allocated MiB", "max allocated MiB", "error", "estimated device MiB",
               "reserved + context MiB", "margin", "verdict"]
    body = (f"{label} preset shape, random weights, bf16, seq {args.seq_len} x batch {args.batch_size},"
            f" {args.steps} steps, each row a fresh process. Command: `{command.strip()}`."
            f" Machine: {machine_description(device)}. Date: {today()}.\n\n" + markdown_table(headers, rows))
    if args.out:
        write_section(args.out, "Estimator against the CUDA allocator", body, subheading=label)
    if args.json:
        Path(args.json).write_text(json.dumps(everything, indent=1, default=str))
    return body


if __name__ == "__main__":
    sys.exit(main())
