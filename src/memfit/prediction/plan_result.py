"""What a plan is: each candidate configuration with its estimate and speed, and the plan found."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from memfit.prediction.estimate_result import Estimate


@dataclass
class Candidate:
    changes: dict[str, Any]
    """Flat config changes (plan_to_overrides)."""
    estimate: Estimate
    step_seconds: float
    tokens_per_step: int
    rank_note: str = ""
    """Why the planner ranks this plan before faster ones ('' when it does not): what it trades, or headroom."""

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_seconds

    def add_rank_note(self, note: str) -> None:
        self.rank_note = f"{self.rank_note}; {note}" if self.rank_note else note


@dataclass
class PlanResult:
    """The best configuration found and the runners-up."""

    fits: bool
    plan: dict[str, Any]
    estimated_peak_bytes: int
    budget_bytes: int
    relative_speed: float
    command: str
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    """The runners-up, in rank order: plan, estimated_peak_bytes, relative_speed (to the best), rank_note."""
    tokens_per_second: float = 0.0
    host_bytes: int = 0
    """Host memory the plan needs (offloaded activations, optimizer state off the device)."""
    host_available_bytes: int | None = None
    """Memory available on the machine that planned (None when the plan needs none or it is unknown)."""
    host_limit_bytes: int | None = None
    """Host memory the plan was allowed (--host-memory, else this machine's total)."""
    load_host_bytes: int = 0
    """Host memory the load passes through (a staged load holds the loaded model there before the first step)."""
    trades: list[str] = field(default_factory=list)
    """What each chosen technique costs, in words."""
    maximize: str | None = None
    memory_limit_seq_len: int | None = None
    """With --maximize seq-len: the longest sequence memory allows, even past the model's positions."""
    max_positions: int | None = None
    """The positions cap the plan used: the model's own, x --rope-scale when given."""
    rope_scale_to_memory_limit: int | None = None
    """When memory allows more than max_positions: the whole --rope-scale whose positions reach memory_limit_seq_len."""
    device: str = "cpu"
    """What the plan was made for: the --gpu preset, else this machine's GPU, else 'cpu'."""
    ranked: list[dict[str, Any]] = field(default_factory=list)
    """The best distinct configurations, best first: plan, step_seconds (predicted), estimated_peak_bytes (trials time them)."""
    trials: list[dict[str, Any]] = field(default_factory=list)
    """Measured on this device (memfit.train.trials, or its cache): each ranked plan's predicted and measured step and peak."""
    chosen_by: str = "speed model"
    """What picked the plan: 'speed model', or 'trials' (the fastest measured) with why in `trials`."""
    rank_note: str = ""
    """Why the best is ranked before faster plans ('' when none is faster): what it trades, or headroom (PEAK_TIE)."""

    @property
    def host_fits(self) -> bool | None:
        if not self.host_bytes or self.host_available_bytes is None:
            return None if self.host_bytes else True
        return max(self.host_bytes, self.load_host_bytes) <= self.host_available_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "plan": dict(self.plan),
            "estimated_peak_bytes": self.estimated_peak_bytes,
            "budget_bytes": self.budget_bytes,
            "relative_speed": self.relative_speed,
            "command": self.command,
            "alternatives": list(self.alternatives),
            "tokens_per_second": self.tokens_per_second,
            "host_bytes": self.host_bytes,
            "load_host_bytes": self.load_host_bytes,
            "host_available_bytes": self.host_available_bytes,
            "host_fits": self.host_fits,
            "host_limit_bytes": self.host_limit_bytes,
            "trades": list(self.trades),
            "maximize": self.maximize,
            "memory_limit_seq_len": self.memory_limit_seq_len,
            "max_positions": self.max_positions,
            "rope_scale_to_memory_limit": self.rope_scale_to_memory_limit,
            "device": self.device,
            "ranked": list(self.ranked),
            "trials": list(self.trials),
            "chosen_by": self.chosen_by,
            "rank_note": self.rank_note,
        }


def plan_to_overrides(result: PlanResult) -> dict[str, Any]:
    """The flat config changes of the plan, for `TrainConfig.replace(**changes)`."""
    return dict(result.plan)
