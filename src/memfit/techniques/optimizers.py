"""Optimizers and learning-rate schedules, with a visible fallback chain for 8-bit AdamW.

8-bit AdamW keeps its two moments in 8 bits (about 2 bytes per parameter instead of 8).
It comes from bitsandbytes; when bitsandbytes is missing or fails, memfit falls back to
torchao's 8-bit AdamW, then to torch AdamW, says so once with the memory difference, and
records what really ran in the metrics.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from memfit.config import OptimizerConfig
from memfit.units import format_bytes

log = logging.getLogger("memfit")


@dataclass
class OptimizerChoice:
    optimizer: torch.optim.Optimizer
    name: str
    """What really runs: adamw (fused/foreach/for-loop), adamw-8bit (bitsandbytes/torchao), ..."""
    reason: str
    """Why it differs from the request ('' when it does not)."""


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Decay matrices only: biases and norm weights (1-D) are not decayed, as usual."""
    decay, no_decay = [], []
    for parameter in model.parameters():
        if parameter.requires_grad:
            (decay if parameter.ndim >= 2 else no_decay).append(parameter)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _impl_kwargs(impl: str, device: torch.device) -> tuple[dict, str]:
    if impl == "auto":
        # The fused kernel exists for CUDA and (since torch 2.4) CPU: fastest, no temporaries.
        return {"fused": True}, "fused"
    return {"fused": impl == "fused", "foreach": impl == "foreach"} if impl != "for-loop" else {
        "fused": False,
        "foreach": False,
    }, impl


def holds_sharded_parameters(groups: list[dict]) -> bool:
    """True when FSDP2 has sharded the parameters (DTensors): some kernels have no DTensor version."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch built without distributed support shards nothing
        return False
    return any(isinstance(p, DTensor) for group in groups for p in group["params"])


def refusal_under_fsdp(optimizer: str) -> str | None:
    """Why `optimizer` cannot update FSDP2-sharded parameters, checked before anything runs (None: it can)."""
    if optimizer == "adafactor":
        return (
            "--optimizer adafactor cannot run under --sharding fsdp (torch's Adafactor has no DTensor version of its"
            " factored second moment); use --optimizer adamw-8bit for small optimizer state, or --sharding ddp"
        )
    from memfit.models.optimizer_state import refusal_under_sharding

    return refusal_under_sharding(optimizer, fsdp=True)


def build_optimizer(
    groups: list[dict], config: OptimizerConfig, device: torch.device, impl: str | None = None
) -> OptimizerChoice:
    """Create the configured optimizer over parameter `groups` (see parameter_groups)."""
    impl = impl or config.optimizer_impl
    name = config.optimizer
    sharded = holds_sharded_parameters(groups)
    betas = (config.beta1, config.beta2)
    if name == "adamw":
        kwargs, impl_name = _impl_kwargs(impl, device)
        return OptimizerChoice(
            torch.optim.AdamW(groups, lr=config.lr, betas=betas, eps=config.eps, **kwargs), f"adamw ({impl_name})", ""
        )
    if name == "sgd":
        reason = ""
        if sharded and impl in ("auto", "fused"):
            # aten._fused_sgd_ has no DTensor sharding strategy; the foreach kernel runs on shards.
            if impl == "fused":  # asked for by name: say what ran instead
                reason = "fused SGD cannot update FSDP2-sharded parameters; foreach SGD ran"
                log.warning("memfit: %s", reason)
            impl = "foreach"
        kwargs, impl_name = _impl_kwargs(impl, device)
        return OptimizerChoice(
            torch.optim.SGD(groups, lr=config.lr, momentum=config.momentum, **kwargs), f"sgd ({impl_name})", reason
        )
    if name == "adafactor":
        optimizer = torch.optim.Adafactor(groups, lr=config.lr, eps=(None, 1e-3), beta2_decay=-0.8)
        return OptimizerChoice(optimizer, "adafactor", "")
    return _build_8bit(groups, config, device, paged=name == "paged-adamw-8bit", sharded=sharded)


def _build_8bit(
    groups: list[dict], config: OptimizerConfig, device: torch.device, paged: bool, sharded: bool = False
) -> OptimizerChoice:
    betas = (config.beta1, config.beta2)
    failures = []
    try:
        if sharded:
            # Its kernels take plain tensors, not the DTensor shards of FSDP2.
            raise RuntimeError("cannot update FSDP2-sharded (DTensor) parameters")
        import bitsandbytes as bnb

        cls = bnb.optim.PagedAdamW8bit if paged and device.type == "cuda" else bnb.optim.AdamW8bit
        optimizer = cls(groups, lr=config.lr, betas=betas, eps=config.eps)
        why = "paged optimizers need CUDA; using unpaged AdamW8bit" if paged and device.type != "cuda" else ""
        if why:
            _warn_once("paged", "memfit: %s", why)
        return OptimizerChoice(optimizer, f"{'paged-' if cls.__name__.startswith('Paged') else ''}adamw-8bit (bitsandbytes)", why)
    except Exception as error:  # ImportError, or a bitsandbytes build that cannot run here
        failures.append(f"bitsandbytes: {str(error).splitlines()[0][:120] if str(error) else type(error).__name__}")
    try:
        if sharded:
            # torchao 0.18's compiled step fails on DTensor shards ('Tensor' object has no attribute 'codes').
            raise RuntimeError("its compiled step cannot update FSDP2-sharded (DTensor) parameters")
        from torchao.optim import AdamW8bit

        optimizer = AdamW8bit(groups, lr=config.lr, betas=betas, eps=config.eps)
        reason = "; ".join(failures) + " -> torchao AdamW8bit"
        _warn_once("torchao", "memfit: 8-bit AdamW from torchao (%s)", reason)
        return OptimizerChoice(optimizer, "adamw-8bit (torchao)", reason)
    except Exception as error:
        failures.append(f"torchao: {str(error).splitlines()[0][:120] if str(error) else type(error).__name__}")
    num_params = sum(p.numel() for group in groups for p in group["params"])
    extra = format_bytes(num_params * 6)  # 8 bytes/param of fp32 moments instead of about 2
    reason = "; ".join(failures) + f" -> torch AdamW (uses about {extra} more optimizer memory)"
    advice = "FSDP2 already shards the optimizer state over ranks" if sharded else "install with: pip install memfit[bnb]"
    _warn_once("torch", "memfit: no 8-bit AdamW available (%s); %s", reason, advice)
    kwargs, impl_name = _impl_kwargs(config.optimizer_impl, device)
    return OptimizerChoice(
        torch.optim.AdamW(groups, lr=config.lr, betas=betas, eps=config.eps, **kwargs), f"adamw ({impl_name})", reason
    )


_warned: set[str] = set()


def _warn_once(key: str, message: str, *args) -> None:
    """Log a fallback once per process: with the step in backward, an optimizer is built per parameter."""
    if key not in _warned:
        _warned.add(key)
        log.warning(message, *args)


def lr_multiplier(step: int, total_steps: int, warmup_steps: int, schedule: str, min_ratio: float = 0.1) -> float:
    """Learning-rate factor at optimizer step `step` (0-based): linear warmup, then decay to min_ratio."""
    if warmup_steps and step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(
    optimizer: torch.optim.Optimizer, config: OptimizerConfig, total_steps: int
) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_multiplier(step, total_steps, config.warmup_steps, config.lr_schedule)
    )


def measured_optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes held now in a live optimizer's state tensors (each storage counted once)."""
    seen, total = set(), 0
    for state in optimizer.state.values():
        for value in _tensors(state.values()):
            key = value.untyped_storage().data_ptr()
            if key not in seen:
                seen.add(key)
                total += value.untyped_storage().nbytes()
    return total


