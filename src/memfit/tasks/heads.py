"""Tasks with a head other than the causal LM's: sequence classification, regression, token
classification and masked LM (memfit.tasks.base.Task says what each method means).

Losses are sums in fp32, normalised by the step: per sample for sequence tasks (cross-entropy;
mean squared error averaged over the targets of a sample; binary cross-entropy averaged over
the labels of a sample), per target token for token tasks. Divided by the batch's count they
equal the Hugging Face models' own mean losses, so a run matches the Trainer's.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memfit.data import collate, load_training_data
from memfit.data.tables import LabelSpec, is_table, label_spec, load_table
from memfit.errors import UsageError
from memfit.tasks.base import LossFunction, Task
from memfit.tasks.masking import EVAL_STEP, IGNORE_INDEX, mask_tokens
from memfit.tasks.metrics import MISSING_NOTE, MetricStream, sklearn_available
from memfit.techniques.loss import final_hidden_states, unwrap_causal_lm

log = logging.getLogger("memfit")


def _labels_list(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


def _logits(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
            positions: dict) -> torch.Tensor:
    return model(input_ids=input_ids, attention_mask=attention_mask, **positions).logits


class TableTask(Task):
    """A task whose data is a sequence/label table (memfit.data.tables)."""

    label_kind = "class"

    def __init__(self, config: Any):
        super().__init__(config)
        self.spec: LabelSpec | None = None
        self._warned = False

    @property
    def fields(self) -> list[str]:
        return _labels_list(self.config.task.label_fields) or ["label"]

    def read_labels(self, dataset: str | None) -> None:
        """The label space, from the training table, before the model (whose head it sizes) loads."""
        if not is_table(dataset) and not (dataset or "").startswith("hf:"):
            raise UsageError(f"--task {self.name} reads a table of sequences and labels (.csv, .tsv, .jsonl, .parquet,"
                             f" FASTA or hf:NAME); got --dataset {dataset or '(the bundled text corpus)'}")
        task = self.config.task
        self.spec = label_spec(dataset, self.label_kind, self.fields, task.sequence_field,
                               _labels_list(task.label_names) or None, task.num_labels, task.label_table, task.id_field)

    def model_config(self) -> dict[str, Any]:
        names = self.spec.names if self.spec is not None else []
        return {"num_labels": max(1, len(names)), "id2label": dict(enumerate(names)),
                "label2id": {name: i for i, name in enumerate(names)}}

    def prepare_model(self, model: torch.nn.Module, tokenizer: Any) -> None:
        # Decoders with a classification head (LlamaForSequenceClassification) pool at the last token that is not
        # padding: they need the pad id in their config, which causal-LM checkpoints often leave out.
        if getattr(model.config, "pad_token_id", None) is None and getattr(tokenizer, "pad_token_id", None) is not None:
            model.config.pad_token_id = tokenizer.pad_token_id

    def load_data(self, data_config: Any, tokenizer: Any, *, role: str = "training", min_samples: int = 1,
                  max_positions: int | None = None, say: bool = True, **_: Any) -> Any:
        if max_positions is not None and data_config.seq_len is not None and data_config.seq_len > max_positions:
            raise UsageError(f"--seq-len {data_config.seq_len} is too long: the model handles at most {max_positions}"
                             " positions; lower --seq-len")
        try:  # --seq-len not given: from the rows' lengths, within the model's positions
            return load_table(data_config.dataset, self.spec, tokenizer, sequence_field=self.config.task.sequence_field,
                              seq_len=data_config.seq_len, truncate=data_config.truncate, min_samples=min_samples,
                              role=role, label_table=self.config.task.label_table, id_field=self.config.task.id_field,
                              allow_drop=data_config.allow_drop, max_positions=max_positions, say=say)
        except UsageError as error:
            raise UsageError(f"{role} data: {error}") from None

    metric_kind: str | None = None
    """What tasks.metrics.MetricStream computes for this task (None: the loss and perplexity only)."""

    def metric_stream(self) -> MetricStream | None:
        """A fresh stream of per-sample predictions for one evaluation, or None (no metrics beyond the loss)."""
        if self.metric_kind is None:
            return None
        if not sklearn_available():
            if not self._warned:
                log.warning("memfit: %s", MISSING_NOTE)
                self._warned = True
            return None
        return MetricStream(self.metric_kind, self.config.task.threshold)

    def eval_loss_sum(self, model: torch.nn.Module, batch: dict, stream: MetricStream) -> torch.Tensor:
        """The loss sum of an eval batch, its predictions added to `stream` (one forward)."""
        logits = _logits(model, batch["input_ids"], batch.get("attention_mask"), {})
        stream.add(logits, batch["labels"])
        return self.loss_from_logits(logits, batch["labels"])

    def loss_from_logits(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def loss_function(self, default: LossFunction) -> LossFunction:
        def loss_sum(model, input_ids, labels, attention_mask=None, chunk_size=0, **positions) -> torch.Tensor:
            return self.loss_from_logits(_logits(model, input_ids, attention_mask, positions), labels)

        return loss_sum

    def facts(self) -> dict[str, Any]:
        facts = super().facts()
        if self.spec is not None:  # a table: one row a sample (build_task turned --packing auto off)
            facts["packing"] = "off: one table row a sample, padded to the longest of its micro-batch"
        return facts

    @classmethod
    def describe_data(cls, facts: dict[str, Any]) -> str:
        if facts.get("format") != "table":
            return super().describe_data(facts)
        return describe_table(facts)

    def refusals(self, config: Any) -> list[str]:
        found = []
        if config.data.packing in ("samples", "wrapped"):
            found.append(f"--packing {config.data.packing} puts several samples in one row; --task {self.name} reads"
                         " one sample a row: use --packing off (padding goes to the longest of each micro-batch)")
        return found


class SequenceClassificationTask(TableTask):
    """One class a sample (cross-entropy), or several 0/1 labels (--problem-type multi-label: binary cross-entropy)."""

    name = "sequence-classification"
    auto_class = "AutoModelForSequenceClassification"
    unit = "samples"
    peft_task_type = "SEQ_CLS"
    head_modules = ("classifier", "score", "pooler.dense")  # BERT/ESM classifier, BERT pooler, a decoder score
    sequence_level = True
    eval_metrics = ("accuracy", "f1", "f1_micro", "f1_macro", "mcc", "auroc")  # single-label or multi-label's
    eval_count_field = "eval_samples"

    def __init__(self, config: Any):
        super().__init__(config)
        wanted = config.task.problem_type
        self.multi_label = wanted == "multi-label" or (wanted == "auto" and len(self.fields) > 1)
        self.label_kind = "multi-label" if self.multi_label else "class"
        self.metric_kind = "multi-label" if self.multi_label else "single-label"
        self.eval_metrics = (("f1_micro", "f1_macro", "accuracy", "auroc") if self.multi_label
                             else ("accuracy", "f1", "mcc", "auroc"))

    def facts(self) -> dict[str, Any]:
        return super().facts() | {"problem": self.metric_kind}

    def model_config(self) -> dict[str, Any]:
        problem = "multi_label_classification" if self.multi_label else "single_label_classification"
        return super().model_config() | {"problem_type": problem}

    def count(self, sample: dict) -> int:
        return 1

    def collate(self, samples: Sequence[dict], pad_token_id: int | None) -> dict[str, torch.Tensor]:
        return collate_sequence_labels(samples, pad_token_id)

    def loss_from_logits(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return multi_label_loss(logits, labels) if self.multi_label else single_label_loss(logits, labels)

    def refusals(self, config: Any) -> list[str]:
        return super().refusals(config) + _no_vocabulary(self.name, config)


class RegressionTask(SequenceClassificationTask):
    """One or more numbers a sample (mean squared error over its targets)."""

    name = "regression"
    label_kind = "number"
    eval_metrics = ("mse", "r2", "pearson", "spearman")

    def __init__(self, config: Any):
        TableTask.__init__(self, config)
        self.multi_label = False
        self.metric_kind = "regression"

    def model_config(self) -> dict[str, Any]:
        names = self.spec.names if self.spec is not None else ["value"]
        return {"num_labels": len(names), "id2label": dict(enumerate(names)),
                "label2id": {name: i for i, name in enumerate(names)}, "problem_type": "regression"}

    def loss_from_logits(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return regression_loss(logits, labels)


class TokenClassificationTask(TableTask):
    """One class a word (its first token), cross-entropy normalised per labelled token."""

    name = "token-classification"
    auto_class = "AutoModelForTokenClassification"
    peft_task_type = "TOKEN_CLS"
    head_modules = ("classifier", "score")
    label_kind = "tokens"
    metric_kind = "tokens"
    unit = "labelled tokens"
    eval_metrics = ("accuracy", "f1", "mcc")

    def count(self, sample: dict) -> int:
        return int((sample["labels"] != IGNORE_INDEX).sum())

    def loss_from_logits(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return token_classification_loss(logits, labels)

    def refusals(self, config: Any) -> list[str]:
        return super().refusals(config) + _no_vocabulary(self.name, config)


class MaskedLMTask(TableTask):
    """Masked language modelling: tokens masked on the fly (tasks.masking), cross-entropy on the masked ones."""

    name = "masked-lm"
    auto_class = "AutoModelForMaskedLM"
    peft_task_type = "FEATURE_EXTRACTION"  # no new head: the adapters alone train (the LM head is tied to the embeddings)
    label_kind = "none"
    unit = "masked tokens"
    eval_metrics = ("perplexity",)  # exp of the eval loss over the masked tokens

    def __init__(self, config: Any):
        super().__init__(config)
        self.table = False
        self.mask_token_id: int | None = None
        self.vocab_size = 0
        self.special_ids: list[int] = []

    def read_labels(self, dataset: str | None) -> None:
        # A table's sequence column, or plain text cut into windows as causal LM reads it.
        self.table = is_table(dataset) and not (dataset or "").lower().endswith((".jsonl", ".json", ".parquet", ".txt"))
        if self.table:
            self.spec = LabelSpec("none", [])

    def model_config(self) -> dict[str, Any]:
        return {}

    def prepare_model(self, model: torch.nn.Module, tokenizer: Any) -> None:
        self.mask_token_id = getattr(tokenizer, "mask_token_id", None)
        if self.mask_token_id is None:
            raise UsageError("--task masked-lm needs a tokenizer with a mask token (BERT's [MASK], ESM's <mask>); pass"
                             " --tokenizer with one")
        self.vocab_size = int(model.get_input_embeddings().weight.shape[0])
        self.special_ids = sorted(set(getattr(tokenizer, "all_special_ids", [])) - {self.mask_token_id})

    def load_data(self, data_config: Any, tokenizer: Any, *, role: str = "training", **options: Any) -> Any:
        if self.table:
            return super().load_data(data_config, tokenizer, role=role, **options)
        return load_training_data(data_config, tokenizer, **options)

    def prepare(self, samples: list[dict], indices: Sequence[int], step: int) -> list[dict]:
        seed, probability = self.config.training.seed, self.config.task.mlm_probability
        prepared = []
        for sample, index in zip(samples, indices, strict=True):
            ids, labels = mask_tokens(sample["input_ids"], seed=seed, step=step, index=int(index), probability=probability,
                                      mask_token_id=self.mask_token_id, vocab_size=self.vocab_size,
                                      special_ids=self.special_ids)
            prepared.append({**sample, "input_ids": ids, "labels": labels})
        return prepared

    def eval_step(self) -> int:
        return EVAL_STEP

    def count(self, sample: dict) -> int:
        return int((sample["labels"] != IGNORE_INDEX).sum())

    def loss_function(self, default: LossFunction) -> LossFunction:
        return masked_lm_loss_sum

    def refusals(self, config: Any) -> list[str]:
        if config.data.packing == "samples":
            return ["--packing samples restricts attention through causal position ids; masked-LM encoders attend both"
                    " ways: use --packing off, or wrapped for plain text"]
        return []


_LABEL_KINDS = {"class": "classes", "multi-label": "labels", "number": "targets", "tokens": "token labels"}


def describe_table(facts: dict[str, Any]) -> str:
    """A table's data facts (data.tables: rows, samples, tokens, labels, the length policy) in words."""
    text = (f"table: {facts.get('records', 0):,} rows, {facts.get('samples_kept', 0):,} samples of <="
            f" {facts.get('seq_len')} tokens ({facts.get('tokens', 0):,} tokens)")
    labels, kind = list(facts.get("labels") or []), facts.get("label_kind")
    if kind in _LABEL_KINDS and labels:
        shown = ", ".join(map(str, labels[:10])) + (", ..." if len(labels) > 10 else "")
        text += f"; {len(labels)}{'+' if len(labels) >= 64 else ''} {_LABEL_KINDS[kind]}: {shown}"
    elif kind == "none":
        text += "; sequences only"
    if facts.get("samples_dropped_long"):
        text += f"; {facts['samples_dropped_long']:,} longer than {facts.get('seq_len')} tokens dropped"
    if facts.get("samples_truncated"):
        text += f"; {facts['samples_truncated']:,} cut to {facts.get('seq_len')} tokens"
    return text


