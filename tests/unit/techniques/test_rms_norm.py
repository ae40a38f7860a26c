"""The memory-efficient RMSNorm: the same forward bit for bit, the same gradients, less kept for backward."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from memfit.memory.tracker import MemoryTracker
from memfit.techniques.checkpointing import apply_gradient_checkpointing
from memfit.techniques.rms_norm import apply_efficient_rms_norm, efficient_rms_norm
from sgd_twin import assert_same_after_sgd
from tiny_llama import tiny_llama
from tracked_against_estimate import peaks_and_estimates

VOCAB = 256


def _autocast(on: bool):
    return torch.autocast("cpu", dtype=torch.bfloat16) if on else contextlib.nullcontext()


def _norm_input_and_grads(dtype: torch.dtype, trainable: bool = True, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    x = (torch.randn(4, 7, 48, generator=generator) * 3).to(dtype)
    weight = (1 + torch.randn(48, generator=generator) * 0.5).to(dtype)
    grad_out = torch.randn(4, 7, 48, generator=generator).to(dtype)
    norm = LlamaRMSNorm(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.copy_(weight)
    norm.weight.requires_grad_(trainable)
    return norm, x, grad_out


def _run(norm: nn.Module, x: torch.Tensor, grad_out: torch.Tensor):
    x = x.clone().requires_grad_(True)
    norm.weight.grad = None
    out = norm(x)
    out.backward(grad_out)
    return out.detach(), x.grad, None if norm.weight.grad is None else norm.weight.grad.clone()


def _fp64_reference(x: torch.Tensor, weight: torch.Tensor, grad_out: torch.Tensor, eps: float):
    """The exact gradients of weight * x / rms(x), by autograd in float64."""
    x64 = x.double().requires_grad_(True)
    w64 = weight.detach().double().requires_grad_(True)
    out = w64 * (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps))
    out.backward(grad_out.double())
    return x64.grad, w64.grad


@pytest.mark.numerics
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("trainable", [True, False])
def test_one_norm_forward_is_bit_identical_and_gradients_agree(dtype, trainable):
    norm, x, grad_out = _norm_input_and_grads(dtype, trainable)
    out_ref, gx_ref, gw_ref = _run(norm, x, grad_out)
    assert apply_efficient_rms_norm(norm) == "1 of 1 norms"
    out, gx, gw = _run(norm, x, grad_out)

    assert torch.equal(out, out_ref)
    if dtype == torch.float32:
        torch.testing.assert_close(gx, gx_ref, rtol=1e-6, atol=1e-7)
        if trainable:
            torch.testing.assert_close(gw, gw_ref, rtol=1e-6, atol=1e-6)
        # and both are the exact gradient (float64)
        gx64, gw64 = _fp64_reference(x, norm.weight, grad_out, 1e-5)
        torch.testing.assert_close(gx.double(), gx64, rtol=1e-5, atol=1e-6)
        if trainable:
            torch.testing.assert_close(gw.double(), gw64, rtol=1e-5, atol=1e-5)
    else:
        # bf16: within a few roundings of the plain norm's gradients
        torch.testing.assert_close(gx.float(), gx_ref.float(), rtol=2e-2, atol=2e-2)
        if trainable:
            # the plain norm rounds each product to bf16 before summing; this one sums in fp32
            torch.testing.assert_close(gw.float(), gw_ref.float(), rtol=2e-2, atol=5e-2)
    assert (gw is None) == (not trainable)


@pytest.mark.numerics
def test_mixed_dtypes_and_autocast_match_the_plain_norm():
    """A bf16 input through an fp32 weight (fp32 output), and under bf16 autocast."""
    norm, x, grad_out = _norm_input_and_grads(torch.float32)
    x16 = x.to(torch.bfloat16)
    out_ref, gx_ref, gw_ref = _run(norm, x16, grad_out)
    with _autocast(True):
        auto_ref = norm(x)
    apply_efficient_rms_norm(norm)
    out, gx, gw = _run(norm, x16, grad_out)
    with _autocast(True):
        auto = norm(x)
    assert out.dtype == torch.float32 and torch.equal(out, out_ref) and torch.equal(auto, auto_ref)
    assert gx.dtype == torch.bfloat16
    torch.testing.assert_close(gx.float(), gx_ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(gw, gw_ref, rtol=1e-5, atol=1e-5)


def _loss_and_grads(model: nn.Module, input_ids: torch.Tensor, autocast: bool = False):
    model.zero_grad(set_to_none=True)
    with _autocast(autocast):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    grads = {name: p.grad.float().clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def _tokens(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def _lora(model: nn.Module) -> nn.Module:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"])
    model = peft.get_peft_model(model, config)
    # nonzero B so the adapters' gradients depend on the norms' input gradients
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.1, generator=torch.Generator().manual_seed(2))
    return model


# name -> (weight dtype, autocast, checkpointing, LoRA)
MODEL_CASES = {
    "fp32": (torch.float32, False, "off", False),
    "fp32, full checkpointing": (torch.float32, False, "full", False),
    "fp32, LoRA, full checkpointing": (torch.float32, False, "full", True),
    "bf16 autocast": (torch.float32, True, "off", False),
    "bf16 weights": (torch.bfloat16, False, "off", False),
    "bf16 weights, LoRA, full checkpointing": (torch.bfloat16, False, "full", True),
}


def _norms_inputs_and_output_grads(model: nn.Module, input_ids: torch.Tensor, autocast: bool):
    """Each norm's input and the gradient that reached its output, in one forward and backward of `model`."""
    seen: dict[str, list] = {}
    handles = []

    def keep(name):
        def hook(module, args, output):
            record = seen.setdefault(name, [args[0].detach().clone(), None])
            output.register_hook(lambda grad: record.__setitem__(1, grad.detach().clone()))
        return hook

    for name, module in model.named_modules():
        if isinstance(module, LlamaRMSNorm):
            handles.append(module.register_forward_hook(keep(name)))
    try:
        _loss_and_grads(model, input_ids, autocast)
    finally:
        for handle in handles:
            handle.remove()
    return seen


