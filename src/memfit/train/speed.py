"""Speed facts of a run: MFU per step, and the speed model's step time beside the measured one.

    speed = SpeedMeter.from_session(session)
    logger.log({"event": "start", ..., **speed.start_facts()})
    record.update(speed.step(tokens, seconds))          # mfu, hfu of this step
    summary.update(speed.summary())                      # medians, measured vs predicted step time

MFU is model FLOPs per second over the device's peak; HFU adds what checkpointing and the chunked loss
recompute. The peak is a measured or published rate, never one inferred from the run: a GPU preset's datasheet
figure, or on a CPU (and an unknown GPU) the best rate of square matmuls timed here (`models.flops`' 1024 probe and
smaller sizes, whose operands stay in cache as a small model's do). A step that runs faster than the probe proves
the probe timed a busy moment: the probe is measured again, and if the step still beats it, MFU is left out with
the reason, never shown above 100 %.

The predicted step time is the planner's own speed model (`prediction.speed_model.estimated_step_seconds`) rated by
this device: the preset's peak at the model's GPU utilisation, or on a CPU the 1024 probe at
`CPU_PROBE_UTILISATION`, the rate the model's CPU terms were measured against. The summary shows it only where it
can be trusted: the probe that rates the device held up, and the measured step is within `TRUSTED_WITHIN` of it;
otherwise it says why there is no prediction (the model's own figure stays in `model_step_seconds`).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from memfit.models.flops import PROBE_SIZE, DevicePeak, FlopsPerToken, device_peak, flops_per_token
from memfit.resolution.resolve import resolve

log = logging.getLogger("memfit")

TRUSTED_WITHIN = 2.0
"""A prediction further than this factor from the measured step (either way) is not shown: it would mislead."""
SWEEP_SIZES = {"cpu": (256, 512, PROBE_SIZE), "cuda": (PROBE_SIZE, 2048, 4096)}
"""Square matmul sizes whose best rate is a device's probed peak. On the 2-core AMD EPYC of the development
machine (fp32, 2 threads, 2026-11-28) 256 and 512 ran at 183 and 192 GFLOP/s where 1024 ran at 116: the 1024
probe alone was beaten by the tiny model's steps (1.08x, whose matmuls are 256 wide), on an idle machine."""
START_SWEEP_SIZES = {"cpu": (256, 512)}
"""The sizes measured beside the 1024 probe when a CPU run starts (about 20 ms on that machine)."""
SWEEP_REPEATS = 8
SWEEP_SECONDS = 0.5
"""The most a sweep may take: a size whose matmuls would not fit in what is left is not timed."""
PROBE_REMEASURES = 3
"""How many times a run measures the probe again after a step beat it (each about 0.1 to 0.3 s on 2 cores)."""


def sweep_matmul_flops(device: torch.device, dtype: torch.dtype, sizes: tuple[int, ...],
                       repeats: int = SWEEP_REPEATS, budget_seconds: float = SWEEP_SECONDS) -> dict[int, float]:
    """The best FLOP/s of `repeats` square matmuls of each size in `sizes`, measured now (nothing cached).

    The best timing, not the mean, stands for the device (on a shared machine the mean measures the load). A size is
    skipped when its matmuls, extrapolated from the last size's (cube of the size), would overrun `budget_seconds`:
    a CPU without bf16 instructions multiplies bf16 at under 1 GFLOP/s, where one 1024 matmul takes seconds.
    """
    # A generator of its own: drawing from the global one would shift a resumed run's dropout masks.
    generator = torch.Generator(device=device).manual_seed(0)
    deadline = time.perf_counter() + budget_seconds
    rates: dict[int, float] = {}
    last: tuple[int, float] | None = None  # (size, seconds of one matmul)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for size in sorted(sizes):
        if last is not None and time.perf_counter() + (repeats + 1) * last[1] * (size / last[0]) ** 3 > deadline:
            break
        a = torch.randn(size, size, device=device, generator=generator).to(dtype)
        b = torch.randn(size, size, device=device, generator=generator).to(dtype)
        torch.matmul(a, b)  # warm-up: thread pool, kernel selection
        best = float("inf")
        for _ in range(repeats):
            synchronize()
            started = time.perf_counter()
            torch.matmul(a, b)
            synchronize()
            best = min(best, time.perf_counter() - started)
            if time.perf_counter() > deadline:
                break
        rates[size] = 2 * size**3 / max(best, 1e-9)
        last = (size, best)
        del a, b
    return rates


