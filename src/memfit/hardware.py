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


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return f"{props.name} ({props.total_memory / 1024**3:.1f} GiB)"
    return f"CPU ({os.cpu_count()} cores)"


def device_memory_bytes(device: torch.device) -> int | None:
    """Total memory of a CUDA device; None for CPU (host memory is shared with everything else)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return None
