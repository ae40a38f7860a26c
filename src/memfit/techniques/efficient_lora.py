"""Memory-efficient LoRA adapters (`--efficient-lora`, on by default; `--no-efficient-lora` turns it off).

Saves: PEFT runs an adapter on a 16-bit base (QLoRA, or LoRA on bf16 weights) as
`lora_B(lora_A(x.to(float32))) * scaling`. The cast is a new fp32 tensor, and autograd keeps
it for lora_A's weight gradient: 4 bytes per element of every adapted linear's input, one
copy per adapter even where several read the same tensor (q, k and v; gate and up), on top
of the 16-bit input the base layer or the norm already keeps. Its output, the output's
gradient and the input's gradient are fp32 tensors as wide as the layer, too. This path
computes the same product but keeps the input itself (that same 16-bit storage, no new
bytes) and the rank-r product `x A^T`; every fp32 tensor as wide as the input or the output
exists one slice of rows at a time (`SLICE_ELEMENTS`), in forward and in backward, and the
input's gradient is written slice by slice in the input's dtype. On a small Llama at 2048
tokens the tracker measures a quarter to a third of the step's peak gone
(benchmarks/bench_efficient_lora.py); on Llama-3.1-8B under QLoRA (r 32, all linear) the
recomputed block holds 48 KiB less per token by the closed form (three hidden-wide fp32
copies), and each MLP tile less again.
Costs: the input is cast twice (forward and backward), an elementwise pass; long inputs run
as several smaller matmuls.

Numerics: the forward runs PEFT's operations in PEFT's order (the cast, `lora_A`, `lora_B`,
`* scaling`, and how the result joins the base layer's output for each layer class), so its
output is bit-identical (longer inputs than one slice: the same dot products, slice by
slice). Backward is the analytic gradient of those operations in the matmuls' dtype, the
scale applied to the rank-r products: fp32 within ~1e-6 relative of autograd's.

Where: PEFT's `Linear`, and bitsandbytes' `Linear4bit` and `Linear8bitLt` adapters with one
active plain adapter (no dropout, DoRA, bias or mixed adapter batches: those layers keep
PEFT's forward, and the summary counts them). Under autocast it computes in autocast's
dtype, as PEFT's layers do there, where the input already is in that dtype. PEFT's own
path runs, said once in the log and in the run's fallbacks, where autocast would cast a
wider input (its 16-bit copy, 2 bytes an element, is then less than keeping the input) and
where DeepSpeed ZeRO-3 partitions the adapters' weights (it gathers them in the adapter's
own forward, which this path does not call).
"""

from __future__ import annotations

import logging
import types

import torch
import torch.nn.functional as F
from torch import nn

log = logging.getLogger("memfit")

SLICE_ELEMENTS = 1 << 24
"""Elements of an input slice cast to the adapters' dtype at once (64 MiB in fp32): the transient
of the cast, whatever the sequence length."""


