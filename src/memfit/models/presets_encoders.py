"""Offline presets of common DNA and protein encoder shapes (registered into models.presets.MODEL_PRESETS).

Each preset holds the numbers of the published config.json of its Hugging Face id, so that
`memfit estimate --model esm2-650m --task sequence-classification` works without the network.
Where the published model runs its own code (trust_remote_code) and transformers has no class
for it, the preset builds the closest transformers architecture, and `differs` says what
changes and how the numbers were adapted to keep the parameter count and the FLOPs:

- Nucleotide Transformer v2 (InstaDeepAI, ESM code of its own): a gated SiLU MLP
  (hidden -> 2 x intermediate, then intermediate -> hidden, no biases). Built as transformers'
  ESM with a plain GELU MLP 1.5x as wide (the same weights and FLOPs a token), rotary
  positions as published; its unused absolute-position table (2050 x hidden, about 2 % of the
  50M model) is not built.
- DNABERT-2 (zhihan1996, BERT code of its own): ALiBi attention biases instead of position
  embeddings, a gated GELU MLP, unpadded attention. Built as transformers' BERT with the MLP
  1.5x as wide (same weights and FLOPs) and BERT's learned 512-position table (0.4M weights),
  so sequences stop at 512 positions where ALiBi would extrapolate.
- ESM-2 (facebook) and ModernBERT (answerdotai) are transformers classes: built as published.

`published_parameters` is the size published for the model: the count its Hugging Face page
shows, or the size in its name where the page shows none (ESM-2: 8M ... 3B). Tests check the
meta build against it within 8 %: the names round, and ESM-2's checkpoints hold an unused
absolute-position table that transformers no longer builds for rotary models.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

# ESM-2: vocabulary of 33 amino-acid and special tokens, 1026 positions (1024 residues + BOS/EOS), rotary,
# token dropout; the LM head is tied to the embeddings.
_ESM2 = {"position_embedding_type": "rotary", "token_dropout": True, "emb_layer_norm_before": False,
         "layer_norm_eps": 1e-5, "mask_token_id": 32, "pad_token_id": 1, "hidden_act": "gelu"}
# Nucleotide Transformer v2: 6-mer vocabulary of 4107 tokens, 2050 positions (12 kb), rotary, separate LM head.
_NT_V2 = {"position_embedding_type": "rotary", "token_dropout": False, "emb_layer_norm_before": False,
          "layer_norm_eps": 1e-12, "mask_token_id": 2, "pad_token_id": 1}
# The gated MLP as a plain one of the same weights: 3 x hidden x intermediate = 2 x hidden x (1.5 x intermediate).
GATED_WIDTH = 1.5


@dataclass(frozen=True)
class EncoderPreset:
    """The architecture numbers of a published encoder config (the fields models.presets.ModelPreset has, and more)."""

    name: str
    hf_id: str
    model_type: str
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    """As published; `built_intermediate_size` is what the transformers class gets."""
    vocab_size: int
    max_positions: int
    tie_embeddings: bool
    published_parameters: int
    extra: dict[str, Any]
    gated_mlp: bool = False
    """The published model's MLP is gated (2 x intermediate in): built 1.5x as wide, see the module docstring."""
    differs: str = ""
    """What the built architecture changes from the published one (empty: built as published)."""

    @property
    def num_kv_heads(self) -> int:
        return self.num_heads  # encoders attend with every head's keys and values

    @property
    def built_intermediate_size(self) -> int:
        return round(self.intermediate_size * GATED_WIDTH) if self.gated_mlp else self.intermediate_size

    def to_hf_config(self) -> Any:
        """The transformers config of this architecture (as the masked-LM checkpoint is published)."""
        from transformers import AutoConfig

        fields = dict(hidden_size=self.hidden_size, num_hidden_layers=self.num_layers,
                      num_attention_heads=self.num_heads, intermediate_size=self.built_intermediate_size,
                      max_position_embeddings=self.max_positions, vocab_size=self.vocab_size,
                      tie_word_embeddings=self.tie_embeddings, **copy.deepcopy(self.extra))
        config = AutoConfig.for_model(self.model_type, **fields)
        config.name_or_path = self.hf_id
        # As the published config.json says: models.presets.build_meta_model builds the masked LM, not a causal one.
        config.architectures = [{"esm": "EsmForMaskedLM", "bert": "BertForMaskedLM",
                                 "modernbert": "ModernBertForMaskedLM"}[self.model_type]]
        return config


