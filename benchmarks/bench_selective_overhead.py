"""What selective checkpointing costs on this device beyond its FLOPs: the dispatch of every operator.

    python benchmarks/bench_selective_overhead.py                 # the bench model's shape, seq 128 and 512
    python benchmarks/bench_selective_overhead.py --layers 4 --hidden 128 --seqs 64 --repeats 2   # a quick look

Selective checkpointing (memfit.techniques.checkpointing) keeps the matmul and attention outputs of each
checkpointed block and recomputes the rest. torch decides what to keep per operator: a Python dispatch mode
sees every operator of the block's forward, and again of its recompute. The FLOPs it redoes are a few percent of
the block's (memfit.models.flops: 5 %), but each operator the mode sees costs Python time whatever its size, so
on a CPU with a small model that time, not the FLOPs, is what the planner must weigh against the memory saved.

This script times one micro-batch's forward and backward of a Llama-shaped model (random weights, fp32 on the
CPU, the default thread count, the best of --repeats timings each, the three modes interleaved) without
checkpointing, with selective and with full checkpointing, at each sequence length and micro-batch size, and
prints what selective adds per block and micro-batch beyond what its recomputed FLOPs explain, in milliseconds
and in FLOPs at the step's matmul rate: the unit of the speed model's SELECTIVE_DISPATCH_CPU_FLOPS
(src/memfit/prediction/speed_model.py).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch


def build(layers: int, hidden: int, intermediate: int, heads: int, mode: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    from memfit.techniques.checkpointing import selective_checkpoint_kwargs

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=heads, vocab_size=257,
                         max_position_embeddings=4096, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).train()
    model.config.use_cache = False
    if mode == "selective":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=selective_checkpoint_kwargs())
    elif mode == "full":
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def micro_batch_seconds(model, tokens: torch.Tensor) -> float:
    started = time.perf_counter()
    model(input_ids=tokens, labels=tokens).loss.backward()
    seconds = time.perf_counter() - started
    model.zero_grad(set_to_none=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seqs", type=int, nargs="+", default=[128, 512])
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    from memfit.models.flops import flops_per_token, probe_matmul_flops

    modes = ("off", "selective", "full")
    models = {mode: build(args.layers, args.hidden, args.intermediate, args.heads, mode) for mode in modes}
    rate = probe_matmul_flops(torch.device("cpu"))
    print(f"{os.cpu_count()} CPUs, {torch.get_num_threads()} threads, matmul probe {rate / 1e9:.1f} GFLOP/s,"
          f" load {os.getloadavg()[0]:.1f}; model {args.layers} blocks of width {args.hidden}")
    print("| seq | micro-batch | off (s) | selective (s) | full (s) | selective's extra (ms) | its FLOPs explain (ms)"
          " | extra per block (ms) | per block (GFLOPs at the step's rate) |")
    print("|---|---|---|---|---|---|---|---|---|")
    per_block: list[float] = []
    flops_per_block: list[float] = []
    for seq in args.seqs:
        for micro in args.micro_batches:
            tokens = torch.randint(0, 256, (micro, seq))
            best = {mode: float("inf") for mode in modes}
            for mode in modes:
                micro_batch_seconds(models[mode], tokens)  # warm-up
            for _ in range(args.repeats):
                for mode in modes:  # interleaved: a load that drifts meets every mode alike
                    best[mode] = min(best[mode], micro_batch_seconds(models[mode], tokens))
            config = models["off"].config
            flops_off = flops_per_token(config, seq).hardware
            flops_selective = flops_per_token(config, seq, checkpointing="selective").hardware
            # the step's matmul rate: what the off run reached (its FLOPs over its time)
            step_rate = flops_off * micro * seq / best["off"]
            explained = (flops_selective - flops_off) * micro * seq / step_rate
            extra = best["selective"] - best["off"]
            per_block.append((extra - explained) / args.layers)
            flops_per_block.append(per_block[-1] * step_rate)
            print(f"| {seq} | {micro} | {best['off']:.3f} | {best['selective']:.3f} | {best['full']:.3f} |"
                  f" {extra * 1e3:.0f} | {explained * 1e3:.0f} | {per_block[-1] * 1e3:.1f} |"
                  f" {flops_per_block[-1] / 1e9:.2f} |")
    print(f"\nselective's dispatch per block and micro-batch, beyond its FLOPs: median"
          f" {statistics.median(per_block) * 1e3:.1f} ms (range {min(per_block) * 1e3:.1f} to {max(per_block) * 1e3:.1f}),"
          f" {statistics.median(flops_per_block) / 1e9:.2f} GFLOPs at the step's rate"
          f" ({min(flops_per_block) / 1e9:.2f} to {max(flops_per_block) / 1e9:.2f})")


if __name__ == "__main__":
    main()
