"""The task words a run's results: the console's eval line, the run summary and the report ask it, never a name.

A classifier's eval reports accuracy, F1, MCC and AUROC over samples (never perplexity, never target tokens); a
regression MSE and correlations; token classification accuracy over labelled tokens; causal and masked LM keep
perplexity over their tokens. The first test reads records as they are written; the second trains a tiny DNA
classifier and reads its console, its summary and its report.
"""

from __future__ import annotations

import re

import pytest

from memfit.config_loading import load_config
from memfit.tasks import TASK_CLASSES, describe_task, task_class
from memfit.train.loop import train
from memfit.train.metrics import read_metrics
from memfit.train.run_summary import memory_report
from tiny_encoders import dna_rows, write_csv

# An eval line of each task as Evaluator.record writes it (every line carries eval_perplexity and eval_tokens).
RECORDS = {
    "causal-lm": {"eval_loss": 3.2, "eval_perplexity": 24.53, "eval_tokens": 12345, "eval_samples": 40},
    "masked-lm": {"eval_loss": 2.1, "eval_perplexity": 8.17, "eval_tokens": 512, "eval_samples": 40},
    "token-classification": {"eval_loss": 0.4, "eval_perplexity": 1.49, "eval_tokens": 900, "eval_samples": 40,
                             "eval_accuracy": 0.91, "eval_f1": 0.88, "eval_mcc": 0.8},
    "sequence-classification": {"eval_loss": 0.4745, "eval_perplexity": 1.61, "eval_tokens": 80, "eval_samples": 80,
                                "eval_accuracy": 0.9, "eval_f1": 0.8976, "eval_mcc": 0.8633, "eval_auroc": 0.9962},
    "regression": {"eval_loss": 0.02, "eval_perplexity": 1.02, "eval_tokens": 80, "eval_samples": 80,
                   "eval_mse": 0.02, "eval_r2": 0.7, "eval_pearson": 0.85, "eval_spearman": 0.83},
    **{name: {"eval_loss": 0.6, "eval_perplexity": 1.82, "eval_tokens": 4000, "eval_samples": 40, "eval_rewards/accuracies": 0.75, "eval_rewards/margins": 0.1234} for name in ("dpo", "simpo", "orpo")},
    "kto": {"eval_loss": 0.6, "eval_perplexity": 1.82, "eval_tokens": 4000, "eval_samples": 40,
            "eval_rewards/margins": 0.1234, "eval_kl": 0.05},
}
EXPECTED = {  # (what the eval is averaged over, the measures shown, words never shown)
    "causal-lm": ("12,345 target tokens", ["perplexity 24.53"], ["samples"]),
    "masked-lm": ("512 masked tokens", ["perplexity 8.17"], ["samples"]),
    "token-classification": ("900 labelled tokens", ["accuracy 0.91", "F1 0.88", "MCC 0.8"], ["perplexity"]),
    "sequence-classification": ("80 samples", ["accuracy 0.9", "F1 0.8976", "MCC 0.8633", "AUROC 0.9962"],
                                ["perplexity", "tokens"]),
    "regression": ("80 samples", ["MSE 0.02", "R2 0.7", "Pearson 0.85", "Spearman 0.83"], ["perplexity", "tokens"]),
    **{name: ("40 pairs", ["rewards/accuracies 0.75", "rewards/margins 0.1234"], ["perplexity", "tokens"])
       for name in ("dpo", "simpo", "orpo")},
    "kto": ("40 completions", ["rewards/margins 0.1234", "kl 0.05"], ["perplexity", "tokens"]),
}
SUMMARY = {"event": "summary", "steps": 10, "first_loss": 1.1, "final_loss": 0.5, "device": "cpu", "precision": "fp32",
           "optimizer": "adamw", "attention": "sdpa", "gradient_checkpointing": "off", "eval_step": 10}


@pytest.mark.parametrize("name", sorted(RECORDS))
def test_each_task_words_its_eval_line_and_summary(name):
    assert set(RECORDS) == set(TASK_CLASSES) - {"grpo"}  # online RL has no held-out evaluation (refused)
    over, measures, never = EXPECTED[name]
    record = RECORDS[name]
    status = task_class(name).eval_status(record)
    assert status == " | ".join([f"eval loss {record['eval_loss']:.4f} over {over}", *measures])
    summary = memory_report({**SUMMARY, **record, "task": {"name": name}})
    eval_line = next(line for line in summary.splitlines() if "eval loss" in line)
    assert eval_line == f"  eval loss {record['eval_loss']:.4f} at step 10 over {over}: " + ", ".join(measures)
    for word in never:
        assert word not in status and word not in eval_line, (name, status, eval_line)
    # A run from before tasks were recorded words it as a causal LM (what it was).
    assert task_class(None) is TASK_CLASSES["causal-lm"] and task_class({"name": "nonsense"}) is TASK_CLASSES["causal-lm"]


