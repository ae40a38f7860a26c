"""The few short steps a trial times (train/trials.py): the peak under the cap, then one and two micro-batches."""

from __future__ import annotations

import time
from typing import Any

import torch


def time_steps(session: Any, cap: int | None) -> tuple[float, int]:
    """(seconds of one optimizer step at the plan's accumulation, peak bytes) from four short steps.

    A step of one micro-batch makes the optimizer's state (and warms up allocations and kernel choices).
    The next (two micro-batches where the plan accumulates: gradients held across them) runs under the
    cap with that state live, as every step of the run after its first, and measures the peak. The
    timed steps run without the tracker, whose bookkeeping would slow every operator.
    """
    from memfit.train.loop import _activation_offload_context
    from memfit.train.step import StepRunner

    # As the loop does: a model loaded by from_pretrained is in eval mode, where Hugging Face blocks skip
    # gradient checkpointing (and dropout): a checkpointed plan would be timed and capped without its recompute
    session.model.train()
    micro = session.config.training.batch_size
    accumulation = session.accumulation_steps
    indices = session.schedule.batch_indices(0)
    samples = session.task.prepare([session.dataset[i] for i in indices], indices, 0)
    one, two = samples[:micro], samples[: 2 * micro]
    first = two if accumulation > 1 else one
    cuda = session.device.type == "cuda"
    with _activation_offload_context(session):
        # One step before the measured one: the optimizer makes its state on its first step, and every step of the
        # run after the first holds it; a peak measured without it passes a cap that the run's second step breaks
        warm_up = StepRunner.from_session(session, micro_batch_size=micro, oom_recovery=False)
        try:
            warm_up.run(one)
        finally:
            warm_up.close()
        if not cuda:
            from memfit.memory.tracker import MemoryTracker

            tracker = MemoryTracker(session.device, cap_bytes=cap)
            tracker.attach(session.model, session.optimizer)
            runner = StepRunner.from_session(session, tracker=tracker, micro_batch_size=micro, oom_recovery=False)
            try:
                with tracker:
                    runner.run(first)
                    peak = tracker.end_step().peak_bytes
            finally:
                runner.close()
                tracker.detach()
        else:
            from memfit.memory.cap import apply_memory_cap

            if cap is not None:
                apply_memory_cap(session.device, cap)
            torch.cuda.reset_peak_memory_stats(session.device)
        runner = StepRunner.from_session(session, micro_batch_size=micro, oom_recovery=False)
        try:
            def timed(batch: list[dict]) -> float:
                if cuda:
                    torch.cuda.synchronize(session.device)
                start = time.perf_counter()
                runner.run(batch)
                if cuda:
                    torch.cuda.synchronize(session.device)
                return time.perf_counter() - start

            if cuda:
                timed(first)  # warm-up under the allocator's cap: an OOM here drops the trial
            t1 = timed(one)
            if accumulation > 1 and len(two) > len(one):
                t2 = timed(two)
                micro_seconds = max(t2 - t1, 0.5 * t1)  # noise can make t2 - t1 tiny: a micro-batch is at least half of t1
                seconds = accumulation * micro_seconds + max(0.0, t1 - micro_seconds)
            else:
                seconds = t1
        finally:
            runner.close()
        if cuda:
            peak = torch.cuda.max_memory_allocated(session.device)
    return seconds, int(peak)

