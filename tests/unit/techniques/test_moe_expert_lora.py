"""LoRA on the fused experts: split LoRA (x A then B per expert group) against PEFT's folded W + BA.

The reference is PEFT's own `target_parameters` path, which materializes the per-expert delta on each call:
the same outputs and adapter gradients within fp32 rounding, and a smaller tracked peak. Bad input (expert
names on a dense model, a router the model lacks, dropout on experts) is one line, exit 2, nothing written.
"""

from __future__ import annotations

import copy

import pytest
import torch

from memfit.config import LoraConfig
from memfit.errors import UsageError
from memfit.techniques.lora import apply_lora, resolve_targets
from model_zoo import build_model, randomize_adapters
from tracked_step import tracked_step

pytest.importorskip("peft")

FAMILIES = ["qwen3_moe", "gpt_oss", "mixtral", "olmoe", "deepseek_v3"]


def _tokens(seed: int = 0, rows: int = 2, length: int = 24) -> torch.Tensor:
    return torch.randint(0, 256, (rows, length), generator=torch.Generator().manual_seed(seed))


def _adapted_pair(family: str, targets: str = "experts"):
    """(split-LoRA model, PEFT-folded model) with the same adapters, B made non-zero so the adapters count."""
    # rank 2 against 4 experts: a rank/expert mix-up in the adapter's layout cannot cancel out
    split, _ = apply_lora(build_model(family), LoraConfig(lora_r=2, lora_targets=targets), gradient_checkpointing=False)
    randomize_adapters(split)
    folded = copy.deepcopy(split)
    for module in folded.modules():
        if "forward" in module.__dict__ and type(module).__name__ == "ParamWrapper":
            del module.forward  # back to PEFT's class forward: W + BA folded per call
    return split, folded


def _loss_and_grads(model, tokens):
    """The logits and every gradient: a tiny model's loss sits near ln(257) whatever its experts do."""
    model.zero_grad(set_to_none=True)
    output = model(input_ids=tokens, labels=tokens)
    output.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return output.logits.detach(), grads


def _close(actual: torch.Tensor, expected: torch.Tensor, rtol: float = 1e-5) -> bool:
    """Equal within `rtol` of the expected tensor's norm (gradients of a tiny model are far below any atol)."""
    return bool(expected.norm() > 0) and bool((actual - expected).norm() <= rtol * expected.norm())


@pytest.mark.parametrize("family", FAMILIES)
def test_split_lora_equals_peft_folded_delta(family):
    split, folded = _adapted_pair(family)
    assert any(getattr(m, "memfit_split_lora", False) for m in split.modules()), "split LoRA did not apply"
    tokens = _tokens()
    logits_split, grads_split = _loss_and_grads(split, tokens)
    logits_folded, grads_folded = _loss_and_grads(folded, tokens)
    assert _close(logits_split, logits_folded, 1e-6)
    expert_grads = [n for n in grads_folded if "experts" in n and "lora_" in n]
    assert expert_grads and set(grads_split) == set(grads_folded)
    for name, grad in grads_folded.items():
        assert _close(grads_split[name], grad), name
    # only adapters train: no gradient reaches a frozen expert weight or a router
    assert all("lora_" in name for name in grads_split)


def test_split_lora_fault_twin_fails():
    """A split adapter that drops its scaling gives another loss: the comparison above can fail."""
    import memfit.techniques.expert_lora as expert_lora

    split, folded = _adapted_pair("qwen3_moe")
    original = expert_lora._project

    def unscaled(chain, name, x, ids, offsets):
        wrapper = chain.wrappers.get(name)
        adapter = wrapper.active_adapters[0]
        saved = wrapper.scaling[adapter]
        wrapper.scaling[adapter] = 1.0
        try:
            return original(chain, name, x, ids, offsets)
        finally:
            wrapper.scaling[adapter] = saved

    tokens = _tokens()
    expert_lora._project = unscaled
    try:
        _, grads_split = _loss_and_grads(split, tokens)
    finally:
        expert_lora._project = original
    _, grads_folded = _loss_and_grads(folded, tokens)
    assert not all(_close(grads_split[name], grad) for name, grad in grads_folded.items())


