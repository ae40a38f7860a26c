"""Which checkpoints a run keeps: the newest N, and the best by eval loss where evaluation names one.

Pruning runs only after a new checkpoint is complete (renamed into place), so a run
killed while it saves still has its previous checkpoint.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

log = logging.getLogger("memfit")

CHECKPOINT_DIR = "checkpoints"
BEST_FILE = "best.json"
"""<output-dir>/best.json {"step", "eval_loss"}: written by evaluation when it keeps a best model."""
_STEP_PATTERN = re.compile(r"^step-(\d+)$")


def checkpoint_step(path: Path) -> int | None:
    match = _STEP_PATTERN.match(path.name)
    return int(match.group(1)) if match else None


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary directories are not complete)."""
    root = Path(output_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        step = checkpoint_step(path)
        if step is not None and (path / "trainer_state.json").is_file():
            found.append((step, path))
    return [path for _, path in sorted(found)]


def best_step(output_dir: str | Path) -> int | None:
    """The step that best.json names (the best eval loss so far), if evaluation wrote one."""
    path = Path(output_dir) / BEST_FILE
    try:
        return int(json.loads(path.read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def prune_checkpoints(output_dir: str | Path, keep_last: int) -> list[Path]:
    """Delete all but the newest `keep_last` complete checkpoints (0: keep all) and the best one; returns those deleted."""
    if keep_last <= 0:
        return []
    checkpoints = list_checkpoints(output_dir)
    best = best_step(output_dir)
    deleted = []
    for old in checkpoints[:-keep_last]:
        if best is not None and checkpoint_step(old) == best:
            continue  # the best by eval loss stays beside the newest ones
        shutil.rmtree(old, ignore_errors=True)
        deleted.append(old)
    return deleted


def stale_temporaries(output_dir: str | Path) -> list[Path]:
    """Temporary checkpoint directories left by a run that was killed while it saved."""
    root = Path(output_dir) / CHECKPOINT_DIR
    return sorted(root.glob(".tmp-step-*")) if root.is_dir() else []
