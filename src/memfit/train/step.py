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
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from memfit.errors import DoesNotFitError
from memfit.memory.cap import is_out_of_memory
from memfit.techniques.loss import causal_lm_loss_sum, count_target_tokens

log = logging.getLogger("memfit")

DEFAULT_ESCALATION_CHUNK = 1024


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
    """fp16: the scaler skipped this step (inf/nan gradients)."""
    events: list[dict] = field(default_factory=list)


class StepRunner:
    """Runs optimizer steps for the loop; holds the micro-batch size, which OOM recovery lowers."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        device: torch.device,
        precision,
        collate: Callable[[list[dict]], dict[str, torch.Tensor]],
        micro_batch_size: int,
        max_grad_norm: float,
        loss_chunk_size: int,
        scaler: torch.amp.GradScaler | None = None,
        tracker=None,
        oom_recovery: bool = True,
        dist=None,
        grads_averaged_across_ranks: bool = False,
        optimizer_steps_in_backward: bool = False,
        enable_checkpointing: Callable[[], str] | None = None,
        checkpointing_on: bool = False,
    ):
        self.model = model
        self.optimizer = optimizer
        self.device = device
        self.precision = precision
        self.collate = collate
        self.micro_batch_size = micro_batch_size
        self.max_grad_norm = max_grad_norm
        self.loss_chunk_size = loss_chunk_size
        self.scaler = scaler
        self.tracker = tracker
        self.oom_recovery = oom_recovery
        self.dist = dist
        self.grads_averaged_across_ranks = grads_averaged_across_ranks
        self.optimizer_steps_in_backward = optimizer_steps_in_backward
        self.enable_checkpointing = enable_checkpointing
        self.checkpointing_on = checkpointing_on
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self._touched: set[int] = set()
        self._recording = False
        self._low_memory_kernels = False  # set after an OOM in the optimizer step
        self._last_phase = "forward"  # where a micro-batch was when it failed
        self._hooks = [parameter.register_post_accumulate_grad_hook(self._note_accumulated) for parameter in self.trainable]

    def close(self) -> None:
        """Remove the gradient hooks (when a runner is made for one probe, not a whole run)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

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

    # -- one step ----------------------------------------------------------

    def run(self, samples: list[dict]) -> StepResult:
        """Forward/backward over `samples` in micro-batches, then one optimizer step."""
        events: list[dict] = []
        target_tokens = sum(count_target_tokens(sample["labels"][None]) for sample in samples)
        input_tokens = sum(int(sample["input_ids"].numel()) for sample in samples)
        normalizer = float(target_tokens)
        if self.dist is not None and self.dist.enabled:
            normalizer = self.dist.all_reduce_sum(target_tokens)
            if self.grads_averaged_across_ranks:
                normalizer /= self.dist.world_size  # the engine averages gradients over ranks
        normalizer = max(normalizer, 1.0)

        pending = deque(Piece(samples[i : i + self.micro_batch_size]) for i in range(0, len(samples), self.micro_batch_size))
        loss_sum = 0.0
        while pending:
            piece = pending.popleft()
            failure = None
            self._touched = set()
            try:
                loss_sum += self._forward_backward(piece, normalizer)
            except Exception as error:  # only out-of-memory is handled; the rest propagates
                if not is_out_of_memory(error) or not self.oom_recovery:
                    raise
                failure = _describe(error, self._last_phase)
            if failure is None:
                continue
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

        grad_norm, skipped = self._optimizer_step(events)
        return StepResult(
            loss=loss_sum / max(target_tokens, 1),
            grad_norm=grad_norm,
            target_tokens=target_tokens,
            input_tokens=input_tokens,
            micro_batch_size=self.micro_batch_size,
            accumulation_steps=-(-len(samples) // self.micro_batch_size),
            skipped=skipped,
            events=events,
        )

    def _forward_backward(self, piece: Piece, normalizer: float) -> float:
        frozen = [p for p in self.trainable if id(p) in piece.frozen]
        for parameter in frozen:
            parameter.requires_grad_(False)
        try:
            batch = {k: v.to(self.device, non_blocking=True) for k, v in self.collate(piece.samples).items()}
            mask = batch.get("attention_mask")
            if mask is not None and bool(mask.all()):
                mask = None  # no padding: lets SDPA take its causal fast path
            self._last_phase = "forward"
            with self._phase("forward"), self.precision.autocast(self.device):
                loss_sum = causal_lm_loss_sum(self.model, batch["input_ids"], batch["labels"], mask, self.loss_chunk_size)
            loss = loss_sum / normalizer
            self._last_phase = "backward"
            self._recording = True
            with self._phase("backward"):
                (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
            self._recording = False
            return float(loss_sum.detach())
        finally:
            for parameter in frozen:
                parameter.requires_grad_(True)

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
        if not self.checkpointing_on and self.enable_checkpointing is not None:
            done = self.enable_checkpointing()
            self.checkpointing_on = True
            action = f"turned on full gradient checkpointing ({done})"
        elif self.loss_chunk_size == 0:
            self.loss_chunk_size = DEFAULT_ESCALATION_CHUNK
            action = f"turned on chunked loss ({DEFAULT_ESCALATION_CHUNK} tokens per chunk)"
        else:
            raise DoesNotFitError(
                f"out of memory in {failure['phase']} with micro-batch 1, even with full gradient checkpointing"
                " and chunked loss; lower --seq-len, use --lora-r 16 (or --quantize 4bit), --optimizer adamw-8bit,"
                " or more memory (memfit plan shows what fits)"
            )
        message = f"out of memory in {failure['phase']} at micro-batch 1: {action} and retrying"
        log.warning("memfit: %s", message)
        return {"event": "oom", "phase": failure["phase"], "error": failure["error"], "action": action, "message": message}

    # -- optimizer step ------------------------------------------------------

    def _optimizer_step(self, events: list[dict]) -> tuple[float | None, bool]:
        if self.optimizer_steps_in_backward:
            self.optimizer.step()  # a no-op (the updates ran in backward) that tells the LR schedule a step happened
            return None, False
        first_step = not self.optimizer.state
        for attempt in range(2):
            try:
                with self._phase("optimizer"):
                    return self._clip_and_step()
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
            # The first step only allocated state (zeros) and temporaries: drop them and redo the
            # step with the per-parameter kernel, which needs no whole-model temporaries.
            self.optimizer.state.clear()
            for group in self.optimizer.param_groups:
                if "foreach" in group:
                    group["foreach"] = False
                if "fused" in group:
                    group["fused"] = False
            self._low_memory_kernels = True
            message = "out of memory in the optimizer step: switched to the per-parameter kernel (--optimizer-impl for-loop) and redid the step"
            log.warning("memfit: %s", message)
            events.append({"event": "oom", "phase": "optimizer", "error": failure["error"], "action": "optimizer-impl for-loop", "message": message})
        raise AssertionError("unreachable")

    def _clip_and_step(self) -> tuple[float | None, bool]:
        grads_exist = any(p.grad is not None for p in self.trainable)
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        grad_norm = None
        if grads_exist:
            max_norm = self.max_grad_norm if self.max_grad_norm > 0 else float("inf")
            foreach = False if self._low_memory_kernels else None
            grad_norm = float(torch.nn.utils.clip_grad_norm_(self.trainable, max_norm, foreach=foreach))
        skipped = False
        if self.scaler is not None:
            scale_before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = self.scaler.get_scale() < scale_before
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm, skipped


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
