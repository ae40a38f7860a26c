"""QLoRA on the fused experts of a mixture of experts: the 3-D expert weights kept in 4-bit NF4.

bitsandbytes' `Linear4bit` holds 2-D weights only, so under `--quantize 4bit` transformers leaves a
mixture of experts' fused expert stacks (`experts.gate_up_proj`, `experts.down_proj`: 19.1 of gpt-oss-20b's
20.9B parameters) in the load dtype. Here each such stack is quantized with bitsandbytes'
`quantize_4bit` as the linears are (NF4, blocks of 64, double-quantized absmax) and held as a `Params4bit`
under its own name (the packed bytes, experts x rows x columns/2, and the QuantState); the 16-bit weight
is dropped.

Saves: 2 - 0.516 bytes a weight of a bf16 stack (about 3/4 of the experts' bytes): 0.5 byte per weight,
one uint8 absmax per 64 weights, one fp32 absmax per 256 blocks, and 1,096 bytes of maps and offset per stack.
Costs: each forward and each backward dequantizes one projection of one layer (its whole expert stack, to
the compute dtype) for its grouped matmul and drops it after: only that one copy is live at a time, and
backward dequantizes again instead of keeping the forward's copy (`_Nf4GroupedMm`). The frozen stack gets
no gradient; the input's gradient is the grouped matmul with the dequantized stack's transpose. NF4
rounding changes the frozen weights as it does the linears'.

Where: experts modules whose forward memfit's grouped path can run (techniques/expert_lora.py: transformers'
experts interface, not split across ranks), with float 3-D weights whose last dimension is even (two
weights a byte). Anything else (an experts module with its own loop, weights already held as MXFP4 blocks)
keeps its weights as loaded, said in the one line `quantize_fused_experts` returns.

The adapters are what a checkpoint saves; the NF4 stacks are rebuilt from the model's weights on load,
with the same bytes (quantization is deterministic).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from memfit.techniques.expert_dequant_groups import dequant_group, grouped_nf4_mm
from memfit.techniques.expert_streaming import host_parameter
from memfit.techniques.nf4_state import dequantize_nf4, is_nf4
from memfit.techniques.staged_weights import device_copy, keeps_on_host, staged_device

NF4_BLOCK = 64
"""Weights per absmax block, as bitsandbytes' Linear4bit uses for QLoRA."""


def why_not_nf4(weight: torch.Tensor) -> str | None:
    """Why a fused expert weight cannot be held in NF4 here, or None when it can."""
    if not isinstance(weight, nn.Parameter) or weight.dim() != 3:
        return "not a 3-D parameter"
    if not weight.is_floating_point():
        return f"held as {weight.dtype} blocks (MXFP4 or another pre-quantized format)"
    if weight.is_meta:
        return "on the meta device"
    if weight.requires_grad:
        return "trained in full"
    if weight.shape[-1] % 2:
        return f"an odd last dimension ({weight.shape[-1]}) cannot pack two weights a byte"
    return None


