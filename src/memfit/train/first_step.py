"""The checks after a launch's first step: what was asked for but did not run.

Compiling is lazy and efficient LoRA decides per adapter when it first runs, so only after the
first step can the run say what really ran; the metrics must name that, not what was asked.
"""

from __future__ import annotations

import logging
from typing import Any

from memfit.train.metrics import MetricLogger
from memfit.train.step_observer import FinishedStep, StepObserver

log = logging.getLogger("memfit")


class FirstStepChecks(StepObserver):
    """After the first step of a launch: a --compile that ran eager, adapters that ran PEFT's path."""

    def __init__(self, session: Any, logger: MetricLogger, tracked: bool):
        self.session = session
        self.logger = logger
        self.tracked = tracked
        """Whether the memory tracker watches every step (Dynamo does not run under it)."""

    def after_step(self, done: FinishedStep) -> None:
        if done.is_first:
            check_compiled(self.session, self.logger, self.tracked, step=done.step)
            check_efficient_lora(self.session, self.logger)


def check_compiled(session: Any, logger: MetricLogger, tracked: bool, step: int = 1) -> None:
    """After the first step (`step`) of a --compile run: when the blocks ran eager, say so and change the run.

    Dynamo falls back silently: under the memory tracker's dispatch mode always, elsewhere when it
    compiled nothing.
    """
    if not session.run.compiled:
        return
    from memfit.techniques.compile import compile_stats

    # Under the tracker's dispatch mode Dynamo never runs compiled code, even graphs compiled
    # before; otherwise no graph in the process after a step means nothing compiled.
    if not tracked and compile_stats()["compiled_graphs"]:
        return
    why = ("the memory tracker (--memory-cap or --track-memory on a CPU) watches every operator, and Dynamo"
           " does not run under it" if tracked else "Dynamo fell back to eager")
    reason = f"no graph was compiled in the first step: {why}; the blocks ran eager"
    session.fallbacks["compile"] = reason
    session.change_run("compile", reason, step=step, compiled=False)
    log.warning("memfit: --compile: %s", reason)
    logger.log({"event": "fallback", "technique": "compile", "reason": reason})


def check_efficient_lora(session: Any, logger: MetricLogger) -> None:
    """After the first step: adapters that ran PEFT's path instead of memfit's efficient one, and why."""
    if not session.run.efficient_lora:
        return
    from memfit.techniques.efficient_lora import fallback_reasons

    reasons = fallback_reasons(session.model)
    if reasons:
        reason = "; ".join(reasons) + ": those adapters keep PEFT's copies of their inputs"
        session.fallbacks["efficient_lora"] = reason
        logger.log({"event": "fallback", "technique": "efficient_lora", "reason": reason})
