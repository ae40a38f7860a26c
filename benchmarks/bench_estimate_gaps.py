"""Three terms of the analytical estimate against memfit's own counts, on CPU.

1. Where the head's and the embedding's gradients live: --optimizer-in-backward (tied and
   untied), tied embeddings, the chunked loss. Two real training steps through
   `memfit.train.profiling.profile_run` (MemoryTracker) against `estimate()`.
2. A tiled MLP's backward: `memfit.prediction.activations.tiled_mlp_backward_bytes` against a
   live-storage count of one tiled MLP's backward (the count of tests/unit/memory/test_tiled_mlp_memory.py).
3. Automatic checkpointing: `predicted_peak_bytes` against MemoryTracker's peak of two AdamW
   steps with 0-4 of 4 blocks checkpointed.

    python benchmarks/bench_estimate_gaps.py
"""

from __future__ import annotations

import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

MIB = 2**20


def _save(directory: Path, **shape) -> Path:
    from memfit.models.tiny import save_llama

    return save_llama(directory, **shape)


def gradients_of_head_and_embedding(root: Path) -> None:
    from memfit.config_loading import load_config
    from memfit.prediction.estimator import estimate
    from memfit.train.profiling import profile_run

    corpus = root / "corpus.txt"
    corpus.write_text("memory gradient batch token model layer training fits device loss step\n\n" * 2000)
    models = {}
    for tied in (False, True):
        name = "tied" if tied else "untied"
        models[f"wide {name}"] = _save(root / f"wide_{name}", hidden_size=256, intermediate_size=704,
                                       num_hidden_layers=2, tie_word_embeddings=tied)
        models[f"v2048 {name}"] = _save(root / f"v2048_{name}", vocab_size=2048, hidden_size=256,
                                        intermediate_size=704, num_hidden_layers=2, tie_word_embeddings=tied)
        models[f"v8192 {name}"] = _save(root / f"v8192_{name}", vocab_size=8192, hidden_size=64,
                                        intermediate_size=176, num_hidden_layers=2, tie_word_embeddings=tied)
    cases = [
        ("wide", {"seq_len": 32, "optimizer_in_backward": True}),
        ("wide", {"seq_len": 32, "optimizer_in_backward": True, "optimizer": "adamw-8bit"}),
        ("v2048", {"seq_len": 32, "optimizer_in_backward": True}),
        ("v8192", {"seq_len": 16, "optimizer_in_backward": True}),
        ("v8192", {"seq_len": 16, "optimizer_in_backward": True, "optimizer": "adamw-8bit"}),
        ("v8192", {"seq_len": 16, "optimizer": "adamw-8bit"}),
        ("v8192", {"seq_len": 16, "loss_chunk_size": 8}),
        ("v8192", {"seq_len": 16, "loss_chunk_size": 8, "optimizer": "adamw-8bit"}),
    ]
    print("| model (layers 2) | embeddings | changes | measured MiB | analytical MiB | error |")
    print("|---|---|---|---|---|---|")
    for shape, changes in cases:
        for name in ("untied", "tied"):
            config = load_config(overrides={
                "model": str(models[f"{shape} {name}"]), "dataset": str(corpus), "batch_size": 2, "max_steps": 2,
                "log_every": 1000, "output_dir": str(root / "run"), "report": False, **changes})
            predicted = estimate(config).peak_bytes
            measured = profile_run(config)[0].to_dict()["peak_bytes"]
            shown = ", ".join(f"{k}={v}" for k, v in changes.items())
            print(f"| {shape} | {name} | {shown} | {measured / MIB:.2f} | {predicted / MIB:.2f} "
                  f"| {predicted / measured - 1:+.1%} |", flush=True)


def tiled_mlp_backward() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "unit" / "memory"))
    from test_tiled_mlp_memory import BATCH, CASES, SEQ, _config, _measured_backward_peak

    from memfit.prediction.activations import architecture_of, tiled_mlp_backward_bytes

    print("\n| tiled MLP (hidden 128, intermediate 352, 1024 tokens) | tiles | counted B | closed form B | error "
          "| two tiles' share (before) | error |")
    print("|---|---|---|---|---|---|---|")
    arch = architecture_of(_config())
    from memfit.prediction.activations import mlp_bytes_per_token

    for name, (autocast, lora, dtype, precision, *efficient_lora) in CASES.items():
        for tiles in (4, 8):
            measured = _measured_backward_peak(tiles, autocast, lora, dtype, efficient_lora=bool(efficient_lora))
            predicted = tiled_mlp_backward_bytes(arch, precision, BATCH * SEQ, tiles)
            before = 2 * mlp_bytes_per_token(arch, precision) * BATCH * SEQ / tiles
            print(f"| {name} | {tiles} | {measured} | {predicted:.0f} | {predicted / measured - 1:+.1%} "
                  f"| {before:.0f} | {before / measured - 1:+.1%} |", flush=True)


def automatic_checkpointing() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "unit" / "techniques"))
    from test_selective_checkpointing import measured_training_peak, tiny_llama

    from memfit.config import TrainConfig
    from memfit.techniques.auto_checkpointing import measure_saved_bytes, predicted_peak_bytes, static_training_parts
    from memfit.techniques.checkpointing import apply_gradient_checkpointing

    config = TrainConfig()
    config.data.seq_len, config.training.batch_size = 64, 2
    input_ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    model = tiny_llama(layers=4).train()
    per_sample, outside = measure_saved_bytes(model, {"input_ids": input_ids[:1], "labels": input_ids[:1]})
    per_block = [2 * size for size in per_sample]
    weights, gradients, states = static_training_parts(model, config)
    fixed = weights + gradients + states + 2 * outside
    kept = 2 * 64 * 64 * 4
    moments = {"gradient_bytes": gradients, "loss_backward_bytes": 2 * 4 * 2 * 64 * 256}
    print("\n| auto checkpointing (Llama, 4 blocks, hidden 64, 2 x 64 tokens) | blocks checkpointed "
          "| tracker B | predicted B | error |")
    print("|---|---|---|---|---|")
    for blocks in range(5):
        model = tiny_llama(layers=4).train()
        if blocks:
            apply_gradient_checkpointing(model, "full", block_indices=list(range(blocks)))
        measured = measured_training_peak(model, input_ids)
        predicted = predicted_peak_bytes(per_block, fixed, kept, list(range(blocks)), **moments)
        print(f"| | {blocks} | {measured} | {predicted} | {predicted / measured - 1:+.1%} |", flush=True)


def main() -> None:
    started = time.time()
    print(f"Measured {time.strftime('%Y-%m-%d')} on {platform.machine()} ({torch.get_num_threads()} threads), "
          f"torch {torch.__version__}\n")
    with tempfile.TemporaryDirectory() as root:
        gradients_of_head_and_embedding(Path(root))
    tiled_mlp_backward()
    automatic_checkpointing()
    print(f"\n{time.time() - started:.0f} s")


if __name__ == "__main__":
    main()
