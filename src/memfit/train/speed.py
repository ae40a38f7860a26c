"""Speed facts of a run: MFU per step, and the planner's predicted step time beside the measured one.

    speed = SpeedMeter.from_session(session)
    logger.log({"event": "start", ..., **speed.start_facts()})
    record.update(speed.step(tokens, seconds))          # mfu, hfu of this step
    summary.update(speed.summary())                      # medians, measured vs predicted step time

MFU is model FLOPs per second over the device's peak (models.flops: vendor figures for
GPU presets, a matmul probe on CPU); HFU adds what checkpointing and the chunked loss
recompute. The predicted step time is the planner's own speed model
(`memory.speed_model.estimated_step_seconds`) run against this device's peak instead of its
nominal rate, so the ratio measured / predicted checks that model on every run.
"""

from __future__ import annotations

import logging
import statistics
from dataclasses import dataclass, field
from typing import Any

import torch

from memfit.models.flops import DevicePeak, FlopsPerToken, device_peak, flops_per_token, utilisation

log = logging.getLogger("memfit")


@dataclass
class SpeedMeter:
    flops: FlopsPerToken | None
    peak: DevicePeak | None
    world_size: int = 1
    predicted_step_seconds: float | None = None
    note: str = ""
    """Why MFU or the prediction is missing (an architecture the formula does not read)."""
    _mfu: list[float] = field(default_factory=list)
    _hfu: list[float] = field(default_factory=list)
    _seconds: list[float] = field(default_factory=list)

    @classmethod
    def from_session(cls, session: Any) -> SpeedMeter:
        """Everything from a TrainingSession: model config, techniques that ran, device, precision."""
        config = session.config
        model = session.model
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        hf_config = getattr(lm, "config", None)
        checkpointing = str(getattr(session, "checkpointing", "off"))
        loss_chunk = int(getattr(session, "loss_chunk_size", 0) or 0)
        kernels = getattr(session, "kernels", None)
        fused_loss = kernels is not None and not getattr(kernels, "holds_logits", True)
        compute_dtype = getattr(session.precision, "autocast_dtype", None)
        if compute_dtype is None:
            compute_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        world_size = session.dist.world_size
        return cls.for_run(
            hf_config, config, session.device, compute_dtype, checkpointing, loss_chunk > 0 and not fused_loss,
            int(getattr(session, "accumulation_steps", 1)), world_size, techniques=techniques_that_run(session),
        )

    @classmethod
    def for_run(cls, hf_config: Any, config: Any, device: torch.device, compute_dtype: torch.dtype | None,
                checkpointing: str, chunked_loss: bool, accumulation_steps: int = 1, world_size: int = 1,
                techniques: dict[str, Any] | None = None) -> SpeedMeter:
        """`techniques`: what the run really does beyond the arguments (`techniques_that_run`); default: what
        `config` asks for."""
        try:
            flops = flops_per_token(hf_config, config.data.seq_len, lora_rank=config.lora.lora_r,
                                    checkpointing=checkpointing, chunked_loss=chunked_loss)
        except (AttributeError, TypeError) as error:
            return cls(None, None, world_size, note=f"no FLOPs formula for this model ({error})")
        peak = device_peak(device, compute_dtype)
        meter = cls(flops, peak, world_size)
        try:
            meter.predicted_step_seconds = _planner_step_seconds(
                hf_config, config, peak, checkpointing, chunked_loss, accumulation_steps, device.type, techniques,
            )
        except Exception as error:  # the speed model is a check, never a reason to stop training
            meter.note = f"no predicted step time: {type(error).__name__}: {str(error)[:120]}"
        return meter

    def start_facts(self) -> dict[str, Any]:
        if self.flops is None:
            return {"mfu_note": self.note}
        facts = {
            "model_flops_per_token": self.flops.model,
            "hardware_flops_per_token": self.flops.hardware,
            "peak_flops_per_second": self.peak.flops_per_second,
            "peak_flops_source": self.peak.source,
            "predicted_step_seconds": self.predicted_step_seconds,
        }
        if self.note:
            facts["speed_model_note"] = self.note
        return facts

    def step(self, tokens: int, seconds: float) -> dict[str, float]:
        """MFU and HFU of one optimizer step that trained `tokens` (all ranks) in `seconds`."""
        self._seconds.append(seconds)
        if self.flops is None:
            return {}
        figures = utilisation(tokens / self.world_size, seconds, self.flops, self.peak)
        if figures["hfu"] > 1 and self.peak.source.startswith("matmul probe"):
            # A step ran faster than the probe's "peak": the probe timed a busy moment of a
            # shared machine. No peak is below a rate the device reached: raise it to that.
            source = self.peak.source
            if not source.endswith(RAISED):
                source += RAISED
            self.peak = DevicePeak(self.peak.flops_per_second * figures["hfu"], source)
            figures = utilisation(tokens / self.world_size, seconds, self.flops, self.peak)
        self._mfu.append(figures["mfu"])
        self._hfu.append(figures["hfu"])
        return {"mfu": round(figures["mfu"], 5), "hfu": round(figures["hfu"], 5)}

    @property
    def first_step_seconds(self) -> float | None:
        """The first step's time (compile and allocator warm-up included)."""
        return self._seconds[0] if self._seconds else None

    def summary(self) -> dict[str, Any]:
        """Medians over the steps after the first (which carries compile and allocator warm-up)."""
        def typical(values: list[float]) -> float | None:
            values = values[1:] if len(values) > 1 else values
            return statistics.median(values) if values else None

        measured = typical(self._seconds)
        facts: dict[str, Any] = {
            "mfu": typical(self._mfu),
            "hfu": typical(self._hfu),
            "measured_step_seconds": measured,
            "predicted_step_seconds": self.predicted_step_seconds,
        }
        if self.peak is not None:
            facts["peak_flops_source"] = self.peak.source
        if measured and self.predicted_step_seconds:
            facts["measured_over_predicted"] = round(measured / self.predicted_step_seconds, 3)
        return facts


