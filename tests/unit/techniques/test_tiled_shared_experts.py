"""Tiled shared experts: under --tiled-mlp the shared experts of DeepSeek-V3, GLM-4-MoE and Qwen2-MoE (with its
sigmoid gate) run over the same token tiles as the routed experts, give the untiled model's loss and gradients,
keep less, and the estimate follows the tracked peak.

Reference: the same model untiled (fp32, so tiling changes only the order of the parameter gradients' sums).
"""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

import memfit.techniques.tiled_experts as tiled_experts
import memfit.techniques.tiled_mlp as tiled_mlp
from memfit.config import LoraConfig
from memfit.config_loading import load_config
from memfit.prediction.estimator import ERROR_BAND, estimate
from memfit.prediction.run_shape import resolve_run
from memfit.prediction.traced import StepSetup
from memfit.techniques.lora import apply_lora
from memfit.techniques.tiled_experts import apply_tiled_experts, tiled_experts_facts, tiled_shared_experts
from memfit.train.traced import measure_step_with_tracker
from model_zoo import build_model, randomize_adapters

pytest.importorskip("peft")

TILES = 3
SHARED = {"deepseek_v3": "shared_experts", "glm4_moe": "shared_experts", "qwen2_moe": "shared_expert"}
# auto: attention and MLP linears, the shared experts' among them; Qwen2-MoE: the MLP linears and the shared gate
LORA_TARGETS = {"deepseek_v3": "auto", "glm4_moe": "auto", "qwen2_moe": "gate_proj,up_proj,down_proj,shared_expert_gate"}


def _tokens(length: int = 40) -> torch.Tensor:
    return torch.randint(0, 256, (2, length), generator=torch.Generator().manual_seed(0))


def _model(family: str, mode: str):
    model = build_model(family)
    if mode == "lora":
        model, _ = apply_lora(model, LoraConfig(lora_r=2, lora_targets=LORA_TARGETS[family]),
                              gradient_checkpointing=False)
        randomize_adapters(model)
    return model.train()


def _step(model, tokens):
    """The loss and every parameter gradient of one step."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    loss = model(input_ids=tokens, labels=tokens).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def _assert_close(actual: dict, expected: dict, rtol: float = 1e-6) -> None:
    assert actual.keys() == expected.keys() and expected
    for name, tensor in expected.items():
        # tiles sum a weight's gradient in another order: compare each tensor as a whole
        error = ((actual[name] - tensor).norm() / tensor.norm()).item()
        assert error < rtol, (name, error)


def _shared_modules(model, family: str) -> list:
    return [module for name, module in model.named_modules() if name.endswith("mlp." + SHARED[family])]


@pytest.mark.parametrize("mode", ["full", "lora"])
@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe", "qwen2_moe"])
def test_tiled_shared_experts_equal_the_untiled_model(family, mode):
    model = _model(family, mode)
    tokens = _tokens()
    loss, grads = _step(model, tokens)
    shared = _shared_modules(model, family)
    described = apply_tiled_experts(model, TILES)
    gates = " (2 with their sigmoid gate)" if family == "qwen2_moe" else ""
    assert described.endswith(f"and on the shared experts of {len(shared)} of them{gates}"), described

    rows = []  # the rows each shared expert's up projection sees: tiles of the sequence, never all of it
    handles = [module.up_proj.register_forward_pre_hook(lambda _, args: rows.append(args[0].shape[-2]))
               for module in shared]
    tiled_loss, tiled_grads = _step(model, tokens)
    for handle in handles:
        handle.remove()
    full = tokens.shape[1] if family != "qwen2_moe" else tokens.numel()  # DeepSeek's run [batch, seq, hidden]
    assert len(rows) == 2 * TILES * len(shared) and max(rows) == -(-full // TILES)  # forward and the recompute

    torch.testing.assert_close(tiled_loss, loss, rtol=1e-6, atol=1e-6)
    _assert_close(tiled_grads, grads)
    compared = [name for name in grads if "." + SHARED[family] + "." in name]
    assert compared and (mode == "full" or all("lora_" in name for name in compared))
    if family == "qwen2_moe":  # the gate's weight (or its adapter) gets its gradient from inside the tiles
        assert any("shared_expert_gate" in name for name in grads)


def test_a_tile_counted_twice_fails_the_comparison_and_changes_only_the_shared_experts(monkeypatch):
    """Fault twin: the first tile's parameter gradients added twice into the shared experts' sums."""
    model = _model("deepseek_v3", "full")
    tokens = _tokens()
    _, grads = _step(model, tokens)
    apply_tiled_experts(model, TILES)
    add = tiled_mlp.add_tile_gradients

    def counts_first_tile_twice(sums, tile_grads):
        if all(total is None for total in sums):
            tile_grads = [None if grad is None else 2 * grad for grad in tile_grads]
        add(sums, tile_grads)

    monkeypatch.setattr(tiled_mlp, "add_tile_gradients", counts_first_tile_twice)
    _, tiled_grads = _step(model, tokens)
    with pytest.raises(AssertionError):
        _assert_close(tiled_grads, grads)
    for name in grads:  # the routed experts' tiles add theirs through their own function, untouched
        changed = not torch.allclose(tiled_grads[name], grads[name], rtol=1e-5, atol=1e-9)
        assert changed == (".shared_experts." in name), name


def test_a_gate_left_half_open_fails_the_comparison(monkeypatch):
    """Fault twin of the gated shared expert: the block's own sigmoid must read exactly 1."""
    model = _model("qwen2_moe", "full")
    tokens = _tokens()
    loss, grads = _step(model, tokens)
    monkeypatch.setattr(tiled_experts, "_open_gate", lambda hidden: hidden.new_zeros((*hidden.shape[:-1], 1)))
    apply_tiled_experts(model, TILES)
    tiled_loss, tiled_grads = _step(model, tokens)
    assert tiled_loss != loss
    with pytest.raises(AssertionError):
        _assert_close(tiled_grads, grads)


