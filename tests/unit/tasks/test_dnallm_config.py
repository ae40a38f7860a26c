"""DNALLM's fine-tuning YAML, as its configuration generator writes it, runs unchanged on a tiny encoder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from memfit.config_loading import load_config
from memfit.errors import UsageError
from tiny_encoders import dna_rows, write_csv

CONFIG = Path(__file__).parent / "data" / "dnallm_finetune_config.yaml"


def test_sections_map_to_memfit_settings(caplog):
    config = load_config(CONFIG, {"eval_fraction": 0.25})
    assert config.task.task == "sequence-classification" and config.task.label_names == "high,low,mid"
    assert (config.lora.lora_r, config.lora.lora_alpha, config.lora.lora_targets) == (4, 16.0, "query,value")
    assert (config.training.epochs, config.optimizer.warmup_ratio, config.optimizer.lr_schedule) == (3.0, 0.1, "linear")
    assert config.evaluation.save_best and config.evaluation.eval_batch_size == 16
    assert "section 'inference' ignored" in caplog.text


def test_multilabel_task_type_sets_the_problem_type(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("task:\n  task_type: multilabel\n  num_labels: 2\n")
    config = load_config(path)
    assert (config.task.task, config.task.problem_type) == ("sequence-classification", "multi-label")


def test_a_trainer_setting_memfit_cannot_honour_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("finetune:\n  metric_for_best_model: eval_accuracy\n  lerning_rate: 1e-4\n")
    with pytest.raises(UsageError) as error:
        load_config(path)
    assert "metric_for_best_model 'eval_accuracy' has no memfit equivalent" in str(error.value)
    assert "did you mean learning_rate?" in str(error.value)


def test_the_generated_file_trains_unchanged(encoder_dirs, dna_csv, tmp_path, warm_memfit):
    eval_csv = write_csv(tmp_path / "eval.csv", dna_rows(8, seed=7))
    # forked from the warm server (tests/memfit_cli.py) in tmp_path: the real command, without a fresh import
    run = warm_memfit.run("train", "--config", str(CONFIG), "--model", str(encoder_dirs["bert"]), "--dataset",
                          str(dna_csv), "--eval-dataset", str(eval_csv), "--output-dir", str(tmp_path / "out"),
                          "--no-report", cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "section 'inference' ignored" in run.stderr
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    summary = next(r for r in records if r.get("event") == "summary")
    assert summary["steps"] == 9  # 3 epochs of 24 rows in batches of 8
    assert "eval_accuracy" in summary and (tmp_path / "out" / "best").is_dir()
    adapter = json.loads((tmp_path / "out" / "final" / "adapter_config.json").read_text())
    assert adapter["r"] == 4 and {name.rsplit(".", 1)[-1] for name in adapter["target_modules"]} == {"query", "value"}
    assert not (tmp_path / "outputs").exists()  # the command line's --output-dir wins over the file's