RAISED = " (raised to a measured step)"
"""Appended to a probed peak's source once a step ran faster than the probe measured."""


def techniques_that_run(session: Any, config: Any = None) -> dict[str, Any]:
    """The speed model's settings that a run's techniques decide, as the run really applies them.

    Activation offload (its host-link traffic), the tiled MLP (one more MLP forward), `--compile` (what compiled,
    not what was asked) and optimizer offload (not where it fell back: on a CPU it does nothing). Without a
    session (`session=None`), what `config` asks for.
    """
    from memfit.techniques.tiled_mlp import tiles_for

    config = session.config if session is not None else config
    fallbacks = getattr(session, "fallbacks", {}) if session is not None else {}
    compiled = str(getattr(session, "compiled", "off")) if session is not None else (
        "on" if config.memory.compile else "off")
    tiles = tiles_for(config.data.seq_len, config.memory.tiled_mlp)
    return {
        "activation_offload": bool(config.memory.activation_offload),
        "tiled_mlp": tiles if tiles > 1 else 0,
        "compile": not compiled.startswith("off"),
        "optimizer_offload": bool(config.memory.optimizer_offload) and "optimizer_offload" not in fallbacks,
    }


def _planner_step_seconds(hf_config, config, peak: DevicePeak, checkpointing: str, chunked_loss: bool,
                          accumulation_steps: int, device_type: str, techniques: dict[str, Any] | None = None,
                          host_link_gbps: float | None = None) -> float:
    """The planner's step time for this run's settings, on a device of this run's peak and type
    (the planner's CPU and GPU terms differ: feeding, 8-bit AdamW, the chunked loss).

    `techniques` (`techniques_that_run`; default: what `config` asks for) carries activation offload, the
    tiled MLP, compile and optimizer offload, whose costs the planner adds; without them every offloaded run
    was predicted at the plain run's time. `host_link_gbps`: the host link's rate, by default this GPU's
    preset's (16 GB/s, the planner's figure without a preset, on a CPU or an unknown card).
    """
    from memfit.gpus import GpuSpec, local_gpu
    from memfit.prediction.estimator import estimate
    from memfit.prediction.speed_model import estimated_step_seconds

    techniques = techniques if techniques is not None else techniques_that_run(None, config)
    if host_link_gbps is None:
        spec = local_gpu() if device_type == "cuda" else None
        host_link_gbps = spec.host_link_gbps if spec is not None else 16.0
    tflops = peak.flops_per_second / 1e12
    # The planner rates a GPU by its 16-bit peak; give it this device's peak in the dtype that runs.
    device_spec = GpuSpec("this device", 0, True, tflops, tflops, host_link_gbps, tflops)
    mode = next((m for m in ("full", "selective") if checkpointing.startswith(m)), "off")
    changes = {
        "batch_size": config.training.batch_size,
        "gradient_accumulation_steps": accumulation_steps,
        "gradient_checkpointing": mode,
        "loss_chunk_size": 1 if chunked_loss else 0,
        "lora_r": config.lora.lora_r,
        "quantize": config.lora.quantize,
        "optimizer": config.optimizer.optimizer,
        **techniques,
    }
    est = estimate(config, hf_config=hf_config)
    return float(estimated_step_seconds(changes, config, est, device_spec, hf_config, device=device_type))


def speed_line(summary: dict) -> str | None:
    """The end-of-run report's line on speed: tokens/s, MFU against which peak, the planner's prediction."""
    mfu, measured = summary.get("mfu"), summary.get("measured_step_seconds")
    if not measured:
        return None
    tokens = summary.get("tokens_seen") or 0
    steps = summary.get("steps") or 0
    parts = [f"step {measured:.3g} s"]
    if tokens and steps:
        parts.append(f"{tokens / steps / measured:,.0f} tokens/s")
    if mfu is not None:
        parts.append(f"MFU {100 * mfu:.1f}% of {summary.get('peak_flops_source', 'the peak')}")
    if summary.get("predicted_step_seconds"):
        parts.append(f"planner predicted {summary['predicted_step_seconds']:.3g} s")
    kernels, compiled = summary.get("kernels"), summary.get("compile")
    if kernels and kernels != "none":
        parts.append(f"kernels {kernels}")
    if compiled and not compiled.startswith("off"):
        parts.append(f"compiled {compiled}")
    return "  speed: " + " | ".join(parts)