def test_off_restores_the_shared_experts_and_their_gates():
    model = _model("qwen2_moe", "lora")
    blocks = [module for name, module in model.named_modules() if name.endswith(".mlp")]
    before = [{name: child.__dict__.get("forward") for name, child in block.named_children()} for block in blocks]
    apply_tiled_experts(model, TILES)
    assert apply_tiled_experts(model, 2).startswith("2 tiles")  # again: one gated expert per block, retiled
    assert len(tiled_shared_experts(model)) == 2 and tiled_experts_facts(model)["shared_experts"] == 2
    assert apply_tiled_experts(model, 0) == "off"
    after = [{name: child.__dict__.get("forward") for name, child in block.named_children()} for block in blocks]
    assert after == before and tiled_shared_experts(model) == [] and tiled_experts_facts(model) is None
    assert not any(tiled_mlp.is_tiled(module) for module in model.modules())


def test_tiled_mlp_flag_logs_the_shared_experts(caplog):
    from memfit.train.setup import apply_model_techniques

    config = load_config(overrides={"tiled_mlp": 4, "seq_len": 64, "gradient_checkpointing": "off"})
    with caplog.at_level("INFO", logger="memfit"):
        model, _ = apply_model_techniques(config, build_model("glm4_moe"))
    assert ("tiled MLP: 4 tiles on 1 MLPs; 4 tiles on the experts of 1 of 1 MoE layers (model.layers.{1}.mlp)"
            " and on the shared experts of 1 of them") in caplog.text
    assert tiled_experts_facts(model)["shared_experts"] == 1


def test_a_gate_the_block_does_not_apply_as_a_sigmoid_stays_untiled_and_is_named(monkeypatch):
    model = build_model("qwen2_moe")
    monkeypatch.setattr(tiled_experts.inspect, "getsource", lambda _: "return self.shared_expert_gate(x) * y")
    text = apply_tiled_experts(model, TILES)
    assert "left untiled: 2 (a shared expert whose gate is not sigmoid(gate(x)) of one output)" in text
    assert tiled_shared_experts(model) == []


# ---------------------------------------------------------------------------
# Memory: tracked peaks and the estimate
# ---------------------------------------------------------------------------

SEQ = 512
SHARED_WIDTH = 256  # four shared experts of width 64: the shared experts' activations are the ones that matter


