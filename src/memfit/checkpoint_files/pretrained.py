"""`save_pretrained` without importing DeepSpeed where no DeepSpeed engine can exist.

transformers' save_pretrained unwraps the model through accelerate, which imports the deepspeed
package whenever it is installed only to ask whether the model is a DeepSpeedEngine. That import
pulls in DeepSpeed's autotuner and mlflow: about 4 s on 2 CPU cores at the end of every run that
never used DeepSpeed, longer than a whole step of a small model. An engine exists only if deepspeed
was imported, so while it is not, accelerate's lookup answers "not installed" for the length of
the call; a run under DeepSpeed (deepspeed imported) saves exactly as before.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any


@contextlib.contextmanager
def deepspeed_unwrap_skipped() -> Iterator[None]:
    """Within the block, accelerate's unwrapping does not import deepspeed if nothing has yet."""
    if "deepspeed" in sys.modules:
        yield
        return
    try:
        from accelerate.utils import other
    except ImportError:  # accelerate absent: transformers unwraps without it
        yield
        return
    looked_up = getattr(other, "is_deepspeed_available", None)
    if looked_up is None:  # another accelerate: leave its unwrapping as it is
        yield
        return
    other.is_deepspeed_available = lambda: False
    try:
        yield
    finally:
        other.is_deepspeed_available = looked_up


def save_pretrained(model: Any, directory: str | Path, **kwargs: Any) -> None:
    """`model.save_pretrained(directory, **kwargs)`, without the deepspeed import when it is not in use."""
    with deepspeed_unwrap_skipped():
        model.save_pretrained(directory, **kwargs)
