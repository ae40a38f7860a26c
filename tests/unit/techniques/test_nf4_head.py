"""The frozen, untied output head held in NF4 under QLoRA (--quantize-head), projected a tile of rows at a time.

Numerics: memfit's chunked loss over the NF4 head gives the loss and every adapter gradient of the same model
holding the head's dequantized weights in a plain linear; a twin whose tiles read the wrong absmax fails.
Memory: the tracked device peak drops by the head's bytes less its NF4 bytes, never holding the whole dequantized
head (one tile: several tiles tested), and the estimate says the same saving. Refusals in one line.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from memfit.config import LoraConfig, TrainConfig
from memfit.errors import UsageError
from memfit.techniques import nf4_head
from memfit.techniques.loss import chunked_causal_lm_loss_sum
from memfit.techniques.nf4_head import Nf4Head, dequantized_rows, quantize_head
from memfit.techniques.nf4_state import block_absmax, nf4_bytes
from model_zoo import ZOO, build_model, randomize_adapters

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")


@pytest.fixture(autouse=True)
def small_tiles(monkeypatch):
    monkeypatch.setattr(nf4_head, "HEAD_TILE_WEIGHTS", 64 * 32)  # 64 rows of the tiny head a tile: 5 tiles of 257


def _qlora(family: str, quantized: bool):
    from memfit.techniques.lora import apply_lora

    model, _ = apply_lora(build_model(family), LoraConfig(lora_r=2), gradient_checkpointing=False)
    randomize_adapters(model)
    if quantized:
        assert quantize_head(model).startswith("output head (257, 32) in NF4")
    return model


def _to_plain_head(model) -> None:
    """Swap the NF4 head for a plain frozen linear holding its dequantized weights (in place: a deep copy of a
    model with split expert adapters would keep the original's bound forwards)."""
    lm = model.get_base_model()
    plain = nn.Linear(32, 257, bias=False)
    plain.weight = nn.Parameter(dequantized_rows(lm.lm_head.weight, 0, 257, torch.float32), requires_grad=False)
    lm.set_output_embeddings(plain)


def _loss_and_grads(model):
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    model.zero_grad(set_to_none=True)
    loss = chunked_causal_lm_loss_sum(model, tokens, tokens, None, chunk_size=16)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _same(model) -> bool:
    loss, grads = _loss_and_grads(model)
    _to_plain_head(model)
    expected_loss, expected = _loss_and_grads(model)
    assert set(grads) == set(expected) and all("lora_" in name for name in grads)
    return abs(loss - expected_loss) <= 1e-5 * abs(expected_loss) and all(
        (grads[name] - grad).norm() <= 1e-5 * grad.norm() for name, grad in expected.items())  # fp32 rounding


@pytest.mark.parametrize("family", ["llama", "gpt_oss"])
def test_the_nf4_head_gives_the_dequantized_heads_loss_and_adapter_gradients(family):
    model = _qlora(family, True)
    head = model.get_base_model().lm_head
    assert isinstance(head, Nf4Head) and head.weight.shape == (257, 16)  # the vocabulary first, as the tracker reads
    assert _same(model)


def test_fault_twin_tiles_read_with_the_wrong_absmax_are_caught(monkeypatch):
    model = _qlora("llama", True)
    real = nf4_head.dequantized_rows
    monkeypatch.setattr(nf4_head, "dequantized_rows", lambda w, first, last, dtype, absmax=None: real(
        w, first, last, dtype, torch.roll(block_absmax(w.quant_state), 3)))
    assert not _same(model)


def test_the_device_peak_drops_by_the_head_less_its_nf4_bytes_and_the_estimate_agrees():
    from memfit.memory.tracker import MemoryTracker
    from memfit.prediction.estimator import estimate

    peaks = {}
    for quantized in (False, True):
        model = _qlora("gpt_oss", quantized)
        tracker = MemoryTracker(torch.device("cpu"))
        tracker.attach(model)
        try:
            with tracker:
                _loss_and_grads(model)
                peaks[quantized] = tracker.end_step().peak_bytes
        finally:
            tracker.detach()
    head = model.get_base_model().lm_head.weight
    saved = 257 * 32 * 4 - nf4_bytes(head)
    # the tiles' working bytes (one 64-row tile and the fp32 absmax) stay under the bytes the head no longer holds
    assert 0.5 * saved < peaks[False] - peaks[True] <= 1.01 * saved, (peaks, saved)
    hf_config = ZOO["gpt_oss"]()
    settings = dict(model="tiny", lora_r=2, quantize="4bit", seq_len=24, batch_size=2, loss_chunk_size=16)
    base = estimate(TrainConfig.from_flat(settings), hf_config=hf_config)
    nf4 = estimate(TrainConfig.from_flat({**settings, "quantize_head": True}), hf_config=hf_config)
    estimated = base.breakdown["parameters"] - nf4.breakdown["parameters"]
    assert abs(estimated - saved) <= 0.02 * saved, (estimated, saved)


def test_a_trained_or_tied_head_stays_and_bad_flags_are_refused():
    assert quantize_head(build_model("llama")) == "off: the output head trains"
    tied = build_model("llama").requires_grad_(False)
    tied.lm_head.weight = tied.get_input_embeddings().weight
    assert "tied to the input embedding" in quantize_head(tied)
    with pytest.raises(UsageError, match="--quantize-head holds the frozen head in NF4 beside the 4-bit linears"):
        TrainConfig.from_flat(dict(model="tiny", lora_r=2, quantize_head=True)).validate()


def test_a_sharded_nf4_head_is_refused_in_one_line():
    with pytest.raises(UsageError, match="--quantize-head cannot be sharded"):
        TrainConfig.from_flat(dict(model="tiny", lora_r=2, quantize="4bit", quantize_head=True,
                                   sharding="fsdp")).validate(world_size=2)
