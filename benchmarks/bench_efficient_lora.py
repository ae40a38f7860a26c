"""Memory-efficient LoRA adapters: the tracked peak with `--no-efficient-lora` and `--efficient-lora`, and the estimate.

A reduced Llama (4 blocks, hidden 128, MLP 352, 4 heads of which 2 key/value heads,
vocabulary 257, random weights) with LoRA r8 on every linear over a bf16 base, batch 1 x
2,048 tokens, trains 2 steps through `memfit profile`'s path with the live-tensor tracker,
once with PEFT's adapter path and once with memfit's; beside them, the analytical estimate
of the efficient run. The stacks: LoRA with full checkpointing, QLoRA (4-bit base) with full
checkpointing, QLoRA with the frontier stack (offloaded checkpoints, 4 MLP tiles, 256-token
loss chunks), and LoRA without checkpointing.

    python benchmarks/bench_efficient_lora.py --out docs/long-context.md
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_description, markdown_table, today, tracked_and_estimated, write_section  # noqa: E402

MIB = 2**20
SEQ = 2048
SECTION = "Memory-efficient LoRA adapters, measured"

# The slice the adapter casts at once, scaled to this shape. On Llama-3.1-8B at 80K tokens the
# default 16M-element slice is about 1.5 % of an MLP input of tokens x intermediate
# (81,920 x 14,336); 8192 elements are the same share of 2,048 x 352. With the default the
# whole input here would be one slice and the run would keep a full fp32 copy in flight.
SLICE_ELEMENTS = 8192

_CHECKPOINTED = {"gradient_checkpointing": "full", "activation_offload": False, "tiled_mlp": 0,
                 "loss_chunk_size": 0}
CASES = {
    "LoRA bf16, full checkpointing": dict(_CHECKPOINTED),
    "QLoRA, full checkpointing": {**_CHECKPOINTED, "quantize": "4bit"},
    "QLoRA, frontier stack (offloaded checkpoints, 4 MLP tiles, 256-token loss chunks)": {
        **_CHECKPOINTED, "quantize": "4bit", "activation_offload": True, "tiled_mlp": 4, "loss_chunk_size": 256},
    "LoRA bf16, no checkpointing": {**_CHECKPOINTED, "gradient_checkpointing": "off"},
}


def _model(directory: Path) -> Path:
    from memfit.models.tiny import save_llama

    return save_llama(directory, hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=SEQ)


def measured(only: list[str] | None = None) -> str:
    import memfit.techniques.efficient_lora as efficient_lora
    from memfit.config_loading import load_config

    efficient_lora.SLICE_ELEMENTS = SLICE_ELEMENTS
    rows = []
    with tempfile.TemporaryDirectory(prefix="memfit-efficient-lora-") as tmp:
        root = Path(tmp)
        model = _model(root / "model")
        corpus = root / "corpus.txt"
        corpus.write_text("adapter rank input cast slice gradient token memory block step\n\n" * 4000)
        for name, changes in CASES.items():
            if only and not any(word in name for word in only):
                continue
            started = time.perf_counter()
            peaks = {}
            for efficient in (False, True):
                config = load_config(overrides={
                    "model": str(model), "dataset": str(corpus), "seq_len": SEQ, "batch_size": 1, "max_steps": 2,
                    "lora_r": 8, "lora_targets": "all-linear", "dtype": "bf16", "efficient_lora": efficient,
                    "log_every": 1000, "report": False, "output_dir": str(root / "run"),
                    "cache_dir": str(root / "cache"), **changes})
                peaks[efficient], _, predicted = tracked_and_estimated(config)
            off, on = peaks[False], peaks[True]
            rows.append([name, f"{off / MIB:.2f}", f"{on / MIB:.2f}", f"{1 - on / off:.1%}",
                         f"{predicted.peak_bytes / MIB:.2f}", f"{predicted.peak_bytes / on - 1:+.1%}",
                         f"{time.perf_counter() - started:.0f}"])
            print(rows[-1], file=sys.stderr)
    return markdown_table(["stack", "tracked MiB, `--no-efficient-lora`", "tracked MiB, `--efficient-lora`", "saving",
                           "estimated MiB (efficient)", "estimate error", "seconds"], rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help="comma-separated words: run only the stacks whose name has one")
    parser.add_argument("--out", default=None, help="markdown file to write the section into")
    args = parser.parse_args(argv)
    command = "python benchmarks/bench_efficient_lora.py " + " ".join(argv if argv is not None else sys.argv[1:])
    load = ", ".join(f"{value:.1f}" for value in os.getloadavg())
    header = (f"Command: `{command.strip()}`. Machine: {machine_description('cpu')}. Date: {today()}."
              f" Load average at the start: {load}.")
    body = ("Reduced Llama (4 blocks, hidden 128, MLP 352, 4 heads, 2 key/value heads, vocabulary 257), LoRA r8 on"
            f" every linear, bf16, batch 1 x {SEQ:,} tokens, 2 steps, AdamW; the steady step's tracked device peak;"
            f" adapter input slices of {SLICE_ELEMENTS:,} elements (the default's share of an MLP input at full"
            f" size). {header}\n\n" + measured(args.only.split(",") if args.only else None))
    print(body)
    if args.out:
        write_section(args.out, SECTION, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
