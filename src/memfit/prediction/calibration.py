"""The speed model corrected by what this device measured: trials and finished runs teach it.

`memfit.prediction.speed_model.estimated_step_seconds` predicts a step from FLOPs and constants
measured on one CPU; a ranking that is right there can be wrong on the next machine. Every
measured step time on this device (a trial of `memfit.train.trials`, or a planned run's median
step) is stored as one point: the configuration's features and log(measured / predicted). A
ridge regression over those points gives one correction per term (the device's rate, the
micro-batch's tokens per dtype, checkpointing, the chunked loss, the optimizer, offload,
compile), and `correction` multiplies the model's seconds by exp(w . features) for this device.

Where it lives: one JSON file, `<cache>/speed.json`, with the cache directory `$MEMFIT_CACHE_DIR`
or `~/.cache/memfit` (trials' measured times are in the same file). Deleting the file forgets
everything; `MEMFIT_CACHE_DIR=/some/dir` keeps a separate one.

A device is its CPU model and instruction-set flags (or GPU name), torch's version and thread
count and the ISA caps a user can set (`ONEDNN_MAX_CPU_ISA`, `ATEN_CPU_CAPABILITY`): a
calibration from one never ranks for another.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any

CACHE_ENV = "MEMFIT_CACHE_DIR"
CACHE_FILE = "speed.json"
MAX_POINTS = 200
"""Points kept per device (the newest): enough for every term, few enough to follow a changed machine."""
RIDGE = 0.05
"""Pull of each term's correction toward 0 (no correction), in squared log units: with two or three
points a term moves only as far as the points ask, and an unmeasured term stays at the model's value."""
FEATURES = ("rate", "tokens", "bf16", "bf16_tokens", "selective", "full", "chunked", "opt_8bit", "opt_small",
            "in_backward", "offload", "compile")
"""What each correction multiplies: rate (1 everywhere: the device's speed against the model's nominal rate),
tokens (log2 of tokens per micro-batch / 512: the feeding of the matmuls), bf16 and bf16_tokens (the same for
bf16 compute), the checkpointing mode, the chunked loss, the optimizer family, offload and --compile."""
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")


def cache_dir() -> Path:
    """`$MEMFIT_CACHE_DIR`, else `~/.cache/memfit`."""
    given = os.environ.get(CACHE_ENV)
    return Path(given) if given else Path.home() / ".cache" / "memfit"


def cache_path() -> Path:
    return cache_dir() / CACHE_FILE


