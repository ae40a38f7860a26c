"""Fused kernels (`--kernels auto|liger|none`): liger-kernel's Triton kernels on CUDA.

Saves: the fused linear cross-entropy never builds the `[tokens, vocab]` logits (nor
their fp32 copy, log-softmax or gradient): it projects and reduces a block of tokens at a
time and writes the hidden states' and the head's gradients during forward, so the
loss's memory is that of `--loss-chunk-size` without the recomputed projection. RMSNorm,
SwiGLU and RoPE kernels keep fewer intermediates and make fewer passes over memory.
Costs: nothing in FLOPs; it needs CUDA, Triton and the liger-kernel package, and a model
family liger patches (Llama, Mistral, Qwen2/3, Gemma, Phi-3, ...).

How: `apply_kernels` calls liger's `_apply_liger_kernel_to_instance` on the loaded model
with `rms_norm`, `swiglu` and `rope` (module-level functions and the instance's norm and
MLP modules). The fused loss does not go through the model's
forward (memfit computes its own summed loss for exact accumulation): `fused_loss_sum`
runs the model with its head swapped out and hands the last hidden states and the head's weight to liger's
`LigerFusedLinearCrossEntropyLoss(reduction="sum")`.

Fallback: without CUDA or without the package, `--kernels liger` logs one line and runs
PyTorch's kernels; `auto` does the same quietly. `KernelChoice.description` says which
kernels ran (the metrics' "kernels" field).
"""

from __future__ import annotations

import importlib.util
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from memfit.techniques.loss import IGNORE_INDEX, unwrap_causal_lm
from memfit.techniques.tiled_mlp import retile_replaced_forwards

log = logging.getLogger("memfit")

BLOCK_KERNELS = ("rms_norm", "swiglu", "rope")
FUSED_LOSS = "fused_linear_cross_entropy"


@dataclass
class KernelChoice:
    """Which fused kernels run, and why others do not."""

    kernels: tuple[str, ...] = ()
    """Kernels that replaced PyTorch's: some of rms_norm, swiglu, rope, fused_linear_cross_entropy."""
    reason: str = ""
    """Why liger does not run (or runs without the fused loss); empty when all of it runs or none was asked."""
    fused_loss: Callable[..., torch.Tensor] | None = field(default=None, repr=False)
    """Replacement for techniques.loss.causal_lm_loss_sum when the fused loss runs."""

    @property
    def description(self) -> str:
        return "liger: " + ", ".join(self.kernels) if self.kernels else "none"

    @property
    def holds_logits(self) -> bool:
        """False when the loss never builds the full logits (what the memory estimate needs)."""
        return self.fused_loss is None


def liger_unavailable_reason(device: torch.device, model_type: str) -> str:
    """Why liger-kernel cannot run this model here ('' when it can)."""
    if device.type != "cuda":
        return f"liger-kernel needs a CUDA device (this run is on {device.type})"
    if importlib.util.find_spec("liger_kernel") is None:
        return "liger-kernel is not installed (pip install liger-kernel)"
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    if model_type not in MODEL_TYPE_TO_APPLY_LIGER_FN:
        return f"liger-kernel has no kernels for the {model_type!r} model family"
    return ""


def apply_kernels(model: torch.nn.Module, requested: str, device: torch.device,
                  fallbacks: dict[str, str] | None = None) -> KernelChoice:
    """Patch liger's kernels into `model` (in place) as `requested` (auto, liger, none) allows.

    Call it on the loaded Hugging Face model, with or without LoRA (a PEFT wrapper is looked through).
    `liger` that cannot run says why once: in `fallbacks["kernels"]` when given (the training
    loop logs those and writes them to the metrics), else as a log warning. `auto` falls back
    silently; the returned choice says what runs either way.
    """
    choice = _apply_kernels(model, requested, device)
    if requested == "liger" and choice.reason:
        if fallbacks is not None:
            fallbacks["kernels"] = choice.reason
        else:
            log.warning("memfit: --kernels liger: %s", choice.reason)
    return choice


