"""The planner: what it picks fits, what cannot fit says by how much, plans apply to a config."""

from __future__ import annotations

import pytest

from memfit.config_loading import load_config
from memfit.errors import DoesNotFitError, UsageError
from memfit.prediction.estimator import estimate
from memfit.prediction.planner import MARGIN, plan, plan_to_overrides
from memfit.units import GIB, MIB


def test_plan_picks_a_configuration_that_fits_and_applies_to_the_config():
    config = load_config(overrides={"model": "tiny", "seq_len": 256, "batch_size": 8})
    budget = 64 * MIB
    result = plan(config, budget_bytes=budget)
    assert result.fits and result.estimated_peak_bytes <= budget * (1 - MARGIN)
    planned = config.replace(**plan_to_overrides(result))
    assert planned.effective_batch_for() == config.effective_batch_for()  # the effective batch is kept
    again = estimate(planned, budget_bytes=budget)
    assert again.peak_bytes == result.estimated_peak_bytes and again.fits
    assert result.command.startswith("memfit train --model tiny --seq-len 256 --batch-size ")
    for alternative in result.alternatives:
        assert alternative["estimated_peak_bytes"] <= budget * (1 - MARGIN)
        # a runner-up is faster only where the best says why it ranks first (test_plan_order.py)
        assert 0 < alternative["relative_speed"] <= 1.0 or result.rank_note


def test_a_roomy_budget_trains_everything_fast():
    result = plan(load_config(overrides={"model": "tiny", "seq_len": 128}), budget_bytes=8 * GIB)
    assert result.plan["lora_r"] == 0 and result.plan["gradient_checkpointing"] == "off"


def test_too_small_budget_says_how_much_is_needed():
    config = load_config(overrides={"model": "tiny", "seq_len": 256})
    with pytest.raises(DoesNotFitError, match=r"device memory stopped it: needs \d+\.\d GiB with everything on, \d+\.\d GiB over the --memory-budget 0\.0 GiB") as error:
        plan(config, budget_bytes=1024)
    assert error.value.exit_code == 3


def test_auto_falls_back_to_lora_then_proposes_more_gpus():
    config = load_config(overrides={"model": "llama-3.1-8b", "seq_len": 2048, "effective_batch_size": 16,
                                    "batch_size": 16})
    # 16 sequences per step: optimizer in backward cannot accumulate, and 16 x 2048 tokens do not fit beside the
    # bf16 weights (a recomputed block alone is 5.4 GiB) even with the checkpoints in 8 GiB of host memory, where
    # the 15 GiB of paged state has nowhere to go either (8 sequences now fit: APOLLO-Mini, checkpoints offloaded)
    result = plan(config, gpu="rtx-4090", host_memory=8 * GIB)
    assert result.plan["lora_r"] > 0 and result.plan["quantize"] == "none"  # the least lossy that fits
    assert "--lora-r" in result.command
    with pytest.raises(DoesNotFitError, match="use --allow lora or .* GPUs with --sharding fsdp"):
        plan(config, gpu="rtx-4090", allow="full", host_memory=8 * GIB)
    sharded = plan(config, gpu="a100-80gb", allow="full", world_size=4)
    assert sharded.command.startswith("torchrun --nproc-per-node 4 -m memfit train")


def test_plan_needs_a_budget_or_a_gpu():
    with pytest.raises(UsageError, match="--gpu NAME or --memory-budget"):
        plan(load_config(overrides={"model": "tiny"}))


QLORA_8B = {"model": "llama-3.1-8b", "lora_r": 32, "lora_targets": "all-linear"}


def _train_config_of(command: str):
    """The config `memfit train` would build from the planned command line."""
    from memfit.cli.flags import parse_command_line

    argv = command.split()
    assert argv[:2] == ["memfit", "train"]
    config, _ = parse_command_line(argv[2:], extras=[])
    return config