def _assert_each_norm_gradient_matches(plain: nn.Module, input_ids: torch.Tensor, autocast: bool) -> None:
    """Every norm of `plain`, fed the input and output gradient it saw in the model, gives the same
    input and weight gradients in fp32 with and without the efficient forward.

    Nothing rounds these gradients after the norm computes them, so they agree to fp32 whatever
    matmul kernels the CPU has; a wrong term in the norm's backward shows here.
    """
    norms = dict(plain.named_modules())
    for name, (x, grad_out) in _norms_inputs_and_output_grads(plain, input_ids, autocast).items():
        results = []
        for efficient in (False, True):
            norm = copy.deepcopy(norms[name])
            if efficient:
                assert apply_efficient_rms_norm(norm) == "1 of 1 norms"
            with _autocast(autocast):
                results.append(_run(norm, x, grad_out))
        (out_ref, gx_ref, gw_ref), (out, gx, gw) = results
        assert torch.equal(out, out_ref), name
        torch.testing.assert_close(gx, gx_ref, rtol=1e-6, atol=1e-7, msg=f"{name} input gradient")
        if gw_ref is not None:
            torch.testing.assert_close(gw, gw_ref, rtol=1e-6, atol=1e-6, msg=f"{name} weight gradient")


def _assert_model_gradients_match(name: str, input_ids: torch.Tensor) -> None:
    dtype, autocast, checkpointing, lora = MODEL_CASES[name]
    plain = tiny_llama(hidden=64, layers=2, vocab=VOCAB).to(dtype)
    if checkpointing != "off":
        apply_gradient_checkpointing(plain, checkpointing)
    if lora:
        plain = _lora(plain)
    plain.train()
    efficient = copy.deepcopy(plain)
    assert apply_efficient_rms_norm(efficient) == "5 of 5 norms"  # 2 per block and the final one
    loss_ref, grads_ref = _loss_and_grads(plain, input_ids, autocast)
    loss, grads = _loss_and_grads(efficient, input_ids, autocast)

    assert torch.equal(loss, loss_ref)  # the forward is bit-identical
    assert grads.keys() == grads_ref.keys() and grads
    if lora:
        assert not any("norm" in n for n in grads)  # frozen norms get no gradient
    for parameter_name, grad in grads.items():
        reference = grads_ref[parameter_name]
        error = (grad - reference).norm() / reference.norm().clamp_min(1e-12)
        if dtype == torch.float32 and not autocast:
            # fp32: only the order of sums differs
            torch.testing.assert_close(grad, reference, rtol=1e-6, atol=1e-7, msg=parameter_name)
        elif autocast and parameter_name == "model.norm.weight":
            # the final norm's gradient passes through no matmul after the norm computes it
            torch.testing.assert_close(grad, reference, rtol=1e-6, atol=1e-7, msg=parameter_name)
        elif autocast:
            # Upstream of a norm, the norm's fp32 gradient (right to ~1e-6) is rounded to bf16 by the next
            # matmul's backward; whether a rounding flips depends on the CPU's bf16 kernels (oneDNN picks
            # others with AVX-512 bf16), so these agree to bf16 rounding (2**-8), not to fp32. The norms'
            # own gradients are held to fp32 below, where nothing rounds them.
            assert error < 2**-7, (parameter_name, float(error))
        else:
            # bf16 weights: relative error of the whole tensor within a few bf16 roundings
            assert error < 2e-2, (parameter_name, float(error))
    if autocast and not lora:
        _assert_each_norm_gradient_matches(plain, input_ids, autocast)


