"""The metrics evaluation streams for each task, computed by scikit-learn and scipy.

Streamed: after each eval batch only per-sample predictions go to the host (class probabilities
of a sequence, the predicted class of each labelled token, a regression value), never the
logits of a batch kept across batches on the device. The metrics are computed once at the end,
from those host arrays:

- single-label classification: accuracy, F1 (binary: of class 1; more classes: macro), MCC,
  AUROC (binary; one-vs-rest macro when every class occurs in the eval set);
- multi-label: F1 micro and macro at --threshold, subset accuracy, AUROC macro;
- regression: MSE, Pearson and Spearman correlation (averaged over targets), R²;
- token classification: accuracy, F1 macro and MCC over the labelled tokens;
- masked LM: perplexity, which is exp(eval loss) and already in every eval line.
A metric that cannot be computed (AUROC with one class present) is left out, not guessed.
"""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

log = logging.getLogger("memfit")
METRIC_NAMES = ("accuracy", "f1", "f1_micro", "f1_macro", "mcc", "auroc", "mse", "r2", "pearson", "spearman")
"""Every metric a stream may report; eval lines carry each as eval_<name>."""
METRIC_LABELS = {"accuracy": "accuracy", "f1": "F1", "f1_micro": "F1 micro", "f1_macro": "F1 macro", "mcc": "MCC",
                 "auroc": "AUROC", "mse": "MSE", "r2": "R2", "pearson": "Pearson", "spearman": "Spearman",
                 "perplexity": "perplexity"}
"""How the console, the run summary and the report name each metric (ASCII: a console may not print more)."""
MISSING_NOTE = "scikit-learn is not installed: evaluation reports the loss only (pip install 'memfit[tasks]')"


def format_metric(name: str, value: object) -> str:
    """One metric's value as the console, the summary and the report print it ("inf" stays a word)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return str(value)  # a perplexity past exp's range is "inf" in the JSON lines
    if name == "perplexity":
        return f"{value:,.2f}" if math.isfinite(value) else "inf"
    return f"{value:.4g}"


def sklearn_available() -> bool:
    try:
        import sklearn  # noqa: F401
    except ImportError:
        return False
    return True


class MetricStream:
    """Per-sample predictions of one evaluation, gathered on the host; `result()` computes the metrics."""

    def __init__(self, kind: str, threshold: float = 0.5):
        self.kind = kind  # single-label, multi-label, regression, tokens
        self.threshold = threshold
        self.predictions: list[np.ndarray] = []
        self.labels: list[np.ndarray] = []

    def add(self, logits: torch.Tensor, labels: torch.Tensor) -> None:
        """One batch: `logits` as the head returns them, `labels` as the batch holds them."""
        logits = logits.detach().float()
        if self.kind == "single-label":
            prediction = torch.softmax(logits, dim=-1)
        elif self.kind == "multi-label":
            prediction = torch.sigmoid(logits)
        elif self.kind == "regression":
            prediction = logits.reshape(labels.shape[0], -1)
            labels = labels.reshape(labels.shape[0], -1)
        else:  # tokens: only the labelled positions, as class ids
            keep = labels != -100
            prediction, labels = logits.argmax(dim=-1)[keep], labels[keep]
        self.predictions.append(prediction.cpu().numpy())
        self.labels.append(labels.detach().cpu().numpy())

    def result(self) -> dict[str, float]:
        if not self.predictions:
            return {}
        predictions, labels = np.concatenate(self.predictions), np.concatenate(self.labels)
        compute = {"single-label": _single_label, "multi-label": self._multi_label, "regression": _regression,
                   "tokens": _tokens}[self.kind]
        return {name: float(value) for name, value in compute(predictions, labels).items() if math.isfinite(value)}

    def _multi_label(self, probabilities: np.ndarray, labels: np.ndarray) -> dict[str, float]:
        from sklearn.metrics import accuracy_score, f1_score, roc_auc_score

        predicted = (probabilities >= self.threshold).astype(int)
        truth = labels.astype(int)
        found = {"accuracy": accuracy_score(truth, predicted),
                 "f1_micro": f1_score(truth, predicted, average="micro", zero_division=0),
                 "f1_macro": f1_score(truth, predicted, average="macro", zero_division=0)}
        if all(0 < truth[:, j].sum() < len(truth) for j in range(truth.shape[1])):
            found["auroc"] = roc_auc_score(truth, probabilities, average="macro")
        return found


def _single_label(probabilities: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef, roc_auc_score

    predicted = probabilities.argmax(axis=-1)
    classes = probabilities.shape[-1]
    binary = classes == 2
    found = {"accuracy": accuracy_score(labels, predicted),
             "f1": f1_score(labels, predicted, average="binary" if binary else "macro", zero_division=0),
             "mcc": matthews_corrcoef(labels, predicted)}
    present = np.unique(labels)
    if binary and len(present) == 2:
        found["auroc"] = roc_auc_score(labels, probabilities[:, 1])
    elif len(present) == classes > 2:
        found["auroc"] = roc_auc_score(labels, probabilities, multi_class="ovr", average="macro")
    return found


def _regression(predictions: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import mean_squared_error, r2_score

    found = {"mse": mean_squared_error(labels, predictions), "r2": r2_score(labels, predictions)}
    if len(labels) > 1:
        varied = [j for j in range(labels.shape[1]) if np.ptp(labels[:, j]) > 0 and np.ptp(predictions[:, j]) > 0]
        if varied:
            found["pearson"] = float(np.mean([pearsonr(predictions[:, j], labels[:, j])[0] for j in varied]))
            found["spearman"] = float(np.mean([spearmanr(predictions[:, j], labels[:, j])[0] for j in varied]))
    return found


def _tokens(predicted: np.ndarray, labels: np.ndarray) -> dict[str, float]:
    from sklearn.metrics import accuracy_score, f1_score, matthews_corrcoef

    return {"accuracy": accuracy_score(labels, predicted),
            "f1": f1_score(labels, predicted, average="macro", zero_division=0),
            "mcc": matthews_corrcoef(labels, predicted)}
