"""The speed model's CPU terms for bf16 autocast, --compile and small loss chunks, and what the planner does with them."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig

from memfit.config_loading import load_config
from memfit.prediction import speed_model
from memfit.prediction.candidates import technique_grid
from memfit.prediction.estimator import estimate
from memfit.prediction.planner import plan
from memfit.prediction.speed_model import estimated_step_seconds
from memfit.prediction.trade_offs import trade_offs
from memfit.units import MIB

# The 22.9M-parameter Llama of benchmarks/bench_p2_settings.py and bench_peers.py p2.
P2_SHAPE = LlamaConfig(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                       num_key_value_heads=6, vocab_size=32000, tie_word_embeddings=True, max_position_embeddings=2048)


@pytest.fixture
def compiler(monkeypatch):
    """torch.compile counted as available (a C++ compiler on the PATH), whatever this machine has."""
    import memfit.techniques.compile as compile_module

    monkeypatch.setattr(compile_module, "compile_unavailable_reason", lambda device, backend="inductor": "")


def _config(**overrides):
    """A config of the P2 run (seq 512, bf16 autocast, 4 samples per step), 1000 steps unless given."""
    return load_config(overrides={"model": "tiny", "seq_len": "512", "precision": "amp", "max_steps": "1000",
                                  **{k: str(v) for k, v in overrides.items()}})


def _speeds(runs: dict[str, dict], precision: str = "amp", device: str = "cpu") -> dict[str, float]:
    """Predicted tokens/s of each run of the P2 model at seq 512 (4 samples per step), relative to the first."""
    config = _config(precision=precision)
    est = estimate(config)
    est.details["trainable_parameter_count"] = 22_900_000
    seconds = {}
    for name, changes in runs.items():
        micro = changes.get("batch_size", 4)
        full = {"batch_size": micro, "gradient_accumulation_steps": 4 // micro, "precision": precision, **changes}
        seconds[name] = estimated_step_seconds(full, config, est, None, P2_SHAPE, device=device)
    first = next(iter(seconds.values()))
    return {name: first / value for name, value in seconds.items()}


def test_compile_is_credited_on_a_cpu_and_not_where_unmeasured():
    # bench_p2_settings.py, bf16 autocast, seq 512: --compile 1.07x to 1.19x its eager run; 1.14 is the median.
    cpu = _speeds({"eager": {}, "compiled": {"compile": True}})
    assert cpu["compiled"] == pytest.approx(speed_model.COMPILED_BLOCKS_SPEEDUP["cpu"])
    assert 1.05 <= cpu["compiled"] <= 1.25
    gpu = _speeds({"eager": {}, "compiled": {"compile": True}}, device="cuda")
    assert gpu["compiled"] == 1.0  # no GPU measurement: no credit, and the planner does not plan it there


def test_bf16_chunked_loss_costs_less_than_fp32_and_is_ranked_as_measured():
    # Measured (bench_p2_settings.py, micro-batch 4 x 1, seq 512, bf16 autocast, tokens per CPU second):
    # chunked loss 0.84x to 1.01x of full logits; micro-batch 1 x 4 with full logits below 4 x 1 chunked
    # (1.13x and 1.22x the Trainer). The fp32 cost (1.2x the head's FLOPs) predicted 0.84x and put 1 x 4 first.
    runs = {"full logits": {}, "chunked 256": {"loss_chunk_size": 256}, "1 x 4": {"batch_size": 1}}
    bf16 = _speeds(runs)
    fp32 = _speeds(runs, precision="fp32")
    assert 0.87 < bf16["chunked 256"] < 0.95
    assert fp32["chunked 256"] < bf16["chunked 256"] - 0.04
    assert bf16["1 x 4"] < bf16["chunked 256"] * 1.02  # within the 1 % tie-break at most, never clearly ahead
    assert bf16["1 x 4"] < bf16["full logits"]


def test_small_chunks_lose_only_the_tie_break_to_large_ones():
    speeds = _speeds({"1024": {"loss_chunk_size": 1024}, "256": {"loss_chunk_size": 256},
                      "run's own marker": {"loss_chunk_size": 1}})
    assert speeds["256"] == pytest.approx(1 / (1 + speed_model.SMALL_CHUNK_COST))
    assert speeds["run's own marker"] == 1.0  # a run's prediction marks any chunked loss as size 1: no tie-break


def test_planner_plans_compile_on_a_cpu_when_it_can_run(compiler):
    config = _config(batch_size=4)
    result = plan(config, budget_bytes=697 * MIB, hf_config=P2_SHAPE)
    assert result.plan["compile"] is True
    assert "--compile" in result.command
    assert any("--compile" in line and "compiles" in line for line in result.trades)
    # the same memory estimate with and without: compile changes time only
    eager = plan(_config(batch_size=4, compile=False), budget_bytes=697 * MIB, hf_config=P2_SHAPE)
    assert eager.plan["compile"] is False
    assert eager.estimated_peak_bytes == result.estimated_peak_bytes
    assert result.tokens_per_second == pytest.approx(eager.tokens_per_second * speed_model.COMPILED_BLOCKS_SPEEDUP["cpu"])


def test_planner_leaves_compile_out_without_a_compiler_on_a_gpu_or_in_a_short_run(monkeypatch):
    import memfit.techniques.compile as compile_module

    monkeypatch.setattr(compile_module, "compile_unavailable_reason", lambda device, backend="inductor": "no g++")
    result = plan(_config(batch_size=4), budget_bytes=697 * MIB, hf_config=P2_SHAPE)
    assert result.plan["compile"] is False and "--compile" not in result.command
    monkeypatch.setattr(compile_module, "compile_unavailable_reason", lambda device, backend="inductor": "")
    assert not any(c["compile"] for c in technique_grid("full", _config(), _gpu(), 512, 1, hf_config=P2_SHAPE))
    # 4 x 512 tokens of this model is 3.1e11 FLOPs a step: compile's ~40 s is repaid after about 160 steps
    assert not plan(_config(batch_size=4, max_steps=100), budget_bytes=697 * MIB, hf_config=P2_SHAPE).plan["compile"]
    assert plan(_config(batch_size=4, max_steps=300), budget_bytes=697 * MIB, hf_config=P2_SHAPE).plan["compile"]
    assert plan(_config(batch_size=4, epochs=1), budget_bytes=697 * MIB, hf_config=P2_SHAPE).plan["compile"]


def _gpu():
    from memfit.gpus import get_gpu

    return get_gpu("h100-80gb")


def test_planner_finds_micro_batch_4_with_small_loss_chunks_where_1024_token_chunks_do_not_fit(compiler):
    # At 697 MiB (bench_peers.py p2's budget) the 1024-token chunk's fp32 logits (125 MiB) keep micro-batch 4
    # out; 256-token chunks fit (bench_p2_settings.py tracked 443 MiB with full checkpointing, 685 MiB without).
    config = _config(batch_size=4)
    grid = technique_grid("full", config, None, 512, 1)
    assert {c["loss_chunk_size"] for c in grid} == {0, 1024, 256}
    result = plan(config, budget_bytes=697 * MIB, hf_config=P2_SHAPE)
    micro_4 = [a for a in result.alternatives if a["plan"]["batch_size"] == 4] + (
        [{"plan": result.plan}] if result.plan["batch_size"] == 4 else [])
    assert micro_4, "no micro-batch-4 plan among the best three"
    assert all(a["plan"]["loss_chunk_size"] == 256 for a in micro_4)
    # where 1024-token chunks fit too, they are kept (the tie-break): the same plan as before small chunks existed
    roomy = plan(_config(batch_size=4, precision="fp32"), budget_bytes=1100 * MIB, hf_config=P2_SHAPE)
    assert roomy.plan["loss_chunk_size"] in (0, 1024)


def test_trade_offs_name_no_compile_when_not_planned():
    config = _config()
    est = estimate(config)
    from memfit.prediction.plan_result import Candidate

    candidate = Candidate({"compile": False, "loss_chunk_size": 0}, est, 1.0, 512)
    assert not any("--compile" in line for line in trade_offs(candidate, config, P2_SHAPE, None))


# The bench model of benchmarks/bench_planned_vs_trainer.py: 8 blocks of width 256, the byte vocabulary.
BENCH_SHAPE = LlamaConfig(hidden_size=256, intermediate_size=688, num_hidden_layers=8, num_attention_heads=4,
                          num_key_value_heads=4, vocab_size=257, tie_word_embeddings=False,
                          max_position_embeddings=2048)


def _bench_seconds(changes: dict, device: str = "cpu") -> float:
    config = load_config(overrides={"model": "tiny", "seq_len": "512", "precision": "fp32"})
    est = estimate(config)
    est.details["trainable_parameter_count"] = 6_460_000
    micro = changes["batch_size"]
    return estimated_step_seconds({"gradient_accumulation_steps": 8 // micro, "precision": "fp32", **changes},
                                  config, est, None, BENCH_SHAPE, device=device, calibrate=False)


def test_selective_checkpointing_costs_its_dispatch_per_block_and_micro_batch_on_a_cpu():
    # Measured on the bench model (speed_model.SELECTIVE_DISPATCH_CPU_FLOPS): selective over no checkpointing at the
    # same micro-batch 0.93 to 1.94x, median 1.27; FLOPs alone say 1.015.
    ratios = {}
    for micro in (1, 2, 4):
        off = _bench_seconds({"batch_size": micro, "gradient_checkpointing": "off"})
        selective = _bench_seconds({"batch_size": micro, "gradient_checkpointing": "selective"})
        ratios[micro] = selective / off
    assert 1.1 < ratios[2] < 1.45 and 1.2 < ratios[1] < 1.7
    assert ratios[1] > ratios[2] > ratios[4]  # more micro-batches, more dispatch
    # one more checkpointed block-pass costs the constant at the step's rate, exactly
    extra = {micro: _bench_seconds({"batch_size": micro, "gradient_checkpointing": "selective"})
             - _bench_seconds({"batch_size": micro, "gradient_checkpointing": "off"}) for micro in (1, 2)}
    rate = speed_model.NOMINAL_TFLOPS * 1e12 * speed_model.UTILISATION
    assert extra[1] - extra[2] == pytest.approx(4 * 8 * speed_model.SELECTIVE_DISPATCH_CPU_FLOPS / rate, rel=0.1)
    # every second block checkpointed: half the dispatch
    half = (_bench_seconds({"batch_size": 1, "gradient_checkpointing": "selective", "checkpoint_every": 2})
            - _bench_seconds({"batch_size": 1, "gradient_checkpointing": "off"}))
    assert half < 0.6 * extra[1]


def test_selective_checkpointing_is_ranked_behind_no_checkpointing_on_a_cpu_and_not_on_a_gpu():
    # the bench's trials: 2 x 4 without checkpointing beat 4 x 2 selective in 5 of 8 runs (predicted 2 % slower before the dispatch term)
    cpu = {name: _bench_seconds(changes) for name, changes in
           {"2x4 off": {"batch_size": 2, "gradient_checkpointing": "off"},
            "4x2 selective": {"batch_size": 4, "gradient_checkpointing": "selective"}}.items()}
    assert cpu["2x4 off"] < cpu["4x2 selective"]
    gpu_off = _bench_seconds({"batch_size": 2, "gradient_checkpointing": "off"}, device="cuda")
    gpu_selective = _bench_seconds({"batch_size": 2, "gradient_checkpointing": "selective"}, device="cuda")
    assert gpu_selective / gpu_off < 1.05  # no dispatch term where it was never measured