def _tensors(values: Iterable) -> Iterable[torch.Tensor]:
    for value in values:
        if isinstance(value, torch.Tensor) and hasattr(value, "__tensor_flatten__"):
            # a quantized state (torchao's 4-bit moments): its codes, scales and code book hold the bytes
            names, _ = value.__tensor_flatten__()
            yield from _tensors(getattr(value, name) for name in names)
        elif isinstance(value, torch.Tensor):
            yield value


def _resolve(facts, run) -> dict:
    optimizer = facts.config.optimizer.optimizer
    return {"optimizer": optimizer, "optimizer_impl": facts.config.optimizer.optimizer_impl,
            "paged_optimizer": optimizer == "paged-adamw-8bit" and facts.device_type == "cuda"}


def _refusals(run, facts) -> list[str]:
    """Optimizers whose state or step cannot follow sharded parameters."""
    if "fsdp" in facts.engine:
        refusal = refusal_under_fsdp(run.optimizer)
    elif facts.engine == "DeepSpeed":
        from memfit.models.optimizer_state import refusal_under_sharding

        refusal = refusal_under_sharding(run.optimizer)
    else:
        refusal = None
    return [refusal] if refusal else []


def _paged_memory_terms(run, facts) -> dict[str, float]:
    """Paged 8-bit AdamW: the driver brings the state of the tensor being stepped onto the device."""
    if not run.paged_optimizer:
        return {}
    parts = facts.parts
    return {"other": parts["optimizer_states_full"] * parts["largest_trainable"] / max(1, parts["trainable_count"])}


def _paged_speed_terms(run, facts) -> float:
    """Paged 8-bit AdamW: the state's pages come in for the step and go out again for the next forward."""
    if not run.paged_optimizer:
        return 0.0
    return 2 * facts.host_optimizer_state_bytes / facts.link_bytes_per_second


def _technique():
    from memfit.techniques.technique import Technique

    return Technique(
        name="optimizer", stage="optimizer", settings=("optimizer", "optimizer_impl"), resolve=_resolve,
        refusals=_refusals,
        memory_terms=_paged_memory_terms, speed_terms=_paged_speed_terms, report=lambda run: {"optimizer": run.optimizer},
        summary="8-bit, paged and small-state optimizers keep less state per trained parameter than AdamW's 8 bytes",
    )


TECHNIQUE = _technique()
