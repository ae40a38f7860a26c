"""Evaluation: the step's forward without gradients over a set of held-out samples.

    eval_source = load_eval_data(config, data_config, loaded)          # --eval-dataset, read like training data
    dataset, eval_set = split_for_evaluation(config, dataset, eval_source, ...)   # or --eval-fraction held out
    evaluator = Evaluator.from_session(session, runner, tracker)
    ...after each optimizer step:  evaluation = evaluator.maybe_run(step)
    ...then:                       evaluator.publish(evaluation, logger, progress)   # eval line, --save-best

The eval loss is the sum of the losses of the whole eval set divided by its units (the task's
`count`: target tokens, or samples for a sequence task), so how the set is cut into batches
cannot change it; the perplexity is exp(loss). The console's eval line is the task's wording
(`Task.eval_status`): perplexity over target tokens for a causal or masked LM, the task's
metrics (accuracy, F1, MCC, AUROC; MSE, Pearson, ...) over samples for a sequence task.
Each batch runs the same loss function as the training step (the chunked loss included,
so the logits of one chunk at most are alive), under `torch.no_grad`: no activation is kept
for backward and no logits are kept across batches, only two running sums. Its peak is
therefore the training forward's at most, with the gradients already freed by the step.

Evaluation has its own batch (--eval-batch-size, default the training micro-batch). An
out-of-memory error (real, or the emulated --memory-cap) halves that batch and redoes only
the failed piece; training's micro-batch and accumulation are never touched. A single
sample that does not fit turns on the chunked loss for evaluation, then gives up.

With several ranks each rank evaluates the whole set (the same forwards on every rank, as
sharded engines need), so the numbers agree without communication; there an out-of-memory
error in evaluation is not split (one rank would run more forwards than the others) and ends
the run like one in training that cannot be recovered.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import time
from collections import deque
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memfit.data import load_training_data
from memfit.errors import DoesNotFitError, UsageError
from memfit.memory.cap import is_out_of_memory
from memfit.tasks import Task
from memfit.tasks.masking import EVAL_STEP
from memfit.techniques.loss import DEFAULT_LOSS_CHUNK_TOKENS
from memfit.techniques.packed_attention import pack_for_model
from memfit.train.step import packed_positions

log = logging.getLogger("memfit")

BEST_DIR = "best"
BEST_FILE = "best.json"
# Mixed into the seed of the held-out choice, so it is not the permutation of the first epoch.
_HOLD_OUT_STREAM = 0xE7A1


# ---------------------------------------------------------------------------
# The eval set
# ---------------------------------------------------------------------------


class SampleView(torch.utils.data.Dataset):
    """Some samples of a dataset, by index, seen as a dataset of their own (the rest of its attributes delegated)."""

    def __init__(self, base: Any, indices: np.ndarray, role: str):
        self.base = base
        self.indices = np.asarray(indices, dtype=np.int64)
        self.role = role
        """'training' or 'evaluation': what the description says the view is."""

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"sample {index} is out of range for {len(self)} samples")
        return self.base[int(self.indices[int(index)])]

    @property
    def lengths(self) -> np.ndarray:
        return np.asarray(self.base.lengths)[self.indices]

    @property
    def num_samples(self) -> int:
        """Whole samples in these rows (several per row when the base is packed)."""
        if getattr(self.base, "packing", None) != "samples":  # one sample a row (a table's `rows` is its row count)
            return len(self)
        return int(sum(len(self.base.rows[int(i)]) for i in self.indices))

    @property
    def description(self) -> str:
        inner = getattr(self.base, "description", f"{len(self.base):,} samples")
        return f"{inner}; {len(self):,} of its {len(self.base):,} rows for {self.role}"

    def __getattr__(self, name: str) -> Any:
        if name in ("base", "__setstate__") or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.base, name)


def held_out_indices(num_samples: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(training, evaluation) sample indices: a `fraction` of them (at least one) held out, chosen by `seed`.

    A function of (num_samples, fraction, seed) only: every run and every rank holds out the
    same samples. Both lists are sorted and disjoint, and together they are every index.
    """
    count = min(num_samples - 1, max(1, round(num_samples * fraction)))
    order = np.random.default_rng([seed, _HOLD_OUT_STREAM]).permutation(num_samples)
    return np.sort(order[count:]), np.sort(order[:count])