@dataclass
class SpeedMeter:
    flops: FlopsPerToken | None
    peak: DevicePeak | None
    """What MFU divides by: a preset's datasheet figure or the best matmul rate measured here."""
    world_size: int = 1
    predicted_step_seconds: float | None = None
    """The speed model's step for this run as the run starts (the summary rates it again by the probe as measured
    last, and shows it only where it can be trusted)."""
    note: str = ""
    """Why MFU or the prediction is missing (an architecture the formula does not read)."""
    device: torch.device | None = None
    compute_dtype: torch.dtype | None = None
    rate_probe: float | None = None
    """The 1024 probe's rate (FLOP/s) that rates a probed device for the speed model; None: a preset rates it."""
    predict: Callable[[DevicePeak], float] | None = None
    """The speed model's step time for this run rated by a peak (what `predicted_step_seconds` came from)."""
    mfu_note: str = ""
    """Why MFU is left out: a step ran faster than every measurement of the peak."""
    remeasured: int = 0
    _model_rates: list[float] = field(default_factory=list)
    _hardware_rates: list[float] = field(default_factory=list)
    _seconds: list[float] = field(default_factory=list)

    @classmethod
    def from_session(cls, session: Any) -> SpeedMeter:
        """Everything from a TrainingSession: model config, techniques that ran, device, precision."""
        config = session.config
        model = session.model
        lm = model.get_base_model() if hasattr(model, "get_base_model") else model
        hf_config = getattr(lm, "config", None)
        run = session.run
        checkpointing = run.checkpointing if run.checkpointing_on else "off"
        compute_dtype = getattr(session.precision, "autocast_dtype", None)
        if compute_dtype is None:
            compute_dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        world_size = session.dist.world_size
        # The techniques are read when the prediction is made: after the first step a --compile that ran eager
        # says so (train/loop.py), and the summary's prediction counts what ran.
        return cls.for_run(
            hf_config, config, session.device, compute_dtype, checkpointing, run.loss_chunk_size > 0 and not run.fused_loss,
            session.accumulation_steps, world_size, techniques=lambda: techniques_that_run(session),
        )

    @classmethod
    def for_run(cls, hf_config: Any, config: Any, device: torch.device, compute_dtype: torch.dtype | None,
                checkpointing: str, chunked_loss: bool, accumulation_steps: int = 1, world_size: int = 1,
                techniques: dict[str, Any] | Callable[[], dict[str, Any]] | None = None) -> SpeedMeter:
        """`techniques`: what the run really does beyond the arguments (`techniques_that_run`, or a function giving
        it when asked); default: what `config` asks for."""
        try:
            flops = flops_per_token(hf_config, config.data.seq_len, lora_rank=resolve(config, None, device.type).lora_r,
                                    checkpointing=checkpointing, chunked_loss=chunked_loss)
        except (AttributeError, TypeError) as error:
            return cls(None, None, world_size, note=f"no FLOPs formula for this model ({error})")
        peak = device_peak(device, compute_dtype)
        probed = _is_probe(peak)
        meter = cls(flops, peak, world_size, device=device, compute_dtype=compute_dtype,
                    rate_probe=peak.flops_per_second if probed else None)
        if probed and device.type in START_SWEEP_SIZES:
            best = max(sweep_matmul_flops(device, compute_dtype or torch.float32, START_SWEEP_SIZES[device.type],
                                          budget_seconds=SWEEP_SECONDS / 4).values(), default=0.0)
            if best > peak.flops_per_second:
                meter.peak = DevicePeak(best, f"{peak.source} (best of sizes 256 to {PROBE_SIZE})")

        def predict(rated_by: DevicePeak) -> float:
            ran = techniques() if callable(techniques) else techniques
            return _planner_step_seconds(hf_config, config, rated_by, checkpointing, chunked_loss, accumulation_steps,
                                         device.type, ran)

        meter.predict = predict
        try:
            meter.predicted_step_seconds = predict(meter.rating_peak)
        except Exception as error:  # the speed model is a check, never a reason to stop training
            meter.predict = None
            meter.note = f"no predicted step time: {type(error).__name__}: {str(error)[:120]}"
        return meter

    @property
    def rating_peak(self) -> DevicePeak:
        """The peak the speed model is rated by: the preset's, or the 1024 probe's (its CPU terms' reference)."""
        if self.rate_probe is None:
            return self.peak
        return DevicePeak(self.rate_probe, _base_source(self.peak))

    def start_facts(self) -> dict[str, Any]:
        if self.flops is None:
            return {"mfu_note": self.note}
        facts = {
            "model_flops_per_token": self.flops.model,
            "hardware_flops_per_token": self.flops.hardware,
            "peak_flops_per_second": self.peak.flops_per_second,
            "peak_flops_source": self.peak.source,
            "model_step_seconds": self.predicted_step_seconds,  # the summary says whether it can be trusted
        }
        if self.note:
            facts["speed_model_note"] = self.note
        return facts

    def step(self, tokens: int, seconds: float) -> dict[str, float]:
        """MFU and HFU of one optimizer step that trained `tokens` (all ranks) in `seconds` ({} once MFU is left
        out); `peak_flops_per_second` too when this step had the peak measured again."""
        self._seconds.append(seconds)
        if self.flops is None or self.mfu_note:
            return {}
        per_second = tokens / self.world_size / max(seconds, 1e-9)
        model, hardware = per_second * self.flops.model, per_second * self.flops.hardware
        self._model_rates.append(model)
        self._hardware_rates.append(hardware)
        record: dict[str, float] = {}
        if hardware > self.peak.flops_per_second:
            if _is_probe(self.peak) and self.remeasured < PROBE_REMEASURES:
                self._measure_peak_again()
                record["peak_flops_per_second"] = self.peak.flops_per_second
            if hardware > self.peak.flops_per_second:
                peak = f"{self.peak.flops_per_second / 1e9:.3g} GFLOP/s"
                self.mfu_note = f"step {len(self._seconds)} ran {hardware / 1e9:.3g} GFLOP/s, above the peak " + (
                    f"measured here ({peak} at best, matmul probe measured {1 + self.remeasured} times)"
                    if _is_probe(self.peak) else f"of {self.peak.source} ({peak})")
                log.info("memfit: MFU left out: %s", self.mfu_note)
                return record  # the peak measured again, if it was: no MFU against a peak a step beat
        record["mfu"] = round(model / self.peak.flops_per_second, 5)
        record["hfu"] = round(hardware / self.peak.flops_per_second, 5)
        return record

    def _measure_peak_again(self) -> None:
        """A step beat the probed peak: time the matmuls again now and keep the best rate ever measured."""
        self.remeasured += 1
        device, dtype = self.device or torch.device("cpu"), self.compute_dtype or torch.float32
        rates = sweep_matmul_flops(device, dtype, SWEEP_SIZES.get(device.type, (PROBE_SIZE,)))
        if rates.get(PROBE_SIZE, 0.0) > (self.rate_probe or 0.0):
            self.rate_probe = rates[PROBE_SIZE]
        best = max(rates.values(), default=0.0)
        if best > self.peak.flops_per_second:
            self.peak = DevicePeak(best, f"{_base_source(self.peak)} (best of sizes {min(rates)} to {max(rates)},"
                                         f" measured again at step {len(self._seconds)})")
        log.info("memfit: a step beat the matmul probe; measured again: peak %.3g GFLOP/s",
                 self.peak.flops_per_second / 1e9)

    @property
    def first_step_seconds(self) -> float | None:
        """The first step's time (compile and allocator warm-up included)."""
        return self._seconds[0] if self._seconds else None

    def summary(self) -> dict[str, Any]:
        """Medians over the steps after the first (which carries compile and allocator warm-up), MFU against the
        final peak, and the prediction where it can be trusted (`prediction_note` says why not)."""
        measured = _typical(self._seconds)
        facts: dict[str, Any] = {"mfu": None, "hfu": None, "measured_step_seconds": measured,
                                 "predicted_step_seconds": None}
        if self.peak is not None:
            facts["peak_flops_per_second"] = self.peak.flops_per_second
            facts["peak_flops_source"] = self.peak.source
        if self.mfu_note or self.flops is None:
            facts["mfu_note"] = self.mfu_note or self.note
        elif self.peak is not None and self._model_rates:
            facts["mfu"] = _typical(self._model_rates) / self.peak.flops_per_second
            facts["hfu"] = _typical(self._hardware_rates) / self.peak.flops_per_second
        model_seconds = self.predicted_step_seconds
        if self.predict is not None and model_seconds is not None:
            try:  # rated by the probe as measured last, with the techniques as they ran
                model_seconds = self.predict(self.rating_peak)
            except Exception as error:  # the start's figure stands
                log.info("memfit: speed model at the summary: %s: %s", type(error).__name__, str(error)[:120])
        facts["model_step_seconds"] = model_seconds
        if not (measured and model_seconds):
            if self.note:
                facts["prediction_note"] = self.note
            return facts
        ratio = measured / model_seconds
        facts["measured_over_model"] = round(ratio, 3)
        why = self._untrusted(ratio)
        if why:
            facts["prediction_note"] = why
        else:
            facts["predicted_step_seconds"] = model_seconds
            facts["measured_over_predicted"] = round(ratio, 3)
        return facts

    def _untrusted(self, ratio: float) -> str:
        """Why the speed model's step may not be shown as a prediction ('' when it may)."""
        if self.mfu_note and _is_probe(self.peak):
            return "the matmul probe that rates this device is below what its steps ran"
        if 1 / TRUSTED_WITHIN <= ratio <= TRUSTED_WITHIN:
            return ""
        off = f"{ratio:.2g}x" if ratio > 1 else f"1/{1 / ratio:.2g}"
        why = f"the speed model was off by more than {TRUSTED_WITHIN:g}x here (the measured step was {off} its figure"
        load = _load_average()
        if load is not None and (self.device is None or self.device.type == "cpu"):
            why += f"; load average {load[0]:.2g} on {load[1]} cores"
        return why + ")"


