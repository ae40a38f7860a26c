"""What the frozen-weight levers cost on this CPU, in the units of the speed model's constants.

    python benchmarks/bench_lever_costs.py            # NF4 dequantization rate and one expert group's overhead

memfit's speed model (src/memfit/prediction/lever_costs.py) prices the NF4 head by the weights it dequantizes
and the expert dequantization groups by the grouped matmuls they add. On a CPU it writes both in FLOPs at the
step's matmul rate, as it writes the 8-bit optimizer's cost, so that one calibration of that rate corrects them
too. This script measures, with the default thread count and best-of-N timings (a shared machine's load shows
in means, not in minima):

- the matmul rate of the compute dtype (a 1024 x 1024 x 1024 matmul) and the step's rate, CPU_PROBE_UTILISATION
  of it (src/memfit/prediction/speed_model.py);
- bitsandbytes' NF4 dequantization of a 32 x 2,880 x 256 stack (23.6M weights, double-quantized absmax, blocks
  of 64) to the compute dtype, in weights per second, and so the FLOPs one weight's dequantization costs;
- one NF4 expert call (forward and backward of memfit's grouped matmul) over a small stack of 32 experts, the
  whole stack at once against one expert at a time: what one more group costs, in seconds and in FLOPs.
"""

from __future__ import annotations

import time

import torch


def best_seconds(work, repeats: int = 7) -> float:
    work()  # warm-up: thread pool, kernel selection
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - started)
    return best


def matmul_rate(dtype: torch.dtype, size: int = 1024) -> float:
    a = torch.randn(size, size).to(dtype)
    b = torch.randn(size, size).to(dtype)
    return 2 * size**3 / best_seconds(lambda: a @ b)


def dequantization_rate(dtype: torch.dtype) -> float:
    """NF4 weights dequantized per second to `dtype` (bitsandbytes' CPU backend)."""
    from memfit.techniques.expert_quant import dequantized, quantize_expert_weight

    stack = quantize_expert_weight(torch.nn.Parameter(torch.randn(32, 2880, 256), requires_grad=False))
    return stack.quant_state.shape.numel() / best_seconds(lambda: dequantized(stack, dtype))


def group_seconds(dtype: torch.dtype, experts: int = 32, tokens: int = 64) -> float:
    """Seconds one more dequantization group adds to one call (forward, or backward) of a small NF4 stack."""
    from memfit.techniques.expert_dequant_groups import GROUP_ATTRIBUTE
    from memfit.techniques.expert_quant import nf4_grouped_mm, quantize_expert_weight

    # (experts, in, out) with transposed=True; quantized from `dtype`, the dtype the grouped matmul then runs in
    stack = quantize_expert_weight(torch.nn.Parameter(torch.randn(experts, 64, 128).to(dtype), requires_grad=False))
    offsets = torch.arange(1, experts + 1, dtype=torch.int32) * (tokens // experts)
    x = torch.randn(tokens, 64, dtype=dtype, requires_grad=True)

    grad = torch.randn(tokens, 128, dtype=dtype)

    def call():
        nf4_grouped_mm(x, stack, True, offsets).backward(grad)

    timings = {}
    for group in (0, 2):  # 0: the whole stack at once; 2: two experts at a time
        setattr(stack, GROUP_ATTRIBUTE, group)
        timings[group] = best_seconds(call, repeats=15)
    return (timings[2] - timings[0]) / (2 * (experts // 2 - 1))  # forward and backward each run E/2 - 1 more groups


def gather_bytes_per_second(tokens: int = 4096, hidden: int = 2880) -> float:
    """Bytes a second of the embedding rows' gather and one copy of them (each pass counted once)."""
    table = torch.randn(32000, hidden).to(torch.bfloat16)
    ids = torch.randint(0, 32000, (tokens,))
    rows = tokens * hidden * 2
    return 2 * rows / best_seconds(lambda: torch.nn.functional.embedding(ids, table).clone())


def main() -> None:
    from memfit.prediction.speed_model import CPU_PROBE_UTILISATION

    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}")
    for dtype in (torch.float32, torch.bfloat16):
        step_rate = CPU_PROBE_UTILISATION * matmul_rate(dtype)
        weights = dequantization_rate(dtype)
        group = group_seconds(dtype)
        print(f"{str(dtype).removeprefix('torch.')}: step rate {step_rate / 1e9:.1f} GFLOP/s;"
              f" NF4 dequantization {weights / 1e9:.2f} G weights/s = {step_rate / weights:.0f} FLOPs a weight;"
              f" one more expert group {group * 1e6:.0f} us = {group * step_rate / 1e6:.1f} MFLOPs")
    print(f"embedding rows gathered and copied on the host: {gather_bytes_per_second() / 1e9:.1f} GB/s a pass")


if __name__ == "__main__":
    main()
