"""Tiled MLP: each block's MLP runs over sequence tiles and is recomputed one tile at a time.

Flag `--tiled-mlp N` (N tiles; 0: off; default: on past `AUTO_TILE_TOKENS` tokens per
sequence, one tile per `AUTO_TILE_TOKENS` tokens).

Saves: a block's MLP keeps its intermediates for backward: for a SwiGLU MLP the gate,
up and activated projections, three `tokens x intermediate` tensors (intermediate is
3.5-4x hidden), plus as much again for their gradients while its backward runs. At 100K
tokens that is the largest working set of a step, checkpointing or not (a checkpointed
block rebuilds it when backward reaches it). Tiled, forward runs the MLP tile by tile
without recording a graph and saves only the MLP's input; backward recomputes one tile
at a time, so the intermediates of one tile (`tokens / N x intermediate`) are alive
instead of all of them. The output, the input and its gradient stay full size
(`tokens x hidden` each).
Costs: one more forward of the MLP per step (the recompute), about a third of the
MLP's step time; N smaller matmuls instead of one (slower when a tile gets small).
Gradients of the MLP's trainable parameters are summed over the tiles in one buffer
the size of those parameters and handed to autograd once, so hooks that act when a
gradient is complete (optimizer in backward, FSDP's reduce-scatter) see one gradient.

Numerics: the MLP acts on each token alone, so tiling changes only the order in which
the parameter gradients are summed (fp32: within ~1e-6 relative). Random operators
inside the MLP (dropout) replay the same random numbers in the recompute.

Which MLPs: the child called `mlp`, `feed_forward` or `ffn` of each transformer block,
when it maps one tensor to one tensor (mixture-of-experts blocks, which also return
router logits, are left alone). LoRA adapters inside it (PEFT) work: the MLP's own
forward is what runs per tile.
"""

from __future__ import annotations

import contextlib
import math
import types
from collections.abc import Callable

import torch
from torch import nn

AUTO_TILE_TOKENS = 8192
"""Automatic tiling: one tile per this many tokens of a sequence, on above it."""
MLP_NAMES = ("mlp", "feed_forward", "ffn")
_ORIGINAL_FORWARD = "_memfit_untiled_forward"
_TILES = "_memfit_tiles"
_TILED_MARK = "_memfit_tiled_forward"


def tiles_for(seq_len: int, tiles: int | None) -> int:
    """Tiles for a sequence of `seq_len` tokens: `tiles` if set (0 or 1: none), else automatic."""
    if tiles is None:
        return math.ceil(seq_len / AUTO_TILE_TOKENS) if seq_len > AUTO_TILE_TOKENS else 1
    return max(1, min(tiles, seq_len))


def find_mlps(model: nn.Module) -> list[nn.Module]:
    """The MLP module of each transformer block (see the module docstring)."""
    from memfit.techniques.checkpointing import transformer_blocks

    found = []
    for block in transformer_blocks(model):
        block = getattr(block, "block", block)  # memfit's CheckpointedBlock wrapper
        for name in MLP_NAMES:
            module = getattr(block, name, None)
            if isinstance(module, nn.Module) and not _looks_like_experts(module):
                found.append(module)
                break
    return found


