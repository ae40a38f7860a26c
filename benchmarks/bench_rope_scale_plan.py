"""The longest context `memfit plan` finds for Llama-3.1-8B QLoRA in 80 GiB, with and without --rope-scale.

Without the flag the plan stops at the model's 131,072 positions; with `--rope-scale F` at F x
them, or at what memory allows. Analytical estimate: no GPU, no weights. Prints a markdown
table and the machine line to paste beside it (docs/long-context.md).

    python benchmarks/bench_rope_scale_plan.py [--host-memory 512GiB] [--scales 4,5]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_description, markdown_table, today  # noqa: E402

GIB = 1024**3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host-memory", default="512GiB")
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--scales", default="4,5", help="--rope-scale factors to plan besides none")
    args = parser.parse_args()

    from memfit.config_loading import load_config
    from memfit.prediction.planner import plan
    from memfit.units import parse_size

    host = parse_size(args.host_memory, "--host-memory")
    rows = []
    for scale in [None] + [float(s) for s in args.scales.split(",") if s]:
        flags = {"model": "llama-3.1-8b", "lora_r": 32, "lora_targets": "all-linear"}
        if scale is not None:
            flags["rope_scale"] = scale
        result = plan(load_config(overrides=flags), gpu=args.gpu, allow="qlora", maximize="seq-len", host_memory=host)
        seq = result.plan["seq_len"]
        why = "memory's limit" if seq == result.memory_limit_seq_len else f"positions cap {result.max_positions:,}"
        rows.append([
            "no `--rope-scale`" if scale is None else f"`--rope-scale {scale:g}`",
            f"{seq:,} ({why})",
            f"{result.estimated_peak_bytes / GIB:.1f} GiB",
            f"{result.host_bytes / GIB:.1f} GiB",
            f"{result.tokens_per_second:,.0f}",
            f"{result.memory_limit_seq_len:,}",
        ])
    print(markdown_table(["Llama-3.1-8B QLoRA r32 all-linear", "planned context", "device peak", "host memory",
                          "est. tokens/s", "memory's limit"], rows))
    load = os.getloadavg()[0]
    print(f"\n`--gpu {args.gpu} --host-memory {args.host_memory}`; analytical estimate. Command: `python"
          f" benchmarks/bench_rope_scale_plan.py --host-memory {args.host_memory} --scales {args.scales}`."
          f" Machine: {machine_description()}; load {load:.1f}. Date: {today()}.")


if __name__ == "__main__":
    main()
