"""Checkpoints written by several ranks at once, with the single-process guarantees.

A sharded checkpoint `<output-dir>/checkpoints/step-N/` holds what the engine wrote
(`shards/` for FSDP2 through torch.distributed.checkpoint, `engine/` for DeepSpeed)
plus the files memfit writes itself: `scheduler.pt`, `rng-<rank>.pt` and
`trainer_state.json` (the file that marks a checkpoint complete).

Every rank writes into the same temporary directory `.tmp-step-N`; after a barrier
rank 0 adds the trainer state, flushes and renames it into place, and prunes old
checkpoints. A run killed at any moment leaves the last complete checkpoint intact.
The output directory must be on a file system every rank sees (one machine, or a
shared mount across machines).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from memfit.checkpoint_files import (
    CHECKPOINT_DIR,
    TrainerState,
    publish_checkpoint,
    restore_rng_state,
    rng_state,
    trainer_state_from,
)
from memfit.distributed.context import DistContext
from memfit.errors import UsageError


def save_sharded(
    output_dir: str | Path,
    state: TrainerState,
    dist: DistContext,
    write_shards: Callable[[Path], None],
    scheduler: Any,
    config_dict: dict[str, Any],
    keep_last: int | None = None,
) -> Path:
    """Write one checkpoint from every rank; `write_shards(tmp_dir)` runs on all of them."""
    root = Path(output_dir) / CHECKPOINT_DIR
    final = root / f"step-{state.step}"
    temporary = root / f".tmp-step-{state.step}"
    if dist.is_main:
        root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir()
    dist.barrier()
    write_shards(temporary)
    torch.save(rng_state(), temporary / f"rng-{dist.rank}.pt")
    dist.barrier()  # every rank's part is on disk before the checkpoint is declared complete
    if dist.is_main:
        torch.save(scheduler.state_dict() if scheduler is not None else {}, temporary / "scheduler.pt")
        publish_checkpoint(temporary, final, output_dir, state, config_dict, keep_last, world_size=dist.world_size)
    dist.barrier()
    return final


def load_sharded(path: Path, dist: DistContext, read_shards: Callable[[Path], None], scheduler: Any) -> TrainerState:
    """Restore a checkpoint written by `save_sharded` with the same number of ranks."""
    try:
        meta = json.loads((path / "trainer_state.json").read_text())
        saved_world = meta.get("world_size", 1)
        if saved_world != dist.world_size:
            raise UsageError(
                f"checkpoint {path} was written by {saved_world} ranks and this run has {dist.world_size};"
                f" resume with --nproc_per_node {saved_world}"
            )
        read_shards(path)
        if scheduler is not None:
            scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        rng = torch.load(path / f"rng-{dist.rank}.pt", weights_only=True)
    except UsageError:
        raise
    except Exception as error:  # any damage means the same to the user
        first = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
        raise UsageError(
            f"checkpoint {path} is damaged or was not written by a sharded run ({first}); delete it to resume from an"
            " earlier one, or start without --resume"
        ) from None
    restore_rng_state(rng)
    return trainer_state_from(meta)
