"""How close are memfit's estimates to the measured peak of real training steps?

Runs real CPU training steps (forward, backward, clipping, optimizer) of small models
built from transformers configs and measures the peak of live tensor bytes, then
compares the `analytical` and `traced` estimates with it. Writes a markdown table.

    python benchmarks/bench_estimate_accuracy.py --out docs/accuracy_table.md

The measurement is memfit.memory.tracker.MemoryTracker on the second of two real
steps (optimizer state allocated), the same tracker `memfit profile` uses.
"""

from __future__ import annotations

import argparse
import itertools
import platform
import sys
import time

import torch

from memfit.config_loading import load_config
from memfit.prediction.estimator import estimate
from memfit.prediction.run_shape import resolve_run
from memfit.prediction.traced import StepSetup
from memfit.train.traced import measure_step_with_allocator, measure_step_with_tracker


def architectures() -> dict:
    from transformers import AutoConfig, GPT2Config, LlamaConfig, MistralConfig, Phi3Config, Qwen2Config

    common = dict(hidden_size=128, intermediate_size=352, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1000, max_position_embeddings=1024)
    return {
        "llama": LlamaConfig(**common),
        "qwen2": Qwen2Config(**common, tie_word_embeddings=True),
        "mistral": MistralConfig(**common, sliding_window=None),
        "phi3": Phi3Config(**{**common, "num_key_value_heads": 4}, pad_token_id=0),
        "gpt2": GPT2Config(n_embd=128, n_layer=4, n_head=4, vocab_size=1000, n_positions=1024),
        # families outside the closed forms: their blocks are measured (memfit.prediction.layer_probe)
        **{name: AutoConfig.for_model(name, **common, bos_token_id=1, eos_token_id=2, pad_token_id=0, **extra)
           for name, extra in (("starcoder2", {}), ("gemma3_text", {"head_dim": 32}), ("gpt_neox", {}),
                               ("qwen3", {"head_dim": 32}), ("olmo2", {}))},
    }


VARIANTS = {
    "adamw": {},
    "adamw ckpt": {"gradient_checkpointing": "full"},
    "adamw-8bit": {"optimizer": "adamw-8bit"},
    "bf16 autocast": {"precision": "bf16"},
    "lora r8": {"lora_r": 8},
    "lora r8 bf16 ckpt": {"lora_r": 8, "dtype": "bf16", "gradient_checkpointing": "full"},
}


def measured_peak(hf_config, config, device: str = "cpu") -> int:
    """Peak of a real steady-state step: live tensor bytes on CPU, the allocator's peak on CUDA."""
    run = resolve_run(config, hf_config, None)
    dtypes = {4: torch.float32, 2: torch.bfloat16}
    setup = StepSetup(
        config.training.batch_size, config.data.seq_len, dtypes[run.weight_bytes],
        torch.bfloat16 if run.autocast else None, run.attention, run.checkpointing, run.checkpoint_every,
        run.loss_chunk_size, torch.device(device),
    )
    if device == "cuda":
        return measure_step_with_allocator(hf_config, config, setup)
    return measure_step_with_tracker(hf_config, config, setup)


class AccuracyTable:
    """The markdown table of measured peaks against both estimates, row by row, with each method's error summary."""

    def __init__(self) -> None:
        self.rows: list[str] = []
        self.errors: dict[str, list[float]] = {"analytical": [], "traced": []}
        self.started = time.time()

    def add(self, name: str, variant: str, seq_len: int, truth: int, analytical: int, traced: int) -> None:
        a_err, t_err = analytical / truth - 1, traced / truth - 1
        self.errors["analytical"].append(a_err)
        self.errors["traced"].append(t_err)
        self.rows.append(f"| {name} | {variant} | {seq_len} | {truth / 2**20:.1f} | {analytical / 2**20:.1f} | "
                         f"{100 * a_err:+.1f}% | {traced / 2**20:.1f} | {100 * t_err:+.1f}% |")
        print(self.rows[-1], file=sys.stderr, flush=True)

    def text(self, device_name: str, batch_size: int) -> str:
        header = [
            f"Measured {time.strftime('%Y-%m-%d')} on {device_name} ({torch.get_num_threads()} threads), torch"
            f" {torch.__version__}, batch {batch_size}; {time.time() - self.started:.0f} s.",
            "",
            "| model | variant | seq | measured MiB | analytical MiB | error | traced MiB | error |",
            "|---|---|---|---|---|---|---|---|",
        ]
        summary = [""]
        for method, values in self.errors.items():
            worst = max(abs(v) for v in values)
            mean = sum(abs(v) for v in values) / len(values)
            summary.append(f"- {method}: mean |error| {100 * mean:.1f}%, worst {100 * worst:.1f}% over {len(values)} runs")
        return "\n".join(header + self.rows + summary) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="write the markdown table here as well as to stdout")
    parser.add_argument("--seq-lens", default="128,512")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="cuda: measure with torch.cuda.max_memory_allocated instead of the tracker")
    parser.add_argument("--archs", default=None, help="comma-separated subset of: llama, qwen2, mistral, phi3, gpt2, starcoder2, gemma3_text, gpt_neox, qwen3, olmo2")
    args = parser.parse_args(argv)
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    table = AccuracyTable()
    chosen = {name: hf for name, hf in architectures().items() if args.archs is None or name in args.archs.split(",")}
    for (arch_name, hf_config), (variant, changes), seq_len in itertools.product(chosen.items(), VARIANTS.items(), seq_lens):
        config = load_config(overrides={"seq_len": seq_len, "batch_size": args.batch_size, **changes})
        truth = measured_peak(hf_config, config, args.device)
        analytical = estimate(config, hf_config=hf_config).peak_bytes
        traced = estimate(config, hf_config=hf_config, method="traced").peak_bytes
        table.add(arch_name, variant, seq_len, truth, analytical, traced)
    device_name = torch.cuda.get_device_name(0) if args.device == "cuda" else platform.processor() or platform.machine()
    text = table.text(device_name, args.batch_size)
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
