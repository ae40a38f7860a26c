"""Exact gradient accumulation: any split of the effective batch gives the same update."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from memfit.config_loading import load_config
from memfit.train.loop import train


def _weights_after_one_update(model_dir, text_file, out, batch: int, accumulation: int, optimizer: str = "sgd"):
    config = load_config(
        overrides=dict(
            model=str(model_dir), dataset=str(text_file), seq_len=64, packing=False,
            batch_size=batch, gradient_accumulation_steps=accumulation, max_steps=1,
            optimizer=optimizer, lr=1.0 if optimizer == "sgd" else 1e-3, max_grad_norm=0, loss_chunk_size=0,
            output_dir=str(out / f"{batch}x{accumulation}"),
        )
    )
    result = train(config)
    return load_file(str(result.final_dir / "model.safetensors")), result


@pytest.mark.parametrize("model_fixture", ["llama_dir", "gpt2_dir"])
def test_split_of_effective_batch_gives_same_weights(model_fixture, request, text_file, tmp_path):
    model_dir = request.getfixturevalue(model_fixture)
    reference, ref_result = _weights_after_one_update(model_dir, text_file, tmp_path, 8, 1)
    for batch, accumulation in ((2, 4), (1, 8)):
        weights, result = _weights_after_one_update(model_dir, text_file, tmp_path, batch, accumulation)
        assert result.losses[0] == pytest.approx(ref_result.losses[0], abs=1e-6)
        for name, tensor in reference.items():
            torch.testing.assert_close(weights[name], tensor, atol=1e-6, rtol=0, msg=f"{name} differs at {batch}x{accumulation}")


def test_mean_of_micro_batch_means_would_differ(text_file, llama_dir):
    """The data really has variable-length samples, so the naive normalization would be wrong."""
    from memfit.data import collate, load_training_data
    from memfit.models.loader import load_tokenizer

    config = load_config(overrides=dict(model=str(llama_dir), dataset=str(text_file), seq_len=64, packing=False))
    from dataclasses import replace

    dataset = load_training_data(replace(config.data, cache_dir=None), load_tokenizer(str(llama_dir), False))
    lengths = {int((dataset[i]["labels"] != -100).sum()) for i in range(16)}
    assert len(lengths) > 1
    assert collate([dataset[0], dataset[1]], 256)["input_ids"].shape[0] == 2
