"""How long a checkpoint save stops training, with and without --async-save.

Each configuration runs `memfit train --save-every 1` for a few steps in a fresh process and reads
the "checkpoint" events of its metrics: `stall_seconds` is the time the training thread spent in
the save (synchronous: the whole write; asynchronous: the host copy, plus any wait for the previous
write). Models: the 23M-parameter Llama of the other benchmarks ("20m") and a 124M-parameter one
("124m": GPT-2-small widths in a Llama shape), both AdamW in fp32, so one checkpoint holds
4 + 8 bytes per parameter. Prints a markdown table and the machine line to paste beside it
(docs/benchmarks.md).

    python benchmarks/bench_checkpoint_stall.py [--shapes 20m,124m] [--steps 5] [--seq-len 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import MODEL_SHAPES, machine_description, markdown_table, save_model, today  # noqa: E402

MODEL_SHAPES.setdefault("124m", {
    "hidden_size": 768,
    "intermediate_size": 2048,
    "num_hidden_layers": 12,
    "num_attention_heads": 12,
    "num_key_value_heads": 12,
    "vocab_size": 32000,
    "tie_word_embeddings": True,
})
MIB = 1024**2


def run(model: Path, data: Path, out: Path, steps: int, seq_len: int, async_save: bool) -> dict:
    command = [sys.executable, "-m", "memfit", "train", "--model", str(model), "--dataset", str(data), "--seq-len",
               str(seq_len), "--batch-size", "2", "--max-steps", str(steps), "--save-every", "1", "--save-total-limit",
               "2", "--no-report", "--output-dir", str(out)]
    if async_save:
        command.append("--async-save")
    subprocess.run(command, check=True, capture_output=True, text=True)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    stalls = [r["stall_seconds"] for r in records if r.get("event") == "checkpoint"]
    steps_s = [r["tokens"] / r["tokens_per_second"] for r in records if "event" not in r]
    size = sum(f.stat().st_size for f in sorted((out / "checkpoints").iterdir())[-1].iterdir())
    return {"stalls": stalls, "step_seconds": statistics.median(steps_s), "checkpoint_bytes": size,
            "wall": next(r for r in records if r.get("event") == "summary")["wall_seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="20m,124m")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args()
    from memfit.data import bundled_corpus_path

    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        root = Path(scratch)
        for shape in args.shapes.split(","):
            params = save_model(root / shape, shape)
            for async_save in (False, True):
                result = run(root / shape, Path(bundled_corpus_path()), root / f"{shape}-{async_save}", args.steps, args.seq_len,
                             async_save)
                stalls = result["stalls"]
                rows.append([f"{shape} ({params / 1e6:.0f}M)", "async" if async_save else "sync",
                             f"{result['checkpoint_bytes'] / MIB:,.0f}", f"{statistics.median(stalls):.3f}",
                             f"{max(stalls):.3f}", f"{result['step_seconds']:.2f}", f"{result['wall']:.1f}"])
                print(rows[-1], file=sys.stderr)
    print(markdown_table(["model", "save", "checkpoint MiB", "stall per save, median s", "max s", "step s (median)",
                          "run wall s"], rows))
    print(f"\n{machine_description('cpu')}, {today()}; {args.steps} steps, a save after each but the last"
          f" (--save-every 1), seq-len {args.seq_len}, batch 2, AdamW fp32")


if __name__ == "__main__":
    main()
