"""Checkpoint writes in a background thread (--async-save): training goes on while the files are written.

The state is first copied to host memory (the caller's snapshot), so the thread writes a
consistent picture while the next steps change the weights. One write is in flight at a
time: the next save waits for the previous one, and the run waits for the last one before
it ends. An error of the write (a full disk) is raised at that wait, in the training thread.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any


class BackgroundWriter:
    """Runs one write at a time in a daemon thread; `wait()` joins it and raises what it raised."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._result: Any = None
        self.write_seconds: float | None = None
        """How long the last finished write took in the background."""

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, write: Callable[[], Any]) -> None:
        """Start `write()` in the background, after the previous write has finished."""
        self.wait()

        def run() -> None:
            started = time.perf_counter()
            try:
                self._result = write()
            except BaseException as error:  # raised again in the training thread by wait()
                self._error = error
            finally:
                self.write_seconds = time.perf_counter() - started

        # A daemon thread: a run killed mid-write leaves only the temporary directory, never a half checkpoint.
        self._thread = threading.Thread(target=run, name="memfit-checkpoint-writer", daemon=True)
        self._thread.start()

    def wait(self) -> Any:
        """Block until the write in flight (if any) is done; returns its result or raises its error."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error
        result, self._result = self._result, None
        return result
