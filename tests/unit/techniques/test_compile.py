"""Compiled blocks: same loss and gradients as eager, with checkpointing and LoRA, few recompiles."""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from memfit.techniques.checkpointing import apply_gradient_checkpointing
from memfit.techniques.compile import compile_blocks, compile_stats

SEQ = 24


@pytest.fixture(autouse=True)
def fresh_dynamo():
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    model.train()
    return model


def _loss_and_grads(model, input_ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _assert_same(eager, compiled, input_ids, rtol=1e-5, atol=1e-6):
    loss_eager, grads_eager = _loss_and_grads(eager, input_ids)
    loss_compiled, grads_compiled = _loss_and_grads(compiled, input_ids)
    torch.testing.assert_close(loss_compiled, loss_eager, rtol=rtol, atol=atol)
    assert grads_compiled.keys() == grads_eager.keys() and grads_eager
    for name, grad in grads_eager.items():
        torch.testing.assert_close(grads_compiled[name], grad, rtol=rtol, atol=atol, msg=name)


def _ids(batch=2, seq=SEQ):
    return torch.randint(0, 97, (batch, seq), generator=torch.Generator().manual_seed(seq * 10 + batch))


@pytest.mark.parametrize("checkpointing", ["off", "full", "selective"])
def test_compiled_blocks_give_eager_loss_and_gradients(checkpointing):
    eager = _model()
    apply_gradient_checkpointing(eager, checkpointing)
    compiled = copy.deepcopy(eager)
    choice = compile_blocks(compiled, torch.device("cpu"), backend="aot_eager")
    assert choice.description == "2 of 2 blocks (aot_eager)"
    _assert_same(eager, compiled, _ids())
    assert compile_stats()["compiled_graphs"] >= 1  # it really went through Dynamo


def test_lora_adapters_are_compiled_with_their_block():
    pytest.importorskip("peft")
    from memfit.config import LoraConfig
    from memfit.techniques.lora import apply_lora

    eager, _ = apply_lora(_model(), LoraConfig(lora_r=4), gradient_checkpointing=False)
    for name, parameter in eager.named_parameters():  # non-zero B so the adapters change the output
        if "lora_B" in name:
            torch.nn.init.normal_(parameter, std=0.1)
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled, torch.device("cpu"), backend="aot_eager")
    _assert_same(eager, compiled, _ids())


def test_new_lengths_and_batch_sizes_compile_once_more_not_every_step():
    model = _model()
    compile_blocks(model, torch.device("cpu"), backend="aot_eager")

    def run(shapes):
        for batch, seq in shapes:
            model(input_ids=_ids(batch, seq), labels=_ids(batch, seq), use_cache=False).loss.backward()
        return compile_stats()["compiled_graphs"]

    # Static graph at the first shape, a dynamic one at the first new length; a micro-batch of 1
    # (out-of-memory recovery) is specialised by Dynamo, and the next size after it is dynamic.
    # Both blocks share the graphs.
    warmed = run([(2, 16), (2, 24), (2, 32), (1, 40), (3, 17)])
    assert warmed <= 4
    assert run([(2, 48), (4, 20), (1, 33), (3, 9), (2, 16)]) == warmed  # no new graph for new shapes


def test_without_a_compiler_it_falls_back_visibly(monkeypatch, caplog):
    import memfit.techniques.compile as compile_module

    monkeypatch.setattr(compile_module.shutil, "which", lambda name: None)
    model = _model()
    with caplog.at_level(logging.WARNING, logger="memfit"):
        choice = compile_blocks(model, torch.device("cpu"))
    assert choice.description == "off" and "C++ compiler" in choice.reason
    assert "C++ compiler" in caplog.text
    assert compile_stats()["compiled_graphs"] == 0
    fallbacks = {}
    compile_blocks(model, torch.device("cpu"), fallbacks=fallbacks)  # in a run: noted for the loop to log once
    assert "C++ compiler" in fallbacks["compile"] and "eager" in fallbacks["compile"]


@pytest.mark.slow
def test_inductor_kernels_keep_the_numbers():
    eager = _model()
    apply_gradient_checkpointing(eager, "full")
    compiled = copy.deepcopy(eager)
    compile_blocks(compiled, torch.device("cpu"))
    # Fused kernels reassociate float sums: equal to fp32 rounding, not bit for bit.
    _assert_same(eager, compiled, _ids(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("checkpointing", ["off", "full"])
def test_compiled_blocks_with_a_tiled_mlp_give_eager_loss_and_gradients(checkpointing):
    """The tiled MLP's own autograd function (recompute per tile) traces inside a compiled block."""
    from memfit.techniques.tiled_mlp import apply_tiled_mlp

    eager = _model()
    apply_gradient_checkpointing(eager, checkpointing)
    compiled = copy.deepcopy(eager)
    apply_tiled_mlp(compiled, 3)  # the order setup uses: MLPs tiled first, blocks compiled after
    choice = compile_blocks(compiled, torch.device("cpu"), backend="aot_eager")
    assert "each MLP tile compiled apart" in choice.description
    _assert_same(eager, compiled, _ids())
    # Attention, norms and the tiles all went through Dynamo: no frame fell back to eager.
    assert compile_stats()["compiled_graphs"] >= 3


@pytest.mark.parametrize("chunk_size", [0, 16])
def test_compiled_loss_tail_gives_eager_loss_and_gradients(chunk_size):
    """--compile also compiles the logits-to-loss tail (cast, post-processing, log-softmax), plain and chunked."""
    from memfit.techniques.compile import compile_token_loss
    from memfit.techniques.loss import causal_lm_loss_sum

    eager, compiled = _model(), _model()
    compiled.config.final_logit_softcapping = eager.config.final_logit_softcapping = 30.0  # post-processing runs too
    token_loss = compile_token_loss(backend="aot_eager")
    ids = _ids(seq=40)
    losses, grads = [], []
    for model, tail in ((eager, None), (compiled, token_loss)):
        loss = causal_lm_loss_sum(model, ids, ids, chunk_size=chunk_size, token_loss=tail)
        loss.backward()
        losses.append(loss.detach())
        grads.append({name: p.grad for name, p in model.named_parameters()})
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-6, atol=1e-6)
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, rtol=1e-5, atol=1e-7, msg=name)
    assert compile_stats()["compiled_graphs"] >= 1
