"""One optimizer step: micro-batches with exact accumulation, and recovery from out-of-memory.

The loss of an update is the mean over every target token of the whole effective batch:
each micro-batch contributes (summed token loss) / (target tokens of the effective batch),
so any split into micro-batches gives the same update.

When a micro-batch runs out of memory, it is split in two and redone; the gradients
already accumulated stay. If the failure came in backward, the parameters whose
gradient had already received that micro-batch's full contribution are frozen while its
halves are redone, so nothing is counted twice: the update stays exact. Training goes on
at the smaller micro-batch. When one sample does not fit, memfit turns on full
checkpointing, then chunked loss, and only then gives up (DoesNotFitError, exit code 3).

The host waits for the device once per optimizer step: losses stay on the device
across micro-batches, the padding check reads the CPU batch before it moves, and the
loss and the gradient norm are read together at the end.

Where it runs (one process, DDP, FSDP2, DeepSpeed) is the engine's business
(memfit.train.engine): the runner calls the same methods on each.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from memfit.data.prefetch import BatchPrefetcher
from memfit.distributed import context_parallel
from memfit.errors import DoesNotFitError
from memfit.memory.cap import is_out_of_memory
from memfit.tasks import Task
from memfit.techniques.loss import DEFAULT_LOSS_CHUNK_TOKENS, causal_lm_loss_sum
from memfit.train.engine import Engine

log = logging.getLogger("memfit")


@dataclass
class Piece:
    """A slice of the effective batch to run as one micro-batch."""

    samples: list[dict]
    frozen: frozenset = frozenset()
    """ids of the parameters that already hold this piece's gradient (from a failed backward)."""


@dataclass
class StepResult:
    loss: float
    """Mean token loss of the effective batch (this rank)."""
    grad_norm: float | None
    target_tokens: int
    """Tokens that carried a loss on this rank."""
    input_tokens: int
    micro_batch_size: int
    accumulation_steps: int
    skipped: bool = False
    """fp16: the grad scaler skipped this step (inf/NaN gradients)."""
    padded_positions: int = 0
    """Positions the micro-batches ran, padding included (each pads to its longest sample): --group-by-length lowers it."""
    events: list[dict] = field(default_factory=list)


