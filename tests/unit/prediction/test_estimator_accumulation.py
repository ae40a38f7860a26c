"""Gradient accumulation: the estimate counts the gradients the earlier micro-batches left behind.

With more than one micro-batch per optimizer step, every micro-batch after the first runs
its forward and backward with the whole accumulated gradient live; the tracker sees it,
and a plan that leaves it out overflows its own cap.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from memfit.config_loading import load_config
from memfit.prediction.estimator import ERROR_BAND, estimate


@pytest.fixture(scope="module")
def wide_model(tmp_path_factory) -> Path:
    """Weights dominate at short sequences, so a missing gradient term shows."""
    from memfit.models.tiny import save_llama

    return save_llama(tmp_path_factory.mktemp("accumulation_model"), hidden_size=256, intermediate_size=704,
                      num_hidden_layers=2, max_position_embeddings=512)


def _config(model: Path, tmp_path: Path, accumulation: int):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("memory gradient batch token model layer training fits device loss step\n\n" * 500)
    return load_config(overrides={
        "model": str(model), "dataset": str(corpus), "seq_len": "128", "batch_size": "2",
        "gradient_accumulation_steps": str(accumulation), "max_steps": "2", "log_every": "1000",
        "output_dir": str(tmp_path / "run"), "report": "False",
    })


@pytest.mark.slow
def test_accumulated_gradients_are_in_the_estimate_as_in_the_tracker(wide_model, tmp_path):
    from memfit.train.profiling import profile_run

    config = _config(wide_model, tmp_path, accumulation=2)
    predicted = estimate(config)
    report, _ = profile_run(config)
    measured = report.to_dict()["peak_bytes"]
    assert abs(predicted.peak_bytes / measured - 1) <= ERROR_BAND["analytical"], (predicted.peak_bytes, measured)
    # a plan trusts the estimate: it must not fall short of the tracked peak by more than a few percent
    assert predicted.peak_bytes >= 0.95 * measured, (predicted.peak_bytes, measured)
    # the accumulated gradient is what the second micro-batch adds to the single-micro-batch peak
    single = estimate(_config(wide_model, tmp_path, accumulation=1))
    gradients = predicted.details["full_bytes"]["gradients"]
    assert predicted.breakdown["gradients"] >= gradients
    assert predicted.peak_bytes > single.peak_bytes
