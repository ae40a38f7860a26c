"""Resuming with a different shape: what may change, and what would make it another run.

The samples of a step depend only on the seed and the effective batch (data/schedule.py),
and the update is the mean over the effective batch whatever its split, so a resume may
use another --batch-size x --gradient-accumulation-steps split or another number of ranks
and still continue the same run exactly. What changes the run itself (the effective batch,
the data's content or order, the model or its trainable shapes) is refused in one line,
unless --resume-allow-changes, which goes on and says what changed (log and metrics).

Each checkpoint records the identity of its run in trainer_state.json's "extra.run".
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

import torch

from memfit.errors import UsageError

log = logging.getLogger("memfit")

_SAMPLES_HASHED = 64


def _dataset_fingerprint(dataset: Any) -> str:
    """A digest of the samples' count and of up to 64 samples spread over the dataset (cheap for any size):
    every numeric field of a sample (tokens, labels, masks)."""
    count = len(dataset)
    digest = hashlib.sha256(str(count).encode())
    stride = max(1, count // _SAMPLES_HASHED)
    for index in range(0, count, stride):
        sample = dataset[index]
        for key in sorted(sample):  # the tokens, and the labels or masks where the task has them
            try:
                values = torch.as_tensor(sample[key])
            except (TypeError, ValueError, RuntimeError):
                continue
            digest.update(key.encode() + values.to(torch.float64).cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def _model_fingerprint(model: torch.nn.Module) -> str:
    """Names, shapes and trainability of the parameters: a different model or adapter shows here."""
    digest = hashlib.sha256()
    for name, parameter in model.named_parameters():
        digest.update(f"{name}:{tuple(parameter.shape)}:{parameter.requires_grad};".encode())
    return digest.hexdigest()[:16]


def run_identity(session: Any) -> dict[str, Any]:
    """What a resumed run must share with the run that wrote the checkpoint."""
    config = session.config
    return {
        "effective_batch_size": session.effective_batch_size,
        "seed": config.training.seed,
        "seq_len": config.data.seq_len,
        "samples": len(session.dataset),
        "data": _dataset_fingerprint(session.dataset),
        "model": config.model.model,
        "parameters": _model_fingerprint(session.model),
        "world_size": session.dist.world_size,
        "micro_batch_size": config.training.batch_size,
    }


_WHAT = {
    "effective_batch_size": "effective batch",
    "seed": "seed (the data order)",
    "seq_len": "sequence length",
    "samples": "number of samples",
    "data": "data content",
    "model": "model",
    "parameters": "parameter names or shapes",
}
"""Changes that make another run; the micro-batch split and the number of ranks are not among them."""


def check_resume(session: Any, checkpoint: Path) -> dict[str, Any]:
    """Compare the checkpoint's run with this one; UsageError for a change unless --resume-allow-changes.

    Returns this run's identity (to record in the checkpoints it writes).
    """
    identity = run_identity(session)
    try:
        saved = json.loads((checkpoint / "trainer_state.json").read_text()).get("extra", {}).get("run")
    except (OSError, ValueError):
        saved = None
    if not saved:
        return identity  # written before checkpoints recorded their run: nothing to compare
    changes = [f"{_WHAT[key]} {saved[key]} -> {identity[key]}" for key in _WHAT
               if key in saved and saved[key] != identity[key]]
    reshaped = [f"{name} {saved[name]} -> {identity[name]}" for name in ("world_size", "micro_batch_size")
                if name in saved and saved[name] != identity[name]]
    if reshaped and session.dist.is_main:
        log.info("memfit: resuming with %s: the same samples and update per step", ", ".join(reshaped))
    if not changes:
        return identity
    said = "; ".join(changes)
    if not session.config.output.resume_allow_changes:
        raise UsageError(
            f"resuming {checkpoint.name} would change the run ({said}); resume with the settings that wrote it,"
            " or add --resume-allow-changes to go on with the change"
        )
    session.fallbacks["resume_changes"] = f"resumed {checkpoint.name} with changes (--resume-allow-changes): {said}"
    if session.dist.is_main:
        log.warning("memfit: --resume-allow-changes: %s", said)
    return identity
