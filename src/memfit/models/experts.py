"""Where a mixture-of-experts model keeps its experts, and how many of its parameters a token uses.

transformers 5 stores a layer's experts as fused 3-D parameters (`experts.gate_up_proj` of shape
experts x 2*width x hidden, `experts.down_proj` experts x hidden x width; gpt-oss stores them transposed,
with biases) and runs them through `config._experts_implementation`: `grouped_mm` (one grouped matmul
per projection over the tokens sorted by expert, the default), `batched_mm`, or `eager` (a Python loop
over the experts hit). This module finds them from the modules themselves, never from a list of family
names, and reads the config numbers that say how many experts a token runs (`moe_shape`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

EXPERT_PARAMETERS = ("gate_up_proj", "up_proj", "down_proj")
"""The fused expert weights transformers' experts implementations read (3-D: experts x out x in, or x in x out)."""


def is_fused_experts(module: nn.Module) -> bool:
    """Whether `module` holds a layer's experts as fused 3-D parameters run by transformers' experts switch."""
    weights = [getattr(module, name, None) for name in EXPERT_PARAMETERS]
    fused = [w for w in weights if isinstance(w, nn.Parameter) and w.dim() == 3]
    return bool(fused) and isinstance(getattr(module, "num_experts", None), int)


def fused_expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(full name, module) of every fused-experts module of `model`, in model order."""
    return [(name, module) for name, module in model.named_modules() if is_fused_experts(module)]


def fused_expert_parameter_names(model: nn.Module) -> list[str]:
    """Full names of the fused 3-D expert weights (`model.layers.1.mlp.experts.gate_up_proj`, ...)."""
    names = []
    for prefix, module in fused_expert_modules(model):
        for name in EXPERT_PARAMETERS:
            weight = getattr(module, name, None)
            if isinstance(weight, nn.Parameter) and weight.dim() == 3:
                names.append(f"{prefix}.{name}")
    return names


def router_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(full name, module) of the routers: the sibling of an experts module whose weight scores the experts."""
    routers = []
    experts = {id(module): name for name, module in fused_expert_modules(model)}
    for name, module in model.named_modules():
        children = dict(module.named_children())
        if not any(id(child) in experts for child in children.values()):
            continue
        count = next(c.num_experts for c in children.values() if id(c) in experts)
        for child_name, child in children.items():
            weight = getattr(child, "weight", None)
            if id(child) not in experts and weight is not None and weight.dim() == 2 and weight.shape[0] == count:
                routers.append((f"{name}.{child_name}" if name else child_name, child))
    return routers


def experts_implementation(model: nn.Module) -> str | None:
    """The experts implementation that runs (`grouped_mm`, `batched_mm`, `eager`...), or None without experts.

    memfit's split-LoRA forward (techniques/expert_lora.py) marks the modules it takes over; it runs
    grouped_mm too, so the answer then says both.
    """
    modules = [module for _, module in fused_expert_modules(_base(model))]
    if not modules:
        return None
    names = set()
    for module in modules:
        config = getattr(module, "config", None)
        chosen = getattr(config, "_experts_implementation", None) or "eager"
        names.add(f"{chosen} + split LoRA" if getattr(module, "memfit_split_lora", False) else chosen)
    return ", ".join(sorted(names))


def _base(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


# ---------------------------------------------------------------------------
# Config numbers
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class MoeShape:
    """The numbers of a mixture-of-experts config that decide its parameters and FLOPs per token."""

    experts: int
    """Routed experts per MoE layer."""
    top_k: int
    """Experts each token runs."""
    expert_width: int
    """Intermediate width of one expert."""
    shared_width: int
    """Intermediate width of the shared expert(s) every token runs (0 without)."""
    moe_layers: int
    """Layers with experts; the others have a dense MLP of the config's intermediate_size."""
    gated: bool = True

    def active_width(self) -> int:
        """The MLP width one token runs through in an MoE layer (top-k experts and the shared ones)."""
        return self.top_k * self.expert_width + self.shared_width


def _first(config: Any, *names: str) -> Any:
    for name in names:
        value = getattr(config, name, None)
        if value:
            return value
    return None


def moe_shape(config: Any) -> MoeShape | None:
    """Read the MoeShape from a transformers config, or None for a dense model."""
    experts = _first(config, "num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
    top_k = _first(config, "num_experts_per_tok", "moe_topk", "top_k")
    if not isinstance(experts, int) or not isinstance(top_k, int) or experts <= 1:
        return None
    width = _first(config, "moe_intermediate_size", "expert_intermediate_size", "intermediate_size")
    shared = _first(config, "shared_expert_intermediate_size") or 0
    if not shared and _first(config, "n_shared_experts"):
        shared = config.n_shared_experts * width
    layers = config.num_hidden_layers
    dense = int(_first(config, "first_k_dense_replace") or 0)
    only_dense = set(_first(config, "mlp_only_layers") or ())
    step = int(_first(config, "decoder_sparse_step", "expert_layer_period") or 1)
    offset = int(_first(config, "expert_layer_offset") or 0) if _first(config, "expert_layer_period") else 0
    moe_layers = sum(
        1 for i in range(layers)
        if i >= dense and i not in only_dense and (i - offset) % step == 0 and i >= offset
    )
    gated = getattr(config, "model_type", "") not in ("gpt_neox",)
    return MoeShape(experts, top_k, int(width), int(shared), moe_layers, gated)


def total_and_active_parameters(model: nn.Module) -> tuple[int, int]:
    """All parameters of `model` and those one token runs through (routed experts counted top-k of n)."""
    base = _base(model)
    total = sum(p.numel() for p in base.parameters())
    shape = moe_shape(getattr(base, "config", None))
    if shape is None:
        return total, total
    idle = 0
    for _, module in fused_expert_modules(base):
        expert_weights = sum(p.numel() for p in module.parameters())
        idle += expert_weights * (module.num_experts - shape.top_k) // module.num_experts
    return total, total - idle


def experts_facts(model: nn.Module) -> dict | None:
    """For the metrics: which experts implementation ran, total and active parameters; None for a dense model."""
    implementation = experts_implementation(model)
    if implementation is None:
        return None
    total, active = total_and_active_parameters(model)
    return {"implementation": implementation, "total_parameters": total, "active_parameters": active,
            "experts_modules": len(fused_expert_modules(_base(model)))}