def cpu_flags() -> set[str]:
    """The instruction-set flags of this CPU (/proc/cpuinfo; empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine()


def native_bf16(device: str = "cpu") -> bool:
    """Whether `device` runs bf16 matmuls natively: CUDA (the caller checks the card), or a CPU with
    AVX-512 bf16 or AMX whose oneDNN is not capped below them by ONEDNN_MAX_CPU_ISA."""
    if device == "cuda":
        return True
    if not cpu_flags() & set(BF16_CPU_FLAGS):
        return False
    cap = os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper()
    return not cap or cap == "ALL" or "BF16" in cap or "AMX" in cap


def device_key(device: str = "cpu") -> str:
    """What makes step times comparable: the processor, its ISA, torch and its threads."""
    import torch

    if device == "cuda" and torch.cuda.is_available():
        where = f"cuda:{torch.cuda.get_device_name()}"
    else:
        flags = cpu_flags()
        isa = ",".join(sorted(f for f in flags if f.startswith(("avx", "amx")) or f in ("fma", "f16c")))
        where = f"cpu:{_cpu_model()}|{isa}|threads={torch.get_num_threads()}"
    caps = ",".join(f"{name}={os.environ[name]}" for name in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")
                    if os.environ.get(name))
    return f"{where}|torch={torch.__version__}|{caps or 'default isa'}"


def features(changes: dict[str, Any], config: Any, compute: str) -> dict[str, float]:
    """The features of one configuration (the planner's flat changes over `config`) computing in
    `compute` ('bf16' or 'fp32': `memfit.prediction.speed_model.compute_dtype`)."""
    from memfit.models.optimizer_state import SMALL_STATE_OPTIMIZERS

    seq = changes.get("seq_len", config.data.seq_len_or_default)
    micro = changes.get("batch_size", config.training.batch_size)
    tokens = math.log2(max(1, micro * seq) / 512)
    bf16 = 1.0 if compute == "bf16" else 0.0
    checkpointing = changes.get("gradient_checkpointing", config.memory.gradient_checkpointing)
    optimizer = changes.get("optimizer", config.optimizer.optimizer)
    return {
        "rate": 1.0, "tokens": tokens, "bf16": bf16, "bf16_tokens": bf16 * tokens,
        "selective": float(checkpointing == "selective"), "full": float(checkpointing == "full"),
        "chunked": float(bool(changes.get("loss_chunk_size", config.memory.loss_chunk_size))),
        "opt_8bit": float(optimizer.endswith("8bit")), "opt_small": float(optimizer in SMALL_STATE_OPTIMIZERS),
        "in_backward": float(bool(changes.get("optimizer_in_backward", config.memory.optimizer_in_backward))),
        "offload": float(bool(changes.get("activation_offload", config.memory.activation_offload)
                              or changes.get("optimizer_offload", config.memory.optimizer_offload))),
        "compile": float(bool(changes.get("compile", config.memory.compile))),
    }


# -- the cache file ------------------------------------------------------------------------------

def read_cache() -> dict[str, Any]:
    """The cache's contents ({} when absent or unreadable: a damaged cache costs trials, never a run)."""
    try:
        data = json.loads(cache_path().read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def update_cache(change) -> None:
    """Apply `change(data)` to the cache and write it atomically (a reader sees the old file or the new)."""
    path = cache_path()
    data = read_cache()
    change(data)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=path.parent, prefix=".speed-", suffix=".json")
        with os.fdopen(handle, "w") as out:
            json.dump(data, out)
        os.replace(temporary, path)
    except OSError:  # a read-only home: no cache, the next run measures again
        with contextlib.suppress(OSError, UnboundLocalError):
            os.unlink(temporary)


def record_points(device: str, points: list[tuple[dict[str, float], float, float]], source: str) -> None:
    """Store measured step times: (features, uncalibrated predicted seconds, measured seconds) each."""
    key = device_key(device)

    def change(data: dict[str, Any]) -> None:
        kept = data.setdefault("calibration", {}).setdefault(key, {}).setdefault("points", [])
        for feats, predicted, measured in points:
            if predicted > 0 and measured > 0:
                kept.append({"features": feats, "log_ratio": math.log(measured / predicted), "source": source,
                             "time": round(time.time())})
        del kept[:-MAX_POINTS]

    update_cache(change)


def record_compile(device: str, compile_seconds: float, gain: float | None) -> None:
    """A compiled run's first-step compile time (and its measured gain over eager, where known)."""
    key = device_key(device)

    def change(data: dict[str, Any]) -> None:
        entry = data.setdefault("calibration", {}).setdefault(key, {})
        entry["compile_seconds"] = compile_seconds
        if gain:
            entry["compile_gain"] = gain

    update_cache(change)


# -- the fit -----------------------------------------------------------------------------------

def fit(points: list[dict[str, Any]]) -> dict[str, float]:
    """Ridge regression of log(measured / predicted) on the features; `rate` is not pulled toward 0."""
    import torch

    if not points:
        return {}
    rows = torch.tensor([[p["features"].get(name, 0.0) for name in FEATURES] for p in points], dtype=torch.float64)
    targets = torch.tensor([p["log_ratio"] for p in points], dtype=torch.float64)
    penalty = torch.full((len(FEATURES),), RIDGE * len(points) ** 0.5, dtype=torch.float64)
    penalty[0] = 1e-9
    gram = rows.T @ rows + torch.diag(penalty)
    weights = torch.linalg.solve(gram, rows.T @ targets)
    return {name: float(w) for name, w in zip(FEATURES, weights, strict=True) if abs(float(w)) > 1e-12}


_FITTED: dict[tuple[str, float], dict[str, float]] = {}


def weights_for(device: str) -> dict[str, float]:
    """This device's fitted corrections ({} when nothing was measured here); cached per file change."""
    path = cache_path()
    try:
        stamp = path.stat().st_mtime
    except OSError:
        return {}
    memo = (f"{path}|{device_key(device)}", stamp)
    if memo not in _FITTED:
        entry = read_cache().get("calibration", {}).get(device_key(device), {})
        _FITTED.clear()
        _FITTED[memo] = fit(entry.get("points", []))
    return _FITTED[memo]


def correction(changes: dict[str, Any], config: Any, device: str, compute: str) -> float:
    """What the model's seconds are multiplied by on this device (1.0 without measurements)."""
    weights = weights_for(device)
    if not weights:
        return 1.0
    feats = features(changes, config, compute)
    exponent = sum(weights.get(name, 0.0) * value for name, value in feats.items())
    return math.exp(max(-30.0, min(30.0, exponent)))


def calibrated(device: str) -> bool:
    return bool(weights_for(device))


def compile_facts(device: str) -> dict[str, float]:
    """What this device measured of --compile: compile_seconds, compile_gain ({} when never run here)."""
    entry = read_cache().get("calibration", {}).get(device_key(device), {})
    return {k: entry[k] for k in ("compile_seconds", "compile_gain") if k in entry}



def compile_measured(device: str) -> tuple[float, float | None, float] | None:
    """What this device measured of --compile: (compile seconds of a compiled run's first step, its gain
    over eager where measured, the correction of the model's compiled steps `exp(w_compile)`), and the
    rate correction `exp(w_rate)`; None when no compiled run was measured here."""
    facts = compile_facts(device)
    weights = weights_for(device)
    if "compile_seconds" not in facts or "rate" not in weights:
        return None
    return (facts["compile_seconds"], facts.get("compile_gain"), math.exp(weights.get("compile", 0.0)),
            math.exp(weights["rate"]))