def _esm2(name: str, hf_id: str, hidden: int, layers: int, heads: int, published: int) -> EncoderPreset:
    return EncoderPreset(name, hf_id, "esm", hidden, layers, heads, 4 * hidden, 33, 1026, True, published, _ESM2)


_NT_DIFFERS = ("gated SiLU MLP without biases built as ESM's GELU MLP 1.5x wide (same weights); the unused"
               " absolute-position table not built")


def _nt_v2(size: str, hidden: int, layers: int, published: int) -> EncoderPreset:
    return EncoderPreset(f"nt-v2-{size}", f"InstaDeepAI/nucleotide-transformer-v2-{size}-multi-species", "esm", hidden,
                         layers, 16, 4 * hidden, 4107, 2050, False, published, _NT_V2, gated_mlp=True,
                         differs=_NT_DIFFERS)


ENCODER_PRESETS: dict[str, EncoderPreset] = {
    p.name: p
    for p in (
        # facebook/esm2_*_UR50D config.json: hidden 320/480/640/1280/2560, 20 heads (40 for 3B), intermediate 4 x hidden;
        # sizes as named.
        _esm2("esm2-8m", "facebook/esm2_t6_8M_UR50D", 320, 6, 20, 8_000_000),
        _esm2("esm2-35m", "facebook/esm2_t12_35M_UR50D", 480, 12, 20, 35_000_000),
        _esm2("esm2-150m", "facebook/esm2_t30_150M_UR50D", 640, 30, 20, 150_000_000),
        _esm2("esm2-650m", "facebook/esm2_t33_650M_UR50D", 1280, 33, 20, 650_000_000),
        _esm2("esm2-3b", "facebook/esm2_t36_3B_UR50D", 2560, 36, 40, 3_000_000_000),
        # InstaDeepAI/nucleotide-transformer-v2-*-multi-species config.json (50m: 55.9M and 100m: 97.9M on their pages;
        # 250m: its 941 MB fp32 checkpoint; 500m: 0.5B).
        _nt_v2("50m", 512, 12, 55_900_000),
        _nt_v2("100m", 512, 22, 97_900_000),
        _nt_v2("250m", 768, 24, 235_000_000),
        _nt_v2("500m", 1024, 29, 500_000_000),
        # zhihan1996/DNABERT-2-117M config.json: BERT numbers, model code of its own (ALiBi, gated MLP).
        EncoderPreset("dnabert-2-117m", "zhihan1996/DNABERT-2-117M", "bert", 768, 12, 12, 3072, 4096, 512, True,
                      117_000_000, {"type_vocab_size": 2, "layer_norm_eps": 1e-12, "pad_token_id": 0},
                      gated_mlp=True,
                      differs="ALiBi built as BERT's learned 512 positions; gated GELU MLP built as BERT's MLP 1.5x wide"
                              " (same weights); padded instead of unpadded attention"),
        # answerdotai/ModernBERT-base config.json.
        EncoderPreset("modernbert-base", "answerdotai/ModernBERT-base", "modernbert", 768, 22, 12, 1152, 50368, 8192,
                      True, 149_000_000, {"global_attn_every_n_layers": 3, "local_attention": 128,
                                          "pad_token_id": 50283, "bos_token_id": 50281, "eos_token_id": 50282}),
    )
}
