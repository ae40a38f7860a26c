"""Expert streaming (--expert-offload): frozen experts in host memory, brought to the device per layer call.

Reference: the same model with its experts resident (fp32, checkpointed, LoRA). Streaming copies the same
values, so loss and the adapters' gradients match exactly, and an SGD step (no clipping) leaves the same
adapters. The tracker sees the experts' bytes move from device to host, and the step's device peak keep
about one layer's experts. Fault twins: a layer whose experts are left in host memory during its call, and
a device copy kept from an earlier call after the host weights changed, are both caught.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

import model_zoo
from memfit.config import LoraConfig, MemoryConfig, TrainConfig
from memfit.errors import UsageError
from memfit.memory.tracker import MemoryTracker
from memfit.techniques import expert_streaming
from memfit.techniques.checkpointing import apply_gradient_checkpointing
from memfit.techniques.expert_streaming import (
    ExpertStreamer,
    apply_expert_streaming,
    expert_streaming_facts,
)
from memfit.techniques.host_memory import is_marked_host
from memfit.techniques.lora import apply_lora
from model_zoo import ZOO, build_model, randomize_adapters

pytest.importorskip("peft")


class ListMoe(nn.Module):
    """A mixture of experts kept as a list of expert MLPs (the older Mixtral layout), top-2 routing."""

    def __init__(self, hidden: int, width: int, experts: int = 4, seed: int = 0) -> None:
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.gate = nn.Linear(hidden, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(hidden, width, bias=False), nn.SiLU(), nn.Linear(width, hidden, bias=False))
            for _ in range(experts))
        with torch.no_grad():
            for parameter in self.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.2)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        weights, chosen = torch.topk(self.gate(flat).softmax(-1), 2, dim=-1)
        out = torch.zeros_like(flat)
        for slot in range(2):
            for index, expert in enumerate(self.experts):
                rows = chosen[:, slot] == index
                out = out + rows.unsqueeze(-1) * weights[:, slot:slot + 1] * expert(flat)
        return out.view_as(hidden_states)


def _model(family: str, layers: int = 2):
    """The tiny checkpointed LoRA model; two builds are equal (a deep copy would share split LoRA's forwards)."""
    torch.manual_seed(0)
    config = ZOO["llama" if family == "list" else family]()
    config.num_hidden_layers = layers
    model = AutoModelForCausalLM.from_config(config)
    targets = "auto"  # the fused experts get adapters: split LoRA
    if family == "list":
        for index, layer in enumerate(model.model.layers):
            layer.mlp = ListMoe(model.config.hidden_size, 48, seed=index)
        targets = "q_proj,v_proj"
    apply_gradient_checkpointing(model, "full")
    model, _ = apply_lora(model, LoraConfig(lora_r=2, lora_targets=targets), gradient_checkpointing=True)
    randomize_adapters(model)
    return model.train()


TOKENS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))


def _step(model, optimizer=None):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=TOKENS, labels=TOKENS).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    if optimizer is not None:
        optimizer.step()
    return loss.detach(), grads


def _sgd(model):
    return torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)


def _assert_same(actual, expected) -> None:
    (loss, grads), (expected_loss, expected_grads) = actual, expected
    torch.testing.assert_close(loss, expected_loss, rtol=0, atol=0)
    assert grads.keys() == expected_grads.keys() and expected_grads
    for name, grad in expected_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def _expert_bytes(model) -> int:
    return sum(p.nbytes for n, p in model.named_parameters() if ".experts." in n and "lora_" not in n)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral", "list"])
def test_streamed_experts_give_the_resident_loss_gradients_and_update(family):
    layers = 4 if family == "list" else 2  # as many blocks as experts: the longest list is the blocks
    model, reference = _model(family, layers), _model(family, layers)
    line = apply_expert_streaming(model)
    assert f"in {layers} MoE layers kept in host memory" in line, line
    optimizer, reference_optimizer = _sgd(model), _sgd(reference)
    for _ in range(2):  # the second step runs on the adapters the first SGD step changed
        _assert_same(_step(model, optimizer), _step(reference, reference_optimizer))
    if family != "list":  # split LoRA's adapters on the streamed experts were compared
        assert any(".experts." in name and "lora_" in name for name in _step(reference)[1])
    facts = expert_streaming_facts(model)
    # two forwards and their recomputes of every layer's experts
    assert facts["streamed_bytes"] == 2 * facts["bytes_per_micro_batch"] == 4 * facts["host_bytes"] > 0


