"""Memory-efficient LoRA adapters: PEFT's forward bit for bit, the same gradients, no fp32 copy of the input."""

from __future__ import annotations

import contextlib
import copy
import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel

from memfit.config import LoraConfig
from memfit.config_loading import load_config
from memfit.techniques import efficient_lora
from memfit.techniques.efficient_lora import adapted_linear, apply_efficient_lora
from memfit.techniques.lora import apply_lora, quantization_config
from sgd_twin import assert_same_after_sgd
from tiny_llama import tiny_llama
from tracked_against_estimate import peaks_and_estimates

VOCAB = 256


def _tokens(rows: int = 2, seq: int = 32, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, seq), generator=torch.Generator().manual_seed(seed))


def _with_adapters(model: torch.nn.Module, **lora) -> torch.nn.Module:
    """PEFT adapters on every linear, lora_B made non-zero so every adapter gradient is non-trivial."""
    model, _ = apply_lora(model, LoraConfig(lora_r=8, lora_targets="all-linear", **lora), gradient_checkpointing=False)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.05)
    return model.train()


def _loss_and_grads(model, input_ids, autocast: bool = False):
    model.zero_grad(set_to_none=True)
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with context:
        loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _bf16_llama(_directory):
    return tiny_llama().to(torch.bfloat16)


def _qlora_llama(directory):
    pytest.importorskip("bitsandbytes")
    config = quantization_config(LoraConfig(lora_r=8, quantize="4bit"), torch.bfloat16)
    return AutoModelForCausalLM.from_pretrained(directory, quantization_config=config, device_map={"": "cpu"},
                                                dtype=torch.bfloat16)


# name: (build the base, from the saved model's directory where it loads quantized; autocast)
CASES = {
    "fp32 base": (lambda _directory: tiny_llama(), False),
    "bf16 base": (_bf16_llama, False),
    "bf16 base under bf16 autocast": (_bf16_llama, True),
    "4-bit base (QLoRA, bf16 compute)": (_qlora_llama, False),
    "4-bit base under bf16 autocast": (_qlora_llama, True),
}


@pytest.mark.numerics
@pytest.mark.parametrize("name", list(CASES))
def test_forward_is_bit_identical_and_gradients_equal_peft(name, llama_dir):
    build, autocast = CASES[name]
    plain = _with_adapters(build(llama_dir))
    efficient = copy.deepcopy(plain)
    assert apply_efficient_lora(efficient) == "14 of 14 adapted linears"
    input_ids = _tokens()
    loss_ref, grads_ref = _loss_and_grads(plain, input_ids, autocast)
    loss, grads = _loss_and_grads(efficient, input_ids, autocast)

    assert torch.equal(loss, loss_ref)  # PEFT's operations in PEFT's order
    assert grads.keys() == grads_ref.keys() and len(grads) == 28  # lora_A and lora_B of 14 linears
    for parameter_name, grad in grads.items():
        # the same products, the scale applied to the rank-r side: fp32 rounding at most
        torch.testing.assert_close(grad, grads_ref[parameter_name], rtol=1e-5, atol=1e-8, msg=parameter_name)


@pytest.mark.numerics
def test_many_slices_give_the_same_output_and_gradients(monkeypatch):
    """An input longer than one slice is cast, multiplied and differentiated slice by slice."""
    plain = _with_adapters(tiny_llama().to(torch.bfloat16))
    efficient = copy.deepcopy(plain)
    apply_efficient_lora(efficient)
    monkeypatch.setattr(efficient_lora, "SLICE_ELEMENTS", 3 * 128)  # 3 rows of the MLP's width, 6 of the hidden
    input_ids = _tokens(rows=2, seq=40)
    loss_ref, grads_ref = _loss_and_grads(plain, input_ids)
    loss, grads = _loss_and_grads(efficient, input_ids)
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=0)
    for parameter_name, grad in grads.items():
        # sums over slices in another order than one matmul's
        torch.testing.assert_close(grad, grads_ref[parameter_name], rtol=1e-4, atol=1e-7, msg=parameter_name)