def _typical(values: list[float]) -> float | None:
    """The median, leaving out the first value (warm-up) when there are more."""
    values = values[1:] if len(values) > 1 else values
    return statistics.median(values) if values else None


def _base_source(peak: DevicePeak) -> str:
    """'matmul probe fp32 on cpu' of 'matmul probe fp32 on cpu (best of sizes ...)'."""
    return peak.source.split(" (")[0]


def _is_probe(peak: DevicePeak | None) -> bool:
    return peak is not None and peak.source.startswith("matmul probe")


def _load_average() -> tuple[float, int] | None:
    """The 1-minute load average and the CPU count (None where the system has none)."""
    try:
        return os.getloadavg()[0], os.cpu_count() or 1
    except (AttributeError, OSError):
        return None


def techniques_that_run(session: Any, config: Any = None) -> dict[str, Any]:
    """The speed model's settings that a run's techniques decide, as the run really applies them.

    Activation offload (its host-link traffic), the tiled MLP (one more MLP forward), `--compile` (whether compiled
    code ran: the resolved run's `compiled`, cleared when Dynamo ran the blocks eager) and optimizer offload (not
    where it fell back: on a CPU it does nothing). Without a session (`session=None`), what `config` asks for.
    """
    if session is None:
        run = resolve(config, None, "cpu")
        offloaded = run.host_optimizer_step
    else:
        run = session.run
        offloaded = run.host_optimizer_step and "optimizer_offload" not in session.fallbacks
    return {"activation_offload": run.activation_offload, "tiled_mlp": run.mlp_tiles, "compile": run.compiled,
            "optimizer_offload": bool(offloaded)}


