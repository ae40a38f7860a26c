"""Tiny encoders (BERT-like, ESM-like) and a DNA tokenizer built from configs and saved: nothing is downloaded."""

from __future__ import annotations

import csv
import random
from pathlib import Path

import torch
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import BertConfig, BertForMaskedLM, EsmConfig, EsmForMaskedLM, PreTrainedTokenizerFast

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
BASES = ["A", "C", "G", "T", "N"]


def dna_tokenizer() -> PreTrainedTokenizerFast:
    """One token a base, [CLS] ... [SEP] around each sequence (as BERT-style DNA models read them)."""
    vocab = {token: i for i, token in enumerate(SPECIALS + BASES)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    backend.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])]
    )
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]",
                                   sep_token="[SEP]", mask_token="[MASK]")


def bert_config(layers: int = 2, hidden: int = 32, max_positions: int = 256) -> BertConfig:
    return BertConfig(vocab_size=len(SPECIALS) + len(BASES), hidden_size=hidden, num_hidden_layers=layers,
                      num_attention_heads=4, intermediate_size=2 * hidden, max_position_embeddings=max_positions,
                      hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0)


def esm_config(layers: int = 2, hidden: int = 32, max_positions: int = 256) -> EsmConfig:
    return EsmConfig(vocab_size=len(SPECIALS) + len(BASES), hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=4, intermediate_size=2 * hidden, max_position_embeddings=max_positions,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0, mask_token_id=4,
                     position_embedding_type="rotary", token_dropout=False)


def save_encoder(directory: Path, family: str = "bert", seed: int = 0, **sizes) -> Path:
    """A masked-LM encoder of `family` (bert or esm) with the DNA tokenizer, saved with safetensors."""
    torch.manual_seed(seed)
    model = BertForMaskedLM(bert_config(**sizes)) if family == "bert" else EsmForMaskedLM(esm_config(**sizes))
    model.save_pretrained(directory, safe_serialization=True)
    dna_tokenizer().save_pretrained(directory)
    return Path(directory)


def dna_rows(count: int, seed: int = 0, min_length: int = 8, max_length: int = 40) -> list[dict]:
    """Sequences of varied length; the class says which base dominates (learnable), the value its GC share."""
    rng = random.Random(seed)
    rows = []
    for i in range(count):
        label = i % 3
        length = rng.randint(min_length, max_length)
        favoured = "ACG"[label]
        sequence = "".join(favoured if rng.random() < 0.5 else rng.choice("ACGT") for _ in range(length))
        gc = sum(base in "GC" for base in sequence) / length
        rows.append({"sequence": sequence, "label": ["low", "mid", "high"][label], "value": round(gc, 4),
                     "a": int("A" in sequence[:4]), "b": int("C" in sequence[:4]),
                     "tags": " ".join("1" if base in "GC" else "0" for base in sequence)})
    return rows


def write_csv(path: Path, rows: list[dict], delimiter: str = ",") -> Path:
    with open(path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]), delimiter=delimiter)
        writer.writeheader()
        writer.writerows(rows)
    return path
