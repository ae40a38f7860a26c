"""Which models may pack samples, and what the run says about how attention stays within each sample."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from memfit.config import DataConfig
from memfit.data.packing import PackedDataset
from memfit.techniques.packed_attention import (
    attention_restriction,
    block_mask_bytes,
    pack_for_model,
    packed_mask_estimate,
    packing_facts,
    positions_not_read,
    stateful_layers,
)
from tiny_llama import tiny_llama


class Samples(torch.utils.data.Dataset):
    def __init__(self, lengths):
        self.lengths = np.asarray(lengths, dtype=np.int64)

    def __len__(self):
        return len(self.lengths)

    def __getitem__(self, index):
        ids = torch.arange(int(self.lengths[index]))
        return {"input_ids": ids, "labels": ids.clone()}


def test_attention_only_models_pack():
    from transformers import GPT2Config, GPT2LMHeadModel

    assert stateful_layers(tiny_llama()) == ""
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32))
    assert stateful_layers(gpt2) == ""  # its Conv1D modules are linear layers


def test_state_space_model_refuses_samples_and_runs_off(caplog):
    from transformers import MambaConfig, MambaForCausalLM

    mamba = MambaForCausalLM(MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, state_size=4))
    assert "mamba" in stateful_layers(mamba)
    samples, fallbacks = Samples([5, 6, 7, 8]), {}
    with caplog.at_level(logging.WARNING, logger="memfit"):
        chosen = pack_for_model(samples, "auto", True, mamba, "sdpa", 32, 1, fallbacks)
    assert chosen is samples
    assert "--packing samples refused (mamba layers carry state across positions)" in fallbacks["packing"]
    assert "(off)" in caplog.text
    assert packing_facts(chosen) == {"mode": "off"}


def test_models_are_detected_by_their_layers_not_only_their_name():
    class ConvMixer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = type("Config", (), {"model_type": "custom"})()
            self.mixer = torch.nn.Conv1d(8, 8, 3, groups=8)

    assert "convolution over positions" in stateful_layers(ConvMixer())
    hybrid = tiny_llama()
    hybrid.config.layer_types = ["full_attention", "linear_attention"]
    assert "linear_attention layers carry state" in stateful_layers(hybrid)


def test_model_that_builds_its_own_mask_is_not_packed():
    """Remote code that does not use transformers' masking utilities would let samples see each other."""

    class OwnMaskModel(torch.nn.Module):  # defined here: this test module imports no mask builder
        config = type("Config", (), {"model_type": "custom"})()

        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(4, 4)

    fallbacks = {}
    samples = Samples([5, 6])
    assert pack_for_model(samples, "samples", True, OwnMaskModel(), "sdpa", 32, 1, fallbacks) is samples
    assert "does not build its attention mask with transformers' masking utilities" in fallbacks["packing"]
    assert positions_not_read(tiny_llama()) == ""


def test_packed_run_names_its_attention_restriction():
    fallbacks = {}
    packed = pack_for_model(Samples([5, 6, 7, 8, 30]), "samples", True, tiny_llama(), "sdpa", 32, 1, fallbacks)
    assert isinstance(packed, PackedDataset) and fallbacks == {}
    facts = packing_facts(packed)
    assert facts["mode"] == "samples" and facts["rows"] == 2 and facts["samples"] == 5
    assert facts["attention_restriction"] == attention_restriction("sdpa")
    assert "flash-attn variable-length" in attention_restriction("flash")


def test_plain_text_auto_stays_wrapped(tmp_path, text_file):
    from memfit.config import DataConfig
    from memfit.data import load_training_data
    from memfit.models.tiny import byte_tokenizer

    tokenizer = byte_tokenizer()
    wrapped = load_training_data(DataConfig(dataset=str(text_file), seq_len=64, cache_dir=str(tmp_path)), tokenizer)
    assert pack_for_model(wrapped, "auto", None, tiny_llama(), "sdpa", 64, 1, {}) is wrapped
    assert packing_facts(wrapped) == {"mode": "wrapped"}
    documents = load_training_data(DataConfig(dataset=str(text_file), seq_len=64, packing="samples",
                                              cache_dir=str(tmp_path)), tokenizer)
    packed = pack_for_model(documents, "samples", None, tiny_llama(), "sdpa", 64, 1, {})
    assert len(packed) < len(documents) and packed.facts()["efficiency"] > 0.9


def test_block_mask_bytes_square_in_the_length_and_only_under_sdpa():
    assert block_mask_bytes(2, 1024, "sdpa", layers_holding=2, element_bytes=4) == 2 * 1024 * 1024 * 9
    assert block_mask_bytes(2, 1024, "sdpa", 2, 4, expanded_kv_bytes_per_token=256) == 2 * 1024 * (1024 * 9 + 2 * 256)
    assert block_mask_bytes(2, 1024, "eager") == 0  # eager builds the same mask for plain causal rows
    assert block_mask_bytes(2, 1024, "flash") == 0