def _looks_like_experts(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return "moe" in name or "sparse" in name or "expert" in name or hasattr(module, "experts")


def apply_tiled_mlp(model: nn.Module, tiles: int | None) -> str:
    """Tile every block's MLP in place; return a one-line description for the log.

    Args:
        tiles: tiles per sequence; None: automatic (see `tiles_for`); 0: off.
    Calling it again changes the number of tiles; `tiles=0` restores the plain MLPs.
    """
    mlps = find_mlps(model)
    for mlp in mlps:
        untiled = mlp.__dict__.get(_ORIGINAL_FORWARD, mlp.forward)
        if tiles == 0:
            mlp.__dict__.pop(_ORIGINAL_FORWARD, None)
            mlp.__dict__.pop(_TILES, None)
            mlp.__dict__.pop("forward", None)
            continue
        mlp.__dict__[_ORIGINAL_FORWARD] = untiled
        mlp.__dict__[_TILES] = tiles
        mlp.forward = types.MethodType(_make_tiled_forward(untiled, tiles), mlp)
    if tiles == 0 or not mlps:
        return "off" if tiles == 0 else "off (no MLP found in the blocks)"
    how = f"{tiles} tiles" if tiles is not None else f"1 tile per {AUTO_TILE_TOKENS} tokens above {AUTO_TILE_TOKENS}"
    return f"{how} on {len(mlps)} MLPs"


def is_tiled(module: nn.Module) -> bool:
    """Whether `apply_tiled_mlp` tiled this module."""
    return _ORIGINAL_FORWARD in module.__dict__


def compile_each_tile(mlp: nn.Module, compile_fn: Callable[[Callable], Callable]) -> None:
    """Run the tiles of a tiled `mlp` through `compile_fn(untiled forward)`.

    The tiling itself (an autograd function whose backward takes gradients tile by tile)
    stays outside the compiled code: Dynamo cannot trace it, and inside a compiled,
    checkpointed block it would send the whole block back to eager.
    """
    untiled = mlp.__dict__[_ORIGINAL_FORWARD]
    mlp.forward = types.MethodType(_make_tiled_forward(compile_fn(untiled), mlp.__dict__[_TILES]), mlp)


def retile_replaced_forwards(model: nn.Module) -> int:
    """Tile again the tiled MLPs whose forward was replaced after tiling; return how many.

    liger-kernel's SwiGLU patches each MLP instance's `forward` (its fused SiLU-times-up kernel),
    which drops the tiling put there before: at 131,072 tokens of Llama-3.1-8B the whole MLP's
    intermediates (10 GiB) came back. The replacement becomes the untiled forward each tile runs,
    so the run keeps both the fused kernel and the tiling the plan counted on.
    """
    count = 0
    for mlp in find_mlps(model):
        current = mlp.__dict__.get("forward")
        if _TILES not in mlp.__dict__ or current is None or getattr(current, "__func__", None) is None:
            continue
        if getattr(current.__func__, _TILED_MARK, False):
            continue  # still memfit's tiled forward
        mlp.__dict__[_ORIGINAL_FORWARD] = current
        mlp.forward = types.MethodType(_make_tiled_forward(current, mlp.__dict__[_TILES]), mlp)
        count += 1
    return count


def _make_tiled_forward(untiled: Callable, tiles: int | None) -> Callable:
    def forward(self, hidden: torch.Tensor, *args, **kwargs):
        count = tiles_for(hidden.shape[-2], tiles) if hidden.dim() >= 2 else 1
        if count <= 1 or args or kwargs:
            return untiled(hidden, *args, **kwargs)
        if not torch.is_grad_enabled():  # evaluation: the tiles alone, nothing to save
            return _tiles_without_graph(untiled, count, hidden)
        trainable = [p for p in self.parameters() if p.requires_grad]
        return TiledMLPFunction.apply(untiled, count, hidden, _draws_random_numbers(self), *trainable)

    setattr(forward, _TILED_MARK, True)
    return forward


def _draws_random_numbers(mlp: nn.Module) -> bool:
    """Whether the MLP's forward uses the random generator (dropout in training, LoRA's included).

    Only then is the random state captured for the recompute: reading it is opaque to
    torch.compile, and a compiled block around a checkpointed, tiled MLP would otherwise run
    eager in full.
    """
    return any(isinstance(module, nn.Dropout) and module.p > 0 and module.training for module in mlp.modules())


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


class TiledMLPFunction(torch.autograd.Function):
    """`mlp(hidden)` computed over `tiles` slices of the sequence dimension (-2).

    Forward saves only `hidden`; backward recomputes each tile with a graph, takes the
    gradients of its input and of `parameters`, and sums the parameters' over the tiles.
    """

    @staticmethod
    def forward(ctx, mlp: Callable, tiles: int, hidden: torch.Tensor, replay_random: bool,
                *parameters: torch.Tensor) -> torch.Tensor:
        ctx.mlp = mlp
        ctx.tiles = tiles
        ctx.device_type = hidden.device.type
        ctx.autocast = (
            torch.is_autocast_enabled(ctx.device_type),
            torch.get_autocast_dtype(ctx.device_type),
        )
        ctx.rng = _RngState.capture(hidden.device) if replay_random else None
        ctx.save_for_backward(hidden)
        # Held, not saved: the module holds them anyway, and a sharding engine that refills
        # their storage between forward and backward must not trip autograd's version check.
        ctx.parameters = parameters
        return _tiles_without_graph(mlp, tiles, hidden)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (hidden,) = ctx.saved_tensors
        parameters = ctx.parameters
        needs_input = ctx.needs_input_grad[2]
        wanted = [p for p, needed in zip(parameters, ctx.needs_input_grad[4:], strict=True) if needed]
        grad_hidden = torch.empty_like(hidden) if needs_input else None
        grad_parameters = [None] * len(wanted)
        enabled, dtype = ctx.autocast
        with (
            ctx.rng.restored() if ctx.rng is not None else contextlib.nullcontext(),
            torch.enable_grad(),
            torch.autocast(ctx.device_type, dtype=dtype, enabled=enabled),
            # A context of saved-tensor hooks (activation offload) must not move the
            # tile's short-lived activations: they are used right here.
            torch.autograd.graph.saved_tensors_hooks(_identity, _identity),
        ):
            for index in range(ctx.tiles):
                piece = _tile(hidden, ctx.tiles, index).detach().requires_grad_(needs_input)
                output = ctx.mlp(piece)
                inputs = ([piece] if needs_input else []) + wanted
                if not inputs:
                    break
                grads = torch.autograd.grad(output, inputs, _tile(grad_output, ctx.tiles, index), allow_unused=True)
                del output
                if needs_input:
                    _tile(grad_hidden, ctx.tiles, index).copy_(grads[0])
                    grads = grads[1:]
                for position, grad in enumerate(grads):
                    if grad is None:
                        continue
                    if grad_parameters[position] is None:
                        grad_parameters[position] = grad
                    else:
                        grad_parameters[position] += grad
        by_parameter = iter(grad_parameters)
        parameter_grads = [next(by_parameter) if needed else None for needed in ctx.needs_input_grad[4:]]
        return (None, None, grad_hidden, None, *parameter_grads)


def _tiles_without_graph(mlp: Callable, tiles: int, hidden: torch.Tensor) -> torch.Tensor:
    output = None
    with torch.no_grad():
        for index, piece in enumerate(hidden.tensor_split(tiles, dim=-2)):
            result = mlp(piece)
            if not isinstance(result, torch.Tensor):
                raise TypeError(f"a tiled MLP must return one tensor, got {type(result).__name__}")
            if output is None:  # written in place: no list of tiles plus a concatenated copy
                output = result.new_empty((*hidden.shape[:-1], result.shape[-1]))
            _tile(output, tiles, index).copy_(result)
            del result
    return output


def _tile(tensor: torch.Tensor, tiles: int, index: int) -> torch.Tensor:
    return tensor.tensor_split(tiles, dim=-2)[index]


class _RngState:
    """The random state at the start of the forward, replayed by the recompute (dropout)."""

    def __init__(self, cpu: torch.Tensor, device: torch.device, device_state: torch.Tensor | None):
        self.cpu, self.device, self.device_state = cpu, device, device_state

    @classmethod
    def capture(cls, device: torch.device) -> _RngState:
        device_state = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
        return cls(torch.get_rng_state(), device, device_state)

    @contextlib.contextmanager
    def restored(self):
        devices = [self.device] if self.device_state is not None else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.set_rng_state(self.cpu)
            if self.device_state is not None:
                torch.cuda.set_rng_state(self.device_state, self.device)
            yield
