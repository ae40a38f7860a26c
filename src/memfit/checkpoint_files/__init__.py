"""The files of a run: resumable checkpoints, written atomically, and the final model.

Every engine (memfit.train.engine, memfit.distributed) writes through these functions,
so this module sits below both.

A checkpoint directory `<output-dir>/checkpoints/step-N/` holds:
  model.safetensors   the trainable weights (the adapter only, with LoRA)
  optimizer.pt        optimizer state (loaded with weights_only=True)
  scheduler.pt, scaler.pt, rng.pt
  trainer_state.json  step, tokens seen, the micro-batch split in use, the config
  manifest.json       every other file's size and SHA-256, the memfit and torch versions, the config

It is written to a temporary sibling directory, flushed, and renamed into place, so a
run killed at any moment leaves the last complete checkpoint intact; a write that fails
(a full disk) removes its temporary directory and raises CheckpointWriteError (exit 74).
Old checkpoints are pruned only once the new one is in place (retention.py); `--resume auto`
takes the newest checkpoint whose files match its manifest (manifest.py). `take_snapshot`
with `host_copy` and writer.BackgroundWriter let the write run while training goes on.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from memfit.checkpoint_files.manifest import MANIFEST, checkpoint_problem, write_manifest
from memfit.checkpoint_files.pretrained import save_pretrained
from memfit.checkpoint_files.retention import CHECKPOINT_DIR, list_checkpoints, prune_checkpoints
from memfit.errors import CheckpointWriteError, MemfitError, UsageError

__all__ = ["CHECKPOINT_DIR", "MANIFEST", "list_checkpoints", "prune_checkpoints", "checkpoint_problem"]

log = logging.getLogger("memfit")



@dataclass
class TrainerState:
    step: int
    """Optimizer steps completed."""
    tokens_seen: int = 0
    micro_batch_size: int | None = None
    """The micro-batch in use when saved (smaller than configured after an OOM split)."""
    extra: dict[str, Any] = field(default_factory=dict)


def trainable_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The weights a checkpoint must keep: all of them, or only the trainable ones with LoRA."""
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    frozen_exists = any(not p.requires_grad for p in model.parameters())
    state = model.state_dict()
    if frozen_exists:
        state = {name: tensor for name, tensor in state.items() if name in trainable}
    # safetensors refuses shared storage (tied embeddings): keep one name per storage.
    unique: dict[str, torch.Tensor] = {}
    seen: set[tuple[int, int]] = set()
    for name, tensor in state.items():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset())
        if key in seen:
            continue
        seen.add(key)
        unique[name] = tensor.detach().contiguous().cpu()
    return unique


def _fsync_dir(path: Path) -> None:
    try:
        descriptor = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def fsync_tree(path: Path) -> None:
    """Flush every file and directory under `path` to disk (before an atomic rename)."""
    for file in sorted(path.rglob("*")):
        if file.is_file():
            with open(file, "rb") as handle:
                os.fsync(handle.fileno())
    for directory in [path, *[p for p in path.rglob("*") if p.is_dir()]]:
        _fsync_dir(directory)


@dataclass
class Snapshot:
    """What one checkpoint holds, taken at a step boundary; `host_copy` ones own their tensors."""

    weights: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    scaler: dict[str, Any]
    rng: dict[str, Any]


