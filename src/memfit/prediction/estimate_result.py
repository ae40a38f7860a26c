"""What an estimate says: the predicted peak, where its bytes go, and the error band of its method."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memfit.units import GIB

# Relative error measured against real CPU training steps (docs/accuracy.md).
ERROR_BAND = {"analytical": 0.10, "traced": 0.03}

CUDA_CONTEXT_BYTES = int(0.85 * GIB)
"""CUDA context, cuBLAS workspace and kernels: taken from the GPU before the first tensor. Measured: 849 MiB
held beside the caching allocator by a training process on an H100 (torch 2.11, CUDA 13, bitsandbytes and
liger-kernel loaded; docs/benchmarks.md, "Estimator against the CUDA allocator"): 0.5 GiB left LoRA and QLoRA
runs of Llama-3.2-1B up to 8 % short of what the process held."""
FRAGMENTATION = 0.05
"""The caching allocator reserves more than it hands out; 5 % covers a steady training loop."""



@dataclass
class Estimate:
    """A predicted peak and where its bytes go."""

    model: str
    method: str
    peak_bytes: int
    breakdown: dict[str, int]
    budget_bytes: int | None = None
    fits: bool | None = None
    headroom_bytes: int | None = None
    error_band: float = 0.0
    """Relative error of this method measured against real steps: the truth lies within peak x (1 +- band)."""
    per_layer_activation_bytes: int = 0
    details: dict[str, Any] = field(default_factory=dict)
    host_bytes: int = 0
    """Host (CPU) memory the techniques put there: offloaded activations, offloaded or paged optimizer state."""
    host_breakdown: dict[str, int] = field(default_factory=dict)
    host_available_bytes: int | None = None
    """Memory this machine has available now (/proc/meminfo's MemAvailable via psutil)."""
    load_host_bytes: int = 0
    """Host memory the load passes through before the first step (a staged load holds the loaded model there)."""

    @property
    def host_peak_bytes(self) -> int:
        """The most host memory the run holds: during its steps, or while it loads."""
        return max(self.host_bytes, self.load_host_bytes)

    @property
    def host_fits(self) -> bool | None:
        if self.host_available_bytes is None:
            return None
        return self.host_peak_bytes <= self.host_available_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "method": self.method,
            "peak_bytes": self.peak_bytes,
            "breakdown": dict(self.breakdown),
            "budget_bytes": self.budget_bytes,
            "fits": self.fits,
            "headroom_bytes": self.headroom_bytes,
            "error_band": self.error_band,
            "per_layer_activation_bytes": self.per_layer_activation_bytes,
            "parameters_total": self.details.get("parameters_total"),
            "parameters_active": self.details.get("parameters_active"),
            "host_bytes": self.host_bytes,
            "host_breakdown": dict(self.host_breakdown),
            "host_available_bytes": self.host_available_bytes,
            "host_fits": self.host_fits,
            "load_host_bytes": self.load_host_bytes,
            "details": self.details,
        }
