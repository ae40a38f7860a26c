"""The device memfit trains on, and what it can do (bf16, flash attention)."""

from __future__ import annotations

import os

import torch


def training_device() -> torch.device:
    """CUDA when present (the local rank's GPU under torchrun), else CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def supports_bf16(device: torch.device) -> bool:
    """bf16 compute: every CPU torch supports autocast to bf16; CUDA needs compute capability 8.0+."""
    if device.type == "cuda":
        return torch.cuda.get_device_capability(device)[0] >= 8
    return device.type == "cpu"
