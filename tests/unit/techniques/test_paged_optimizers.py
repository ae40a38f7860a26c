"""Optimizer state off the device: 8-bit and paged AdamW, in backward, and stepped on the host."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import LlamaForCausalLM

from memfit.config import OptimizerConfig
from memfit.memory.tracker import MemoryTracker
from memfit.techniques.optimizer_in_backward import OptimizerInBackward
from memfit.techniques.optimizer_offload import HostSteppedOptimizer, host_stepped
from memfit.techniques.optimizers import build_optimizer
from tiny_llama import tiny_llama as shared_tiny_llama

VOCAB = 128


def tiny_llama(device: str = "cpu") -> LlamaForCausalLM:
    return shared_tiny_llama(vocab=VOCAB, max_positions=128).to(device)


def batches(steps: int, device: str = "cpu") -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (2, 32), generator=generator).to(device) for _ in range(steps)]


def train(model, optimizer, inputs, in_backward: bool) -> list[float]:
    losses = []
    for input_ids in inputs:
        loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        if not in_backward:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def make_sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def make_adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, foreach=False)


def weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_same_weights(actual: dict, expected: dict) -> None:
    for name, tensor in expected.items():
        torch.testing.assert_close(actual[name], tensor, rtol=0, atol=0, msg=name)


# --- optimizer offload with the step in backward (host-stepped) --------------------------------


@pytest.mark.parametrize("make", [make_sgd, make_adamw], ids=["sgd", "adamw"])
def test_host_stepped_in_backward_equals_the_device_optimizer_exactly(make):
    reference = tiny_llama()
    reference_losses = train(reference, make(reference.parameters()), batches(3), in_backward=False)

    model = tiny_llama()
    optimizer = OptimizerInBackward(model, host_stepped(make, "cpu"))
    losses = train(model, optimizer, batches(3), in_backward=True)

    assert losses == reference_losses
    assert_same_weights(weights(model), weights(reference))
    assert all(p.grad is None for p in model.parameters())  # each freed right after its step


def test_a_doubled_gradient_in_the_host_step_fails_the_comparison(monkeypatch):
    reference = tiny_llama()
    train(reference, make_sgd(reference.parameters()), batches(1), in_backward=False)
    step = HostSteppedOptimizer.step

    def doubled(self, closure=None):
        self.parameter.grad.mul_(2)
        return step(self)

    monkeypatch.setattr(HostSteppedOptimizer, "step", doubled)
    model = tiny_llama()
    train(model, OptimizerInBackward(model, host_stepped(make_sgd, "cpu")), batches(1), in_backward=True)
    with pytest.raises(AssertionError):
        assert_same_weights(weights(model), weights(reference))


def test_host_copy_follows_weights_loaded_into_the_parameter():
    model = tiny_llama()
    optimizer = OptimizerInBackward(model, host_stepped(make_sgd, "cpu"))
    train(model, optimizer, batches(1), in_backward=True)
    fresh = tiny_llama().state_dict()
    model.load_state_dict(fresh)  # a resumed run loads weights after the optimizer exists
    reference = tiny_llama()
    train(reference, make_sgd(reference.parameters()), batches(1), in_backward=False)

    train(model, optimizer, batches(1), in_backward=True)
    assert_same_weights(weights(model), weights(reference))


def test_host_stepped_state_dict_round_trips():
    model = tiny_llama()
    optimizer = OptimizerInBackward(model, host_stepped(make_adamw, "cpu"))
    train(model, optimizer, batches(2), in_backward=True)
    state = copy.deepcopy(optimizer.state_dict())  # a saved file, not tensors shared with the live optimizer
    twin = tiny_llama()
    twin.load_state_dict(model.state_dict())
    twin_optimizer = OptimizerInBackward(twin, host_stepped(make_adamw, "cpu"))
    twin_optimizer.load_state_dict(state)
    train(model, optimizer, batches(1), in_backward=True)
    train(twin, twin_optimizer, batches(1), in_backward=True)
    assert_same_weights(weights(twin), weights(model))


def tracked_step(model, optimizer, in_backward: bool) -> MemoryTracker:
    tracker = MemoryTracker("cpu")
    tracker.attach(model, optimizer)
    with tracker:
        train(model, optimizer, batches(2), in_backward)
    return tracker


def test_host_stepped_state_leaves_the_tracked_device_peak():
    """AdamW in backward keeps 8 bytes/parameter of moments on the device; stepped on the host, none."""
    on_device = tiny_llama()
    device_tracker = tracked_step(on_device, OptimizerInBackward(on_device, make_adamw), in_backward=True)
    offloaded = tiny_llama()
    host_tracker = tracked_step(offloaded, OptimizerInBackward(offloaded, host_stepped(make_adamw, "cpu")), True)

    parameter_bytes = sum(p.numel() * 4 for p in on_device.parameters())
    state_bytes = 2 * parameter_bytes + 4 * sum(1 for _ in on_device.parameters())  # two moments + a step count
    assert device_tracker.breakdown()["optimizer_states"] == state_bytes
    assert host_tracker.breakdown()["optimizer_states"] == 0
    saved = device_tracker.peak_bytes - host_tracker.peak_bytes
    print(
        f"tracked device peak: AdamW in backward {device_tracker.peak_bytes} B, host-stepped"
        f" {host_tracker.peak_bytes} B (host {host_tracker.host_bytes} B); AdamW state {state_bytes} B"
    )
    assert saved >= state_bytes, (device_tracker.peak_bytes, host_tracker.peak_bytes, state_bytes)
    # Host memory holds the copy of the weights, their gradients and the moments.
    assert host_tracker.host_bytes >= 2 * parameter_bytes + state_bytes


# --- 8-bit AdamW: with the step in backward, paged ---------------------------------------------


def build_8bit(params, name: str = "adamw-8bit", device: str = "cpu"):
    config = OptimizerConfig(optimizer=name, lr=1e-2, max_grad_norm=0.0)
    return build_optimizer([{"params": params}], config, torch.device(device), impl="for-loop")


def test_8bit_adamw_in_backward_equals_8bit_adamw_exactly():
    pytest.importorskip("bitsandbytes")
    reference = tiny_llama()
    choice = build_8bit(list(reference.parameters()))
    assert choice.name == "adamw-8bit (bitsandbytes)", choice.reason
    reference_losses = train(reference, choice.optimizer, batches(2), in_backward=False)

    model = tiny_llama()
    optimizer = OptimizerInBackward(model, lambda params: build_8bit(params).optimizer)
    losses = train(model, optimizer, batches(2), in_backward=True)
    assert losses == reference_losses
    assert_same_weights(weights(model), weights(reference))


def test_8bit_state_in_backward_is_a_quarter_of_adamw():
    pytest.importorskip("bitsandbytes")
    fp32 = tiny_llama()
    fp32_tracker = tracked_step(fp32, torch.optim.AdamW(fp32.parameters(), lr=1e-2, foreach=False), False)
    model = tiny_llama()
    tracker = tracked_step(model, OptimizerInBackward(model, lambda params: build_8bit(params).optimizer), True)

    big = [p for p in model.parameters() if p.numel() >= 4096]  # bitsandbytes keeps smaller tensors' state in fp32
    small = [p for p in model.parameters() if p.numel() < 4096]
    # Per big tensor: two uint8 moments, an fp32 absmax per 256 values of each, two 256-entry fp32 maps.
    expected = sum(2 * p.numel() + 2 * 4 * -(-p.numel() // 256) + 2 * 256 * 4 for p in big)
    expected += sum(8 * p.numel() for p in small)
    state = tracker.breakdown()["optimizer_states"]
    print(
        f"optimizer state: 8-bit in backward {state} B (model {expected} B), AdamW fp32 "
        f"{fp32_tracker.breakdown()['optimizer_states']} B"
    )
    assert state == pytest.approx(expected, rel=0.02, abs=64 * len(small))  # + small step counters
    # A quarter of AdamW's 8 bytes/parameter, plus the small tensors' fp32 state and the maps on this toy.
    assert state < 0.4 * fp32_tracker.breakdown()["optimizer_states"]
    assert tracker.breakdown()["gradients"] == 0  # freed as each parameter stepped


def test_paged_8bit_adamw_without_cuda_runs_unpaged_and_says_so():
    pytest.importorskip("bitsandbytes")
    choice = build_8bit(list(tiny_llama().parameters()), "paged-adamw-8bit", "cpu")
    assert choice.name == "adamw-8bit (bitsandbytes)"
    assert "paged optimizers need CUDA" in choice.reason


@pytest.mark.gpu
def test_paged_8bit_adamw_on_cuda_equals_unpaged_and_keeps_state_out_of_the_allocator():
    pytest.importorskip("bitsandbytes")
    results = {}
    for name in ("adamw-8bit", "paged-adamw-8bit"):
        # bitsandbytes pages only tensors of 100,000 elements or more (smaller state stays in the allocator):
        # hidden 512 gives MLP weights of 512 x 1024 = 524,288.
        model = shared_tiny_llama(hidden=512, vocab=VOCAB, max_positions=128).to("cuda")
        choice = build_8bit(list(model.parameters()), name, "cuda")
        assert choice.name == f"{name} (bitsandbytes)", choice.reason
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        train(model, choice.optimizer, batches(3, "cuda"), in_backward=False)
        torch.cuda.synchronize()
        results[name] = (weights(model), torch.cuda.memory_allocated() - before)
    assert_same_weights(results["paged-adamw-8bit"][0], results["adamw-8bit"][0])
    # Paged state lives in CUDA unified memory, outside PyTorch's allocator.
    assert results["paged-adamw-8bit"][1] < results["adamw-8bit"][1]
    print(
        f"allocator bytes held after 3 steps: adamw-8bit {results['adamw-8bit'][1]}, paged {results['paged-adamw-8bit'][1]}"
    )


def test_training_with_offload_and_step_in_backward_equals_step_in_backward(llama_dir, text_file, tmp_path):
    """Through memfit.train: --optimizer-offload with --optimizer-in-backward steps on the host, same weights."""
    from safetensors.torch import load_file

    from memfit.config_loading import load_config
    from memfit.train.loop import train
    from memfit.train.metrics import read_metrics

    results = {}
    for offload in (False, True):
        out = tmp_path / str(offload)
        config = load_config(
            overrides=dict(
                model=str(llama_dir),
                dataset=str(text_file),
                seq_len=64,
                batch_size=2,
                max_steps=2,
                optimizer="sgd",
                lr=0.5,
                max_grad_norm=0.0,
                optimizer_in_backward=True,
                optimizer_offload=offload,
                output_dir=str(out),
            )
        )
        result = train(config)
        results[offload] = load_file(str(result.final_dir / "model.safetensors"))
        start = read_metrics(out / "metrics.jsonl")[0]
        assert start["optimizer"].endswith(" in backward on the host" if offload else " in backward")
    assert_same_weights(results[True], results[False])
