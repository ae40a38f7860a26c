"""Keep stdout clean for `--json`: everything printed while computing goes to stderr."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def stdout_to_stderr(enabled: bool = True) -> Iterator[None]:
    """Send what libraries print (DeepSpeed's and transformers' notices) to stderr while computing."""
    if not enabled:
        yield
        return
    with contextlib.redirect_stdout(sys.stderr):
        yield


def print_json(payload: Any) -> None:
    """The one object `--json` promises on stdout."""
    sys.stdout.write(json.dumps(payload) + "\n")
    sys.stdout.flush()
