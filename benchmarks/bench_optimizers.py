"""Small-state optimizers beside AdamW: loss after N steps, optimizer state (measured and predicted), step time.

    python benchmarks/bench_optimizers.py                           # 20M Llama, seq 128, batch 8, 40 steps (CPU)
    python benchmarks/bench_optimizers.py --steps 20 --seq-len 64 --batch 4   # shorter, for a loaded machine
    python benchmarks/bench_optimizers.py --out docs/benchmarks.md  # also write the table into the docs
    python benchmarks/bench_optimizers.py --quick                   # toy model, a smoke run

Every optimizer trains the same model (built with a fixed seed) on the same windows of the bundled corpus in the
same order, through memfit's optimizer factory (memfit.techniques.small_state_optimizers), each in a fresh process.
The loss is the mean of the last 5 steps' training losses; state is the bytes held by the optimizer after the last
step (measured) beside memfit's formula (memfit.models.optimizer_state); step time is the median over the steps
after the first two. A recorded figure, not a quality claim: 40 steps say little about where each converges.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from _common import emit_result, machine_description, markdown_table, median, run_worker, today, write_section

SECTION = "Small-state optimizers: loss after N steps and state bytes"
OPTIMIZERS = ["adamw", "adamw-8bit", "galore-adamw", "apollo-adamw", "apollo-mini", "adam-mini", "adamw-4bit"]


def _windows(seq_len: int, count: int):
    import torch

    corpus = Path(__file__).resolve().parents[1] / "src/memfit/data/corpus/corpus.txt"
    data = torch.tensor(list(corpus.read_bytes()), dtype=torch.long)
    usable = data[: (len(data) // seq_len) * seq_len].view(-1, seq_len)
    return usable[torch.randperm(len(usable), generator=torch.Generator().manual_seed(0))[:count]]


def worker(spec: dict) -> None:
    import torch
    from _common import llama_config
    from transformers import LlamaForCausalLM

    from memfit.config import OptimizerConfig
    from memfit.models.optimizer_state import SMALL_STATE_OPTIMIZERS, named_trainable
    from memfit.models.state_bytes import (
        optimizer_state_bytes_for_shapes,
        parameter_inventory,
        small_state_optimizer_bytes,
    )
    from memfit.techniques.optimizers import build_optimizer, measured_optimizer_state_bytes, parameter_groups
    from memfit.techniques.small_state_optimizers import build_run_optimizer

    torch.set_num_threads(spec["threads"])
    torch.manual_seed(0)
    hf_config = llama_config(spec["shape"])
    model = LlamaForCausalLM(hf_config)
    config = OptimizerConfig(optimizer=spec["optimizer"], lr=spec["lr"], weight_decay=0.0)
    groups = parameter_groups(model, 0.0)
    device = torch.device("cpu")
    if spec["optimizer"] in SMALL_STATE_OPTIMIZERS:
        choice = build_run_optimizer(model, groups, config, device, False, {})
        predicted = small_state_optimizer_bytes(config, parameter_inventory(hf_config), 4, False)
    else:
        choice = build_optimizer(groups, config, device)
        predicted = optimizer_state_bytes_for_shapes(
            spec["optimizer"], [t.shape for t in named_trainable(model)], 4, fused_step=True)
    optimizer = choice.optimizer
    batches = _windows(spec["seq_len"], spec["steps"] * spec["batch"]).view(spec["steps"], spec["batch"], -1)
    losses, times = [], []
    for ids in batches:
        start = time.perf_counter()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    emit_result({"name": choice.name, "loss": sum(losses[-5:]) / 5, "first_loss": losses[0],
                 "state": measured_optimizer_state_bytes(optimizer), "predicted": predicted,
                 "step_seconds": median(times[2:])})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="write the table into this markdown file")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--worker")
    args = parser.parse_args()
    if args.worker:
        import json

        worker(json.loads(args.worker))
        return
    spec = {"shape": "quick" if args.quick else "20m", "seq_len": args.seq_len, "batch": args.batch,
            "steps": 10 if args.quick else args.steps,
            "lr": 1e-3, "threads": 1}
    rows, adamw_state = [], None
    for name in OPTIMIZERS:
        result = run_worker(__file__, {**spec, "optimizer": name}, timeout=1800)
        adamw_state = adamw_state or result["state"]
        rows.append([f"`{name}`", result["name"], f"{result['first_loss']:.3f} -> {result['loss']:.3f}",
                     f"{result['state'] / 2**20:.2f}", f"{result['predicted'] / 2**20:.2f}",
                     f"{result['state'] / adamw_state:.3f}", f"{result['step_seconds']:.3f}"])
        print(" | ".join(rows[-1]), flush=True)
    table = markdown_table(["--optimizer", "ran", f"loss (step 1 -> mean of last 5 of {spec['steps']})",
                            "state measured (MiB)", "state predicted (MiB)", "state / AdamW's", "step (s)"], rows)
    command = " ".join(sys.argv[1:]).replace(f"--out {args.out}", "").strip()
    body = (f"`python benchmarks/bench_optimizers.py {command}`: {spec['shape']} Llama"
            f" (tied embeddings), seq {spec['seq_len']}, batch {spec['batch']}, lr {spec['lr']}, clipping 1.0, fp32,"
            f" defaults of each optimizer (GaLore/APOLLO rank 128 over every Linear, APOLLO-Mini rank 1),"
            f" {today()}, {machine_description('cpu')}.\n\n{table}\n")
    print(body)
    if args.out:
        write_section(args.out, SECTION, body)


if __name__ == "__main__":
    sys.exit(main())
