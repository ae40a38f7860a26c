"""The estimate of the bench model's selective-checkpointing plan holds the tracked peak within its band.

benchmarks/bench_planned_vs_trainer.py plans micro-batch 4 x 2 with selective checkpointing under 358 MiB; its
trials ran over the cap, which looked like an estimate short of the truth. Tracked (memfit profile, 2 steps so the
optimizer state is live): 324.7 MiB against 314.3 MiB estimated (-3.2 %, inside the 10 % band). The trials had run
the model in eval mode, without checkpointing (tests/unit/train/test_trials.py checks they no longer do).
The traced estimate (one micro-batch traced) now counts every gradient live when the plan accumulates: 340.4 MB
against 340.5 tracked (it was 315.6, 7.3 % short, past its 3 % band).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from memfit.config_loading import load_config
from memfit.prediction.estimator import estimate
from memfit.train.profiling import profile_run

BENCH_SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=257, max_position_embeddings=2048, bos_token_id=256,
                   eos_token_id=256, pad_token_id=256, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory):
    from memfit.models.tiny import byte_tokenizer

    directory = tmp_path_factory.mktemp("bench-model")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**BENCH_SHAPE)).save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


@pytest.mark.slow
def test_selective_estimate_within_band_of_tracked_peak_at_bench_shape(bench_model, tmp_path):
    config = load_config(overrides={
        "model": str(bench_model), "seq_len": "512", "batch_size": "4", "gradient_accumulation_steps": "2",
        "gradient_checkpointing": "selective", "max_steps": "2", "output_dir": str(tmp_path / "out"),
        "report": "false"})
    import memfit.train.traced  # noqa: F401  registers the step the traced estimate runs

    predicted = estimate(config)
    traced = estimate(config, method="traced")
    report, _ = profile_run(config)
    tracked = report.peak_bytes
    assert abs(predicted.peak_bytes - tracked) <= predicted.error_band * tracked, (predicted.peak_bytes, tracked)
    # the traced step is one micro-batch: from the second on every gradient is live (without: 7.3 % short)
    assert abs(traced.peak_bytes - tracked) <= traced.error_band * tracked, (traced.peak_bytes, tracked)
