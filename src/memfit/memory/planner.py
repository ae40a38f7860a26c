"""Find the fastest training configuration that fits a GPU or a memory budget.

    from memfit import load_config, plan
    result = plan(load_config(overrides={"model": "llama-3.1-8b", "seq_len": 2048}), gpu="rtx-4090")
    print(result.command)

The search tries micro-batch sizes (powers of two, accumulation keeping the effective
batch), checkpointing off/selective/full, 8-bit AdamW, chunked loss and optimizer
offload, for full training, LoRA and QLoRA as `allow` permits. It keeps what the
analytical estimate puts under the budget with a 5 % margin and ranks it by estimated
tokens per second (see `estimated_step_seconds`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from memfit.config import TrainConfig
from memfit.errors import DoesNotFitError, UsageError
from memfit.gpus import GpuSpec, get_gpu
from memfit.memory.estimator import Estimate, estimate
from memfit.units import GIB

MARGIN = 0.05
"""Fraction of the budget kept free: the analytical estimate's error band is 10 %, usually less."""
UTILISATION = 0.45
"""Fraction of the GPU's peak rate a well-fed training step reaches."""
NOMINAL_TFLOPS = 100.0
"""Rate assumed without a GPU preset: only relative speeds are meaningful then."""
ALLOW = ("auto", "full", "lora", "qlora", "any")
DEFAULT_LORA_RANK = 16


@dataclass
class Candidate:
    changes: dict[str, Any]
    """Flat config changes (plan_to_overrides)."""
    estimate: Estimate
    step_seconds: float
    tokens_per_step: int

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_per_step / self.step_seconds


@dataclass
class PlanResult:
    """The best configuration found and the runners-up."""

    fits: bool
    plan: dict[str, Any]
    estimated_peak_bytes: int
    budget_bytes: int
    relative_speed: float
    command: str
    alternatives: list[dict[str, Any]] = field(default_factory=list)
    tokens_per_second: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "fits": self.fits,
            "plan": dict(self.plan),
            "estimated_peak_bytes": self.estimated_peak_bytes,
            "budget_bytes": self.budget_bytes,
            "relative_speed": self.relative_speed,
            "command": self.command,
            "alternatives": list(self.alternatives),
            "tokens_per_second": self.tokens_per_second,
        }


def plan_to_overrides(result: PlanResult) -> dict[str, Any]:
    """The flat config changes of the plan, for `TrainConfig.replace(**changes)`."""
    return dict(result.plan)


def estimated_step_seconds(changes: dict[str, Any], config: TrainConfig, est: Estimate, gpu: GpuSpec | None,
                           hf_config: Any) -> float:
    """Seconds of one optimizer step: FLOPs over the GPU's rate, plus offload transfers.

    Training FLOPs are 6 x parameters x tokens (4 x with LoRA: no weight-gradient
    matmuls) plus attention (12 x layers x hidden x seq per token, halved for causal
    masking), + 1/3 of the forward for full recompute, + 5 % for selective, + the
    head projection again with chunked loss, QLoRA dequantization +25 %; small
    micro-batches use the GPU less well.
    """
    from memfit.memory.activations import architecture_of

    arch = architecture_of(hf_config)
    seq = config.data.seq_len
    micro = changes.get("batch_size", config.training.batch_size)
    tokens = micro * seq * changes.get("gradient_accumulation_steps", 1)
    params = est.details["parameter_count"]
    lora = changes.get("lora_r", config.lora.lora_r) > 0
    per_token = (4 if lora else 6) * params + 6 * arch.layers * arch.hidden * seq
    forward = per_token / (2 if lora else 3)
    recompute = {"full": forward, "selective": 0.05 * forward}.get(changes.get("gradient_checkpointing", "off"), 0.0)
    chunked = 2 * arch.hidden * arch.vocab if changes.get("loss_chunk_size", 0) else 0
    flops = tokens * (per_token + recompute + chunked)
    if changes.get("quantize", "none") == "4bit":
        flops *= 1.25
    tflops = gpu.peak_tflops if gpu is not None else NOMINAL_TFLOPS
    feeding = micro * seq / (micro * seq + 512)  # small micro-batches leave the GPU idle
    seconds = flops / (tflops * 1e12 * UTILISATION * feeding)
    trainable = est.details["trainable_parameter_count"]
    if changes.get("optimizer", "adamw").endswith("8bit"):
        seconds *= 1.01
    if changes.get("optimizer_offload"):
        link = (gpu.host_link_gbps if gpu is not None else 16.0) * 1e9
        seconds += 8 * trainable / link + trainable / 2e9  # gradients down, weights up, CPU AdamW
    return seconds