@pytest.mark.numerics
@pytest.mark.parametrize("name", list(MODEL_CASES))
def test_whole_model_loss_and_gradients_match_the_plain_norm(name):
    _assert_model_gradients_match(name, _tokens(2, 32))


@pytest.mark.parametrize("wrong", ["input gradient", "weight gradient"])
def test_a_twice_wrong_norm_gradient_fails_the_autocast_check(wrong, monkeypatch):
    """The fault twin of the bf16 autocast case: one term of the norm's backward 2x too large."""
    from memfit.techniques import rms_norm

    original = rms_norm._RMSNormFunction.backward

    def twice_wrong(ctx, grad_out):
        grad_x, grad_w, grad_eps = original(ctx, grad_out)
        if wrong == "input gradient":
            return grad_x * 2, grad_w, grad_eps
        return grad_x, grad_w * 2, grad_eps

    monkeypatch.setattr(rms_norm._RMSNormFunction, "backward", staticmethod(twice_wrong))
    with pytest.raises(AssertionError):
        _assert_model_gradients_match("bf16 autocast", _tokens(2, 32))


def test_a_twice_wrong_gradient_is_caught_by_sgd():
    """SGD without clipping: the updated weights of the two models agree, so a scaled gradient would not."""
    plain = tiny_llama(hidden=64, layers=2, vocab=VOCAB)
    efficient = copy.deepcopy(plain)
    apply_efficient_rms_norm(efficient)
    assert_same_after_sgd(plain, efficient, _tokens(2, 32))


def test_gemma_style_and_layer_norms_are_left_alone():
    class GemmaStyleNorm(nn.Module):
        def __init__(self, width: int):
            super().__init__()
            self.eps = 1e-6
            self.weight = nn.Parameter(torch.zeros(width))

        def forward(self, x):
            out = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
            return (out * (1.0 + self.weight.float())).type_as(x)

    model = nn.Sequential(GemmaStyleNorm(16), nn.LayerNorm(16), LlamaRMSNorm(16))
    done = apply_efficient_rms_norm(model)
    assert done.startswith("1 of 3 norms") and "computes another norm: 1 GemmaStyleNorm, 1 LayerNorm" in done, done
    assert "forward" not in model[0].__dict__ and "forward" not in model[1].__dict__
    assert "forward" in model[2].__dict__
    # a second application finds nothing left to do
    assert apply_efficient_rms_norm(model).startswith("0 of 2 norms")