def test_longest_qlora_context_of_an_8b_model_in_24_and_80_gib():
    in_24 = plan(load_config(overrides=QLORA_8B), gpu="rtx-4090", allow="qlora", maximize="seq-len",
                 host_memory=24 * GIB)
    # 88,832 by the estimate within 24 GiB of host memory (docs/long-context.md; Unsloth: 78,475): past 80,000
    assert in_24.plan["seq_len"] >= 80_000 and in_24.plan["batch_size"] == 1
    assert in_24.plan["activation_offload"] and in_24.plan["tiled_mlp"] > 1 and in_24.plan["quantize"] == "4bit"
    assert in_24.estimated_peak_bytes <= in_24.budget_bytes * (1 - MARGIN)
    assert 0 < in_24.host_bytes <= 0.75 * 24 * GIB
    in_80 = plan(load_config(overrides=QLORA_8B), gpu="h100-80gb", allow="qlora", maximize="seq-len",
                 host_memory=256 * GIB)
    # memory allows over 500,000 tokens; memfit train runs at most the model's 131,072 positions, and says so
    assert in_80.memory_limit_seq_len >= 350_000 and in_80.plan["seq_len"] == 131_072
    assert any("handles 131,072 positions" in line for line in in_80.trades)
    # the command is one memfit train accepts, and it builds the planned run
    planned = _train_config_of(in_24.command)
    assert planned.data.seq_len == in_24.plan["seq_len"] and planned.lora.lora_targets == "all-linear"
    assert planned.memory.activation_offload and planned.memory.tiled_mlp == in_24.plan["tiled_mlp"]
    again = estimate(planned, gpu="rtx-4090")
    assert again.peak_bytes == in_24.estimated_peak_bytes and again.host_bytes == in_24.host_bytes


def test_host_memory_bounds_the_longest_context():
    roomy = plan(load_config(overrides=QLORA_8B), gpu="rtx-4090", allow="qlora", maximize="seq-len",
                 host_memory=64 * GIB)
    tight = plan(load_config(overrides=QLORA_8B), gpu="rtx-4090", allow="qlora", maximize="seq-len",
                 host_memory=8 * GIB)
    assert tight.plan["seq_len"] < roomy.plan["seq_len"]
    assert tight.host_bytes <= 0.75 * 8 * GIB
    data = tight.to_dict()
    assert {"host_bytes", "host_available_bytes", "host_fits", "host_limit_bytes", "trades"} <= set(data)
    assert data["plan"]["seq_len"] == tight.plan["seq_len"] and data["host_limit_bytes"] == 8 * GIB


def test_full_fine_tune_of_an_8b_model_at_batch_2_fits_a_24_gib_gpu():
    config = load_config(overrides={"model": "llama-3.1-8b", "seq_len": 2048, "batch_size": 2})
    result = plan(config, gpu="rtx-4090", allow="full", host_memory=64 * GIB)
    chosen = result.plan
    assert chosen["lora_r"] == 0 and chosen["batch_size"] == 2 and chosen["gradient_accumulation_steps"] == 1
    # pure bf16 weights, APOLLO-Mini's rank-1 state on the device (nothing paged to host), each gradient applied
    # and freed in backward; faster than the paged 8-bit plan, which the trades compare it with
    assert chosen["dtype"] == "bf16" and chosen["optimizer_in_backward"] and chosen["optimizer"] == "apollo-mini"
    assert result.estimated_peak_bytes <= 24 * GIB * 0.95
    assert any("pure bf16 weights" in line for line in result.trades)
    assert any(line.startswith("APOLLO-Mini") and "furthest from AdamW" in line for line in result.trades)
    compared = [line for line in result.trades if "best paged-state plan" in line]
    assert compared and float(compared[0].split("expected ")[1].split("x")[0]) > 1
    assert _train_config_of(result.command).memory.optimizer_in_backward


def test_maximize_batch_size_finds_the_largest_micro_batch_that_fits():
    config = load_config(overrides={"model": "tiny", "seq_len": 256})
    budget = 64 * MIB
    result = plan(config, budget_bytes=budget, allow="full", maximize="batch-size")
    largest = result.plan["batch_size"]
    assert largest >= 2 and result.plan["gradient_accumulation_steps"] == 1
    planned = config.replace(**plan_to_overrides(result))
    assert estimate(planned, budget_bytes=budget).peak_bytes <= budget * (1 - MARGIN)
    one_more = estimate(planned.replace(batch_size=largest + 1), budget_bytes=budget)
    assert one_more.peak_bytes > budget * (1 - MARGIN) or one_more.host_bytes > 0


def test_optimizer_in_backward_is_never_planned_with_accumulation():
    config = load_config(overrides={"model": "llama-3.2-1b", "seq_len": 1024, "batch_size": 1,
                                    "gradient_accumulation_steps": 8})
    result = plan(config, gpu="rtx-4090", allow="full", host_memory=64 * GIB)
    for candidate in [result.plan] + [a["plan"] for a in result.alternatives]:
        assert not (candidate.get("optimizer_in_backward") and candidate["gradient_accumulation_steps"] > 1)
    with pytest.raises(UsageError, match="--maximize"):
        plan(config, gpu="rtx-4090", maximize="tokens")