def load_eval_data(config: Any, data_config: Any, loaded: Any, load: Any = None) -> Any | None:
    """--eval-dataset read, tokenized and cached like the training data (any format it takes), or None.

    `data_config` is the run's data section with its cache directory resolved; `loaded` the
    memfit.models.loader.LoadedModel (tokenizer, positions); `load` the task's reader (memfit.tasks),
    load_training_data by default. Raises UsageError for bad data.
    """
    name = config.evaluation.eval_dataset
    if not name or config.evaluation.eval_strategy == "no":
        return None
    try:
        options = {"role": "evaluation"} if load is not None else {}
        return (load or load_training_data)(
            replace(data_config, dataset=name), loaded.tokenizer, max_positions=loaded.max_positions, min_samples=1,
            rope_positions=loaded.rope_positions, **options,
        )
    except UsageError as error:
        raise UsageError(f"--eval-dataset {name}: {error}") from None


def split_for_evaluation(config: Any, dataset: Any, eval_source: Any | None, model: torch.nn.Module, attention: str,
                         min_training_rows: int) -> tuple[Any, Any | None]:
    """(training dataset, eval dataset or None) of the run.

    --eval-dataset: `eval_source` packed as the training rows are (--packing), training unchanged.
    --eval-fraction: a share of the training rows (whole samples, packed or not) held out by
    --seed; training uses the rest. Raises UsageError when too few rows are left to train on.
    """
    evaluation = config.evaluation
    if evaluation.eval_strategy == "no":
        return dataset, None
    if eval_source is not None:
        packed = pack_for_model(eval_source, config.data.packing, None, model, attention, config.data.seq_len, 1, {})
        return dataset, packed
    if not evaluation.eval_fraction:
        return dataset, None
    if len(dataset) < 2:
        raise UsageError(f"--eval-fraction {evaluation.eval_fraction}: the training data has {len(dataset)} sample(s),"
                         " none to spare; add data or give --eval-dataset")
    train_rows, eval_rows = held_out_indices(len(dataset), evaluation.eval_fraction, config.training.seed)
    if len(train_rows) < min_training_rows:
        raise UsageError(
            f"--eval-fraction {evaluation.eval_fraction} holds out {len(eval_rows)} of {len(dataset)} samples and leaves"
            f" {len(train_rows)}, fewer than one effective batch ({min_training_rows}); lower --eval-fraction or the"
            " batch, or give --eval-dataset"
        )
    return SampleView(dataset, train_rows, "training"), SampleView(dataset, eval_rows, "evaluation")


# ---------------------------------------------------------------------------
# Evaluating
# ---------------------------------------------------------------------------


@dataclass
class EvalResult:
    step: int
    loss: float
    """Summed token loss of the eval set / its target tokens."""
    target_tokens: int
    samples: int
    """Whole samples evaluated (packed rows count each of theirs)."""
    batch_size: int
    """The eval batch at the end (lower than asked after an out-of-memory split)."""
    seconds: float
    events: list[dict] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    """The task's metrics (memfit.tasks.metrics: accuracy, F1, MCC, AUROC, MSE, Pearson, ...), by name."""

    @property
    def perplexity(self) -> float:
        try:
            return math.exp(self.loss)
        except OverflowError:
            return math.inf

    def record(self) -> dict[str, Any]:
        """The metrics line: {"event": "eval", "step", "eval_loss", "eval_perplexity", ...}."""
        return {
            "event": "eval",
            "step": self.step,
            "eval_loss": self.loss,
            "eval_perplexity": self.perplexity,
            "eval_tokens": self.target_tokens,
            "eval_samples": self.samples,
            "eval_batch_size": self.batch_size,
            "eval_seconds": round(self.seconds, 3),
            **{f"eval_{name}": value for name, value in self.metrics.items()},
        }