def _apply_kernels(model: torch.nn.Module, requested: str, device: torch.device) -> KernelChoice:
    if requested == "none":
        return KernelChoice()
    model_type = getattr(getattr(model, "config", None), "model_type", "") or ""
    reason = liger_unavailable_reason(device, model_type)
    if reason:
        return KernelChoice(reason=f"{reason}; PyTorch's kernels ran")
    from liger_kernel.transformers.monkey_patch import _apply_liger_kernel_to_instance

    # memfit takes the loss itself (summed, for exact accumulation): liger must not replace the
    # model's forward or the cross-entropy function, only the blocks' kernels.
    # The Hugging Face model itself: liger finds the blocks through its base_model_prefix, which a
    # PEFT wrapper would answer with the wrong module. LoRA's injected layers are called as before.
    _apply_liger_kernel_to_instance(
        model=unwrap_causal_lm(model), rms_norm=True, swiglu=True, rope=True, cross_entropy=False, fused_linear_cross_entropy=False
    )
    # liger's SwiGLU replaces each MLP's forward, and with it a tiling applied before (--tiled-mlp): tile again.
    retile_replaced_forwards(model)
    kernels = BLOCK_KERNELS
    head_problem = fused_loss_problem(model)
    if head_problem:
        return KernelChoice(kernels, f"no fused loss: {head_problem}")
    return KernelChoice(kernels + (FUSED_LOSS,), "", fused_loss_sum)


def fused_loss_problem(model: torch.nn.Module) -> str:
    """Why the fused linear cross-entropy cannot replace this model's head and loss ('' when it can)."""
    lm = unwrap_causal_lm(model)
    head = lm.get_output_embeddings()
    if type(head) is not torch.nn.Linear:
        return f"the output head is a {type(head).__name__}, not a plain linear layer"
    config = lm.config
    if getattr(config, "logit_scale", None) not in (None, 1) or getattr(config, "logits_scaling", None) not in (None, 1):
        return "the model scales its logits, which the fused loss does not do"
    return ""


def fused_loss_sum(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    chunk_size: int = 0,
    position_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """`causal_lm_loss_sum` through liger's fused linear cross-entropy: no logits are built.

    `chunk_size` is accepted for the same signature and ignored: the fused kernel works
    through the tokens in blocks of its own.
    """
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    from memfit.techniques.loss import final_hidden_states

    lm = unwrap_causal_lm(model)
    head = lm.get_output_embeddings()
    # The model's own forward with the head swapped out (as the chunked loss does): wrappers' hooks run.
    hidden, empty_logits = final_hidden_states(model, lm, head, input_ids, attention_mask, position_ids)
    targets = F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)
    softcap = getattr(lm.config, "final_logit_softcapping", None) or None
    loss = LigerFusedLinearCrossEntropyLoss(ignore_index=IGNORE_INDEX, reduction="sum", softcap=softcap)
    hidden = hidden.reshape(-1, hidden.size(-1))
    if hidden.dtype != head.weight.dtype:  # under autocast the backbone's output may be fp32
        hidden = hidden.to(head.weight.dtype)
    # The empty logits add exactly 0 and keep the wrappers' backward hooks in the graph.
    return empty_logits.float().sum() + loss(head.weight, hidden, targets.reshape(-1), head.bias).float()


def _resolve(facts, run) -> dict:
    fused = _fused_loss_runs(facts.config.memory.kernels, facts.device_type, facts.hf_config)
    # liger's RMSNorm replaces memfit's where its fused loss runs
    return {"kernels": facts.config.memory.kernels, "fused_loss": fused,
            "efficient_norm": run.efficient_norm and not fused}


def _fused_loss_runs(kernels: str, device_type: str, hf_config) -> bool:
    """Whether the run would use liger's fused loss (the logits never held), by this module's rule.

    Never on a CPU, where `--kernels liger` falls back. On a GPU: `auto` only where liger-kernel is
    installed here and covers the family; an explicit `liger` also when it is not installed on the
    planning machine (the user asked for it on the GPU machine), unless it is installed and says the
    family is not covered.
    """
    if kernels == "none" or device_type != "cuda":
        return False
    import importlib.util

    if importlib.util.find_spec("liger_kernel") is None:
        return kernels == "liger"
    try:
        return liger_unavailable_reason(torch.device("cuda"), getattr(hf_config, "model_type", "")) == ""
    except ImportError:  # liger-kernel installed without what it needs (Triton) on this machine
        return kernels == "liger"


def _apply(model: torch.nn.Module, run, context):
    from memfit.techniques.technique import Applied

    choice = apply_kernels(model, run.kernels, context.device, context.fallbacks)  # liger on CUDA, else PyTorch's
    return Applied(choice.description, changes={"fused_loss": choice.fused_loss is not None}, quiet=True)


def _technique():
    from memfit.techniques.technique import Technique

    return Technique(
        name="kernels", settings=("kernels",), after=("efficient_norm", "tiled_mlp", "lora"),
        resolve=_resolve, apply=_apply,
        report=lambda run: {"fused_loss": True} if run.fused_loss else {},
        summary="liger-kernel's fused RMSNorm, SwiGLU, RoPE and linear cross-entropy (CUDA): the logits never held",
    )


TECHNIQUE = _technique()
