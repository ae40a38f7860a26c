"""2-process runs under torchrun (gloo, CPU): each engine gives the single-process update.

Every run trains a 2-layer Llama for 3 steps on a global batch of 8 samples; the
final weights (gathered into one Hugging Face directory) must equal the reference
run's in fp32 to 1e-5.
"""

from __future__ import annotations

import json
import shutil

import pytest
from torchrun_helpers import assert_same_weights, deepspeed_available, final_weights, launch

from memfit.distributed.parallel import CAP_RANK_ENV
from memfit.train.metrics import read_metrics

pytestmark = pytest.mark.distributed


def _steps(out):
    return [r for r in read_metrics(out / "metrics.jsonl") if "event" not in r]


def _state_bytes(rank: dict) -> int:
    return rank["parameters"] + rank["gradients"] + rank["optimizer_states"]


@pytest.fixture(scope="module")
def fsdp_run(run_args, tmp_path_factory):
    out = tmp_path_factory.mktemp("fsdp")
    launch(*run_args, "--batch-size", "4", "--sharding", "fsdp", "--save-every", "2", "--output-dir", out)
    return out


@pytest.fixture(scope="module")
def ddp_run(run_args, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp")
    launch(*run_args, "--batch-size", "4", "--sharding", "ddp", "--track-memory", "--output-dir", out)
    return out


def test_fsdp_equals_single_process(fsdp_run, single_run):
    assert_same_weights(final_weights(single_run), final_weights(fsdp_run))
    summary = read_metrics(fsdp_run / "metrics.jsonl")[-1]
    assert summary["world_size"] == 2 and summary["parallel"].startswith("fsdp2 over 2 ranks")
    # The run's peak over ranks is the largest of the steps' peaks over ranks, each at least rank 0's own.
    steps = _steps(fsdp_run)
    assert summary["max_peak_memory_bytes"] == max(s["max_peak_memory_bytes"] for s in steps)
    assert all(s["max_peak_memory_bytes"] >= s["peak_memory_bytes"] > 0 for s in steps)


def test_fsdp_with_chunked_loss_equals_single_process(run_args, single_run, tmp_path):
    """The chunked loss runs the model's own forward, so FSDP2's root unit gathers the head: same update."""
    args = ["16" if previous == "--loss-chunk-size" else arg for previous, arg in zip(["", *run_args], run_args)]
    launch(*args, "--batch-size", "4", "--sharding", "fsdp", "--output-dir", tmp_path)
    assert_same_weights(final_weights(single_run), final_weights(tmp_path))
    start = read_metrics(tmp_path / "metrics.jsonl")[0]
    assert start["loss_chunk_size"] == 16 and "loss_chunk_size" not in start["fallbacks"]


def test_ddp_equals_single_process(ddp_run, single_run):
    assert_same_weights(final_weights(single_run), final_weights(ddp_run))


def test_fsdp_holds_half_the_state_per_rank(fsdp_run, ddp_run):
    """Parameters + gradients + optimizer state per rank: 1/2 of the whole model's under FSDP2."""
    whole = _state_bytes(_steps(ddp_run)[-1]["ranks"][0])
    ranks = _steps(fsdp_run)[-1]["ranks"]
    assert [r["rank"] for r in ranks] == [0, 1]
    for rank in ranks:
        assert _state_bytes(rank) == pytest.approx(whole / 2, rel=0.05)
        assert rank["gradients"] == rank["parameters"] > 0
    assert sum(_state_bytes(r) for r in ranks) == pytest.approx(whole, rel=0.01)


def test_fsdp_resumes_from_its_sharded_checkpoint(fsdp_run, run_args, tmp_path):
    """Resuming the step-2 checkpoint (as if killed after it) ends with the uninterrupted weights."""
    checkpoint = fsdp_run / "checkpoints" / "step-2"
    assert (checkpoint / "trainer_state.json").is_file() and (checkpoint / "shards").is_dir()
    assert not list((fsdp_run / "checkpoints").glob(".tmp-*"))
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["world_size"] == 2
    copy = tmp_path / "run"
    shutil.copytree(fsdp_run, copy, ignore=shutil.ignore_patterns("final", "step-3", "metrics.jsonl"))
    result = launch(*run_args, "--batch-size", "4", "--sharding", "fsdp", "--resume", "auto", "--output-dir", copy)
    assert "resumed from" in result.stderr
    assert [r["step"] for r in _steps(copy)] == [3]
    assert_same_weights(final_weights(fsdp_run), final_weights(copy), atol=1e-6)


def test_oom_on_one_rank_is_recovered_in_step(ddp_run, run_args, single_run, tmp_path):
    """A memory cap on rank 1 only: it splits its micro-batch, rank 0 follows, the update stays exact."""
    steps = _steps(ddp_run)
    static = _state_bytes(steps[-1]["ranks"][1])
    peak = max(s["ranks"][1]["tracked_peak_bytes"] for s in steps)
    cap = static + int(0.8 * (peak - static))  # fits a micro-batch of 2, not of 4
    launch(
        *run_args,
        "--batch-size",
        "4",
        "--sharding",
        "ddp",
        "--memory-cap",
        cap,
        "--output-dir",
        tmp_path,
        env={CAP_RANK_ENV: "1"},
    )
    records = read_metrics(tmp_path / "metrics.jsonl")
    ooms = [r for r in records if r.get("event") == "oom"]
    assert ooms and {r["rank"] for r in ooms} == {1}
    assert ooms[0]["old_micro_batch_size"] == 4 and ooms[0]["new_micro_batch_size"] == 2
    assert _steps(tmp_path)[-1]["micro_batch_size"] == 2  # rank 0 agreed
    assert_same_weights(final_weights(single_run), final_weights(tmp_path))


needs_deepspeed = pytest.mark.skipif(not deepspeed_available(), reason="deepspeed is not installed")


@needs_deepspeed
def test_deepspeed_zero2_equals_single_process(run_args, single_run, tmp_path):
    config = tmp_path / "ds.json"
    config.write_text(
        json.dumps(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "gradient_accumulation_steps": "auto",
                "train_batch_size": "auto",
                "gradient_clipping": "auto",
                "bf16": {"enabled": "auto"},
                "zero_optimization": {"stage": 2, "reduce_bucket_size": "auto"},
            }
        )
    )
    out = tmp_path / "run"
    launch(
        *run_args, "--batch-size", "2", "--gradient-accumulation-steps", "2", "--deepspeed", config, "--output-dir", out
    )
    assert_same_weights(final_weights(single_run), final_weights(out))
    assert "zero-2" in read_metrics(out / "metrics.jsonl")[-1]["parallel"]


@needs_deepspeed
def test_deepspeed_zero3_cpu_offload_equals_single_process(run_args, single_run, tmp_path):
    launch(*run_args, "--batch-size", "4", "--zero-stage", "3", "--zero-offload", "--output-dir", tmp_path)
    assert_same_weights(final_weights(single_run), final_weights(tmp_path))
    summary = read_metrics(tmp_path / "metrics.jsonl")[-1]
    assert "offload optimizer+param" in summary["parallel"]
    whole = sum(t.numel() * 4 for t in final_weights(single_run).values())
    for rank in _steps(tmp_path)[-1]["ranks"]:  # ZeRO-3: each rank keeps half of the weights
        assert rank["parameters"] == pytest.approx(whole / 2, rel=0.05)
        assert rank["master_weights"] == pytest.approx(whole / 2, rel=0.05)
