"""Per-rank memory of each way of spreading a run over ranks (1 and 2 CPU processes).

    python benchmarks/bench_distributed.py [--model tiny] [--steps 3] [--out runs/bench-distributed]

Runs `memfit train` in one process and under torchrun with 2 processes (gloo) for
DDP, FSDP2 (with and without CPU offload) and DeepSpeed ZeRO-2 / ZeRO-3 + offload,
reads each run's metrics, and prints a Markdown table of rank 0's parameter,
gradient and optimizer-state bytes (what the engine keeps on each rank) and the
largest process peak RSS over the ranks. The table in docs/distributed.md comes
from this script.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch

MODES = [
    ("one process", 1, []),
    ("ddp", 2, ["--sharding", "ddp"]),
    ("fsdp2", 2, ["--sharding", "fsdp"]),
    ("fsdp2 + cpu offload", 2, ["--sharding", "fsdp", "--fsdp-offload"]),
    ("zero-2", 2, ["--zero-stage", "2"]),
    ("zero-3 + cpu offload", 2, ["--zero-stage", "3", "--zero-offload"]),
]


def run(mode_args: list[str], ranks: int, common: list[str], out: Path) -> list[dict]:
    launcher = [sys.executable, "-m", "memfit", "train"]
    if ranks > 1:
        launcher = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={ranks}",
            "-m",
            "memfit",
            "train",
        ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*launcher, *common, *mode_args, "--output-dir", str(out)], capture_output=True, text=True, env=env
    )
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(mode_args) or 'one process'} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def one_process_state(records: list[dict], model_dir: Path) -> dict:
    """The single-process figures: every parameter, its gradient, AdamW's two fp32 moments."""
    from safetensors.torch import load_file

    weights = sum(t.numel() * t.element_size() for t in load_file(str(model_dir / "model.safetensors")).values())
    return {"rank": 0, "parameters": weights, "gradients": weights, "optimizer_states": 2 * weights}


def mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=4, help="samples per rank per micro-batch")
    parser.add_argument("--out", default="runs/bench-distributed")
    args = parser.parse_args()
    common = [
        "--model",
        args.model,
        "--max-steps",
        str(args.steps),
        "--seq-len",
        str(args.seq_len),
        "--batch-size",
        str(args.batch_size),
    ]
    rows = []
    for name, ranks, mode_args in MODES:
        out = Path(args.out) / name.replace(" ", "-").replace("+", "")
        records = run(mode_args, ranks, common, out)
        steps = [r for r in records if "event" not in r]
        summary = records[-1]
        state = steps[-1]["ranks"][0] if "ranks" in steps[-1] else one_process_state(records, out / "final")
        peak = summary.get("max_peak_memory_bytes") or summary.get("peak_memory_bytes")
        rows.append((name, ranks, state, peak))
        print(f"{name}: done", file=sys.stderr)
    when = datetime.date.today().isoformat()
    print(
        f"memfit train --model {args.model} --seq-len {args.seq_len} --batch-size {args.batch_size} (per rank)"
        f" --max-steps {args.steps}, fp32, AdamW; {platform.processor() or platform.machine()}, torch {torch.__version__}, {when}\n"
    )
    print(
        "| mode | ranks | parameters / rank (MiB) | gradients / rank (MiB) | optimizer state / rank (MiB) | peak RSS, max over ranks (MiB) |"
    )
    print("|---|---|---|---|---|---|")
    for name, ranks, state, peak in rows:
        optimizer = state["optimizer_states"] + state.get("master_weights", 0)
        gradients = state["gradients"] if "master_weights" not in state else None
        print(f"| {name} | {ranks} | {mib(state['parameters'])} | {mib(gradients)} | {mib(optimizer)} | {mib(peak)} |")


if __name__ == "__main__":
    main()
