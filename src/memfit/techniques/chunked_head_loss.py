"""The chunked loss with the head's gradient accumulated in place (what `--loss-chunk-size` runs for a trained head).

Saves: with every loss chunk checkpointed on its own (techniques/loss.py), each chunk's
backward makes a head-sized weight gradient and autograd adds it to the sum so far out of
place: the sum, the chunk's gradient and the new sum (three `vocab x hidden` tensors, 3.1
GiB in bf16 for Llama 3's 128,256 x 4,096 head) are live at once before the head's gradient
is complete. Here one autograd function runs the whole loss: its forward computes the loss
chunk by chunk and keeps only the hidden states; its backward recomputes one chunk's logits
at a time, takes the loss's gradient with respect to them, adds the chunk's head gradient
into ONE head-sized buffer in place (`addmm_`) and writes the chunk's hidden-state gradient
into one preallocated buffer. What is live is one head gradient and one chunk's logits and
their gradients.
Costs: nothing more than the checkpointed chunks (the projection runs again per chunk in
backward either way).
Numerics: the chunk's head gradient is added in the weight's dtype. For a 16-bit weight the
sum is rounded once per chunk, as autograd's out-of-place sums were; an fp32 accumulator
would cost another head-sized tensor (two, counting the final cast), which is what this
path removes. Under autocast with an fp32 weight, the chunk's 16-bit operands are upcast
(chunk-sized copies) and the sum is fp32.
Applies to a plain `nn.Linear` head (tied to the embedding or not, with or without a bias)
whose weight trains; the head module itself runs (in forward, and again per chunk in
backward), so hooks that watch it (the memory tracker's) see it as before. Elsewhere the
checkpointed chunks run (`in_place_head_problem` says why): a LoRA-wrapped or quantized
head, a model sharded by FSDP2 or DeepSpeed (their hooks gather the weight and reduce its
gradient; the session also keeps DeepSpeed's ZeRO-1/2 on that path), a frozen weight.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F

log = logging.getLogger("memfit")


FROZEN_HEAD = "the output head's weight does not train"
"""`in_place_head_problem`'s answer for a plain Linear head whose weight is frozen (its only problem)."""


def in_place_head_problem(head: torch.nn.Module, model: torch.nn.Module | None = None) -> str:
    """Why the in-place head gradient cannot run for `head` of `model` ('' when it can)."""
    if any(cls.__name__ == "FSDPModule" for module in (model, head) for cls in type(module).__mro__):
        # FSDP2 swaps the sharded and gathered weights around the forward and reduces gradients from its own hooks
        return "the model is sharded by FSDP2"
    if type(head) is not torch.nn.Linear:
        # PEFT's LoRA layers and bitsandbytes' quantized linears have forwards of their own
        return f"the output head is a {type(head).__name__}, not a plain Linear"
    weight = head.weight
    if type(weight) not in (torch.nn.Parameter, torch.Tensor):
        return f"the output head's weight is a {type(weight).__name__}"  # FSDP2's DTensor, quantized parameters
    if hasattr(weight, "ds_id"):
        return "the output head's weight is partitioned by DeepSpeed"
    if not weight.requires_grad:
        return FROZEN_HEAD
    return ""


def head_gradient_path(model: torch.nn.Module, engine: str, chunk_size: int, fused_loss: bool,
                       fallbacks: dict[str, str]) -> str:
    """How a run's chunked loss makes the head's gradient, said once in the log and in the metrics.

    'in place' (this module), 'per chunk' (the checkpointed chunks; why in `fallbacks["chunked_head_loss"]`),
    or '' where no chunked loss runs (`chunk_size` 0, liger's `fused_loss`) or the head has no trained weight.
    `engine`: the engine's name (train/engine.py); DeepSpeed's keeps the checkpointed chunks.
    """
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if chunk_size <= 0 or fused_loss or head is None or not isinstance(weight, torch.Tensor) or not weight.requires_grad:
        return ""
    problem = "DeepSpeed reduces the head's gradient from hooks of its own" if engine == "deepspeed" else (
        in_place_head_problem(head, model))
    if problem:
        fallbacks["chunked_head_loss"] = (f"{problem}: each loss chunk's head gradient is summed out of place"
                                          " (up to three head-sized tensors at once)")
        return "per chunk"
    log.info("memfit: chunked loss: the head's gradient is accumulated in place across the %d-token chunks",
             chunk_size)
    return "in place"


def chunked_head_loss_sum(hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Linear, chunk_size: int,
                          postprocess: Callable[[torch.Tensor], torch.Tensor],
                          token_loss: Callable[..., torch.Tensor]) -> torch.Tensor:
    """Summed `token_loss` of `head(hidden)` against `targets`, `chunk_size` rows at a time (fp32 scalar).

    `hidden`: `[tokens, hidden]`; `targets`: `[tokens]`; `postprocess` and `token_loss` as in
    techniques.loss. The head's gradient is accumulated in place across chunks (module docstring).
    """
    return _ChunkedHeadLoss.apply(hidden, head.weight, head.bias, targets, chunk_size, postprocess, token_loss)


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, chunk_size, postprocess, token_loss):
        # `weight` and `bias` are the head's, passed as inputs so that autograd gives them their gradients
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.size(0), chunk_size):
            end = start + chunk_size
            # the head's own projection, not a call of the module: a module call here would let module hooks
            # (FlopCounterMode's tracker) hang gradient hooks on inputs that have no graph inside this forward
            total += token_loss(F.linear(hidden[start:end], weight, bias), targets[start:end], postprocess)
        ctx.save_for_backward(hidden, weight, bias, targets)
        ctx.chunk_size, ctx.postprocess, ctx.token_loss = chunk_size, postprocess, token_loss
        ctx.autocast = autocast_state(hidden)
        return total

    @staticmethod
    def backward(ctx, grad_total):
        grads = backward_by_chunks(ctx, lambda logits, targets: ctx.token_loss(logits, targets, ctx.postprocess),
                                   lambda start, end: grad_total)
        return *grads, None, None, None, None


