"""The accumulation check can fail: a 2x gradient error in the split run breaks the equality.

The equality itself (8 x 1 == 2 x 4 == 1 x 8 under SGD without clipping) is
tests/unit/train/test_accumulation.py; here the same comparison runs once clean and
once with every backward pass doubled (a loss normalizer half its size, as when each
micro-batch is divided by its own token count), and must then fail.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from fault_injection import SGD_NO_CLIPPING, largest_update, scaled_gradients
from memfit.config_loading import load_config
from memfit.train.loop import train


def _weights(llama_dir, text_file, out, batch: int, accumulation: int) -> dict:
    config = load_config(overrides=dict(
        model=str(llama_dir), dataset=str(text_file), seq_len=64, packing=False, batch_size=batch,
        gradient_accumulation_steps=accumulation, max_steps=1, lr=0.5, loss_chunk_size=0, output_dir=str(out),
        **SGD_NO_CLIPPING,
    ))
    return load_file(str(train(config).final_dir / "model.safetensors"))


def _assert_same(a: dict, b: dict) -> None:
    for name, tensor in a.items():
        torch.testing.assert_close(b[name], tensor, atol=1e-6, rtol=0, msg=name)


def test_accumulation_check_fails_on_a_2x_gradient_error(llama_dir, text_file, tmp_path):
    initial = load_file(str(llama_dir / "model.safetensors"))
    big_batch = _weights(llama_dir, text_file, tmp_path / "8x1", 8, 1)
    assert largest_update(initial, big_batch) > 1e-2  # the update is large beside the tolerance
    _assert_same(big_batch, _weights(llama_dir, text_file, tmp_path / "2x4", 2, 4))
    with scaled_gradients(2.0):
        faulty = _weights(llama_dir, text_file, tmp_path / "2x4-fault", 2, 4)
    with pytest.raises(AssertionError):
        _assert_same(big_batch, faulty)
