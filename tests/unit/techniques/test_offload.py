"""Activation and optimizer offload: numerics unchanged; memory effect on CUDA."""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memfit.config import OptimizerConfig
from memfit.errors import UsageError
from memfit.techniques.offload import ActivationOffload, activation_offload
from memfit.techniques.optimizer_offload import OPTIMIZER_NO_EFFECT_ON_CPU, check_optimizer_offload, optimizer_offload

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def tiny_llama(device: str = "cpu", hidden: int = 64, layers: int = 2) -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=2048,
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config).to(device)


def loss_and_grads(model, input_ids, context=None):
    model.zero_grad(set_to_none=True)
    with context or contextlib.nullcontext():
        loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def test_on_cpu_activation_offload_runs_the_same_code():
    context, reason = activation_offload("cpu")
    assert reason is None
    assert isinstance(context, ActivationOffload)


def test_pack_unpack_path_leaves_loss_and_grads_unchanged():
    model = tiny_llama()
    input_ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    reference_loss, reference_grads = loss_and_grads(model, input_ids)

    context, reason = activation_offload("cpu", model=model, min_bytes=1024)
    loss, grads = loss_and_grads(model, input_ids, context)

    assert reason is None
    assert context.offloaded_tensors > 10 and context.offloaded_bytes > 100_000
    assert torch.equal(loss, reference_loss)
    for name, grad in reference_grads.items():
        assert torch.equal(grads[name], grad), name


@pytest.mark.parametrize("pass_model", [True, False], ids=["model-given", "no-model"])
def test_parameters_and_small_tensors_stay_put(pass_model):
    model = tiny_llama()
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    moved_from = []
    context = ActivationOffload(model if pass_model else None, min_bytes=4096)
    pack = context.pack_hook

    def spying_pack(tensor):
        packed = pack(tensor)
        if not isinstance(packed, torch.Tensor):
            moved_from.append(tensor)
            assert packed.host.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr()
        return packed

    context.pack_hook = spying_pack
    with context:
        loss = model(input_ids=torch.randint(0, 256, (1, 32))).logits.sum()
    loss.backward()
    assert moved_from
    assert all(t.untyped_storage().data_ptr() not in weights for t in moved_from)
    assert all(t.numel() * t.element_size() >= 4096 for t in moved_from)


def test_optimizer_offload_on_cpu_returns_the_same_optimizer():
    groups = [{"params": list(tiny_llama().parameters()), "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=1e-3)
    offloaded, reason = optimizer_offload(optimizer, groups, OptimizerConfig(max_grad_norm=1.0), "cpu")
    assert offloaded is optimizer and reason == OPTIMIZER_NO_EFFECT_ON_CPU


def test_optimizer_offload_refuses_clipping_on_cuda_only():
    check_optimizer_offload("cpu", 1.0)
    check_optimizer_offload("cuda", 0.0)
    with pytest.raises(UsageError, match="--max-grad-norm 0"):
        check_optimizer_offload("cuda", 1.0)


@pytest.mark.gpu
@gpu
def test_activation_offload_frees_gpu_memory_after_forward_and_keeps_numerics():
    model = tiny_llama("cuda", hidden=512, layers=4)
    input_ids = torch.randint(0, 256, (4, 1024), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    reference_loss, reference_grads = loss_and_grads(model, input_ids)

    def held_after_forward(context):
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        with context:
            loss = model(input_ids=input_ids, labels=input_ids).loss
        torch.cuda.synchronize()
        held = torch.cuda.memory_allocated() - before
        loss.backward()
        return held, loss.detach()

    plain_bytes, _ = held_after_forward(contextlib.nullcontext())
    context, reason = activation_offload("cuda", model=model)
    offloaded_bytes, loss = held_after_forward(context)
    grads = {name: p.grad for name, p in model.named_parameters()}

    print(f"held after forward: {plain_bytes / 2**20:.1f} MiB without offload, {offloaded_bytes / 2**20:.1f} MiB with")
    assert reason is None and context.offloaded_bytes > 0
    assert offloaded_bytes < 0.5 * plain_bytes, (offloaded_bytes, plain_bytes)
    torch.testing.assert_close(loss, reference_loss, rtol=0, atol=0)
    for name, grad in reference_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.gpu
@gpu
def test_optimizer_offload_keeps_adam_state_off_the_gpu():
    pytest.importorskip("torchao")
    measured = {}
    for offload in (False, True):
        model = tiny_llama("cuda", hidden=512, layers=4)
        groups = [{"params": list(model.parameters()), "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=1e-3, fused=True)
        if offload:
            optimizer, reason = optimizer_offload(optimizer, groups, OptimizerConfig(max_grad_norm=0.0), "cuda")
            assert reason is None and type(optimizer).__name__ == "CPUOffloadOptimizer"
            with pytest.raises(UsageError, match="--max-grad-norm 0"):
                optimizer_offload(optimizer, groups, OptimizerConfig(max_grad_norm=1.0), "cuda")
        input_ids = torch.randint(0, 256, (2, 128), device="cuda")
        model(input_ids=input_ids, labels=input_ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch.cuda.synchronize()
        measured[offload] = (torch.cuda.memory_allocated(), [p.detach().cpu() for p in model.parameters()])
        del model, optimizer
    parameter_bytes = sum(p.numel() * 4 for p in measured[False][1])
    print(f"device bytes freed by optimizer offload: {(measured[False][0] - measured[True][0]) / parameter_bytes:.2f}"
          " x the parameter bytes")
    # AdamW keeps two fp32 moments per parameter: about 2 x parameter bytes leave the GPU.
    assert measured[False][0] - measured[True][0] > 1.5 * parameter_bytes
    for expected, actual in zip(measured[False][1], measured[True][1], strict=True):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layers", [8])
def test_offloaded_checkpoints_keep_two_block_inputs_on_the_device(layers):
    """Full checkpointing + offload: the block inputs wait in host memory, two come back at a time."""
    from memfit.memory.tracker import MemoryTracker
    from memfit.techniques.checkpointing import apply_gradient_checkpointing
    from memfit.techniques.tiled_mlp import apply_tiled_mlp

    seq, hidden = 4096, 64
    model = tiny_llama(hidden=hidden, layers=layers)
    apply_gradient_checkpointing(model, "full")
    apply_tiled_mlp(model, 8)  # so that the block inputs, not one block's MLP, decide the peak
    model.train()
    input_ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(0))
    measured = {}
    for offload in (False, True):
        model.zero_grad(set_to_none=True)
        context = ActivationOffload(model, device="cpu") if offload else contextlib.nullcontext()
        tracker = MemoryTracker("cpu")
        tracker.attach(model)
        with tracker:
            with context:
                loss = model(input_ids=input_ids, labels=input_ids).loss
            loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters()}
        measured[offload] = (tracker.peak_bytes, tracker.host_peak_bytes, loss.detach(), grads)
        tracker.detach()

    block_input = seq * hidden * 4
    (plain_peak, _, plain_loss, plain_grads), (peak, host_peak, loss, grads) = measured[False], measured[True]
    print(f"offloaded checkpoints, {layers} blocks: device peak {plain_peak} -> {peak} B, host peak {host_peak} B")
    assert plain_peak - peak >= (layers - 3) * block_input  # all but about two (plus the one in flight)
    assert host_peak >= layers * block_input
    assert torch.equal(loss, plain_loss)
    for name, grad in plain_grads.items():
        assert torch.equal(grads[name], grad), name