def test_split_lora_tracked_peak_is_below_the_folded_delta():
    def peak(model):
        return tracked_step(model, _tokens(rows=1, length=8)).peak_bytes

    import memfit.models.experts  # noqa: F401

    def big_experts():
        from transformers import AutoModelForCausalLM

        from model_zoo import ZOO

        config = ZOO["qwen3_moe"]()
        config.num_experts, config.moe_intermediate_size = 16, 128  # the expert stack dominates, as in real MoEs
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config)

    split, _ = apply_lora(big_experts(), LoraConfig(lora_r=4, lora_targets="experts"), gradient_checkpointing=False)
    folded = copy.deepcopy(split)
    for module in folded.modules():
        if "forward" in module.__dict__ and type(module).__name__ == "ParamWrapper":
            del module.forward
    stack = sum(p.nbytes for n, p in split.named_parameters() if n.endswith("experts.base_layer.base_layer.down_proj"))
    split_peak, folded_peak = peak(split), peak(folded)
    # the folded form holds at least one expert stack (a layer's W + BA and its gradient) more
    assert folded_peak - split_peak >= stack, (split_peak, folded_peak, stack)


def test_auto_targets_include_experts_dense_mlps_and_shared_experts_not_routers():
    model = build_model("deepseek_v3")
    targets = resolve_targets(model, "auto")
    assert "model.layers.0.mlp.gate_proj" in targets.modules  # the dense first layer
    assert "model.layers.1.mlp.shared_experts.down_proj" in targets.modules
    assert targets.experts.parameters == ["model.layers.1.mlp.experts.gate_up_proj",
                                          "model.layers.1.mlp.experts.down_proj"]
    assert not any(name.endswith(".gate") for name in targets.modules) and not targets.experts.routers
    wrapped, summary = apply_lora(model, LoraConfig(lora_r=4), gradient_checkpointing=False)
    assert summary.modules == len(targets.modules) and summary.expert_weights == 2  # what the adapter holds


def test_router_trains_in_full_only_when_named():
    model, summary = apply_lora(build_model("qwen3_moe"), LoraConfig(lora_r=4, lora_targets="q_proj,router"),
                                gradient_checkpointing=False)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert summary.routers == 2 and any("mlp.gate" in n and "lora_" not in n for n in trainable)
    model, _ = apply_lora(build_model("qwen3_moe"), LoraConfig(lora_r=4), gradient_checkpointing=False)
    assert not any("mlp.gate" in n for n, p in model.named_parameters() if p.requires_grad)


@pytest.mark.parametrize("targets, message", [
    ("experts", "no fused experts"),
    ("gate_up_proj", "matches no linear layer"),
    ("router", "no expert router"),
])
def test_expert_names_on_a_dense_model_are_one_line(targets, message):
    with pytest.raises(UsageError, match=message):
        resolve_targets(build_model("llama"), targets)


def test_mamba_out_proj_is_left_out_of_auto_and_refused_by_name():
    model = build_model("mamba2")
    assert not any(name.endswith(("out_proj", "conv1d")) for name in resolve_targets(model, "auto").modules)
    with pytest.raises(UsageError, match="PEFT refuses"):
        resolve_targets(model, "out_proj")


def test_dropout_on_experts_is_refused():
    with pytest.raises(UsageError, match="--lora-dropout"):
        apply_lora(build_model("mixtral"), LoraConfig(lora_r=4, lora_dropout=0.1), gradient_checkpointing=False)


def test_cli_refuses_experts_on_a_dense_model_and_writes_nothing(llama_dir, text_file, tmp_path):
    from model_zoo import run_in_one_process

    out = tmp_path / "run"
    (result,) = run_in_one_process([["train", "--model", str(llama_dir), "--dataset", str(text_file), "--lora-r", "4",
                                     "--lora-targets", "experts", "--max-steps", "1", "--output-dir", str(out)]])
    assert result["returncode"] == 2
    lines = [ln for ln in result["stderr"].splitlines() if ln.startswith("memfit")]
    assert lines and "no fused experts" in lines[-1] and "Traceback" not in result["stderr"]
    assert not out.exists()