def quantize_expert_weight(weight: torch.Tensor):
    """The NF4 `Params4bit` of a 3-D expert stack (experts x rows x columns): packed experts x rows x columns/2.

    Quantized where the weight lives (bitsandbytes' CPU backend does NF4 too), double-quantized as the
    linears of QLoRA are; the QuantState keeps the 3-D shape and the load dtype.
    """
    import bitsandbytes.functional as bnb_functional
    from bitsandbytes.nn import Params4bit

    packed, state = bnb_functional.quantize_4bit(
        weight.detach().contiguous(), blocksize=NF4_BLOCK, compress_statistics=True, quant_type="nf4",
        quant_storage=torch.uint8,
    )
    experts, rows, columns = weight.shape
    # the packing runs along the flattened weight, two neighbours a byte: the 3-D view is exact for even columns
    data = packed.view(experts, rows, columns // 2)
    return Params4bit(data, requires_grad=False, quant_state=state, blocksize=NF4_BLOCK, compress_statistics=True,
                      quant_type="nf4", quant_storage=torch.uint8, bnb_quantized=True)


def dequantized(weight: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The 3-D stack an NF4 expert weight stands for, in `dtype` (default: the dtype it was loaded in)."""

    state = weight.quant_state
    if dtype is not None and dtype != state.dtype:
        state = copy.copy(state)  # the tensors are shared; only the output dtype differs
        state.dtype = dtype
    return dequantize_nf4(weight.data, state)


def cpu_weight(parameter: torch.Tensor) -> torch.Tensor:
    """A parameter's values on the CPU (for a merge): an NF4 expert stack dequantized to fp32."""
    if is_nf4(parameter):
        return dequantized(parameter, torch.float32).cpu()
    return parameter.detach().cpu()


def _compute_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype the grouped matmul runs in: autocast's when it is on, else the weight's load dtype."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return weight.quant_state.dtype


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    from transformers.integrations.moe import _grouped_mm

    return _grouped_mm(x, weight, offsets)


def _as_in_out(stack: torch.Tensor, transposed: bool) -> torch.Tensor:
    """grouped_mm wants (experts, in, out); transformers stores (experts, out, in) unless `is_transposed`."""
    return stack if transposed else stack.transpose(-2, -1)


class _Nf4GroupedMm(torch.autograd.Function):
    """x (tokens sorted by expert) times an NF4 stack, dequantized for the call and never saved for backward."""

    @staticmethod
    def forward(ctx, x, weight, transposed, offsets, dtype):
        # a reference to the packed parameter, not through save_for_backward: saved-tensor hooks (offload,
        # the tracker) must not copy or count the frozen weight as an activation
        ctx.weight, ctx.transposed, ctx.dtype, ctx.input_dtype = weight, transposed, dtype, x.dtype
        ctx.save_for_backward(offsets)
        if dequant_group(weight):  # a group of experts dequantized at a time (techniques/expert_dequant_groups.py)
            return grouped_nf4_mm(x, weight, offsets, dtype, lambda s: _as_in_out(s, transposed), _grouped_mm)
        return _grouped_mm(x, _as_in_out(dequantized(weight, dtype), transposed), offsets)

    @staticmethod
    def backward(ctx, grad_output):
        (offsets,) = ctx.saved_tensors
        if dequant_group(ctx.weight):
            grad_input = grouped_nf4_mm(grad_output, ctx.weight, offsets, ctx.dtype,
                                        lambda s: _as_in_out(s, ctx.transposed).transpose(-2, -1), _grouped_mm)
            return grad_input.to(ctx.input_dtype), None, None, None, None
        stack = _as_in_out(dequantized(ctx.weight, ctx.dtype), ctx.transposed)  # dequantized again, then dropped
        grad_input = _grouped_mm(grad_output.to(ctx.dtype), stack.transpose(-2, -1), offsets)
        return grad_input.to(ctx.input_dtype), None, None, None, None


def nf4_grouped_mm(x: torch.Tensor, weight: torch.Tensor, transposed: bool, offsets: torch.Tensor) -> torch.Tensor:
    """x (tokens sorted by expert, in) times each expert's NF4 weight (what `_grouped_mm` does for a 16-bit one)."""
    return _Nf4GroupedMm.apply(x, weight, transposed, offsets, _compute_dtype(x, weight))




def quantize_experts_module(experts: nn.Module, names: tuple[str, ...]) -> tuple[int, str | None]:
    """Hold the 3-D weights `names` of one experts module in NF4 (in place).

    Returns (weights quantized, why one was left as loaded or None). Each weight is checked before any is
    changed, so a module is quantized whole or not at all.
    """
    weights = {name: getattr(experts, name) for name in names if isinstance(getattr(experts, name, None), nn.Parameter)}
    for name, weight in weights.items():
        reason = why_not_nf4(weight)
        if reason:
            return 0, f"{name} {reason}"
    count = len(weights)
    device = staged_device(experts)  # a staged load: the stacks wait in host memory (techniques/staged_weights.py)
    for name in list(weights):
        # the 16-bit stack goes as soon as its NF4 copy replaces it: one stack extra at a time
        weight = weights.pop(name)
        if device is None:
            setattr(experts, name, quantize_expert_weight(weight))
            continue
        quantized = quantize_expert_weight(device_copy(weight, device))  # quantized where it trains, copy dropped
        del weight
        experts._parameters.pop(name)  # the host stack goes before the next one comes
        if keeps_on_host(experts):  # --expert-offload: its NF4 bytes back to host memory, the statistics stay
            quantized = host_parameter(quantized, pin=torch.cuda.is_available())
        setattr(experts, name, quantized)
    experts.memfit_experts_nf4 = True
    return count, None


def experts_precision(model: nn.Module) -> str | None:
    """What the experts' weights ran in: 'experts nf4', 'experts bf16' (the load dtype), both, or None."""
    from memfit.models.experts import EXPERT_PARAMETERS

    kinds = set()
    for module in model.modules():
        if not isinstance(getattr(module, "num_experts", None), int):
            continue
        for name in EXPERT_PARAMETERS:
            weight = getattr(module, name, None)
            if is_nf4(weight):
                kinds.add("experts nf4")
            elif isinstance(weight, nn.Parameter) and weight.dim() == 3:
                name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(weight.dtype)
                kinds.add(f"experts {name}" if name else f"experts {str(weight.dtype).removeprefix('torch.')} blocks")
    return ", ".join(sorted(kinds)) or None
