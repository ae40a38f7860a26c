"""The planner's frozen-weight levers (--embedding-on-host, --quantize-head, --expert-dequant-group) on a tiny gpt-oss under QLoRA.

They are tried only where they apply (an untied embedding and head; NF4 experts), left off when the budget is roomy, and
turned on, with what each trades said, when the smallest configuration without them does not fit.
"""

from __future__ import annotations

from memfit.config_loading import load_config
from memfit.prediction.candidates import technique_grid
from memfit.prediction.estimator import estimate
from memfit.prediction.planner import MARGIN, plan
from memfit.prediction.qlora_levers import dequantized_bytes, lever_changes
from memfit.units import GIB
from model_zoo import ZOO

SETTINGS = {"model": "tiny", "seq_len": 64, "batch_size": 1, "lora_r": 2, "quantize": "4bit", "dtype": "bf16"}


def test_levers_apply_to_untied_embeddings_and_nf4_experts_only():
    config = load_config(overrides=SETTINGS)
    assert lever_changes("qlora", config, ZOO["gpt_oss"](), lambda c, n: False) == {
        "embedding_on_host": True, "quantize_head": True, "expert_dequant_group": 1}
    assert lever_changes("lora", config, ZOO["gpt_oss"](), lambda c, n: False) == {"embedding_on_host": True}
    assert lever_changes("full", config, ZOO["gpt_oss"](), lambda c, n: False) == {}
    tied = ZOO["llama"]()
    tied.tie_word_embeddings = True
    assert lever_changes("qlora", config, tied, lambda c, n: False) == {}
    assert lever_changes("qlora", config, ZOO["gpt_oss"](), lambda c, n: True) == {}  # the user chose
    # a group of experts whose weights are not whole 64-weight blocks is dequantized whole, as the technique does
    assert dequantized_bytes(4 * 96, 4, 2, 1) == 4 * 96 * 2


def test_the_planner_turns_the_levers_on_only_when_the_budget_needs_them():
    hf_config = ZOO["gpt_oss"]()
    config = load_config(overrides=SETTINGS)
    roomy = plan(config, budget_bytes=8 * GIB, allow="qlora", hf_config=hf_config)
    assert not roomy.plan.get("embedding_on_host") and not roomy.plan.get("expert_dequant_group")
    grid = technique_grid("qlora", config, None, 64, 1, hf_config=hf_config)
    peaks = {True: [], False: []}
    for changes in grid:
        peak = estimate(config.replace(**changes), hf_config=hf_config).peak_bytes
        peaks["embedding_on_host" in changes].append(peak)
    assert min(peaks[True]) < min(peaks[False])
    tight = plan(config, budget_bytes=int(min(peaks[False]) / (1 - MARGIN)) - 1, allow="qlora", hf_config=hf_config)
    assert tight.plan["embedding_on_host"] and tight.plan["quantize_head"] and tight.plan["expert_dequant_group"] == 1
    assert any(line.startswith("NF4 output head: the frozen head's weights rounded") for line in tight.trades)
    assert any(line.startswith("embedding on host: the frozen input embedding") for line in tight.trades)
    assert any(line.startswith("expert dequantization 1 of 4 experts at a time") for line in tight.trades)
    assert "--embedding-on-host" in tight.command and "--expert-dequant-group 1" in tight.command


def test_the_dequantized_working_set_is_the_larger_of_a_head_tile_and_a_group_of_experts():
    """With --quantize-head and --expert-dequant-group together, whichever dequantized copy is larger counts (here the
    tiny head's one tile, 257 x 32 values, is larger than a group of the tiny experts): neither replaces the other."""
    from memfit.models.state_bytes import parameter_inventory
    from memfit.prediction.qlora_levers import nf4_head_saving, with_qlora_levers

    hf_config = ZOO["gpt_oss"]()
    config = load_config(overrides={**SETTINGS, "quantize_head": True, "expert_dequant_group": 1})
    inventory = parameter_inventory(hf_config, 2)
    parts = with_qlora_levers({"parameters": 10 * GIB, "experts_dequantized_bytes": GIB}, config, hf_config,
                              inventory, 2, "4bit", 2, 2)
    head_tile = nf4_head_saving(config, hf_config, 2, "4bit", 2, 2)[1]
    grouped = with_qlora_levers({"parameters": 10 * GIB, "experts_dequantized_bytes": GIB},
                                config.replace(quantize_head=False), hf_config, inventory, 2, "4bit", 2, 2)
    assert 0 < grouped["experts_dequantized_bytes"] < head_tile  # the whole stack's GiB is replaced by a group
    assert parts["experts_dequantized_bytes"] == head_tile