class Evaluator:
    """Evaluates a model on a fixed set of samples; holds the eval batch size that OOM recovery lowers.

    Build it with `Evaluator.from_session`. `evaluate()` can be called on its own (tests, a
    library user); `maybe_run` and `publish` are what the training loop calls.
    """

    def __init__(self, model: torch.nn.Module, samples: Any, device: torch.device, precision, collate, loss_fn,
                 loss_chunk_size: int, batch_size: int, oom_recovery: bool = True, tracker=None, task=None):
        self.model = model
        self.samples = samples
        self.device = device
        self.precision = precision
        self.collate = collate
        self.loss_fn = loss_fn
        self.loss_chunk_size = loss_chunk_size
        self.batch_size = batch_size
        self.oom_recovery = oom_recovery
        self.tracker = tracker
        self.task = task or Task()  # counts the loss's units, masks (masked LM) and streams the metrics
        # What the loop sets (from_session): when to run, where to keep the best model.
        self.every = 0
        self.total_steps = 0
        self.save_best = False
        self.session = None
        self.best: dict[str, Any] | None = None
        self.last: EvalResult | None = None

    @classmethod
    def from_session(cls, session: Any, runner: Any, tracker=None, resumed: bool = False) -> Evaluator | None:
        """The evaluator of a training session (None without an eval set): the step's model, loss and collate."""
        eval_set = getattr(session, "eval_dataset", None)
        if eval_set is None:
            return None
        evaluation = session.config.evaluation
        evaluator = cls(
            model=runner.model,
            samples=eval_set,
            device=session.device,
            precision=session.precision,
            collate=runner.prefetcher.collate,  # training's own: packed positions, padding, mask dropping
            loss_fn=runner.loss_fn,
            loss_chunk_size=runner.loss_chunk_size,
            batch_size=evaluation.eval_batch_size or runner.micro_batch_size,
            # One rank splitting alone would run more forwards than the others, and wrappers that sync in forward
            # (DDP's buffers, FSDP2's gathers) would wait on each other: with several ranks an eval OOM is fatal.
            oom_recovery=(session.config.memory.oom_recovery and session.engine.recovers_from_oom
                          and session.dist.world_size == 1),
            tracker=tracker,
            task=runner.task,
        )
        evaluator.every = (
            max(1, session.schedule.steps_per_epoch) if evaluation.eval_strategy == "epoch" else evaluation.eval_every
        )
        evaluator.total_steps = session.total_steps
        evaluator.save_best = evaluation.save_best
        evaluator.session = session
        if resumed:
            evaluator.best = read_best(session.output_dir)
        return evaluator

    # -- when -------------------------------------------------------------

    def due(self, step: int) -> bool:
        """Evaluate after optimizer step `step` (1-based): every --eval-every steps, and after the last."""
        return step == self.total_steps or (self.every > 0 and step % self.every == 0)

    def maybe_run(self, step: int) -> EvalResult | None:
        return self.evaluate(step) if self.due(step) else None

    # -- the forward passes -------------------------------------------------

    def evaluate(self, step: int = 0) -> EvalResult:
        """Loss of the whole eval set, token-weighted; the model's train/eval mode is restored after."""
        started = time.perf_counter()
        events: list[dict] = []
        count = len(self.samples)
        target_tokens = 0
        was_training = self.model.training
        self.model.eval()  # dropout off: the eval loss is a function of the weights only
        # float64 sums on the device (one read at the end); MPS has no float64.
        total = torch.zeros((), dtype=torch.float32 if self.device.type == "mps" else torch.float64, device=self.device)
        pending = deque((start, min(start + self.batch_size, count)) for start in range(0, count, self.batch_size))
        stream = self.task.metric_stream()  # per-sample predictions on the host, never logits across batches
        try:
            while pending:
                start, end = pending.popleft()
                pieces = self.task.prepare([self.samples[i] for i in range(start, end)], range(start, end),
                                           EVAL_STEP)
                try:
                    total += self._loss_sum(pieces, stream).to(total.dtype)
                    target_tokens += sum(self.task.count(sample) for sample in pieces)
                    continue
                except Exception as error:  # only out-of-memory is handled; the rest propagates
                    if not (is_out_of_memory(error) and self.oom_recovery):
                        raise
                    failure = str(error).strip().splitlines()[0][:200] if str(error).strip() else type(error).__name__
                del pieces  # the failed attempt's tensors go with the exception, out of scope here
                _release_memory(self.device)
                events.append(self._recover(failure, start, end, pending))
        finally:
            self.model.train(was_training)
        from memfit.distributed.context_parallel import sum_over_context_group

        total = sum_over_context_group(total)  # --context-parallel: each rank summed its shard of every row
        loss = float(total.item()) / max(target_tokens, 1)
        samples = int(getattr(self.samples, "num_samples", count))  # packed rows hold several
        result = EvalResult(step, loss, target_tokens, samples, self.batch_size, time.perf_counter() - started, events,
                            stream.result() if stream is not None else {})
        self.last = result
        return result

    def _loss_sum(self, samples: list[dict], stream=None) -> torch.Tensor:
        batch = {name: tensor.to(self.device, non_blocking=True) for name, tensor in self.collate(samples).items()}
        phase = self.tracker.phase("eval") if self.tracker is not None else contextlib.nullcontext()
        with torch.no_grad(), phase, self.precision.autocast(self.device):
            if stream is not None:  # the task's metrics: one forward gives the loss and the predictions
                return self.task.eval_loss_sum(self.model, batch, stream).detach()
            loss_sum = self.loss_fn(
                self.model, batch["input_ids"], batch["labels"], batch.get("attention_mask"), self.loss_chunk_size,
                **packed_positions(batch),
            )
        return loss_sum.detach()

    def _recover(self, failure: str, start: int, end: int, pending: deque) -> dict:
        """Split the failed piece (and the rest) to half its size, or chunk the loss for one sample."""
        size = end - start
        if size > 1:
            old = self.batch_size
            self.batch_size = min(self.batch_size, (size + 1) // 2)
            rest = [(start, end)] + list(pending)
            pending.clear()
            for first, last in rest:
                pending.extend((s, min(s + self.batch_size, last)) for s in range(first, last, self.batch_size))
            message = (f"out of memory in evaluation on a batch of {size}: eval batch now {self.batch_size} (was {old});"
                       " training's micro-batch is unchanged")
            event = {"event": "oom", "phase": "eval", "error": failure, "old_eval_batch_size": old,
                     "new_eval_batch_size": self.batch_size, "message": message}
        elif self.loss_chunk_size == 0:
            self.loss_chunk_size = DEFAULT_LOSS_CHUNK_TOKENS
            pending.appendleft((start, end))
            message = f"out of memory in evaluation on one sample: chunked loss on ({DEFAULT_LOSS_CHUNK_TOKENS} tokens per chunk)"
            event = {"event": "oom", "phase": "eval", "error": failure, "action": "chunked loss", "message": message}
        else:
            raise DoesNotFitError(
                f"out of memory in evaluation on one sample, with the chunked loss ({failure}); lower --seq-len or"
                " evaluate on shorter samples"
            )
        log.warning("memfit: %s", message)
        return event

    # -- results -------------------------------------------------------------

    def publish(self, result: EvalResult, logger, progress=None) -> None:
        """Log the eval line (and its OOM events), show it, and keep the best model when asked."""
        for event in result.events:
            logger.log({"step": result.step, **event})
        logger.log(result.record())
        if progress is not None:
            # The task words it: perplexity over target tokens for a causal LM, accuracy/F1/... over samples for a classifier.
            progress.evaluation(result.step, self.task.eval_status(result.record()))
        if self.save_best and (self.best is None or result.loss < self.best["eval_loss"]):
            self._save_best(result)

    def _save_best(self, result: EvalResult) -> None:
        session = self.session
        output_dir = Path(session.output_dir)
        # The engine's final-model path: gathered from every rank, written to a temporary directory and renamed.
        session.engine.save_final_model(output_dir / BEST_DIR, session.loaded.tokenizer)
        self.best = {"step": result.step, "eval_loss": result.loss, "eval_perplexity": result.perplexity}
        if session.dist.is_main:
            write_best(output_dir, self.best)
            log.info("memfit: best eval loss so far (%.4f at step %d): model saved to %s", result.loss, result.step,
                     output_dir / BEST_DIR)

    def summary(self) -> dict[str, Any]:
        """Fields of the run's summary line: the last eval and the best one kept."""
        if self.last is None:
            return {}
        summary = {"eval_loss": self.last.loss, "eval_perplexity": self.last.perplexity, "eval_step": self.last.step,
                   "eval_tokens": self.last.target_tokens, "eval_samples": self.last.samples,
                   **{f"eval_{name}": value for name, value in self.last.metrics.items()}}
        if self.save_best and self.best is not None:
            summary |= {"best_eval_loss": self.best["eval_loss"], "best_eval_step": self.best["step"],
                        "best_dir": str(Path(self.session.output_dir) / BEST_DIR)}
        return summary


def read_best(output_dir: str | Path) -> dict[str, Any] | None:
    """best.json of a run directory ({"step", "eval_loss", ...}), or None when there is none (or it is unreadable)."""
    path = Path(output_dir) / BEST_FILE
    try:
        best = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return best if isinstance(best, dict) and "step" in best and "eval_loss" in best else None


def write_best(output_dir: str | Path, best: dict[str, Any]) -> Path:
    """Write best.json atomically (a temporary file renamed over it)."""
    path = Path(output_dir) / BEST_FILE
    temporary = path.with_name(f".tmp-{BEST_FILE}-{os.getpid()}")
    temporary.write_text(json.dumps(best, indent=2))
    with open(temporary, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(temporary, path)
    return path


def _release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
