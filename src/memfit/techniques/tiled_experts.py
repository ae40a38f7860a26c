"""Tiled experts: a mixture-of-experts block's experts run over token tiles and are recomputed one tile at a time.

Flag: `--tiled-mlp N` (the same switch as the dense MLP's: techniques/tiled_mlp.py). Every MoE layer's experts
call, `experts(hidden [tokens, hidden], indices [tokens, top-k], routing weights [tokens, top-k or experts])`
as transformers 5 makes it (gpt-oss, Qwen3-MoE, Mixtral, OLMoE, DeepSeek-V3, GLM-4-MoE...), runs over N
slices of its tokens.

Saves: the experts call keeps for backward, per routed row (tokens x top-k rows): the token's hidden state
copied into expert order, the gate and up projection, the activation chain (gpt-oss: its clamps, sigmoid and
GLU product), the down projection's output and the permutation's indices. That is most of what an MoE block
keeps (gpt-oss-20b: about 340 KiB a token of its block), and under full checkpointing it comes back whole when
backward reaches the block. Tiled, forward runs the experts tile by tile without a graph and saves only its
three inputs (the hidden states are a view of the block's normed input, which the router keeps anyway; the
indices and weights are top-k wide); backward recomputes one tile at a time, so one tile's routed rows are
alive instead of all of them. What stays full size: the output, the hidden states' gradient (filled
tile by tile) and the routing weights' gradient.
Costs: one more forward of the experts per step (the recompute); N smaller grouped matmuls instead of one
(each expert gets fewer rows per call, slower once a tile's rows per expert get few); in a full fine-tune, one
layer's expert gradients as a temporary beside their running sum.

Numerics: each token's expert output depends on that token alone (its own hidden state, experts and weights),
so tiling changes only the order in which a parameter's gradient is summed (fp32: within ~1e-6 relative).
The router stays outside the tiles: its logits, top-k and weights are computed once on all tokens, and its
gradient arrives through the routing weights' gradient, which each tile fills for its tokens.

Gradients of the trainable parameters (LoRA adapters on the experts, or the expert stacks in a full
fine-tune) are summed over the tiles in one buffer per parameter and handed to autograd once, as the tiled
MLP does (`TiledMLPFunction`), so hooks that act on a complete gradient see one.

What runs per tile is the experts module's forward as it is when tiling is applied: transformers' own (grouped
matmul, batched or a loop), memfit's split LoRA (techniques/expert_lora.py) or its NF4 experts
(techniques/expert_quant.py). Apply the tiling after those; `apply_tiled_experts` called again (or after a
later technique replaced the forward) tiles the forward then in place.
Left alone, named in the one line `apply_tiled_experts` returns: experts split across ranks (expert
parallelism: every rank would have to cut the same tiles), and experts whose forward does not take exactly
(hidden states, indices, weights).

Shared experts: beside its routed experts, an MoE block may run a plain gated MLP on every token (DeepSeek-V3's
and GLM-4-MoE's `shared_experts`, Qwen2-MoE's and Qwen3-Next's `shared_expert`): untiled, its gate, up and
activated projections (tokens x shared width each) are kept for backward. It is tiled by the dense MLP's
machinery (`tiled_mlp.tile_module`: forward without a graph, recompute tile by tile; LoRA on its linears runs
in each tile). Where the block scales it by a sigmoid gate of its own (`sigmoid(self.shared_expert_gate(x)) *
shared_expert(x)`, read from the block's source), the gate runs inside the tiles too (`GatedSharedExpert`), so
the full-size product kept for the gate's gradient goes as well; the block's own `sigmoid(gate(x))` then reads
an open gate (+inf, whose sigmoid is exactly 1). A shared expert whose gate the block uses otherwise stays
untiled and is named.
"""

from __future__ import annotations

import contextlib
import inspect
import re
import types
from collections.abc import Callable

import torch
from torch import nn

from memfit.models.experts import is_fused_experts
from memfit.techniques.expert_streaming import HOLD_ATTRIBUTE
from memfit.techniques.tiled_mlp import (
    _draws_random_numbers,
    _RngState,
    _tile,
    add_tile_gradients,
    apply_tiled_mlp,
    find_mlps,
    is_tiled,
    recompute_context,
    tile_module,
    tiles_for,
    untile_module,
)

_PREVIOUS = "_memfit_untiled_experts_forward"
_MARK = "_memfit_tiled_experts_forward"
TILED_ATTRIBUTE = "memfit_expert_tiles"
"""Set on each tiled experts module (the fused one, under any PEFT wrapper): its number of tiles."""