def _relative_speeds(gpu_name: str | None) -> dict[str, float]:
    """Tokens/s of planner configurations of a 20M Llama at seq 128, relative to checkpointing off, 4 x 1."""
    from transformers import LlamaConfig

    from memfit.gpus import get_gpu
    from memfit.prediction.speed_model import estimated_step_seconds

    hf_config = LlamaConfig(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6,
                            num_key_value_heads=6, vocab_size=32000, tie_word_embeddings=True)
    config = load_config(overrides={"model": "tiny", "seq_len": 128})
    est = estimate(config)
    est.details["trainable_parameter_count"] = 22_900_000  # the benchmark model's, not the tiny one's
    gpu = get_gpu(gpu_name) if gpu_name else None
    runs = {
        "reference": {}, "micro 1 x 4": {"batch_size": 1, "gradient_accumulation_steps": 4},
        "8-bit": {"optimizer": "adamw-8bit"}, "full checkpointing": {"gradient_checkpointing": "full"},
        "chunked loss": {"loss_chunk_size": 1024},
    }
    seconds = {name: estimated_step_seconds({"batch_size": 4, "gradient_accumulation_steps": 1, **changes}, config,
                                            est, gpu, hf_config) for name, changes in runs.items()}
    return {name: seconds["reference"] / value for name, value in seconds.items()}


def test_speed_model_orders_cpu_configurations_as_measured():
    # benchmarks/bench_speed_ranking.py, CPU, 2 cores, one thread, 2026-11-23, relative to checkpointing off with
    # micro-batch 4 x 1: micro-batch 1 x 4 0.71x, 8-bit AdamW 0.73x, full checkpointing 0.96x, chunked loss 0.74x
    # (0.83x median over six pairs). The former model predicted 0.40x, 0.99x, 0.75x and 0.85x: it put 8-bit AdamW
    # first and full checkpointing last, the reverse of what ran.
    speed = _relative_speeds(None)
    assert 0.6 < speed["micro 1 x 4"] < 0.8
    assert 0.65 < speed["8-bit"] < 0.8
    assert 0.85 < speed["full checkpointing"] < 1.0
    assert 0.75 < speed["chunked loss"] < 0.88
    assert speed["8-bit"] < speed["chunked loss"] < speed["full checkpointing"]


def test_speed_model_on_a_gpu_keeps_small_micro_batches_slow_and_8_bit_adamw_nearly_free():
    speed = _relative_speeds("h100-80gb")
    assert speed["micro 1 x 4"] < 0.5  # 128-token micro-batches leave the GPU idle between kernels
    assert 0.98 < speed["8-bit"] < 1.0  # a tie-break, not a cost
    assert speed["full checkpointing"] < 1.0 and speed["chunked loss"] < 1.0


def test_the_search_pairs_cpu_optimizer_offload_with_optimizer_in_backward():
    from memfit.gpus import get_gpu
    from memfit.prediction.candidates import technique_grid

    config = load_config(overrides={"model": "preset:llama-3.2-1b", "seq_len": 1024})
    grid = technique_grid("full", config, get_gpu("rtx-4090"), 1024, accumulation=1)
    paired = [c for c in grid if c["optimizer_offload"] and c["optimizer_in_backward"]]
    assert paired and all(c["optimizer"] == "adamw" and c["max_grad_norm"] == 0.0 for c in paired)


def _pretend_cuda(monkeypatch, name: str, total_memory: int, capability: tuple[int, int]):
    import types

    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=0: name)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index=0: types.SimpleNamespace(total_memory=total_memory))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: capability)


def test_without_gpu_or_budget_the_plan_is_for_this_machines_gpu(monkeypatch):
    config = load_config(overrides={"model": "preset:llama-3.2-1b", "seq_len": 2048})
    named = plan(config, gpu="rtx-4090")
    _pretend_cuda(monkeypatch, "NVIDIA GeForce RTX 4090", int(23.64 * GIB), (8, 9))
    here = plan(config)
    assert here.device == "rtx-4090" and here.plan == named.plan and here.budget_bytes == named.budget_bytes
    # A budget caps memory; the GPU still decides speed, bf16 and offloading (a CPU plan has no offload).
    capped = plan(config, budget_bytes=12 * GIB)
    assert capped.device == "rtx-4090" and capped.to_dict()["device"] == "rtx-4090"


def test_a_card_without_a_preset_plans_with_its_own_memory(monkeypatch):
    from memfit.gpus import local_gpu

    _pretend_cuda(monkeypatch, "NVIDIA RTX A6000", 48 * GIB, (8, 6))
    spec = local_gpu()
    assert spec.memory_bytes == 48 * GIB and spec.bf16 and spec.name.startswith("NVIDIA RTX A6000 (speed of ")
    assert plan(load_config(overrides={"model": "preset:llama-3.2-1b", "seq_len": 2048})).budget_bytes == 48 * GIB
