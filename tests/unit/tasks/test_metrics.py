"""Evaluation streams each task's metrics (scikit-learn, scipy) into the eval lines and the summary."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memfit.config_loading import load_config
from memfit.tasks.metrics import MetricStream
from memfit.train.loop import train
from memfit.train.metrics import read_metrics
from tiny_encoders import dna_rows, dna_tokenizer, write_csv


def test_streamed_batches_give_the_metrics_of_the_whole_set():
    generator = torch.Generator().manual_seed(0)
    logits, labels = torch.randn(30, 3, generator=generator), torch.randint(0, 3, (30,), generator=generator)
    whole, batched = MetricStream("single-label"), MetricStream("single-label")
    whole.add(logits, labels)
    for start in range(0, 30, 7):
        batched.add(logits[start : start + 7], labels[start : start + 7])
    assert batched.result() == pytest.approx(whole.result())
    assert whole.result()["accuracy"] == pytest.approx(float((logits.argmax(-1) == labels).float().mean()))
    values = torch.randn(20, 1, generator=generator)
    regression = MetricStream("regression")
    regression.add(values, 2 * values + 1)  # a perfect linear relation
    found = regression.result()
    assert found["pearson"] == pytest.approx(1.0) and found["spearman"] == pytest.approx(1.0)
    assert found["mse"] == pytest.approx(float(((values + 1) ** 2).mean()), rel=1e-5)


def _run(model_dir, train_csv, eval_csv, out, task, fields="label", **extra):
    config = load_config(overrides=dict(model=str(model_dir), dataset=str(train_csv), eval_dataset=str(eval_csv),
                                        task=task, label_fields=fields, seq_len=64, batch_size=4, max_steps=3,
                                        lr=3e-3, output_dir=str(out), report=False) | extra)
    train(config)
    records = read_metrics(out / "metrics.jsonl")
    return [r for r in records if r.get("event") == "eval"][-1], [r for r in records if r.get("event") == "summary"][-1]


def test_classification_metrics_match_the_saved_model_on_the_eval_rows(encoder_dirs, dna_csv, tmp_path):
    from transformers import AutoModelForSequenceClassification

    rows = dna_rows(12, seed=5)
    eval_csv = write_csv(tmp_path / "eval.csv", rows)
    line, summary = _run(encoder_dirs["bert"], dna_csv, eval_csv, tmp_path / "run", "sequence-classification",
                         eval_batch_size=5)
    model = AutoModelForSequenceClassification.from_pretrained(tmp_path / "run" / "final").eval()
    tokenizer, names = dna_tokenizer(), model.config.label2id
    with torch.no_grad():
        predicted = [int(model(**tokenizer(r["sequence"], return_tensors="pt")).logits.argmax()) for r in rows]
    truth = [names[r["label"]] for r in rows]
    assert line["eval_accuracy"] == pytest.approx(float(np.mean(np.array(predicted) == np.array(truth))))
    for name in ("eval_f1", "eval_mcc", "eval_auroc"):
        assert name in line and summary[name] == line[name]


@pytest.mark.parametrize(("task", "fields", "expected"), [
    ("regression", "value", {"eval_mse", "eval_pearson", "eval_spearman", "eval_r2"}),
    ("token-classification", "tags", {"eval_accuracy", "eval_f1", "eval_mcc"}),
    ("sequence-classification", "a,b", {"eval_f1_micro", "eval_f1_macro", "eval_accuracy"}),
])
def test_each_task_reports_its_metrics(encoder_dirs, dna_csv, tmp_path, task, fields, expected):
    eval_csv = write_csv(tmp_path / "eval.csv", dna_rows(10, seed=3))
    one, _ = _run(encoder_dirs["esm"], dna_csv, eval_csv, tmp_path / "one", task, fields, eval_batch_size=1)
    many, _ = _run(encoder_dirs["esm"], dna_csv, eval_csv, tmp_path / "many", task, fields, eval_batch_size=10)
    assert expected <= set(one)
    # How the eval set is cut into batches changes neither the loss nor the metrics.
    assert many["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)
    for name in expected:
        assert many[name] == pytest.approx(one[name], rel=1e-4, abs=1e-6)