def _no_vocabulary(name: str, config: Any) -> list[str]:
    if config.memory.loss_chunk_size:
        return [f"--loss-chunk-size chunks vocabulary logits; --task {name} has a small label head and none: drop it"]
    return []


# ---------------------------------------------------------------------------
# Batches and losses
# ---------------------------------------------------------------------------


def collate_sequence_labels(samples: Sequence[dict], pad_token_id: int | None) -> dict[str, torch.Tensor]:
    """Tokens padded to the longest sample (as memfit.data.collate pads), one label a sample stacked."""
    tokens = collate([{"input_ids": s["input_ids"], "labels": s["input_ids"]} for s in samples], pad_token_id)
    return {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"],
            "labels": torch.stack([s["labels"] for s in samples])}


def single_label_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of one class a sample."""
    return F.cross_entropy(logits.float(), labels, reduction="sum")


def multi_label_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Binary cross-entropy of each label, averaged over the labels of a sample, summed over samples."""
    logits = logits.float()
    return F.binary_cross_entropy_with_logits(logits, labels.float(), reduction="sum") / logits.shape[-1]


def regression_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Squared error averaged over the targets of a sample, summed over samples."""
    logits = logits.float()
    return F.mse_loss(logits, labels.float().reshape(logits.shape), reduction="sum") / logits.shape[-1]


def token_classification_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over the labelled tokens (no shift: a token's label is its own)."""
    logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=IGNORE_INDEX,
                           reduction="sum")


