"""Training on several ranks: what every multi-rank engine shares, and data parallelism.

memfit.train.engine.choose_engine picks the engine from the config and the launcher:

  --sharding ddp (or several ranks and no --sharding)   `DataParallelEngine` (this module)
  --sharding fsdp                                       `FullyShardedEngine` (fsdp.py)
  --deepspeed FILE / --zero-stage N                     `DeepSpeedEngine` (zero.py)

Each implements memfit.train.engine.Engine (a Protocol: nothing here imports train/).
`RankMetrics` adds every rank's state bytes and the peak over ranks to the metrics.

Data parallelism and OOM recovery. Every rank runs its slice of the global batch in
micro-batches with no communication at all, and the gradients are summed across ranks
once, after the last micro-batch (as DDP does under `no_sync` accumulation). The loss
is normalized by the target tokens of the whole global batch, so the summed gradient
is exactly the single-process one. Because nothing is exchanged while micro-batches
run, a rank that runs out of memory splits and redoes its micro-batch on its own
(see memfit.train.step); the ranks then agree on the smallest micro-batch, so they
stay in step for the rest of the run, and rank 0 logs every rank's OOM event.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import torch

from memfit.checkpoint_files import TrainerState
from memfit.config import TrainConfig
from memfit.distributed.context import DistContext
from memfit.distributed.memory import gradient_bytes, optimizer_state_bytes, parameter_bytes
from memfit.errors import UsageError

log = logging.getLogger("memfit")

CAP_RANK_ENV = "MEMFIT_MEMORY_CAP_RANK"
"""Environment variable: apply --memory-cap on this rank only (rehearse an OOM on one rank)."""


def gather_events(dist: DistContext, events: list[dict]) -> list[dict]:
    """Every rank's events, tagged with their rank, on every rank (rank 0 logs them)."""
    if not dist.enabled:
        return events
    import torch.distributed as tdist

    gathered: list[Any] = [None] * dist.world_size
    tdist.all_gather_object(gathered, events)
    return [{**event, "rank": rank} for rank, rank_events in enumerate(gathered) for event in rank_events or []]


def all_reduce_gradients(parameters: list[torch.nn.Parameter], device: torch.device) -> None:
    """Sum the gradients of `parameters` over ranks, in place (a missing gradient counts as zero).

    One collective per tensor, with no flat buffer: the sync needs no memory beyond
    the gradients themselves.
    """
    import torch.distributed as tdist

    has_grad = torch.tensor([float(p.grad is not None) for p in parameters], device=device)
    tdist.all_reduce(has_grad, op=tdist.ReduceOp.MAX)
    for parameter, flag in zip(parameters, has_grad.tolist(), strict=True):
        if not flag:
            continue
        if parameter.grad is None:
            parameter.grad = torch.zeros_like(parameter)
        tdist.all_reduce(parameter.grad)


class RankMetrics:
    """Per-rank memory in the metrics: each rank's parameter, gradient and optimizer-state bytes,
    and the peak over ranks. Engines set `dist`, `device`, `model`, `optimizer` and count
    `gradient_bytes_seen` before each optimizer step (gradients are freed after it)."""

    name = "multi-rank"
    dist: DistContext
    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    gradient_bytes_seen = 0
    run_peak = 0

    def rank_state_bytes(self) -> dict[str, int]:
        """This rank's parameter, gradient and optimizer-state bytes."""
        return {
            "parameters": parameter_bytes(self.model),
            "gradients": self.gradient_bytes_seen,
            "optimizer_states": optimizer_state_bytes(self.optimizer),
        }

    def step_metrics(self, record: dict) -> dict:
        """Every rank's state bytes and the peak over ranks (a collective: every rank calls it)."""
        import torch.distributed as tdist

        peak = record.get("peak_memory_bytes") or 0
        collective_device = self.device if self.device.type == "cuda" else torch.device("cpu")
        max_peak = int(self.dist.all_reduce_max(peak, collective_device))
        self.run_peak = max(self.run_peak, max_peak)
        mine = {"rank": self.dist.rank, **self.rank_state_bytes()}
        if "tracked_peak_bytes" in record:
            mine["tracked_peak_bytes"] = record["tracked_peak_bytes"]
        ranks: list[Any] = [mine]
        if self.dist.enabled:
            ranks = [None] * self.dist.world_size
            tdist.all_gather_object(ranks, mine)
        return {"max_peak_memory_bytes": max_peak, "ranks": ranks, "parallel": self.name}

    def summary_metrics(self, summary: dict) -> dict:
        return {"max_peak_memory_bytes": self.run_peak or None, "parallel": self.describe()}

    def describe(self) -> str:
        return f"{self.name} over {self.dist.world_size} rank(s)"


