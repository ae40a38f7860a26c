"""Attention that stays within each packed sample, and the models that cannot be packed this way.

A row of `--packing samples` reaches the model with `position_ids` restarting at each sample
and no attention mask (padding beyond a short row has positions 0, 0, ...: each pad token is
a one-token sample of its own, carrying no loss). From those positions transformers finds
the sample boundaries (`masking_utils.find_packed_sequence_indices`) and restricts attention
with the kernel the model runs:

- flash-attn (CUDA, when installed): its variable-length path, from the positions; no mask
  is built, nothing grows with the square of the length;
- FlexAttention (CUDA without flash-attn, `--attention auto` or `flex`): a document block
  mask built from the positions, a few bytes per 128 x 128 tile, no `seq x seq` tensor;
  the run switches the model to it when it packs samples (PyTorch has no FlexAttention
  backward on the CPU, so CPU runs keep SDPA's mask);
- PyTorch SDPA or eager: a block-diagonal causal mask of `batch x seq x seq` booleans, built
  once per forward and kept for backward. That is memory a plain causal row never costs
  (SDPA's causal fast path builds no mask): the estimator counts it (`block_mask_bytes`).

Models whose layers carry state from one position to the next (Mamba/Mamba-2, Hyena, RWKV,
linear-attention and convolution blocks) would pass that state across a sample boundary
whatever the attention mask says, and a model whose code does not build its mask with
transformers' masking utilities would not read the boundaries from the positions: `samples`
is refused for both, visibly, and `off` runs.
"""

from __future__ import annotations

import logging
import sys
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


# transformers' mask builders that find packed samples from position_ids (masking_utils).
_PACKING_AWARE_MASKS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_masks_for_generate")


def positions_not_read(model: torch.nn.Module) -> str:
    """Why the model would not restrict attention from position_ids alone ('' when it does).

    transformers' own models build their masks with `masking_utils`, which finds the samples
    of a packed row from its positions; a model whose code builds its mask otherwise (remote
    code, older ports) would let each sample attend to the one before it, silently.
    """
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    lm = getattr(lm, "_orig_mod", lm)
    for part in (lm, getattr(lm, "model", None), getattr(lm, "transformer", None)):
        if part is None:
            continue
        code = sys.modules.get(type(part).__module__)
        if any(hasattr(code, name) for name in _PACKING_AWARE_MASKS):
            return ""
    return f"{type(lm).__name__} does not build its attention mask with transformers' masking utilities, which find samples from position_ids"


def attention_restriction(attention: str) -> str:
    """How the kernel that runs keeps attention within each sample (memfit's kernel names)."""
    if attention == "flash":
        return "flash-attn variable-length kernel from position_ids"
    if attention == "flex":
        return "FlexAttention with a document block mask from position_ids (no seq x seq tensor)"
    if attention in ("sdpa", "eager"):
        return f"{attention} with a block-diagonal causal mask (batch x seq x seq booleans)"
    return f"{attention}: transformers' document mask from position_ids"


def block_mask_bytes(batch: int, seq_len: int, attention: str, layers_holding: int = 1, element_bytes: int = 4,
                     expanded_kv_bytes_per_token: int = 0) -> int:
    """Bytes that packed rows add to a step under SDPA (an upper bound; 0 for eager and flash-attn).

    - transformers' block-diagonal mask: one boolean per (query, key) pair of each row,
      alive through the forward;
    - PyTorch's SDPA turns a boolean mask into an additive one of the attention's dtype
      (`element_bytes`) in every attention call and keeps it for that call's backward:
      `layers_holding` of them at once (every layer without checkpointing, one under full);
    - with a mask, transformers hands SDPA keys and values repeated to every query head
      (grouped-query attention is not used with a mask): `expanded_kv_bytes_per_token` more
      per layer held, `2 x (query width - key-value width) x element_bytes`.

    Measured on CPU in fp32 (tests/unit/techniques/test_packed_attention.py): the estimate is
    at most 5 % over the tracked cost at 4 and 6 layers. Eager attention builds the same-sized
    mask for plain causal rows already; flash-attn's variable-length path needs no mask.
    """
    if attention != "sdpa":
        return 0
    pairs = batch * seq_len * seq_len
    return pairs * (1 + layers_holding * element_bytes) + layers_holding * batch * seq_len * expanded_kv_bytes_per_token


def packs_samples(data_cfg: Any) -> bool:
    """Whether a run of `data_cfg` will pack whole samples, as far as the settings alone say.

    `--packing samples`, or `auto` on data known to be supervised before it is read (a
    `--dataset-format` other than text, or the bundled chat set); a file whose format is
    only found by reading it counts as plain text here.
    """
    packing = getattr(data_cfg, "packing", "auto")
    if packing is True:
        packing = "auto"
    if packing != "auto":
        return packing == "samples"
    dataset_format = getattr(data_cfg, "dataset_format", "auto")
    return dataset_format not in ("auto", "text") or str(getattr(data_cfg, "dataset", "") or "").startswith("builtin:chat")


