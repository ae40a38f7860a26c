"""Gradient (activation) checkpointing: recompute block activations in backward.

`full` keeps only each transformer block's input and recomputes the rest in backward:
activation memory falls from every intermediate of every block to one tensor per block
plus one block's intermediates, at the cost of about one extra forward (~20-30% slower).
`--checkpoint-every N` checkpoints only every Nth block (less recompute, less saving).
`selective` keeps matmul/attention outputs and recomputes the cheap ops: activation memory
lands between off and full, for the recompute of the cheap ops only (a few percent of a
step's FLOPs; on a CPU with a small model the dispatch mode that sees every operator costs
more: prediction/speed_model.SELECTIVE_DISPATCH_CPU_FLOPS). `auto` picks the blocks to
checkpoint so the run fits a memory budget (techniques.auto_checkpointing).

Selective checkpointing goes through `torch.utils.checkpoint.checkpoint` (non-reentrant,
with a selective-checkpoint `context_fn`). Hugging Face models take those keyword
arguments as `gradient_checkpointing_kwargs`:
`model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)` binds them with
`functools.partial(checkpoint, **kwargs)` (transformers 5.23, where the method is a
deprecated alias of `activation_checkpointing_enable`, which takes the same dict as
`activation_checkpointing_kwargs`).

Hugging Face models use their own switch, with non-reentrant checkpointing; any other
model with a list of blocks is wrapped with torch.utils.checkpoint.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

_aten = torch.ops.aten

# Outputs worth keeping: they cost O(n^3)-like FLOPs to recompute, the rest is O(n^2).
SAVED_OPS = {
    _aten.mm.default,
    _aten.addmm.default,
    _aten.bmm.default,
    _aten.baddbmm.default,
    _aten._scaled_dot_product_flash_attention.default,
    _aten._scaled_dot_product_efficient_attention.default,
    _aten._scaled_dot_product_cudnn_attention.default,
    _aten._scaled_dot_product_flash_attention_for_cpu.default,
}


def _keep_matmul_outputs(ctx, op, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_checkpoint_kwargs() -> dict:
    """Keyword arguments for `torch.utils.checkpoint.checkpoint` that keep matmul/attention outputs.

    Pass them as Hugging Face `gradient_checkpointing_kwargs` (or to `checkpoint` directly).
    Each checkpointed call gets fresh contexts from `context_fn`.
    """
    return {
        "use_reentrant": False,
        "context_fn": functools.partial(create_selective_checkpoint_contexts, _keep_matmul_outputs),
    }


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The model's list of transformer blocks: its longest nn.ModuleList."""
    lists = [module for module in model.modules() if isinstance(module, nn.ModuleList)]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no list of blocks to checkpoint")
    return max(lists, key=len)


def checkpointed_block_indices(num_blocks: int, every: int) -> list[int]:
    """Blocks checkpointed with --checkpoint-every N: 0, N, 2N, ..."""
    return list(range(0, num_blocks, every))


class CheckpointedBlock(nn.Module):
    """Wraps a block so its forward is recomputed in backward (for non-Hugging Face models)."""

    def __init__(self, block: nn.Module, checkpoint_kwargs: dict | None = None):
        super().__init__()
        self.block = block
        self.checkpoint_kwargs = checkpoint_kwargs or {}

    def forward(self, *args, **kwargs):
        if not (self.training and torch.is_grad_enabled()):
            return self.block(*args, **kwargs)
        return checkpoint(self.block, *args, use_reentrant=False, **self.checkpoint_kwargs, **kwargs)


def apply_gradient_checkpointing(
    model: nn.Module, mode: str, every: int = 1, block_indices: list[int] | None = None
) -> str:
    """Switch checkpointing on in place; return a one-line description of what was done.

    mode: off, full or selective. `block_indices` (from the auto mode) overrides `every`.
    """
    if mode == "off":
        return "off"
    kwargs: dict = {"use_reentrant": False}
    if mode == "selective":
        kwargs = selective_checkpoint_kwargs()
    blocks = transformer_blocks(model)
    chosen = block_indices if block_indices is not None else checkpointed_block_indices(len(blocks), every)
    if hasattr(model, "gradient_checkpointing_enable") and getattr(model, "supports_gradient_checkpointing", False):
        enable = getattr(model, "activation_checkpointing_enable", None)  # transformers >= 5.23's name
        if enable is not None:
            enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        if all(hasattr(block, "gradient_checkpointing") for block in blocks):
            for index, block in enumerate(blocks):
                block.gradient_checkpointing = index in chosen
        else:  # a model whose checkpointed layers are not its blocks: keep HF's choice, all of them
            chosen = list(range(len(blocks)))
    else:
        extra = {k: v for k, v in kwargs.items() if k != "use_reentrant"}
        for index in chosen:
            blocks[index] = CheckpointedBlock(blocks[index], extra)
    return f"{mode} on {len(chosen)} of {len(blocks)} blocks"


def checkpointed_count(model: nn.Module) -> int:
    """How many of the model's blocks recompute their activations in backward (read from the model itself)."""
    try:
        blocks = transformer_blocks(model)
    except ValueError:
        return 0
    return sum(isinstance(block, CheckpointedBlock) or getattr(block, "gradient_checkpointing", False) is True
               for block in blocks)
