#!/usr/bin/env bash
# Every GPU figure of docs/benchmarks.md, part by part; each part fits one 10-minute run on an H100-class GPU.
#
#   benchmarks/gpu_truth.sh PART [PART ...]      (make gpu-truth PARTS="tests allocator")
#
# Parts, in the order they are worth running:
#   tests         pytest -m gpu: the CUDA paths, bitsandbytes' and liger's kernels included
#   allocator     bench_gpu.py (tracker, checkpointing, offload, attention peaks) and the estimator against
#                 max_memory_allocated / max_memory_reserved for the Llama-3.2-1B and -3B shapes
#   allocator-8b  the same for the Llama-3.1-8B shape (the variants that fit 80 GiB)
#   frontier      Llama-3.1-8B QLoRA at the planner's longest context and the full fine-tune, under --memory-cap 24GiB
#   speed         Llama-3.2-1B against the Hugging Face Trainer: tokens/s, MFU, peak; --compile and liger
#   overlap       offloaded checkpoints and their prefetch on side streams: step time with and without offload
#   sft           packed supervised fine-tuning against padded batches
#
# Each part writes its section of docs/benchmarks.md (command, GPU, driver, torch, date) and, when $OUT is set,
# its log and JSON there. Runs from the checkout on the machine's own torch, transformers and peft.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LOGS=${OUT:-/tmp/memfit-gpu-truth}
mkdir -p "$LOGS"
[ $# -gt 0 ] || { echo "usage: benchmarks/gpu_truth.sh PART [PART ...] (parts: tests allocator allocator-8b frontier speed overlap sft)" >&2; exit 2; }
status=0
for part in "$@"; do
  echo "== $part: $(date -u +%H:%M:%S)"
  case "$part" in
    tests) $PY -m pytest -m gpu tests -q -p no:cacheprovider -W ignore -rfEs ;;
    allocator)
      $PY benchmarks/bench_gpu.py --out docs/benchmarks.md &&
      $PY benchmarks/bench_gpu_estimates.py --models llama-3.2-1b,llama-3.2-3b --out docs/benchmarks.md \
        --json "$LOGS/allocator.json" ;;
    allocator-8b)
      $PY benchmarks/bench_gpu_estimates.py --models llama-3.1-8b --out docs/benchmarks.md \
        --variants "full checkpointing,LoRA r16,QLoRA r16 nf4,optimizer in backward,8-bit AdamW" \
        --json "$LOGS/allocator-8b.json" ;;
    frontier) $PY benchmarks/bench_frontier_gpu.py --steps 2 --out docs/benchmarks.md --json "$LOGS/frontier.json" ;;
    speed) $PY benchmarks/bench_peers.py gpu --out docs/benchmarks.md --json "$LOGS/speed.json" ;;
    overlap) $PY benchmarks/bench_offload_overlap.py --out docs/benchmarks.md --json "$LOGS/overlap.json" ;;
    sft) $PY benchmarks/bench_sft_gpu.py --out docs/benchmarks.md --json "$LOGS/sft.json" ;;
    *) echo "gpu_truth: unknown part '$part' (parts: tests allocator allocator-8b frontier speed overlap sft)" >&2; exit 2 ;;
  esac || { echo "== $part FAILED"; status=1; }
done
exit $status
