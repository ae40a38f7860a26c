"""A head's per-token log-probabilities and their gradients in one pass, when the loss's gradient is known ahead.

techniques/sequence_logprobs.py takes the head's gradients in forward when its caller says ahead what gradient each
token's log-probability will get (GRPO: `token_gradient`). Through autograd, each chunk then makes and frees half a
dozen `[chunk, vocabulary]` fp32 tensors (the logits, their log-softmax, the entropy's exponentials, the negative
log-likelihood's and the log-softmax's gradients): on a CPU, new pages for each and a heap that keeps the largest
layout any chunk needed. Here one chunk is worked in two buffers, reused by every chunk, with in-place operations:

    z = f * logits - max          (f: the post-processing's factor, 1 / temperature included)
    e = exp(z), s = sum(e)        log p(target) = z[target] - log s
    entropy = log s - (e . z) / s
    d loss / d logits = f * g * (onehot(target) - e / s)   (g: the gradient said ahead), written over e

then the two products of the head (the hidden states' gradient, the head's added in place), as the autograd path.

Saves: the chunk's other temporaries (four of the six) and their allocations; four passes over the chunk instead of
about ten. Numerics: the autograd path's values and gradients up to float rounding (tests/unit/tasks/
test_grpo_gradient_ahead.py compares them for every GRPO loss type). Applies where the model's logit
post-processing only multiplies (`logit_postprocessing`'s `linear_factor`: not Gemma's soft-capping) and autocast
is off (a 16-bit model's logits are cast to fp32 as the autograd path casts them); elsewhere the autograd path runs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from memfit.techniques.chunked_head_loss import accumulate_head_product
from memfit.techniques.loss import IGNORE_INDEX


def head_gradients_in_place(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                            targets: torch.Tensor, chunk_size: int, factor: float, needs: tuple,
                            gradient_ahead: Callable, values: torch.Tensor,
                            on_entropy: Callable[[torch.Tensor], None] | None = None) -> tuple:
    """(grad hidden, grad weight, grad bias) of the log-probabilities of `targets` under `factor * head(hidden)`, a
    chunk at a time, the gradient of chunk start:end being `gradient_ahead(start, end, its values)`; `values`
    receives the log-probabilities (0 where the target is IGNORE_INDEX), `on_entropy` each chunk's entropies.
    `needs`: the three inputs' needs_input_grad (None where False)."""
    needs_hidden, needs_weight, needs_bias = needs
    tokens, vocabulary = hidden.size(0), weight.size(0)
    rows = min(chunk_size, tokens)
    grad_hidden = torch.empty_like(hidden) if needs_hidden else None
    grad_weight = grad_bias = None
    shifted = torch.empty((rows, vocabulary), dtype=torch.float32, device=hidden.device)
    exponentials = torch.empty_like(shifted)
    native = None if weight.dtype == torch.float32 else torch.empty((rows, vocabulary), dtype=weight.dtype,
                                                                     device=hidden.device)
    with torch.no_grad():
        for start in range(0, tokens, chunk_size):
            end = min(start + chunk_size, tokens)
            chunk, target = hidden[start:end].detach(), targets[start:end]
            z, e = shifted[: end - start], exponentials[: end - start]
            if native is None:
                torch.mm(chunk, weight.t(), out=z)
            else:  # the logits in the model's dtype, then fp32, as the autograd path's `.float()`
                z.copy_(torch.mm(chunk, weight.t(), out=native[: end - start]))
            if bias is not None:
                z.add_(bias)
            if factor != 1.0:
                z.mul_(factor)
            z.sub_(z.amax(dim=-1, keepdim=True))
            torch.exp(z, out=e)
            sums = e.sum(dim=-1)
            log_sums = sums.log()
            scored = target != IGNORE_INDEX
            index = target.clamp(min=0).unsqueeze(1)
            logprobs = torch.where(scored, z.gather(1, index).squeeze(1) - log_sums, 0.0)
            values[start:end] = logprobs
            if on_entropy is not None:
                on_entropy(log_sums - torch.linalg.vecdot(e, z) / sums)
            gradient = torch.where(scored, gradient_ahead(start, end, logprobs).float(), 0.0) * factor
            e.mul_((-gradient / sums).unsqueeze(1))
            e.scatter_add_(1, index, gradient.unsqueeze(1))
            grad_logits = e if native is None else native[: end - start].copy_(e)
            if needs_hidden:
                torch.mm(grad_logits, weight, out=grad_hidden[start:end])
            if needs_weight:
                grad_weight = accumulate_head_product(grad_weight, grad_logits, chunk.to(grad_logits.dtype),
                                                      weight.dtype)
            if needs_bias:
                chunk_bias = grad_logits.sum(0, dtype=bias.dtype)
                grad_bias = chunk_bias if grad_bias is None else grad_bias.add_(chunk_bias)
    return grad_hidden, grad_weight, grad_bias
