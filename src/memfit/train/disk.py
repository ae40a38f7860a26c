"""Will the checkpoints fit on the disk? Checked before the first step, from the state's sizes.

One checkpoint holds the trainable weights, the optimizer state (predicted from the
optimizer and the trainable shapes when the state is still empty), the scheduler, the
RNG and the trainer state. The run keeps --save-total-limit of them and writes the next
before deleting the oldest, so it needs room for one more than it keeps (or for every save
it will make, if fewer), plus the final model. A run that cannot fit stops at start with one
line (exit 2) unless --no-disk-check; a file-size limit (`ulimit -f`) smaller than the largest
checkpoint file is refused the same way.
"""

from __future__ import annotations

import logging
import resource
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memfit.checkpoint_files import list_checkpoints
from memfit.errors import UsageError
from memfit.units import format_bytes

log = logging.getLogger("memfit")

SMALL_FILES_BYTES = 64 * 1024
"""Scheduler, scaler, RNG, trainer_state.json and manifest.json together, with room to spare."""


@dataclass
class CheckpointSize:
    weights_bytes: int
    optimizer_bytes: int
    final_model_bytes: int

    @property
    def checkpoint_bytes(self) -> int:
        return self.weights_bytes + self.optimizer_bytes + SMALL_FILES_BYTES

    @property
    def largest_file_bytes(self) -> int:
        return max(self.weights_bytes, self.optimizer_bytes)


def _numel_bytes(tensors) -> int:
    seen, total = set(), 0
    for tensor in tensors:
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()  # a DTensor's numel is the whole tensor's
    return total


def checkpoint_size(session: Any) -> CheckpointSize:
    """The bytes of one checkpoint of `session` and of its final model (whole, over all ranks)."""
    import torch

    model, optimizer = session.model, session.optimizer
    trainable = [p for p in model.parameters() if p.requires_grad]
    weights = _numel_bytes(trainable)
    state_tensors = [t for state in optimizer.state.values() for t in state.values() if isinstance(t, torch.Tensor)]
    if state_tensors and session.dist.world_size == 1:
        optimizer_bytes = _numel_bytes(state_tensors)
    else:  # nothing stepped yet (or a shard of it): predicted from the optimizer and the shapes
        from memfit.models.state_bytes import optimizer_state_bytes_for_shapes

        name = session.run.optimizer
        element = trainable[0].element_size() if trainable else 4
        try:
            optimizer_bytes = optimizer_state_bytes_for_shapes(
                name, [tuple(p.shape) for p in trainable], element, momentum=session.config.optimizer.momentum
            )
        except UsageError:
            optimizer_bytes = 2 * weights  # an optimizer the table does not know: Adam's two moments
    final = weights if session.run.lora_r > 0 else _numel_bytes(list(model.parameters()))
    return CheckpointSize(weights, optimizer_bytes, final)


def checkpoints_to_hold(config: Any, total_steps: int, start_step: int, existing: int) -> int:
    """How many more checkpoints the disk must hold at the worst moment of the run."""
    output = config.output
    saves = 1 + (len(range(start_step + 1, total_steps)) // output.save_every if output.save_every else 0)
    if output.save_every_minutes:
        saves = total_steps - start_step  # as often as every step, at worst
    at_once = saves if output.save_total_limit == 0 else min(saves, output.save_total_limit + 1)
    return max(1, at_once - existing)


def check_disk_space(session: Any, start_step: int) -> CheckpointSize | None:
    """Refuse (UsageError) a run whose checkpoints cannot fit the output directory's free space or file-size limit."""
    config = session.config
    if not config.output.disk_check:
        return None
    size = checkpoint_size(session)
    output_dir = Path(config.output.output_dir)
    existing = len(list_checkpoints(output_dir))
    count = checkpoints_to_hold(config, session.total_steps, start_step, existing)
    needed = count * size.checkpoint_bytes + size.final_model_bytes
    probe = output_dir
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise UsageError(
            f"{output_dir} has {format_bytes(free)} free and this run needs about {format_bytes(needed)}"
            f" ({count} checkpoint(s) of {format_bytes(size.checkpoint_bytes)} and a final model of"
            f" {format_bytes(size.final_model_bytes)}); free space, lower --save-total-limit, pick another"
            " --output-dir, or add --no-disk-check to go on"
        )
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    largest = max(size.largest_file_bytes, size.final_model_bytes)
    if limit != resource.RLIM_INFINITY and largest > limit:
        raise UsageError(
            f"the file-size limit (ulimit -f) is {format_bytes(limit)} and a checkpoint file of this run takes"
            f" {format_bytes(largest)}; raise the limit, or add --no-disk-check to go on"
        )
    if session.dist.is_main:  # it fits (else refused above): nothing to act on, the debug log (MEMFIT_LOG_LEVEL=DEBUG)
        log.debug("memfit: disk: %s free in %s; a checkpoint takes about %s (%d kept at once) and the final model %s",
                 format_bytes(free), probe, format_bytes(size.checkpoint_bytes), count, format_bytes(size.final_model_bytes))
    return size