def _row_slices(rows: int, width: int) -> list[slice]:
    step = max(1, SLICE_ELEMENTS // max(1, width))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


class _AdaptedLinear(torch.autograd.Function):
    """The base layer's output plus `lora_B(lora_A(x)) * scaling`, computed and joined as PEFT does.

    Keeps `x` as it came and the rank-r product only. Every tensor as wide as the input or the
    output in the adapters' dtype (the cast, the adapter's output, its gradient) exists one
    slice of rows at a time. `compute` is the matmuls' dtype: the adapters' (PEFT casts the
    input to it), or autocast's (its casts of the input and the adapters' weights).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, base_output: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor,
                scaling: float, join: str, compute: torch.dtype) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        base_rows = base_output.reshape(-1, base_output.shape[-1])
        a, b = weight_a.to(compute), weight_b.to(compute)  # no-ops but under autocast (rank-r wide)
        product = rows.new_empty((rows.shape[0], a.shape[0]), dtype=compute)
        out_dtype = torch.promote_types(base_rows.dtype, compute) if join == "promote" else base_rows.dtype
        output = torch.empty(base_rows.shape, dtype=out_dtype, device=base_rows.device)
        for part in _row_slices(rows.shape[0], max(rows.shape[1], base_rows.shape[1])):
            # PEFT's operations in PEFT's order: the cast, lora_A, lora_B, the scale
            # (each result written in place: no output-wide copy beyond PEFT's own tensors)
            torch.mm(rows[part].to(compute), a.t(), out=product[part])
            adapter = F.linear(product[part], b).mul_(scaling)
            if join == "cast first":
                # bitsandbytes' adapter layers round the adapter's output to the base's dtype, then add
                torch.add(base_rows[part], adapter.to(base_rows.dtype), out=output[part])
            elif join == "promote":
                # bitsandbytes' layers under autocast add in the promoted dtype and keep it
                torch.add(base_rows[part], adapter, out=output[part])
            else:
                # PEFT's Linear adds in the promoted dtype and rounds the sum to the base's dtype:
                # here slice by slice, so no output-wide sum in the adapters' dtype exists
                output[part] = adapter.add_(base_rows[part])
        ctx.save_for_backward(x, product, weight_a, weight_b)
        ctx.scaling, ctx.compute, ctx.base_dtype = scaling, compute, base_output.dtype
        return output.view(*base_output.shape[:-1], -1)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, product, weight_a, weight_b = ctx.saved_tensors
        compute = ctx.compute
        a, b = weight_a.to(compute), weight_b.to(compute)
        rows = x.reshape(-1, x.shape[-1])
        grad_rows = grad_output.reshape(-1, grad_output.shape[-1])
        need_x, _, need_a, need_b = ctx.needs_input_grad[:4]
        grad_a = torch.zeros_like(weight_a) if need_a else None
        grad_b = torch.zeros_like(weight_b) if need_b else None
        grad_x = torch.empty_like(rows) if need_x else None
        for part in _row_slices(rows.shape[0], max(rows.shape[1], grad_rows.shape[1])):
            # The output's gradient reaches the adapter in the matmuls' dtype; the scale is
            # applied to the rank-r products, not to an output-wide copy.
            grad = grad_rows[part].to(compute)
            if need_b:
                grad_b.add_(grad.t().mm(product[part]).to(grad_b.dtype), alpha=ctx.scaling)
            grad_product = grad.mm(b).mul_(ctx.scaling)
            if need_a:
                grad_a += grad_product.t().mm(rows[part].to(compute)).to(grad_a.dtype)
            if need_x:
                grad_x[part] = grad_product.mm(a).to(x.dtype)
        # The base layer's output joins by addition: its gradient is the output's, in its dtype
        grad_base = grad_output.to(ctx.base_dtype) if ctx.needs_input_grad[1] else None
        return (None if grad_x is None else grad_x.view(x.shape)), grad_base, grad_a, grad_b, None, None, None


def adapted_linear(x: torch.Tensor, base_output: torch.Tensor, weight_a: torch.Tensor, weight_b: torch.Tensor,
                   scaling: float, join: str = "round sum", compute: torch.dtype | None = None) -> torch.Tensor:
    """`base_output` plus the adapter's `(x A^T) B^T * scaling`, keeping no copy of `x`.

    join: "cast first" rounds the adapter's output to the base's dtype and adds (bitsandbytes'
    adapter layers); "round sum" adds in the promoted dtype and rounds the sum to the base's
    dtype (PEFT's Linear); "promote" adds in the promoted dtype and keeps it (bitsandbytes'
    layers under autocast). compute: the matmuls' dtype (default: the adapters').
    """
    return _AdaptedLinear.apply(x, base_output, weight_a, weight_b, scaling, join, compute or weight_a.dtype)


def _plain_adapter(module: nn.Module) -> str | None:
    """The single adapter this path can run for `module` (set up once), or None."""
    adapters = [name for name in getattr(module, "active_adapters", []) if name in module.lora_A]
    if len(adapters) != 1:
        return None
    name = adapters[0]
    if name in getattr(module, "lora_variant", {}) or not isinstance(module.lora_dropout[name], nn.Identity):
        return None
    if module.lora_A[name].bias is not None or module.lora_B[name].bias is not None:
        return None
    return name


PEFT_ONLY_KWARGS = ("adapter_names", "alora_offsets")
"""Keyword arguments PEFT's forward consumes itself (mixed adapter batches, aLoRA): with any set, PEFT's path runs."""

_reported: set[str] = set()


def _peft_path(module: nn.Module, why: str, x, args, kwargs):
    module._memfit_lora_fell_back = why
    if why not in _reported:
        _reported.add(why)
        log.info("memfit: efficient LoRA: %s; PEFT's adapter path runs there", why)
    return type(module).forward(module, x, *args, **kwargs)


def _efficient_forward(self: nn.Module, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    name = _plain_adapter(self)
    if (name is None or self.disable_adapters or self.merged or any(kwargs.get(k) is not None for k in PEFT_ONLY_KWARGS)
            or not getattr(self, "cast_input_dtype_enabled", True)):
        return type(self).forward(self, x, *args, **kwargs)
    weight_a, weight_b = self.lora_A[name].weight, self.lora_B[name].weight
    compute, join = weight_a.dtype, "cast first" if self._memfit_lora_casts_first else "round sum"
    if torch.is_autocast_enabled(x.device.type):
        compute = torch.get_autocast_dtype(x.device.type)
        if x.dtype != compute:
            # autocast's 16-bit copy of a wider input is what PEFT's adapter keeps (2 bytes an
            # element); keeping the input itself here would keep more
            return _peft_path(self, f"autocast casts its {str(x.dtype).removeprefix('torch.')} input", x, args, kwargs)
        # PEFT skips its cast under autocast in bitsandbytes' layers and adds without rounding
        join = "promote" if join == "cast first" else join
    if hasattr(weight_a, "ds_id"):
        return _peft_path(self, "DeepSpeed ZeRO-3 partitions the adapters' weights", x, args, kwargs)
    kwargs = {k: v for k, v in kwargs.items() if k not in PEFT_ONLY_KWARGS}  # PEFT pops these before the base layer
    result = self.base_layer(x, *args, **kwargs)
    return adapted_linear(x, result, weight_a, weight_b, self.scaling[name], join, compute)


def fallback_reasons(model: nn.Module) -> list[str]:
    """Why adapters given this path ran PEFT's instead (after a forward), one line per reason."""
    reasons = {getattr(m, "_memfit_lora_fell_back", "") for m in model.modules()}
    return sorted(reason for reason in reasons if reason)


