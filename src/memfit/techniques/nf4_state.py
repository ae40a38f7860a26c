"""What every NF4 tensor memfit holds outside bitsandbytes' linears shares: its blocks' absmax and its bytes.

The NF4 expert stacks (expert_quant.py, expert_dequant_groups.py) and the NF4 output head (nf4_head.py) keep
bitsandbytes' packed weights with a QuantState and dequantize slices of them; both read the fp32 absmax of each
64-weight block, and both count their bytes the same way.
"""

from __future__ import annotations

import torch


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
