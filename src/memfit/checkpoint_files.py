"""The files of a run: resumable checkpoints, written atomically, and the final model.

Every engine (memfit.train.engine, memfit.distributed) writes through these functions,
so this module sits below both.

A checkpoint directory `<output-dir>/checkpoints/step-N/` holds:
  model.safetensors   the trainable weights (the adapter only, with LoRA)
  optimizer.pt        optimizer state (loaded with weights_only=True)
  scheduler.pt, scaler.pt, rng.pt
  trainer_state.json  step, tokens seen, the micro-batch split in use, the config

It is written to a temporary sibling directory, flushed, and renamed into place, so a
run killed at any moment leaves the last complete checkpoint intact.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from memfit.errors import UsageError

CHECKPOINT_DIR = "checkpoints"
_STEP_PATTERN = re.compile(r"^step-(\d+)$")


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


def save_checkpoint(
    output_dir: str | Path,
    state: TrainerState,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    scaler: Any,
    config_dict: dict[str, Any],
    keep_last: int = 2,
) -> Path:
    """Write a checkpoint atomically and return its directory; keeps the newest `keep_last`."""
    root = Path(output_dir) / CHECKPOINT_DIR
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step-{state.step}"
    temporary = root / f".tmp-step-{state.step}-{os.getpid()}"
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir()
    save_file(trainable_state_dict(model), str(temporary / "model.safetensors"))
    torch.save(optimizer.state_dict(), temporary / "optimizer.pt")
    torch.save(scheduler.state_dict() if scheduler is not None else {}, temporary / "scheduler.pt")
    torch.save(scaler.state_dict() if scaler is not None else {}, temporary / "scaler.pt")
    torch.save(rng_state(), temporary / "rng.pt")
    publish_checkpoint(temporary, final, output_dir, state, config_dict, keep_last)
    return final


def publish_checkpoint(
    temporary: Path, final: Path, output_dir: str | Path, state: TrainerState, config_dict: dict, keep_last: int, **meta: Any
) -> None:
    """Write trainer_state.json (the mark of a complete checkpoint), flush, rename into place, prune old ones."""
    record = {
        "step": state.step,
        "tokens_seen": state.tokens_seen,
        "micro_batch_size": state.micro_batch_size,
        "extra": state.extra,
        **meta,
        "config": config_dict,
    }
    (temporary / "trainer_state.json").write_text(json.dumps(record, indent=2))
    fsync_tree(temporary)
    if final.exists():
        shutil.rmtree(final)
    os.replace(temporary, final)
    _fsync_dir(final.parent)
    for old in list_checkpoints(output_dir)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary directories are not complete)."""
    root = Path(output_dir) / CHECKPOINT_DIR
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _STEP_PATTERN.match(path.name)
        if match and (path / "trainer_state.json").is_file():
            found.append((int(match.group(1)), path))
    return [path for _, path in sorted(found)]


def resolve_resume(resume: str | None, output_dir: str | Path) -> Path | None:
    """--resume auto -> latest checkpoint (or None: start fresh); a path -> that checkpoint."""
    if resume is None:
        return None
    if resume == "auto":
        checkpoints = list_checkpoints(output_dir)
        return checkpoints[-1] if checkpoints else None
    path = Path(resume)
    if not (path / "trainer_state.json").is_file():
        raise UsageError(f"--resume {resume}: not a memfit checkpoint directory (no trainer_state.json); use --resume auto")
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


def save_final_model(
    model: torch.nn.Module, tokenizer: Any, directory: str | Path, state_dict: dict | None = None
) -> Path:
    """Write the trained model (or the LoRA adapter) loadable with from_pretrained, atomically.

    `state_dict` replaces the model's own (a sharded model's gathered full weights).
    """
    directory = Path(directory)
    temporary = directory.with_name(f".tmp-{directory.name}-{os.getpid()}")
    shutil.rmtree(temporary, ignore_errors=True)
    model.save_pretrained(temporary, state_dict=state_dict, safe_serialization=True)
    if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(temporary)
    if directory.exists():
        shutil.rmtree(directory)
    os.replace(temporary, directory)
    return directory
