"""Find the largest micro-batch that fits: doubling from 1, then a binary search.

Each probe is a full training step (forward, backward, optimizer step) on worst-case
samples: full --seq-len windows with every token a target. A probe fits when it
raises no out-of-memory error and its measured peak stays under the limit: the
memory cap (or the device's memory) less a safety margin. The search takes
O(log n) probes.
"""

from __future__ import annotations

import gc
import logging
from dataclasses import asdict, dataclass, field

import torch

from memfit.config import TrainConfig
from memfit.errors import DoesNotFitError
from memfit.memory.cap import is_out_of_memory
from memfit.train.setup import TrainingSession, build_session
from memfit.train.step import StepRunner
from memfit.units import format_bytes

log = logging.getLogger("memfit")

# The search never goes beyond this many samples per micro-batch.
MAX_PROBE_BATCH = 4096


@dataclass
class Probe:
    batch_size: int
    fits: bool
    peak_bytes: int | None
    """Measured peak of the probe step (None when it ran out of memory before the end)."""


@dataclass
class BatchSizeResult:
    max_batch_size: int
    recommended_batch_size: int
    gradient_accumulation_steps: int
    peak_bytes_at_recommended: int | None
    limit_bytes: int
    probes: list[Probe] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def memory_limit(config: TrainConfig, device: torch.device, margin: float) -> tuple[int, int]:
    """(capacity, limit): the cap or the device's memory, and that less the margin."""
    capacity = config.memory.memory_cap
    if capacity is None and device.type == "cuda":
        capacity = torch.cuda.get_device_properties(device).total_memory
    if capacity is None:
        capacity = _host_available_bytes()
    return capacity, int(capacity * (1.0 - margin))


def _host_available_bytes() -> int:
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 16 * 1024**3


class _Prober:
    """Runs probe steps on one prepared session, measuring each with the tracker (or CUDA stats)."""

    def __init__(self, session: TrainingSession, capacity: int, limit: int):
        self.session = session
        self.limit = limit
        self.device = session.device
        self.tracker = None
        if self.device.type == "cpu":
            from memfit.memory.tracker import MemoryTracker

            self.tracker = MemoryTracker(self.device, cap_bytes=capacity)
            self.tracker.attach(session.model, session.optimizer)
        elif session.config.memory.memory_cap is not None:
            from memfit.memory.cap import apply_memory_cap

            apply_memory_cap(self.device, capacity)
        generator = torch.Generator().manual_seed(0)
        vocab = session.model.get_input_embeddings().weight.shape[0]
        seq_len = session.config.data.seq_len
        self.sample_ids = torch.randint(0, vocab, (MAX_PROBE_BATCH, seq_len), generator=generator)

    def __call__(self, batch_size: int) -> Probe:
        samples = [{"input_ids": self.sample_ids[i], "labels": self.sample_ids[i]} for i in range(batch_size)]
        # The loop's step at this micro-batch, without recovery: an OOM means "does not fit".
        runner = StepRunner.from_session(self.session, tracker=self.tracker, micro_batch_size=batch_size, oom_recovery=False)
        peak = None
        fits = True
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        try:
            if self.tracker is not None:
                with self.tracker:
                    runner.run(samples)
                    peak = self.tracker.end_step().peak_bytes
            else:
                runner.run(samples)
                peak = torch.cuda.max_memory_allocated(self.device)
        except Exception as error:
            if not is_out_of_memory(error):
                raise
            fits = False
        finally:
            runner.close()
            self.session.optimizer.zero_grad(set_to_none=True)
            del runner, samples
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        if peak is not None and peak > self.limit:
            fits = False
        log.info("memfit: probe micro-batch %d: %s (peak %s)", batch_size, "fits" if fits else "does not fit", format_bytes(peak) if peak else "OOM")
        return Probe(batch_size, fits, peak)


def search_batch_size(probe, upper: int = MAX_PROBE_BATCH) -> tuple[int, list[Probe]]:
    """Largest size for which `probe(size).fits`, by doubling then bisecting; 0 if 1 does not fit."""
    probes: list[Probe] = []

    def run(size: int) -> bool:
        result = probe(size)
        probes.append(result)
        return result.fits

    if not run(1):
        return 0, probes
    last_fit, first_fail = 1, None
    while first_fail is None and last_fit < upper:
        candidate = min(last_fit * 2, upper)
        if run(candidate):
            last_fit = candidate
        else:
            first_fail = candidate
    if first_fail is None:
        return last_fit, probes
    while first_fail - last_fit > 1:
        middle = (last_fit + first_fail) // 2
        if run(middle):
            last_fit = middle
        else:
            first_fail = middle
    return last_fit, probes


def find_batch_size(config: TrainConfig, margin: float = 0.1, session: TrainingSession | None = None) -> BatchSizeResult:
    """Probe the configured run for the largest micro-batch that fits.

    The recommended size divides the effective batch (--effective-batch-size, or
    --batch-size x --gradient-accumulation-steps) so accumulation stays whole.
    Raises DoesNotFitError when even one sample does not fit.
    """
    session = session or build_session(config)
    session.model.train()
    capacity, limit = memory_limit(config, session.device, margin)
    effective = session.effective_batch_size
    prober = _Prober(session, capacity, limit)
    best, probes = search_batch_size(prober, upper=min(MAX_PROBE_BATCH, max(effective, 1) * 64))
    if best == 0:
        raise DoesNotFitError(
            f"one sample of {session.config.data.seq_len} tokens does not fit in {format_bytes(limit)}"
            f" ({format_bytes(capacity)} less a {margin:.0%} margin); lower --seq-len, add --gradient-checkpointing full,"
            " --lora-r 16 or --optimizer adamw-8bit"
        )
    recommended = max(size for size in range(1, min(best, effective) + 1) if effective % size == 0)
    measured = {p.batch_size: p.peak_bytes for p in probes if p.fits}
    if recommended not in measured:
        measured[recommended] = prober(recommended).peak_bytes
    return BatchSizeResult(
        max_batch_size=best,
        recommended_batch_size=recommended,
        gradient_accumulation_steps=effective // recommended,
        peak_bytes_at_recommended=measured.get(recommended),
        limit_bytes=limit,
        probes=probes,
    )