def flex_for_packed_rows(model: torch.nn.Module, requested: str, running: str, device: torch.device) -> str:
    """Why packed rows should run FlexAttention instead of SDPA's block mask ('' when they should not).

    Only where SDPA would build the mask (flash-attn's variable-length path needs none), the
    user left the kernel to memfit (`auto`) or asked for flex, the device is a CUDA GPU
    (PyTorch's FlexAttention has no backward on the CPU) and the model's transformers class
    supports it.
    """
    if running != "sdpa" or requested not in ("auto", "flex") or device.type != "cuda":
        return ""
    lm = model.get_base_model() if hasattr(model, "get_base_model") else model
    if not getattr(lm, "_supports_flex_attn", False):
        return ""
    from torch.nn.attention import flex_attention  # noqa: F401  (PyTorch builds without it raise here)

    return "packed rows: FlexAttention's document block mask instead of SDPA's batch x seq x seq mask"


def pack_for_model(dataset: Any, requested: str, supervised: bool | None, model: torch.nn.Module, attention: str,
                   seq_len: int, min_rows: int, fallbacks: dict[str, str], requested_attention: str = "auto",
                   device: torch.device | None = None) -> Any:
    """The dataset the run trains on: `dataset` packed into rows when `samples` runs, else as it is.

    `dataset` holds whole samples (a `lengths` array and dict items); `requested` is --packing;
    `supervised` (None: anything but plain text windows) decides what `auto` means.
    A model whose layers carry state across positions runs `off` instead of `samples`, and
    says so in `fallbacks`. Raises UsageError when the packed rows are fewer than `min_rows`.
    """
    if getattr(dataset, "packed_by_task", False):  # the task packs the rows it trains on itself (GRPO's completions)
        return dataset
    if supervised is None:
        supervised = not isinstance(dataset, TokenizedDataset)
    mode = resolve_packing(requested, supervised)
    if mode != "samples":
        return dataset
    why = stateful_layers(model) or positions_not_read(model)
    if why:
        note = f"--packing samples refused ({why}): one sample per row, padded (off)"
        fallbacks["packing"] = note
        log.warning("memfit: packing: %s", note)
        return dataset
    if not hasattr(dataset, "lengths"):
        raise UsageError("--packing samples needs samples of known length; use --packing off")
    packed = PackedDataset(dataset, seq_len, min_rows=min_rows)
    why_flex = flex_for_packed_rows(model, requested_attention, attention, device or torch.device("cpu"))
    if why_flex:
        model.set_attn_implementation("flex_attention")
        attention = "flex"
        log.info("memfit: attention: %s", why_flex)
    packed.attention_restriction = attention_restriction(attention)
    return packed


def packing_facts(dataset: Any) -> dict[str, Any]:
    """What the metrics' start and summary lines record about packing (mode, efficiency, kernel)."""
    facts = getattr(dataset, "facts", None)
    if callable(facts):
        return facts()
    return {"mode": "wrapped" if getattr(dataset, "packing", False) is True else "off"}


def flex_class_supported(hf_config: Any) -> bool:
    """Whether the causal-LM class transformers builds for `hf_config` runs FlexAttention."""
    from transformers import AutoModelForCausalLM

    model_class = AutoModelForCausalLM._model_mapping.get(type(hf_config), None) if hf_config is not None else None
    return bool(getattr(model_class, "_supports_flex_attn", False))


def packed_mask_estimate(data_cfg: Any, batch: int, attention: str, checkpointing: str, arch: Any,
                         element_bytes: int, requested_attention: str = "auto", device_type: str = "cpu",
                         hf_config: Any = None) -> int:
    """What the estimator adds for packed rows (0 unless `samples` packing runs under SDPA).

    `arch`: the model's shape (memory.activations.Architecture: layers, q_width, kv_width).
    On a GPU a run that packs samples switches SDPA to FlexAttention where the model supports it
    (`flex_for_packed_rows`), which builds no `seq x seq` mask: nothing is added then.
    """
    if not packs_samples(data_cfg):
        return 0
    if (device_type == "cuda" and attention == "sdpa" and requested_attention in ("auto", "flex")
            and flex_class_supported(hf_config)):
        return 0
    holding = 1 if checkpointing == "full" else arch.layers
    expanded = 2 * max(0, arch.q_width - arch.kv_width) * element_bytes
    return block_mask_bytes(batch, data_cfg.seq_len_or_default, attention, holding, element_bytes, expanded)
