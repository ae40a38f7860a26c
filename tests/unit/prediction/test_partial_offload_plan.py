"""Partial offloaded checkpoints in the config, the estimate (against the tracker) and the planner."""

from __future__ import annotations

from pathlib import Path

import pytest

from memfit.config_loading import load_config
from memfit.errors import UsageError
from memfit.prediction.estimator import ERROR_BAND, estimate
from memfit.prediction.planner import HOST_MARGIN, MARGIN, plan
from memfit.units import GIB

QLORA_8B = {"model": "llama-3.1-8b", "lora_r": 32, "lora_targets": "all-linear"}
COMMON_8B = {**QLORA_8B, "quantize": "4bit", "dtype": "bf16", "batch_size": 1, "seq_len": 65536, "tiled_mlp": 8,
             "gradient_checkpointing": "full", "loss_chunk_size": 1024, "optimizer": "adamw-8bit"}


def _parse(argv: list[str]):
    from memfit.cli.flags import parse_command_line

    config, _ = parse_command_line(argv, extras=[])
    return config


def test_the_block_count_turns_offload_on_and_refuses_what_contradicts_it():
    config = _parse(["--gradient-checkpointing", "full", "--activation-offload-blocks", "20"])
    assert config.memory.activation_offload and config.memory.activation_offload_blocks == 20
    assert "activation_offload" in config.derived  # chosen for the user: logged, not silent
    assert _parse(["--activation-offload"]).memory.activation_offload_blocks is None
    for argv, message in (
        (["--gradient-checkpointing", "full", "--activation-offload-blocks", "-1"], "must be 0 or more"),
        (["--gradient-checkpointing", "full", "--activation-offload-blocks", "two"], "takes a whole number"),
        (["--gradient-checkpointing", "full", "--no-activation-offload", "--activation-offload-blocks", "2"],
         "drop --no-activation-offload"),
        (["--activation-offload-blocks", "2"], "--gradient-checkpointing full"),
        (["--gradient-checkpointing", "selective", "--activation-offload-blocks", "2"], "--gradient-checkpointing full"),
    ):
        with pytest.raises(UsageError, match=message):
            _parse(argv)


def test_a_bad_block_count_is_one_line_on_stderr_and_exit_2():
    from memfit_cli import run_memfit

    result = run_memfit("estimate", "--model", "tiny", "--gradient-checkpointing", "full",
                        "--activation-offload-blocks", "-3")
    assert result.returncode == 2 and result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1 and "--activation-offload-blocks" in result.stderr


def test_the_estimate_moves_exactly_the_offloaded_inputs_between_device_and_host():
    plain = estimate(load_config(overrides=COMMON_8B), gpu="rtx-4090")
    block_input = 65536 * 4096 * 2  # one bf16 residual-stream tensor
    previous = None
    for blocks in (8, 16, 24):
        partial = estimate(load_config(overrides={**COMMON_8B, "activation_offload_blocks": blocks}), gpu="rtx-4090")
        # the first block's input is the embedding output, a leaf LoRA's graph keeps on the device
        assert partial.host_breakdown["activations"] == (blocks - 1) * block_input
        assert partial.details["pcie_bytes_per_micro_batch"] == 2 * (blocks - 1) * block_input
        assert plain.details["activation_bytes"] - partial.details["activation_bytes"] == (blocks - 1) * block_input
        if previous is not None:  # each further block: one input less on the device, one more on the host
            assert previous.peak_bytes - partial.peak_bytes == pytest.approx(8 * block_input * 1.05, rel=0.01)
        previous = partial
    # every block: two inputs are in flight in backward (the one in use, the one fetched ahead)
    every = estimate(load_config(overrides={**COMMON_8B, "activation_offload_blocks": 32}), gpu="rtx-4090")
    assert plain.details["activation_bytes"] - every.details["activation_bytes"] == (31 - 2) * block_input
    assert every.host_bytes == 31 * block_input
    full = estimate(load_config(overrides={**COMMON_8B, "activation_offload": True}), gpu="rtx-4090")
    assert full.host_bytes > every.host_bytes  # full offload also sends the head's inputs


