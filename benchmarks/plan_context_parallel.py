"""The longest context memfit plans on paper for a full fine-tune over N GPUs, per context-parallel size.

For each divisor of --gpus that divides the attention heads (Ulysses), the per-rank estimate of
memfit.prediction.context_parallel finds the longest sequence that fits 95 % of the GPU and 75 % of
--host-memory with memfit's long-context levers (checkpointing, tiled MLP, chunked loss,
offloaded checkpoints). Analytical: no GPU, no weights. Prints a markdown table and the machine line.

    python benchmarks/plan_context_parallel.py [--model llama-3.1-8b] [--gpus 8] [--gpu h100] [--host-memory 2TiB]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import machine_description, markdown_table, today  # noqa: E402

from memfit.gpus import get_gpu  # noqa: E402
from memfit.models.presets import resolve_model_config  # noqa: E402
from memfit.prediction.context_parallel import (  # noqa: E402
    GIB,
    decoder_parameters,
    plan_context_parallel,
    shape_from_hf_config,
)

_UNITS = {"gib": GIB, "tib": 1024 * GIB}


def _bytes(text: str) -> float:
    number = text.lower().rstrip("b").rstrip("i") + "ib"
    for suffix, scale in _UNITS.items():
        if number.endswith(suffix):
            return float(number[: -len(suffix)]) * scale
    raise SystemExit(f"--host-memory: give a size such as 512GiB, got {text}")


def rows_for(model: str, gpus: int, gpu: str, host_memory: float) -> list[list[str]]:
    """The best plan of each context-parallel size as table rows."""
    hf_config = resolve_model_config(model)
    shape = shape_from_hf_config(hf_config, 0)
    shape = shape_from_hf_config(hf_config, decoder_parameters(shape, bool(getattr(hf_config, "tie_word_embeddings", False))))
    device = 0.95 * get_gpu(gpu).memory_bytes
    plans = plan_context_parallel(shape, gpus, device, 0.75 * host_memory)
    best: dict[int, object] = {}
    for plan in plans:
        best.setdefault(plan.estimate.context_parallel, plan)
    rows = []
    for cp, plan in sorted(best.items()):
        levers = plan.levers
        lever_text = ", ".join(name for name, on in [("checkpointing", levers.checkpointing),
                                                     (f"tiled MLP x{levers.mlp_tiles}", levers.mlp_tiles > 1),
                                                     (f"chunked loss {levers.loss_chunk}", levers.loss_chunk),
                                                     ("offloaded checkpoints", levers.offload_checkpoints)] if on)
        rows.append([f"{plan.estimate.data_parallel} x {cp}", f"{plan.seq_len:,}", lever_text,
                     f"{plan.estimate.peak_bytes / GIB:.1f}", f"{plan.estimate.host_bytes / GIB:.1f}",
                     f"{plan.all_to_all_seconds:.2f}"])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--gpus", type=int, default=8)
    parser.add_argument("--gpu", default="h100")
    parser.add_argument("--host-memory", default="2TiB", help="the node's RAM (8 ranks share it)")
    args = parser.parse_args()
    host_per_rank = _bytes(args.host_memory) / min(args.gpus, 8)
    rows = rows_for(args.model, args.gpus, args.gpu, host_per_rank)
    if not rows:
        print(f"{args.model} full fine-tune does not fit {args.gpus} x {args.gpu} at any context-parallel size")
    print(markdown_table(["dp x cp", "longest seq-len", "levers", "GPU GiB/rank", "host GiB/rank",
                          "all-to-all s/step"], rows))
    print(f"\n{today()}, {machine_description()}: `python benchmarks/plan_context_parallel.py --model {args.model} "
          f"--gpus {args.gpus} --gpu {args.gpu} --host-memory {args.host_memory}`")


if __name__ == "__main__":
    main()
