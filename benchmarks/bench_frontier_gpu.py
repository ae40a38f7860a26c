"""The frontier runs, measured: the planner's longest QLoRA context and the full fine-tune at batch 2.

On a GPU (the figures of docs/long-context.md): random weights of the Llama-3.1-8B preset
shape, under `--memory-cap 24GiB`, train 3 steps of

1. QLoRA (rank 32, every linear) at the longest context `memfit plan --maximize seq-len`
   finds for the cap, and
2. the full fine-tune at batch 2, seq 2048, as `memfit plan --allow full` configures it (the frontier: nothing
   paged to the host), and beside it (GPU only) the same run with paged 8-bit AdamW, torchtune's recipe,

and record torch.cuda.max_memory_allocated / max_memory_reserved, the tracker's peak and
host peak, and tokens/s beside the planner's estimate (device and host).

On a CPU the same script runs the same two plans at reduced shapes (4 blocks of width 256,
a 4096-token vocabulary, a 256 MiB cap, sequence 512 for the full fine-tune), so that the
path is tested wherever the tests run:

    python benchmarks/bench_frontier_gpu.py                       # CUDA when present
    python benchmarks/bench_frontier_gpu.py --device cpu --out docs/benchmarks.md
    make bench-frontier
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (  # noqa: E402
    byte_corpus,
    default_label,
    emit_result,
    machine_description,
    markdown_table,
    resolve_device,
    run_worker,
    today,
    write_section,
)

GIB = 1024**3
MIB = 1024**2

CPU_SHAPE = {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "vocab_size": 4096, "max_position_embeddings": 65536}
QUICK_SHAPE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 2048}
"""--quick: a toy for the smoke test (a 24 MiB cap, sequence 128 for the full fine-tune)."""


def _cpu_model(directory: Path, shape: dict) -> str:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from memfit.models.tiny import byte_tokenizer

    config = LlamaConfig(**shape, eos_token_id=256, pad_token_id=256, bos_token_id=256)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return str(directory)


def _gpu_spec(cap: int, device: str):
    """The local GPU as the planner sees it, with the cap as its memory (speeds only rank the plans)."""
    import torch

    from memfit.gpus import GpuSpec

    if device != "cuda":
        return None
    return GpuSpec("local", cap, torch.cuda.is_bf16_supported(), 100.0, 100.0, 32.0)


def _plans(model: str, cap: int, gpu, full_seq: int, host_memory: int | None) -> dict[str, Any]:
    from memfit.config_loading import load_config
    from memfit.prediction.planner import plan

    qlora = plan(load_config(overrides={"model": model, "lora_r": 32, "lora_targets": "all-linear"}),
                 budget_bytes=cap, gpu=gpu, allow="qlora", maximize="seq-len", host_memory=host_memory)
    full = plan(load_config(overrides={"model": model, "seq_len": full_seq, "batch_size": 2}),
                budget_bytes=cap, gpu=gpu, allow="full", host_memory=host_memory)
    return {"QLoRA r32 all-linear, longest context": qlora, f"full fine-tune, batch 2, seq {full_seq}": full}


def _paged_beside(model: str, full, cap: int, gpu) -> Any:
    """The full fine-tune's plan with paged 8-bit AdamW and no activation offload: torchtune's recipe, and the paged
    plan the planner compares its choice with ("nothing paged to the host: expected ...x")."""
    from types import SimpleNamespace

    from memfit.config_loading import load_config
    from memfit.prediction.estimator import estimate

    changes = {k: v for k, v in full.plan.items() if k not in ("optim_target_modules", "activation_offload_blocks")}
    changes.update(optimizer="paged-adamw-8bit", activation_offload=False)
    est = estimate(load_config(overrides={"model": model, **changes}), gpu=gpu, budget_bytes=cap)
    command = " ".join(["memfit", "train", "--model", model] + [f"--{k.replace('_', '-')} {v}" for k, v in changes.items()
                                              if not isinstance(v, bool)] + [f"--{k.replace('_', '-')}" for k, v in
                                                                             changes.items() if v is True])
    return SimpleNamespace(plan=changes, estimated_peak_bytes=est.peak_bytes, host_bytes=est.host_bytes,
                           command=command, trades=[])


def _measure(model: str, result, cap: int, steps: int, workdir: Path, device: str, here: bool) -> dict[str, Any]:
    """Train the plan's steps in a fresh process (a run's model and allocator state never meet the next run's);
    `here` (the --quick CPU smoke run): in this process, as its peaks are the tracker's live tensors of each run."""
    from memfit.prediction.planner import plan_to_overrides

    spec = {"model": model, "changes": plan_to_overrides(result), "cap": cap, "steps": steps, "workdir": str(workdir),
            "device": device, "name": result.command}
    row = worker(spec) if here else run_worker(__file__, spec, timeout=3600)
    row.update(estimated_peak_bytes=result.estimated_peak_bytes, estimated_host_bytes=result.host_bytes,
               command=result.command, trades=result.trades)
    return row


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from memfit.config_loading import load_config
    from memfit.train.profiling import profile_run

    changes, steps, workdir = spec["changes"], spec["steps"], Path(spec["workdir"])
    seq = changes["seq_len"]
    corpus = byte_corpus(workdir, seq * changes["batch_size"] * (steps + 2))
    out = workdir / f"run-{seq}-{changes['batch_size']}-{changes.get('optimizer', '')}"
    config = load_config(overrides={
        "model": spec["model"], "dataset": corpus, "max_steps": steps, "memory_cap": spec["cap"], "output_dir": str(out),
        "report": False, "log_every": 1, "cache_dir": str(workdir / "cache"), **changes,
    })
    started = time.perf_counter()
    report, extra = profile_run(config)
    wall = time.perf_counter() - started
    data = report.to_dict()
    tokens_per_second = _last_tokens_per_second(out)
    if tokens_per_second is None:  # no metrics file: whole-run rate, setup included (a lower bound)
        tokens_per_second = steps * seq * changes["batch_size"] / wall
    row = {"plan": changes, "tracked_peak_bytes": data["peak_bytes"],
           "tracked_host_peak_bytes": data.get("host_peak_bytes", 0), "tokens_per_second": tokens_per_second,
           "wall_seconds": wall, "losses": extra.get("losses"), "ran": extra.get("run")}
    if spec["device"] == "cuda":
        row["cuda_max_allocated_bytes"] = torch.cuda.max_memory_allocated()
        row["cuda_max_reserved_bytes"] = torch.cuda.max_memory_reserved()
    return row