class _HostReads(TorchDispatchMode):
    """Operators (other than the copies that bring a weight) that read a tensor in host memory."""

    COPIES = {"aten.clone.default", "aten._to_copy.default", "aten.copy_.default", "aten.detach.default"}

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) not in self.COPIES:
            for value in torch.utils._pytree.tree_leaves((args, kwargs or {})):
                if isinstance(value, torch.Tensor) and is_marked_host(value.untyped_storage()):
                    self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


def _host_reads(model) -> list[str]:
    with _HostReads() as mode:
        _step(model)
    return mode.reads


def test_no_operator_reads_an_expert_weight_in_host_memory():
    model = _model("qwen3_moe")
    apply_expert_streaming(model)
    assert _host_reads(model) == []


def test_fault_twin_a_layer_left_in_host_memory_is_caught(monkeypatch):
    model = _model("qwen3_moe")
    apply_expert_streaming(model)
    bring = ExpertStreamer.bring

    def skips_layer_one(self, index, backward):
        if index != 1:
            bring(self, index, backward)

    monkeypatch.setattr(ExpertStreamer, "bring", skips_layer_one)
    assert _host_reads(model), "a layer computing on its host weights went unnoticed"


def _changed_host_weights(model, factor: float) -> None:
    """Change every frozen expert weight where it lives (host copies when streamed), as loading another base would."""
    streamer = getattr(model, expert_streaming.STREAMER_ATTRIBUTE, None)
    with torch.no_grad():
        if streamer is not None:
            for layer in streamer.layers:
                for _, _, host in layer.weights:
                    host.data.mul_(factor)
        else:
            for name, parameter in model.named_parameters():
                if ".experts." in name and "lora_" not in name:
                    parameter.mul_(factor)


def _after_change(model, reference):
    _step(model), _step(reference)
    _changed_host_weights(model, 1.5)
    _changed_host_weights(reference, 1.5)
    return _step(model), _step(reference)


def test_a_change_of_the_host_weights_reaches_the_next_call():
    model, reference = _model("qwen3_moe"), _model("qwen3_moe")
    apply_expert_streaming(model)
    streamed, resident = _after_change(model, reference)
    _assert_same(streamed, resident)


def test_fault_twin_a_stale_device_copy_is_caught(monkeypatch):
    model, reference = _model("qwen3_moe"), _model("qwen3_moe")
    apply_expert_streaming(model)
    copy_of = ExpertStreamer._copy
    kept: dict[int, list] = {}

    def keeps_first_copy(self, layer):  # the fault: a device copy reused across calls
        return kept.setdefault(layer.index, copy_of(self, layer))

    monkeypatch.setattr(ExpertStreamer, "_copy", keeps_first_copy)
    streamed, resident = _after_change(model, reference)
    with pytest.raises(AssertionError):
        _assert_same(streamed, resident)


def _tracked(model) -> tuple[int, int, int]:
    """(device bytes before the step, the step's device peak, host bytes) of one tracked step."""
    tracker = MemoryTracker("cpu")
    tracker.attach(model)
    with tracker:
        before = tracker.current_bytes
        with tracker.phase("forward"):
            loss = model(input_ids=TOKENS, labels=TOKENS).loss
        with tracker.phase("backward"):
            loss.backward()
        memory = tracker.end_step()
        host = tracker.host_bytes
    tracker.detach()
    model.zero_grad(set_to_none=True)
    return before, memory.peak_bytes, host


def test_tracker_sees_the_experts_move_to_host_and_one_layer_on_the_device():
    layers = 6
    model = _model("qwen3_moe", layers=layers)
    experts = _expert_bytes(model)
    resident_before, resident_peak, resident_host = _tracked(model)
    apply_expert_streaming(model)
    assert _expert_bytes(model) == experts
    before, peak, host = _tracked(model)
    assert host - resident_host == experts
    assert resident_before - before == experts
    one_layer = experts // layers
    saved = resident_peak - peak
    print(f"experts {experts} B ({one_layer} B a layer); device peak {resident_peak} -> {peak} B")
    # every layer's experts but the one running (and its recompute's saved copy) leave the device peak
    assert experts - 1.5 * one_layer <= saved <= experts


def test_trainable_experts_and_unchecked_layers_are_refused():
    full = build_model("qwen3_moe")
    apply_gradient_checkpointing(full, "full")
    with pytest.raises(UsageError, match="trains in full"):
        apply_expert_streaming(full)
    model = build_model("qwen3_moe")
    model, _ = apply_lora(model, LoraConfig(lora_r=2), gradient_checkpointing=False)
    with pytest.raises(UsageError, match="not checkpointed"):
        apply_expert_streaming(model)
    with pytest.raises(UsageError, match="no mixture-of-experts"):
        apply_expert_streaming(build_model("llama"))


