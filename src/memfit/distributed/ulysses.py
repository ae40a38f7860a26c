"""Ulysses attention over a context group: all-to-all from sequence shards to head shards and back.

Each rank holds a contiguous shard of every row (memfit.distributed.sequence_shards). Before
attention, one all-to-all turns this rank's queries, keys and values from [seq/N, heads] into
[seq, heads/N]: the rank then attends the whole row on its share of the heads, with the causal
and document mask of the whole row (built from the gathered positions), and a second all-to-all
turns the output back into [seq/N, heads]. Per layer and rank that moves 4 x (N-1)/N of the
layer's local q, k, v and output activations (k and v at the key-value head count).

Hooked into the model through transformers' attention interface under the name
`ULYSSES_ATTENTION` (every causal LM whose attention calls `ALL_ATTENTION_FUNCTIONS` is covered).
This is memfit's own all-to-all over torch.distributed (gloo's all_to_all included); see
memfit.distributed.context_parallel for which implementation runs where.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from memfit.distributed.sequence_shards import document_ids

ULYSSES_ATTENTION = "memfit_ulysses"
"""The attention implementation name memfit registers for Ulysses context parallelism."""

_GROUP: dict[str, object] = {}
"""The context group the registered attention exchanges over (set by `use_context_group`)."""


def use_context_group(group, size: int) -> None:
    """The process group (and its size) that `ulysses_attention` exchanges over."""
    _GROUP["group"], _GROUP["size"] = group, size


def _all_to_all(tensor: torch.Tensor, group, size: int, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    import torch.distributed as dist

    pieces = [piece.contiguous() for piece in tensor.chunk(size, dim=scatter_dim)]
    received = [torch.empty_like(piece) for piece in pieces]
    dist.all_to_all(received, pieces, group=group)
    return torch.cat(received, dim=gather_dim)


class SequenceToHeads(torch.autograd.Function):
    """[batch, heads, seq/N, dim] -> [batch, heads/N, seq, dim] across the group; backward the inverse."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return _all_to_all(tensor, group, size, scatter_dim=1, gather_dim=2)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group, ctx.size, scatter_dim=2, gather_dim=1), None, None


class HeadsToSequence(torch.autograd.Function):
    """[batch, heads/N, seq, dim] -> [batch, heads, seq/N, dim] across the group; backward the inverse."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group, size: int) -> torch.Tensor:
        ctx.group, ctx.size = group, size
        return _all_to_all(tensor, group, size, scatter_dim=2, gather_dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_to_all(grad, ctx.group, ctx.size, scatter_dim=1, gather_dim=2), None, None


def gather_positions(positions: torch.Tensor, group, size: int) -> torch.Tensor:
    """The whole rows' positions from every rank's shard (in rank order), [batch, seq]."""
    import torch.distributed as dist

    pieces = [torch.empty_like(positions) for _ in range(size)]
    dist.all_gather(pieces, positions.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)


def whole_row_mask(positions: torch.Tensor) -> torch.Tensor | None:
    """[batch, 1, seq, seq] boolean: causal and within one document; None where plain causal is the same."""
    documents = document_ids(positions)
    if bool((documents == documents[:, :1]).all()):
        return None
    length = positions.size(-1)
    causal = torch.ones(length, length, dtype=torch.bool, device=positions.device).tril()
    same_document = documents[:, :, None] == documents[:, None, :]
    return (same_document & causal)[:, None]


def ulysses_attention(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None,
                      position_ids: torch.Tensor | None = None, **kwargs):
    """Attention of one layer over the whole row, this rank on heads/N (transformers' attention signature).

    The model's own `attention_mask` (built for the local shard) is not used: the mask of the
    whole row comes from the gathered `position_ids`.
    """
    group, size = _GROUP["group"], int(_GROUP["size"])
    if position_ids is None:
        raise ValueError("context-parallel attention needs the shard's position_ids")
    heads = query.size(1)
    if key.size(1) != heads and key.size(1) % size:  # fewer key-value heads than shards: give every query head its own
        groups = heads // key.size(1)
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    query, key, value = (SequenceToHeads.apply(t, group, size) for t in (query, key, value))
    mask = whole_row_mask(gather_positions(position_ids, group, size))
    # Grouped-query attention in the kernel: repeated keys and values would be saved for backward at the query heads.
    output = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout,
                                            is_causal=mask is None, scale=scaling,
                                            enable_gqa=key.size(1) != query.size(1))
    output = HeadsToSequence.apply(output, group, size)
    return output.transpose(1, 2).contiguous(), None


def register_ulysses_attention() -> str:
    """Register `ulysses_attention` with transformers under `ULYSSES_ATTENTION`; returns the name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ULYSSES_ATTENTION, ulysses_attention)
    return ULYSSES_ATTENTION