def _modes(allow: str) -> list[str]:
    return {"full": ["full"], "lora": ["lora"], "qlora": ["qlora"], "any": ["full", "lora", "qlora"],
            "auto": ["full", "lora", "qlora"]}[allow]


def _mode_changes(mode: str, config: TrainConfig) -> dict[str, Any]:
    rank = config.lora.lora_r or DEFAULT_LORA_RANK
    if mode == "full":
        return {"lora_r": 0, "quantize": "none", "dtype": config.model.dtype}
    # A frozen base needs no fp32 master copy: store it in bf16.
    return {"lora_r": rank, "quantize": "4bit" if mode == "qlora" else "none", "dtype": "bf16"}


def _search(config, hf_config, budget, gpu, modes, effective, world_size, sharding) -> list[Candidate]:
    from memfit.techniques.loss import DEFAULT_LOSS_CHUNK_TOKENS

    micro_sizes = [2**k for k in range(0, int(math.log2(max(1, effective // world_size))) + 1)]
    precision = "auto" if gpu is not None else config.memory.precision
    offloads = [False, True] if gpu is not None else [False]
    found = []
    for mode in modes:
        for micro, checkpointing, optimizer, chunk, offload in itertools.product(
            micro_sizes, ("off", "selective", "full"), ("adamw", "adamw-8bit"), (0, DEFAULT_LOSS_CHUNK_TOKENS), offloads
        ):
            if (effective // world_size) % micro:
                continue
            changes = {
                "batch_size": micro, "gradient_accumulation_steps": effective // (micro * world_size),
                "gradient_checkpointing": checkpointing, "precision": precision, "optimizer": optimizer,
                "loss_chunk_size": chunk, "optimizer_offload": offload, **_mode_changes(mode, config),
            }
            candidate_config = config.replace(effective_batch_size=None, memory_budget=None, gpu=None, **changes)
            est = estimate(candidate_config, world_size=world_size, sharding=sharding, gpu=gpu,
                           budget_bytes=budget, hf_config=hf_config)
            seconds = estimated_step_seconds(changes, config, est, gpu, hf_config)
            tokens_per_step = candidate_config.effective_batch_for(world_size) * config.data.seq_len
            found.append(Candidate(changes, est, seconds, tokens_per_step))
    return found


def plan(
    config: TrainConfig,
    budget_bytes: int | None = None,
    gpu: GpuSpec | str | None = None,
    allow: str = "auto",
    effective_batch_size: int | None = None,
    world_size: int = 1,
    sharding: str = "none",
    hf_config: Any = None,
    explain: bool = True,
) -> PlanResult:
    """The fastest configuration of `config` whose estimated peak fits the budget.

    Args:
        budget_bytes: memory per device; default: the GPU's.
        gpu: GPU preset (name or GpuSpec): memory, bf16 support, speed.
        allow: full, lora, qlora, any, or auto (full if it fits, else LoRA, else QLoRA).
        effective_batch_size: samples per optimizer step; default: the config's.
        world_size, sharding: devices and how they share state (none/ddp/zero1-3/fsdp).
        explain: when nothing fits, work out what would (a wider --allow, more GPUs) for the message.

    Raises:
        DoesNotFitError: nothing fits; the message says how much is needed and what to try.
        UsageError: neither a budget nor a GPU, or a bad `allow`.
    """
    from memfit.models.presets import resolve_model_config

    if allow not in ALLOW:
        raise UsageError(f"--allow must be one of {', '.join(ALLOW)}, got {allow!r}")
    gpu_spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if gpu_spec is None and config.memory.gpu:
        gpu_spec = get_gpu(config.memory.gpu)
    budget = budget_bytes or config.memory.memory_budget or (gpu_spec.memory_bytes if gpu_spec else None)
    if budget is None:
        raise UsageError("memfit plan needs --gpu NAME or --memory-budget SIZE (e.g. --memory-budget 24GiB)")
    if hf_config is None:
        hf_config = resolve_model_config(config.model.model, config.model.trust_remote_code)
    effective = effective_batch_size or config.effective_batch_for(world_size)
    if world_size > 1 and sharding == "none":
        sharding = "fsdp"
    usable = budget * (1 - MARGIN)
    chosen: list[Candidate] = []
    everything: list[Candidate] = []
    for mode in _modes(allow):
        found = _search(config, hf_config, budget, gpu_spec, [mode], effective, world_size, sharding)
        everything += found
        fitting = [c for c in found if c.estimate.peak_bytes <= usable]
        chosen += fitting
        if allow == "auto" and fitting:
            break  # the least lossy mode that fits wins
    if not chosen:
        if not explain:
            raise DoesNotFitError("does not fit")
        raise DoesNotFitError(_does_not_fit_message(config, hf_config, budget, gpu_spec, allow, everything, effective))
    chosen.sort(key=lambda c: (-c.tokens_per_second, c.estimate.peak_bytes))
    best = chosen[0]
    alternatives = [_describe(c, best) for c in _distinct(chosen)[1:3]]
    return PlanResult(
        fits=True, plan=dict(best.changes), estimated_peak_bytes=best.estimate.peak_bytes, budget_bytes=int(budget),
        relative_speed=1.0, command=train_command(config, best.changes, gpu_spec, budget_bytes, world_size),
        alternatives=alternatives, tokens_per_second=best.tokens_per_second,
    )


def _distinct(candidates: list[Candidate]) -> list[Candidate]:
    """Drop runners-up that differ from a better one only by switches that change nothing shown."""
    seen, kept = set(), []
    for c in candidates:
        key = tuple(sorted((k, v) for k, v in c.changes.items() if k != "gradient_accumulation_steps"))
        if key not in seen:
            seen.add(key)
            kept.append(c)
    return kept


def _describe(candidate: Candidate, best: Candidate) -> dict[str, Any]:
    return {
        "plan": dict(candidate.changes),
        "estimated_peak_bytes": candidate.estimate.peak_bytes,
        "relative_speed": round(candidate.tokens_per_second / best.tokens_per_second, 3),
    }


def _does_not_fit_message(config, hf_config, budget, gpu, allow, everything, effective) -> str:
    smallest = min(everything, key=lambda c: c.estimate.peak_bytes)
    need = smallest.estimate.peak_bytes / (1 - MARGIN)
    hints = []
    if allow in ("full", "lora"):
        wider = "qlora" if allow == "lora" else "lora"
        try:
            plan(config, budget, gpu, allow="any" if allow == "full" else "qlora", effective_batch_size=effective, hf_config=hf_config, explain=False)
            hints.append(f"use --allow {wider if allow == 'full' else 'qlora'}")
        except DoesNotFitError:
            pass
    for ranks in (2, 4, 8):
        try:
            plan(config, budget, gpu, allow=allow, effective_batch_size=max(effective, ranks), world_size=ranks,
                 sharding="fsdp", hf_config=hf_config, explain=False)
            hints.append(f"{ranks} GPUs with --sharding fsdp (or --zero-stage 3)")
            break
        except DoesNotFitError:
            continue
    hint = ": " + " or ".join(hints) if hints else ": use a smaller model, a shorter --seq-len or a larger GPU"
    return (f"needs {need / GIB:.1f} GiB with everything on; {budget / GIB:.1f} GiB available{hint}")


def train_command(config: TrainConfig, changes: dict[str, Any], gpu: GpuSpec | None, budget: int | None,
                  world_size: int = 1) -> str:
    """The `memfit train ...` command line that runs the plan."""
    parts = ["memfit", "train", "--model", config.model.model, "--seq-len", str(config.data.seq_len)]
    if config.data.dataset:
        parts += ["--dataset", config.data.dataset]
    defaults = TrainConfig().flat()
    for name, value in changes.items():
        if name in ("lora_r", "quantize", "dtype") and value == defaults.get(name):
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            if value:
                parts.append(flag)
            continue
        parts += [flag, str(value)]
    if world_size > 1:
        return f"torchrun --nproc-per-node {world_size} -m " + " ".join(parts) + " --sharding fsdp"
    return " ".join(parts)