@pytest.mark.parametrize(("memory", "lora", "needs"), [
    ({"gradient_checkpointing": "off"}, {"lora_r": 8}, "--gradient-checkpointing full"),
    ({"gradient_checkpointing": "full"}, {"lora_r": 0}, "add --lora-r"),
    ({"gradient_checkpointing": "full", "compile": True}, {"lora_r": 8}, "--compile"),
])
def test_config_refuses_what_streaming_cannot_run_with(memory, lora, needs):
    config = TrainConfig(memory=MemoryConfig(expert_offload=True, **memory), lora=LoraConfig(**lora))
    with pytest.raises(UsageError, match=needs):
        config.validate()


def _wide_experts():
    """Experts dominate the weights: 8 experts of width 128 on a 64-wide stream, top-2, four layers."""
    from transformers import AutoConfig

    return AutoConfig.for_model("qwen3_moe", vocab_size=257, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                                num_key_value_heads=2, head_dim=16, max_position_embeddings=1024, num_experts_per_tok=2,
                                intermediate_size=128, moe_intermediate_size=128, num_experts=8)


def _train_config(offload: bool):
    from memfit.config_loading import load_config

    return load_config(overrides={"seq_len": 256, "batch_size": 1, "gradient_checkpointing": "full", "lora_r": 8,
                                  "dtype": "bf16", "expert_offload": offload})


@pytest.fixture(scope="module")
def tracked_and_estimated() -> dict[bool, tuple[int, int, int, int]]:
    """offload -> (tracked device peak, tracked host peak, estimated peak, estimated host bytes) of a real CPU step."""
    from memfit.prediction.estimator import estimate
    from memfit.prediction.run_shape import resolve_run
    from memfit.prediction.traced import StepSetup
    from memfit.train.traced import trace_step

    found = {}
    for offload in (False, True):
        config, hf_config = _train_config(offload), _wide_experts()
        run = resolve_run(config, hf_config, None)
        setup = StepSetup(config.training.batch_size, config.data.seq_len, torch.bfloat16, None, run.attention,
                          run.checkpointing, run.checkpoint_every, run.loss_chunk_size, torch.device("cpu"))
        traced = trace_step(copy.deepcopy(hf_config), config, setup, fake=False)
        predicted = estimate(config, hf_config=hf_config, method="analytical")
        found[offload] = (traced.peak_bytes, traced.host_peak_bytes, predicted.peak_bytes, predicted.host_bytes)
    return found


def test_estimate_of_streamed_experts_follows_the_tracker(tracked_and_estimated):
    from memfit.prediction.estimator import ERROR_BAND

    resident, streamed = tracked_and_estimated[False], tracked_and_estimated[True]
    experts = 4 * 2 * 8 * 3 * 64 * 128  # layers x bf16 bytes x experts x (gate, up, down) x hidden x width
    print(f"tracked peak {resident[0]} -> {streamed[0]} B, host {streamed[1]} B; "
          f"estimate {resident[2]} -> {streamed[2]} B, host {streamed[3]} B")
    assert streamed[1] - resident[1] == experts  # the tracker files every expert byte as host memory
    assert streamed[3] == experts  # and the estimate's host term says the same
    band = ERROR_BAND["analytical"]
    assert streamed[2] / streamed[0] - 1 == pytest.approx(0, abs=band), (streamed[2], streamed[0])
    # the device saving: all layers' experts but the one running, in both
    tracked_saving, estimated_saving = resident[0] - streamed[0], resident[2] - streamed[2]
    assert estimated_saving == experts * 3 // 4
    assert tracked_saving == pytest.approx(estimated_saving, rel=0.1)


zoo_model_dirs = model_zoo.zoo_model_dirs  # the session fixture: tiny models saved by transformers