def _last_tokens_per_second(out: Path) -> float | None:
    metrics = out / "metrics.jsonl"
    if not metrics.exists():
        return None
    rates = [json.loads(line).get("tokens_per_second") for line in metrics.read_text().splitlines() if line.strip()]
    rates = [r for r in rates if r]
    return rates[-1] if rates else None


def _table(rows: dict[str, dict[str, Any]], device: str) -> str:
    headers = ["run", "seq x batch", "estimated peak", "tracked peak", "error"]
    if device == "cuda":
        headers += ["max allocated", "max reserved"]
    headers += ["estimated host", "tracked host peak", "tokens/s (steady, else whole run)"]
    lines = []
    for name, row in rows.items():
        plan = row["plan"]
        est, tracked = row["estimated_peak_bytes"], row["tracked_peak_bytes"]
        cells = [name, f"{plan['seq_len']:,} x {plan['batch_size']}", f"{est / MIB:,.1f} MiB", f"{tracked / MIB:,.1f} MiB",
                 f"{100 * (est / tracked - 1):+.1f}%"]
        if device == "cuda":
            cells += [f"{row['cuda_max_allocated_bytes'] / MIB:,.1f} MiB", f"{row['cuda_max_reserved_bytes'] / MIB:,.1f} MiB"]
        rate = row["tokens_per_second"]
        cells += [f"{row['estimated_host_bytes'] / MIB:,.1f} MiB", f"{row['tracked_host_peak_bytes'] / MIB:,.1f} MiB",
                  f"{rate:,.0f}" if rate else "-"]
        lines.append(cells)
    commands = "\n".join(f"- {name}: `{row['command']}`" for name, row in rows.items())
    return markdown_table(headers, lines) + "\n\nPlanned commands (before the cap and the step count were added):\n\n" + commands


def main(argv: list[str] | None = None) -> dict[str, dict[str, Any]]:
    from memfit.units import parse_size

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--memory-cap", default=None, help="device memory to plan and train within (GPU: 24GiB; CPU: 256MiB)")
    parser.add_argument("--host-memory", default=None, help="host memory the plans may use (default: this machine's)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--runs", default="qlora,full", help="which runs: qlora (the longest context), full (the full"
                        " fine-tune, and on a GPU the paged 8-bit plan beside it), comma-separated")
    parser.add_argument("--out", default=None, help="write the table into this markdown file (section 'Frontier runs')")
    parser.add_argument("--json", default=None, help="also write every figure to this JSON file")
    parser.add_argument("--quick", action="store_true", help="CPU smoke run: a toy shape under a 24 MiB cap")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        emit_result(worker(json.loads(args.worker)))
        return {}
    device = resolve_device(args.device)
    if args.quick and device == "cuda":
        parser.error("--quick is the CPU smoke run; drop it on a GPU")
    default_cap = "24GiB" if device == "cuda" else ("24MiB" if args.quick else "256MiB")
    cap = parse_size(args.memory_cap or default_cap, "--memory-cap")
    host_memory = parse_size(args.host_memory, "--host-memory") if args.host_memory else None
    with tempfile.TemporaryDirectory(prefix="memfit-frontier-") as tmp:
        workdir = Path(tmp)
        shape = QUICK_SHAPE if args.quick else CPU_SHAPE
        model = "preset:llama-3.1-8b" if device == "cuda" else _cpu_model(workdir / "model", shape)
        full_seq = 2048 if device == "cuda" else (128 if args.quick else 512)
        plans = _plans(model, cap, _gpu_spec(cap, device), full_seq, host_memory)
        runs = {r.strip() for r in args.runs.split(",")}
        plans = {name: result for name, result in plans.items() if ("qlora" if name.startswith("QLoRA") else "full") in runs}
        if device == "cuda" and "full" in runs:  # bitsandbytes pages state through CUDA unified memory: no CPU equivalent
            full_name = next(name for name in plans if name.startswith("full"))
            plans[f"{full_name}, paged 8-bit AdamW"] = _paged_beside(model, plans[full_name], cap,
                                                                          _gpu_spec(cap, device))
        rows = {}
        for name, result in plans.items():
            print(f"{name}: {result.command}", file=sys.stderr)
            rows[name] = _measure(model, result, cap, args.steps, workdir, device, args.quick)
    shape = "Llama-3.1-8B preset shape, random weights" if device == "cuda" else (
        f"reduced Llama: {shape['num_hidden_layers']} blocks, hidden {shape['hidden_size']}, vocabulary"
        f" {shape['vocab_size']}, random weights")
    command = "python benchmarks/bench_frontier_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    body = (f"{shape}; `--memory-cap {cap / MIB:,.0f}MiB`, {args.steps} steps. Command: `{command.strip()}`. "
            f"Machine: {machine_description(device)}. Date: {today()}.\n\n" + _table(rows, device))
    print(body)
    if args.out:
        write_section(args.out, "Frontier runs", body, subheading=default_label(device))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1, default=str))
    return rows


if __name__ == "__main__":
    main()
