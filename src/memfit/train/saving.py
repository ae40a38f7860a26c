"""When the loop saves a checkpoint, and how: every N steps, every M minutes, on preemption; in the
background or not.

    saver = Saver(session, logger, preemption)
    ... after each optimizer step:  saver.after_step(state)   # may save; raises PreemptedError when asked to stop
    ... before the final save:      saver.finish()            # waits for a write in flight

Retention (--save-total-limit) runs in memfit.checkpoint_files once a new checkpoint is complete.
Under torchrun the ranks agree, after each step, on whether to save (the minutes elapsed can
differ between ranks) and whether to stop (a signal may reach one rank only): one all-reduce.

--async-save: the engine copies the state to host memory (the stall the step sees) and a
background thread writes it; the next save waits for the previous write. Engines that cannot
(FSDP2, DeepSpeed: their writes are collectives) save synchronously and say so once.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from memfit.checkpoint_files.writer import BackgroundWriter
from memfit.errors import PreemptedError

log = logging.getLogger("memfit")


class Saver:
    def __init__(self, session: Any, logger: Any, preemption: Any, enabled: bool = True):
        self.session = session
        self.config = session.config
        self.logger = logger
        self.preemption = preemption
        self.enabled = enabled
        output = self.config.output
        self.every_steps = output.save_every
        self.every_seconds = output.save_every_minutes * 60
        self.last_save_time = time.monotonic()
        self.last_saved_step: int | None = None
        self.writer: BackgroundWriter | None = None
        self.stalls: list[float] = []
        if enabled and output.async_save:
            if hasattr(session.engine, "checkpoint_snapshot"):
                self.writer = BackgroundWriter()
            else:
                reason = (f"{session.engine.name} writes its checkpoints collectively: saves are synchronous"
                          " (torch.distributed.checkpoint's async save is not used under gloo)")
                session.fallbacks["async_save"] = reason
                log.warning("memfit: --async-save: %s", reason)

    def after_step(self, state: Any) -> None:
        """Save when a save is due or a stop was asked; after a stop, raise PreemptedError."""
        if not self.enabled:
            return
        total = self.session.total_steps
        due = bool(self.every_steps) and state.step % self.every_steps == 0 and state.step < total
        timed = bool(self.every_seconds) and time.monotonic() - self.last_save_time >= self.every_seconds
        # One collective a step for both decisions: 2 x stop + timed, agreed by the maximum over ranks.
        local = 2 * int(self.preemption.requested) + int(timed)
        needs_agreement = self.preemption.signals or self.every_seconds
        agreed = int(self.session.dist.all_reduce_max(float(local))) if needs_agreement else local
        if agreed >= 2:  # someone was signalled: this step's checkpoint is saved whatever else is due
            self.save(state, background=False)
            raise self._preempted(state)
        if due or (agreed == 1 and state.step < total):
            self.save(state)
            # A signal that came during the save stops the run now, on the checkpoint just written.
            if self.preemption.signals and self.session.dist.all_reduce_max(float(self.preemption.requested)):
                raise self._preempted(state)

    def save(self, state: Any, background: bool = True) -> None:
        """One checkpoint of `state`, in the background when --async-save runs and `background`."""
        if self.last_saved_step == state.step:
            self.finish()  # this step's checkpoint is written or being written: wait for it, never write it twice
            return
        session = self.session
        started = time.perf_counter()
        config_dict = self.config.to_dict()
        if self.writer is not None and background:
            write = session.engine.checkpoint_snapshot(session.output_dir, state, session.scheduler, config_dict)
            if write is not None:
                self.writer.submit(write)
        else:
            self.finish()  # one write at a time: pruning must see the previous checkpoint complete
            session.engine.save_checkpoint(session.output_dir, state, session.scheduler, config_dict)
        stall = time.perf_counter() - started
        self.stalls.append(stall)
        self.last_saved_step = state.step
        self.last_save_time = time.monotonic()
        self.logger.log({"event": "checkpoint", "step": state.step, "stall_seconds": round(stall, 4),
                         "async": self.writer is not None and background})

    def finish(self) -> None:
        """Wait for the write in flight (its error, a full disk, is raised here)."""
        if self.writer is not None:
            self.writer.wait()

    def summary(self) -> dict:
        if not self.stalls:
            return {}
        return {"checkpoint_saves": len(self.stalls), "checkpoint_stall_seconds_max": round(max(self.stalls), 4),
                "checkpoint_stall_seconds_mean": round(sum(self.stalls) / len(self.stalls), 4)}

    def _preempted(self, state: Any) -> PreemptedError:
        self.finish()  # the checkpoint written in the background is complete before the run says so
        received = self.preemption.received.name if self.preemption.received is not None else "another rank's signal"
        self.logger.log({"event": "preempted", "step": state.step, "signal": received})
        self.logger.close()
        return PreemptedError(
            f"preempted by {received} after step {state.step}: checkpoint step-{state.step} is written in"
            f" {self.session.output_dir}; run the same command with --resume auto to continue"
        )


def prepare_long_run(session: Any, resume_from: Any, start_step: int, save_outputs: bool) -> dict:
    """Before the first step: refuse a resume that changes the run, and a run whose checkpoints cannot fit the disk.

    Returns the run's identity, which every checkpoint records (train/resume_check.py).
    """
    from memfit.train.resume_check import check_resume, run_identity

    identity = check_resume(session, resume_from) if resume_from is not None else run_identity(session)
    if save_outputs and session.dist.is_main:
        import shutil

        from memfit.checkpoint_files.retention import stale_temporaries

        for stale in stale_temporaries(session.output_dir):  # a save cut short by a kill; never complete
            log.info("memfit: removing %s, a checkpoint whose write was cut short", stale)
            shutil.rmtree(stale, ignore_errors=True)
    if save_outputs:
        from memfit.train.disk import check_disk_space

        check_disk_space(session, start_step)
    return identity


def start_preemption(session: Any, save_outputs: bool):
    """The signal handling of a run (a context manager); nothing is caught when the run writes nothing."""
    from memfit.train.preemption import Preemption, arm_test_hook, parse_signals

    output = session.config.output
    signals = parse_signals(output.preempt_signals) if save_outputs else []
    if signals:
        arm_test_hook(session)
    return Preemption(signals, output.preempt_grace_seconds, session.dist)