def test_a_classifier_without_scikit_learn_says_why_it_has_no_metrics():
    record = {key: value for key, value in RECORDS["sequence-classification"].items() if key in (
        "eval_loss", "eval_perplexity", "eval_tokens", "eval_samples")}
    summary = memory_report({**SUMMARY, **record, "task": {"name": "sequence-classification"}})
    line = next(line for line in summary.splitlines() if "eval loss" in line)
    assert "over 80 samples" in line and "memfit[tasks]" in line and "perplexity" not in line


def test_task_row_names_head_loss_and_metrics():
    facts = {"name": "sequence-classification", "head": "AutoModelForSequenceClassification", "loss_per": "sample",
             "eval_metrics": ["accuracy", "f1", "mcc", "auroc"], "problem": "single-label",
             "packing": "off: one table row a sample"}
    row = describe_task(facts)
    assert row.startswith("sequence-classification (AutoModelForSequenceClassification; loss per sample")
    assert "accuracy, F1, MCC, AUROC" in row and "perplexity" not in row
    assert "eval" not in describe_task(facts, evaluated=False)


@pytest.fixture(scope="module")
def classifier_run(encoder_dirs, dna_csv, tmp_path_factory):
    """A tiny DNA classifier trained 4 steps with an eval set, its console captured: the brief's run, small."""
    root = tmp_path_factory.mktemp("classifier")
    eval_csv = write_csv(root / "test.csv", dna_rows(20, seed=7))
    out = root / "run"
    config = load_config(overrides=dict(model=str(encoder_dirs["esm"]), dataset=str(dna_csv), eval_dataset=str(eval_csv),
                                        task="sequence-classification", seq_len=64, batch_size=4, max_steps=4,
                                        eval_every=2, lr=3e-3, output_dir=str(out)))
    return out, config


def test_classifier_console_summary_and_report_speak_of_its_task(classifier_run, capfd):
    pytest.importorskip("sklearn")
    out, config = classifier_run
    result = train(config)
    console = capfd.readouterr().err
    eval_lines = [line for line in console.splitlines() if "eval loss" in line]
    assert len(eval_lines) == 2, console[-3000:]
    summary = memory_report(result.summary)
    summary_eval = [line for line in summary.splitlines() if "eval loss" in line]
    for line in eval_lines + summary_eval:
        assert "over 20 samples" in line and "accuracy" in line and "F1" in line and "MCC" in line, line
        assert "perplexity" not in line and "target tokens" not in line, line
    # The metrics the eval line printed are the ones metrics.jsonl holds.
    last = [r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "eval"][-1]
    assert f"accuracy {last['eval_accuracy']:.4g}" in eval_lines[-1]

    pytest.importorskip("plotly")
    from memfit.reporting import load_run, write_report
    from memfit.reporting.page import configuration_rows, fallbacks_and_choices, glance

    run = load_run(out)
    rows = dict(configuration_rows(run))
    assert rows["task"].startswith("sequence-classification (AutoModelForSequenceClassification; loss per sample")
    assert "packing off" in rows["task"]  # said where it belongs: what the task reads, not a fallback
    assert rows["data as read"].startswith("table: 24 rows, 24 samples") and "3 classes: high, low, mid" in rows["data as read"]
    assert "tokens carry loss" not in rows["data as read"] and "None" not in rows["data as read"]
    fallbacks, _ = fallbacks_and_choices(run)
    assert "packing" not in fallbacks and "packing" not in (run.facts.get("fallbacks") or {})
    cards = {label: (value, note) for label, value, note in glance(run)}
    assert cards["eval loss"][1] == "at step 4 over 20 samples"
    assert cards["eval metrics"][0].startswith("accuracy") and "perplexity" not in str(cards)
    page = write_report(run).read_text()
    assert "Everything ran as asked: no fallback." in page
    assert re.search(r"<td>task</td><td>sequence-classification", page)
    assert "target tokens" not in page.replace("loss per target token", "")


def test_packing_asked_and_refused_is_an_error_not_a_silent_fallback(encoder_dirs, dna_csv, tmp_path):
    from memfit.errors import UsageError

    config = load_config(overrides=dict(model=str(encoder_dirs["esm"]), dataset=str(dna_csv), packing="samples",
                                        task="sequence-classification", seq_len=64, max_steps=1, output_dir=str(tmp_path)))
    with pytest.raises(UsageError, match="--packing samples"):
        train(config)


def test_a_training_step_line_shows_the_tasks_own_measures():
    step = {"step": 3, "loss": 0.61, "rewards/accuracies": 0.75, "rewards/margins": 0.1234, "rewards/chosen": 0.2}
    assert TASK_CLASSES["dpo"].step_scores(step) == ["rewards/accuracies 0.75", "rewards/margins 0.1234"]
    assert TASK_CLASSES["causal-lm"].step_scores(step) == []  # its measure (perplexity) is an eval's
