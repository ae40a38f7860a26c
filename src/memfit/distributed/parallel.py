"""Training on several ranks: what the loop asks of an engine, and data parallelism.

`prepare_parallel` picks the engine from the config and the launcher:

  --sharding ddp (or several ranks and no --sharding)   `DataParallel` (this module)
  --sharding fsdp                                       `FullyShardedParallel` (fsdp.py)
  --deepspeed FILE / --zero-stage N                     `DeepSpeedParallel` (zero.py)

Each engine gives the loop a step runner, sharded checkpoints, the final model
gathered into one directory, and per-rank memory figures for the metrics.

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

from memfit.config import TrainConfig
from memfit.distributed.context import DistContext
from memfit.distributed.memory import gradient_bytes, optimizer_state_bytes, parameter_bytes
from memfit.errors import UsageError
from memfit.techniques.optimizers import refusal_under_fsdp
from memfit.train.checkpoint import TrainerState, load_checkpoint, save_final_model, save_session_checkpoint
from memfit.train.step import StepResult, StepRunner

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


class ParallelStepRunner(StepRunner):
    """StepRunner that reports every rank's events and remembers the gradient bytes it saw."""

    gradient_bytes_seen = 0

    def run(self, samples: list[dict]) -> StepResult:
        result = super().run(samples)
        result.events = gather_events(self.dist, result.events)
        return result

    def _optimizer_step(self, events: list[dict]) -> tuple[float | None, bool]:
        self.gradient_bytes_seen = gradient_bytes(self.trainable)
        return super()._optimizer_step(events)


class DataParallelStepRunner(ParallelStepRunner):
    """Micro-batches without communication; gradients summed once per step (see the module docstring)."""

    def _optimizer_step(self, events: list[dict]) -> tuple[float | None, bool]:
        all_reduce_gradients(self.trainable, self.device)
        agreed = int(-self.dist.all_reduce_max(-float(self.micro_batch_size), self.device))
        if agreed < self.micro_batch_size:
            log.info("memfit: another rank split its micro-batch: micro-batch %d on every rank", agreed)
        self.micro_batch_size = agreed
        return super()._optimizer_step(events)


class Parallel:
    """An engine that spreads training over ranks; the loop calls these methods on every rank."""

    name = "none"
    grads_averaged_across_ranks = False

    def __init__(self, config: TrainConfig, dist: DistContext, device: torch.device):
        self.config = config
        self.dist = dist
        self.device = device
        self.runner: ParallelStepRunner | None = None
        self.run_peak = 0

    def describe(self) -> str:
        return f"{self.name} over {self.dist.world_size} rank(s)"

    def attach(self, session) -> None:
        """Called once the session is built (optimizer and scheduler exist)."""

    def make_runner(self, **kwargs) -> StepRunner:
        self.runner = DataParallelStepRunner(**kwargs)
        return self.runner

    # -- checkpoints ---------------------------------------------------------

    def save_checkpoint(self, session, state: TrainerState) -> Path | None:
        path = None
        if self.dist.is_main:  # every rank holds the same weights: rank 0 writes them
            path = save_session_checkpoint(session, state)
        self.dist.barrier()
        return path

    def load_checkpoint(self, session, path: Path) -> TrainerState:
        return load_checkpoint(path, session.model, session.optimizer.optimizer, session.scheduler, session.scaler)

    def save_final(self, session) -> Path | None:
        final = None
        if self.dist.is_main:
            final = save_final_model(session.model, session.loaded.tokenizer, session.output_dir / "final")
            if session.config.lora.merge_adapter:
                from memfit.techniques.lora import merge_and_save

                merge_and_save(session.model, session.output_dir / "merged")
        self.dist.barrier()
        return final

    # -- metrics -------------------------------------------------------------

    def rank_state_bytes(self, session) -> dict[str, int]:
        """This rank's parameter, gradient and optimizer-state bytes."""
        return {
            "parameters": parameter_bytes(session.model),
            "gradients": self.runner.gradient_bytes_seen if self.runner is not None else 0,
            "optimizer_states": optimizer_state_bytes(session.optimizer.optimizer),
        }

    def step_metrics(self, session, record: dict) -> dict:
        """Fields added to each step's metrics line: every rank's state bytes and the peak over ranks."""
        import torch.distributed as tdist

        peak = record.get("peak_memory_bytes") or 0
        max_peak = int(self.dist.all_reduce_max(peak, self._collective_device()))
        self.run_peak = max(self.run_peak, max_peak)
        mine = {"rank": self.dist.rank, **self.rank_state_bytes(session)}
        if "tracked_peak_bytes" in record:
            mine["tracked_peak_bytes"] = record["tracked_peak_bytes"]
        ranks: list[Any] = [mine]
        if self.dist.enabled:
            ranks = [None] * self.dist.world_size
            tdist.all_gather_object(ranks, mine)
        return {"max_peak_memory_bytes": max_peak, "ranks": ranks, "parallel": self.name}

    def summary_metrics(self, session, summary: dict) -> dict:
        return {"max_peak_memory_bytes": self.run_peak or None, "parallel": self.describe()}

    def _collective_device(self) -> torch.device:
        return self.device if self.device.type == "cuda" else torch.device("cpu")


