"""The engine: where a step's backward, gradient reduction and update run, and how a run is saved.

The step runner (step.py) decides what one optimizer step computes: which samples go
into which micro-batch, the loss of each, OOM recovery. The engine decides where it
runs. The loop calls the same methods whatever the engine:

    optimizer = engine.prepare(model, build_optimizer)      # shard, wrap, build the optimizer
    normalizer = engine.loss_normalizer(target_tokens)      # per step
    engine.backward(loss, last_micro_batch)                 # per micro-batch
    engine.reduce_gradients()                               # once, after the last micro-batch
    grad_norm = engine.clip_and_step()                      # once; the norm stays on the device
    engine.save_checkpoint(...); engine.load_checkpoint(...); engine.save_final_model(...)
    record |= engine.step_metrics(record); summary |= engine.summary_metrics(summary)

Engines:
    SingleProcessEngine            this module: one process (the default)
    DataParallelEngine             memfit.distributed.parallel: --sharding ddp, each rank a SingleProcessEngine
    FullyShardedEngine             memfit.distributed.fsdp: --sharding fsdp (FSDP2)
    DeepSpeedEngine                memfit.distributed.zero: --deepspeed FILE / --zero-stage N

`Engine` is a Protocol: the engines of memfit.distributed satisfy it by their methods,
without importing this package (distributed/ sits below train/). The multi-rank
engines that run the local step like one process (DDP, FSDP2) are handed a
SingleProcessEngine by `choose_engine` and delegate to it.

To add an engine: write a class with these attributes and methods (in distributed/
when it spans ranks), and pick it in `choose_engine`.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import torch

from memfit.checkpoint_files import (
    TrainerState,
    load_checkpoint,
    save_checkpoint,
    save_final_model,
    take_snapshot,
    write_snapshot,
)
from memfit.config import TrainConfig
from memfit.distributed.context import DistContext
from memfit.techniques.optimizers import OptimizerChoice
from memfit.techniques.precision import PrecisionChoice, make_grad_scaler
from memfit.techniques.resolved_run import ResolvedRun

OptimizerBuilder = Callable[[torch.nn.Module], OptimizerChoice]
"""Builds the optimizer over a (possibly sharded) model's trainable parameters."""


