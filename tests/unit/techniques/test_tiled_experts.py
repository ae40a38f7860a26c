"""Tiled experts: the MoE layers' experts calls over token tiles give the untiled model's logits and gradients,
keep less, and the estimate follows the tracked peak.

Reference: the same model untiled (fp32, so tiling changes only the order of the parameter gradients' sums).
Compared: logits, every parameter gradient (the router's in a full fine-tune, the experts' adapters under
`--lora-targets experts`), and the gradients reaching each experts call's hidden states and routing weights.
"""

from __future__ import annotations

import copy

import pytest
import torch

from memfit.config import LoraConfig
from memfit.config_loading import load_config
from memfit.prediction.estimator import ERROR_BAND, estimate
from memfit.prediction.run_shape import resolve_run
from memfit.prediction.traced import StepSetup
from memfit.techniques.lora import apply_lora
from memfit.techniques.tiled_experts import (
    TILED_ATTRIBUTE,
    TiledExpertsFunction,
    apply_tiled_experts,
    moe_experts_calls,
    tiled_experts_facts,
)
from memfit.train.traced import measure_step_with_tracker
from model_zoo import build_model, randomize_adapters

pytest.importorskip("peft")

FAMILIES = ("qwen3_moe", "gpt_oss", "mixtral")
TILES = 3


def _tokens(length: int = 40) -> torch.Tensor:
    return torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(0))


def _model(family: str, mode: str):
    model = build_model(family)
    if mode == "lora":
        model, _ = apply_lora(model, LoraConfig(lora_r=2, lora_targets="experts"), gradient_checkpointing=False)
        randomize_adapters(model)
    return model.train()


def _step(model, tokens):
    """Logits, parameter gradients and the gradients reaching each experts call's hidden states and weights."""
    inputs: dict[str, torch.Tensor] = {}
    handles = []
    for name, called, _ in moe_experts_calls(model):
        def keep(module, args, name=name):
            for label, tensor in (("hidden", args[0]), ("weights", args[2])):
                if tensor.requires_grad:
                    tensor.register_hook(lambda grad, key=f"{name} {label}": inputs.__setitem__(key, grad.clone()))
        handles.append(called.register_forward_pre_hook(keep))
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)  # routers with jitter draw the same numbers in both runs
    output = model(input_ids=tokens, labels=tokens)
    output.loss.backward()
    for handle in handles:
        handle.remove()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return output.logits.detach(), grads, inputs


def _assert_close(actual: dict, expected: dict, rtol: float = 1e-6) -> None:
    assert actual.keys() == expected.keys() and expected
    for name, tensor in expected.items():
        # tiles sum a weight's gradient in another order: compare each tensor as a whole
        error = ((actual[name] - tensor).norm() / tensor.norm()).item()
        assert error < rtol, (name, error)


@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.parametrize("family", FAMILIES)
def test_tiled_experts_equal_the_untiled_model(family, mode):
    model = _model(family, mode)
    tokens = _tokens()
    logits, grads, inputs = _step(model, tokens)
    assert apply_tiled_experts(model, TILES).startswith(f"{TILES} tiles on the experts of 2 of 2 MoE layers")
    tiled_logits, tiled_grads, tiled_inputs = _step(model, tokens)

    torch.testing.assert_close(tiled_logits, logits, rtol=1e-6, atol=1e-6)
    _assert_close(tiled_grads, grads)
    _assert_close(tiled_inputs, inputs)
    assert any(name.endswith("weights") for name in inputs)  # the routing weights' gradient was compared
    if mode == "full":
        routers = [name for name in grads if ".gate." in name or ".router." in name]
        assert routers, "no router gradient compared"
    else:
        assert all("lora_" in name for name in grads) and any("experts" in name for name in grads)