@pytest.mark.numerics
def test_one_adapted_linear_against_float64_autograd():
    """The Function alone: every gradient (input, base output, A, B) against float64 autograd."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 16, generator=generator)
    base = torch.randn(3, 5, 12, generator=generator)
    weight_a = torch.randn(4, 16, generator=generator)
    weight_b = torch.randn(12, 4, generator=generator)
    grad_out = torch.randn(3, 5, 12, generator=generator)
    leaves = [t.clone().requires_grad_(True) for t in (x, base, weight_a, weight_b)]
    adapted_linear(*leaves, scaling=0.5).backward(grad_out)
    exact = [t.double().requires_grad_(True) for t in (x, base, weight_a, weight_b)]
    (exact[1] + (exact[0] @ exact[2].t()) @ exact[3].t() * 0.5).backward(grad_out.double())
    for ours, reference, what in zip(leaves, exact, ("x", "base", "A", "B"), strict=True):
        torch.testing.assert_close(ours.grad.double(), reference.grad, rtol=1e-5, atol=1e-5, msg=what)


@pytest.mark.numerics
def test_a_twice_wrong_gradient_is_caught_by_sgd():
    """SGD without clipping, two steps: the adapters of the two models agree, so a scaled gradient would not."""
    plain = _with_adapters(tiny_llama().to(torch.bfloat16))
    efficient = copy.deepcopy(plain)
    apply_efficient_lora(efficient)
    assert_same_after_sgd(plain, efficient, _tokens(), atol=1e-7)


@pytest.mark.numerics
def test_gpt2_conv1d_base_gives_the_same_gradients():
    """GPT-2's Conv1D base (PEFT's fan_in_fan_out): the adapters are plain linears all the same."""
    torch.manual_seed(0)
    base = GPT2LMHeadModel(GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    with pytest.warns(UserWarning, match="fan_in_fan_out"):
        plain = _with_adapters(base)
    efficient = copy.deepcopy(plain)
    assert apply_efficient_lora(efficient).startswith("8 of 8")
    input_ids = _tokens()
    loss_ref, grads_ref = _loss_and_grads(plain, input_ids)
    loss, grads = _loss_and_grads(efficient, input_ids)
    assert torch.equal(loss, loss_ref)
    for parameter_name, grad in grads.items():
        torch.testing.assert_close(grad, grads_ref[parameter_name], rtol=1e-5, atol=1e-8, msg=parameter_name)


def test_adapters_with_dropout_keep_peft_forward():
    model = _with_adapters(tiny_llama().to(torch.bfloat16), lora_dropout=0.1)
    assert apply_efficient_lora(model) == "0 of 14 adapted linears (14 keep PEFT's: dropout, DoRA, bias or another layer kind)"
    assert not any("forward" in m.__dict__ for m in model.modules() if hasattr(m, "lora_A"))


@pytest.mark.numerics
def test_autocast_over_fp32_weights_runs_peft_path_and_says_so(caplog, monkeypatch):
    """autocast's bf16 copy of an fp32 input (the norms' outputs) is smaller than the input: PEFT's
    path there, logged once; the adapters whose inputs autocast made bf16 (o, down) take memfit's."""
    monkeypatch.setattr(efficient_lora, "_reported", set())
    plain = _with_adapters(tiny_llama())
    efficient = copy.deepcopy(plain)
    apply_efficient_lora(efficient)
    input_ids = _tokens()
    with caplog.at_level(logging.INFO, logger="memfit"):
        loss, grads = _loss_and_grads(efficient, input_ids, autocast=True)
    loss_ref, grads_ref = _loss_and_grads(plain, input_ids, autocast=True)
    assert torch.equal(loss, loss_ref)
    assert all(torch.equal(grads[n], grads_ref[n]) for n in grads_ref)
    notes = [r.getMessage() for r in caplog.records if "efficient LoRA" in r.getMessage()]
    assert notes == ["memfit: efficient LoRA: autocast casts its float32 input; PEFT's adapter path runs there"]


def test_disabled_adapters_give_the_base_output():
    model = _with_adapters(tiny_llama().to(torch.bfloat16))
    apply_efficient_lora(model)
    input_ids = _tokens()
    with torch.no_grad():
        with model.disable_adapter():
            base_logits = model(input_ids=input_ids).logits
        adapted_logits = model(input_ids=input_ids).logits
        reference = tiny_llama().to(torch.bfloat16)(input_ids=input_ids).logits
    assert torch.equal(base_logits, reference) and not torch.equal(adapted_logits, reference)


