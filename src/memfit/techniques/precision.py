"""Compute precision: autocast dtype and loss scaling, chosen by the device's capability.

bf16 autocast keeps fp32 master weights and computes matmuls in bf16 (about half the
activation bytes); fp16 needs a GradScaler and counts the steps it skips. fp16 on a CPU
is refused: it runs about 25x slower than fp32 there.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from memfit.errors import UsageError
from memfit.hardware import supports_bf16


@dataclass(frozen=True)
class PrecisionChoice:
    """What really runs, and why when it differs from the request."""

    name: str
    """fp32, bf16 or fp16: the compute precision that runs."""
    autocast_dtype: torch.dtype | None
    """dtype of torch.autocast, or None for plain fp32."""
    grad_scaler: bool
    """fp16 needs loss scaling against gradient underflow."""
    reason: str
    """How the choice was made, for the log and the metrics."""

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=device.type, dtype=self.autocast_dtype)


def resolve_precision(requested: str, device: torch.device) -> PrecisionChoice:
    """Map --precision (auto, amp, fp32, bf16, fp16) to what runs on `device`.

    Raises UsageError for a precision the device cannot run usefully.
    """
    return choose_precision(requested, device.type, supports_bf16(device))


def choose_precision(requested: str, device_type: str, bf16_supported: bool) -> PrecisionChoice:
    """The precision policy, for a device described rather than present (the estimator's GPU presets).

    Args:
        requested: --precision: auto, amp, fp32, bf16 or fp16.
        device_type: "cuda" or "cpu".
        bf16_supported: the device computes in bf16 (every CPU; CUDA compute capability 8.0+).
    Raises:
        UsageError for a precision the device cannot run usefully.
    """
    on_cuda = device_type == "cuda"
    if requested == "auto":
        if on_cuda and bf16_supported:
            return PrecisionChoice("bf16", torch.bfloat16, False, "auto: bf16 autocast (GPU supports bf16)")
        if on_cuda:
            return PrecisionChoice("fp16", torch.float16, True, "auto: fp16 autocast + GradScaler (GPU lacks bf16)")
        return PrecisionChoice("fp32", None, False, "auto: fp32 on CPU (use --precision bf16 for bf16 autocast)")
    if requested == "amp":
        if bf16_supported:
            return PrecisionChoice("bf16", torch.bfloat16, False, f"amp: bf16 autocast on {device_type}")
        return PrecisionChoice("fp16", torch.float16, True, "amp: fp16 autocast + GradScaler (no bf16 on this GPU)")
    if requested == "fp32":
        return PrecisionChoice("fp32", None, False, "requested fp32")
    if requested == "bf16":
        if not bf16_supported:
            raise UsageError("--precision bf16 needs a GPU of compute capability 8.0 or newer; use --precision fp16")
        return PrecisionChoice("bf16", torch.bfloat16, False, "requested bf16 autocast")
    if requested == "fp16":
        if not on_cuda:
            raise UsageError(
                "--precision fp16 on a CPU runs about 25x slower than fp32; use --precision bf16 (or fp32) on CPU"
            )
        return PrecisionChoice("fp16", torch.float16, True, "requested fp16 autocast + GradScaler")
    raise UsageError(f"--precision must be auto, amp, fp32, bf16 or fp16, got {requested!r}")


def make_grad_scaler(choice: PrecisionChoice, device: torch.device) -> torch.amp.GradScaler | None:
    return torch.amp.GradScaler(device.type) if choice.grad_scaler else None


def _resolve(facts, run) -> dict:
    """The autocast dtype the training loop's policy picks on the device (raises UsageError as it would)."""
    choice = choose_precision(facts.config.memory.precision, facts.device_type, facts.bf16_supported)
    return {"autocast": choice.name if choice.autocast_dtype is not None else None}


def _report(run) -> dict:
    return {"precision": run.autocast or {4: "fp32", 2: "bf16"}.get(run.weight_bytes, "fp32")}


def _technique():
    from memfit.techniques.technique import Technique

    return Technique(
        name="precision", stage="choice", settings=("precision",), resolve=_resolve, report=_report,
        summary="bf16/fp16 autocast: 16-bit activations and matmuls; fp16 adds a grad scaler",
    )


TECHNIQUE = _technique()


def run_precision(config, device: torch.device) -> PrecisionChoice:
    """What a run on `device` computes in, for its --precision (the resolver's choice, with its reason and scaler)."""
    return resolve_precision(config.memory.precision, device)
