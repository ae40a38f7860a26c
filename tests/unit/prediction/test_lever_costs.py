"""The speed model prices the frozen-weight levers (--embedding-on-host, --quantize-head, --expert-dequant-group).

Each lever raises the predicted step of the same configuration by its cost (prediction/lever_costs.py) and by
nothing else, its cost follows its formula, the planner keeps a lever off where a configuration without it fits
and runs faster, and `memfit plan` says each cost. Config-level, on a tiny gpt-oss (4 experts, vocabulary 257,
width 32) under QLoRA.
"""

from __future__ import annotations

import math

import pytest

from memfit.cli.main import main
from memfit.config_loading import load_config
from memfit.gpus import get_gpu
from memfit.prediction import lever_costs
from memfit.prediction.candidates import technique_grid
from memfit.prediction.estimator import estimate
from memfit.prediction.lever_costs import group_launches
from memfit.prediction.planner import MARGIN, plan
from memfit.prediction.speed_model import estimated_step_seconds
from memfit.prediction.speed_model import lever_step_seconds as lever_seconds
from model_zoo import ZOO

SETTINGS = {"model": "tiny", "seq_len": 64, "batch_size": 1, "lora_r": 2, "quantize": "4bit", "dtype": "bf16"}
BASE = {"batch_size": 2, "gradient_accumulation_steps": 2, "gradient_checkpointing": "full", "loss_chunk_size": 16,
        "lora_r": 2, "quantize": "4bit", "dtype": "bf16", "optimizer": "adamw"}
LEVERS = {"embedding_on_host": True, "quantize_head": True, "expert_dequant_group": 1}


@pytest.fixture(scope="module")
def gpt_oss():
    return ZOO["gpt_oss"]()


def _step(changes, hf_config, gpu):
    config = load_config(overrides=SETTINGS)
    est = estimate(config.replace(**changes), hf_config=hf_config, gpu=gpu)
    return estimated_step_seconds(changes, config, est, gpu, hf_config)


def _check_each_lever_adds_its_cost(hf_config, gpu, step=_step):
    config = load_config(overrides=SETTINGS)
    plain = step(BASE, hf_config, gpu)
    for lever, value in LEVERS.items():
        changes = {**BASE, lever: value}
        cost = lever_seconds(changes, config, hf_config, gpu)
        assert set(cost) == {lever}  # this lever's cost, no other
        added = step(changes, hf_config, gpu) - plain
        assert added == pytest.approx(cost[lever], rel=1e-9, abs=1e-15), lever
        if gpu is not None or lever != "embedding_on_host":  # a CPU step reads the rows where they are
            assert cost[lever] > 0, lever


@pytest.mark.parametrize("gpu_name", [None, "t4"])
def test_each_lever_raises_the_predicted_step_by_its_cost_and_nothing_else(gpt_oss, gpu_name):
    gpu = get_gpu(gpu_name) if gpu_name else None
    _check_each_lever_adds_its_cost(gpt_oss, gpu)
    # the three together add the sum of the three
    config = load_config(overrides=SETTINGS)
    together = _step({**BASE, **LEVERS}, gpt_oss, gpu) - _step(BASE, gpt_oss, gpu)
    assert together == pytest.approx(sum(lever_seconds({**BASE, **LEVERS}, config, gpt_oss, gpu).values()), rel=1e-9)


@pytest.mark.parametrize("scale", [0.0, 2.0])
def test_fault_twin_a_speed_model_that_drops_or_doubles_the_costs_fails_the_check(gpt_oss, monkeypatch, scale):
    """The step priced with each lever's cost dropped (or counted twice) while the trade-offs still say it."""
    original = lever_costs.lever_model_seconds

    def faulty_step(changes, hf_config, gpu):
        with monkeypatch.context() as patch:
            patch.setattr(lever_costs, "lever_model_seconds", lambda *args, **kwargs: {
                name: scale * seconds for name, seconds in original(*args, **kwargs).items()})
            return _step(changes, hf_config, gpu)

    with pytest.raises(AssertionError):
        _check_each_lever_adds_its_cost(gpt_oss, get_gpu("t4"), step=faulty_step)


