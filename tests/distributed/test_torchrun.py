"""2-process runs under torchrun (gloo, CPU): each engine gives the single-process update.

Every run trains a 2-layer Llama for 3 steps on a global batch of 8 samples; the
final weights (gathered into one Hugging Face directory) must equal the reference
run's in fp32 to 1e-5.
"""

from __future__ import annotations

import json

import pytest
from torchrun_helpers import assert_same_weights, final_weights

from memfit.train.metrics import read_metrics

pytestmark = pytest.mark.distributed

# The runs are launched by the session fixtures of conftest.py (engine_runs, later_runs, zero_runs),
# together with the SGD runs of test_exactness.py.


def _steps(out):
    return [r for r in read_metrics(out / "metrics.jsonl") if "event" not in r]


def _state_bytes(rank: dict) -> int:
    return rank["parameters"] + rank["gradients"] + rank["optimizer_states"]


@pytest.fixture(scope="module")
def fsdp_run(engine_runs):
    """AdamW under FSDP2, micro-batch 4 per rank, a checkpoint every 2 steps."""
    return engine_runs["adamw-fsdp"]


@pytest.fixture(scope="module")
def ddp_run(engine_runs):
    """AdamW under DDP, micro-batch 4 per rank, memory tracked."""
    return engine_runs["adamw-ddp"]


def test_fsdp_equals_single_process(fsdp_run, single_run):
    assert_same_weights(final_weights(single_run), final_weights(fsdp_run))
    summary = read_metrics(fsdp_run / "metrics.jsonl")[-1]
    assert summary["world_size"] == 2 and summary["parallel"].startswith("fsdp2 over 2 ranks")
    # The run's peak over ranks is the largest of the steps' peaks over ranks, each at least rank 0's own.
    steps = _steps(fsdp_run)
    assert summary["max_peak_memory_bytes"] == max(s["max_peak_memory_bytes"] for s in steps)
    assert all(s["max_peak_memory_bytes"] >= s["peak_memory_bytes"] > 0 for s in steps)


def test_fsdp_with_chunked_loss_equals_single_process(engine_runs, single_run):
    """The chunked loss runs the model's own forward, so FSDP2's root unit gathers the head: same update."""
    out = engine_runs["adamw-fsdp-chunked"]
    assert_same_weights(final_weights(single_run), final_weights(out))
    start = read_metrics(out / "metrics.jsonl")[0]
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


def test_fsdp_resumes_from_its_sharded_checkpoint(fsdp_run, later_runs):
    """Resuming the step-2 checkpoint (as if killed after it) ends with the uninterrupted weights."""
    checkpoint = fsdp_run / "checkpoints" / "step-2"
    assert (checkpoint / "trainer_state.json").is_file() and (checkpoint / "shards").is_dir()
    assert not list((fsdp_run / "checkpoints").glob(".tmp-*"))
    state = json.loads((checkpoint / "trainer_state.json").read_text())
    assert state["step"] == 2 and state["world_size"] == 2
    copy = later_runs["adamw-fsdp-resumed"]  # a copy of fsdp_run without step 3, resumed with --resume auto
    assert "resumed from" in later_runs["logs"]["adamw-fsdp-resumed"]
    assert [r["step"] for r in _steps(copy)] == [3]
    assert_same_weights(final_weights(fsdp_run), final_weights(copy), atol=1e-6)


def test_oom_on_one_rank_is_recovered_in_step(later_runs, single_run):
    """A memory cap on rank 1 only: it splits its micro-batch, rank 0 follows, the update stays exact."""
    out = later_runs["adamw-capped"]
    records = read_metrics(out / "metrics.jsonl")
    ooms = [r for r in records if r.get("event") == "oom"]
    assert ooms and {r["rank"] for r in ooms} == {1}
    assert ooms[0]["old_micro_batch_size"] == 4 and ooms[0]["new_micro_batch_size"] == 2
    assert _steps(out)[-1]["micro_batch_size"] == 2  # rank 0 agreed
    assert_same_weights(final_weights(single_run), final_weights(out))


def test_deepspeed_zero2_equals_single_process(zero_runs, single_run):
    """A DeepSpeed file with "auto" values, ZeRO-2."""
    out = zero_runs["adamw-zero2-file"]
    assert_same_weights(final_weights(single_run), final_weights(out))
    assert "zero-2" in read_metrics(out / "metrics.jsonl")[-1]["parallel"]


def test_deepspeed_zero3_cpu_offload_equals_single_process(zero_runs, single_run):
    out = zero_runs["adamw-zero3-offload"]
    assert_same_weights(final_weights(single_run), final_weights(out))
    summary = read_metrics(out / "metrics.jsonl")[-1]
    assert "offload optimizer+param" in summary["parallel"]
    whole = sum(t.numel() * 4 for t in final_weights(single_run).values())
    for rank in _steps(out)[-1]["ranks"]:  # ZeRO-3: each rank keeps half of the weights
        assert rank["parameters"] == pytest.approx(whole / 2, rel=0.05)
        assert rank["master_weights"] == pytest.approx(whole / 2, rel=0.05)
