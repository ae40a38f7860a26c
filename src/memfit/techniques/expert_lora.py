"""LoRA on the fused experts of a mixture-of-experts model, without a per-expert weight delta ("split LoRA").

transformers 5 keeps a layer's experts as fused 3-D parameters (experts x out x in) run by grouped matmuls.
PEFT adapts them through `LoraConfig(target_parameters=...)`: one rank-r pair per expert, held by a
`ParamWrapper` in PEFT's format (saved, loaded and merged as any PEFT adapter). Its forward, though,
folds the adapter into the weight for the duration of the call: `W + scaling * B A`, a new tensor as large
as the layer's whole expert stack, and its gradient, as large again, in backward. For Qwen3-30B-A3B's 48
layers of 128 experts that is 2 x 1.2 GiB in bf16 per layer on top of the frozen weights.

Split LoRA (`apply_split_lora`, on whenever experts carry adapters) keeps PEFT's adapter weights and
replaces only that computation: per projection, the tokens sorted by expert run
`grouped_mm(x, W) + scaling * grouped_mm(grouped_mm(x, A), B)`, so each expert's rank-r product is
computed for its own tokens and nothing expert-stack-sized is ever built; the frozen weight gets no
gradient. Saves: the folded weight and its gradient (2 x the stack of each adapted projection, per
layer, transient). Costs: two thin grouped matmuls per adapted projection (rank r wide).

Numerics: the same sums as the folded form, in another order (x W + x A B instead of x (W + A B)): fp32
within ~1e-6 relative. The routing (the router's top-k and weights) is computed by the model as before,
and stays frozen unless named in `--lora-targets`.

Where: experts modules that are what this forward replaces: transformers' `@use_experts_implementation`
classes (attributes `num_experts`, `has_gate`, `has_bias`, `is_transposed`, and a forward taking
`(hidden_states, top_k_index, top_k_weights)`, gpt-oss's names aside), not split across ranks (expert parallelism). Any other
keeps PEFT's folded forward, named in what `apply_split_lora` returns.
"""

from __future__ import annotations

import inspect
import logging
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from memfit.errors import UsageError
from memfit.models.experts import EXPERT_PARAMETERS, fused_expert_modules, fused_expert_parameter_names, router_modules
from memfit.techniques.expert_quant import is_nf4, nf4_grouped_mm, quantize_experts_module

log = logging.getLogger("memfit")

EXPERT_NAMES = ("experts", *EXPERT_PARAMETERS)
"""Names `--lora-targets` accepts for the fused experts: all of them, or one projection."""
ROUTER_NAMES = ("router",)
"""The name that trains the routers in full (they stay frozen unless named)."""


ROUTED_INDEX_NAMES = ("top_k_index", "router_indices")
ROUTED_WEIGHT_NAMES = ("top_k_weights", "routing_weights")
"""What transformers' experts forwards call their second and third inputs (gpt-oss: router_indices, routing_weights)."""


@dataclass
class ExpertTargets:
    """What `--lora-targets` asks of a model's experts and routers."""

    parameters: list[str] = field(default_factory=list)
    """Full names of the fused expert weights that get adapters (PEFT's target_parameters)."""
    routers: list[str] = field(default_factory=list)
    """Full names of the router modules trained in full (PEFT's modules_to_save)."""


def split_target_names(model: nn.Module, wanted: list[str], auto: bool) -> tuple[list[str], ExpertTargets]:
    """Split `--lora-targets` names into those for linear layers and those for the experts and routers.

    `auto`: every fused expert weight of the model gets an adapter (the default targets of an MoE model).
    Returns the names left for linear layers and the expert targets. Raises UsageError when experts or
    routers are named on a model that has none, naming the flag.
    """
    fused = fused_expert_parameter_names(model)
    routers = [name for name, _ in router_modules(model)]
    targets = ExpertTargets(parameters=list(fused) if auto else [])
    rest = []
    for name in wanted:
        if name in ROUTER_NAMES:
            if not routers:
                raise UsageError(f"--lora-targets {name}: this model has no expert router; drop {name!r}")
            targets.routers = routers
            continue
        matches = [full for full in fused if name == "experts" or full == name or full.endswith("." + name)]
        if name == "experts" and not fused:
            raise UsageError(
                "--lora-targets experts: this model has no fused experts (it is not a mixture of experts);"
                " use auto, all-linear or module names"
            )
        targets.parameters += [full for full in matches if full not in targets.parameters]
        if name != "experts":
            rest.append(name)  # a projection name may also name linear layers (a dense layer's down_proj)
    return rest, targets


# ---------------------------------------------------------------------------
# The split forward
# ---------------------------------------------------------------------------


@dataclass
class _Chain:
    """PEFT's nesting for one experts module: the outer ParamWrapper, the experts, parameter -> wrapper."""

    outer: nn.Module
    experts: nn.Module
    wrappers: dict[str, nn.Module]


