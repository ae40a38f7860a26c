"""Packed supervised fine-tuning against padded batches on a GPU: conversations/s, target tokens/s, peak, kernel.

    python benchmarks/bench_sft_gpu.py --out docs/benchmarks.md                # Llama-3.2-1B shape, seq 2048
    python benchmarks/bench_sft_gpu.py --conversations 64 --seq-len 4096
    python benchmarks/bench_sft_gpu.py --device cpu --quick                     # the tiny model: the path, on a CPU

memfit only (benchmarks/bench_sft.py sets memfit beside TRL's SFTTrainer on a CPU). One preset shape
(random weights of the real shape, the byte tokenizer), memfit's bundled conversations
(`--dataset builtin:chat`, rendered with the shipped ChatML template, loss on the assistant turns),
memfit's defaults otherwise (precision auto: bf16 autocast on a GPU; attention auto; kernels auto)
with full checkpointing, and two rows, each a fresh process trained through memfit's own step
(`_common.timed_steps`):

- `--packing samples` (memfit's default for conversations): whole conversations packed into windows
  of --seq-len by best-fit decreasing, attention and positions restarting at each, with the
  attention kernel memfit picks for packed rows (flash-attn's variable-length path where installed,
  else FlexAttention on CUDA, else SDPA with a block-diagonal mask);
- `--packing off`: one conversation per row, padded to the micro-batch's longest.

Both train about --conversations conversations a step: the padded row takes that many rows, the
packed row the windows they fill (their count x the windows of the whole set / its conversations).
Reported over the steps after --warmup: conversations, tokens (real, padding left out) and target
tokens (those carrying loss) per second, the share of the positions run that hold a token,
`torch.cuda.max_memory_allocated` over the steps (on a CPU: the process's peak RSS), and the
attention path that really ran (the run facts: the kernel, and for packed rows how attention is
kept within each conversation).
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
    default_label,
    emit_result,
    machine_description,
    markdown_table,
    resolve_device,
    run_worker,
    timed_steps,
    today,
    write_section,
)

SECTION = "Packed SFT on a GPU"
MIB = 1024**2
DATASET, TEMPLATE = "builtin:chat", "chatml"
ROWS = {"--packing samples": "samples", "--packing off": "off"}


def _config(spec: dict[str, Any]):
    from memfit.config_loading import load_config

    model = spec["model"] if spec["model"] == "tiny" else f"preset:{spec['model']}"
    return load_config(overrides={
        "model": model, "dataset": DATASET, "chat_template": TEMPLATE, "seq_len": spec["seq_len"],
        "batch_size": spec["rows"], "max_steps": spec["steps"], "packing": ROWS[spec["row"]],
        "gradient_checkpointing": "full", "output_dir": spec["output_dir"], "cache_dir": spec["cache_dir"],
        "report": False,
    })


def windows_per_conversation(seq_len: int, cache_dir: str) -> tuple[float, int, float]:
    """(windows of --seq-len that best-fit decreasing packs the set into / its conversations, conversations,
    mean tokens a conversation), from memfit's own tokenization of the set with the byte tokenizer."""
    from memfit.config import DataConfig
    from memfit.data import load_training_data
    from memfit.data.packing import best_fit_decreasing
    from memfit.models.tiny import byte_tokenizer

    data = DataConfig(dataset=DATASET, chat_template=TEMPLATE, seq_len=seq_len, packing="off", cache_dir=cache_dir)
    lengths = [int(n) for n in load_training_data(data, byte_tokenizer()).lengths]
    return len(best_fit_decreasing(lengths, seq_len)) / len(lengths), len(lengths), sum(lengths) / len(lengths)


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One row, in its own process: build the run, train its steps, count what each step trained."""
    from memfit.train.loop import run_facts
    from memfit.train.setup import build_session

    session = build_session(_config(spec))
    facts = run_facts(session)
    timed = timed_steps(session, spec["steps"])
    packed_rows = getattr(session.dataset, "rows", None)  # packed: the conversations of each window
    conversations = [sum(len(packed_rows[i]) for i in chosen) if packed_rows is not None else len(chosen)
                     for chosen in timed["indices"]]
    warm = slice(spec["warmup"], None)
    seconds = sum(timed["seconds"][warm])
    results = timed["results"][warm]
    return {
        "conversations_per_second": sum(conversations[warm]) / seconds,
        "tokens_per_second": sum(r.input_tokens for r in results) / seconds,
        "target_tokens_per_second": sum(r.target_tokens for r in results) / seconds,
        "conversations_per_step": sum(conversations[warm]) / len(results),
        "rows_per_step": spec["rows"],
        "token_share": sum(r.input_tokens for r in results) / max(1, sum(r.padded_positions for r in results)),
        "step_seconds": seconds / len(results), "first_step_seconds": timed["seconds"][0],
        "max_allocated_bytes": timed["max_allocated_bytes"], "host_peak_bytes": timed["host_peak_bytes"],
        "oom_events": sum(1 for r in timed["results"] for e in r.events if e.get("event") == "oom"),
        "attention": facts["attention"], "packing": facts["packing"],
        "ran": {key: facts.get(key) for key in ("precision", "gradient_checkpointing", "loss_chunk_size", "kernels",
                                                "fallbacks")},
    }


def _described(model: str) -> str:
    return "memfit's built-in tiny Llama" if model == "tiny" else f"{model} preset shape, random weights, byte tokenizer"


def _attention(r: dict[str, Any]) -> str:
    restriction = (r.get("packing") or {}).get("attention_restriction")
    return f"{r['attention']}: {restriction}" if restriction else r["attention"]


def _row(label: str, r: dict[str, Any] | None, base: dict[str, Any] | None, why: str) -> list[str]:
    if r is None:
        return [label] + ["-"] * 8 + [why]
    peak = r["max_allocated_bytes"] if r["max_allocated_bytes"] is not None else r["host_peak_bytes"]
    versus = (f"{r['conversations_per_second'] / base['conversations_per_second']:.2f}x"
              if base is not None and base is not r else "-")
    note = f"; {r['oom_events']} out-of-memory recoveries" if r["oom_events"] else ""
    return [label, f"{r['rows_per_step']} x {r['conversations_per_step']:.1f}", f"{r['conversations_per_second']:.1f}",
            f"{r['tokens_per_second']:,.0f}", f"{r['target_tokens_per_second']:,.0f}", f"{r['token_share']:.2f}",
            f"{peak / MIB:,.0f}", versus, _attention(r), f"{r['step_seconds']:.3f} s a step{note}"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.2-1b", help="a preset, or 'tiny'")
    parser.add_argument("--seq-len", type=int, default=2048, help="tokens a packed window holds")
    parser.add_argument("--conversations", type=int, default=32, help="conversations a step (the padded row's rows)")
    parser.add_argument("--steps", type=int, default=12, help="optimizer steps per row, warm-up included")
    parser.add_argument("--warmup", type=int, default=3, help="first steps left out (kernel compilation, allocator)")
    parser.add_argument("--quick", action="store_true", help="the tiny model, seq 512, 8 conversations, 3 steps")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    parser.add_argument("--row-timeout", type=float, default=240, help="seconds one row may take")
    parser.add_argument("--out", default=None, help="write the table into this markdown file")
    parser.add_argument("--json", default=None, help="also write every figure to this JSON file")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        emit_result(worker(json.loads(args.worker)))
        return 0
    if args.quick:
        args.model, args.seq_len, args.conversations, args.steps, args.warmup = "tiny", 512, 8, 3, 1
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} leaves no step after --warmup {args.warmup}")
    device = resolve_device(args.device)
    env = {"CUDA_VISIBLE_DEVICES": ""} if device == "cpu" else {}
    command = "python benchmarks/bench_sft_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])
    table, raw = [], {}
    with tempfile.TemporaryDirectory(prefix="memfit-sft-gpu-") as tmp:
        workdir = Path(tmp)
        cache = str(workdir / "cache")
        per_conversation, count, mean_length = windows_per_conversation(args.seq_len, cache)
        base = None
        for label, packing in ROWS.items():
            rows = max(1, round(args.conversations * per_conversation)) if packing == "samples" else args.conversations
            spec = {"model": args.model, "row": label, "rows": rows, "seq_len": args.seq_len, "steps": args.steps,
                    "warmup": args.warmup, "output_dir": str(workdir / f"run-{packing}"), "cache_dir": cache,
                    "name": label}
            measured, why = None, ""
            try:
                measured = run_worker(__file__, spec, timeout=args.row_timeout, env=env)
            except Exception as error:  # noqa: BLE001 - a failed row is a finding: recorded, the rest runs
                why = f"FAILED: {str(error).strip().splitlines()[-1][:160]}"
            base = base or measured
            table.append(_row(label, measured, base, why))
            raw[label] = {"spec": spec, "measured": measured, "why": why}
            print(" | ".join(table[-1]), file=sys.stderr, flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps(raw, indent=1, default=str))
    peak = "max allocated MiB" if device == "cuda" else "peak RSS MiB"
    headers = ["row", "rows x conversations a step", "conversations/s", "tokens/s", "target tokens/s",
               "tokens / positions run", peak, "conversations/s vs packed", "attention that ran", "step"]
    body = "\n".join([
        f"{_described(args.model)}; `{DATASET}` ({count} conversations of"
        f" {mean_length:.0f} tokens on average, ChatML, loss on the answers), seq {args.seq_len}, about"
        f" {args.conversations} conversations a step, full checkpointing, memfit's defaults otherwise;"
        f" {args.steps} steps of which {args.warmup} warm-up, each row a fresh process.",
        "",
        markdown_table(headers, table),
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
