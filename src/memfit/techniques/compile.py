"""Compiled transformer blocks (`--compile`): torch.compile per block, not per model.

Saves: time, not memory. Inductor fuses each block's element-wise ops (norms, rotary
embeddings, activations, residual adds, casts) into a few kernels, so fewer
intermediates go through memory and, on a GPU, far fewer kernels are launched.
Costs: compile time at the first step (and once more at the first new sequence length
or micro-batch size, see below), and a C++ compiler on CPU (Triton on CUDA).

How (regional compilation): each block is compiled in place with `module.compile()`.
The blocks of a model run the same code, so Dynamo traces one block and the others reuse
its graph (their weights are graph inputs): compile time is that of one block, not of
the whole model, and the embedding, the head and the loss stay eager.

- Sequence lengths and micro-batch sizes that change (unpacked data, the last batch,
  out-of-memory recovery) do not recompile every step: with `dynamic=None` the first
  shape is compiled static and the first change recompiles once with symbolic sizes,
  which then serve every later shape (`compile_stats()` counts the graphs).
- Gradient checkpointing: Hugging Face's checkpointed blocks call the compiled forward
  inside `torch.utils.checkpoint`, which recomputes it in backward (full or selective).
- LoRA: compile after the adapters are injected, so they are part of the compiled graph.
- Tiled MLP: its autograd function (backward takes gradients tile by tile) cannot be
  traced, so a block with a tiled MLP is compiled one level down: attention and norms as
  modules, the MLP's own forward once per tile. Compile after tiling.

The numbers stay those of the eager model up to float reassociation in fused kernels
(tests compare the loss and every gradient).
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from memfit.techniques.checkpointing import transformer_blocks
from memfit.techniques.loss import token_loss_sum
from memfit.techniques.tiled_mlp import compile_each_tile, is_tiled

log = logging.getLogger("memfit")


@dataclass
class CompileChoice:
    """What `--compile` did: 'off', or how many blocks were compiled with which backend."""

    description: str
    compiled_blocks: int = 0
    reason: str = ""
    """Why it did not run when asked (empty when it ran or was not asked)."""


def compile_unavailable_reason(device: torch.device, backend: str = "inductor") -> str:
    """Why torch.compile cannot run here ('' when it can)."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile is not supported on this Python/platform"
    if backend == "inductor" and device.type == "cpu" and not any(shutil.which(c) for c in ("g++", "c++", "clang++")):
        return "torch.compile on CPU needs a C++ compiler (g++ or clang++) on the PATH"
    if backend == "inductor" and device.type == "cuda":
        try:
            import triton  # noqa: F401
        except ImportError:
            return "torch.compile on CUDA needs the triton package"
    return ""


def compile_blocks(
    model: nn.Module, device: torch.device, backend: str = "inductor", dynamic: bool | None = None,
    fallbacks: dict[str, str] | None = None,
) -> CompileChoice:
    """Compile each transformer block of `model` in place; fall back visibly when compile cannot run.

    Call it last, after checkpointing and LoRA have been applied to the blocks. Why it did
    not run is also noted in `fallbacks["compile"]` when given.
    `backend` is torch.compile's ('aot_eager' traces without generating code: tests).
    """
    reason = compile_unavailable_reason(device, backend)
    if reason:
        reason = f"{reason}; the blocks ran eager"
        if fallbacks is not None:
            fallbacks["compile"] = reason  # the training loop logs it once and writes it to the metrics
        else:
            log.warning("memfit: --compile: %s", reason)
        return CompileChoice("off", 0, reason)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    blocks = transformer_blocks(base)
    split = 0
    for block in blocks:
        if any(is_tiled(module) for module in block.modules()):
            _compile_around_tiles(block, backend, dynamic)
            split += 1
        else:
            block.compile(backend=backend, dynamic=dynamic)
    how = f"{backend}; tiled MLPs: each child and each MLP tile compiled apart" if split else backend
    return CompileChoice(f"{len(blocks)} of {len(blocks)} blocks ({how})", len(blocks))


def _compile_around_tiles(block: nn.Module, backend: str, dynamic: bool | None) -> None:
    """Compile a block whose MLP is tiled one level down: its other children, and the MLP per tile.

    The tiled MLP's autograd function cannot be traced; inside one compiled block it would
    break the graph, and under checkpointing Dynamo then runs the whole block eager.
    """
    for child in block.children():
        tiled = [module for module in child.modules() if is_tiled(module)]
        if not tiled:
            child.compile(backend=backend, dynamic=dynamic)
        for mlp in tiled:
            compile_each_tile(mlp, lambda forward: torch.compile(forward, backend=backend, dynamic=dynamic))


def compile_token_loss(backend: str = "inductor", dynamic: bool | None = None) -> Callable[..., torch.Tensor]:
    """`loss.token_loss_sum` compiled: the logits' fp32 cast, post-processing and log-softmax fused.

    That tail of the step is memory-bound element-wise work over `[tokens, vocabulary]`
    (on a CPU with a 32K vocabulary it dominates a small model's step: docs/speed.md); it
    takes plain tensors, so it compiles under any engine, with or without the chunked loss.
    """
    return torch.compile(token_loss_sum, backend=backend, dynamic=dynamic)


def compile_stats() -> dict[str, int]:
    """Graphs Dynamo compiled so far in this process: 1 or 2 for a run's blocks, more means recompiles.

    The forward of blocks that run with a Hugging Face KV cache (`use_cache=True`) recompiles
    as the cache fills: memfit's loss always calls the model with `use_cache=False`.
    """
    from torch._dynamo.utils import counters

    return {"compiled_graphs": int(counters["stats"]["unique_graphs"])}


def _apply(model: nn.Module, run, context):
    from memfit.techniques.technique import Applied

    if not run.compiled:
        return Applied()
    choice = compile_blocks(model, context.device, fallbacks=context.fallbacks)
    compiled = choice.compiled_blocks > 0
    # liger's fused loss never builds the logits: only the plain loss has a tail to compile (the loss recipe does)
    description = f"{choice.description} and the loss" if compiled and not run.fused_loss else choice.description
    return Applied(description, changes={"compiled": compiled}, quiet=True)


def _technique():
    from memfit.techniques.technique import Technique

    return Technique(
        name="compile", settings=("compile",), after=("kernels", "efficient_norm", "tiled_mlp", "lora",
                                                      "gradient_checkpointing"),
        resolve=lambda facts, run: {"compiled": facts.config.memory.compile}, apply=_apply,
        report=lambda run: {"compiled": True} if run.compiled else {},
        summary="each block compiled (inductor): fewer kernels and intermediates; a compile at the start",
    )


TECHNIQUE = _technique()
