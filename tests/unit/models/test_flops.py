"""The FLOPs-per-token formula against PyTorch's own count of the matmuls a step runs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from memfit.models.flops import DevicePeak, device_peak, flops_per_token, probe_matmul_flops, utilisation

BATCH, SEQ = 2, 32


def _llama(**overrides):
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, **overrides,
    )
    torch.manual_seed(0)
    # Eager attention runs its two matmuls as counted ops (the CPU SDPA kernel has no flop formula).
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager"), config


def _counted_per_token(model, step=None) -> float:
    input_ids = torch.randint(0, model.config.vocab_size, (BATCH, SEQ))
    counter = FlopCounterMode(display=False)
    with counter:
        if step is None:
            model(input_ids=input_ids, labels=input_ids).loss.backward()
        else:
            step(model, input_ids).backward()
    return counter.get_total_flops() / (BATCH * SEQ)


def test_full_training_matches_the_counted_matmuls():
    model, config = _llama()
    model.train()
    expected = flops_per_token(config, SEQ)
    counted = _counted_per_token(model)
    # The rotary embedding's small position matmul is the only counted op the formula leaves out.
    assert counted == pytest.approx(expected.model, rel=0.01)
    assert expected.hardware == expected.model
    assert expected.model == pytest.approx(3 * expected.forward)


def test_full_checkpointing_counts_the_recomputed_forward_as_hardware_flops():
    model, config = _llama()
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    expected = flops_per_token(config, SEQ, checkpointing="full on 2 of 2 blocks")
    counted = _counted_per_token(model)
    assert counted == pytest.approx(expected.hardware, rel=0.01)
    # Everything of the blocks' forward but the MLP's output projection (2 x hidden x intermediate).
    assert expected.hardware == pytest.approx(expected.model + expected.block_forward - 2 * 2 * 64 * 160)


def test_chunked_loss_counts_the_recomputed_head():
    from memfit.techniques.loss import chunked_causal_lm_loss_sum

    model, config = _llama()
    model.train()
    expected = flops_per_token(config, SEQ, chunked_loss=True)

    def step(m, ids):
        return chunked_causal_lm_loss_sum(m, ids, ids, None, chunk_size=16)

    # The chunked loss projects only the SEQ - 1 positions that have a target.
    counted = _counted_per_token(model, step)
    head_saved = 3 * expected.head_forward * BATCH / (BATCH * SEQ)  # no head FLOPs for the last position
    recompute_saved = expected.head_forward * BATCH / (BATCH * SEQ)
    assert counted == pytest.approx(expected.hardware - head_saved - recompute_saved, rel=0.01)


def test_lora_has_no_weight_gradients_for_the_frozen_base():
    peft = pytest.importorskip("peft")
    model, config = _llama()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=targets))
    model.train()
    expected = flops_per_token(config, SEQ, lora_rank=4)
    counted = _counted_per_token(model)
    assert counted == pytest.approx(expected.model, rel=0.01)
    assert expected.model < flops_per_token(config, SEQ).model * 0.8


def test_gpt2_shape_is_read_too():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    model.config._attn_implementation = "eager"
    model.train()
    assert _counted_per_token(model) == pytest.approx(flops_per_token(config, SEQ).model, rel=0.01)


def test_cpu_peak_is_probed_once_and_mfu_is_a_fraction():
    cpu = torch.device("cpu")
    peak = device_peak(cpu)
    assert peak.source == "matmul probe fp32 on cpu"
    assert peak.flops_per_second > 1e8
    assert probe_matmul_flops(cpu) == peak.flops_per_second  # cached: the same figure, not a new timing
    flops = flops_per_token(_llama()[1], SEQ, checkpointing="full")
    # A step that ran at half the peak in hardware FLOPs.
    tokens = 1000
    seconds = tokens * flops.hardware / (0.5 * peak.flops_per_second)
    result = utilisation(tokens, seconds, flops, DevicePeak(peak.flops_per_second, "test"))
    assert result["hfu"] == pytest.approx(0.5)
    assert 0 < result["mfu"] < result["hfu"]


def test_moe_flops_count_active_experts_not_all():
    """A token of an MoE runs top-k of n experts: its FLOPs follow the active, not the total, parameters."""
    from memfit.models.experts import moe_shape
    from model_zoo import ZOO

    config = ZOO["qwen3_moe"]()
    shape = moe_shape(config)
    assert (shape.experts, shape.top_k, shape.expert_width, shape.moe_layers) == (4, 2, 32, 2)
    routed = flops_per_token(config, seq_len=32).model
    config.num_experts = 16  # four times the experts, the same two per token: the same work but the router's
    more_experts = flops_per_token(config, seq_len=32).model
    assert more_experts < 1.05 * routed
    config.num_experts_per_tok = 4  # twice the experts per token: about twice the MLP's work
    assert flops_per_token(config, seq_len=32).model > 1.2 * more_experts


def test_moe_shape_reads_dense_first_layers_and_shared_experts():
    from memfit.models.experts import moe_shape
    from model_zoo import ZOO

    shape = moe_shape(ZOO["deepseek_v3"]())
    assert shape.moe_layers == 1 and shape.shared_width == 32 and shape.active_width() == 3 * 32
    assert moe_shape(ZOO["llama"]()) is None
