"""Attention that stays within each packed sample, and the models that cannot be packed this way.

A row of `--packing samples` reaches the model with `position_ids` restarting at each sample
and no attention mask (padding beyond a short row has positions 0, 0, ...: each pad token is
a one-token sample of its own, carrying no loss). From those positions transformers finds
the sample boundaries (`masking_utils.find_packed_sequence_indices`) and restricts attention
with the kernel the model runs:

- flash-attn (CUDA, when installed): its variable-length path, from the positions; no mask
  is built, nothing grows with the square of the length;
- PyTorch SDPA or eager: a block-diagonal causal mask of `batch x seq x seq` booleans, built
  once per forward and kept for backward. That is memory a plain causal row never costs
  (SDPA's causal fast path builds no mask): the estimator counts it (`block_mask_bytes`).

Models whose layers carry state from one position to the next (Mamba/Mamba-2, Hyena, RWKV,
linear-attention and convolution blocks) would pass that state across a sample boundary
whatever the attention mask says: `samples` is refused for them, visibly, and `off` runs.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from memfit.data.dataset import TokenizedDataset
from memfit.data.packing import PackedDataset, resolve_packing
from memfit.errors import UsageError

log = logging.getLogger("memfit")

# model_type of families with recurrent, state-space or convolutional sequence mixing.
STATEFUL_MODEL_TYPES = frozenset({
    "mamba", "mamba2", "falcon_mamba", "falcon_h1", "jamba", "zamba", "zamba2", "bamba", "nemotron_h",
    "granitemoehybrid", "rwkv", "rwkv5", "rwkv6", "rwkv7", "recurrent_gemma", "xlstm", "lfm2", "lfm2_moe",
    "qwen3_next", "minimax", "hyena", "stripedhyena", "plamo2", "kimi_linear", "olmo_hybrid",
})
# Words in the class names of sequence-mixing blocks that keep state across positions.
STATEFUL_MODULE_WORDS = ("Mamba", "SSM", "Hyena", "Rwkv", "RWKV", "GatedDeltaNet", "LinearAttention", "ShortConv", "Recurrent")
ATTENTION_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention", "attention"})


def stateful_layers(model: torch.nn.Module) -> str:
    """Why the model's layers carry state across positions ('' when attention is its only sequence mixing)."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", "") or ""
    if model_type in STATEFUL_MODEL_TYPES:
        return f"{model_type} layers carry state across positions"
    other_layers = sorted(set(getattr(config, "layer_types", None) or []) - ATTENTION_LAYER_TYPES)
    if other_layers:
        return f"its {', '.join(map(str, other_layers))} layers carry state across positions"
    for name, module in model.named_modules():
        kind = type(module).__name__
        if isinstance(module, torch.nn.Conv1d):  # transformers' GPT-2 `Conv1D` is a linear layer, not this
            return f"{name or 'the model'} is a convolution over positions ({kind})"
        if any(word in kind for word in STATEFUL_MODULE_WORDS):
            return f"{name or 'the model'} ({kind}) carries state across positions"
    return ""


def attention_restriction(attention: str) -> str:
    """How the kernel that runs keeps attention within each sample (memfit's kernel names)."""
    if attention == "flash":
        return "flash-attn variable-length kernel from position_ids"
    if attention in ("sdpa", "eager"):
        return f"{attention} with a block-diagonal causal mask (batch x seq x seq booleans)"
    return f"{attention}: transformers' document mask from position_ids"


def block_mask_bytes(batch: int, seq_len: int, attention: str) -> int:
    """Bytes of the block-diagonal mask that SDPA and eager attention need for packed rows.

    One boolean per (query, key) pair of each row, alive from the model's first layer to
    the end of its backward; flash-attn's variable-length path needs none.
    """
    return 0 if attention == "flash" else batch * seq_len * seq_len


def pack_for_model(dataset: Any, requested: str, supervised: bool | None, model: torch.nn.Module, attention: str,
                   seq_len: int, min_rows: int, fallbacks: dict[str, str]) -> Any:
    """The dataset the run trains on: `dataset` packed into rows when `samples` runs, else as it is.

    `dataset` holds whole samples (a `lengths` array and dict items); `requested` is --packing;
    `supervised` (None: anything but plain text windows) decides what `auto` means.
    A model whose layers carry state across positions runs `off` instead of `samples`, and
    says so in `fallbacks`. Raises UsageError when the packed rows are fewer than `min_rows`.
    """
    if supervised is None:
        supervised = not isinstance(dataset, TokenizedDataset)
    mode = resolve_packing(requested, supervised)
    if mode != "samples":
        return dataset
    why = stateful_layers(model)
    if why:
        note = f"--packing samples refused ({why}): one sample per row, padded (off)"
        fallbacks["packing"] = note
        log.warning("memfit: packing: %s", note)
        return dataset
    if not hasattr(dataset, "lengths"):
        raise UsageError("--packing samples needs samples of known length; use --packing off")
    packed = PackedDataset(dataset, seq_len, min_rows=min_rows)
    packed.attention_restriction = attention_restriction(attention)
    return packed


def packing_facts(dataset: Any) -> dict[str, Any]:
    """What the metrics' start and summary lines record about packing (mode, efficiency, kernel)."""
    facts = getattr(dataset, "facts", None)
    if callable(facts):
        return facts()
    return {"mode": "wrapped" if getattr(dataset, "packing", False) is True else "off"}
