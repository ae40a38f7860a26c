"""Speed facts: MFU is a fraction of the probed peak, and the planner's step time is logged beside the measured one."""

from __future__ import annotations

import pytest
import torch

from memfit.config import TrainConfig
from memfit.models.tiny import tiny_config
from memfit.train.speed import SpeedMeter


def _meter(**changes) -> SpeedMeter:
    config = TrainConfig().replace(seq_len=128, batch_size=4, **changes)
    return SpeedMeter.for_run(tiny_config(), config, torch.device("cpu"), None, config.memory.gradient_checkpointing,
                              chunked_loss=False)


def test_start_facts_name_the_flops_the_peak_and_the_prediction():
    facts = _meter().start_facts()
    assert facts["model_flops_per_token"] > 0
    assert facts["peak_flops_source"].startswith("matmul probe fp32 on cpu")
    assert facts["model_step_seconds"] > 0


def test_a_cpu_run_is_predicted_with_the_planners_cpu_terms(monkeypatch):
    """The planner's CPU and GPU terms differ (feeding, 8-bit AdamW, chunked loss): a CPU run asks for CPU's."""
    import memfit.prediction.speed_model as speed_model

    asked = []
    real = speed_model.estimated_step_seconds

    def spy(*args, **kwargs):
        asked.append(kwargs.get("device"))
        return real(*args, **kwargs)

    monkeypatch.setattr(speed_model, "estimated_step_seconds", spy)
    assert _meter().start_facts()["model_step_seconds"] > 0
    assert asked == ["cpu"]


def test_step_mfu_is_model_flops_over_the_peak():
    meter = _meter()
    tokens = 512
    seconds = tokens * meter.flops.model / (0.25 * meter.peak.flops_per_second)
    assert meter.step(tokens, seconds)["mfu"] == pytest.approx(0.25, rel=1e-3)
    meter.step(tokens, seconds / 2)
    meter.step(tokens, seconds / 2)
    summary = meter.summary()
    assert summary["mfu"] == pytest.approx(0.5, rel=1e-3)  # the first (warm-up) step is left out
    assert summary["measured_over_model"] == pytest.approx(summary["measured_step_seconds"]
                                                           / summary["model_step_seconds"], rel=1e-2)


def test_full_checkpointing_predicts_a_longer_step_and_counts_hardware_flops():
    plain, full = _meter(), _meter(gradient_checkpointing="full")
    assert full.predicted_step_seconds > plain.predicted_step_seconds
    assert full.flops.hardware > full.flops.model == plain.flops.model


def test_a_cpu_run_logs_mfu_per_step_the_prediction_and_which_kernels_ran(tmp_path):
    from memfit.config_loading import load_config
    from memfit.train.loop import train
    from memfit.train.metrics import read_metrics
    from memfit.train.run_summary import memory_report

    config = load_config(overrides={"model": "tiny", "max_steps": "3", "seq_len": "64", "batch_size": "2",
                                    "gradient_accumulation_steps": "2", "output_dir": str(tmp_path / "run"),
                                    "report": "false", "kernels": "liger"})
    result = train(config)
    records = read_metrics(tmp_path / "run" / "metrics.jsonl")
    start, steps, summary = records[0], [r for r in records if "event" not in r], records[-1]
    assert start["model_step_seconds"] > 0 and start["peak_flops_source"].startswith("matmul probe")
    assert len(steps) == 3
    for record in steps:  # no step beats a measured peak: past one, MFU is left out with the reason
        assert "mfu" not in record or 0 < record["mfu"] <= record["hfu"] <= 1
        assert record["tokens_per_second"] > 0
    assert summary["mfu_note"] if summary["mfu"] is None else 0 < summary["mfu"] <= 1
    # Asked for liger on a CPU: PyTorch's kernels ran, and the metrics say so and why.
    assert summary["kernels"] == "none" and summary["compile"] == "off"
    assert "CUDA" in summary["fallbacks"]["kernels"]
    assert summary["measured_step_seconds"] > 0 and summary["measured_over_model"] > 0
    assert "speed: step" in memory_report(result.summary)
