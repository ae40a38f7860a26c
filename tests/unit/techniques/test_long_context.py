"""A long sequence on CPU under an emulated memory cap: offloaded checkpoints + tiled MLP make it fit.

The run goes through `memfit.train` with `--memory-cap` (the tracker enforces the cap on
CPU, counting offloaded copies as host memory, as a GPU run would keep them off the device).
"""

from __future__ import annotations

import random

import pytest
import torch

from memfit.config_loading import load_config
from memfit.errors import DoesNotFitError
from memfit.train.loop import train
from memfit.train.metrics import read_metrics

# 8K tokens with a 512-token loss chunk: every tensor the cap weighs (block inputs, MLP tiles, the loss chunk's
# logits) is half its size at 16K with a 1024-token chunk, so the same three runs fit or not against the same
# cap, while attention, quadratic in the length, costs a quarter (16K took 40 s of the suite's time).
SEQ_LEN = 8192
LOSS_CHUNK = 512
HIDDEN = 16
LAYERS = 4
TILES = 8


@pytest.fixture(scope="module")
def long_run_inputs(tmp_path_factory):
    """A 4-block Llama with a wide MLP (8 x hidden), saved to disk, and one SEQ_LEN-token window of text."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from memfit.models.tiny import byte_tokenizer

    root = tmp_path_factory.mktemp("long")
    config = LlamaConfig(
        vocab_size=257,
        hidden_size=HIDDEN,
        intermediate_size=8 * HIDDEN,
        num_hidden_layers=LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=2 * SEQ_LEN,
        eos_token_id=256,
        pad_token_id=256,
        bos_token_id=256,
    )
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
    byte_tokenizer().save_pretrained(root / "model")
    rng = random.Random(0)
    words = "memory gradient batch token model layer the a of to in training fits device loss step".split()
    (root / "corpus.txt").write_text(" ".join(rng.choice(words) for _ in range(SEQ_LEN // 3)))
    return root


def run(root, name: str, cap: int | None = None, **techniques):
    config = load_config(
        overrides=dict(
            model=str(root / "model"),
            dataset=str(root / "corpus.txt"),
            seq_len=SEQ_LEN,
            batch_size=1,
            max_steps=1,
            gradient_checkpointing="full",
            loss_chunk_size=LOSS_CHUNK,
            optimizer="sgd",
            lr=0.1,
            max_grad_norm=0.0,
            track_memory=True,
            memory_cap=cap,
            output_dir=str(root / name),
            **techniques,
        )
    )
    return train(config)


@pytest.mark.slow
def test_a_long_window_fits_the_cap_only_with_offloaded_checkpoints_and_tiled_mlp(long_run_inputs):
    root = long_run_inputs
    both = dict(activation_offload=True, tiled_mlp=TILES)
    uncapped = run(root, "uncapped", **both)
    # Between the run with both and the run without offload, which keeps all four block inputs
    # (one [SEQ_LEN x 16] fp32 tensor each) where offload keeps two.
    block_input = SEQ_LEN * HIDDEN * 4
    cap = uncapped.tracked_peak_bytes + block_input

    capped = run(root, "capped", cap, **both)
    records = read_metrics(root / "capped" / "metrics.jsonl")
    assert not [r for r in records if r.get("event") == "oom"]
    assert capped.steps == 1 and capped.tracked_peak_bytes <= cap
    assert capped.final_loss == uncapped.final_loss
    host_peak = max(step.host_peak_bytes for step in capped.memory_steps)
    assert host_peak >= LAYERS * block_input  # the block inputs waited in host memory
    print(
        f"{SEQ_LEN} tokens: tracked device peak {capped.tracked_peak_bytes} B under a cap of {cap} B, host peak {host_peak} B"
    )

    for name, techniques in (("tiled-only", dict(tiled_mlp=TILES)), ("neither", dict(tiled_mlp=0))):
        # Micro-batch 1 with checkpointing and chunked loss on: nothing left to split or switch on.
        with pytest.raises(DoesNotFitError, match="out of memory"):
            run(root, name, cap, **techniques)