def _tracked_step_peak(layers: int, batch: int, seq_len: int, packed: bool) -> int:
    from memfit.memory.tracker import MemoryTracker
    from memfit.techniques.loss import causal_lm_loss_sum

    model = tiny_llama(layers=layers, max_positions=1024)  # 4 query heads, 2 key-value heads
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(0, 256, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    positions = torch.cat([torch.arange(100), torch.arange(seq_len - 100)]).expand(batch, seq_len)
    tracker = MemoryTracker("cpu")
    tracker.attach(model)
    try:
        with tracker:
            causal_lm_loss_sum(model, ids, ids, None, 0, **({"position_ids": positions} if packed else {})).backward()
        return tracker.peak_bytes
    finally:
        tracker.detach()


@pytest.mark.parametrize("layers", [4, 6])
def test_mask_bytes_bound_the_tracked_cost_of_packed_rows(layers):
    """The tracker's peak of a packed step minus a plain causal one, against what the estimator adds (fp32, CPU)."""
    from memfit.prediction.activations import architecture_of

    batch, seq_len = 2, 512
    measured = _tracked_step_peak(layers, batch, seq_len, True) - _tracked_step_peak(layers, batch, seq_len, False)
    arch = architecture_of(tiny_llama(layers=layers, max_positions=1024).config)
    predicted = packed_mask_estimate(DataConfig(seq_len=seq_len, packing="samples"), batch, "sdpa", "off", arch, 4)
    assert measured <= predicted <= 1.05 * measured


def test_estimator_counts_the_mask_where_samples_packing_runs(llama_dir):
    from memfit.config_loading import load_config
    from memfit.prediction.activations import architecture_of
    from memfit.prediction.estimator import estimate

    def peak(**settings):
        config = load_config(overrides=dict(model=str(llama_dir), seq_len=256, batch_size=4, precision="fp32", **settings))
        return estimate(config)

    arch = architecture_of(tiny_llama(layers=2).config)
    off, packed = peak(packing="off"), peak(packing="samples")
    expected = block_mask_bytes(4, 256, "sdpa", 2, 4, 2 * (arch.q_width - arch.kv_width) * 4)
    assert packed.details["packed_mask_bytes"] == expected
    assert packed.breakdown["activations"] - off.breakdown["activations"] == expected
    assert packed.peak_bytes - off.peak_bytes == expected
    assert "packed_mask_bytes" not in peak(packing="samples", attention="flash").details
    assert "packed_mask_bytes" not in peak(packing="auto").details  # plain text: wrapped
    assert peak(packing="auto", dataset="builtin:chat").details["packed_mask_bytes"] == expected
    checkpointed = peak(packing="samples", gradient_checkpointing="full")
    assert checkpointed.details["packed_mask_bytes"] == block_mask_bytes(
        4, 256, "sdpa", 1, 4, 2 * (arch.q_width - arch.kv_width) * 4)


def test_packed_rows_on_a_gpu_take_flex_attention_instead_of_sdpas_mask():
    """Where SDPA would build the batch x seq x seq mask on a GPU, packed rows run FlexAttention's block mask;
    on the CPU (no FlexAttention backward), with flash-attn, with a kernel the user named, or on a model
    without FlexAttention, nothing changes."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from memfit.techniques.packed_attention import flex_for_packed_rows

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert flex_for_packed_rows(tiny_llama(), "auto", "sdpa", cuda)
    assert flex_for_packed_rows(tiny_llama(), "flex", "sdpa", cuda)
    assert not flex_for_packed_rows(tiny_llama(), "auto", "sdpa", cpu)
    assert not flex_for_packed_rows(tiny_llama(), "auto", "flash", cuda)
    assert not flex_for_packed_rows(tiny_llama(), "sdpa", "sdpa", cuda)
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    assert not flex_for_packed_rows(gpt2, "auto", "sdpa", cuda)
    assert "no seq x seq" in attention_restriction("flex")


def test_flex_asked_on_the_cpu_runs_sdpa_and_says_why():
    from memfit.techniques.attention import choose_attention

    choice = choose_attention("flex", torch.device("cpu"), None)
    assert choice.implementation == "sdpa" and choice.fell_back and "no backward on the CPU" in choice.reason


def test_estimator_counts_no_mask_for_packed_rows_on_a_gpu(llama_dir):
    """A GPU plan of packed samples: FlexAttention runs, so no seq x seq mask is counted; --attention sdpa keeps it."""
    from memfit.config_loading import load_config
    from memfit.prediction.estimator import estimate

    def details(**settings):
        config = load_config(overrides=dict(model=str(llama_dir), seq_len=256, batch_size=4, packing="samples",
                                            **settings))
        return estimate(config, gpu="rtx-4090").details

    assert "packed_mask_bytes" not in details()
    assert details(attention="sdpa")["packed_mask_bytes"] > 0


@pytest.mark.gpu
def test_flex_attention_keeps_packed_samples_apart_on_cuda():
    """On CUDA: the switched model gives each packed sample the logits it has alone (bf16 tolerance)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    # Rows of 256 tokens and heads of 32 dimensions: at 128 query tokens or fewer inductor takes its decoding
    # kernel, which has no valid configuration for the tiny model's 16-dimension heads.
    samples = Samples([97, 40, 101, 12])
    packed = PackedDataset(samples, 256)
    model = tiny_llama(hidden=128, max_positions=256).to("cuda", torch.bfloat16).eval()
    pack_for_model(samples, "samples", True, model, "sdpa", 256, 1, {}, "auto", torch.device("cuda"))
    assert model.config._attn_implementation == "flex_attention"
    rows = [packed[i] for i in range(len(packed))]
    with torch.no_grad():
        for r, members in enumerate(packed.rows):
            row = rows[r]
            logits = model(input_ids=row["input_ids"][None].cuda(), position_ids=row["position_ids"][None].cuda()).logits
            start = 0
            for index in members.tolist():
                ids = samples[index]["input_ids"][None].cuda()
                alone = model(input_ids=ids).logits
                torch.testing.assert_close(logits[0, start : start + ids.shape[1]].float(), alone[0].float(),
                                           atol=3e-2, rtol=3e-2)
                start += ids.shape[1]
