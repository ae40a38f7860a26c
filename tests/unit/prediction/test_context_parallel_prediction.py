"""The per-rank estimate of a context-parallel run: its terms, refusals, plan and traffic."""
import pytest

from memfit.errors import UsageError
from memfit.prediction.context_parallel import (
    GIB,
    Levers,
    ModelShape,
    all_to_all_bytes_per_step,
    all_to_all_seconds,
    per_rank_estimate,
    plan_context_parallel,
)

LLAMA_8B = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, intermediate=14336, vocab=128256,
                      parameters=8_030_261_248)
TINY = ModelShape(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=100, parameters=10_000)


def test_activations_outside_attention_scale_with_one_over_n():
    one = per_rank_estimate(LLAMA_8B, 65536, 1, 8).terms
    four = per_rank_estimate(LLAMA_8B, 65536, 4, 8).terms
    for term in ("saved_activations", "layer_working", "loss"):
        assert four[term] == pytest.approx(one[term] / 4)
    # attention sees the whole sequence on heads/N: also 1/N; model state is sharded over all 8 ranks either way
    assert four["attention"] == pytest.approx(one["attention"] / 4)
    assert four["model_state"] == one["model_state"] == pytest.approx(LLAMA_8B.parameters * 16 / 8)


def test_all_to_all_buffers_exact_for_a_known_shape():
    estimate = per_rank_estimate(TINY, 32, 2, 2)
    # q, k, v, out: 4 tensors of [16 tokens, 4 heads, 16 head_dim] in bf16
    assert estimate.terms["all_to_all"] == 4 * 16 * 4 * 16 * 2
    assert estimate.tokens_per_rank == 16
    assert "1 data-parallel x 2 context-parallel" in estimate.summary()


def test_offloaded_checkpoints_move_to_host_per_rank():
    estimate = per_rank_estimate(TINY, 32, 2, 2, Levers(offload_checkpoints=True))
    assert estimate.host_bytes == 2 * 16 * 64 * 2  # layers x tokens per rank x hidden x bf16


@pytest.mark.parametrize("cp, seq, words", [(3, 30, "heads to divide"), (2, 31, "must divide")])
def test_refusals(cp, seq, words):
    with pytest.raises(UsageError, match=words):
        per_rank_estimate(TINY, seq, cp, 6)


def test_ring_is_refused():
    with pytest.raises(UsageError, match="ring"):
        per_rank_estimate(TINY, 32, 2, 2, mode="ring")


def test_plan_on_eight_h100_is_longer_than_one():
    device, host = 0.95 * 79.11 * GIB, 0.75 * 1024 * GIB
    plans = plan_context_parallel(LLAMA_8B, 8, device, host)
    eight = plans[0]
    data_parallel_only = max(plan.seq_len for plan in plans if plan.estimate.context_parallel == 1)
    assert eight.estimate.context_parallel == 8
    assert eight.seq_len > 4 * data_parallel_only
    # a full fine-tune's 16 bytes a parameter (128 GB) never fits one 80 GB GPU
    assert plan_context_parallel(LLAMA_8B, 1, device, host) == []
    assert eight.estimate.peak_bytes <= device


def test_traffic_grows_with_n():
    sizes = [all_to_all_bytes_per_step(LLAMA_8B, 65536, n) for n in (1, 2, 4, 8)]
    assert sizes[0] == 0
    # (N-1)/N of seq/N x hidden x 2 bytes, 8 per layer
    assert sizes[1] == 32 * 8 * 0.5 * 32768 * 4096 * 2
    assert all_to_all_seconds(LLAMA_8B, 65536, 16) > all_to_all_seconds(LLAMA_8B, 65536, 8)


def test_benchmark_plan_script_rows_for_the_preset():
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "benchmarks"))
    from plan_context_parallel import rows_for

    rows = rows_for("llama-3.1-8b", 8, "h100", 256 * GIB)
    assert [row[0] for row in rows] == ["8 x 1", "4 x 2", "2 x 4", "1 x 8"]
    lengths = [int(row[1].replace(",", "")) for row in rows]
    assert lengths == sorted(lengths) and lengths[-1] > 7 * lengths[0]


def test_memfit_estimate_says_the_split_and_gives_one_rank_of_it(capsys):
    from memfit.cli.estimate import run

    assert run(["--model", "llama-3.1-8b", "--seq-len", "65536", "--context-parallel", "8", "--world-size", "8",
                "--gradient-checkpointing", "full", "--sharding", "fsdp"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert "1 data-parallel x 8 context-parallel, 8192 of 65536 tokens per rank" in line


@pytest.mark.parametrize("checkpointing, seq_len", [("full", 262144), ("off", 65536)])
def test_the_estimator_prices_one_rank_as_the_step_at_seq_over_n_plus_the_exchange(checkpointing, seq_len):
    from memfit import load_config
    from memfit.prediction.estimator import estimate

    def estimated(seq_len, context_parallel):
        config = load_config(overrides={"model": "llama-3.1-8b", "seq_len": seq_len, "batch_size": 1,
                                        "gradient_checkpointing": checkpointing,
                                        "context_parallel": context_parallel})
        return estimate(config, world_size=8, sharding="fsdp", gpu="h100")

    split, whole_on_one = estimated(seq_len, 8), estimated(seq_len // 8, 1)
    assert split.details["peak_phase"] == "backward"
    buffers = split.details["context_parallel"]["all_to_all_buffer_bytes"]
    # q and its exchanged copy, bf16 (8 key-value heads divide by 8: nothing repeated)
    assert buffers == 2 * (seq_len // 8) * 4096 * 2
    assert split.breakdown["activations"] == whole_on_one.breakdown["activations"] + buffers
    assert split.peak_bytes == pytest.approx(whole_on_one.peak_bytes + buffers * 1.05, rel=1e-6)  # + allocator slack
    assert split.peak_bytes < estimated(seq_len, 1).peak_bytes / 2


def test_a_world_size_that_does_not_divide_is_refused():
    from memfit import load_config
    from memfit.prediction.estimator import estimate

    config = load_config(overrides={"model": "llama-3.1-8b", "seq_len": 4096, "context_parallel": 4})
    with pytest.raises(UsageError, match="must divide --world-size 6"):
        estimate(config, world_size=6)
