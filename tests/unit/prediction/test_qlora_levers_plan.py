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