def test_the_nf4_head_costs_its_dequantized_weights_and_twice_the_chunks_twice_the_time(gpt_oss):
    config = load_config(overrides=SETTINGS)
    t4 = get_gpu("t4")
    head = {**BASE, "quantize_head": True}
    chunks_8 = lever_seconds(head, config, gpt_oss, t4)["quantize_head"]  # 128 tokens in chunks of 16
    chunks_16 = lever_seconds({**head, "loss_chunk_size": 8}, config, gpt_oss, t4)["quantize_head"]
    assert chunks_16 == pytest.approx(2 * chunks_8, rel=1e-12)
    # the whole head (257 x 32) three times a chunk (forward, recompute, input gradient), 8 chunks, 2 micro-batches,
    # each weight reading half a byte, writing two (bf16) and the absmax, at half the T4's 320 GB/s
    weights = 257 * 32 * 3 * 8 * 2
    expected = weights * (0.5 + 2 + 8 / 64) / (lever_costs.DEQUANT_BANDWIDTH_SHARE * 320e9)
    assert chunks_8 == pytest.approx(expected, rel=1e-12)
    # on a CPU the same weights at DEQUANT_CPU_FLOPS a weight, at the step's (nominal) rate
    cpu = lever_seconds(head, config, gpt_oss, None, calibrate=False)["quantize_head"]
    assert cpu == pytest.approx(weights * lever_costs.DEQUANT_CPU_FLOPS["bf16"] / (100e12 * 0.45), rel=1e-12)


def test_expert_groups_cost_their_extra_grouped_matmuls(gpt_oss):
    # tiny gpt-oss: 2 layers x 2 stacks (gate_up, down) of 4 experts; 3 calls each under full checkpointing
    assert group_launches(gpt_oss, 2, 1, 3) == (4 * 3 * 3, 4 * 3)  # 3 more groups and one offsets read a call
    assert group_launches(gpt_oss, 2, 2, 3) == (4 * 1 * 3, 4 * 3)
    assert group_launches(gpt_oss, 2, 4, 3) == (0, 0)  # G = E: the whole stack, as the technique runs it
    config = load_config(overrides=SETTINGS)
    t4 = get_gpu("t4")
    one = lever_seconds({**BASE, "expert_dequant_group": 1}, config, gpt_oss, t4)["expert_dequant_group"]
    two = lever_seconds({**BASE, "expert_dequant_group": 2}, config, gpt_oss, t4)["expert_dequant_group"]
    whole = lever_seconds({**BASE, "expert_dequant_group": 4}, config, gpt_oss, t4)["expert_dequant_group"]
    per_call = lever_costs.GROUP_SECONDS["cuda"], lever_costs.HOST_SYNC_SECONDS["cuda"]
    assert one == pytest.approx(2 * 12 * (3 * per_call[0] + per_call[1]), rel=1e-12)  # 2 micro-batches
    assert two == pytest.approx(2 * 12 * (1 * per_call[0] + per_call[1]), rel=1e-12)
    assert whole == 0
    # without checkpointing no recompute: two calls a stack instead of three
    off = lever_seconds({**BASE, "expert_dequant_group": 1, "gradient_checkpointing": "off"}, config, gpt_oss, t4)
    assert off["expert_dequant_group"] == pytest.approx(one * 2 / 3, rel=1e-12)
    # on a CPU: GROUP_CPU_FLOPS an extra group and no synchronisation cost, so G=1 costs 3x G=2 here
    cpu = {g: lever_seconds({**BASE, "expert_dequant_group": g}, config, gpt_oss, None, calibrate=False)
           for g in (1, 2)}
    assert cpu[1]["expert_dequant_group"] == pytest.approx(3 * cpu[2]["expert_dequant_group"], rel=1e-12)


def test_the_embedding_on_host_costs_its_rows_over_the_link_on_cuda_and_nothing_on_a_cpu(gpt_oss):
    config = load_config(overrides=SETTINGS)
    changes = {**BASE, "embedding_on_host": True}
    t4 = get_gpu("t4")
    tokens, rows = 128, 128 * 32 * 2  # 2 x 64 tokens a micro-batch, bf16 rows of 32
    expected = 2 * ((8 * tokens + rows) / (t4.host_link_gbps * 1e9) + 2 * rows / lever_costs.HOST_COPY_BYTES_PER_SECOND
                    + lever_costs.HOST_SYNC_SECONDS["cuda"])
    assert lever_seconds(changes, config, gpt_oss, t4)["embedding_on_host"] == pytest.approx(expected, rel=1e-12)
    assert lever_seconds(changes, config, gpt_oss, None)["embedding_on_host"] == 0.0
    tied = ZOO["llama"]()
    tied.tie_word_embeddings = True
    assert lever_seconds(changes, config, tied, t4) == {}  # a tied table stays on the device: no cost


