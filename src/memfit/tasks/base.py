"""The Task seam: what is learned, and everything about it the step, evaluation and setup ask.

A task decides:
- `auto_class`: the transformers class that loads the model (AutoModelForCausalLM, ...ForSequenceClassification);
- `loss_function(default)`: how a micro-batch becomes a loss *sum* (fp32), with the signature of
  techniques.loss.causal_lm_loss_sum: `(model, input_ids, labels, attention_mask, chunk_size, **positions)`;
- `count(sample)`: the units that sum is normalised by (target tokens for token tasks, 1 a sample for
  sequence tasks), so any split of an effective batch into micro-batches, OOM halves included, gives
  the same update;
- `collate`, `prepare` (the masked LM's masks), `load_data` (tables or text), and the metrics
  evaluation streams (tasks.metrics);
- what the run says about itself: `eval_metrics` and `unit` (what an eval line reports and over what),
  `facts()` (the metrics' start and summary lines), `eval_status`, `eval_scores`, `eval_count` and
  `describe_data` (the console, the run summary and the HTML report word the task's results with these:
  accuracy, F1, MCC and AUROC over samples for a classifier, perplexity over target tokens for a causal LM).
The step, the OOM split, accumulation, evaluation and the report call these; none branches on a task's name.
The wording methods are class methods: the report asks the class named in a run's metrics, with no config.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from memfit.data import collate, load_training_data
from memfit.tasks.metrics import METRIC_LABELS, format_metric
from memfit.techniques.loss import count_target_tokens

LossFunction = Callable[..., torch.Tensor]


class Task:
    """Causal language modelling, the default: next-token cross-entropy over the target tokens."""

    name = "causal-lm"
    auto_class = "AutoModelForCausalLM"
    unit = "target tokens"
    """What `count` counts (the loss is normalised per one of them, and an eval loss is averaged over them)."""
    label_kind: str | None = None
    """What tables.load_table reads from label columns; None: the text and fine-tuning formats (memfit.data)."""
    sequence_level = False
    """Whether a sample carries one label (pooled head): no packing, no vocabulary logits to chunk."""
    peft_task_type = "CAUSAL_LM"
    """PEFT's task type under --lora-r (techniques.lora): SEQ_CLS/TOKEN_CLS train the head in full."""
    eval_metrics: tuple[str, ...] = ("perplexity",)
    """What an eval line reports beside the loss, in the order it is shown (each is the line's eval_<name> field;
    tasks.metrics.METRIC_LABELS names them): perplexity where a token is predicted from a vocabulary, the metric
    stream's measures (accuracy, F1, ...) elsewhere. A name the line lacks (no scikit-learn, AUROC of one class) is
    left out."""
    eval_count_field = "eval_tokens"
    """The eval line's field that counts the `unit`s the eval loss is averaged over (eval_samples for sequence tasks)."""

    def __init__(self, config: Any = None):
        self.config = config

    # -- the model -----------------------------------------------------------

    def model_config(self) -> dict[str, Any]:
        """Settings of the transformers config the head needs (num_labels, id2label, problem_type)."""
        return {}

    def prepare_model(self, model: torch.nn.Module, tokenizer: Any) -> None:
        """Last touches on a loaded model (a decoder's classification head pools at the last non-pad token)."""

    head_modules: tuple[str, ...] = ()
    """Names of the modules the task's head adds to the checkpoint's model (newly initialised, trained in full)."""

    def keep_head_unquantized(self, quantization: Any) -> None:
        """Keep the head's new modules out of --quantize: bitsandbytes quantizes weights as they load, and a module
        the checkpoint lacks is initialised instead, left in a state its 4-bit forward cannot run."""
        if quantization is not None and self.head_modules:
            quantization.llm_int8_skip_modules = list(self.head_modules)

    # -- the data --------------------------------------------------------------

    def load_data(self, data_config: Any, tokenizer: Any, *, role: str = "training", **options: Any) -> Any:
        """The samples of `data_config.dataset` (`role`: training or evaluation); UsageError for bad data."""
        return load_training_data(data_config, tokenizer, **options)

    def prepare(self, samples: list[dict], indices: Sequence[int], step: int) -> list[dict]:
        """The samples as the step trains on them at optimizer step `step` (masked LM masks them)."""
        return samples

    def collate(self, samples: Sequence[dict], pad_token_id: int | None) -> dict[str, torch.Tensor]:
        return collate(samples, pad_token_id)

    def row_positions(self, samples: Sequence[dict]) -> int:
        """Positions the model runs for a micro-batch of `samples`, padding included (the step's padding_tokens):
        one row a sample, as wide as the longest. A task that packs its micro-batches counts its packed rows."""
        return len(samples) * max(int(s["input_ids"].numel()) for s in samples)

    # -- the loss --------------------------------------------------------------

    def count(self, sample: dict) -> int:
        """Units of the loss in one sample (its loss sum is divided by the effective batch's total)."""
        return count_target_tokens(sample["labels"][None])

    prepares_on_policy = False
    """The task's `prepare` reads the model as it is at the step (online RL's rollout): the loop prepares each
    step's samples right before the step, never during the step before (where other tasks overlap it)."""

    def items_per_step(self, effective_batch: int) -> int:
        """Data items the schedule gives an optimizer step whose effective batch is `effective_batch` samples (the
        same, but for a task whose `prepare` makes several samples of an item: online RL's completions)."""
        return effective_batch

    def after_data_loaded(self, dist: Any) -> None:
        """Work on the loaded data that every rank does together, once all have loaded it (`dist`: the run's
        DistContext; a preference task's shared reference pass). Nothing by default."""

    def loss_function(self, default: LossFunction) -> LossFunction:
        """The loss the step runs: `default` is memfit's causal loss (fused or compiled where they run)."""
        return default

    def loss_inputs(self, batch: dict) -> dict[str, Any]:
        """What the task's loss reads of a collated batch beyond input_ids, labels, the mask and packed positions,
        as keyword arguments (a preference task's pairs and reference log-probabilities); nothing by default."""
        return {}

    def step_metrics(self) -> dict[str, Any]:
        """What the task measured of its training steps since it was last asked (a preference task's rewards and
        log-probabilities, under TRL's names), for the step's metrics line; then forgotten. Nothing by default."""
        return {}

    def metric_stream(self) -> Any:
        """A stream of per-sample predictions for one evaluation (tasks.metrics), or None: loss and perplexity only."""
        return None

    def eval_loss_sum(self, model: torch.nn.Module, batch: dict, stream: Any) -> torch.Tensor:
        """An eval batch's loss sum, its predictions added to `stream` (only called when metric_stream gave one)."""
        raise NotImplementedError

    # -- what cannot apply -------------------------------------------------------

    def refusals(self, config: Any) -> list[str]:
        """Settings this task cannot honour, one line each (build_session raises them before anything is written)."""
        return []

    def describe(self) -> str:
        return f"{self.name} ({self.auto_class}; loss normalised per {self.unit.removesuffix('s')})"

    # -- what the run says about the task (console, run summary, HTML report) ------------------

    def facts(self) -> dict[str, Any]:
        """What the metrics' start and summary lines record about the task (the report's task row)."""
        return {"name": self.name, "head": self.auto_class, "loss_per": self.unit.removesuffix("s"),
                "eval_metrics": list(self.eval_metrics)}

    @classmethod
    def eval_scores(cls, record: dict[str, Any]) -> list[str]:
        """The task's measures an eval line (or the run's summary) carries, worded: ["accuracy 0.9", "F1 0.8976"]."""
        return [f"{METRIC_LABELS.get(name, name)} {format_metric(name, record[f'eval_{name}'])}"
                for name in cls.eval_metrics if record.get(f"eval_{name}") is not None]

    @classmethod
    def step_scores(cls, record: dict[str, Any]) -> list[str]:
        """The task's measures a training step's line carries (its `step_metrics` under the eval metrics' names),
        worded for the progress line: ["rewards/accuracies 0.75", "rewards/margins 0.1234"]."""
        return [f"{METRIC_LABELS.get(name, name)} {format_metric(name, record[name])}"
                for name in cls.eval_metrics if isinstance(record.get(name), int | float)]

    @classmethod
    def eval_count(cls, record: dict[str, Any]) -> str:
        """What the eval loss was averaged over: "80 samples", "12,345 target tokens" ("" when the line lacks it)."""
        count = record.get(cls.eval_count_field)
        return f"{count:,} {cls.unit}" if isinstance(count, int) and not isinstance(count, bool) else ""

    @classmethod
    def eval_status(cls, record: dict[str, Any]) -> str:
        """The console's eval line: "eval loss 0.4745 over 80 samples | accuracy 0.9 | F1 0.8976 | MCC 0.86 | ..."."""
        count = cls.eval_count(record)
        head = f"eval loss {record['eval_loss']:.4f}" + (f" over {count}" if count else "")
        return " | ".join([head, *cls.eval_scores(record)])

    @classmethod
    def describe_data(cls, facts: dict[str, Any]) -> str:
        """The data facts of the metrics' start line (data.samples.dataset_facts) in words: the report's data row."""
        from memfit.data.samples import describe_facts

        return describe_facts(facts)
