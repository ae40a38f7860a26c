"""Partial offloaded checkpoints: the tracker against the estimate at a reduced shape, and what the planner finds.

Measured part (CPU, reduced shape): a narrow bf16 Llama with LoRA, full checkpointing and a
chunked loss, trained two steps through `memfit profile`'s path with the live-tensor tracker
(device and host apart), with no offload, the first N blocks offloaded
(`--activation-offload-blocks N`), and full offload; beside each, the analytical estimate.

Planned part (analytical): `memfit plan --model llama-3.1-8b --gpu rtx-4090 --allow qlora --lora-r 32
--lora-targets all-linear --maximize seq-len` at several `--host-memory` values, with partial offload
(the planner's default) and with full offload only (`--activation-offload-blocks none`).

    python benchmarks/bench_partial_offload.py --layers 16 --out docs/long-context.md
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_description, markdown_table, today, tracked_and_estimated, write_section  # noqa: E402

HIDDEN, SEQ = 64, 4096
SECTION = "Partial offload: spare device memory instead of host memory"


def _model(directory: Path, layers: int) -> Path:
    from memfit.models.tiny import save_llama

    return save_llama(directory, hidden_size=HIDDEN, intermediate_size=HIDDEN, num_hidden_layers=layers,
                      max_position_embeddings=SEQ)


def measured_part(layers: int) -> str:
    from memfit.config_loading import load_config

    mib = 2**20
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        model = _model(root / "model", layers)
        corpus = root / "corpus.txt"
        corpus.write_text("memory gradient batch token model layer training fits device loss step\n\n" * 4000)
        cases = [("no offload", {}), (f"first {layers // 2} blocks", {"activation_offload_blocks": layers // 2}),
                 (f"all {layers} blocks", {"activation_offload_blocks": layers}),
                 ("full offload (blocks and head)", {"activation_offload": True})]
        for name, changes in cases:
            config = load_config(overrides={
                "model": str(model), "dataset": str(corpus), "seq_len": SEQ, "batch_size": 1, "max_steps": 2,
                "lora_r": 8, "dtype": "bf16", "gradient_checkpointing": "full", "loss_chunk_size": 512,
                "tiled_mlp": 0, "log_every": 1000, "report": False, "output_dir": str(root / "run"), **changes})
            device, host, predicted = tracked_and_estimated(config)
            rows.append([name, f"{device / mib:.2f}", f"{predicted.peak_bytes / mib:.2f}",
                         f"{predicted.peak_bytes / device - 1:+.1%}", f"{host / mib:.2f}",
                         f"{predicted.host_bytes / mib:.2f}"])
    return markdown_table(["offloaded", "tracked device MiB", "estimated MiB", "error", "tracked host MiB",
                           "estimated host MiB"], rows)


def planned_part(host_sizes: list[str]) -> str:
    from memfit.config_loading import load_config
    from memfit.prediction.planner import plan
    from memfit.units import GIB, parse_size

    base = {"model": "llama-3.1-8b", "lora_r": 32, "lora_targets": "all-linear"}
    rows = []
    for size in host_sizes:
        host = parse_size(size, "--host-memory") if size != "this machine" else None
        partial = plan(load_config(overrides=base), gpu="rtx-4090", allow="qlora", maximize="seq-len", host_memory=host)
        full = plan(load_config(overrides={**base, "activation_offload_blocks": None}), gpu="rtx-4090", allow="qlora",
                    maximize="seq-len", host_memory=host)
        blocks = partial.plan.get("activation_offload_blocks")
        limit = partial.host_limit_bytes / GIB
        rows.append([f"{size} ({limit:.1f} GiB)", f"{full.plan['seq_len']:,} ({full.host_bytes / GIB:.1f} GiB host,"
                     f" {full.estimated_peak_bytes / GIB:.1f} GiB device)",
                     f"{partial.plan['seq_len']:,} ({'all + head' if blocks is None else f'{blocks} of 32'} offloaded,"
                     f" {partial.host_bytes / GIB:.1f} GiB host, {partial.estimated_peak_bytes / GIB:.1f} GiB device)"])
    return markdown_table(["host memory", "full offload only (`--activation-offload-blocks none`)",
                           "partial offload (the planner's choice)"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16, help="blocks of the reduced model")
    parser.add_argument("--host", default="16GiB,20GiB,this machine,64GiB", help="--host-memory values to plan with")
    parser.add_argument("--skip-measured", action="store_true", help="only the planner's table")
    parser.add_argument("--out", default=None, help="markdown file to write the section into")
    args = parser.parse_args(argv)
    command = "python benchmarks/bench_partial_offload.py " + " ".join(argv if argv is not None else sys.argv[1:])
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    header = f"Command: `{command.strip()}`. Machine: {machine_description('cpu')}. Date: {today()}. Load average at the start: {load}."
    planned = ("Longest QLoRA r32 all-linear context of Llama-3.1-8B on an RTX 4090 (analytical estimate,"
               f" `memfit plan ... --maximize seq-len --host-memory SIZE`). {header}\n\n" + planned_part(args.host.split(",")))
    print(planned)
    if args.out:
        write_section(args.out, SECTION, planned, subheading="Planned")
    if not args.skip_measured:
        measured = (f"Reduced Llama ({args.layers} blocks, hidden {HIDDEN}, MLP {HIDDEN}, vocabulary 257), LoRA r8 on a"
                    f" bf16 base, batch 1 x {SEQ:,} tokens, full checkpointing, 512-token loss chunks, 2 steps;"
                    f" the second step's peaks. {header}\n\n" + measured_part(args.layers))
        print(measured)
        if args.out:
            write_section(args.out, SECTION, measured, subheading=f"Measured at {args.layers} blocks")
    return 0


if __name__ == "__main__":
    sys.exit(main())
