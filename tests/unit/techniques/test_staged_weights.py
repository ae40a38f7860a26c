"""Staged load: a mixture of experts under QLoRA or --expert-offload reaches the device in its final form.

Measured by the tracker from the loaded model to the first step (loading, staging, LoRA, NF4 experts,
streaming): the staged load holds the step's resident weights plus one expert stack in the load dtype, the
plain load every stack; the estimate's load peak follows both. Twins: the plain load itself (what staging
removes), and NF4 stacks left to gather on the device under --expert-offload. Staging changes no number: the
same NF4 bytes, loss and adapter gradients as the plain load.
"""

from __future__ import annotations

import pytest
import torch

from memfit.config_loading import load_config
from memfit.memory.tracker import MemoryTracker
from memfit.models.loader import load_model_and_tokenizer
from memfit.prediction.estimator import estimate
from memfit.resolution.resolve import resolve
from memfit.techniques import expert_quant, staged_weights
from memfit.techniques.attention import choose_attention
from memfit.techniques.lora import quantization_config
from memfit.techniques.staged_weights import StagedWeights, stage_on_host, staging_for, staging_for_run
from memfit.train.setup import apply_model_techniques

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

CPU = torch.device("cpu")
TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
CASES = {"qlora": ("4bit", False), "qlora, expert offload": ("4bit", True), "lora, expert offload": ("none", True)}


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """A Qwen3-MoE whose expert stacks are most of its bytes (6 layers of 8 experts), saved by transformers."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=128,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
        num_experts_per_tok=2, max_position_embeddings=64, tie_word_embeddings=False)
    directory = tmp_path_factory.mktemp("staged") / "qwen3-moe"
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def _config(moe_dir, quantize: str, offload: bool, tmp_path):
    return load_config(overrides=dict(
        model=str(moe_dir), tokenizer="tiny", lora_r=2, quantize=quantize, gradient_checkpointing="full",
        expert_offload=offload, output_dir=str(tmp_path), dataset="unused", seq_len=16, batch_size=2, dtype="fp32"))


def _prepared(config, staged: bool):
    """(model ready to train, tracked device peak from the loaded model on, device bytes at the end, at the start)."""
    attention = choose_attention(config.model.attention, CPU, None)
    quantization = quantization_config(config.lora, torch.float32) if config.lora.quantize != "none" else None
    model = load_model_and_tokenizer(config, CPU, attention, quantization, on_host=staged).model
    if staged:
        stage_on_host(model, CPU, staging_for_run(resolve(config, model.config, "cpu"), model.config, world_size=1))
    tracker = MemoryTracker(CPU)
    tracker.attach(model)
    with tracker:
        start = tracker.current_bytes
        model, _ = apply_model_techniques(config, model)
        peak, final = tracker.peak_bytes, tracker.current_bytes
    tracker.detach()
    return model, peak, final, start


def _plain_estimate(config, monkeypatch):
    """The estimate of the load as it was before staging (the rule says: stage nothing)."""
    with monkeypatch.context() as patch:
        patch.setattr(staged_weights, "staging_for_run", lambda *args, **kwargs: StagedWeights())
        return estimate(config)


def _expert_bytes(model) -> int:
    return sum(p.nbytes for n, p in model.named_parameters() if ".experts." in n and "lora" not in n)


@pytest.mark.parametrize("case", list(CASES))
def test_the_staged_load_holds_one_expert_stack_and_the_estimate_follows(case, moe_dir, tmp_path, monkeypatch):
    quantize, offload = CASES[case]
    config = _config(moe_dir, quantize, offload, tmp_path)
    _, staged_peak, staged_final, _ = _prepared(config, staged=True)
    _, plain_peak, plain_final, loaded = _prepared(config, staged=False)
    est, plain_est = estimate(config), _plain_estimate(config, monkeypatch)
    stack = 8 * 256 * 64 * 4  # the largest stack (gate_up) in fp32
    print(f"{case}: staged peak {staged_peak} B (estimate {est.details['load_peak_bytes']}), plain {plain_peak} B"
          f" (estimate {plain_est.details['load_peak_bytes']}), resident after {staged_final} B")
    assert staged_final == plain_final  # the same model in the end
    # staged: the resident weights and at most one stack on its way (plus its NF4 bytes under offload)
    assert staged_peak <= staged_final + (1.2 * stack if quantize == "4bit" else 0.05 * staged_final)
    assert plain_peak > staged_peak + 6 * stack  # the plain load held every stack (12 of them) at once
    assert est.details["staged_load"] == "expert stacks" and plain_est.details["staged_load"] == "nothing"
    assert est.details["load_peak_bytes"] == pytest.approx(staged_peak, rel=0.03)
    assert plain_est.details["load_peak_bytes"] == pytest.approx(plain_peak, rel=0.03)
    # the staged load passes the loaded model through host memory: the estimate says how much
    assert est.load_host_bytes == pytest.approx(loaded, rel=0.01) and not plain_est.load_host_bytes


def test_fault_twin_nf4_stacks_gathering_on_the_device_break_the_band(moe_dir, tmp_path, monkeypatch):
    """Under --expert-offload the NF4 bytes go back to host memory as each stack is made; kept, they gather."""
    config = _config(moe_dir, "4bit", True, tmp_path)
    monkeypatch.setattr(expert_quant, "keeps_on_host", lambda module: False)
    _, peak, _, _ = _prepared(config, staged=True)
    assert peak > 1.2 * estimate(config).details["load_peak_bytes"]


def test_staged_and_plain_loads_train_the_same(moe_dir, tmp_path):
    """Same NF4 bytes, same loss, same adapter gradients: staging moves weights, it changes no number."""
    config = _config(moe_dir, "4bit", False, tmp_path)
    results = []
    for staged in (True, False):
        torch.manual_seed(0)
        model, _, _, _ = _prepared(config, staged)
        from model_zoo import randomize_adapters

        randomize_adapters(model)
        model.train()
        loss = model(input_ids=TOKENS, labels=TOKENS).loss
        loss.backward()
        packed = {n: p.detach().clone() for n, p in model.named_parameters() if ".experts." in n and "lora" not in n}
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((loss.detach(), packed, grads))
    (loss, packed, grads), (plain_loss, plain_packed, plain_grads) = results
    assert packed.keys() == plain_packed.keys() and packed
    for name, value in plain_packed.items():
        assert torch.equal(packed[name], value), name
    torch.testing.assert_close(loss, plain_loss, rtol=0, atol=0)
    assert grads.keys() == plain_grads.keys() and any("experts" in name for name in grads)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=0, msg=name)


def test_what_is_staged_follows_the_run():
    moe = dict(is_moe=True, lora_r=8, embedding_on_host=False, quantize_head=False, world_size=1)
    assert staging_for(**moe, quantize="4bit", expert_offload=False) == StagedWeights(experts=True)
    assert staging_for(**moe, quantize="none", expert_offload=True) == StagedWeights(experts=True,
                                                                                    experts_stay_on_host=True)
    assert not staging_for(**moe, quantize="none", expert_offload=False).any  # bf16 LoRA: loaded as it trains
    assert not staging_for(**moe, quantize="8bit", expert_offload=True).any  # 8-bit weights cannot move once made
    assert not staging_for(**{**moe, "world_size": 2}, quantize="4bit", expert_offload=False).any  # sharded
    assert not staging_for(**{**moe, "is_moe": False}, quantize="4bit", expert_offload=False).any  # dense
    levers = staging_for(**{**moe, "embedding_on_host": True, "quantize_head": True}, quantize="4bit",
                         expert_offload=True)
    assert levers.embedding and levers.head and levers.describe() == "expert stacks, input embedding, output head"


def test_the_frontier_plan_counts_its_load(monkeypatch):
    """gpt-oss-20b QLoRA at 2,048 tokens: the load stays under the step; loaded plainly, it would be the peak."""
    config = load_config(overrides=dict(model="gpt-oss-20b", lora_r=16, quantize="4bit", dtype="bf16", seq_len=2048,
                                        batch_size=1, gradient_checkpointing="full", expert_offload=True))
    staged, plain = estimate(config, gpu="rtx-4090"), _plain_estimate(config, monkeypatch)
    gib = 2**30
    assert staged.details["load_peak_bytes"] < staged.peak_bytes < 12 * gib
    assert staged.details.get("peak_phase") != "load"
    assert plain.details["peak_phase"] == "load" and plain.details["load_peak_bytes"] > 36 * gib
    assert staged.load_host_bytes > 36 * gib  # the bf16 experts pass through host memory instead


@pytest.mark.gpu
def test_staged_load_on_cuda_stays_under_its_estimate(moe_dir, tmp_path):
    """On a GPU: the CUDA allocator's peak from the load to the first step is the estimate's (5 %), every weight
    not filed as host memory is on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    device = torch.device("cuda")
    config = _config(moe_dir, "4bit", True, tmp_path)
    torch.cuda.reset_peak_memory_stats()
    attention = choose_attention(config.model.attention, device, None)
    model = load_model_and_tokenizer(config, device, attention, quantization_config(config.lora, torch.float32),
                                     on_host=True).model
    stage_on_host(model, device, staging_for_run(resolve(config, model.config, "cpu"), model.config, world_size=1))
    model, _ = apply_model_techniques(config, model)
    est = estimate(config)
    assert torch.cuda.max_memory_allocated() <= 1.05 * est.details["load_peak_bytes"]
    for name, parameter in model.named_parameters():
        assert parameter.is_cuda or ".experts." in name, name
