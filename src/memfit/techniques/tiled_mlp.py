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

Encoder layers without such a child (BERT, RoBERTa, ESM and their kin) compute their
feed-forward in a method of the layer, `feed_forward_chunk(attention_output)`: BERT's
dense -> GELU -> dense -> dropout -> LayerNorm(+ residual), ESM's the same after a
LayerNorm and without the last one. Every step of it acts on each token alone, so it is
tiled too: `LayerFeedForward` presents it as a module whose parameters are exactly the
feed-forward's (the layer's children other than its attention), and the layer's
`feed_forward_chunk` is replaced on the instance by a call to that tiled module. What
tiling saves there: the two `tokens x intermediate` tensors (BERT; ESM's written-out
GELU keeps four), the LayerNorm's input and statistics (BERT) or its output (ESM).
"""

from __future__ import annotations

import contextlib
import inspect
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
_FEED_FORWARD = "_memfit_feed_forward"


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
        else:
            feed_forward = LayerFeedForward.of(block)
            if feed_forward is not None:
                found.append(feed_forward)
    return found


class LayerFeedForward(nn.Module):
    """The feed-forward an encoder layer computes in its own `feed_forward_chunk` method, as a module to tile.

    Its children are the layer's children other than its attention (BERT: intermediate and output; ESM: those
    and the LayerNorm before them): the tiled function must receive every parameter the feed-forward uses, or
    those would get no gradient from the recompute, and none of the attention's. They are registered here only:
    the layer's own tree, its state dict and its parameter names stay as they were. Its forward is the layer's
    original method; `install` makes the layer call this module instead, `remove` undoes it.
    """

    def __init__(self, layer: nn.Module):
        super().__init__()
        for name, child in layer.named_children():
            if "attention" not in name.lower():
                self.add_module(name, child)
        # plain attributes, not submodules: the layer is this module's owner, not its child
        self.__dict__["layer"] = layer
        self.__dict__["untiled"] = layer.feed_forward_chunk

    @classmethod
    def of(cls, layer: nn.Module) -> LayerFeedForward | None:
        """The layer's feed-forward (the one already installed, else a new one), or None where it has none."""
        existing = layer.__dict__.get(_FEED_FORWARD)
        if existing is not None:
            return existing
        method = getattr(layer, "feed_forward_chunk", None)
        children = dict(layer.named_children())
        if not callable(method) or not all(isinstance(children.get(n), nn.Module) for n in ("intermediate", "output")):
            return None
        try:  # one tensor in, as transformers' apply_chunking_to_forward calls it
            if len(inspect.signature(method).parameters) != 1:
                return None
        except (TypeError, ValueError):
            return None
        return cls(layer)

    def forward(self, attention_output: torch.Tensor) -> torch.Tensor:
        return self.untiled(attention_output)

    def install(self) -> None:
        """The layer's feed_forward_chunk calls this module (and so its tiled forward)."""
        self.layer.__dict__[_FEED_FORWARD] = self
        # a bound method of one parameter: transformers' apply_chunking_to_forward counts the parameters
        self.layer.feed_forward_chunk = types.MethodType(_call_feed_forward, self)

    def remove(self) -> None:
        """The layer computes its feed-forward with its own method again."""
        self.layer.__dict__.pop(_FEED_FORWARD, None)
        self.layer.__dict__.pop("feed_forward_chunk", None)


def _call_feed_forward(feed_forward: LayerFeedForward, attention_output: torch.Tensor) -> torch.Tensor:
    return feed_forward(attention_output)


def _looks_like_experts(module: nn.Module) -> bool:
    if hasattr(module, "experts"):
        return True
    name = type(module).__name__.lower()
    if name.endswith("mlp"):  # an MoE family's dense MLP (GLM-4-MoE's first layer: Glm4MoeMLP), no experts in it
        return False
    return "moe" in name or "sparse" in name or "expert" in name


def apply_tiled_mlp(model: nn.Module, tiles: int | None) -> str:
    """Tile every block's MLP in place; return a one-line description for the log.

    Args:
        tiles: tiles per sequence; None: automatic (see `tiles_for`); 0: off.
    Calling it again changes the number of tiles; `tiles=0` restores the plain MLPs.
    """
    mlps = find_mlps(model)
    for mlp in mlps:
        if tiles == 0:
            untile_module(mlp)
            if isinstance(mlp, LayerFeedForward):
                mlp.remove()
            continue
        tile_module(mlp, tiles)
        if isinstance(mlp, LayerFeedForward):
            mlp.install()
    if tiles == 0 or not mlps:
        return "off" if tiles == 0 else "off (no MLP found in the blocks)"
    how = f"{tiles} tiles" if tiles is not None else f"1 tile per {AUTO_TILE_TOKENS} tokens above {AUTO_TILE_TOKENS}"
    return f"{how} on {len(mlps)} MLPs"


def tile_module(module: nn.Module, tiles: int | None) -> None:
    """Run `module` (one tensor in, one out, acting on each token alone) over `tiles` slices of dimension -2,
    recomputed tile by tile in backward; called again, it changes the tiles and keeps the untiled forward."""
    untiled = module.__dict__.get(_ORIGINAL_FORWARD, module.forward)
    module.__dict__[_ORIGINAL_FORWARD] = untiled
    module.__dict__[_TILES] = tiles
    module.forward = types.MethodType(_make_tiled_forward(untiled, tiles), module)


def untile_module(module: nn.Module) -> None:
    """Undo `tile_module`: the module runs its own forward again."""
    module.__dict__.pop(_ORIGINAL_FORWARD, None)
    module.__dict__.pop(_TILES, None)
    module.__dict__.pop("forward", None)


def is_tiled(module: nn.Module) -> bool:
    """Whether `apply_tiled_mlp` tiled this module, or this encoder layer's feed-forward (`LayerFeedForward`).

    Such a layer's children (attention, intermediate, output) are then compiled each on its own: the tiles run
    the compiled intermediate and output, and the tiling's autograd function stays outside compiled code.
    """
    return _ORIGINAL_FORWARD in module.__dict__ or _FEED_FORWARD in module.__dict__


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


def add_tile_gradients(sums: list, grads) -> None:
    """Add one tile's parameter gradients into `sums` (one running sum per parameter, None until its first tile):
    each parameter then gets one complete gradient, handed to autograd once."""
    for position, grad in enumerate(grads):
        if grad is None:
            continue
        if sums[position] is None:
            sums[position] = grad
        else:
            sums[position] += grad


@contextlib.contextmanager
def recompute_context(ctx):
    """What a tile's recompute in backward runs under: the forward's random numbers (`ctx.rng`, when captured),
    grad mode, the forward's autocast (`ctx.autocast`, `ctx.device_type`) and no saved-tensor hooks: activation
    offload's hooks must not move a tile's short-lived tensors, which are used right here."""
    enabled, dtype = ctx.autocast
    with (
        ctx.rng.restored() if ctx.rng is not None else contextlib.nullcontext(),
        torch.enable_grad(),
        torch.autocast(ctx.device_type, dtype=dtype, enabled=enabled),
        torch.autograd.graph.saved_tensors_hooks(_identity, _identity),
    ):
        yield


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
        with recompute_context(ctx):
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
                add_tile_gradients(grad_parameters, grads)
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