def test_a_tile_without_its_routing_weight_gradient_fails_the_comparison(monkeypatch):
    """Fault twin: the router's gradient arrives only through the routing weights' gradient each tile fills."""
    model = _model("qwen3_moe", "full")
    tokens = _tokens()
    _, grads, _ = _step(model, tokens)
    apply_tiled_experts(model, TILES)
    backward = TiledExpertsFunction.backward

    def drops_first_tile(ctx, grad_output):
        grads = list(backward(ctx, grad_output))
        grads[4] = grads[4].clone()
        grads[4][: grads[4].shape[0] // TILES] = 0
        return tuple(grads)

    monkeypatch.setattr(TiledExpertsFunction, "backward", staticmethod(drops_first_tile))
    _, tiled_grads, _ = _step(model, tokens)
    with pytest.raises(AssertionError):
        _assert_close(tiled_grads, grads)
    # in the last MoE layer the fault reaches its router's gradient alone (the experts' own are computed before it)
    last = sorted({name.split(".mlp")[0] for name in grads if ".mlp." in name})[-1]
    for name in grads:
        if name.startswith(last + ".mlp."):
            changed = not torch.allclose(tiled_grads[name], grads[name], rtol=1e-5, atol=1e-9)
            assert changed == (".gate." in name), name


def test_each_tile_runs_the_split_lora_forward_and_off_restores_it(monkeypatch):
    import memfit.techniques.expert_lora as expert_lora

    model = _model("gpt_oss", "lora")
    calls = moe_experts_calls(model)
    split = [called.forward.__func__ for _, called, _ in calls]
    apply_tiled_experts(model, TILES)
    assert apply_tiled_experts(model, TILES).startswith(f"{TILES} tiles")  # again: tiles the split forward, once
    ran = []
    original = expert_lora._split_lora_forward
    monkeypatch.setattr(expert_lora, "_split_lora_forward",
                        lambda chain, hidden, *rest: ran.append(hidden.shape[0]) or original(chain, hidden, *rest))
    tokens = _tokens(30)
    model(input_ids=tokens, labels=tokens).loss.backward()
    # each layer: 3 tiles of 20 tokens in forward and again in backward
    assert ran == [20] * (2 * TILES * 2)
    facts = tiled_experts_facts(model)
    assert facts["tiles"] == TILES and len(facts["layers"]) == 2 and "{0-1}" in facts["described"]

    assert apply_tiled_experts(model, 0) == "off"
    assert [called.forward.__func__ for _, called, _ in calls] == split
    assert not any(TILED_ATTRIBUTE in inner.__dict__ for _, _, inner in calls)
    assert tiled_experts_facts(model) is None


def test_tiled_mlp_flag_tiles_the_experts_of_a_model_without_dense_mlps(caplog):
    """gpt-oss has no dense MLP: --tiled-mlp was refused there; now its experts are what it tiles."""
    from memfit.train.setup import apply_model_techniques

    config = load_config(overrides={"tiled_mlp": 4, "seq_len": 64, "gradient_checkpointing": "off"})
    with caplog.at_level("INFO", logger="memfit"):
        model, _ = apply_model_techniques(config, build_model("gpt_oss"))
    assert "tiled MLP: 4 tiles on the experts of 2 of 2 MoE layers (model.layers.{0-1}.mlp)" in caplog.text
    assert tiled_experts_facts(model)["tiles"] == 4


def test_experts_split_across_ranks_stay_untiled_and_are_named():
    from memfit.techniques.tiled_experts import with_tiled_experts

    model = build_model("gpt_oss")
    for _, _, inner in moe_experts_calls(model):
        inner._is_expert_parallel = True
    text = with_tiled_experts(model, 4, "off (no MLP found in the blocks)")
    assert text.startswith("off") and "left untiled: 2 (split across ranks)" in text  # so --tiled-mlp is refused
    assert tiled_experts_facts(model) is None


def test_each_parameter_gets_one_complete_gradient_from_the_tiles():
    """Hooks that act on a complete gradient (optimizer in backward, FSDP's reduce-scatter) fire once, on the sum."""
    model = _model("mixtral", "full")
    tokens = _tokens()
    _, grads, _ = _step(model, tokens)
    apply_tiled_experts(model, TILES)
    calls: dict[str, int] = {}
    names = {p: name for name, p in model.named_parameters()}
    seen: dict[str, torch.Tensor] = {}

    def count(parameter):
        calls[names[parameter]] = calls.get(names[parameter], 0) + 1
        seen[names[parameter]] = parameter.grad.clone()

    for parameter in model.parameters():
        parameter.register_post_accumulate_grad_hook(count)
    _step(model, tokens)
    experts = [name for name in calls if ".experts." in name]
    assert experts and all(calls[name] == 1 for name in calls)
    _assert_close({name: seen[name] for name in experts}, {name: grads[name] for name in experts})


# ---------------------------------------------------------------------------
# Memory: tracked peaks and the estimate
# ---------------------------------------------------------------------------


def _wide_experts(family: str):
    """Routed activations dominate: 8 experts of width 256 on a 64-wide stream, top-2."""
    from transformers import AutoConfig

    common = dict(vocab_size=257, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=4096, num_experts_per_tok=2)
    if family == "qwen3_moe":
        return AutoConfig.for_model(family, **common, intermediate_size=256, moe_intermediate_size=256, num_experts=8)
    return AutoConfig.for_model(family, **common, intermediate_size=256, num_local_experts=8)


VARIANTS = {"lora bf16": {"lora_r": 8, "dtype": "bf16", "lora_targets": "experts"}, "fp32": {}}


def _config(variant: str, tiles: int):
    return load_config(overrides={"seq_len": 512, "batch_size": 1, "gradient_checkpointing": "full",
                                  "tiled_mlp": tiles, **VARIANTS[variant]})


@pytest.fixture(scope="module")
def tracked_peaks() -> dict[tuple[str, str, int], int]:
    """(family, variant, tiles) -> the tracked peak of a real CPU step (two steps through memfit's setup)."""
    peaks = {}
    for family, variants in (("qwen3_moe", VARIANTS), ("mixtral", ["lora bf16"])):
        hf_config = _wide_experts(family)
        for variant in variants:
            for tiles in (0, 8):
                config = _config(variant, tiles)
                run = resolve_run(config, hf_config, None)
                setup = StepSetup(config.training.batch_size, config.data.seq_len,
                                  {4: torch.float32, 2: torch.bfloat16}[run.weight_bytes], None, run.attention,
                                  run.checkpointing, run.checkpoint_every, run.loss_chunk_size, torch.device("cpu"))
                peaks[family, variant, tiles] = measure_step_with_tracker(copy.deepcopy(hf_config), config, setup)
    return peaks


def test_tiling_lowers_the_tracked_peak_by_most_of_the_routed_activations(tracked_peaks):
    """LoRA on a bf16 base, full checkpointing: the recomputed block's routed rows are the peak."""
    from memfit.prediction.layer_probe import probed_layer_bytes_per_token

    hf_config = _wide_experts("qwen3_moe")
    untiled = probed_layer_bytes_per_token(hf_config, 2, False, "sdpa", 512, 8, False, True)
    tiled = probed_layer_bytes_per_token(hf_config, 2, False, "sdpa", 512, 8, False, True, tiled_experts=True)
    routed = (untiled - tiled) * 512  # one layer's experts call, what tiling takes out of the recompute
    saved = tracked_peaks["qwen3_moe", "lora bf16", 0] - tracked_peaks["qwen3_moe", "lora bf16", 8]
    print(f"tracked peak {tracked_peaks['qwen3_moe', 'lora bf16', 0]} B untiled, saved {saved} B of {routed:.0f} B")
    assert saved > 0.6 * routed > 0


@pytest.mark.parametrize(("family", "variant"), [("qwen3_moe", "lora bf16"), ("qwen3_moe", "fp32"),
                                                 ("mixtral", "lora bf16")])
def test_estimate_of_tiled_experts_within_the_band(tracked_peaks, family, variant):
    truth = tracked_peaks[family, variant, 8]
    predicted = estimate(_config(variant, 8), hf_config=_wide_experts(family), method="analytical").peak_bytes
    assert predicted / truth - 1 == pytest.approx(0, abs=ERROR_BAND["analytical"]), (predicted, truth)
    untiled = estimate(_config(variant, 0), hf_config=_wide_experts(family), method="analytical").peak_bytes
    print(f"{family} {variant}: tracked peak {tracked_peaks[family, variant, 0] / 2**20:.2f} MiB untiled, "
          f"{truth / 2**20:.2f} MiB tiled; estimate tiled {predicted / 2**20:.2f} MiB ({predicted / truth - 1:+.1%})")
    assert predicted < untiled


def test_tiles_run_the_nf4_experts_of_qlora_and_equal_them_untiled():
    """QLoRA's NF4 experts (techniques/expert_quant.py) dequantize per grouped matmul: each tile runs that forward."""
    pytest.importorskip("bitsandbytes")
    from memfit.techniques.expert_lora import quantize_fused_experts

    model = _model("qwen3_moe", "lora")
    assert quantize_fused_experts(model).startswith("experts nf4 in 2 of 2")
    tokens = _tokens()
    logits, grads, inputs = _step(model, tokens)
    apply_tiled_experts(model, TILES)
    tiled_logits, tiled_grads, tiled_inputs = _step(model, tokens)
    torch.testing.assert_close(tiled_logits, logits, rtol=1e-6, atol=1e-6)
    _assert_close(tiled_grads, grads)
    _assert_close(tiled_inputs, inputs)
