"""Automatic activation checkpointing: checkpoint the fewest blocks that fit a budget.

`--gradient-checkpointing auto` (with `--memory-budget`, `--gpu` or `--memory-cap`):
`measure_block_activation_bytes` runs one forward and attributes the bytes saved for
backward to each transformer block; `choose_blocks_to_checkpoint` then checkpoints the
fewest blocks (so the least recompute) that bring the predicted peak under the budget.
Weights, gradients and optimizer state in the prediction come from
`memfit.models.state_bytes`, the model the estimator uses. Costs: one measuring forward
before training, then the recompute of the chosen blocks only. How a block is
checkpointed (full or selective) lives in `memfit.techniques.checkpointing`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import torch
from torch import nn

from memfit.errors import UsageError
from memfit.models.state_bytes import optimizer_state_bytes_for_shapes
from memfit.techniques.checkpointing import apply_gradient_checkpointing, checkpointed_count, transformer_blocks
from memfit.units import format_bytes

# ---------------------------------------------------------------------------
# Automatic choice of the blocks to checkpoint
# ---------------------------------------------------------------------------


def predicted_peak_bytes(
    per_block_activation_bytes: list[int],
    fixed_bytes: int,
    checkpointed_block_bytes: list[int] | int,
    checkpointed: list[int],
    *,
    gradient_bytes: int = 0,
    loss_backward_bytes: int = 0,
) -> int:
    """Peak training bytes when the blocks in `checkpointed` are checkpointed.

    The moments that compete (each checked against memfit's MemoryTracker on a Llama step):

    - the loss's backward, the first moment of backward: every block holds its activations,
      or only `checkpointed_block_bytes` (its input) when checkpointed, the loss adds its
      gradient buffers (`loss_backward_bytes`), and no parameter gradient exists yet
      (`gradient_bytes`, part of `fixed_bytes`, is left out: the loop frees them after each step);
    - block i's backward, last block to first: the blocks before it hold theirs, block i holds
      its full activations (rebuilt on top of its input when checkpointed), and the gradients
      of block i and of the blocks after it exist (their share of `gradient_bytes`). The
      block's activation gradients take the place of the activations they free as they form:
      the tracker sees no transient beyond them.
    """
    count = len(per_block_activation_bytes)
    kept = _as_list(checkpointed_block_bytes, count)
    chosen = set(checkpointed)
    held = [kept[i] if i in chosen else size for i, size in enumerate(per_block_activation_bytes)]
    without_gradients = fixed_bytes - gradient_bytes
    peak = without_gradients + sum(held) + loss_backward_bytes
    held_before = 0
    for i, size in enumerate(per_block_activation_bytes):
        gradients = gradient_bytes * (count - i) // max(1, count)
        rebuilt = kept[i] + size if i in chosen else size
        peak = max(peak, without_gradients + held_before + rebuilt + gradients)
        held_before += held[i]
    return peak


def choose_blocks_to_checkpoint(
    per_block_activation_bytes: list[int],
    fixed_bytes: int,
    budget_bytes: int,
    checkpointed_block_bytes: list[int] | int,
    *,
    gradient_bytes: int = 0,
    loss_backward_bytes: int = 0,
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
        gradient_bytes, loss_backward_bytes: as in `predicted_peak_bytes`.
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
    moments = {"gradient_bytes": gradient_bytes, "loss_backward_bytes": loss_backward_bytes}
    while True:
        if predicted_peak_bytes(per_block_activation_bytes, fixed_bytes, kept, chosen, **moments) <= budget_bytes:
            return sorted(chosen)
        candidates = [i for i in range(count) if i not in chosen]
        if not candidates:
            return None
        chosen.append(
            min(
                candidates,
                key=lambda i: (
                    predicted_peak_bytes(per_block_activation_bytes, fixed_bytes, kept, [*chosen, i], **moments),
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
    return measure_saved_bytes(model, batch, blocks)[0]


def measure_saved_bytes(
    model: nn.Module, batch: Mapping[str, torch.Tensor] | torch.Tensor, blocks: nn.ModuleList | None = None
) -> tuple[list[int], int]:
    """Bytes saved for backward per block, and outside the blocks (embeddings, head, loss)."""
    if blocks is None:
        blocks = transformer_blocks(model)
    inputs = {"input_ids": batch} if isinstance(batch, torch.Tensor) else dict(batch)
    parameter_storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    per_block = [0] * len(blocks)
    outside = 0
    seen: set[int] = set()
    current: list[int] = []  # stack of blocks being run

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal outside
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in parameter_storages and key not in seen:
            seen.add(key)
            if current:
                per_block[current[-1]] += storage.nbytes()
            else:
                outside += storage.nbytes()
        return tensor

    def enter(index: int, _module, _args) -> None:
        current.append(index)

    def leave(_module, _args, _output) -> None:  # returns None: the output stays as it is
        current.pop()

    def require_grad(_module, _args, output):
        return output.requires_grad_(True)

    handles = []
    for index, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(functools.partial(enter, index)))
        handles.append(block.register_forward_hook(leave))
    embeddings = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embeddings is not None and not any(p.requires_grad for p in model.parameters()):
        # A frozen (e.g. quantized) base saves nothing unless something upstream needs grad;
        # training it with adapters will, so measure as if it did.
        handles.append(embeddings.register_forward_hook(require_grad))
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            outputs = model(**inputs)
        del outputs  # the graph (and the storages counted) lived until here
    finally:
        for handle in handles:
            handle.remove()
    return per_block, outside


# ---------------------------------------------------------------------------
# --gradient-checkpointing auto
# ---------------------------------------------------------------------------

# Share of the budget the prediction may use: the rest covers what the prediction
# leaves out (temporaries of backward, allocator fragmentation, the CUDA context).
AUTO_BUDGET_SHARE = 0.9


def static_training_bytes(model: nn.Module, config, run) -> int:
    """Weights, gradients and optimizer state of a run, from its TrainConfig (before LoRA is applied).

    The optimizer state is `memfit.models.state_bytes`' closed form for the model's trainable tensors.
    """
    return sum(static_training_parts(model, config, run))


def static_training_parts(model: nn.Module, config, run) -> tuple[int, int, int]:
    """Weights, gradients and optimizer state of a run apart (see `static_training_bytes`); `run` is its
    resolved run (techniques/resolved_run.py): which optimizer, stepped in backward, on the host."""
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    trainable = [p for p in model.parameters() if p.is_floating_point()]
    if config.lora_enabled or not trainable:
        return weights, 0, 0  # adapters' gradients and state are a rounding error at this scale
    trainable_bytes = sum(p.numel() * p.element_size() for p in trainable)
    if run.optimizer_in_backward:
        gradients = max(p.numel() * p.element_size() for p in trainable)  # one gradient alive at a time
    else:
        gradients = trainable_bytes
    if run.host_optimizer_step:
        return weights, gradients, 0
    element_size = trainable[0].element_size()
    states = optimizer_state_bytes_for_shapes(
        run.optimizer, [tuple(p.shape) for p in trainable], element_size, config.optimizer.momentum
    )
    return weights, gradients, states


def auto_checkpointing(model: nn.Module, config, budget_bytes: int | None, run) -> str:
    """`--gradient-checkpointing auto`: checkpoint the fewest blocks that fit `budget_bytes`.

    Measures one sample (batch 1 at --seq-len) and scales by --batch-size, predicts the
    peak with `predicted_peak_bytes` against 90% of the budget, and switches checkpointing
    on for the chosen blocks (all of them when nothing fits). The measuring forward runs
    in the model's dtype without autocast, so with mixed precision the estimate errs on
    the safe side. Returns a one-line description for the log.
    """
    if budget_bytes is None:
        raise UsageError("--gradient-checkpointing auto needs --memory-budget (or --gpu / --memory-cap) to aim at")
    blocks = transformer_blocks(model)
    parameter = next(model.parameters())
    vocab_size = getattr(model.config, "vocab_size", None) or 2
    seq_len, batch_size = config.data.seq_len_or_default, config.training.batch_size
    sample = torch.randint(0, vocab_size, (1, seq_len), device=parameter.device)
    try:
        per_sample, outside_per_sample = measure_saved_bytes(model, {"input_ids": sample, "labels": sample}, blocks)
    except torch.OutOfMemoryError:
        return (
            apply_gradient_checkpointing(model, "full")
            + " (auto: even a one-sample measuring forward ran out of memory)"
        )
    per_block = [size * batch_size for size in per_sample]
    weights, gradients, states = static_training_parts(model, config, run)
    fixed = weights + gradients + states + outside_per_sample * batch_size
    # The loss's backward: the log-softmax's and the logits' fp32 gradients (measured with the tracker).
    moments = {"gradient_bytes": 0 if run.optimizer_in_backward else gradients,
               "loss_backward_bytes": 2 * 4 * batch_size * seq_len * vocab_size}
    hidden_size = getattr(model.config, "hidden_size", None) or getattr(model.config, "n_embd", 0)
    embeddings = model.get_input_embeddings()
    element_size = embeddings.weight.element_size() if embeddings is not None else 4
    kept = batch_size * seq_len * hidden_size * element_size  # a checkpointed block keeps its input
    target = int(budget_bytes * AUTO_BUDGET_SHARE)
    chosen = choose_blocks_to_checkpoint(per_block, fixed, target, kept, **moments)
    if chosen is None:
        everything = list(range(len(blocks)))
        peak = predicted_peak_bytes(per_block, fixed, kept, everything, **moments)
        description = apply_gradient_checkpointing(model, "full")
        return f"{description} (auto: predicted peak {format_bytes(peak)} exceeds {format_bytes(target)} even so)"
    peak = predicted_peak_bytes(per_block, fixed, kept, chosen, **moments)
    if not chosen:
        return f"off (auto: predicted peak {format_bytes(peak)} fits {format_bytes(target)})"
    description = apply_gradient_checkpointing(model, "full", block_indices=chosen)
    return f"{description} (auto: predicted peak {format_bytes(peak)} within {format_bytes(target)})"


def checkpointing_budget(config) -> int | None:
    """The memory `--gradient-checkpointing auto` aims at: --memory-budget, --memory-cap, or the named GPU's."""
    budget = config.memory.memory_budget or config.memory.memory_cap
    if budget is None and config.memory.gpu:
        from memfit.gpus import lookup_gpu

        budget = lookup_gpu(config.memory.gpu).memory_bytes
    return budget


def _resolve(facts, run) -> dict:
    mode = facts.config.memory.gradient_checkpointing
    # auto checkpoints as few blocks as the budget allows: full is its upper bound until the model is built
    return {"checkpointing": "full" if mode == "auto" else mode, "checkpoint_auto": mode == "auto",
            "checkpoint_every": facts.config.memory.checkpoint_every}


def _apply(model: nn.Module, run, context):
    from memfit.techniques.technique import Applied

    if run.checkpoint_auto:
        description = auto_checkpointing(model, context.config, checkpointing_budget(context.config), run)
    else:
        description = apply_gradient_checkpointing(model, run.checkpointing, run.checkpoint_every)
    return Applied(description, changes={"checkpointed_blocks": checkpointed_count(model)}, quiet=True)


def _technique():
    from memfit.techniques.technique import Technique

    return Technique(
        name="gradient_checkpointing", settings=("gradient_checkpointing", "checkpoint_every"),
        resolve=_resolve, apply=_apply,
        report=lambda run: {"checkpointing": run.describe_checkpointing()},
        summary="blocks keep only their input and recompute the rest in backward: about a third more compute",
    )


TECHNIQUE = _technique()