def _param_wrapper_class():
    from peft.tuners.lora.layer import ParamWrapper

    return ParamWrapper


def _chains(model: nn.Module) -> list[_Chain]:
    wrapper_class = _param_wrapper_class()
    inner = {id(m.base_layer) for m in model.modules() if isinstance(m, wrapper_class)}
    chains = []
    for module in model.modules():
        if not isinstance(module, wrapper_class) or id(module) in inner:
            continue
        wrappers, layer = {}, module
        while isinstance(layer, wrapper_class):
            wrappers[layer.parameter_name] = layer
            layer = layer.base_layer
        chains.append(_Chain(module, layer, wrappers))
    return chains


def _why_not_split(chain: _Chain) -> str | None:
    reason = _why_not_grouped(chain.experts)
    if reason is None and any(len(w.active_adapters) != 1 for w in chain.wrappers.values()):
        return "several active adapters"
    return reason


def _why_not_grouped(experts: nn.Module) -> str | None:
    """Why memfit's grouped forward cannot stand in for this experts module's own, or None when it can."""
    needed = ("num_experts", "has_gate", "has_bias", "is_transposed")
    missing = [name for name in needed if not hasattr(experts, name)]
    if missing:
        return f"{type(experts).__name__} lacks {', '.join(missing)}"
    if getattr(experts, "_is_expert_parallel", False):
        return f"{type(experts).__name__} is split across ranks"
    try:
        parameters = list(inspect.signature(type(experts).forward).parameters)[1:]
    except (TypeError, ValueError):
        return f"{type(experts).__name__}'s forward has no signature"
    if (len(parameters) != 3 or parameters[0] != "hidden_states" or parameters[1] not in ROUTED_INDEX_NAMES
            or parameters[2] not in ROUTED_WEIGHT_NAMES):
        return f"{type(experts).__name__}.forward takes ({', '.join(parameters)})"
    return None