def _wide_shared(family: str):
    from transformers import AutoConfig

    common = dict(vocab_size=257, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                  max_position_embeddings=4096, num_experts_per_tok=2, intermediate_size=256, n_routed_experts=4,
                  moe_intermediate_size=64, n_shared_experts=4, first_k_dense_replace=0, n_group=1, topk_group=1)
    if family == "deepseek_v3":
        return AutoConfig.for_model(family, **common, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=8,
                                    qk_nope_head_dim=8, v_head_dim=16)
    if family == "qwen2_moe":  # one gated shared expert of the same width
        return AutoConfig.for_model(family, **{k: v for k, v in common.items() if k not in QWEN2_MOE_DROPS},
                                    num_experts=4, shared_expert_intermediate_size=SHARED_WIDTH)
    return AutoConfig.for_model(family, **common, head_dim=16)


QWEN2_MOE_DROPS = ("n_routed_experts", "n_shared_experts", "first_k_dense_replace", "n_group", "topk_group")


VARIANTS = {"fp32": {}, "lora bf16": {"lora_r": 8, "dtype": "bf16"}}
CASES = [("deepseek_v3", "fp32"), ("deepseek_v3", "lora bf16"), ("glm4_moe", "fp32"), ("qwen2_moe", "fp32")]
SAVING_CASES = [("deepseek_v3", "fp32"), ("deepseek_v3", "lora bf16"), ("qwen2_moe", "fp32")]


def _config(variant: str, tiles: int):
    return load_config(overrides={"seq_len": SEQ, "batch_size": 1, "gradient_checkpointing": "full",
                                  "tiled_mlp": tiles, **VARIANTS[variant]})


def _routed_only():
    """The shared experts left untiled: what the model kept before they were tiled."""
    return mock.patch.object(tiled_experts, "apply_tiled_shared_experts", lambda *_: {})


@pytest.fixture(scope="module")
def tracked_peaks() -> dict[tuple[str, str, str], int]:
    """(family, variant, "routed" or "all") -> the tracked peak of a real CPU step, 8 tiles."""
    peaks = {}
    for family, variant in CASES:
        hf_config = _wide_shared(family)
        config = _config(variant, 8)
        run = resolve_run(config, hf_config, None)
        setup = StepSetup(1, SEQ, {4: torch.float32, 2: torch.bfloat16}[run.weight_bytes], None, run.attention,
                          run.checkpointing, run.checkpoint_every, run.loss_chunk_size, torch.device("cpu"))
        peaks[family, variant, "all"] = measure_step_with_tracker(copy.deepcopy(hf_config), config, setup)
        if (family, variant) in SAVING_CASES:
            with _routed_only():
                peaks[family, variant, "routed"] = measure_step_with_tracker(copy.deepcopy(hf_config), config, setup)
    return peaks


@pytest.mark.parametrize(("family", "variant"), SAVING_CASES)
def test_tiling_the_shared_experts_lowers_the_tracked_peak_by_their_activations(tracked_peaks, family, variant):
    """Full checkpointing: the recomputed block's shared-expert intermediates (gate, up, act, product) go."""
    # what the shared experts' gated MLP keeps per token: four tensors of their width (16-bit base with LoRA:
    # plus PEFT's fp32 copy of the down projection's input); Qwen2-MoE's gate: the expert's output, hidden wide,
    # that the block's product kept for the gate's gradient
    per_token = 4 * 4 * SHARED_WIDTH if variant == "fp32" else 4 * 2 * SHARED_WIDTH + 4 * SHARED_WIDTH
    per_token += 4 * 64 if family == "qwen2_moe" else 0
    saved = tracked_peaks[family, variant, "routed"] - tracked_peaks[family, variant, "all"]
    print(f"{family} {variant}: tracked peak {tracked_peaks[family, variant, 'routed'] / 2**20:.3f} MiB"
          f" -> {tracked_peaks[family, variant, 'all'] / 2**20:.3f} MiB, saved {saved} B of {per_token * SEQ} B")
    assert 0.8 < saved / (per_token * SEQ) < 1.2


@pytest.mark.parametrize(("family", "variant"), CASES)
def test_estimate_of_tiled_shared_experts_within_the_band(tracked_peaks, family, variant):
    truth = tracked_peaks[family, variant, "all"]
    predicted = estimate(_config(variant, 8), hf_config=_wide_shared(family), method="analytical").peak_bytes
    print(f"{family} {variant}: tracked {truth / 2**20:.3f} MiB, estimate {predicted / 2**20:.3f} MiB"
          f" ({predicted / truth - 1:+.1%})")
    assert predicted / truth - 1 == pytest.approx(0, abs=ERROR_BAND["analytical"]), (predicted, truth)
