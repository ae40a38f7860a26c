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


def load_sharded(
    path: Path, dist: DistContext, read_shards: Callable[[Path], None], scheduler: Any, reshards: bool = False
) -> TrainerState:
    """Restore a checkpoint written by `save_sharded`: with the same number of ranks, or any when `reshards`
    (torch.distributed.checkpoint re-slices the saved tensors for the ranks that load them), except state
    quantized per shard (`refuse_reblocked_state`)."""
    try:
        meta = json.loads((path / "trainer_state.json").read_text())
        saved_world = meta.get("world_size", 1)
        if saved_world != dist.world_size and not reshards:
            raise UsageError(
                f"checkpoint {path} was written by {saved_world} ranks and this run has {dist.world_size};"
                f" resume with --nproc_per_node {saved_world}"
            )
        refuse_reblocked_state(path, meta, dist.world_size)
        read_shards(path)
        if scheduler is not None:
            scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        rng = torch.load(_rng_file(path, dist.rank), weights_only=True)
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


BLOCKWISE_STATE_OPTIMIZERS = ("adamw-4bit",)
"""Optimizers whose state is quantized in blocks of each rank's own shard (torchao's 4-bit AdamW: 128 values a
block, tensors or shards under 4096 values or not a multiple of 128 kept in full precision). Another number of ranks
cuts the tensors elsewhere, so its blocks (and which tensors are quantized at all) would differ: copying the saved
state into them requantizes it, and the run would not continue as it was."""


def refuse_reblocked_state(path: Path, meta: dict[str, Any], world_size: int) -> None:
    """UsageError when the checkpoint's optimizer quantizes its state per shard and this run would cut it anew:
    only FSDP2 shards (`shards/`) loaded on the number of ranks that wrote them keep their blocks."""
    optimizer = meta.get("config", {}).get("optimizer", {}).get("optimizer")
    if optimizer not in BLOCKWISE_STATE_OPTIMIZERS:
        return
    saved_world = meta.get("world_size", 1)
    if (path / "shards").is_dir():
        if saved_world == world_size:
            return
        saved, remedy = f"{saved_world} FSDP2 ranks' shards", f"torchrun --nproc_per_node {saved_world} --sharding fsdp"
    else:
        saved, remedy = "whole tensors", "--sharding ddp or in one process"
    raise UsageError(
        f"checkpoint {path} holds --optimizer {optimizer} state quantized in blocks of {saved}, which {world_size}"
        f" {'FSDP2 ranks' if world_size > 1 else 'process'} would cut differently (not an exact resume): resume it"
        f" with {remedy}"
    )


def _rng_file(path: Path, rank: int) -> Path:
    """This rank's generator state; a rank the saving run did not have takes rank 0's, or the one process's
    (the data order does not depend on it; only dropout draws would differ)."""
    for candidate in (path / f"rng-{rank}.pt", path / "rng-0.pt", path / "rng.pt"):  # rng.pt: one process wrote it
        if candidate.is_file():
            return candidate
    return path / f"rng-{rank}.pt"


def load_shards_in_one_process(path: Path, model: torch.nn.Module, optimizer: Any, scheduler: Any) -> TrainerState:
    """Resume an FSDP2 checkpoint (torch.distributed.checkpoint shards) in one process: the shards are
    gathered into whole tensors by their names (model and optimizer state alike)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    def read(directory: Path) -> None:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp.load(state, checkpoint_id=str(directory / "shards"))
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    return load_sharded(path, DistContext(), read, scheduler, reshards=True)


_KERNEL_OPTIONS = ("fused", "foreach", "capturable", "differentiable")


def load_whole_into_shards(path: Path, model: torch.nn.Module, optimizer: Any, scheduler: Any,
                           dist: DistContext) -> TrainerState:
    """Resume a one-process checkpoint (model.safetensors, optimizer.pt) into an FSDP2 model: every rank reads
    the whole state and keeps its shards. The optimizer state, saved by parameter position, is renamed by
    the parameters' names (the sharded optimizer's groups hold the parameters in the same order)."""
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    from torch.distributed.tensor import DTensor, distribute_tensor

    parameters = dict(model.named_parameters())

    def shard_like(name: str, tensor: torch.Tensor) -> torch.Tensor:
        """A whole tensor cut as parameter `name` is cut (its own shard on this rank); others as they are."""
        parameter = parameters.get(name)
        if isinstance(parameter, DTensor) and isinstance(tensor, torch.Tensor) and tensor.shape == parameter.shape:
            return distribute_tensor(tensor.to(parameter.device), parameter.device_mesh, parameter.placements)
        return tensor

    def read(directory: Path) -> None:
        weights = load_file(str(directory / "model.safetensors"))
        model.load_state_dict({name: shard_like(name, tensor) for name, tensor in weights.items()}, strict=False)
        saved = torch.load(directory / "optimizer.pt", weights_only=True)
        names = {id(parameter): name for name, parameter in parameters.items()}
        order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
        by_name = {
            "state": {order[index]: {key: shard_like(order[index], value) for key, value in state.items()}
                      for index, state in saved["state"].items()},
            # The hyperparameters as saved; the kernel choice (fused, foreach) stays this engine's own.
            "param_groups": [{**group, **{key: own[key] for key in _KERNEL_OPTIONS if key in own},
                              "params": [order[index] for index in group["params"]]}
                             for group, own in zip(saved["param_groups"], optimizer.param_groups, strict=True)],
        }
        set_optimizer_state_dict(model, optimizer, optim_state_dict=by_name)

    return load_sharded(path, dist, read, scheduler, reshards=True)
