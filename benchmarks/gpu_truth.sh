#!/usr/bin/env bash
# Every GPU figure of docs/benchmarks.md, part by part; each part fits one 10-minute run on an H100-class GPU.
#
#   benchmarks/gpu_truth.sh PART [PART ...]      (make gpu-truth PARTS="tests allocator")
#
# Parts, in the order they are worth running (minutes on an H100 in brackets):
#   tests           pytest -m gpu: the CUDA paths, bitsandbytes' and liger's kernels included (1.5)
#   figures         bench_gpu.py: tracker against the allocator, chunked loss, offload, checkpointing, attention (1)
#   allocator-1b    the estimator against max_memory_allocated / max_memory_reserved, Llama-3.2-1B, nine variants (7)
#   allocator-3b    the same for the Llama-3.2-3B shape
#   allocator-8b    the same for the Llama-3.1-8B shape (the variants that fit 80 GiB)
#   long-context    four Llama-3.1-8B blocks at 131,072 tokens: the QLoRA frontier with and without liger (3)
#   frontier-qlora  Llama-3.1-8B QLoRA at the planner's longest context under --memory-cap 24GiB
#   frontier-full   the 8B full fine-tune at batch 2, seq 2048, and the paged 8-bit plan, under the same cap (4)
#   speed           Llama-3.2-1B against the Hugging Face Trainer: tokens/s, MFU, peak; --compile and liger
#   overlap         offloaded checkpoints and their prefetch on side streams: step time with and without (2)
#   sft             packed supervised fine-tuning against padded batches (2)
#
# Each part writes its section of docs/benchmarks.md (command, GPU, driver, torch, date) and, when $OUT is set,
# its log and JSON there. Runs from the checkout on the machine's own torch, transformers and peft.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
LOGS=${OUT:-/tmp/memfit-gpu-truth}
mkdir -p "$LOGS"
[ $# -gt 0 ] || { echo "usage: benchmarks/gpu_truth.sh PART [PART ...] (parts: tests figures allocator-1b allocator-3b allocator-8b long-context frontier-qlora frontier-full speed overlap sft)" >&2; exit 2; }
status=0
for part in "$@"; do
  echo "== $part: $(date -u +%H:%M:%S)"
  case "$part" in
    tests) $PY -m pytest -m gpu tests -q -p no:cacheprovider -W ignore -rfEs ;;
    figures) $PY benchmarks/bench_gpu.py --out docs/benchmarks.md ;;
    allocator-1b | allocator-3b)
      model=llama-3.2-${part#allocator-}
      $PY benchmarks/bench_gpu_estimates.py --models "$model" --out docs/benchmarks.md --json "$LOGS/$part.json" ;;
    allocator-8b)
      $PY benchmarks/bench_gpu_estimates.py --models llama-3.1-8b --out docs/benchmarks.md \
        --variants "full checkpointing,LoRA r16,QLoRA r16 nf4,optimizer in backward,8-bit AdamW" \
        --json "$LOGS/allocator-8b.json" ;;
    long-context)
      $PY benchmarks/bench_gpu_estimates.py --models llama-3.1-8b --layers 4 --seq-len 131072 --steps 2 \
        --variants "frontier QLoRA + liger,frontier QLoRA + chunked loss" --out docs/benchmarks.md \
        --json "$LOGS/long-context.json" ;;
    frontier-qlora | frontier-full)
      $PY benchmarks/bench_frontier_gpu.py --runs "${part#frontier-}" --steps 2 --out docs/benchmarks.md \
        --json "$LOGS/$part.json" ;;
    speed) $PY benchmarks/bench_peers.py gpu --out docs/benchmarks.md --json "$LOGS/speed.json" ;;
    overlap) $PY benchmarks/bench_offload_overlap.py --out docs/benchmarks.md --json "$LOGS/overlap.json" ;;
    sft) $PY benchmarks/bench_sft_gpu.py --out docs/benchmarks.md --json "$LOGS/sft.json" ;;
    *) echo "gpu_truth: unknown part '$part' (parts: tests figures allocator-1b allocator-3b allocator-8b long-context frontier-qlora frontier-full speed overlap sft)" >&2; exit 2 ;;
  esac || { echo "== $part FAILED"; status=1; }
done
exit $status
