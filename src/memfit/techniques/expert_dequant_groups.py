"""Bounded dequantization of NF4 expert stacks: a group of experts at a time instead of the whole stack.

QLoRA's NF4 expert stacks (techniques/expert_quant.py) are dequantized to the compute dtype for each grouped
matmul. Whole, that copy is one projection of every expert of a layer (gpt-oss-20b's gate_up: 32 x 2,880 x
5,760 in bf16, 1.0 GiB), live during the call in forward and again in backward. With a group of G experts the
stack is dequantized G experts at a time: the tokens are already sorted by expert, so each group's tokens are
one contiguous slice, run through one grouped matmul with that group's dequantized weights, and the copy is
dropped before the next group's is made.

Saves: (1 - G / experts) of the dequantized stack. Costs: one fp32 copy of the stack's absmax (1/16 byte a
weight, 64 MiB for that stack) made once per call, the expert offsets read on the host (a synchronisation) and
experts / G grouped matmuls instead of one. The numbers are the same: each expert's rows meet the same
dequantized weights in the same matmul, only split across calls.

Where: stacks whose per-expert weight count is a whole number of NF4 blocks (64), so a group's packed bytes
and absmax are plain slices; any other stack is dequantized whole, said in the one line
`set_dequant_group` returns.
"""

from __future__ import annotations

import torch
from torch import nn

from memfit.techniques.nf4_state import block_absmax, dequantize_nf4, is_nf4

GROUP_ATTRIBUTE = "memfit_dequant_group"


def dequant_group(weight: torch.Tensor) -> int:
    """Experts per dequantized group of an NF4 stack (0: the whole stack at once)."""
    return getattr(weight, GROUP_ATTRIBUTE, 0)


def dequantized_experts(weight: torch.Tensor, first: int, last: int, dtype: torch.dtype,
                        absmax: torch.Tensor | None = None) -> torch.Tensor:
    """Experts [first, last) of an NF4 stack, dequantized to `dtype` (absmax: `block_absmax` of its state, if made)."""
    from bitsandbytes.functional import QuantState

    state = weight.quant_state
    _, rows, columns = state.shape
    blocks = rows * columns // state.blocksize
    absmax = block_absmax(state) if absmax is None else absmax
    part = QuantState(absmax=absmax[first * blocks:last * blocks], shape=torch.Size((last - first, rows, columns)),
                      code=state.code, blocksize=state.blocksize, quant_type=state.quant_type, dtype=dtype)
    return dequantize_nf4(weight.data[first:last], part)


def groupable(weight: torch.Tensor) -> bool:
    """Whether each expert of the NF4 stack is a whole number of quantization blocks."""
    _, rows, columns = weight.quant_state.shape
    return rows * columns % weight.quant_state.blocksize == 0


def grouped_nf4_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, dtype: torch.dtype,
                   as_in_out, grouped_mm) -> torch.Tensor:
    """x (tokens sorted by expert) times each expert's NF4 weight, dequantized `dequant_group` experts at a time.

    as_in_out(stack) turns a dequantized (group, ...) stack into grouped_mm's (group, in, out) layout;
    grouped_mm(x, stack, offsets) is the grouped matmul of the whole-stack path.
    """
    experts = weight.quant_state.shape[0]
    group = dequant_group(weight)
    absmax = block_absmax(weight.quant_state)
    ends = [0] + offsets.tolist()  # each expert's rows end here; read once on the host for the slices
    out = None
    for first in range(0, experts, group):
        last = min(experts, first + group)
        start, stop = ends[first], ends[last]
        stack = as_in_out(dequantized_experts(weight, first, last, dtype, absmax))
        if out is None:
            out = x.new_empty((x.shape[0], stack.shape[-1]), dtype=dtype)
            if ends[-1] < x.shape[0]:
                out[ends[-1]:].zero_()  # rows past the last expert (grouped_mm leaves them unset too)
        if stop > start:
            out[start:stop] = grouped_mm(x[start:stop].to(dtype).contiguous(), stack, offsets[first:last] - start)
        del stack  # the next group's copy is made only after this one is gone
    return out


def set_dequant_group(model: nn.Module, group: int) -> str:
    """Dequantize each NF4 expert stack of `model` `group` experts at a time (0: whole); one line saying where."""
    from memfit.models.experts import EXPERT_PARAMETERS

    stacks, whole = 0, []
    for name, module in model.named_modules():
        for attribute in EXPERT_PARAMETERS:
            weight = getattr(module, attribute, None)
            if not is_nf4(weight):
                continue
            if not groupable(weight):
                whole.append(f"{name}.{attribute}")
                continue
            experts = weight.quant_state.shape[0]
            setattr(weight, GROUP_ATTRIBUTE, group if 0 < group < experts else 0)
            stacks += 1
    if not stacks and not whole:
        return "off: no NF4 expert stack (needs --quantize 4bit on a mixture of experts)"
    line = f"{stacks} NF4 expert stacks dequantized {group} experts at a time"
    if whole:
        line += f"; dequantized whole (an expert is not a whole number of 64-weight blocks): {', '.join(whole[:3])}"
    return line


def _apply(model: nn.Module, run, context):
    from memfit.techniques.technique import Applied

    if not run.expert_dequant_group:
        return Applied()
    return Applied(f"expert dequant group: {set_dequant_group(model, run.expert_dequant_group)}")


def _technique():
    from memfit.techniques.technique import Technique, report_when_on

    return Technique(
        name="expert_dequant_group", settings=("expert_dequant_group",), after=("embedding_on_host",), apply=_apply,
        resolve=lambda facts, run: {"expert_dequant_group": facts.config.memory.expert_dequant_group or 0},
        report=report_when_on("expert_dequant_group"),
        summary="NF4 expert stacks are dequantized a group of experts at a time, not the whole stack",
    )


TECHNIQUE = _technique()