class DataParallel(Parallel):
    """Every rank holds the whole model; gradients are summed once per optimizer step."""

    name = "ddp"

    def __init__(self, config: TrainConfig, model: torch.nn.Module, dist: DistContext, device: torch.device):
        super().__init__(config, dist, device)
        import torch.distributed as tdist

        # Same starting point on every rank, whatever each one initialised (LoRA adapters, new heads).
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                tdist.broadcast(tensor.data, src=0)


def _check_supported(config: TrainConfig, engine: str) -> None:
    problems = []
    if config.memory.optimizer_in_backward:
        problems.append(f"--optimizer-in-backward does not work with {engine}: drop it")
    if engine != "--sharding ddp" and config.memory.optimizer_offload:
        problems.append(
            f"--optimizer-offload is single-process: with {engine} use "
            + ("--fsdp-offload" if "fsdp" in engine else "--zero-offload (or offload_optimizer in the file)")
        )
    if engine != "--sharding ddp" and config.lora.quantize != "none":
        problems.append(f"--quantize {config.lora.quantize} cannot be sharded by {engine}: use --sharding ddp")
    if engine != "--sharding ddp" and config.lora.merge_adapter:
        problems.append(f"--merge-adapter is not supported with {engine}: merge the saved adapter afterwards")
    if "fsdp" in engine and refusal_under_fsdp(config.optimizer.optimizer):
        problems.append(refusal_under_fsdp(config.optimizer.optimizer))
    if problems:
        raise UsageError("; ".join(problems))


def _apply_cap_rank(config: TrainConfig, dist: DistContext) -> None:
    """With MEMFIT_MEMORY_CAP_RANK=R, only rank R keeps --memory-cap (rehearsing an OOM on one rank)."""
    wanted = os.environ.get(CAP_RANK_ENV)
    if wanted is None or config.memory.memory_cap is None:
        return
    if not wanted.strip().isdigit():
        raise UsageError(f"{CAP_RANK_ENV} must be a rank number, got {wanted!r}")
    if int(wanted) != dist.rank:
        config.memory.memory_cap = None


def prepare_parallel(
    config: TrainConfig,
    model: torch.nn.Module,
    dist: DistContext,
    device: torch.device,
    precision,
    notes: dict[str, str],
) -> Parallel | None:
    """Pick and set up the engine before the optimizer is built; None for a plain single process.

    FSDP2 shards `model` in place here. Raises UsageError for combinations that cannot run.
    """
    distributed = config.distributed
    _apply_cap_rank(config, dist)
    if distributed.deepspeed or distributed.zero_stage is not None:
        _check_supported(config, "DeepSpeed")
        from memfit.distributed.zero import DeepSpeedParallel

        return DeepSpeedParallel(config, dist, device, notes)
    if not dist.enabled:
        if distributed.sharding != "none":
            notes["sharding"] = (
                f"--sharding {distributed.sharding} needs several ranks (launch with torchrun); ran in one process"
            )
        return None
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if distributed.sharding == "fsdp":
        _check_supported(config, "--sharding fsdp")
        from memfit.distributed.fsdp import FullyShardedParallel

        return FullyShardedParallel(config, model, dist, device, precision, notes)
    _check_supported(config, "--sharding ddp")
    if distributed.sharding == "none":
        notes["sharding"] = f"{dist.world_size} ranks and no --sharding: replicated as with --sharding ddp"
    return DataParallel(config, model, dist, device)