PLANNED = {**SETTINGS, "seq_len": 1024}


@pytest.fixture(scope="module")
def large_vocabulary():
    """The tiny gpt-oss with a 32,000-token vocabulary: at 1,024 tokens its logits need the chunked loss."""
    hf_config = ZOO["gpt_oss"]()
    hf_config.vocab_size = 32000
    return hf_config


@pytest.fixture(scope="module")
def t4_budget(large_vocabulary):
    """A T4 budget where full checkpointing with loss chunks of 256 is the fastest configuration without a lever that
    fits (no checkpointing and selective need more; the same with the levers needs less, and ties it when unpriced)."""
    from memfit.prediction.planner import _Search

    config = load_config(overrides=PLANNED)
    search = _Search(config, large_vocabulary, 1 << 40, get_gpu("t4"), 1, "none", "auto", None)
    found = [search.candidate(changes, 1, 1, 1024)
             for changes in technique_grid("qlora", config, get_gpu("t4"), 1024, 1, hf_config=large_vocabulary)]
    plain = [c for c in found if "embedding_on_host" not in c.changes and not c.changes.get("expert_offload")]
    target = min((c for c in plain if c.changes["gradient_checkpointing"] == "full" and c.changes["loss_chunk_size"]),
                 key=lambda c: c.estimate.peak_bytes)
    budget = math.ceil(target.estimate.peak_bytes / (1 - MARGIN)) + 1
    faster = [c for c in plain if c.step_seconds < target.step_seconds]
    assert all(c.estimate.peak_bytes > budget * (1 - MARGIN) for c in faster)  # the setting the tests need
    return budget


def test_the_planner_keeps_the_levers_off_where_a_faster_configuration_fits(large_vocabulary, t4_budget):
    config = load_config(overrides=PLANNED)
    result = plan(config, budget_bytes=t4_budget, gpu="t4", allow="qlora", hf_config=large_vocabulary)
    assert not any(result.plan.get(lever) for lever in LEVERS)
    assert result.plan["gradient_checkpointing"] == "full" and result.plan["loss_chunk_size"]  # the levers' twin


def test_fault_twin_without_the_costs_the_planner_takes_the_levers(large_vocabulary, t4_budget, monkeypatch):
    """Priced at nothing, the levers tie with their twin and their smaller peak wins: what the costs prevent."""
    monkeypatch.setattr(lever_costs, "lever_model_seconds", lambda *args, **kwargs: {})
    config = load_config(overrides=PLANNED)
    result = plan(config, budget_bytes=t4_budget, gpu="t4", allow="qlora", hf_config=large_vocabulary)
    assert result.plan.get("embedding_on_host") and result.plan.get("quantize_head")


def test_memfit_plan_names_each_levers_cost(gpt_oss, tmp_path, capsys):
    gpt_oss.save_pretrained(tmp_path)
    config = load_config(overrides={**SETTINGS, "model": str(tmp_path)})
    peaks = [estimate(config.replace(**changes), hf_config=gpt_oss).peak_bytes
             for changes in technique_grid("qlora", config, None, 64, 1, hf_config=gpt_oss)
             if "embedding_on_host" not in changes and not changes.get("expert_offload")]
    budget = int(min(peaks) / (1 - MARGIN)) - 1  # only configurations with the levers fit
    code = main(["plan", "--model", str(tmp_path), "--memory-budget", str(budget), "--seq-len", "64", "--batch-size",
                 "1", "--lora-r", "2", "--quantize", "4bit", "--dtype", "bf16", "--allow", "qlora", "--no-expert-offload"])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    head = next(line for line in lines if "NF4 output head" in line)
    groups = next(line for line in lines if "expert dequantization 1 of 4" in line)
    embedding = next(line for line in lines if "embedding on host" in line)
    assert " per step" in head and "ms per step" in groups
    assert "no time on a CPU" in embedding