def autocast_state(hidden: torch.Tensor) -> tuple:
    """The autocast forward ran under, for backward to recompute the logits as forward computed them."""
    device_type = hidden.device.type
    return device_type, torch.get_autocast_dtype(device_type), torch.is_autocast_enabled(device_type)


def backward_by_chunks(ctx, value_of: Callable, grad_of: Callable) -> tuple:
    """The gradients of hidden, weight and bias for a head run a chunk of rows at a time, recomputed here.

    `ctx` saved (hidden, weight, bias, targets), `chunk_size` and `autocast` (`autocast_state`); `value_of(logits,
    targets)` is what forward computed of a chunk's logits, `grad_of(start, end)` the gradient it received for those
    rows. The head's gradient is added to in place, chunk by chunk: one head-sized buffer.
    """
    hidden, weight, bias, targets = ctx.saved_tensors
    return chunk_gradients(hidden, weight, bias, targets, ctx.chunk_size, ctx.autocast, ctx.needs_input_grad[:3],
                           value_of, lambda start, end, value: grad_of(start, end))


def chunk_gradients(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, targets: torch.Tensor,
                    chunk_size: int, autocast: tuple, needs: tuple, value_of: Callable, grad_of: Callable,
                    values: torch.Tensor | None = None) -> tuple:
    """(grad hidden, grad weight, grad bias) of `value_of(head(hidden), targets)` a chunk at a time (None where
    `needs`, the three inputs' needs_input_grad, says no), `grad_of(start, end, value)` the gradient a chunk's value
    gets; `values`, when given, receives each chunk's value (a forward that knows its gradient ahead: one pass).
    """
    needs_hidden, needs_weight, needs_bias = needs
    grad_hidden = torch.empty_like(hidden) if needs_hidden else None
    grad_weight = grad_bias = None
    device_type, dtype, enabled = autocast
    # No autocast cache: a 16-bit copy of an fp32 head would stay for the whole backward; cast per chunk instead.
    recompute = torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=False)
    for start in range(0, hidden.size(0), chunk_size):
        end = start + chunk_size
        chunk = hidden[start:end].detach().requires_grad_(needs_hidden)
        # no saved-tensor hooks: activation offload must not move a chunk's short-lived tensors, used right here
        with torch.enable_grad(), recompute, torch.autograd.graph.saved_tensors_hooks(_same, _same):
            logits = F.linear(chunk, weight.detach(), None if bias is None else bias.detach())  # no module call
            if not needs_hidden:  # nothing upstream trains: the logits are where the recomputed graph starts
                logits = logits.detach().requires_grad_()
            value = value_of(logits, targets[start:end])
            if values is not None:
                values[start:end] = value.detach()
            grads = torch.autograd.grad(value, [logits, chunk] if needs_hidden else [logits],
                                        grad_of(start, end, value.detach()))
        grad_logits = grads[0]
        del logits, value
        if needs_hidden:
            grad_hidden[start:end].copy_(grads[1])
        del grads
        # without autocast (a backward called inside an autocast region runs in it): the sums keep the
        # parameters' dtypes
        with torch.autocast(device_type, enabled=False):
            if needs_weight:
                # the input the projection multiplied (cast to the compute dtype under autocast)
                rows = chunk.detach().to(grad_logits.dtype)
                grad_weight = accumulate_head_product(grad_weight, grad_logits, rows, weight.dtype)
            if needs_bias:
                chunk_bias = grad_logits.sum(0, dtype=bias.dtype)
                grad_bias = chunk_bias if grad_bias is None else grad_bias.add_(chunk_bias)
        del grad_logits
    return grad_hidden, grad_weight, grad_bias


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def accumulate_head_product(total: torch.Tensor | None, grad_logits: torch.Tensor, rows: torch.Tensor,
                            dtype: torch.dtype) -> torch.Tensor:
    """`total += grad_logits^T @ rows` in place, in `dtype` (the first chunk's product starts the sum)."""
    # A 16-bit product with an fp32 weight (autocast): upcasting the chunk's operands costs chunk-sized copies,
    # where casting the product would cost a head-sized one.
    grad_logits, rows = grad_logits.to(dtype), rows.to(dtype)
    if total is None:
        return grad_logits.t().mm(rows)
    # addmm's out= form is the in-place product-and-add too, and is the op that FLOP counters know (they count
    # aten.addmm, not aten.addmm_)
    return torch.addmm(total, grad_logits.t(), rows, out=total)
