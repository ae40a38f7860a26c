"""The planner's expert-offload lever (--expert-offload): tried for LoRA on a mixture of experts, chosen only when
nothing fits with the experts on the device, and what it trades said; Qwen3-30B-A3B bf16 LoRA below 63 GB.
"""

from __future__ import annotations

from types import SimpleNamespace

from memfit.config_loading import load_config
from memfit.prediction.candidates import technique_grid, user_set
from memfit.prediction.estimator import estimate
from memfit.prediction.expert_streaming import stream_seconds, streaming_changes
from memfit.prediction.planner import MARGIN, plan
from memfit.units import GIB
from model_zoo import ZOO

SETTINGS = {"model": "tiny", "seq_len": 64, "batch_size": 1, "lora_r": 2, "dtype": "bf16"}


def test_the_lever_applies_to_lora_on_experts_only():
    config = load_config(overrides=SETTINGS)
    assert streaming_changes("lora", config, ZOO["qwen3_moe"](), user_set) == {"expert_offload": True, "compile": False}
    assert streaming_changes("qlora", config, ZOO["qwen3_moe"](), user_set)["expert_offload"]
    assert streaming_changes("full", config, ZOO["qwen3_moe"](), user_set) == {}
    assert streaming_changes("lora", config, ZOO["llama"](), user_set) == {}
    chosen = load_config(overrides={**SETTINGS, "expert_offload": False})
    chosen.user_set = {"expert_offload"}
    assert streaming_changes("lora", chosen, ZOO["qwen3_moe"](), user_set) == {}  # the user chose


def test_link_time_counts_only_what_compute_does_not_hide():
    est = SimpleNamespace(details={"expert_stream_bytes_per_micro_batch": 64 * 10**9})
    assert stream_seconds(est, 64e9, compute_seconds=1.0, accumulation=2) == 2.0 - 0.5
    assert stream_seconds(est, 64e9, compute_seconds=10.0, accumulation=1) == 0.0


def test_the_planner_streams_the_experts_only_when_the_budget_needs_it():
    hf_config = ZOO["qwen3_moe"]()
    config = load_config(overrides=SETTINGS)
    roomy = plan(config, budget_bytes=8 * GIB, allow="lora", hf_config=hf_config, host_memory=8 * GIB)
    assert not roomy.plan.get("expert_offload")
    grid = technique_grid("lora", config, None, 64, 1, hf_config=hf_config)
    peaks = {True: [], False: []}
    for changes in grid:
        peak = estimate(config.replace(**changes), hf_config=hf_config).peak_bytes
        peaks[bool(changes.get("expert_offload"))].append(peak)
    assert min(peaks[True]) < min(peaks[False])
    tight = plan(config, budget_bytes=int(min(peaks[False]) / (1 - MARGIN)) - 1, allow="lora", hf_config=hf_config,
                 host_memory=8 * GIB)
    assert tight.plan["expert_offload"] and "--expert-offload" in tight.command
    assert any(line.startswith("expert offload: the frozen experts") for line in tight.trades)


def test_qwen3_30b_a3b_bf16_lora_fits_below_63_gb_with_the_experts_streamed():
    """The README frontier row: the bf16 base alone (56.9 GiB) is most of the 58.7 GiB; 54 GiB of it is experts."""
    config = load_config(overrides={"model": "qwen3-30b-a3b", "seq_len": 2048, "lora_r": 16, "dtype": "bf16"})
    result = plan(config, budget_bytes=63 * 10**9, allow="lora", host_memory=128 * GIB)
    print(f"peak {result.estimated_peak_bytes / GIB:.2f} GiB, host {result.host_bytes / GIB:.2f} GiB: {result.command}")
    assert result.fits and result.plan["expert_offload"]
    assert result.estimated_peak_bytes <= 63 * 10**9 * (1 - MARGIN)
    assert result.host_bytes > 54 * GIB  # 29B expert weights in bf16


def test_tiled_experts_bring_each_layer_once_more_not_once_a_tile():
    hf_config = ZOO["qwen3_moe"]()
    settings = {**SETTINGS, "gradient_checkpointing": "full", "expert_offload": True}
    untiled = estimate(load_config(overrides={**settings, "tiled_mlp": 0}), hf_config=hf_config)
    tiled = estimate(load_config(overrides={**settings, "tiled_mlp": 4}), hf_config=hf_config)
    experts = untiled.host_breakdown["experts"]
    assert experts == 2 * 4 * 3 * 32 * 32 * 2  # layers x experts x (gate, up, down) x hidden x width x bf16 bytes
    assert untiled.details["expert_stream_bytes_per_micro_batch"] == 2 * experts  # forward and recompute
    assert tiled.details["expert_stream_bytes_per_micro_batch"] == 3 * experts  # and the tiled backward, all tiles
    assert any(c.get("expert_offload") and c["tiled_mlp"]
               for c in technique_grid("lora", load_config(overrides=SETTINGS), None, 8192, 1, hf_config=hf_config))
