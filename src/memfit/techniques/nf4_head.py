"""The frozen, untied output head held in 4-bit NF4 under QLoRA, dequantized a tile of vocabulary rows at a time.

transformers' bitsandbytes loading quantizes the blocks' linears and leaves the output head in the load dtype
(gpt-oss-20b: 201,088 x 2,880 in bf16, 1.08 GiB). Under QLoRA the head is frozen, so here it is quantized as the
linears are (bitsandbytes NF4, blocks of 64, double-quantized absmax) and the module is replaced by an `Nf4Head`
whose forward projects with the dequantized head one tile of `HEAD_TILE_WEIGHTS` weights (a multiple of 64 rows)
at a time, writing each tile's logits into the output: the whole 16-bit head never exists. Backward runs the same
tiles for the input's gradient (the head gets none). memfit's chunked loss calls the head one token chunk at a
time, so at most one chunk's logits and one tile of weights are live.

Saves: the head's bytes less its NF4 bytes (about 0.52 byte a weight). Costs: NF4 rounding of the head's weights
(as QLoRA's linears), the dequantization of the whole head once in forward and once in backward per token chunk,
and no fused linear cross-entropy (liger's needs a plain linear head).

Where: a frozen `nn.Linear` output head not tied to the input embedding, with an even input width. Anything else
keeps its head, said in the one line `quantize_head` returns.
"""

from __future__ import annotations

import torch
from torch import nn

from memfit.techniques.host_embedding import embedding_tied_to_head
from memfit.techniques.nf4_state import block_absmax, dequantize_nf4, nf4_bytes

HEAD_TILE_WEIGHTS = 1 << 24
"""Weights of one dequantized tile of the head (32 MiB in bf16); rounded down to a multiple of 64 rows."""


def tile_rows(hidden: int) -> int:
    """Vocabulary rows of one tile: a multiple of 64, so each tile starts on an NF4 block boundary."""
    return max(64, HEAD_TILE_WEIGHTS // hidden // 64 * 64)


def dequantized_rows(weight: torch.Tensor, first: int, last: int, dtype: torch.dtype,
                     absmax: torch.Tensor | None = None) -> torch.Tensor:
    """Rows [first, last) of an NF4 head, dequantized to `dtype` (first a multiple of 64)."""
    from bitsandbytes.functional import QuantState

    state = weight.quant_state
    hidden, block = state.shape[1], state.blocksize
    absmax = block_absmax(state) if absmax is None else absmax
    part = QuantState(absmax=absmax[first * hidden // block:-(-last * hidden // block)],
                      shape=torch.Size((last - first, hidden)), code=state.code, blocksize=block,
                      quant_type=state.quant_type, dtype=dtype)
    packed = weight.data.reshape(-1)[first * hidden // 2:last * hidden // 2]
    return dequantize_nf4(packed, part)


def _tiles(weight: torch.Tensor):
    vocab, hidden = weight.quant_state.shape
    step = tile_rows(hidden)
    return [(first, min(vocab, first + step)) for first in range(0, vocab, step)]


class _Nf4HeadProjection(torch.autograd.Function):
    """hidden x W^T with W an NF4 head, dequantized a tile of rows at a time and never saved."""

    @staticmethod
    def forward(ctx, hidden, weight, dtype):
        ctx.weight, ctx.dtype, ctx.input_dtype = weight, dtype, hidden.dtype
        absmax = block_absmax(weight.quant_state)
        x = hidden.to(dtype)
        out = x.new_empty((*x.shape[:-1], weight.quant_state.shape[0]))
        for first, last in _tiles(weight):
            tile = dequantized_rows(weight, first, last, dtype, absmax)
            out[..., first:last] = x @ tile.t()
            del tile  # the next tile is made only after this one is gone
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weight = ctx.weight
        absmax = block_absmax(weight.quant_state)
        grad = grad_out.to(ctx.dtype)
        grad_hidden = None
        for first, last in _tiles(weight):
            tile = dequantized_rows(weight, first, last, ctx.dtype, absmax)
            part = grad[..., first:last] @ tile
            grad_hidden = part if grad_hidden is None else grad_hidden.add_(part)
            del tile, part
        return grad_hidden.to(ctx.input_dtype), None, None


class Nf4Head(nn.Module):
    """An output head whose frozen weight is NF4 (a bitsandbytes Params4bit), projected a tile at a time."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        self.in_features, self.out_features = weight.quant_state.shape[1], weight.quant_state.shape[0]
        self.weight = weight
        self.bias = bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) else (
            self.weight.quant_state.dtype)
        logits = _Nf4HeadProjection.apply(hidden, self.weight, dtype)
        return logits if self.bias is None else logits + self.bias.to(logits.dtype)


def why_not_nf4_head(model: nn.Module) -> str | None:
    """Why the output head of `model` cannot be held in NF4, or None when it can."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if type(head) is not nn.Linear:
        return f"the output head is a {type(head).__name__}, not a plain linear layer"
    if head.weight.requires_grad:
        return "the output head trains"
    if embedding_tied_to_head(model):
        return "the output head is tied to the input embedding, which looks up rows of it"
    if head.in_features % 2:
        return f"an odd input width ({head.in_features}) cannot pack two weights a byte"
    return None


def quantize_head(model: nn.Module) -> str:
    """Replace the frozen output head of `model` by its NF4 `Nf4Head` (in place); one line saying what was done."""
    import bitsandbytes.functional as bnb_functional
    from bitsandbytes.nn import Params4bit

    from memfit.techniques.loss import unwrap_causal_lm

    lm = unwrap_causal_lm(model)
    reason = why_not_nf4_head(lm)
    if reason:
        return f"off: {reason}"
    head = lm.get_output_embeddings()
    before = head.weight.nbytes
    packed, state = bnb_functional.quantize_4bit(head.weight.detach().contiguous(), blocksize=64,
                                                 compress_statistics=True, quant_type="nf4", quant_storage=torch.uint8)
    # rows x columns/2 (two weights a byte, exact for an even width): the weight's first dimension stays the
    # vocabulary, which the default loss chunk and the tracker's logits category read from the head
    packed = packed.view(state.shape[0], state.shape[1] // 2)
    weight = Params4bit(packed, requires_grad=False, quant_state=state, blocksize=64, compress_statistics=True,
                        quant_type="nf4", quant_storage=torch.uint8, bnb_quantized=True)
    lm.set_output_embeddings(Nf4Head(weight, head.bias))
    after = nf4_bytes(weight)
    return (f"output head {tuple(state.shape)} in NF4 ({before / 2**30:.2f} -> {after / 2**30:.2f} GiB), projected"
            f" {min(state.shape[0], tile_rows(state.shape[1]))} vocabulary rows at a time")




def _technique():
    from memfit.techniques.technique import Technique, apply_when_on, report_when_on

    return Technique(
        name="nf4_head", settings=("quantize_head",), after=("expert_offload",),
        resolve=lambda facts, run: {"quantize_head": facts.config.lora.quantize_head},
        # the frozen head in NF4, projected a tile of vocabulary rows at a time
        apply=apply_when_on("quantize_head", "NF4 head", quantize_head), report=report_when_on("quantize_head"),
        summary="the frozen output head in NF4 (QLoRA), projected a tile of vocabulary rows at a time",
    )


TECHNIQUE = _technique()
