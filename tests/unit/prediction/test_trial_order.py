"""The plan's ranked list reaches the trials with several shapes: the bench model at half its plain peak
(benchmarks/bench_planned_vs_trainer.py) offers at least four distinct shapes to time, so the speed model's
rank correlation can be measured; loss-chunk variants of one shape come after every shape's best."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from memfit.config_loading import load_config
from memfit.prediction.planner import plan
from memfit.prediction.trial_order import shape_of, shapes_first
from memfit.train import trials

BENCH_SHAPE = dict(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=4,
                   num_key_value_heads=4, vocab_size=257, max_position_embeddings=2048, tie_word_embeddings=False)
BENCH_BUDGET = 375474760
"""Half the Trainer's plain tracked peak at micro-batch 8 (the benchmark's 358 MiB)."""


@pytest.fixture(scope="module")
def bench_model(tmp_path_factory):
    directory = tmp_path_factory.mktemp("bench-model")
    LlamaConfig(**BENCH_SHAPE).save_pretrained(directory)  # planning reads the config only
    return directory


def test_bench_plan_offers_trials_four_distinct_shapes(bench_model, tmp_path):
    config = load_config(overrides={"model": str(bench_model), "seq_len": "512", "batch_size": "8",
                                    "max_steps": "12", "memory_budget": str(BENCH_BUDGET),
                                    "output_dir": str(tmp_path / "out")})
    result = plan(config)
    offered = trials.diverse(trials.comparable(result.ranked))[:trials.MAX_TRIALS]
    assert offered[0]["plan"] == result.ranked[0]["plan"]  # the planner's choice is timed first
    shapes = {shape_of(r["plan"]) for r in offered}
    assert len(shapes) >= 4, [r["plan"] for r in offered]


def test_shapes_first_keeps_rank_within_and_the_first_first():
    plans = [{"batch_size": 2, "loss_chunk_size": 0}, {"batch_size": 2, "loss_chunk_size": 1024},
             {"batch_size": 4, "loss_chunk_size": 0}, {"batch_size": 2, "loss_chunk_size": 256},
             {"batch_size": 1, "loss_chunk_size": 0}]
    ordered = shapes_first([{"plan": p} for p in plans])
    assert [r["plan"] for r in ordered] == [plans[0], plans[2], plans[4], plans[1], plans[3]]
