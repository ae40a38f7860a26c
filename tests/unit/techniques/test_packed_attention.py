"""Which models may pack samples, and what the run says about how attention stays within each sample."""

from __future__ import annotations

import logging

import numpy as np
import torch

from memfit.data.packing import PackedDataset
from memfit.techniques.packed_attention import (
    attention_restriction,
    block_mask_bytes,
    pack_for_model,
    packing_facts,
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


def test_block_mask_bytes_square_in_the_length_and_none_for_flash():
    assert block_mask_bytes(2, 1024, "sdpa") == 2 * 1024 * 1024
    assert block_mask_bytes(2, 1024, "eager") == block_mask_bytes(2, 1024, "sdpa")
    assert block_mask_bytes(2, 1024, "flash") == 0