def test_memfit_train_streams_the_experts_and_says_so(zoo_model_dirs, text_file, tmp_path, caplog):
    """Through memfit's loop (LoRA, full checkpointing, SGD without clipping): the adapter equals the resident run's."""
    import json

    from safetensors.torch import load_file

    from fault_injection import SGD_NO_CLIPPING
    from memfit.config_loading import load_config
    from memfit.train.loop import train

    def run(out, offload):
        config = load_config(overrides=dict(
            model=str(zoo_model_dirs["qwen3_moe"]), dataset=str(text_file), seq_len=32, batch_size=2, max_steps=2,
            packing=False, loss_chunk_size=0, output_dir=str(out), lr=1.0, report=False, lora_r=2,
            gradient_checkpointing="full", expert_offload=offload, **SGD_NO_CLIPPING))
        result = train(config)
        adapter = load_file(str(next(result.final_dir.glob("adapter_model.safetensors"))))
        lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        staged.append(next(line["staged_load"] for line in lines if "staged_load" in line))
        return adapter, [line["expert_offload"] for line in lines if "expert_offload" in line]

    staged = []

    torch.set_num_threads(1)
    resident, facts_off = run(tmp_path / "resident", False)
    with caplog.at_level("INFO", logger="memfit"):
        streamed, facts = run(tmp_path / "streamed", True)
    assert resident.keys() == streamed.keys() and any("experts" in name for name in resident)
    for name, tensor in resident.items():
        torch.testing.assert_close(streamed[name], tensor, rtol=0, atol=1e-6, msg=name)
    assert all(fact is None for fact in facts_off)
    # the streamed run loaded its experts into host memory and never put them on the device (the staged load)
    assert staged[0] is None and staged[1]["weights"] == "expert stacks" and staged[1]["tensors"] == 4
    assert facts and facts[-1]["layers"] == 2 and facts[-1]["streamed_bytes"] >= 2 * facts[-1]["bytes_per_micro_batch"]
    assert any("expert offload:" in record.getMessage() and "kept in host memory" in record.getMessage()
               for record in caplog.records)


def test_traced_estimate_runs_the_streamed_step(tracked_and_estimated):
    """The traced estimate runs memfit's step on fake tensors, streaming included: the tracked peak, host term alike."""
    import memfit.train.traced  # noqa: F401  (registers the step the traced estimate runs)
    from memfit.prediction.estimator import ERROR_BAND, estimate

    traced = estimate(_train_config(True), hf_config=_wide_experts(), method="traced")
    tracked = tracked_and_estimated[True][0]
    assert traced.peak_bytes / tracked - 1 == pytest.approx(0, abs=ERROR_BAND["traced"]), (traced.peak_bytes, tracked)
    assert traced.host_breakdown["experts"] == tracked_and_estimated[True][3]


def test_nf4_experts_stream_their_packed_bytes_and_give_the_resident_result():
    """QLoRA's NF4 expert stacks: the packed weights go to host memory, the quantization state stays."""
    pytest.importorskip("bitsandbytes")
    from memfit.techniques.expert_lora import quantize_fused_experts
    from memfit.techniques.expert_quant import is_nf4

    model, reference = _model("qwen3_moe"), _model("qwen3_moe")
    for each in (model, reference):
        assert quantize_fused_experts(each).startswith("experts nf4 in 2 of 2")
    apply_expert_streaming(model)
    streamer = getattr(model, expert_streaming.STREAMER_ATTRIBUTE)
    hosts = [host for layer in streamer.layers for _, _, host in layer.weights]
    assert hosts and all(is_nf4(host) and host.dtype == torch.uint8 for host in hosts)
    assert not any(is_marked_host(host.quant_state.absmax.untyped_storage()) for host in hosts)
    optimizer, reference_optimizer = _sgd(model), _sgd(reference)
    for _ in range(2):
        _assert_same(_step(model, optimizer), _step(reference, reference_optimizer))
    assert _host_reads(model) == []


def _tiled(tiles: int, streamed: bool = True):
    from memfit.techniques.tiled_experts import apply_tiled_experts

    model = _model("qwen3_moe", layers=2)
    if streamed:
        apply_expert_streaming(model)  # before tiling, as memfit's setup orders them
    apply_tiled_experts(model, tiles)
    return model


def test_tiled_experts_bring_a_streamed_layer_once_for_all_their_tiles():
    """Forward, the checkpointed recompute and the tiled backward each copy a layer once, whatever the tiles: three
    copies a micro-batch (untiled: two). The result is the resident tiled model's."""
    model, reference = _tiled(4), _tiled(4, streamed=False)
    _assert_same(_step(model), _step(reference))
    facts = expert_streaming_facts(model)
    assert facts["streamed_bytes"] == 3 * facts["host_bytes"] > 0


def test_fault_twin_tiles_that_each_bring_their_layer_are_caught(monkeypatch):
    from memfit.techniques import tiled_experts

    monkeypatch.setattr(tiled_experts, "HOLD_ATTRIBUTE", "not_a_hold")  # every tile's call brings the layer again
    model = _tiled(4)
    _step(model)
    facts = expert_streaming_facts(model)
    assert facts["streamed_bytes"] > 3 * facts["host_bytes"]
