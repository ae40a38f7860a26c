"""GPU presets: how much memory a GPU really offers and how fast it computes.

`memory_bytes` is the capacity PyTorch reports on the card (`total_memory`), which is
below the number on the box (ECC, firmware reservations). Peak rates are the vendor's
dense (no sparsity) tensor-core figures; `host_link_gbps` is the host link bandwidth in
gigabytes per second, one direction, used to cost offloading.

    >>> get_gpu("rtx-4090").memory_bytes / GIB
    23.64...
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from memfit.config_loading import suggest
from memfit.errors import UsageError
from memfit.units import GIB


@dataclass(frozen=True)
class GpuSpec:
    """One GPU model as the planner sees it."""

    name: str
    memory_bytes: int
    """Usable device memory in bytes (what torch.cuda reports as total)."""
    bf16: bool
    """Whether the GPU computes in bfloat16 (Ampere and newer)."""
    peak_tflops_bf16_dense: float
    peak_tflops_fp16_dense: float
    host_link_gbps: float
    """Host <-> device bandwidth, GB/s one direction (PCIe generation x16)."""
    peak_tflops_fp32_dense: float = 0.0
    """fp32 rate without TF32 (PyTorch's default for matmuls): what an fp32 step's MFU is measured against."""
    memory_gbps: float = 0.0
    """Device memory bandwidth, GB/s (the vendor's data sheet; H100: the SXM card); 0 where unknown."""

    @property
    def peak_tflops(self) -> float:
        """The rate of the fastest 16-bit format the GPU supports."""
        return self.peak_tflops_bf16_dense if self.bf16 else self.peak_tflops_fp16_dense


def _gib(value: float) -> int:
    return int(value * GIB)


GPUS: dict[str, GpuSpec] = {
    spec.name: spec
    for spec in (
        GpuSpec("t4", _gib(14.75), False, 0.0, 65.0, 16.0, 8.1, 320.0),
        GpuSpec("l4", _gib(22.03), True, 121.0, 121.0, 32.0, 30.3, 300.0),
        GpuSpec("a10g", _gib(22.19), True, 70.0, 70.0, 32.0, 31.2, 600.0),
        GpuSpec("rtx-3090", _gib(23.69), True, 71.0, 71.0, 32.0, 35.6, 936.0),
        GpuSpec("rtx-4090", _gib(23.64), True, 165.0, 165.0, 32.0, 82.6, 1008.0),
        GpuSpec("a100-40gb", _gib(39.39), True, 312.0, 312.0, 32.0, 19.5, 1555.0),
        GpuSpec("a100-80gb", _gib(79.15), True, 312.0, 312.0, 32.0, 19.5, 2039.0),
        GpuSpec("h100-80gb", _gib(79.11), True, 989.0, 989.0, 64.0, 67.0, 3350.0),
        GpuSpec("h200", _gib(139.8), True, 989.0, 989.0, 64.0, 67.0, 4800.0),
    )
}

# Other spellings people type -> preset name (compared after normalising, see _key).
_ALIASES = {
    "tesla-t4": "t4",
    "3090": "rtx-3090",
    "4090": "rtx-4090",
    "geforce-rtx-3090": "rtx-3090",
    "geforce-rtx-4090": "rtx-4090",
    "a100": "a100-80gb",
    "a100-40g": "a100-40gb",
    "a100-80g": "a100-80gb",
    "a100-40": "a100-40gb",
    "a100-80": "a100-80gb",
    "a100-sxm4-40gb": "a100-40gb",
    "a100-sxm4-80gb": "a100-80gb",
    "h100": "h100-80gb",
    "h100-sxm": "h100-80gb",
    "h100-80g": "h100-80gb",
    "h100-sxm5-80gb": "h100-80gb",
    "h200-141gb": "h200",
    "nvidia-h200": "h200",
}


def _key(name: str) -> str:
    text = re.sub(r"[\s_]+", "-", name.strip().lower())
    text = text.removeprefix("nvidia-")
    return re.sub(r"(\d+)-?gb$", r"\1gb", text)


def get_gpu(name: str) -> GpuSpec:
    """The preset for `name` ("rtx-4090", "4090", "A100 80GB", "h100").

    Raises:
        UsageError: unknown GPU; the message suggests the closest preset.
    """
    key = _key(name)
    key = _ALIASES.get(key, key)
    if key in GPUS:
        return GPUS[key]
    raise UsageError(
        f"unknown GPU {name!r}{suggest(key, list(GPUS) + list(_ALIASES))}; "
        f"known: {', '.join(GPUS)} (or give --memory-budget SIZE)"
    )


lookup_gpu = get_gpu  # the name the training setup uses


def preset_name_of(cuda_name: str, total_memory: int) -> str:
    """'NVIDIA H100 80GB HBM3' -> 'h100'; A100s are told apart by their memory."""
    text = cuda_name.lower().replace("nvidia", "").replace("geforce", "").strip()
    for known in ("h200", "h100", "a100", "a10g", "l4", "t4", "rtx 4090", "rtx 3090"):
        if known in text:
            if known == "a100":
                return "a100-80gb" if total_memory > 50 * 1024**3 else "a100-40gb"
            return known.replace(" ", "-")
    return text


def local_gpu(index: int = 0) -> GpuSpec | None:
    """This machine's CUDA GPU as the planner sees it; None without one.

    A card with a preset gets the preset with the memory torch reports; any other card
    gets its own memory and bf16 support, and the speed of the preset closest in memory
    (named in `name`, since that speed is a stand-in).
    """
    import torch

    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(index)
    memory = torch.cuda.get_device_properties(index).total_memory
    try:
        preset = get_gpu(preset_name_of(name, memory))
    except UsageError:
        closest = min(GPUS.values(), key=lambda spec: abs(spec.memory_bytes - memory))
        bf16 = torch.cuda.get_device_capability(index)[0] >= 8
        return replace(closest, name=f"{name} (speed of {closest.name})", memory_bytes=memory, bf16=bf16)
    return replace(preset, memory_bytes=memory)


def list_gpus() -> list[GpuSpec]:
    """Every preset, smallest memory first."""
    return sorted(GPUS.values(), key=lambda spec: spec.memory_bytes)
