"""Memory-efficient RMSNorm (`--efficient-norm`, on by default; `--no-efficient-norm` turns it off).

Saves: Hugging Face's Llama-family RMSNorm (Llama, Mistral, Qwen2/3, Phi-3: the same code)
upcasts its input to fp32, and autograd keeps that fp32 copy for backward (twice over, by
`pow` and by the multiplication, one storage), the fp32 1/rms, and, when the weight trains,
the normalised tensor that multiplies it. This norm computes the same forward but keeps
only its input, in its own dtype, and the fp32 1/rms (4 bytes per row); backward recomputes
the rest. Per token and norm it keeps `r * hidden + 4` bytes instead of
`4 * hidden + 4 (+ r * hidden with a trainable weight)`, r the residual stream's bytes:
- 16-bit weights, frozen norms (LoRA / QLoRA on a bf16 base): 2h instead of 4h;
- 16-bit weights, full fine-tuning: 2h instead of 6h;
- fp32 weights (fp32, or autocast over fp32 master weights): the upcast is the input
  itself, so only the normalised tensor goes (4h instead of 8h with a trainable weight,
  nothing with a frozen one).
Two norms per block: for Llama-3.1-8B under QLoRA at 81,920 tokens, 1.25 GiB less in the
recomputed block's working set (and in every block's, without checkpointing), by the closed form.
Costs: backward recomputes the normalisation (a few elementwise passes over the input).

Numerics: the forward runs the very operations of the original (`x.float()`,
`pow(2).mean(-1, keepdim=True)`, `rsqrt(var + eps)`, the cast back, `weight *`), so its
output is bit-identical, under autocast too. Backward applies the analytic RMSNorm
gradient in fp32, rounding where autograd rounds (the gradient reaching the normalised
tensor is cast to its dtype first); only the order of sums differs: fp32 within ~1e-6
relative, 16-bit within its rounding.

Which norms: every module with a `weight` and an `eps` or `variance_epsilon` whose forward
gives bit-identical outputs to this one on a small random input of its own width and
dtype. Variants that compute something else (Gemma's `(1 + weight)` in fp32, LayerNorm)
fail that check and keep their own forward; so do norms whose forward takes more than the
hidden states (Mamba-2's and Falcon-H1's gated norms take a `gate`, and compute another
thing when it is given), checked from the signature before anything is swapped and named in
what `apply_efficient_rms_norm` returns. liger-kernel's RMSNorm (`--kernels liger`,
applied after this) binds its own forward over this one where it runs.
"""

from __future__ import annotations

import inspect
import types

import torch
from torch import nn


class _RMSNormFunction(torch.autograd.Function):
    """weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype), keeping x and 1/rms only."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        # The same operations in the same order as LlamaRMSNorm.forward: the output is bit-identical.
        xf = x.to(torch.float32)
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        out = weight * (xf * rstd).to(x.dtype)
        # The input in its own dtype (2 bytes per element on a 16-bit residual stream) and one
        # fp32 per row; the weight is a parameter that exists anyway.
        ctx.save_for_backward(x, weight, rstd)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        xhat = x.to(torch.float32) * rstd  # the fp32 normalised input, recomputed
        grad_x = grad_w = None
        if ctx.needs_input_grad[1]:
            # d out / d weight = the normalised tensor in the input's dtype, as the forward used it;
            # summed in fp32 over every row
            y = xhat.to(x.dtype).to(torch.float32)
            grad_w = (grad_out.to(torch.float32) * y).sum_to_size(weight.shape).to(weight.dtype)
        if ctx.needs_input_grad[0]:
            # Autograd would cast the gradient reaching the normalised tensor to its dtype
            # before the fp32 upcast's backward: round the same way.
            grad_y = (grad_out * weight).to(x.dtype).to(torch.float32)
            # d xhat_i / d x_j = rstd * (delta_ij - xhat_i * xhat_j / hidden)
            grad_x = rstd * (grad_y - xhat * (grad_y * xhat).mean(-1, keepdim=True))
            grad_x = grad_x.to(x.dtype)
        return grad_x, grad_w, None


def efficient_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm of `x`, keeping only `x` and the fp32 1/rms for backward."""
    return _RMSNormFunction.apply(x, weight, eps)