def _planner_step_seconds(hf_config, config, peak: DevicePeak, checkpointing: str, chunked_loss: bool,
                          accumulation_steps: int, device_type: str, techniques: dict[str, Any] | None = None,
                          host_link_gbps: float | None = None) -> float:
    """The planner's step time for this run's settings, on a device of this run's peak and type
    (the planner's CPU and GPU terms differ: feeding, 8-bit AdamW, the chunked loss).

    On a CPU the peak is the 1024 matmul probe and the model runs at `CPU_PROBE_UTILISATION` of it (what the CPU
    terms were measured against, as trials rate it); on a GPU at the model's `UTILISATION` of the peak.
    `techniques` (`techniques_that_run`; default: what `config` asks for) carries activation offload, the
    tiled MLP, compile and optimizer offload, whose costs the planner adds; without them every offloaded run
    was predicted at the plain run's time. `host_link_gbps`: the host link's rate, by default this GPU's
    preset's (16 GB/s, the planner's figure without a preset, on a CPU or an unknown card).
    """
    from memfit.gpus import GpuSpec, local_gpu
    from memfit.prediction.estimator import estimate
    from memfit.prediction.speed_model import CPU_PROBE_UTILISATION, UTILISATION, estimated_step_seconds

    techniques = techniques if techniques is not None else techniques_that_run(None, config)
    if host_link_gbps is None:
        spec = local_gpu() if device_type == "cuda" else None
        host_link_gbps = spec.host_link_gbps if spec is not None else 16.0
    tflops = peak.flops_per_second / 1e12
    if device_type == "cpu":  # the model multiplies by UTILISATION: hand it the rate that gives the CPU's share
        tflops *= CPU_PROBE_UTILISATION / UTILISATION
    # The planner rates a GPU by its 16-bit peak; give it this device's peak in the dtype that runs.
    device_spec = GpuSpec("this device", 0, True, tflops, tflops, host_link_gbps, tflops)
    mode = next((m for m in ("full", "selective") if checkpointing.startswith(m)), "off")
    run = resolve(config, hf_config, device_type)
    changes = {
        "batch_size": config.training.batch_size,
        "gradient_accumulation_steps": accumulation_steps,
        "gradient_checkpointing": mode,
        "loss_chunk_size": 1 if chunked_loss else 0,
        "lora_r": run.lora_r,
        "quantize": run.quantize,
        "optimizer": run.optimizer,
        **techniques,
    }
    est = estimate(config, hf_config=hf_config)
    return float(estimated_step_seconds(changes, config, est, device_spec, hf_config, device=device_type))