def masked_lm_loss_sum(model, input_ids, labels, attention_mask=None, chunk_size=0, **positions) -> torch.Tensor:
    """Summed cross-entropy over the masked tokens; with `chunk_size` the vocabulary logits are built a chunk at a time
    (the head's last projection recomputed in backward, as techniques.loss does for causal LMs)."""
    if chunk_size <= 0:
        logits = _logits(model, input_ids, attention_mask, positions)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")
    lm = unwrap_causal_lm(model)
    head = lm.get_output_embeddings()
    if head is None:
        raise UsageError(f"{type(lm).__name__} has no output embeddings to chunk; use --loss-chunk-size 0")
    hidden, empty_logits = final_hidden_states(model, lm, head, input_ids, attention_mask, positions.get("position_ids"))
    hidden = hidden.reshape(-1, hidden.shape[-1])
    targets = labels.reshape(-1)
    total = empty_logits.float().sum()  # exactly 0; keeps wrappers' backward hooks in the graph
    for hidden_chunk, target_chunk in zip(hidden.split(chunk_size), targets.split(chunk_size), strict=True):
        total = total + checkpoint(_chunk_cross_entropy, head, hidden_chunk, target_chunk, use_reentrant=False)
    return total


def _chunk_cross_entropy(head, hidden_chunk: torch.Tensor, target_chunk: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden_chunk).float(), target_chunk, ignore_index=IGNORE_INDEX, reduction="sum")