def _efficient_forward(self: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    return efficient_rms_norm(hidden_states, self.weight, _eps_of(self))


def _eps_of(module: nn.Module) -> float | None:
    eps = getattr(module, "variance_epsilon", None)
    if eps is None:
        eps = getattr(module, "eps", None)
    return float(eps) if isinstance(eps, (int, float)) and not isinstance(eps, bool) else None


def _is_candidate(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (
        isinstance(weight, torch.Tensor) and weight.dim() == 1 and weight.is_floating_point()
        and _eps_of(module) is not None and "forward" not in module.__dict__  # not patched already (by this or liger)
    )


def _extra_inputs(module: nn.Module) -> list[str]:
    """Names of the forward's inputs beyond the hidden states (Mamba-2's and Falcon-H1's gated norms take a
    `gate`): such a norm computes something else when they are given, so it keeps its own forward."""
    try:
        parameters = list(inspect.signature(type(module).forward).parameters.values())[1:]  # past self
    except (TypeError, ValueError):  # a forward without a Python signature: not one this norm can stand for
        return ["(unknown signature)"]
    return [p.name for p in parameters[1:] if p.kind not in (p.VAR_KEYWORD,)]


def _computes_the_same(module: nn.Module) -> bool:
    """Whether the module's own forward equals this one bit for bit on a small random input.

    Real CPU tensors of the module's width and dtype, with random ones swapped in for its
    parameters and buffers (which may be fake, as in the estimates' probes, or on another
    device): a norm that computes anything else, such as Gemma's `(1 + weight)` or a
    LayerNorm, gives other bits.
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    weight = module.weight
    width, dtype = weight.shape[0], weight.dtype
    with unset_fake_temporarily(), torch.no_grad():
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(3, 5, width, generator=generator).mul(3.0).to(dtype)
        swapped = {
            name: torch.randn(tuple(t.shape), generator=generator).to(t.dtype)
            for name, t in [*module.named_parameters(), *module.named_buffers()] if t.is_floating_point()
        }
        try:
            original = torch.func.functional_call(module, swapped, (x,))
            ours = efficient_rms_norm(x, swapped["weight"], _eps_of(module))
            return (
                isinstance(original, torch.Tensor) and original.dtype == ours.dtype
                and original.shape == ours.shape and torch.equal(original, ours)
            )
        except Exception:  # a forward that needs more than one tensor, or other state: not a plain norm
            return False


def apply_efficient_rms_norm(model: nn.Module) -> str:
    """Give every RMSNorm of `model` that computes Llama's norm the memory-efficient forward (in place).

    Returns what was done, e.g. "9 of 9 norms" (norms that compute something else keep theirs), and
    names the norms left alone because their forward takes more inputs than the hidden states.
    """
    candidates = [m for m in model.modules() if _is_candidate(m)]
    replaced = 0
    more_inputs: dict[str, int] = {}
    other: dict[str, int] = {}
    for module in candidates:
        extra = _extra_inputs(module)
        if extra:
            key = f"{type(module).__name__} ({', '.join(extra)})"
            more_inputs[key] = more_inputs.get(key, 0) + 1
            continue
        if _computes_the_same(module):
            # An instance attribute, as liger-kernel patches norms: the class and its other
            # instances are untouched, and a later liger patch replaces this one.
            module.forward = types.MethodType(_efficient_forward, module)
            replaced += 1
        else:
            name = type(module).__name__
            other[name] = other.get(name, 0) + 1
    done = f"{replaced} of {len(candidates)} norms"
    if more_inputs:
        kept = ", ".join(f"{count} {name}" for name, count in more_inputs.items())
        done += f"; kept their own forward, which takes more than the hidden states: {kept}"
    if other:
        # Gemma's norms scale by (1 + weight) in fp32: another function, left to its own forward.
        kept = ", ".join(f"{count} {name}" for name, count in other.items())
        done += f"; kept their own forward, which computes another norm: {kept}"
    return done


def _apply(model: nn.Module, run, context):
    from memfit.techniques.technique import Applied

    if not context.config.memory.efficient_norm:
        return Applied()
    # On by default, exact, and nothing to act on ("0 of 5 norms" on an encoder's LayerNorms): the debug log.
    return Applied(f"efficient RMSNorm: {apply_efficient_rms_norm(model)}", quiet=True)


def _technique():
    from memfit.techniques.technique import Technique

    return Technique(
        name="efficient_norm", settings=("efficient_norm",), after=("tiled_mlp",), apply=_apply,
        # liger's RMSNorm replaces memfit's where its fused loss runs (the kernels technique comes later)
        resolve=lambda facts, run: {"efficient_norm": facts.config.memory.efficient_norm},
        summary="RMSNorm keeps its input and the fp32 1/rms only, not its fp32 intermediates",
    )


TECHNIQUE = _technique()
