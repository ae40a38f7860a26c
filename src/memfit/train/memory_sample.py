"""The memory tracker on one early step of a run: what a default run's report shows at the peak.

The report promises the memory at the peak beside memfit's estimate and one step's timeline; those
come from the live-tensor tracker (memfit.memory.tracker), which costs a Python call per operator.
`--track-memory` runs it on every step; by default it runs on one step only:

- the launch's second step (its first when it has one step): the first step of a fresh run builds
  the optimizer state in its optimizer phase, so its peak is not the one every later step reaches,
  which is what the estimate predicts;
- only where the result is drawn and cheap to take: one process (no sharding engine under it), the
  HTML report on (`--no-report` skips it), no `--compile` (Dynamo does not run under the tracker's
  dispatch mode, so the tracked step would not be the step that runs), and no `--no-track-memory`.

Its step time is kept out of the speed meter (MFU, the measured step the planner learns from):
on the 3M-parameter default model the tracked step takes about 3x an untracked one on a CPU.

    sample = OneStepSample.for_run(session, first_step, save_outputs)   # None: not this run
    with sample:                                                         # leaves the tracker if a step raises
        ...before each step: sampled = sample.begin(step_number, runner, evaluator)   # True: this one is tracked
        ...after it:         sample.tracker.end_step(); sample.end()
"""

from __future__ import annotations

import contextlib
from typing import Any


class OneStepSample:
    """The tracker entered for one optimizer step (`step`, 1-based as in the metrics), then left."""

    def __init__(self, session: Any, step: int):
        from memfit.memory.tracker import MemoryTracker

        self.session = session
        self.step = step
        self.tracker = MemoryTracker(session.device)
        self._stack = contextlib.ExitStack()

    @classmethod
    def for_run(cls, session: Any, first_step: int, save_outputs: bool) -> OneStepSample | None:
        """The sample of this launch (it starts after `first_step` steps), or None where the default does not track."""
        if not default_tracking(session.config, session.run, session.dist.world_size, save_outputs):
            return None
        remaining = session.total_steps - first_step
        if remaining <= 0:
            return None
        return cls(session, first_step + (2 if remaining >= 2 else 1))

    def begin(self, step: int, runner: Any, evaluator: Any = None) -> bool:
        """Before optimizer step `step`: when it is the one, attach and enter the tracker; whether it is."""
        if step != self.step:
            return False
        session = self.session
        self.tracker.attach(session.model, session.optimizer)
        runner.tracker = self.tracker  # the step's phases (forward, backward, optimizer)
        if evaluator is not None:
            evaluator.tracker = self.tracker  # an evaluation after this step is its "eval" phase
        self._stack.enter_context(self.tracker)
        self._stack.callback(self._release, runner, evaluator)
        return True

    def end(self) -> None:
        """After the tracked step: leave the tracker and detach it (a no-op when it is not entered)."""
        self._stack.close()

    def __enter__(self) -> OneStepSample:
        return self

    def __exit__(self, *exc_info) -> None:
        self.end()  # a step that raised inside the tracker leaves it too

    def _release(self, runner: Any, evaluator: Any) -> None:
        self.tracker.detach()  # the module hooks go: later steps run as if it had never been there
        runner.tracker = None
        if evaluator is not None:
            evaluator.tracker = None


def default_tracking(config: Any, run: Any, world_size: int, save_outputs: bool = True) -> bool:
    """Whether a run tracks one step by default (`--track-memory` unset): see the module's docstring."""
    return (config.memory.track_memory is None and save_outputs and config.output.report and world_size == 1
            and not run.compiled)