def speed_line(summary: dict) -> str | None:
    """The end-of-run report's line on speed: tokens/s, MFU against which peak, the speed model's prediction; where
    MFU or the prediction cannot be trusted, why there is none instead of a figure."""
    mfu, measured = summary.get("mfu"), summary.get("measured_step_seconds")
    if not measured:
        return None
    tokens = summary.get("tokens_seen") or 0
    steps = summary.get("steps") or 0
    parts = [f"step {measured:.3g} s"]
    if tokens and steps:
        parts.append(f"{tokens / steps / measured:,.0f} tokens/s")
    if mfu is not None and 0 < mfu <= 1:
        parts.append(f"MFU {100 * mfu:.1f}% of {summary.get('peak_flops_source', 'the peak')}")
    elif summary.get("mfu_note"):
        parts.append(f"no MFU: {summary['mfu_note']}")
    if summary.get("predicted_step_seconds"):
        parts.append(f"planner predicted {summary['predicted_step_seconds']:.3g} s")
    elif summary.get("prediction_note"):
        parts.append(f"no prediction: {summary['prediction_note']}")
    kernels = summary.get("kernels")
    if kernels and kernels != "none":
        parts.append(f"kernels {kernels}")
    if summary.get("compiled_ran"):
        parts.append(f"compiled {summary.get('compile')}")
    return "  speed: " + " | ".join(parts)
