"""Preemption: a scheduler's signal ends the run at a step boundary with a checkpoint and exit code 75.

Clusters and spot instances stop a job by sending SIGTERM (SLURM can send SIGUSR1 some
seconds ahead with `--signal`) and kill it a little later. On a signal named by
--preempt-signals the handler only records it; the loop finishes the optimizer step in
flight (an update is never half applied), all ranks agree to stop after the same step
(one all-reduce of the flag per step under torchrun), a checkpoint is written and the run
exits with PREEMPTED_EXIT_CODE (75, EX_TEMPFAIL: "resume me" with --resume auto).

- A second signal exits at once (128 + the signal's number, as a shell reports a signal death);
  the last complete checkpoint stays what --resume auto finds.
- --preempt-grace-seconds bounds the wait: past it the process leaves with exit 75 and whatever
  checkpoint is complete by then (the one being written is a temporary directory, ignored).
- SIGINT (Ctrl-C) keeps its meaning (exit 130 at once) unless --preempt-signals names it.

MEMFIT_PREEMPT_AT=PHASE:STEP[:RANK] sends SIGTERM to this process at a named moment of optimizer
step STEP (1-based): forward, backward, optimizer (inside the update), save (as a checkpoint
write starts). It rehearses a preemption at an exact point, as the tests do.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from typing import Any

from memfit.errors import PreemptedError, UsageError

log = logging.getLogger("memfit")

PREEMPTED_EXIT_CODE = PreemptedError.exit_code
HOOK_ENV = "MEMFIT_PREEMPT_AT"
PHASES = ("forward", "backward", "optimizer", "save")


def parse_signals(text: str) -> list[signal.Signals]:
    """'SIGTERM,SIGUSR1' (or 'TERM,usr1', or 'none') -> the signals; UsageError naming a wrong one."""
    if text.strip().lower() in ("", "none", "off"):
        return []
    found = []
    for name in (part.strip().upper() for part in text.split(",")):
        full = name if name.startswith("SIG") else f"SIG{name}"
        if full not in signal.Signals.__members__ or full in ("SIGKILL", "SIGSTOP"):
            raise UsageError(f"--preempt-signals: {name!r} is not a signal memfit can catch; use e.g. SIGTERM,SIGUSR1,SIGINT")
        found.append(signal.Signals[full])
    return found


class Preemption:
    """Installed for the length of a run (a context manager); `should_stop()` is asked once per step."""

    def __init__(self, signals: list[signal.Signals], grace_seconds: float, dist: Any = None):
        self.signals = signals
        self.grace_seconds = grace_seconds
        self.dist = dist
        self.received: signal.Signals | None = None
        self._previous: dict[signal.Signals, Any] = {}
        self._done = threading.Event()

    def __enter__(self) -> Preemption:
        if threading.current_thread() is not threading.main_thread():
            if self.signals:
                log.info("memfit: training outside the main thread: preemption signals are not caught")
            return self
        for number in self.signals:
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc_info) -> None:
        self._done.set()
        if self.received is not None:
            # The run is stopping on a signal: a second one in the moments between the saved checkpoint and the
            # process's exit still means "exit at once" (128 + its number), not the default handler's death.
            return
        for number, previous in self._previous.items():
            signal.signal(number, previous)
        self._previous.clear()

    def _handle(self, number: int, frame: Any) -> None:
        name = signal.Signals(number).name
        if self.received is not None:
            # A handler must not log (the logging lock may be held by the interrupted code): write directly.
            os.write(2, f"memfit: second signal ({name}): exiting at once; resume with --resume auto\n".encode())
            os._exit(128 + number)
        self.received = signal.Signals(number)
        os.write(2, f"memfit: {name} received: finishing this step, then saving a checkpoint\n".encode())
        threading.Thread(target=self._watchdog, args=(name,), name="memfit-preempt-grace", daemon=True).start()

    def _watchdog(self, name: str) -> None:
        if self._done.wait(self.grace_seconds):
            return
        os.write(2, (f"memfit: {name}: the save did not finish within --preempt-grace-seconds {self.grace_seconds:g};"
                     " exiting; --resume auto takes the last complete checkpoint\n").encode())
        sys.stderr.flush()
        os._exit(PREEMPTED_EXIT_CODE)

    def agreed(self, local_flag: bool) -> bool:
        """Whether any rank has `local_flag` (every rank calls it, after the same step)."""
        if self.dist is None or not self.dist.enabled:
            return local_flag
        return self.dist.all_reduce_max(float(local_flag)) > 0

    @property
    def requested(self) -> bool:
        return self.received is not None


def arm_test_hook(session: Any, env: dict | None = None) -> None:
    """MEMFIT_PREEMPT_AT=PHASE:STEP[:RANK]: send SIGTERM to this process at that moment (see the module docstring)."""
    spec = (env if env is not None else os.environ).get(HOOK_ENV)
    if not spec:
        return
    parts = spec.split(":")
    if len(parts) not in (2, 3) or parts[0] not in PHASES or not all(p.isdigit() for p in parts[1:]):
        raise UsageError(f"{HOOK_ENV} must be PHASE:STEP[:RANK] with PHASE one of {', '.join(PHASES)}, got {spec!r}")
    phase, step = parts[0], int(parts[1])
    if len(parts) == 3 and int(parts[2]) != session.dist.rank:
        return
    done = {"steps": 0, "sent": False}

    def send(current_phase: str) -> None:
        if not done["sent"] and current_phase == phase and done["steps"] + 1 == step:
            done["sent"] = True
            os.kill(os.getpid(), signal.SIGTERM)

    def counted(*_args, **_kwargs) -> None:
        done["steps"] += 1

    session.model.register_forward_pre_hook(lambda *_: send("forward"))
    trainable = next(p for p in session.model.parameters() if p.requires_grad)
    trainable.register_hook(lambda grad: (send("backward"), grad)[1])
    session.optimizer.register_step_pre_hook(lambda *_: send("optimizer"))
    session.optimizer.register_step_post_hook(counted)
    engine = session.engine
    for method in ("save_checkpoint", "checkpoint_snapshot"):
        if hasattr(engine, method):
            setattr(engine, method, _signalling(getattr(engine, method), send, done))


def _signalling(save, send, done):
    def wrapped(*args, **kwargs):
        done["steps"] -= 1  # the save after N updates belongs to step N
        send("save")
        done["steps"] += 1
        return save(*args, **kwargs)

    return wrapped