def _save_deep(directory: Path) -> Path:
    """A 12-block Llama narrow enough that the block inputs decide the backward peak."""
    from memfit.models.tiny import save_llama

    return save_llama(directory, hidden_size=64, intermediate_size=128, num_hidden_layers=12)


@pytest.mark.slow
def test_the_estimate_of_partial_offload_matches_the_tracker(tmp_path):
    from memfit.train.profiling import profile_run

    model = _save_deep(tmp_path / "deep")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("memory gradient batch token model layer training fits device loss step\n\n" * 2000)
    measured = {}
    for blocks in (None, 6):
        changes = {"activation_offload_blocks": blocks} if blocks is not None else {}
        config = load_config(overrides={
            "model": str(model), "dataset": str(corpus), "batch_size": 1, "seq_len": 2048, "max_steps": 2,
            "lora_r": 8, "gradient_checkpointing": "full", "log_every": 1000, "report": False,
            "output_dir": str(tmp_path / f"run{blocks}"), **changes})
        report, _ = profile_run(config)
        data = report.to_dict()
        predicted = estimate(config)
        measured[blocks] = data["peak_bytes"]
        print(f"offloaded blocks {blocks or 0}: tracked {data['peak_bytes']} B device, {data.get('host_peak_bytes', 0)} B host;"
              f" estimated {predicted.peak_bytes} B, {predicted.host_bytes} B")
        assert abs(predicted.peak_bytes / data["peak_bytes"] - 1) <= ERROR_BAND["analytical"]
        assert predicted.host_bytes == data.get("host_peak_bytes", 0)
    block_input = 2048 * 64 * 4
    assert measured[None] - measured[6] == 5 * block_input  # blocks 1-5: block 0's input is LoRA's leaf


def test_the_planner_offloads_the_fewest_blocks_that_fit_when_full_offload_overflows_the_host():
    host = 16 * GIB  # full offload reaches 44,800 tokens here, bound by the host
    full_only = plan(load_config(overrides={**QLORA_8B, "activation_offload_blocks": None}), gpu="rtx-4090",
                     allow="qlora", maximize="seq-len", host_memory=host)
    result = plan(load_config(overrides=QLORA_8B), gpu="rtx-4090", allow="qlora", maximize="seq-len", host_memory=host)
    assert full_only.plan.get("activation_offload_blocks") is None and full_only.plan["activation_offload"]
    assert full_only.host_bytes > 0.7 * host * (1 - HOST_MARGIN)  # full offload is bound by the host
    blocks = result.plan["activation_offload_blocks"]
    assert result.plan["activation_offload"] and 0 < blocks < 32
    assert result.plan["seq_len"] > full_only.plan["seq_len"]
    assert result.host_bytes <= host * (1 - HOST_MARGIN) and result.estimated_peak_bytes <= result.budget_bytes * (1 - MARGIN)
    # full offload at the partial plan's length would not fit the host, one block fewer not the device
    at_length = {**QLORA_8B, **{k: v for k, v in result.plan.items() if k != "activation_offload_blocks"}}
    assert estimate(load_config(overrides=at_length), gpu="rtx-4090").host_bytes > host * (1 - HOST_MARGIN)
    fewer = estimate(load_config(overrides={**at_length, "activation_offload_blocks": blocks - 1}), gpu="rtx-4090")
    assert fewer.peak_bytes > result.budget_bytes * (1 - MARGIN)
    assert any(f"first {blocks} of 32 blocks" in line for line in result.trades)
    # the printed command parses back to the planned run
    argv = result.command.split()
    assert argv[:2] == ["memfit", "train"] and f"--activation-offload-blocks {blocks}" in result.command
    planned = _parse(argv[2:])
    assert planned.memory.activation_offload_blocks == blocks and planned.data.seq_len == result.plan["seq_len"]
    again = estimate(planned, gpu="rtx-4090")
    assert again.peak_bytes == result.estimated_peak_bytes and again.host_bytes == result.host_bytes