class Engine(Protocol):
    """What the loop and the step runner ask of an engine (see the module docstring)."""

    name: str
    """Short name for the metrics: single, ddp, fsdp, deepspeed."""
    recovers_from_oom: bool
    """A rank can split and redo a micro-batch on its own: no collective runs in the middle of a pass."""
    scaler: torch.amp.GradScaler | None
    """fp16 loss scaling run by memfit (None when off, or when the engine scales by itself)."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    """The torch optimizer that steps (inside the engine's wrapper, if any); set by `prepare`."""

    def describe(self) -> str:
        """One line for the log and the metrics."""
        ...

    def prepare(self, model: torch.nn.Module, build_optimizer: OptimizerBuilder) -> OptimizerChoice:
        """Shard or wrap `model` in place, then build the optimizer over it; returns what runs."""
        ...

    def loss_normalizer(self, target_tokens: int) -> float:
        """What a micro-batch's summed token loss is divided by, so the reduced gradient is the
        mean over every target token of the global batch (the single-process gradient)."""
        ...

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        """Backward of one micro-batch's normalized loss; gradients accumulate."""
        ...

    def reduce_gradients(self) -> None:
        """Bring the accumulated gradients of every rank together (after the last micro-batch)."""
        ...

    def agree_after_micro_batches(self, micro_batch_size: int, events: list[dict]) -> tuple[int, list[dict]]:
        """Ranks agree on one micro-batch size after an OOM split and share their events."""
        ...

    def clip_and_step(self) -> torch.Tensor | float | None:
        """Clip the gradients to --max-grad-norm, step the optimizer, zero the gradients.

        Returns the gradient norm before clipping, left on the device (None without
        gradients or without a norm, as under --optimizer-in-backward).
        """
        ...

    def use_per_parameter_kernels(self) -> None:
        """After an OOM in the first optimizer step: drop the optimizer state (zeros so far) and
        step one parameter at a time, which needs no whole-model temporaries."""
        ...

    def save_checkpoint(self, output_dir: Path, state: TrainerState, scheduler: Any, config_dict: dict) -> Path | None:
        """Write a resumable checkpoint (every rank calls it; the engine decides who writes)."""
        ...

    def load_checkpoint(self, path: Path, scheduler: Any) -> TrainerState:
        """Restore what `save_checkpoint` wrote."""
        ...

    def save_final_model(self, directory: Path, tokenizer: Any) -> Path | None:
        """Write the trained model (gathered from every rank) loadable with from_pretrained."""
        ...

    def step_metrics(self, record: dict) -> dict:
        """Fields this engine adds to a step's metrics line (every rank calls it)."""
        ...

    def summary_metrics(self, summary: dict) -> dict:
        """Fields this engine adds to the summary line."""
        ...


class SingleProcessEngine:
    """One process: plain backward, the optimizer's own step, files written directly."""

    name = "single"
    recovers_from_oom = True

    def __init__(
        self, device: torch.device, precision: PrecisionChoice, max_grad_norm: float, updates_in_backward: bool = False
    ):
        self.device = device
        self.max_grad_norm = max_grad_norm
        self.updates_in_backward = updates_in_backward
        """--optimizer-in-backward: the optimizer steps inside backward; `clip_and_step` only tells the schedule."""
        self.scaler = make_grad_scaler(precision, device)
        self.per_parameter_kernels = False
        self.model: torch.nn.Module | None = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.trainable: list[torch.nn.Parameter] = []

    def describe(self) -> str:
        return "one process"

    def prepare(self, model: torch.nn.Module, build_optimizer: OptimizerBuilder) -> OptimizerChoice:
        choice = build_optimizer(model)
        self.model, self.optimizer = model, choice.optimizer
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        return choice

    def loss_normalizer(self, target_tokens: int) -> float:
        return float(target_tokens)

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def reduce_gradients(self) -> None:
        pass  # one process: nothing to reduce

    def agree_after_micro_batches(self, micro_batch_size: int, events: list[dict]) -> tuple[int, list[dict]]:
        return micro_batch_size, events

    def clip_and_step(self) -> torch.Tensor | None:
        if self.updates_in_backward:
            self.optimizer.step()  # a no-op (the updates ran in backward) that tells the LR schedule a step happened
            return None
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = None
        if any(p.grad is not None for p in self.trainable):
            max_norm = self.max_grad_norm if self.max_grad_norm > 0 else float("inf")  # the norm is logged either way
            foreach = False if self.per_parameter_kernels else None
            grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, max_norm, foreach=foreach)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skips the update when the unscaled gradients hold inf/NaN
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm

    def use_per_parameter_kernels(self) -> None:
        self.optimizer.state.clear()
        for group in self.optimizer.param_groups:
            if "foreach" in group:
                group["foreach"] = False
            if "fused" in group:
                group["fused"] = False
        self.per_parameter_kernels = True

    def save_checkpoint(self, output_dir: Path, state: TrainerState, scheduler: Any, config_dict: dict) -> Path:
        return save_checkpoint(output_dir, state, self.model, self.optimizer, scheduler, self.scaler, config_dict)

    def checkpoint_snapshot(
        self, output_dir: Path, state: TrainerState, scheduler: Any, config_dict: dict
    ) -> Callable[[], Path]:
        """--async-save: copy the state to host memory now; the returned call writes it (in a background thread)."""
        snapshot = take_snapshot(self.model, self.optimizer, scheduler, self.scaler, host_copy=True)
        saved = dataclasses.replace(state, extra=copy.deepcopy(state.extra))
        return lambda: write_snapshot(snapshot, output_dir, saved, config_dict)

    def load_checkpoint(self, path: Path, scheduler: Any) -> TrainerState:
        if (path / "shards").is_dir():  # written by FSDP2 ranks: gathered by name into this process
            from memfit.distributed.checkpoint_io import load_shards_in_one_process

            return load_shards_in_one_process(path, self.model, self.optimizer, scheduler)
        return load_checkpoint(path, self.model, self.optimizer, scheduler, self.scaler)

    def save_final_model(self, directory: Path, tokenizer: Any) -> Path:
        return save_final_model(self.model, tokenizer, directory)

    def step_metrics(self, record: dict) -> dict:
        return {}

    def summary_metrics(self, summary: dict) -> dict:
        return {}


def choose_engine(
    config: TrainConfig, dist: DistContext, device: torch.device, precision: PrecisionChoice, fallbacks: dict[str, str],
    run: ResolvedRun | None = None,
) -> Engine:
    """The engine that `config` and the launcher ask for; UsageError for combinations that cannot run.

    Runs before the model is prepared and the optimizer built, so that every choice an
    engine makes (its own optimizer, no grad scaler, no OOM recovery) is made once.
    """
    from memfit.distributed.parallel import apply_cap_rank

    # What an engine cannot run (--optimizer-in-backward, --quantize under sharding, ...) its technique refuses when
    # the run is resolved, before this (resolution/resolve.py: the `engine` fact).

    distributed = config.distributed
    apply_cap_rank(config, dist)
    if distributed.deepspeed or distributed.zero_stage is not None:
        from memfit.distributed.zero import DeepSpeedEngine

        return DeepSpeedEngine(config, dist, device, precision, fallbacks)
    if run is None:  # the run as the config alone resolves it (setup passes the one it resolved)
        from memfit.resolution.resolve import resolve

        run = resolve(config, None, device.type, world_size=dist.world_size)
    local = SingleProcessEngine(
        device, precision, config.optimizer.max_grad_norm, updates_in_backward=run.optimizer_in_backward
    )
    if not dist.enabled:
        if distributed.sharding != "none":
            fallbacks["sharding"] = (
                f"--sharding {distributed.sharding} needs several ranks (launch with torchrun); ran in one process"
            )
        return local
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if distributed.sharding == "fsdp":
        from memfit.distributed.fsdp import FullyShardedEngine

        return FullyShardedEngine(local, config, dist, device, precision, fallbacks)
    if distributed.sharding == "none":
        fallbacks["sharding"] = f"{dist.world_size} ranks and no --sharding: replicated as with --sharding ddp"
    from memfit.distributed.parallel import DataParallelEngine

    return DataParallelEngine(local, dist, device)