def test_merge_folds_the_expert_adapters(tmp_path):
    from transformers import AutoModelForCausalLM

    from memfit.techniques.lora_merge import merge_and_save

    split, folded = _adapted_pair("qwen3_moe")
    tokens = _tokens()
    with torch.no_grad():
        expected = split(input_ids=tokens).logits
    merge_and_save(split, tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    with torch.no_grad():
        assert torch.allclose(merged(input_ids=tokens).logits, expected, atol=1e-5)


def test_qlora_quantizes_the_linears_and_holds_the_fused_experts_in_nf4(tmp_path, caplog):
    """bitsandbytes quantizes nn.Linear only: attention goes 4-bit through it, memfit holds the 3-D expert
    weights in NF4 (techniques/expert_quant.py, tested in test_expert_nf4.py), the log says so in one line,
    and the split adapters on the experts train."""
    pytest.importorskip("bitsandbytes")
    import logging

    from transformers import AutoModelForCausalLM

    from memfit.techniques.lora import quantization_config

    build_model("qwen3_moe").save_pretrained(tmp_path)
    config = quantization_config(LoraConfig(lora_r=4, quantize="4bit"), torch.float32)
    base = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=config, device_map={"": "cpu"})
    assert type(base.model.layers[0].self_attn.q_proj.weight).__name__ == "Params4bit"
    with caplog.at_level(logging.INFO, logger="memfit"):
        model, summary = apply_lora(base, LoraConfig(lora_r=4, quantize="4bit"), gradient_checkpointing=False)
    assert any("experts nf4 in 2 of 2 experts modules" in r.message for r in caplog.records)
    assert summary.quantize == "4bit" and summary.expert_weights == 4
    experts = model.get_base_model().model.layers[0].mlp.experts.base_layer.base_layer
    assert type(experts.gate_up_proj).__name__ == "Params4bit" and experts.gate_up_proj.quant_state.dtype == torch.float32
    tokens = _tokens()
    model(input_ids=tokens, labels=tokens).loss.backward()
    assert all(p.grad is not None for n, p in model.named_parameters() if "experts" in n and p.requires_grad)


def test_a_lora_run_with_expert_adapters_resumes_exactly(text_file, tmp_path):
    """The expert adapters are saved in the checkpoint and read back (Mixtral: PEFT renames such keys for
    transformers 4 adapters): a resumed run ends with the uninterrupted run's adapter weights."""
    import shutil

    from safetensors.torch import load_file

    from memfit.checkpoint_files import list_checkpoints
    from memfit.config_loading import load_config
    from memfit.train.loop import train
    from model_zoo import save_family

    directory = save_family("mixtral", tmp_path / "model")

    def config(out, **extra):
        return load_config(overrides=dict(
            model=str(directory), dataset=str(text_file), seq_len=32, batch_size=2, max_steps=2, lora_r=4,
            packing=False, report=False, optimizer="sgd", momentum=0.0, max_grad_norm=0.0, lr=1.0,
            warmup_steps=0, lr_schedule="constant", output_dir=str(out), **extra))

    straight = train(config(tmp_path / "straight"))
    train(config(tmp_path / "killed", save_every=1))
    for checkpoint in list_checkpoints(tmp_path / "killed"):
        if checkpoint.name != "step-1":
            shutil.rmtree(checkpoint)
    shutil.rmtree(tmp_path / "killed" / "final")
    (tmp_path / "killed" / "metrics.jsonl").unlink()
    resumed = train(config(tmp_path / "killed", resume="auto"))
    expected = load_file(str(straight.final_dir / "adapter_model.safetensors"))
    got = load_file(str(resumed.final_dir / "adapter_model.safetensors"))
    assert any("experts" in name and "lora_B" in name for name in expected)
    assert any(float(t.abs().max()) > 0 for n, t in expected.items() if "experts" in n and "lora_B" in n)
    for name, tensor in expected.items():
        torch.testing.assert_close(got[name], tensor, atol=1e-6, rtol=0, msg=name)