class LocalStepEngine(RankMetrics):
    """A multi-rank engine whose local step is a one-process engine's (`local`): DDP and FSDP2."""

    def __init__(self, local, dist: DistContext, device: torch.device):
        self.local = local
        """A memfit.train.engine.SingleProcessEngine: backward, clipping, the step and the files of one process."""
        self.dist = dist
        self.device = device
        self.scaler = local.scaler

    @property
    def model(self) -> torch.nn.Module:
        return self.local.model

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.local.optimizer


class DataParallelEngine(LocalStepEngine):
    """Every rank holds the whole model and runs a one-process engine (`local`) on its slice of the
    batch; gradients are summed once per optimizer step (see the module docstring)."""

    name = "ddp"
    recovers_from_oom = True

    def prepare(self, model: torch.nn.Module, build_optimizer):
        import torch.distributed as tdist

        # Same starting point on every rank, whatever each one initialised (LoRA adapters, new heads).
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                tdist.broadcast(tensor.data, src=0)
        return self.local.prepare(model, build_optimizer)

    def loss_normalizer(self, target_tokens: int) -> float:
        return self.dist.all_reduce_sum(target_tokens)  # the gradients are summed over ranks

    def backward(self, loss: torch.Tensor, last_micro_batch: bool) -> None:
        self.local.backward(loss, last_micro_batch)

    def reduce_gradients(self) -> None:
        all_reduce_gradients(self.local.trainable, self.device)

    def agree_after_micro_batches(self, micro_batch_size: int, events: list[dict]) -> tuple[int, list[dict]]:
        agreed = int(-self.dist.all_reduce_max(-float(micro_batch_size), self.device))
        if agreed < micro_batch_size:
            log.info("memfit: another rank split its micro-batch: micro-batch %d on every rank", agreed)
        return agreed, gather_events(self.dist, events)

    def clip_and_step(self):
        self.gradient_bytes_seen = gradient_bytes(self.local.trainable)
        return self.local.clip_and_step()

    def use_per_parameter_kernels(self) -> None:
        self.local.use_per_parameter_kernels()

    def save_checkpoint(self, output_dir: Path, state: TrainerState, scheduler: Any, config_dict: dict) -> Path | None:
        path = None
        if self.dist.is_main:  # every rank holds the same weights: rank 0 writes them
            path = self.local.save_checkpoint(output_dir, state, scheduler, config_dict)
        self.dist.barrier()
        return path

    def checkpoint_snapshot(self, output_dir: Path, state: TrainerState, scheduler: Any, config_dict: dict):
        """--async-save: rank 0 copies the (replicated) state and writes it in the background; the others write nothing."""
        if not self.dist.is_main:
            return None
        return self.local.checkpoint_snapshot(output_dir, state, scheduler, config_dict)

    def load_checkpoint(self, path: Path, scheduler: Any) -> TrainerState:
        return self.local.load_checkpoint(path, scheduler)

    def save_final_model(self, directory: Path, tokenizer: Any) -> Path | None:
        final = None
        if self.dist.is_main:
            final = self.local.save_final_model(directory, tokenizer)
        self.dist.barrier()
        return final


def apply_cap_rank(config: TrainConfig, dist: DistContext) -> None:
    """With MEMFIT_MEMORY_CAP_RANK=R, only rank R keeps --memory-cap (rehearsing an OOM on one rank)."""
    wanted = os.environ.get(CAP_RANK_ENV)
    if wanted is None or config.memory.memory_cap is None:
        return
    if not wanted.strip().isdigit():
        raise UsageError(f"{CAP_RANK_ENV} must be a rank number, got {wanted!r}")
    if int(wanted) != dist.rank:
        config.memory.memory_cap = None
