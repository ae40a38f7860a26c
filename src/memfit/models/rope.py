"""RoPE scaling: train a model on more positions than it was trained on (a context-extension fine-tune).

`--rope-scale F` multiplies the model's positions by F before the model is built: the rotary
embedding's frequencies are rescaled through transformers' own RoPE types
(`config.rope_parameters`, transformers.modeling_rope_utils), and `max_position_embeddings`
becomes F x the original, so `memfit train` accepts windows up to it. It changes the model's
numerics at every position (the rotations differ), so the model needs a fine-tune at the new
length before it is good at it; the saved model keeps the scaled config.

Types (`--rope-scaling`):
- linear: position interpolation, every frequency divided by F;
- yarn: interpolates low frequencies, keeps high ones, and scales attention by 0.1 ln F + 1;
- llama3: Llama 3.1's own scheme; a model that has it keeps it, its factor multiplied by F;
- auto (default): the model's own type when it already scales (linear, yarn, llama3), else yarn.
Dynamic NTK is not offered: it recomputes the frequencies from each batch's length, so a fine-tune
would learn frequencies that other lengths do not use.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from memfit.errors import UsageError

ROPE_TYPES = ("linear", "yarn", "llama3")
"""The RoPE types --rope-scale can extend (transformers' names)."""
DEFAULT_TYPE = "yarn"
"""The type given to a model whose RoPE is unscaled, under --rope-scaling auto."""


@dataclass(frozen=True)
class RopeScaling:
    """What --rope-scale did to a model config (the log, the metrics and the run summary say it)."""

    rope_type: str
    scale: float
    """The factor asked for (--rope-scale)."""
    config_factor: float
    """The factor now in the config's rope_parameters (the model's own factor x scale for a scaled model)."""
    positions_before: int
    positions_after: int

    def describe(self) -> str:
        return (f"{self.rope_type} x{self.scale:g} (rope_parameters factor {self.config_factor:g}):"
                f" {self.positions_before:,} -> {self.positions_after:,} positions")


def model_positions(hf_config: Any) -> int | None:
    """The most positions the model config says it handles (learned or rotary), if it says."""
    return getattr(hf_config, "max_position_embeddings", None) or getattr(hf_config, "n_positions", None)


def _rope_parameters(hf_config: Any) -> dict[str, Any] | None:
    params = getattr(hf_config, "rope_parameters", None)
    return params if isinstance(params, dict) and params else None


def can_scale(hf_config: Any) -> bool:
    """Whether --rope-scale can extend this model (rotary positions of a type it extends)."""
    try:
        _check(hf_config, "auto")
    except UsageError:
        return False
    return True


def _check(hf_config: Any, kind: str) -> str:
    """The RoPE type the scaled model will use; UsageError (one line) when it cannot be scaled."""
    model_type = getattr(hf_config, "model_type", "this model")
    params = _rope_parameters(hf_config)
    if params is None or model_positions(hf_config) is None:
        raise UsageError(f"--rope-scale needs a model with rotary position embeddings (RoPE); {model_type}"
                         " has none (its positions are learned): lower --seq-len instead")
    if "rope_type" not in params and "type" not in params:
        # per-layer RoPE (one dict per attention type, as Gemma 3 has): which to scale is the model's design
        raise UsageError(f"--rope-scale does not extend {model_type}'s per-layer RoPE parameters")
    current = params.get("rope_type", params.get("type", "default"))
    if current not in ("default",) + ROPE_TYPES:
        raise UsageError(f"--rope-scale cannot extend {model_type}'s {current!r} RoPE scaling;"
                         f" it extends {', '.join(ROPE_TYPES)} or unscaled RoPE")
    if kind == "auto":
        return DEFAULT_TYPE if current == "default" else current
    if current != "default" and kind != current:
        raise UsageError(f"{model_type} already uses {current} RoPE scaling (factor {params.get('factor')});"
                         f" --rope-scaling must be {current} (or auto) to extend it")
    if current == "default" and kind == "llama3":
        raise UsageError("--rope-scaling llama3 extends a model that already uses it (Llama 3.1 and later);"
                         " use linear or yarn for this model")
    return kind


def scaled_positions(hf_config: Any, scale: float | None, kind: str = "auto") -> int | None:
    """The positions of the model once scaled by `scale` (the model's own without it); config unchanged.

    Raises UsageError when `scale` is given and the model cannot be scaled.
    """
    positions = model_positions(hf_config)
    if scale is None:
        return positions
    _check(hf_config, kind)
    return _times(positions, scale)


def _times(positions: int, scale: float) -> int:
    return int(round(positions * scale))


def apply_rope_scale(hf_config: Any, scale: float | None, kind: str = "auto") -> RopeScaling | None:
    """Scale the model config's RoPE in place, before the model is built from it.

    None (and nothing changed) without `scale` or at scale 1. Raises UsageError when the
    model has no RoPE or a type this cannot extend.
    """
    if scale is None:
        return None
    if not math.isfinite(scale) or scale < 1:
        raise UsageError(f"--rope-scale must be a number of at least 1, got {scale}")
    rope_type = _check(hf_config, kind)
    if scale == 1:
        return None  # the identity: the config, and so the model, stay exactly as they were
    params = dict(_rope_parameters(hf_config))
    before = model_positions(hf_config)
    after = _times(before, scale)
    if params.get("rope_type", params.get("type", "default")) == "default":
        # The new positions over the old ones, exactly: transformers checks YaRN's factor against that ratio.
        factor = after / before
        params.update(rope_type=rope_type, factor=factor)
        if rope_type == "yarn":
            params["original_max_position_embeddings"] = before
    else:
        # A scaled model keeps its pretraining length and its type; only the factor grows.
        factor = float(params["factor"]) * scale
        params["factor"] = factor
    params.pop("type", None)
    params["rope_type"] = rope_type
    hf_config.rope_parameters = params
    hf_config.max_position_embeddings = after
    return RopeScaling(rope_type, float(scale), factor, before, after)


def suggested_scale(positions: int, wanted: int) -> int:
    """The smallest whole --rope-scale whose positions reach `wanted` tokens."""
    return max(2, math.ceil(wanted / positions))