def _grouped(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """x (tokens sorted by expert, in) times weight[e] (in x out) for each expert's rows."""
    from transformers.integrations.moe import _grouped_mm

    return _grouped_mm(x, weight, offsets)


def _project(chain: _Chain, name: str, x: torch.Tensor, expert_ids: torch.Tensor,
             offsets: torch.Tensor) -> torch.Tensor:
    """One fused projection of the sorted tokens, its adapter added as x A then B per expert group."""
    experts = chain.experts
    weight = getattr(experts, name)
    if is_nf4(weight):  # QLoRA's 4-bit stack, dequantized for this call only (techniques/expert_quant.py)
        base = nf4_grouped_mm(x, weight, experts.is_transposed, offsets)
    else:
        # stored (experts, out, in) unless transposed (experts, in, out): grouped_mm wants (experts, in, out)
        base = _grouped(x, weight if experts.is_transposed else weight.transpose(-2, -1), offsets)
    if experts.has_bias:
        base = base + getattr(experts, f"{name}_bias")[expert_ids]
    wrapper = chain.wrappers.get(name)
    if wrapper is None or wrapper.disable_adapters or wrapper.merged:
        return base
    adapter = wrapper.active_adapters[0]
    if adapter not in wrapper.lora_A:
        return base
    count = experts.num_experts
    weight_a = wrapper.lora_A[adapter].weight  # (r * experts, in): PEFT's layout, expert-major
    weight_b = wrapper.lora_B[adapter].weight  # (out, r * experts): rank-major
    a = weight_a.reshape(count, -1, weight_a.shape[-1]).transpose(-2, -1)  # (experts, in, r)
    b = weight_b.reshape(weight_b.shape[0], -1, count).permute(2, 1, 0)  # (experts, r, out)
    # grouped_mm wants every row stride a multiple of 16 bytes: zero columns of A and rows of B round the
    # rank up (rank 2 in fp32 is 8 bytes); they add nothing, and their gradients are dropped by the pad.
    pad = -a.shape[-1] % max(1, 16 // a.element_size())
    a = torch.nn.functional.pad(a, (0, pad)).contiguous()
    b = torch.nn.functional.pad(b, (0, 0, 0, pad)).contiguous()
    low_rank = _grouped(_grouped(x.to(a.dtype), a, offsets), b, offsets)
    return base + (low_rank * wrapper.scaling[adapter]).to(base.dtype)


def _split_lora_forward(chain: _Chain, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                        top_k_weights: torch.Tensor) -> torch.Tensor:
    experts = chain.experts
    tokens, top_k = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, slot) pairs grouped by expert
    expert_ids = flat[order]
    x = hidden_states[order // top_k]
    # histc, not bincount: a fixed number of bins keeps the shapes static (fake tensors of the traced estimate,
    # CUDA graphs); its CPU kernel takes floats, its CUDA kernel integers under deterministic algorithms.
    on_cpu = expert_ids.device.type in ("cpu", "mps")
    counts = torch.histc(expert_ids.float() if on_cpu else expert_ids.int(), bins=experts.num_experts, min=0,
                         max=experts.num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    first = "gate_up_proj" if experts.has_gate else "up_proj"
    h = _project(chain, first, x, expert_ids, offsets)
    h = experts._apply_gate(h) if experts.has_gate else experts.act_fn(h)
    out = _project(chain, "down_proj", h, expert_ids, offsets)
    if getattr(experts, "has_post_expert_norm", False):
        out = experts.post_expert_norm(out)
    out = out * top_k_weights.reshape(-1)[order].unsqueeze(-1).to(out.dtype)
    unsorted = torch.empty_like(out).index_copy(0, order, out)  # back to (token, slot) order
    return unsorted.view(tokens, top_k, -1).sum(dim=1).to(hidden_states.dtype)


def apply_split_lora(model: nn.Module) -> str:
    """Give every adapted experts module of a PEFT model the split-LoRA forward (in place).

    Returns what was done ("2 of 2 experts modules"), naming those that keep PEFT's folded forward and why.
    """
    chains = _chains(model)
    done, kept = 0, {}
    for chain in chains:
        reason = _why_not_split(chain)
        if reason:
            kept[reason] = kept.get(reason, 0) + 1
            continue

        _install_grouped_forward(chain)
        chain.experts.memfit_split_lora = True
        done += 1
    text = f"{done} of {len(chains)} experts modules"
    if kept:
        text += "; PEFT's folded forward (W + BA per call) kept for " + ", ".join(
            f"{count} ({reason})" for reason, count in kept.items())
    return text


def _install_grouped_forward(chain: _Chain) -> None:
    def forward(self, hidden_states, top_k_index, top_k_weights, _chain=chain, **_):
        return _split_lora_forward(_chain, hidden_states, top_k_index, top_k_weights)

    chain.outer.forward = types.MethodType(forward, chain.outer)


def quantize_fused_experts(model: nn.Module) -> str:
    """QLoRA on the experts: hold every fused expert stack of `model` in NF4 where memfit's grouped forward runs it.

    Call after `apply_split_lora`. Adapted experts keep their split forward, which now dequantizes per call;
    experts without adapters get the same grouped forward with no adapter. Experts whose forward memfit
    cannot stand in for (their own loop, PEFT's folded forward) or whose weights are not 16/32-bit floats
    (MXFP4 blocks) keep their weights as loaded. Returns one line for the log naming both.
    """
    chains = {id(chain.experts): chain for chain in _chains(model)}
    done, weights, kept = 0, 0, {}
    modules = fused_expert_modules(model)
    for _, experts in modules:
        chain = chains.get(id(experts))
        if getattr(experts, "memfit_experts_nf4", False):  # quantized by an earlier call
            done += 1
            continue
        packed = [name for name in EXPERT_PARAMETERS if not getattr(experts, name, torch.zeros(0)).is_floating_point()]
        reason = (f"{type(experts).__name__}.{packed[0]} held as {getattr(experts, packed[0]).dtype} blocks (MXFP4"
                  " or another pre-quantized format)") if packed else _why_not_grouped(experts)
        if reason is None and chain is not None and not getattr(experts, "memfit_split_lora", False):
            reason = "PEFT's folded forward reads the 16-bit weight"
        if reason is None:
            count, reason = quantize_experts_module(experts, EXPERT_PARAMETERS)
            weights += count
        if reason:
            kept[reason] = kept.get(reason, 0) + 1
            continue
        if chain is None:
            _install_grouped_forward(_Chain(experts, experts, {}))
        done += 1
    text = f"experts nf4 in {done} of {len(modules)} experts modules ({weights} fused weights)"
    if kept:
        text += "; kept as loaded: " + ", ".join(f"{count} ({reason})" for reason, count in kept.items())
    return text


def check_expert_lora(model: nn.Module, targets: ExpertTargets, lora_dropout: float, quantize: str) -> str | None:
    """Refuse what PEFT cannot do on fused experts (one line naming the flag); say what QLoRA leaves.

    Returns a note for the log when the experts stay unquantized under --quantize 8bit (4-bit: see
    `quantize_fused_experts`), else None.
    """
    if not targets.parameters:
        return None
    if lora_dropout:
        raise UsageError(
            f"--lora-dropout {lora_dropout:g} cannot apply to the fused experts (x A B per expert has no"
            " per-layer input to drop); set --lora-dropout 0 or leave the experts out of --lora-targets"
        )
    if quantize == "8bit":
        return ("--quantize 8bit: bitsandbytes quantizes linear layers only; the fused 3-D expert"
                " weights stay in the load dtype (--quantize 4bit holds them in NF4)")
    return None


def expert_modules_count(model: nn.Module) -> int:
    return len(fused_expert_modules(model))
