"""Mixture-of-experts speed and memory: transformers' grouped path against a loop over experts, and split LoRA.

One reduced Qwen3-MoE (random weights) trains forward and backward on one batch, the same model and tokens
for every row, in one process:
- full fine-tuning with `config._experts_implementation = "grouped_mm"` (one grouped matmul per projection,
  what memfit runs) against `"eager"` (a Python loop over the experts that got tokens);
- LoRA r8 on the experts: memfit's split LoRA (x A then B per expert group) against PEFT's folded
  `W + BA` per call (the ParamWrapper's own forward).
Each row: median seconds of the timed repeats, tokens/s, and the peak of live tensors counted by memfit's
tracker over one forward and backward; the ratios compare the two rows of a pair.

    python benchmarks/bench_moe_experts.py --out docs/benchmarks.md
    python benchmarks/bench_moe_experts.py --quick          # a smoke run on a smaller shape, printed only
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine_description, markdown_table, today, write_section  # noqa: E402

MIB = 2**20
SECTION = "Mixture of experts: grouped experts and split LoRA, measured"
SHAPES = {
    "full": dict(hidden_size=256, moe_intermediate_size=256, num_experts=32, num_experts_per_tok=4,
                 num_hidden_layers=4, tokens=(4, 512), repeats=5),
    "quick": dict(hidden_size=64, moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                  num_hidden_layers=2, tokens=(2, 64), repeats=2),
}


def _model(shape: dict):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=257, hidden_size=shape["hidden_size"], intermediate_size=2 * shape["hidden_size"],
        moe_intermediate_size=shape["moe_intermediate_size"], num_experts=shape["num_experts"],
        num_experts_per_tok=shape["num_experts_per_tok"], num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=shape["hidden_size"] // 4,
        max_position_embeddings=4096,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _set_experts(model, implementation: str) -> None:
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "_experts_implementation"):
            config._experts_implementation = implementation


def _measure(model, tokens, repeats: int) -> dict:
    import torch

    from memfit.memory.tracker import MemoryTracker

    def step():
        model.zero_grad(set_to_none=True)
        model(input_ids=tokens, labels=tokens).loss.backward()

    step()  # warm-up: first-call allocations and kernel selection
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    tracker = MemoryTracker(torch.device("cpu"))
    tracker.attach(model)
    with tracker:
        with tracker.phase("forward"):
            loss = model(input_ids=tokens, labels=tokens).loss
        with tracker.phase("backward"):
            loss.backward()
        peak = tracker.end_step().peak_bytes
    tracker.detach()
    median = statistics.median(seconds)
    return {"seconds": median, "tokens_per_second": tokens.numel() / median, "peak": peak}


def run(shape_name: str) -> list[tuple[str, dict]]:
    import torch

    from memfit.config import LoraConfig
    from memfit.techniques.lora import apply_lora

    shape = SHAPES[shape_name]
    tokens = torch.randint(0, 256, shape["tokens"], generator=torch.Generator().manual_seed(0))
    rows = []
    model = _model(shape)
    for implementation in ("grouped_mm", "eager"):
        _set_experts(model, implementation)
        rows.append((f"full fine-tuning, experts {implementation}", _measure(model, tokens, shape["repeats"])))
    split, _ = apply_lora(_model(shape), LoraConfig(lora_r=8, lora_targets="experts"), gradient_checkpointing=False)
    folded = copy.deepcopy(split)
    for module in folded.modules():
        if "forward" in module.__dict__ and type(module).__name__ == "ParamWrapper":
            del module.forward  # PEFT's class forward: W + BA folded on each call
    rows.append(("LoRA r8 on the experts, split LoRA (memfit)", _measure(split, tokens, shape["repeats"])))
    rows.append(("LoRA r8 on the experts, PEFT folded W + BA", _measure(folded, tokens, shape["repeats"])))
    return rows


def _table(rows: list[tuple[str, dict]]) -> str:
    body = []
    for index, (name, row) in enumerate(rows):
        pair = rows[index - 1][1] if index % 2 else rows[index + 1][1]
        body.append([name, f"{row['seconds']:.3f}", f"{row['tokens_per_second']:,.0f}", f"{row['peak'] / MIB:.1f}",
                     f"{row['tokens_per_second'] / pair['tokens_per_second']:.2f}x", f"{row['peak'] / pair['peak']:.2f}x"])
    return markdown_table(["run", "step s (median)", "tokens/s", "tracked peak MiB", "tokens/s vs pair",
                           "peak vs pair"], body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller shape, printed only (a smoke test)")
    parser.add_argument("--out", help="markdown file to write the section into (docs/benchmarks.md)")
    args = parser.parse_args()
    import os

    import torch

    # One thread: on a shared machine a spinning thread pool makes small matmuls' times meaningless.
    torch.set_num_threads(1)
    load = os.getloadavg()[0]
    shape_name = "quick" if args.quick else "full"
    rows = run(shape_name)
    shape = SHAPES[shape_name]
    table = _table(rows)
    print(table)
    if args.out and not args.quick:
        body = (
            f"Reduced Qwen3-MoE: {shape['num_hidden_layers']} layers, hidden {shape['hidden_size']},"
            f" {shape['num_experts']} experts of width {shape['moe_intermediate_size']}, top-{shape['num_experts_per_tok']},"
            f" batch {shape['tokens'][0]} x {shape['tokens'][1]} tokens, fp32, one forward and backward per step"
            f" (median of {shape['repeats']} after a warm-up); peak = memfit's tracker over one step.\n\n"
            f"{table}\n\n"
            f"Command: `python benchmarks/bench_moe_experts.py --out docs/benchmarks.md`; machine:"
            f" {machine_description()}; torch threads {torch.get_num_threads()}; {today()}; load average"
            f" {load:.1f} when it started (a shared machine: the times move with the load, the ratios less so).\n"
        )
        write_section(args.out, SECTION, body)


if __name__ == "__main__":
    main()
