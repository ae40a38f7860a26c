"""Synthetic run directories: what memfit train writes, made without training (fast, exact, any length).

A module of its own name, not conftest: another test directory's conftest may shadow that name on sys.path."""

from __future__ import annotations

import json
import math
from pathlib import Path

CATEGORIES = ("parameters", "gradients", "optimizer_states", "activations", "other")


def step_record(step: int, micro_batch: int = 8) -> dict:
    breakdown = {"parameters": 12_000_000, "gradients": 12_000_000, "optimizer_states": 24_000_000,
                 "activations": 20_000_000 * micro_batch, "other": 1_000_000}
    return {
        "step": step, "loss": 5.0 * math.exp(-step / 500) + 0.01 * math.sin(step), "lr": 1e-3 * (1 - step / 3000),
        "grad_norm": 2.0 + math.cos(step / 7), "tokens": 2048, "tokens_per_second": 1500.0 + 50 * math.sin(step / 3),
        "micro_batch_size": micro_batch, "gradient_accumulation_steps": 8 // micro_batch, "precision": "fp32",
        "optimizer": "adamw (fused)", "attention": "sdpa", "peak_memory_bytes": 700_000_000 + step * 1000,
        "rss_bytes": 690_000_000, "tracked_peak_bytes": sum(breakdown.values()), "tracked_breakdown": breakdown,
        "tracked_phase_peaks": {"forward": sum(breakdown.values()) - 5, "backward": sum(breakdown.values()),
                                "optimizer": 50_000_000},
    }


def start_record(resumed_from: str | None = None) -> dict:
    return {
        "event": "start", "model": "tiny", "device": "cpu", "world_size": 1, "precision": "fp32",
        "precision_reason": "auto: fp32 on CPU", "optimizer": "adamw (fused)", "attention": "sdpa",
        "gradient_checkpointing": "off", "loss_chunk_size": 0, "effective_batch_size": 8, "seq_len": 256,
        "fallbacks": {"optimizer": "adamw-8bit asked, bitsandbytes missing: adamw ran"}, "resumed_from": resumed_from,
    }


def memory_record(samples: int = 1000) -> dict:
    phases = [[0, "forward"], [samples // 2, "backward"], [samples - samples // 10, "optimizer"]]
    sizes = {name: [] for name in CATEGORIES}
    for index in range(samples):
        sizes["parameters"].append(12_000_000)
        sizes["gradients"].append(12_000_000 if index > samples // 2 else 0)
        sizes["optimizer_states"].append(24_000_000)
        sizes["activations"].append(int(160_000_000 * min(index, samples - index) / samples))
        sizes["other"].append(1_000_000)
    profile = {
        "device": "cpu", "steps": 3, "peak_bytes": 129_000_000,
        "breakdown": {"parameters": 12_000_000, "gradients": 12_000_000, "optimizer_states": 24_000_000,
                      "activations": 80_000_000, "other": 1_000_000},
        "phases": [], "peak_step": 1, "peak_phase": "backward",
        "top_modules": [{"module": f"model.layers.{i}.mlp", "activation_bytes": 9_000_000 - i} for i in range(10)],
        "top_tensors": [{"shape": [8, 256, 257], "dtype": "float32", "bytes": 2_105_344, "category": "activations",
                         "op": "aten.mm", "module": "lm_head", "phase": "forward"}] * 10,
        "advice": [{"technique": "gradient checkpointing", "flag": "--gradient-checkpointing full",
                    "saves_bytes": 60_000_000, "message": "activations are 62% of the peak: <b>checkpointing</b>"}],
        "leak": None,
    }
    return {
        "version": 1, "profile": profile, "peak_step": 2,
        "timeline": {"event_index": list(range(samples)), "phases": phases, "bytes": sizes, "step": 2,
                     "samples_recorded": samples * 3},
        "estimate": {"method": "analytical", "peak_bytes": 135_000_000, "error_band": 0.1, "peak_phase": "forward",
                     "breakdown": {"parameters": 12_000_000, "gradients": 0, "optimizer_states": 24_000_000,
                                   "activations": 95_000_000, "logits": 4_000_000, "other": 0},
                     "micro_batch_size": 8},
    }


def write_run(directory: Path, steps: int = 20, oom_at: tuple[int, ...] = (), resume_at: int | None = None,
              tracked: bool = True, mfu: float | None = None) -> Path:
    """A run directory: metrics.jsonl (start, steps, OOM events, an optional resume), summary, memory record."""
    directory.mkdir(parents=True, exist_ok=True)
    records = [start_record()]
    micro_batch = 8
    for step in range(1, steps + 1):
        if step in oom_at:
            records.append({"step": step, "event": "oom", "phase": "forward", "old_micro_batch_size": micro_batch,
                            "new_micro_batch_size": micro_batch // 2,
                            "message": f"out of memory in forward on a micro-batch of {micro_batch}"})
            micro_batch //= 2
        records.append(step_record(step, micro_batch) | ({"mfu": mfu, "hfu": mfu * 1.3} if mfu else {}))
        if resume_at is not None and step == resume_at + 2:  # killed two steps after the checkpoint
            records.append(start_record(resumed_from=str(directory / "checkpoints" / f"step-{resume_at}")))
            for again in range(resume_at + 1, step + 1):
                records.append(step_record(again, micro_batch) | {"loss": 9.0})  # later values win
    summary = {**start_record(), "event": "summary", "steps": steps, "wall_seconds": 12.5, "oom_events": len(oom_at)}
    if mfu:
        summary |= {"mfu": mfu, "measured_step_seconds": 1.25, "predicted_step_seconds": 1.5}
    records.append(summary)
    with open(directory / "metrics.jsonl", "w") as handle:
        for record in records:
            handle.write(json.dumps(record) + "\n")
        handle.write('{"step": 99999, "loss": ')  # a line cut short by a kill
    if tracked:
        (directory / "memory_timeline.json").write_text(json.dumps(memory_record()))
    return directory
