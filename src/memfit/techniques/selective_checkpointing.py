"""Selective and automatic activation checkpointing.

Selective (`--gradient-checkpointing selective`)
    Saves: inside each checkpointed block only the outputs of the expensive ops
    (matmuls and attention) are kept; the cheap element-wise ops (norms, activations,
    rotary embeddings, residual adds, casts) are recomputed in backward. Activation
    memory lands between no checkpointing and full checkpointing.
    Costs: recomputing the cheap ops only, a few percent of a step instead of the
    ~20-30% of full checkpointing (which reruns the matmuls too).
    How: `selective_checkpoint_kwargs()` gives the keyword arguments of
    `torch.utils.checkpoint.checkpoint` (non-reentrant, with a selective-checkpoint
    `context_fn`). Hugging Face models take them as `gradient_checkpointing_kwargs`:
    `model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=...)` binds them
    with `functools.partial(checkpoint, **kwargs)` (transformers 5.23, where the method is
    a deprecated alias of `activation_checkpointing_enable`, which takes the same dict as
    `activation_checkpointing_kwargs`).

Automatic (`--gradient-checkpointing auto`, with `--memory-budget`)
    `measure_block_activation_bytes` runs one forward and attributes the bytes saved for
    backward to each transformer block; `choose_blocks_to_checkpoint` then checkpoints
    the fewest blocks (so the least recompute) that bring the predicted peak under the
    budget. Costs: one measuring forward before training, then the recompute of the
    chosen blocks only.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

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


# ---------------------------------------------------------------------------
# Automatic choice of the blocks to checkpoint
# ---------------------------------------------------------------------------


def predicted_peak_bytes(
    per_block_activation_bytes: list[int],
    fixed_bytes: int,
    checkpointed_block_bytes: list[int] | int,
    checkpointed: list[int],
) -> int:
    """Peak training bytes when the blocks in `checkpointed` are checkpointed.

    Two moments compete. At the end of forward every block holds its activations, or
    only `checkpointed_block_bytes` (its input) when checkpointed. In backward, blocks
    are undone last to first; when checkpointed block i is rebuilt, the blocks after it
    are already freed and the blocks before it still hold theirs, plus block i's full
    activations.
    """
    kept = _as_list(checkpointed_block_bytes, len(per_block_activation_bytes))
    chosen = set(checkpointed)
    held = [kept[i] if i in chosen else size for i, size in enumerate(per_block_activation_bytes)]
    peak = sum(held)
    held_before = 0
    for i, size in enumerate(per_block_activation_bytes):
        if i in chosen:
            peak = max(peak, held_before + kept[i] + size)
        held_before += held[i]
    return fixed_bytes + peak


def choose_blocks_to_checkpoint(
    per_block_activation_bytes: list[int],
    fixed_bytes: int,
    budget_bytes: int,
    checkpointed_block_bytes: list[int] | int,
) -> list[int] | None:
    """The fewest blocks to checkpoint so the predicted peak fits `budget_bytes`.

    Args:
        per_block_activation_bytes: bytes each block saves for backward (from
            `measure_block_activation_bytes`).
        fixed_bytes: everything else at the peak: weights, gradients, optimizer state,
            activations outside the blocks (embeddings, loss).
        budget_bytes: the memory to fit in.
        checkpointed_block_bytes: bytes a checkpointed block still keeps (its input),
            one per block or one value for all.
    Returns:
        Sorted block indices ([] when everything fits without checkpointing), or None
        when even checkpointing every block does not fit.

    Blocks are added one at a time, each time the one that lowers the predicted peak
    most (ties: the larger saving, then the earlier block); the first set that fits is
    returned. Exact for blocks of equal size, near-minimal otherwise.
    """
    count = len(per_block_activation_bytes)
    kept = _as_list(checkpointed_block_bytes, count)
    chosen: list[int] = []
    while True:
        if predicted_peak_bytes(per_block_activation_bytes, fixed_bytes, kept, chosen) <= budget_bytes:
            return sorted(chosen)
        candidates = [i for i in range(count) if i not in chosen]
        if not candidates:
            return None
        chosen.append(
            min(
                candidates,
                key=lambda i: (
                    predicted_peak_bytes(per_block_activation_bytes, fixed_bytes, kept, [*chosen, i]),
                    kept[i] - per_block_activation_bytes[i],
                    i,
                ),
            )
        )


def _as_list(value: list[int] | int, count: int) -> list[int]:
    if isinstance(value, int):
        return [value] * count
    if len(value) != count:
        raise ValueError(f"checkpointed_block_bytes has {len(value)} values for {count} blocks")
    return list(value)


def measure_block_activation_bytes(
    model: nn.Module, batch: Mapping[str, torch.Tensor] | torch.Tensor, blocks: nn.ModuleList | None = None
) -> list[int]:
    """Bytes saved for backward by each transformer block, from one forward pass.

    Run it before checkpointing is switched on (a checkpointed block saves almost
    nothing). `batch` is the model's keyword inputs (input_ids, attention_mask, ...)
    or a tensor of input ids; `blocks` defaults to the model's longest ModuleList.
    Parameters (weights saved by matmuls) are not counted; a storage saved twice is
    counted once. Costs one forward with autograd on.
    """
    if blocks is None:
        from memfit.techniques.checkpointing import transformer_blocks

        blocks = transformer_blocks(model)
    inputs = {"input_ids": batch} if isinstance(batch, torch.Tensor) else dict(batch)
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    per_block = [0] * len(blocks)
    seen: set[int] = set()
    current: list[int] = []  # stack of blocks being run

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if current and key not in parameter_storages and key not in seen:
            seen.add(key)
            per_block[current[-1]] += storage.nbytes()
        return tensor

    def enter(index: int, _module, _args) -> None:
        current.append(index)

    def leave(_module, _args, _output) -> None:  # returns None: the output stays as it is
        current.pop()

    handles = []
    for index, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(functools.partial(enter, index)))
        handles.append(block.register_forward_hook(leave))
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            outputs = model(**inputs)
        del outputs  # the graph (and the storages counted) lived until here
    finally:
        for handle in handles:
            handle.remove()
    return per_block