def test_gemma3_norms_are_named_as_kept_and_its_gradients_are_the_plain_ones():
    """Gemma 3 scales by (1 + weight) in fp32 in all 13 of its norms: each keeps its own forward, the log
    says so, and the model's update under SGD equals the plain one's."""
    from model_zoo import build_model

    plain = build_model("gemma3_text")
    efficient = copy.deepcopy(plain)
    done = apply_efficient_rms_norm(efficient)
    assert done == "0 of 13 norms; kept their own forward, which computes another norm: 13 Gemma3RMSNorm", done
    assert_same_after_sgd(plain, efficient, _tokens(2, 16))


def test_gated_norms_keep_their_forward_and_a_mamba2_model_trains():
    """Mamba-2's gated norm takes a second input (the gate): it must keep its own forward, say so, and the
    model must train with the technique on (its default)."""
    from transformers import Mamba2Config, Mamba2ForCausalLM

    config = Mamba2Config(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_heads=4, head_dim=16,
                          state_size=8, n_groups=1, expand=2, chunk_size=16)
    torch.manual_seed(0)
    plain = Mamba2ForCausalLM(config)
    efficient = copy.deepcopy(plain)
    done = apply_efficient_rms_norm(efficient)
    assert done.startswith("3 of 5 norms") and "2 MambaRMSNormGated (gate)" in done, done
    gated = [m for m in efficient.modules() if type(m).__name__ == "MambaRMSNormGated"]
    assert gated and all("forward" not in m.__dict__ for m in gated)
    assert_same_after_sgd(plain, efficient, _tokens(2, 16))


def test_bf16_step_keeps_less_by_the_tracker():
    """bf16 weights, full fine-tuning, no checkpointing: each norm keeps its bf16 input and 1/rms
    instead of the fp32 upcast and the bf16 normalised tensor (6 bytes per element less 2)."""
    seq, hidden, layers = 512, 64, 2
    input_ids = _tokens(1, seq)
    saved_at_peak = {}
    for efficient in (False, True):
        model = tiny_llama(hidden=hidden, layers=layers, vocab=VOCAB).to(torch.bfloat16)
        model.train()
        if efficient:
            apply_efficient_rms_norm(model)
        tracker = MemoryTracker("cpu")
        tracker.attach(model)
        with tracker:
            loss = model(input_ids=input_ids, labels=input_ids).loss
            saved_at_peak[efficient] = tracker.current_bytes
            loss.backward()
        tracker.detach()
    saved = saved_at_peak[False] - saved_at_peak[True]
    # 2 norms per block and the final norm, 4 bytes per element each
    expected = (2 * layers + 1) * 4 * hidden * seq
    print(f"kept after forward: plain {saved_at_peak[False]} B, efficient {saved_at_peak[True]} B, saved {saved} B")
    assert abs(saved - expected) <= 0.02 * expected, (saved, expected)


