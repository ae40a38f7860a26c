"""What each long-context lever buys: measured on CPU at a reduced shape, estimated at full size.

Part 1 trains 2 steps of a reduced Llama (4 blocks of width 256, MLP 704, vocabulary 4096,
random weights) at one sequence length through `memfit.train` with the live-tensor tracker,
once per stack of levers, and records the device peak and the host peak beside the
analytical estimate. Part 2 asks the estimator for the same stacks on Llama-3.1-8B QLoRA
(rank 32, every linear) at full size: the device peak at 32K tokens and the longest
context that fits 24 GiB (with 64 GiB of host memory).

    python benchmarks/bench_long_context.py --out docs/long-context.md
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_description, markdown_table, today, tracked_and_estimated, write_section  # noqa: E402

MIB, GIB = 1024**2, 1024**3

_OFF = {"tiled_mlp": 0, "activation_offload": False, "optimizer_in_backward": False}
LEVERS = {
    "plain (AdamW, no checkpointing)": {**_OFF, "gradient_checkpointing": "off"},
    "full checkpointing": {**_OFF, "gradient_checkpointing": "full"},
    "+ tiled MLP (4 tiles)": {**_OFF, "gradient_checkpointing": "full", "tiled_mlp": 4},
    "+ offloaded checkpoints": {**_OFF, "gradient_checkpointing": "full", "tiled_mlp": 4, "activation_offload": True},
    "+ optimizer in backward": {"gradient_checkpointing": "full", "tiled_mlp": 4, "activation_offload": True,
                                "optimizer_in_backward": True},
}


def _model(directory: Path) -> str:
    from memfit.models.tiny import save_llama

    return str(save_llama(directory, hidden_size=256, intermediate_size=704, num_hidden_layers=4, vocab_size=4096,
                          max_position_embeddings=65536))


def measured_part(seq_len: int) -> str:
    from memfit.config_loading import load_config

    rows = []
    with tempfile.TemporaryDirectory(prefix="memfit-long-") as tmp:
        work = Path(tmp)
        model = _model(work / "model")
        corpus = work / "corpus.txt"
        corpus.write_text("long context memory offload tile checkpoint " * (seq_len // 8))
        for name, changes in LEVERS.items():
            config = load_config(overrides={
                "model": model, "dataset": str(corpus), "seq_len": seq_len, "batch_size": 1, "max_steps": 2,
                "loss_chunk_size": 1024, "output_dir": str(work / "run"), "cache_dir": str(work / "cache"),
                "report": False, "log_every": 1000, **changes,
            })
            started = time.perf_counter()
            device, host, predicted = tracked_and_estimated(config)
            rows.append([name, f"{device / MIB:,.1f}", f"{predicted.peak_bytes / MIB:,.1f}",
                         f"{100 * (predicted.peak_bytes / device - 1):+.1f}%", f"{host / MIB:,.1f}",
                         f"{predicted.host_bytes / MIB:,.1f}", f"{time.perf_counter() - started:.0f}"])
            print(rows[-1], file=sys.stderr)
    return markdown_table(["levers", "tracked device MiB", "estimated MiB", "error", "tracked host MiB",
                           "estimated host MiB", "seconds"], rows)


def estimated_part() -> str:
    from memfit.config_loading import load_config
    from memfit.prediction.estimator import estimate
    from memfit.prediction.planner import plan

    base = {"model": "llama-3.1-8b", "lora_r": 32, "lora_targets": "all-linear", "quantize": "4bit", "dtype": "bf16",
            "batch_size": 1, "loss_chunk_size": 1024}
    rows = []
    for name, changes in LEVERS.items():
        if name.startswith("plain"):
            changes = {**changes, "loss_chunk_size": 0}
        config = load_config(overrides={**base, **changes, "seq_len": 32768})
        at_32k = estimate(config, gpu="rtx-4090")
        fixed = {k: v for k, v in changes.items() if k != "tiled_mlp"}
        try:
            longest = _longest_with(base, fixed, bool(changes.get("tiled_mlp")), plan, load_config)
        except Exception as error:  # nothing fits at 256 tokens
            longest = f"- ({str(error).splitlines()[0][:60]})"
        rows.append([name, f"{at_32k.peak_bytes / GIB:.1f}", f"{at_32k.host_bytes / GIB:.1f}", longest])
    return markdown_table(["levers (QLoRA r32, all linear, chunked loss)", "peak at 32K tokens, GiB",
                           "host at 32K, GiB", "longest context in 24 GiB"], rows)


def _longest_with(base: dict, fixed: dict, tiled: bool, plan, load_config) -> str:
    """The planner's longest context with these levers forced (its grid filtered to them)."""
    from unittest import mock

    import memfit.prediction.planner as planner

    original = planner.technique_grid

    def only_these(*args, **kwargs):
        grid = original(*args, **kwargs)
        keep = [g for g in grid if all(g.get(k) == v for k, v in fixed.items() if k in g)
                and bool(g.get("tiled_mlp")) == tiled and g.get("optimizer") == "adamw"
                and not g.get("optimizer_offload")]
        return keep or grid[:0]

    with mock.patch.object(planner, "technique_grid", only_these):
        result = plan(load_config(overrides={k: v for k, v in base.items() if k not in ("quantize", "dtype")}),
                      gpu="rtx-4090", allow="qlora", maximize="seq-len", host_memory=64 * GIB)
    return f"{result.plan['seq_len']:,}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=8192, help="sequence length of the CPU runs")
    parser.add_argument("--out", default=None, help="markdown file to write the two tables into")
    args = parser.parse_args(argv)
    command = "python benchmarks/bench_long_context.py " + " ".join(argv if argv is not None else sys.argv[1:])
    header = f"Command: `{command.strip()}`. Machine: {machine_description('cpu')}. Date: {today()}."
    measured = (f"Reduced Llama (4 blocks, hidden 256, MLP 704, vocabulary 4096), batch 1 x {args.seq_len:,} tokens,"
                f" chunked loss, 2 steps, AdamW fp32. {header}\n\n" + measured_part(args.seq_len))
    estimated = ("Llama-3.1-8B, QLoRA rank 32 on every linear, batch 1, bf16, `--gpu rtx-4090`, 64 GiB of host"
                 f" memory; analytical estimate. {header}\n\n" + estimated_part())
    print(measured + "\n\n" + estimated)
    if args.out:
        write_section(args.out, "What each lever buys, measured", measured)
        write_section(args.out, "What each lever buys at full size, estimated", estimated)
    return 0


if __name__ == "__main__":
    sys.exit(main())
