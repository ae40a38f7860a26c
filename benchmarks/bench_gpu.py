"""Every GPU figure of docs/techniques.md and docs/accuracy.md, measured with one command.

    make bench-gpu                      # or: python benchmarks/bench_gpu.py [--out FILE.md] [--only NAME ...]

Each measurement prints one line per figure (MiB = 1024² bytes, measured with
`torch.cuda.max_memory_allocated` / `memory_allocated` around the measured region) and the
report names the machine, the date and the command. Without a CUDA device it says so and
exits 2: these figures exist only where a GPU ran them.

Measurements (the docs' wording in brackets):
  tracker-vs-allocator  the tracker's peak growth over a step / the allocator's, two Llama shapes
  chunked-loss          step peak of loss + backward, vocabulary 32000, 4 x 1024 tokens, plain vs 1024-token chunks
  optimizer-in-backward backward peak, 8 linear layers of 2048 x 2048 fp32, AdamW vs AdamW in backward
  activation-offload    bytes held after forward and step peak, Llama hidden 512 x 4 layers, 4 x 1024 tokens, fp32
  optimizer-offload     device bytes after a step with and without torchao's CPUOffloadOptimizer
  selective             activation bytes held after forward, bf16, 4 x 1024 tokens: off / selective / full
  attention             step peak, bf16, 4 x 2048 tokens, 2 layers: eager vs SDPA; fp32 with GQA under SDPA
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_description, markdown_table, today, write_section  # noqa: E402

MIB = 1024**2


def _llama(hidden: int, layers: int, vocab: int = 256, intermediate: int | None = None, kv_heads: int = 2,
           attention: str = "sdpa", positions: int = 2048):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=hidden, intermediate_size=intermediate or 4 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=kv_heads, vocab_size=vocab,
                         max_position_embeddings=positions)
    config._attn_implementation = attention
    torch.manual_seed(0)
    return LlamaForCausalLM(config).cuda()


def _growth(run: Callable[[], object]) -> tuple[int, object]:
    """Peak allocated bytes above the starting point while `run` runs, and what it returned."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    value = run()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before, value


def _tracked_step(tracker, model, optimizer, input_ids):
    with tracker.phase("forward"):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    with tracker.phase("backward"):
        loss.backward()
    with tracker.phase("optimizer"):
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return tracker.end_step()


def tracker_vs_allocator() -> list[list[str]]:
    import torch

    from memfit.memory.tracker import MemoryTracker

    rows = []
    for layers, hidden, batch, seq in ((4, 1024, 4, 512), (2, 256, 8, 1024)):
        model = _llama(hidden, layers, vocab=32000, intermediate=4 * hidden)
        optimizer = torch.optim.AdamW(model.parameters())
        input_ids = torch.randint(0, 32000, (batch, seq), device="cuda")
        tracker = MemoryTracker(torch.device("cuda"))
        tracker.attach(model, optimizer)
        with tracker:
            # The first step makes the optimizer state and cuBLAS's workspace (not a tensor).
            _tracked_step(tracker, model, optimizer, input_ids)
            torch.cuda.synchronize()
            tracked_before = tracker.current_bytes
            allocator_growth, memory = _growth(functools.partial(_tracked_step, tracker, model, optimizer, input_ids))
        ratio = (memory.peak_bytes - tracked_before) / allocator_growth
        rows.append([f"tracker / allocator, Llama {layers} layers, hidden {hidden}, vocab 32000, {batch} x {seq}",
                     f"{ratio:.7f}"])
        del model, optimizer, tracker
        torch.cuda.empty_cache()
    return rows


def chunked_loss() -> list[list[str]]:
    import torch

    from memfit.techniques.loss import causal_lm_loss_sum

    model = _llama(64, 2, vocab=32000, intermediate=128, positions=1024)
    input_ids = torch.randint(0, 32000, (4, 1024), device="cuda")
    rows = []
    for chunk in (0, 1024):
        model.zero_grad(set_to_none=True)
        peak, _ = _growth(lambda c=chunk: causal_lm_loss_sum(model, input_ids, input_ids, chunk_size=c).backward())
        rows.append([f"chunked loss, step peak, chunk {chunk or 'off'}", f"{peak / MIB:.1f} MiB"])
    rows.append(["chunked loss, fp32 logits", f"{4 * 1023 * 32000 * 4 / MIB:.1f} MiB"])
    return rows


def optimizer_in_backward() -> list[list[str]]:
    import torch
    from torch import nn

    from memfit.techniques.optimizer_in_backward import OptimizerInBackward

    def adamw(params):
        return torch.optim.AdamW(params, lr=1e-3, foreach=False)

    inputs = torch.randn(64, 2048, device="cuda")
    rows = []
    for in_backward in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(2048, 2048) for _ in range(8)]).cuda()
        optimizer = OptimizerInBackward(model.parameters(), adamw) if in_backward else adamw(model.parameters())
        for _ in range(2):  # the second step has optimizer state in both cases
            loss = model(inputs).square().mean()
            peak, _ = _growth(loss.backward)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        rows.append([f"optimizer {'in backward' if in_backward else 'after backward'}, backward peak",
                     f"{peak / MIB:.1f} MiB"])
        del model, optimizer, loss
    return rows