@pytest.mark.numerics
def test_compiles_without_graph_breaks():
    norm, x, grad_out = _norm_input_and_grads(torch.bfloat16)
    _, gx_ref, gw_ref = _run(norm, x, grad_out)
    explanation = torch._dynamo.explain(lambda t: efficient_rms_norm(t, norm.weight, 1e-5))(x)
    assert explanation.graph_break_count == 0
    apply_efficient_rms_norm(norm)
    compiled = torch.compile(norm, backend="aot_eager", fullgraph=True)
    x = x.clone().requires_grad_(True)
    norm.weight.grad = None
    compiled(x).backward(grad_out)
    torch.testing.assert_close(x.grad.float(), gx_ref.float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(norm.weight.grad.float(), gw_ref.float(), rtol=2e-2, atol=5e-2)


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    """A Llama with activations that dominate at 512 tokens, saved with a byte tokenizer, and a corpus."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from memfit.models.tiny import byte_tokenizer

    root = tmp_path_factory.mktemp("efficient_norm")
    config = LlamaConfig(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096, vocab_size=257,
                         eos_token_id=256, pad_token_id=256, bos_token_id=256, hidden_size=128,
                         intermediate_size=352, num_hidden_layers=4)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(root / "model")
    byte_tokenizer().save_pretrained(root / "model")
    corpus = root / "corpus.txt"
    corpus.write_text("memory gradient batch token model layer training fits device loss step\n\n" * 2000)
    return root / "model", corpus


# name -> settings; each with bf16 weights, so the norms see a 16-bit residual stream
ESTIMATE_CASES = {
    "bf16 weights, full fine-tuning": {"gradient_checkpointing": "off"},
    "bf16 weights, LoRA, full checkpointing": {"gradient_checkpointing": "full", "lora_r": 8},
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(ESTIMATE_CASES))
def test_estimate_follows_the_tracker_with_and_without_the_efficient_norm(name, saved_llama, tmp_path):
    from memfit.config_loading import load_config
    from memfit.prediction.estimator import ERROR_BAND

    model, corpus = saved_llama
    peaks, estimates = peaks_and_estimates({efficient: load_config(overrides={
        "model": str(model), "dataset": str(corpus), "batch_size": 2, "max_steps": 2, "log_every": 1000,
        "output_dir": str(tmp_path / f"run{efficient}"), "report": False, "seq_len": 512, "dtype": "bf16",
        "efficient_norm": efficient, **ESTIMATE_CASES[name],
    }) for efficient in (False, True)})
    print(f"{name}: tracked {peaks}, estimated {estimates}")
    assert peaks[True] < peaks[False] and estimates[True] < estimates[False]
    for efficient in (False, True):
        assert abs(estimates[efficient] / peaks[efficient] - 1) <= ERROR_BAND["analytical"], (efficient, estimates, peaks)


@pytest.mark.numerics
def test_a_compiled_block_has_no_more_graph_breaks_and_the_same_output():
    """Dynamo traces the replaced norms inside a whole decoder block (regional compilation's unit)."""
    model = tiny_llama(hidden=64, layers=1, vocab=VOCAB)
    hidden = torch.randn(1, 16, 64, generator=torch.Generator().manual_seed(3))
    position_ids = torch.arange(16)[None]
    embeddings = model.model.rotary_emb(hidden, position_ids)
    block = model.model.layers[0]

    def run(x):
        return block(x, position_embeddings=embeddings, attention_mask=None, position_ids=position_ids)

    plain_breaks = torch._dynamo.explain(run)(hidden).graph_break_count
    expected = run(hidden)
    apply_efficient_rms_norm(model)
    torch._dynamo.reset()
    assert torch._dynamo.explain(run)(hidden).graph_break_count == plain_breaks
    compiled = torch.compile(run, backend="aot_eager")
    out = compiled(hidden)
    out = out[0] if isinstance(out, tuple) else out
    expected = expected[0] if isinstance(expected, tuple) else expected
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("efficient", [True, False])
def test_the_run_applies_it_unless_switched_off(efficient):
    from memfit.config_loading import load_config
    from memfit.train.setup import apply_model_techniques

    config = load_config(overrides={"efficient_norm": efficient, "gradient_checkpointing": "full"})
    model, _ = apply_model_techniques(config, tiny_llama(hidden=64, layers=2, vocab=VOCAB))
    patched = [m for m in model.modules() if isinstance(m, LlamaRMSNorm) and "forward" in m.__dict__]
    assert len(patched) == (5 if efficient else 0)