def _is_supported(module: nn.Module) -> tuple[bool, bool]:
    """(whether this path knows the layer's class, whether that class casts the adapter's output first)."""
    try:
        from peft.tuners.lora.layer import Linear as PeftLinear
    except ImportError:
        return False, False
    kind = type(module)
    if kind is PeftLinear:
        return True, False
    try:
        from peft.tuners.lora import bnb as peft_bnb
    except ImportError:
        return False, False
    casts_first = tuple(getattr(peft_bnb, n) for n in ("Linear4bit", "Linear8bitLt") if hasattr(peft_bnb, n))
    return (True, True) if kind in casts_first else (False, False)


def apply_efficient_lora(model: nn.Module) -> str:
    """Give each PEFT adapter layer of `model` that runs one plain adapter the memory-efficient path (in place).

    Returns what was done, e.g. "14 of 14 adapted linears".
    """
    # Adapters on fused expert weights (PEFT's ParamWrapper) are no linears: split LoRA runs them (expert_lora.py).
    adapted = [m for m in model.modules() if hasattr(m, "lora_A") and hasattr(m, "base_layer")
               and type(m).__name__ != "ParamWrapper"]
    patched = 0
    for module in adapted:
        known, casts_first = _is_supported(module)
        if not known or _plain_adapter(module) is None or "forward" in module.__dict__:
            continue
        module._memfit_lora_casts_first = casts_first
        # An instance attribute: the class and PEFT's other layers are untouched.
        module.forward = types.MethodType(_efficient_forward, module)
        patched += 1
    kept = len(adapted) - patched
    why = f" ({kept} keep PEFT's: dropout, DoRA, bias or another layer kind)" if kept else ""
    return f"{patched} of {len(adapted)} adapted linears{why}"


def _apply(model: nn.Module, run, context):
    from memfit.techniques.technique import Applied

    if not run.efficient_lora:
        return Applied()
    # On by default and nothing to act on: the debug log. An adapter that falls back to PEFT's path at run time is
    # still said, as a fallback (the loop's check after the first step).
    return Applied(f"efficient LoRA: {apply_efficient_lora(model)}", quiet=True)


def _technique():
    from memfit.techniques.technique import Technique

    return Technique(
        name="efficient_lora", settings=("efficient_lora",), after=("lora",), apply=_apply,
        resolve=lambda facts, run: {"efficient_lora": facts.config.memory.efficient_lora and run.lora_r > 0},
        summary="adapters keep no fp32 copy of their input: the input itself is reused in backward",
    )


TECHNIQUE = _technique()