@pytest.mark.numerics
def test_a_compiled_block_matches_and_breaks_no_more_graphs():
    """Dynamo traces the adapter path inside a decoder block (regional compilation's unit)."""
    model = _with_adapters(tiny_llama(layers=1).to(torch.bfloat16))
    block = model.base_model.model.model.layers[0]
    hidden = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    position_ids = torch.arange(16)[None]
    embeddings = model.base_model.model.model.rotary_emb(hidden, position_ids)

    def run(x):
        out = block(x, position_embeddings=embeddings, attention_mask=None, position_ids=position_ids)
        return out[0] if isinstance(out, tuple) else out

    plain_breaks = torch._dynamo.explain(run)(hidden).graph_break_count
    expected = run(hidden)
    apply_efficient_lora(model)
    torch._dynamo.reset()
    assert torch._dynamo.explain(run)(hidden).graph_break_count <= plain_breaks
    torch._dynamo.reset()
    compiled = torch.compile(run, backend="aot_eager")
    torch.testing.assert_close(compiled(hidden), expected, rtol=0, atol=0)


@pytest.mark.parametrize("efficient", [True, False])
def test_the_run_applies_it_unless_switched_off(efficient):
    from memfit.train.setup import apply_model_techniques

    config = load_config(overrides={"efficient_lora": efficient, "lora_r": 8, "lora_targets": "all-linear"})
    model, _ = apply_model_techniques(config, tiny_llama(hidden=64, layers=2, vocab=VOCAB))
    patched = [m for m in model.modules() if hasattr(m, "lora_A") and "forward" in m.__dict__]
    assert len(patched) == (14 if efficient else 0)


@pytest.fixture(scope="module")
def long_context_llama(tmp_path_factory):
    """A Llama whose activations dominate at 2048 tokens, saved where the real loading code reads it.

    Two blocks: the tracker's per-operator cost is most of these runs' time and grows with the blocks, while the
    saving and the estimate's error do not depend on the depth (4 blocks: saving 33 % and 24 %, estimate -7.1 to
    +5.0 %; 2 blocks: 36 % and 25 %, -7.7 to +6.2 %)."""
    from memfit.models.tiny import save_llama

    root = tmp_path_factory.mktemp("efficient-lora-run")
    model = save_llama(root / "model", hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2)
    corpus = root / "corpus.txt"
    corpus.write_text("memory gradient batch token model layer training fits device loss step\n\n" * 4000)
    return model, corpus


# name -> settings on a bf16 base (benchmarks/bench_efficient_lora.py publishes the figures)
RUN_CASES = {
    "LoRA, full checkpointing": {"gradient_checkpointing": "full"},
    "QLoRA, offloaded checkpoints, tiled MLP, chunked loss": {
        "gradient_checkpointing": "full", "quantize": "4bit", "activation_offload": True, "tiled_mlp": 4,
        "loss_chunk_size": 256},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUN_CASES))
def test_tracker_measures_the_saving_and_the_estimate_follows(name, long_context_llama, tmp_path, monkeypatch):
    from memfit.prediction.estimator import ERROR_BAND

    # The slice as large next to this block's inputs as 16M elements are next to Llama-3.1-8B's at 80K tokens
    monkeypatch.setattr(efficient_lora, "SLICE_ELEMENTS", 8192)
    model, corpus = long_context_llama
    peaks, estimates = peaks_and_estimates({efficient: load_config(overrides={
        "model": str(model), "dataset": str(corpus), "batch_size": 1, "max_steps": 2, "log_every": 1000,
        "output_dir": str(tmp_path / f"run{efficient}"), "report": False, "seq_len": 2048, "dtype": "bf16",
        "lora_r": 8, "lora_targets": "all-linear", "efficient_lora": efficient, **RUN_CASES[name],
    }) for efficient in (False, True)})
    print(f"{name}: tracked {peaks}, estimated {estimates}")
    assert peaks[True] < 0.85 * peaks[False]  # a fifth to a third of the peak goes
    assert estimates[True] < estimates[False]
    for efficient in (False, True):
        assert abs(estimates[efficient] / peaks[efficient] - 1) <= ERROR_BAND["analytical"], (
            efficient, estimates, peaks)


@pytest.mark.parametrize("precision, fell_back", [("fp32", False), ("bf16", True)])
def test_a_run_names_adapters_that_ran_peft_path(llama_dir, text_file, tmp_path, precision, fell_back):
    """bf16 autocast over fp32 weights: the norms' fp32 outputs go through PEFT's path, and the summary says so."""
    from memfit.train.loop import train

    result = train(load_config(overrides={
        "model": str(llama_dir), "dataset": str(text_file), "seq_len": 32, "batch_size": 2, "max_steps": 1,
        "output_dir": str(tmp_path), "report": False, "lora_r": 8, "lora_targets": "all-linear",
        "precision": precision}))
    reason = result.summary["fallbacks"].get("efficient_lora", "")
    assert ("autocast casts its float32 input" in reason) == fell_back
