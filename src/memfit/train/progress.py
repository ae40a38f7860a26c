"""Progress of a run: a live bar on a terminal, plain periodic lines in a pipe or a log."""

from __future__ import annotations

import sys

from memfit.units import format_bytes


class Progress:
    def __init__(self, total_steps: int, start_step: int, every: int, enabled: bool = True):
        self.total = total_steps
        self.start = start_step
        self.every = max(1, every)
        self.enabled = enabled
        self.interactive = enabled and sys.stderr.isatty()
        self._bar = None
        self._task = None

    def __enter__(self) -> Progress:
        if self.interactive:
            from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeRemainingColumn
            from rich.progress import Progress as RichProgress

            self._bar = RichProgress(
                TextColumn("[bold]train"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[status]}"),
                TimeRemainingColumn(),
                transient=False,
                console=None,
            )
            self._bar.__enter__()
            self._task = self._bar.add_task("train", total=self.total, completed=self.start, status="")
        return self

    def update(self, step: int, loss: float, tokens_per_second: float, peak_bytes: int | None,
               scores: list[str] | None = None) -> None:
        """`scores`: the task's own measures of the step, worded (Task.step_scores)."""
        if not self.enabled:
            return
        memory = format_bytes(peak_bytes) if peak_bytes else "n/a"
        status = " | ".join([f"loss {loss:.4f}", *(scores or []), f"{tokens_per_second:,.0f} tok/s", f"peak {memory}"])
        if self._bar is not None:
            self._bar.update(self._task, completed=step, status=status)
        elif step % self.every == 0 or step == self.total or step == self.start + 1:
            print(f"step {step}/{self.total} | {status}", file=sys.stderr, flush=True)

    def evaluation(self, step: int, status: str) -> None:
        """An evaluation's result, worded by the task (Task.eval_status): its own line, in a pipe or above the bar."""
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.console.print(f"step {step}/{self.total} | {status}")
        else:
            print(f"step {step}/{self.total} | {status}", file=sys.stderr, flush=True)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