def moe_experts_calls(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """(name of the MoE block, the module it calls as `self.experts`, the fused experts inside) for each MoE layer.

    The module called is the fused experts themselves, or PEFT's `ParamWrapper`s around them (LoRA on the experts).
    """
    found = []
    for name, module in model.named_modules():
        called = module._modules.get("experts")
        if called is None:
            continue
        inner = called
        while not is_fused_experts(inner) and isinstance(getattr(inner, "base_layer", None), nn.Module):
            inner = inner.base_layer  # PEFT nests one ParamWrapper per adapted parameter
        if is_fused_experts(inner):
            found.append((name, called, inner))
    return found


def _why_not_tiled(experts: nn.Module) -> str | None:
    if getattr(experts, "_is_expert_parallel", False):
        return "split across ranks"
    try:
        inputs = [p for p in list(inspect.signature(type(experts).forward).parameters.values())[1:]
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return "a forward without a signature"
    if len(inputs) != 3:
        return f"a forward taking ({', '.join(p.name for p in inputs)}), not (hidden states, indices, weights)"
    return None


def apply_tiled_experts(model: nn.Module, tiles: int | None) -> str:
    """Tile every MoE layer's experts call in place; return one line for the log naming the layers.

    Args:
        tiles: tiles of the tokens of one call; None: one tile per `tiled_mlp.AUTO_TILE_TOKENS` tokens of the
            call (the flattened micro-batch) above that many; 0: off (the plain forward again).
    Returns "" when the model has no fused experts.
    """
    calls = moe_experts_calls(model)
    tiled, kept = [], {}
    shared = apply_tiled_shared_experts(model, [name for name, _, _ in calls], tiles, kept)
    for name, called, inner in calls:
        retiled = _is_tiled_forward(called.__dict__.get("forward"))
        # the forward in place before this tiling: split LoRA's or NF4's (on the instance), or the class's (None)
        previous = called.__dict__[_PREVIOUS] if retiled else called.__dict__.get("forward")
        if tiles == 0:
            if retiled:
                called.__dict__.pop(_PREVIOUS)
                if previous is None:
                    del called.forward
                else:
                    called.forward = previous
            inner.__dict__.pop(TILED_ATTRIBUTE, None)
            continue
        reason = _why_not_tiled(inner)
        if reason:
            kept[reason] = kept.get(reason, 0) + 1
            continue
        untiled = previous if previous is not None else types.MethodType(type(called).forward, called)
        called.__dict__[_PREVIOUS] = previous
        called.forward = types.MethodType(_make_tiled_forward(untiled, tiles), called)
        setattr(inner, TILED_ATTRIBUTE, tiles)
        tiled.append(name)
    if not calls or tiles == 0:
        return "off" if calls else ""
    how = f"{tiles} tiles" if tiles is not None else "automatic tiles"
    text = f"{how} on the experts of {len(tiled)} of {len(calls)} MoE layers ({layer_list(tiled)})"
    gated = sum(1 for kind in shared.values() if kind == "gated")
    and_gates = f" ({gated} with their sigmoid gate)" if gated else ""
    if shared:
        text += f" and on the shared experts of {len(shared)} of them{and_gates}"
    if not tiled:
        text = f"off on the experts of {len(calls)} MoE layers"
        if shared:  # the routed experts stay whole, the shared ones are tiled: not off
            text = f"{how} on the shared experts of {len(shared)} of {len(calls)} MoE layers{and_gates} (routed untiled)"
    if kept:
        text += "; left untiled: " + ", ".join(f"{count} ({reason})" for reason, count in kept.items())
    return text


def with_tiled_experts(model: nn.Module, tiles: int | None, mlp_description: str) -> str:
    """Tile the experts too (`apply_tiled_experts`) and join their line to the tiled MLP's.

    The result starts with "off" only when neither a dense MLP nor an experts call was tiled.
    """
    experts = apply_tiled_experts(model, tiles)
    if not experts or experts == "off":
        return mlp_description
    if mlp_description.startswith("off") and not experts.startswith("off"):
        return experts
    return f"{mlp_description}; {experts}"


def tiled_experts_facts(model: nn.Module) -> dict | None:
    """For the metrics: the tiles and the MoE layers whose experts run tiled; None when none do."""
    layers = [name for name, _, inner in moe_experts_calls(model) if TILED_ATTRIBUTE in inner.__dict__]
    shared = tiled_shared_experts(model)
    if not layers and not shared:
        return None
    tiles = {inner.__dict__[TILED_ATTRIBUTE] for _, _, inner in moe_experts_calls(model)
             if TILED_ATTRIBUTE in inner.__dict__} or {None}
    return {"tiles": tiles.pop() if len(tiles) == 1 else sorted(tiles, key=str), "layers": layers,
            "described": layer_list(layers), "shared_experts": len(shared)}


def layer_list(names: list[str]) -> str:
    """Module names with their layer numbers folded into ranges: `model.layers.{0-23}.mlp`."""
    groups: dict[str, list[int]] = {}
    for name in names:
        match = re.search(r"\.(\d+)\.", name)
        if match is None:
            groups.setdefault(name, [])
            continue
        pattern = name[:match.start(1)] + "{}" + name[match.end(1):]
        groups.setdefault(pattern, []).append(int(match.group(1)))
    parts = []
    for pattern, numbers in groups.items():
        if not numbers:
            parts.append(pattern)
            continue
        ranges, start = [], numbers[0]
        for previous, number in zip(numbers, [*numbers[1:], None], strict=True):
            if number != previous + 1:
                ranges.append(f"{start}-{previous}" if previous != start else str(start))
                start = number
        parts.append(pattern.replace("{}", "{" + ",".join(ranges) + "}"))
    return ", ".join(parts)


def _is_tiled_forward(forward: Callable | None) -> bool:
    return getattr(getattr(forward, "__func__", None), _MARK, False)


def _make_tiled_forward(untiled: Callable, tiles: int | None) -> Callable:
    def forward(self, hidden_states, indices=None, weights=None, *args, **kwargs):
        count = tiles_for(hidden_states.shape[0], tiles) if hidden_states.dim() == 2 else 1
        if count <= 1 or args or kwargs or not _routed(hidden_states, indices, weights):
            return untiled(hidden_states, indices, weights, *args, **kwargs)
        hold = getattr(self, HOLD_ATTRIBUTE, None) or contextlib.nullcontext  # streamed experts: one copy, all tiles
        if not torch.is_grad_enabled():  # evaluation, or a checkpointed block's first forward: nothing to save
            with hold():
                return _tiles_without_graph(untiled, count, hidden_states, indices, weights)
        trainable = [p for p in self.parameters() if p.requires_grad]
        return TiledExpertsFunction.apply(_HeldExperts(untiled, hold), count, hidden_states, indices, weights,
                                          _draws_random_numbers(self), *trainable)

    setattr(forward, _MARK, True)
    return forward


def _hold_of(experts: Callable) -> Callable:
    return getattr(experts, "hold", None) or contextlib.nullcontext


def _routed(hidden: torch.Tensor, indices, weights) -> bool:
    """Whether the call is the one tiling assumes: one row of indices and weights per token."""
    return (isinstance(indices, torch.Tensor) and isinstance(weights, torch.Tensor) and indices.dim() == 2
            and weights.dim() == 2 and not indices.is_floating_point()
            and indices.shape[0] == weights.shape[0] == hidden.shape[0])


def _tiles_without_graph(experts: Callable, tiles: int, hidden: torch.Tensor, indices: torch.Tensor,
                         weights: torch.Tensor) -> torch.Tensor:
    output = None
    with torch.no_grad():
        for index in range(tiles):
            result = experts(_tile(hidden, tiles, index), _tile(indices, tiles, index), _tile(weights, tiles, index))
            if output is None:  # written in place: no list of tiles plus a concatenated copy
                output = result.new_empty((hidden.shape[0], *result.shape[1:]))
            _tile(output, tiles, index).copy_(result)
            del result
    return output


class _HeldExperts:
    """The untiled experts call, and the context that keeps a streamed layer on the device while its tiles run."""

    def __init__(self, call: Callable, hold: Callable) -> None:
        self.call, self.hold = call, hold

    def __call__(self, *args, **kwargs):
        return self.call(*args, **kwargs)


class TiledExpertsFunction(torch.autograd.Function):
    """`experts(hidden, indices, weights)` over `tiles` slices of the tokens (dimension 0 of all three).

    Forward saves the three inputs; backward recomputes each tile with a graph, takes the gradients of its
    hidden states, routing weights and `parameters`, and sums the parameters' over the tiles.
    """

    @staticmethod
    def forward(ctx, experts: Callable, tiles: int, hidden: torch.Tensor, indices: torch.Tensor,
                weights: torch.Tensor, replay_random: bool, *parameters: torch.Tensor) -> torch.Tensor:
        ctx.experts = experts
        ctx.tiles = tiles
        ctx.device_type = hidden.device.type
        ctx.autocast = (torch.is_autocast_enabled(ctx.device_type), torch.get_autocast_dtype(ctx.device_type))
        ctx.rng = _RngState.capture(hidden.device) if replay_random else None
        ctx.save_for_backward(hidden, indices, weights)
        # Held, not saved: the module holds them anyway, and a sharding engine that refills their
        # storage between forward and backward must not trip autograd's version check.
        ctx.parameters = parameters
        with _hold_of(experts)():
            return _tiles_without_graph(experts, tiles, hidden, indices, weights)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        hidden, indices, weights = ctx.saved_tensors
        needs_hidden, needs_weights = ctx.needs_input_grad[2], ctx.needs_input_grad[4]
        wanted = [p for p, needed in zip(ctx.parameters, ctx.needs_input_grad[6:], strict=True) if needed]
        grad_hidden = torch.empty_like(hidden) if needs_hidden else None
        grad_weights = torch.empty_like(weights) if needs_weights else None
        grad_parameters: list[torch.Tensor | None] = [None] * len(wanted)
        with recompute_context(ctx), _hold_of(ctx.experts)():
            for index in range(ctx.tiles):
                piece = _tile(hidden, ctx.tiles, index).detach().requires_grad_(needs_hidden)
                routing = _tile(weights, ctx.tiles, index).detach().requires_grad_(needs_weights)
                inputs = ([piece] if needs_hidden else []) + ([routing] if needs_weights else []) + wanted
                if not inputs:
                    break
                output = ctx.experts(piece, _tile(indices, ctx.tiles, index), routing)
                grads = list(torch.autograd.grad(output, inputs, _tile(grad_output, ctx.tiles, index),
                                                 allow_unused=True))
                del output
                for wanted_here, buffer in ((needs_hidden, grad_hidden), (needs_weights, grad_weights)):
                    if not wanted_here:
                        continue
                    grad = grads.pop(0)
                    if grad is None:  # the experts ignored this input (a weight slot never routed)
                        _tile(buffer, ctx.tiles, index).zero_()
                    else:
                        _tile(buffer, ctx.tiles, index).copy_(grad)
                add_tile_gradients(grad_parameters, grads)
        by_parameter = iter(grad_parameters)
        parameter_grads = [next(by_parameter) if needed else None for needed in ctx.needs_input_grad[6:]]
        return (None, None, grad_hidden, None, grad_weights, None, *parameter_grads)


# ---------------------------------------------------------------------------
# Shared experts
# ---------------------------------------------------------------------------

_GATED = "_memfit_gated_shared_expert"


class GatedSharedExpert(nn.Module):
    """`sigmoid(gate(x)) * expert(x)`, a shared expert with its sigmoid gate, as one module to tile.

    Its children are the block's shared expert and gate (registered here only, as `LayerFeedForward` does: the
    block's tree and state dict stay as they were), so the tiles' recompute gives both their gradients. The
    forwards it runs are theirs from before `install`, which makes the block's calls come here and open its gate.
    """

    def __init__(self, block: nn.Module, expert_name: str, gate_name: str):
        super().__init__()
        self.add_module("expert", block._modules[expert_name])
        self.add_module("gate", block._modules[gate_name])
        self.__dict__["previous"] = {child: module.__dict__.get("forward") for child, module in self.named_children()}
        self.__dict__["runs"] = {child: self.previous[child] or types.MethodType(type(module).forward, module)
                                 for child, module in self.named_children()}

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.runs["gate"](hidden)) * self.runs["expert"](hidden)

    def install(self, block: nn.Module) -> None:
        """The block's shared-expert call runs this module (tiled); its gate call returns an open gate."""
        block.__dict__[_GATED] = self
        self.expert.forward = self.__call__
        self.gate.forward = _open_gate

    def remove(self, block: nn.Module) -> None:
        """The block runs its shared expert and gate as before `install`."""
        block.__dict__.pop(_GATED, None)
        for child, module in self.named_children():
            module.__dict__.pop("forward", None)
            if self.previous[child] is not None:
                module.forward = self.previous[child]


def _open_gate(hidden: torch.Tensor) -> torch.Tensor:
    """What the block's `sigmoid(gate(x))` turns into exactly 1: the gated shared expert applied the gate already.

    In the dtype the gate's linear would have returned, so the block's product keeps its dtype."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
    return hidden.new_full((*hidden.shape[:-1], 1), float("inf"), dtype=dtype)


def _shared_children(block: nn.Module) -> list[tuple[str, str | None]]:
    """(shared expert's name, its gate's name or None) for each shared expert of an MoE block."""
    children = block._modules
    return [(name, f"{name}_gate" if isinstance(children.get(f"{name}_gate"), nn.Module) else None)
            for name, child in children.items()
            if name.startswith("shared_expert") and not name.endswith("_gate") and isinstance(child, nn.Module)]


def _why_shared_not_tiled(block: nn.Module, expert: nn.Module, gate_name: str | None) -> str | None:
    forward = expert.__dict__.get("forward") or type(expert).forward
    try:  # one tensor in, as the block calls it
        inputs = [p for p in inspect.signature(forward).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"]
    except (TypeError, ValueError):
        return "a shared expert's forward without a signature"
    if len(inputs) != 1:
        return "a shared expert's forward taking more than the hidden states"
    if gate_name is None:
        return None
    weight = getattr(block._modules[gate_name], "weight", None)
    try:
        source = inspect.getsource(type(block).forward)
    except (OSError, TypeError):
        source = ""
    if (not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[0] != 1
            or not re.search(rf"sigmoid\(\s*self\.{re.escape(gate_name)}\(", source)):
        return "a shared expert whose gate is not sigmoid(gate(x)) of one output"
    return None


def apply_tiled_shared_experts(model: nn.Module, blocks: list[str], tiles: int | None,
                               kept: dict[str, int]) -> dict[str, str]:
    """Tile the shared experts of the MoE `blocks` (their names in `model`); 0: untile them.

    Returns {shared expert's name: "plain" or "gated"} for those tiled; counts the ones left untiled, by reason,
    into `kept`.
    """
    modules = dict(model.named_modules())
    tiled = {}
    for block_name in blocks:
        block = modules[block_name]
        for name, gate_name in _shared_children(block):
            expert, gated = block._modules[name], block.__dict__.get(_GATED)
            if tiles == 0:
                if gated is not None:
                    untile_module(gated)
                    gated.remove(block)  # gives the expert and its gate back their own forwards
                elif is_tiled(expert):
                    untile_module(expert)
                continue
            reason = None if gated is not None or is_tiled(expert) else _why_shared_not_tiled(block, expert,
                                                                                                gate_name)
            if reason:
                kept[reason] = kept.get(reason, 0) + 1
                continue
            if gate_name is None:
                tile_module(expert, tiles)
            else:
                gated = gated or GatedSharedExpert(block, name, gate_name)
                tile_module(gated, tiles)
                gated.install(block)
            tiled[f"{block_name}.{name}"] = "plain" if gate_name is None else "gated"
    return tiled


def tiled_shared_experts(model: nn.Module) -> list[str]:
    """Names of the shared experts that run over token tiles (with their gate or alone)."""
    names = []
    for block_name, block in model.named_modules():
        for name, gate_name in _shared_children(block):
            if is_tiled(block._modules[name]) or (gate_name and _GATED in block.__dict__):
                names.append(f"{block_name}.{name}")
    return names


def _resolve(facts, run) -> dict:
    tiles = tiles_for(facts.config.data.seq_len_or_default, facts.config.memory.tiled_mlp)
    return {"mlp_tiles": tiles if tiles > 1 else 0}


def _apply(model: nn.Module, run, context):
    from memfit.errors import UsageError
    from memfit.techniques.technique import Applied

    if run.mlp_tiles <= 1:
        return Applied()
    tiled = apply_tiled_mlp(model, run.mlp_tiles)
    tiled = with_tiled_experts(model, run.mlp_tiles, tiled)  # each MoE layer's experts call, over token tiles
    if context.config.memory.tiled_mlp and not find_mlps(model) and not _tiled_experts(model):
        # asked for and nothing to tile: refused, not ignored
        raise UsageError(f"--tiled-mlp {context.config.memory.tiled_mlp}: the blocks of {type(model).__name__} have"
                         " no MLP module (mlp, feed_forward or ffn) nor a feed_forward_chunk method to tile;"
                         " drop --tiled-mlp")
    return Applied(f"tiled MLP: {tiled}")


def _tiled_experts(model: nn.Module) -> bool:
    return bool(tiled_experts_facts(model))


def _technique():
    from memfit.techniques.technique import Technique

    return Technique(
        name="tiled_mlp", settings=("tiled_mlp",), after=("staged_weights", "lora"), resolve=_resolve, apply=_apply,
        report=lambda run: {"mlp_tiles": run.mlp_tiles} if run.mlp_tiles else {},
        summary="each MLP runs over tiles of tokens: its intermediate activations are one tile's; one more MLP"
                " forward in backward",
    )


TECHNIQUE = _technique()
