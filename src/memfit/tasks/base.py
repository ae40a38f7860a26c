"""The Task seam: what is learned, and everything about it the step, evaluation and setup ask.

A task decides:
- `auto_class`: the transformers class that loads the model (AutoModelForCausalLM, ...ForSequenceClassification);
- `loss_function(default)`: how a micro-batch becomes a loss *sum* (fp32), with the signature of
  techniques.loss.causal_lm_loss_sum: `(model, input_ids, labels, attention_mask, chunk_size, **positions)`;
- `count(sample)`: the units that sum is normalised by (target tokens for token tasks, 1 a sample for
  sequence tasks), so any split of an effective batch into micro-batches, OOM halves included, gives
  the same update;
- `collate`, `prepare` (the masked LM's masks), `load_data` (tables or text), and the metrics
  evaluation streams (tasks.metrics).
The step, the OOM split, accumulation and evaluation call these; none branches on a task's name.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from memfit.data import collate, load_training_data
from memfit.techniques.loss import count_target_tokens

LossFunction = Callable[..., torch.Tensor]


class Task:
    """Causal language modelling, the default: next-token cross-entropy over the target tokens."""

    name = "causal-lm"
    auto_class = "AutoModelForCausalLM"
    unit = "target tokens"
    """What `count` counts, for the log."""
    label_kind: str | None = None
    """What tables.load_table reads from label columns; None: the text and fine-tuning formats (memfit.data)."""
    sequence_level = False
    peft_task_type = "CAUSAL_LM"
    """PEFT's task type under --lora-r (techniques.lora): SEQ_CLS/TOKEN_CLS train the head in full."""
    """Whether a sample carries one label (pooled head): no packing, no vocabulary logits to chunk."""

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

    # -- the loss --------------------------------------------------------------

    def count(self, sample: dict) -> int:
        """Units of the loss in one sample (its loss sum is divided by the effective batch's total)."""
        return count_target_tokens(sample["labels"][None])

    def loss_function(self, default: LossFunction) -> LossFunction:
        """The loss the step runs: `default` is memfit's causal loss (fused or compiled where they run)."""
        return default

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