def activation_offload() -> list[list[str]]:
    import torch

    from memfit.techniques.offload import activation_offload as offload_context

    model = _llama(512, 4)
    input_ids = torch.randint(0, 256, (4, 1024), device="cuda")
    rows = []
    for offload in (False, True):
        context = offload_context("cuda", model=model)[0] if offload else contextlib.nullcontext()
        model.zero_grad(set_to_none=True)
        held = {}

        def step(ctx=context, held=held):
            before = torch.cuda.memory_allocated()
            with ctx:
                loss = model(input_ids=input_ids, labels=input_ids).loss
            torch.cuda.synchronize()
            held["after_forward"] = torch.cuda.memory_allocated() - before
            loss.backward()

        peak, _ = _growth(step)
        label = "with" if offload else "without"
        rows.append([f"activation offload {label}: held after forward", f"{held['after_forward'] / MIB:.1f} MiB"])
        rows.append([f"activation offload {label}: step peak", f"{peak / MIB:.1f} MiB"])
    return rows


def optimizer_offload() -> list[list[str]]:
    import torch

    from memfit.config import OptimizerConfig
    from memfit.techniques.optimizer_offload import optimizer_offload as offload

    allocated = {}
    parameter_bytes = 0
    for offloaded in (False, True):
        model = _llama(512, 4)
        parameter_bytes = sum(p.numel() * 4 for p in model.parameters())
        groups = [{"params": list(model.parameters()), "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=1e-3, fused=True)
        if offloaded:
            optimizer, reason = offload(optimizer, groups, OptimizerConfig(max_grad_norm=0.0), "cuda")
            if reason:
                return [["optimizer offload", f"not measured: {reason}"]]
        input_ids = torch.randint(0, 256, (2, 128), device="cuda")
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize()
        allocated[offloaded] = torch.cuda.memory_allocated()
        del model, optimizer
        torch.cuda.empty_cache()
    moved = allocated[False] - allocated[True]
    return [["optimizer offload: device bytes freed / parameter bytes", f"{moved / parameter_bytes:.2f}"]]


def selective() -> list[list[str]]:
    import torch

    from memfit.techniques.checkpointing import apply_gradient_checkpointing

    input_ids = torch.randint(0, 256, (4, 1024), device="cuda")
    rows = []
    for mode in ("off", "selective", "full"):
        model = _llama(64, 2, intermediate=256, positions=1024).to(torch.bfloat16).train()
        if mode != "off":
            apply_gradient_checkpointing(model, mode)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = model(input_ids=input_ids, labels=input_ids).loss
        torch.cuda.synchronize()
        rows.append([f"checkpointing {mode}: activations held after forward (bf16)",
                     f"{(torch.cuda.memory_allocated() - before) / MIB:.1f} MiB"])
        loss.backward()
        del model, loss
    return rows


def attention() -> list[list[str]]:
    import torch

    input_ids = torch.randint(0, 256, (4, 2048), device="cuda")
    rows = []
    for kind, dtype, kv_heads in (("eager", torch.bfloat16, 2), ("sdpa", torch.bfloat16, 2), ("sdpa", torch.float32, 2)):
        model = _llama(64, 2, intermediate=128, kv_heads=kv_heads, attention=kind).to(dtype)

        def step(model=model):
            model(input_ids=input_ids, labels=input_ids).loss.backward()

        peak, _ = _growth(step)
        rows.append([f"attention {kind}, {str(dtype).removeprefix('torch.')}, GQA 4/{kv_heads}: step peak",
                     f"{peak / MIB:.1f} MiB"])
        del model
    return rows


MEASUREMENTS: dict[str, Callable[[], list[list[str]]]] = {
    "tracker-vs-allocator": tracker_vs_allocator,
    "chunked-loss": chunked_loss,
    "optimizer-in-backward": optimizer_in_backward,
    "activation-offload": activation_offload,
    "optimizer-offload": optimizer_offload,
    "selective": selective,
    "attention": attention,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=list(MEASUREMENTS), help="run only these measurements")
    parser.add_argument("--out", help="also write the report as a section of this Markdown file")
    args = parser.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench_gpu: no CUDA device here; these figures are measured on a GPU only", file=sys.stderr)
        return 2
    command = "python benchmarks/bench_gpu.py " + shlex.join(sys.argv[1:] if argv is None else argv)
    rows = []
    for name in args.only or MEASUREMENTS:
        for row in MEASUREMENTS[name]():
            print(f"{row[0]}: {row[1]}", flush=True)
            rows.append(row)
        torch.cuda.empty_cache()
    machine = machine_description("cuda")
    body = f"`{command.strip()}` on {today()}; {machine}.\n\n" + markdown_table(["figure", "measured"], rows)
    print(f"\n{machine}, {today()}")
    if args.out:
        write_section(args.out, "GPU figures", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