def _host_copy(value: Any) -> Any:
    """`value` with every tensor copied to host memory (a new storage even when it is there already)."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, dict):
        return {key: _host_copy(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_host_copy(item) for item in value)
    return copy.deepcopy(value)


def take_snapshot(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any, scaler: Any, host_copy: bool = False
) -> Snapshot:
    """The state a checkpoint keeps; `host_copy` copies it so that training may go on while it is written."""
    snapshot = Snapshot(
        trainable_state_dict(model),
        optimizer.state_dict(),
        scheduler.state_dict() if scheduler is not None else {},
        scaler.state_dict() if scaler is not None else {},
        rng_state(),
    )
    if host_copy:
        # Field by field (dataclasses.astuple would deep-copy every tensor once more).
        snapshot = Snapshot(*(_host_copy(getattr(snapshot, f.name)) for f in dataclasses.fields(snapshot)))
    return snapshot


def snapshot_bytes(snapshot: Snapshot) -> int:
    """Bytes of the tensors in a snapshot (the host memory an asynchronous save holds)."""
    total = 0

    def visit(value: Any) -> None:
        nonlocal total
        if isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, (list, tuple)):
            for item in value:
                visit(item)

    for part in (snapshot.weights, snapshot.optimizer, snapshot.scheduler, snapshot.scaler, snapshot.rng):
        visit(part)
    return total


def save_checkpoint(
    output_dir: str | Path,
    state: TrainerState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: Any,
    config_dict: dict[str, Any],
    keep_last: int | None = None,
) -> Path:
    """Write a checkpoint atomically and return its directory; keeps the newest `keep_last` (0: all; default:
    the config's --save-total-limit)."""
    return write_snapshot(take_snapshot(model, optimizer, scheduler, scaler), output_dir, state, config_dict, keep_last)


def write_snapshot(
    snapshot: Snapshot, output_dir: str | Path, state: TrainerState, config_dict: dict[str, Any],
    keep_last: int | None = None,
) -> Path:
    """Write `snapshot` as checkpoint step-N, atomically; raises CheckpointWriteError when a file cannot be written."""
    root = Path(output_dir) / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{state.step}"
    temporary = root / f".tmp-step-{state.step}-{os.getpid()}"
    with writing_checkpoint(temporary, output_dir):
        shutil.rmtree(temporary, ignore_errors=True)
        temporary.mkdir()
        save_file(snapshot.weights, str(temporary / "model.safetensors"))
        torch.save(snapshot.optimizer, temporary / "optimizer.pt")
        torch.save(snapshot.scheduler, temporary / "scheduler.pt")
        torch.save(snapshot.scaler, temporary / "scaler.pt")
        torch.save(snapshot.rng, temporary / "rng.pt")
        publish_checkpoint(temporary, final, output_dir, state, config_dict, keep_last)
    return final


@contextlib.contextmanager
def writing_checkpoint(temporary: Path, output_dir: str | Path):
    """A write that fails (a full disk, a file-size limit) removes its temporary directory and says so in one line.

    The previous checkpoint was never touched: it stays the one `--resume auto` finds.
    """
    try:
        yield
    except MemfitError:
        raise
    except Exception as error:
        shutil.rmtree(temporary, ignore_errors=True)
        first = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
        try:
            free = f"{shutil.disk_usage(temporary.parent).free / 1024**3:.2f} GiB free"
        except OSError:
            free = "free space unknown"
        previous = list_checkpoints(output_dir)
        kept = f"the previous checkpoint {previous[-1].name} is intact" if previous else "no earlier checkpoint exists"
        raise CheckpointWriteError(
            f"could not write checkpoint {temporary.name.removeprefix('.tmp-').rsplit('-', 1)[0]} in {temporary.parent}"
            f" ({first}; {free}); {kept}; free space (or lower --save-total-limit) and run again with --resume auto"
        ) from None


def keep_last_of(config_dict: dict[str, Any]) -> int:
    """--save-total-limit of the config that writes a checkpoint (2 when the config does not say)."""
    return int(config_dict.get("output", {}).get("save_total_limit", 2))


def publish_checkpoint(
    temporary: Path, final: Path, output_dir: str | Path, state: TrainerState, config_dict: dict,
    keep_last: int | None = None, **meta: Any,
) -> None:
    """Write trainer_state.json and the manifest, flush, rename into place, then prune old checkpoints."""
    record = {
        "step": state.step,
        "tokens_seen": state.tokens_seen,
        "micro_batch_size": state.micro_batch_size,
        "extra": state.extra,
        **meta,
        "config": config_dict,
    }
    (temporary / "trainer_state.json").write_text(json.dumps(record, indent=2))
    write_manifest(temporary, config_dict)
    fsync_tree(temporary)
    if final.exists():
        shutil.rmtree(final)
    os.replace(temporary, final)
    _fsync_dir(final.parent)
    prune_checkpoints(output_dir, keep_last_of(config_dict) if keep_last is None else keep_last)  # only now: the new checkpoint is complete


def resolve_resume(resume: str | None, output_dir: str | Path) -> Path | None:
    """--resume auto -> the newest checkpoint whose files match its manifest (None: start fresh); a path -> that one.

    A damaged newest checkpoint is skipped with one line naming what is wrong; when every
    checkpoint is damaged, or the path given is, the run stops with a UsageError.
    """
    if resume is None:
        return None
    if resume == "auto":
        checkpoints = list_checkpoints(output_dir)
        problems = []
        for checkpoint in reversed(checkpoints):
            problem = checkpoint_problem(checkpoint)
            if problem is None:
                return checkpoint
            problems.append(f"{checkpoint.name}: {problem}")
            log.warning("memfit: checkpoint %s is damaged (%s); trying the one before it", checkpoint, problem)
        if problems:
            raise UsageError(
                f"every checkpoint in {Path(output_dir) / CHECKPOINT_DIR} is damaged ({'; '.join(problems)});"
                " delete them to start fresh, or restore a copy"
            )
        return None
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise UsageError(f"--resume {resume}: not a memfit checkpoint directory (no trainer_state.json); use --resume auto")
    problem = checkpoint_problem(path)
    if problem is not None:
        raise UsageError(f"checkpoint {path} is damaged ({problem}); resume from an earlier one, or use --resume auto")
    return path


def load_checkpoint(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: Any,
) -> TrainerState:
    """Restore everything saved by save_checkpoint; a damaged checkpoint is a UsageError."""
    try:
        meta = json.loads((path / "trainer_state.json").read_text())
        weights = load_file(str(path / "model.safetensors"))
        missing = set(trainable_state_dict(model)) - set(weights)
        if missing:
            raise ValueError(f"weights missing for {sorted(missing)[:3]}")
        model.load_state_dict(weights, strict=False)
        optimizer.load_state_dict(torch.load(path / "optimizer.pt", weights_only=True))
        if scheduler is not None:
            scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
        if scaler is not None:
            scaler_state = torch.load(path / "scaler.pt", weights_only=True)
            if scaler_state:
                scaler.load_state_dict(scaler_state)
        rng = torch.load(path / "rng.pt", weights_only=True)
    except Exception as error:  # any damage (truncated file, bad header, wrong shapes) means the same to the user
        first = str(error).splitlines()[0][:160] if str(error) else type(error).__name__
        raise UsageError(
            f"checkpoint {path} is damaged ({first}); delete it to resume from an earlier one, or start without --resume"
        ) from None
    restore_rng_state(rng)
    return trainer_state_from(meta)


def rng_state() -> dict[str, Any]:
    """The random number generators' state, saved so a resumed run draws the same numbers (dropout)."""
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def restore_rng_state(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def trainer_state_from(meta: dict[str, Any]) -> TrainerState:
    """The TrainerState recorded in a checkpoint's trainer_state.json."""
    return TrainerState(meta["step"], meta.get("tokens_seen", 0), meta.get("micro_batch_size"), meta.get("extra", {}))


def share_tied_tensors(model: torch.nn.Module, state_dict: dict) -> dict:
    """`state_dict` with every name of one tied parameter pointing at one tensor.

    A gathered state dict (FSDP2's full state dict on the CPU) holds a separate copy per name, so
    save_pretrained no longer sees the tie and writes a masked LM's decoder weight and bias beside
    the embedding and bias they are tied to: a file with other names than one process writes.
    """
    shared = dict(state_dict)
    first: dict[int, str] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        owner = first.setdefault(id(parameter), name)
        if owner != name and owner in shared and name in shared:
            shared[name] = shared[owner]
    return shared


def save_final_model(
    model: torch.nn.Module, tokenizer: Any, directory: str | Path, state_dict: dict | None = None
) -> Path:
    """Write the trained model (or the LoRA adapter) loadable with from_pretrained, atomically.

    `state_dict` replaces the model's own (a sharded model's gathered full weights).
    """
    directory = Path(directory)
    temporary = directory.with_name(f".tmp-{directory.name}-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    if state_dict is not None:
        state_dict = share_tied_tensors(model, state_dict)
    save_pretrained(model, temporary, state_dict=state_dict, safe_serialization=True)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(temporary)
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(temporary, directory)
    return directory