class StepRunner:
    """Runs optimizer steps; holds the micro-batch size, which OOM recovery lowers.

    Build it with `StepRunner.from_session`: the loop, the batch-size finder and the
    profiler all do, so they run the same step.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        engine: Engine,
        device: torch.device,
        precision,
        pad_token_id: int | None,
        micro_batch_size: int,
        loss_chunk_size: int,
        oom_recovery: bool,
        checkpointing_on: bool,
        tracker=None,
        loss_fn=causal_lm_loss_sum,
        task: Task | None = None,
        on_run_change: Callable[..., None] | None = None,
    ):
        self.model = model
        self.engine = engine
        self.device = device
        self.precision = precision
        self.pad_token_id = pad_token_id
        self.micro_batch_size = micro_batch_size
        self.loss_chunk_size = loss_chunk_size
        self.oom_recovery = oom_recovery
        self.checkpointing_on = checkpointing_on
        self.tracker = tracker
        # An OOM escalation changes what runs: said to the session (`TrainingSession.change_run`), an event of its run.
        self.on_run_change = on_run_change
        # What is learned (memfit.tasks): its units (target tokens or samples) and the batches.
        self.task = task or Task()
        self.loss_fn = loss_fn  # the loss recipe (techniques/loss_recipe.py), the task's own where it has one
        # The next micro-batch is collated (and on CUDA copied on a side stream) while this one computes.
        self.context_parallel = context_parallel.active()  # --context-parallel: this rank trains its shard of every row
        collate = self.task.collate if self.context_parallel is None else context_parallel.sharded_collate(
            self.task.collate, self.context_parallel)
        self.prefetcher = BatchPrefetcher(lambda samples: collate(samples, pad_token_id), device,
                                          drop_full_attention_mask=True)
        self._upcoming: list[dict] | None = None
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self._touched: set[int] = set()
        self._recording = False
        self._last_phase = "forward"  # where a micro-batch was when it failed
        self._hooks = [parameter.register_post_accumulate_grad_hook(self._note_accumulated) for parameter in self.trainable]

    @classmethod
    def from_session(
        cls, session: Any, *, tracker=None, micro_batch_size: int | None = None, oom_recovery: bool | None = None
    ) -> StepRunner:
        """The step of `session` (a memfit.train.setup.TrainingSession).

        `micro_batch_size` defaults to --batch-size; `oom_recovery` to --oom-recovery, and is
        off where it would change the numbers: under an engine whose ranks exchange data
        mid-pass, and under --optimizer-in-backward (each backward applies an update, so a
        split micro-batch would apply two).
        """
        run = session.run
        wanted = session.config.memory.oom_recovery if oom_recovery is None else oom_recovery
        return cls(
            model=session.model,
            engine=session.engine,
            device=session.device,
            precision=session.precision,
            pad_token_id=session.loaded.tokenizer.pad_token_id,
            micro_batch_size=micro_batch_size or session.config.training.batch_size,
            loss_chunk_size=run.loss_chunk_size,
            oom_recovery=wanted and session.engine.recovers_from_oom and not run.optimizer_in_backward,
            checkpointing_on=run.checkpointing_on,
            tracker=tracker,
            loss_fn=session.loss_function,
            task=session.task,
            on_run_change=session.change_run,
        )

    def close(self) -> None:
        """Remove the gradient hooks (when a runner is made for one probe, not a whole run)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    # -- one step ----------------------------------------------------------

    def run(self, samples: list[dict], next_samples: list[dict] | None = None) -> StepResult:
        """Forward/backward over `samples` in micro-batches, then one optimizer step.

        `next_samples` (the next step's samples, the very same objects that step will pass)
        lets the last micro-batch prepare the next step's first one, so the input pipeline
        runs ahead across optimizer steps too, not only between micro-batches of a step.
        """
        events: list[dict] = []
        target_tokens = sum(self.task.count(sample) for sample in samples)  # samples, for sequence tasks
        input_tokens = sum(int(sample["input_ids"].numel()) for sample in samples)
        normalizer = self.engine.loss_normalizer(target_tokens)
        if self.context_parallel is not None:  # every rank of a context group counted the same samples
            normalizer *= context_parallel.loss_normalizer_share(self.context_parallel.size)
        normalizer = max(normalizer, 1.0)

        pending = deque(Piece(samples[i : i + self.micro_batch_size]) for i in range(0, len(samples), self.micro_batch_size))
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        positions = 0
        while pending:
            piece = pending.popleft()
            self._touched = set()
            self._upcoming = pending[0].samples if pending else (next_samples or [])[: self.micro_batch_size]
            try:
                loss_sum += self._forward_backward(piece, normalizer, last_micro_batch=not pending)
                positions += self.task.row_positions(piece.samples)
                continue
            except Exception as error:  # only out-of-memory is handled; the rest propagates
                if not is_out_of_memory(error) or not self.oom_recovery:
                    raise
                failure = _describe(error, self._last_phase)
            self._recording = False
            self._release_memory()
            frozen = piece.frozen | frozenset(self._touched)
            if len(piece.samples) > 1:
                half = (len(piece.samples) + 1) // 2
                old = self.micro_batch_size
                self.micro_batch_size = min(self.micro_batch_size, half)
                pending.appendleft(Piece(piece.samples[half:], frozen))
                pending.appendleft(Piece(piece.samples[:half], frozen))
                pending = _resplit(pending, self.micro_batch_size)  # later pieces would fail the same way
                events.append(self._oom_event(failure, len(piece.samples), old, self.micro_batch_size, len(samples)))
            else:
                events.append(self._escalate(failure))
                pending.appendleft(Piece(piece.samples, frozen))

        self.engine.reduce_gradients()
        grad_norm = self._optimizer_step(events)
        self.micro_batch_size, events = self.engine.agree_after_micro_batches(self.micro_batch_size, events)
        loss_sum, norm = _read_once(loss_sum, grad_norm)  # the step's one wait for the device
        return StepResult(
            loss=loss_sum / max(target_tokens, 1),
            grad_norm=norm,
            target_tokens=target_tokens,
            input_tokens=input_tokens,
            micro_batch_size=self.micro_batch_size,
            accumulation_steps=-(-len(samples) // self.micro_batch_size),
            # The grad scaler skips exactly the steps whose unscaled gradients hold inf/NaN: their norm is not finite.
            skipped=self.engine.scaler is not None and norm is not None and not math.isfinite(norm),
            events=events,
            padded_positions=positions,
        )

    def _forward_backward(self, piece: Piece, normalizer: float, last_micro_batch: bool) -> torch.Tensor:
        """Forward and backward of one micro-batch; returns its summed token loss, on the device."""
        frozen = [p for p in self.trainable if id(p) in piece.frozen]
        for parameter in frozen:
            parameter.requires_grad_(False)
        try:
            # A mask without padding is dropped on the CPU, before the batch moves: SDPA's causal fast path.
            batch = self.prefetcher.take(piece.samples)
            self._last_phase = "forward"
            with self._phase("forward"), self.precision.autocast(self.device):
                loss_sum = self.loss_fn(
                    self.model, batch["input_ids"], batch["labels"], batch.get("attention_mask"), self.loss_chunk_size,
                    **packed_positions(batch), **self.task.loss_inputs(batch),
                )
            if self._upcoming:
                self.prefetcher.prepare(self._upcoming)  # overlaps this micro-batch's compute on CUDA
            self._last_phase = "backward"
            self._recording = True
            with self._phase("backward"):
                self.engine.backward(loss_sum / normalizer, last_micro_batch)
            self._recording = False
            return loss_sum.detach()
        finally:
            for parameter in frozen:
                parameter.requires_grad_(True)

    def _optimizer_step(self, events: list[dict]) -> torch.Tensor | float | None:
        """engine.clip_and_step, redone per parameter when the first step runs out of memory."""
        first_step = not self.engine.optimizer.state
        for attempt in range(2):
            try:
                with self._phase("optimizer"):
                    return self.engine.clip_and_step()
            except Exception as error:
                if not (self.oom_recovery and is_out_of_memory(error)) or attempt == 1:
                    raise
                failure = _describe(error, "optimizer")
            self._release_memory()
            if not first_step:
                raise DoesNotFitError(
                    "out of memory in the optimizer step after the first step, where its state may be half-updated;"
                    " use --optimizer adamw-8bit or --optimizer-impl for-loop"
                )
            # The first step only allocated state (zeros) and temporaries: drop them and redo it.
            self.engine.use_per_parameter_kernels()
            message = "out of memory in the optimizer step: switched to the per-parameter kernel (--optimizer-impl for-loop) and redid the step"
            log.warning("memfit: %s", message)
            events.append({"event": "oom", "phase": "optimizer", "error": failure["error"], "action": "optimizer-impl for-loop", "message": message})
        raise AssertionError("unreachable")

    # -- out-of-memory recovery ----------------------------------------------

    def _oom_event(self, failure: dict, failed_size: int, old: int, new: int, effective: int) -> dict:
        old_accumulation, new_accumulation = -(-effective // old), -(-effective // new)
        message = (
            f"out of memory in {failure['phase']} on a micro-batch of {failed_size}: now {new} x {new_accumulation}"
            f" (was {old} x {old_accumulation}); the effective batch of {effective} and the update are unchanged"
        )
        log.warning("memfit: %s", message)
        return {
            "event": "oom",
            "phase": failure["phase"],
            "error": failure["error"],
            "failed_micro_batch_size": failed_size,
            "old_micro_batch_size": old,
            "new_micro_batch_size": new,
            "old_gradient_accumulation_steps": old_accumulation,
            "new_gradient_accumulation_steps": new_accumulation,
            "message": message,
        }

    def _escalate(self, failure: dict) -> dict:
        """One sample does not fit: switch on what saves memory without changing the numbers."""
        if not self.checkpointing_on:
            from memfit.techniques.checkpointing import apply_gradient_checkpointing, checkpointed_count

            base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
            done = apply_gradient_checkpointing(base, "full")
            self.checkpointing_on = True
            action = f"turned on full gradient checkpointing ({done})"
            self._change_run("gradient_checkpointing", failure, checkpointing="full",
                             checkpointed_blocks=checkpointed_count(base))
        elif self.loss_chunk_size == 0:
            self.loss_chunk_size = DEFAULT_LOSS_CHUNK_TOKENS
            action = f"turned on chunked loss ({DEFAULT_LOSS_CHUNK_TOKENS} tokens per chunk)"
            self._change_run("loss_chunking", failure, loss_chunk_size=DEFAULT_LOSS_CHUNK_TOKENS)
        else:
            raise DoesNotFitError(
                f"out of memory in {failure['phase']} with micro-batch 1, even with full gradient checkpointing"
                " and chunked loss; lower --seq-len, use --lora-r 16 (or --quantize 4bit), --optimizer adamw-8bit,"
                " or more memory (memfit plan shows what fits)"
            )
        message = f"out of memory in {failure['phase']} at micro-batch 1: {action} and retrying"
        log.warning("memfit: %s", message)
        return {"event": "oom", "phase": failure["phase"], "error": failure["error"], "action": action, "message": message}

    def _change_run(self, technique: str, failure: dict, **fields) -> None:
        """Record an escalation in the resolved run (the loop reports the run's events)."""
        if self.on_run_change is not None:
            self.on_run_change(technique, f"out of memory in {failure['phase']} at micro-batch 1", **fields)

    # -- bookkeeping -------------------------------------------------------

    def _note_accumulated(self, parameter: torch.Tensor) -> None:
        if self._recording:
            self._touched.add(id(parameter))

    def _phase(self, name: str):
        return self.tracker.phase(name) if self.tracker is not None else contextlib.nullcontext()

    def _release_memory(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def packed_positions(batch: dict) -> dict:
    """{"position_ids": ...} for packed rows (positions restart per sample), else nothing: see data.packing."""
    return {"position_ids": batch["position_ids"]} if "position_ids" in batch else {}


def _read_once(loss_sum: torch.Tensor, grad_norm: torch.Tensor | float | None) -> tuple[float, float | None]:
    """The summed loss and the gradient norm as numbers, in one device-to-host copy."""
    if isinstance(grad_norm, torch.Tensor):
        both = torch.stack([loss_sum.float(), grad_norm.detach().float().to(loss_sum.device)]).tolist()
        return both[0], both[1]
    return loss_sum.item(), None if grad_norm is None else float(grad_norm)


def _resplit(pending: deque, size: int) -> deque:
    """Cut every pending piece to at most `size` samples, keeping order and frozen sets."""
    result: deque = deque()
    for piece in pending:
        for start in range(0, len(piece.samples), size):
            result.append(Piece(piece.samples[start : start + size], piece.frozen))
    return result


def _describe(error: BaseException, phase: str) -> dict:
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return {"phase": phase, "error": text[:200]}
