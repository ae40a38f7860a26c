"""What the NF4 tensors memfit holds outside bitsandbytes' linears share: how to tell one, its blocks' absmax, its bytes.

The NF4 expert stacks (expert_quant.py, expert_dequant_groups.py) and the NF4 output head (nf4_head.py) keep
bitsandbytes' packed weights with a QuantState and dequantize slices of them; both read the fp32 absmax of each
64-weight block, and both count their bytes the same way.
"""

from __future__ import annotations

import copy

import torch


def is_nf4(weight: torch.Tensor) -> bool:
    """Whether `weight` is a fused expert stack held in NF4 (expert_quant.quantize_expert_weight)."""
    state = getattr(weight, "quant_state", None)
    return type(weight).__name__ == "Params4bit" and state is not None and len(state.shape) == 3


def block_absmax(state) -> torch.Tensor:
    """The fp32 absmax of every block of a (double-quantized) NF4 tensor, from its QuantState."""
    import bitsandbytes.functional as bnb_functional

    if state.nested:
        return bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    return state.absmax.float()


def nf4_bytes(weight: torch.Tensor) -> int:
    """Bytes an NF4 tensor holds: the packed weights and every tensor of its QuantState."""
    state = weight.quant_state
    tensors = [weight.data, state.absmax, state.code, state.offset]
    if state.state2 is not None:
        tensors += [state.state2.absmax, state.state2.code]
    return sum(t.nbytes for t in tensors if isinstance(t, torch.Tensor))


def dequantize_nf4(packed: torch.Tensor, state) -> torch.Tensor:
    """bitsandbytes' `dequantize_4bit` of `packed` under `state`, in `state.shape`, read through a flat shape.

    `quantize_4bit` runs its 64-weight blocks over the flattened tensor, but bitsandbytes' AVX-512 CPU kernel, given a
    2-D or 3-D shape, looks a block's absmax up row by row: rows shorter than a block (or a slice of a stack that
    starts past its first expert) read other blocks' scales (up to 1.9 off where the weights' own rounding is 0.45).
    Given one flat row, every kernel reads the blocks as they were made.
    """
    import bitsandbytes.functional as bnb_functional

    flat = copy.copy(state)  # the tensors are shared; only the shape it is read in differs
    flat.shape = torch.Size((state.shape.numel(),))
    return bnb_functional.dequantize_4bit(packed.reshape(-1), flat).reshape(state.shape)
