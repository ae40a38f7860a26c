"""Gradient checkpointing: the bytes saved for backward fall as expected; loss and gradients do not change."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from memfit.techniques.checkpointing import apply_gradient_checkpointing, transformer_blocks
from tracked_step import tracked_step

LAYERS, BATCH, SEQ, HIDDEN = 4, 2, 64, 64


def _model():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=257, hidden_size=HIDDEN, intermediate_size=176, num_hidden_layers=LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _saved_bytes(model, input_ids) -> tuple[int, torch.Tensor]:
    """Bytes of distinct storages autograd keeps for backward during forward (parameters excluded)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(input_ids=input_ids, labels=input_ids).loss
    return sum(seen.values()), loss


def _per_block_saved_bytes(model, input_ids) -> list[int]:
    blocks = transformer_blocks(model)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    per_block = [dict() for _ in blocks]
    current = [None]
    handles = []
    for index, block in enumerate(blocks):
        handles.append(block.register_forward_pre_hook(lambda m, a, i=index: current.__setitem__(0, i)))
        handles.append(block.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)))

    def pack(tensor):
        storage = tensor.untyped_storage()
        if current[0] is not None and storage.data_ptr() not in parameters:
            per_block[current[0]][storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=input_ids, labels=input_ids)
    for handle in handles:
        handle.remove()
    return [sum(block.values()) for block in per_block]


@pytest.fixture
def input_ids():
    return torch.randint(0, 256, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))


def _tracked_peaks(model, input_ids) -> tuple[int, int]:
    """(peak of forward, peak of the whole forward + backward), measured by the tracker."""
    step = tracked_step(model, input_ids)
    return next(p.peak_bytes for p in step.phases if p.name == "forward"), step.peak_bytes


def _saved_in_blocks_and_block_inputs(model, input_ids) -> tuple[int, int]:
    """Distinct storages that blocks save for backward, and distinct tensors handed to blocks (the checkpoints' keep)."""
    from torch.utils._pytree import tree_leaves

    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    inputs: dict[int, int] = {}
    inside = [False]

    def enter(module, args, kwargs):
        inside[0] = True
        for tensor in tree_leaves((args, kwargs)):
            if isinstance(tensor, torch.Tensor):
                inputs[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()

    def pack(tensor):
        storage = tensor.untyped_storage()
        if inside[0] and storage.data_ptr() not in parameters:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    blocks = transformer_blocks(model)
    handles = [block.register_forward_pre_hook(enter, with_kwargs=True) for block in blocks]
    handles += [block.register_forward_hook(lambda m, a, o: inside.__setitem__(0, False)) for block in blocks]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=input_ids, labels=input_ids)
    for handle in handles:
        handle.remove()
    return sum(saved.values()), sum(inputs.values())


def test_full_checkpointing_saves_the_expected_bytes(input_ids):
    """Measured by the tracker: the forward peak falls by exactly what the blocks saved, less what checkpoints keep.

    Each checkpointed block keeps its tensor inputs (hidden states, rotary cos/sin, positions)
    instead of everything it saved for backward; the prediction comes from the plain model,
    the measurement from the live-tensor tracker on the checkpointed one.
    """
    saved_in_blocks, block_inputs = _saved_in_blocks_and_block_inputs(_model().train(), input_ids)
    off_forward, off_peak = _tracked_peaks(_model().train(), input_ids)
    model = _model().train()
    apply_gradient_checkpointing(model, "full")
    full_forward, full_peak = _tracked_peaks(model, input_ids)
    print(f"forward peak {off_forward} -> {full_forward} B, step peak {off_peak} -> {full_peak} B;"
          f" saved in blocks {saved_in_blocks} B, block inputs {block_inputs} B")
    assert off_forward - full_forward == saved_in_blocks - block_inputs
    # Backward recomputes one block at a time: the step peak falls too, by less than the forward peak.
    assert 0 < off_peak - full_peak < off_forward - full_forward


def test_checkpoint_every_second_block_saves_about_half(input_ids):
    model = _model().train()
    off_bytes, _ = _saved_bytes(model, input_ids)
    assert apply_gradient_checkpointing(model, "full", every=2) == "full on 2 of 4 blocks"
    half_bytes, _ = _saved_bytes(model, input_ids)
    full_model = _model().train()
    apply_gradient_checkpointing(full_model, "full")
    full_bytes, _ = _saved_bytes(full_model, input_ids)
    assert full_bytes < half_bytes < off_bytes
    assert (off_bytes - half_bytes) == pytest.approx((off_bytes - full_bytes) / 2, rel=0.15)


@pytest.mark.parametrize("mode", ["full", "selective"])
def test_loss_and_gradients_unchanged(mode, input_ids):
    reference = _model().train()
    loss = reference(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    model = _model().train()
    apply_gradient_checkpointing(model, mode)
    checkpointed_loss = model(input_ids=input_ids, labels=input_ids).loss
    checkpointed_loss.backward()
    assert checkpointed_loss.item() == pytest.approx(loss.item(), abs=1e-6)
    for (name, p), q in zip(reference.named_parameters(), model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, atol=1e-6, rtol=1e-5, msg=name)


def _matmuls_in_backward(model, input_ids) -> int:
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountMatmuls(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm, torch.ops.aten.bmm):
                CountMatmuls.count += 1
            return func(*args, **(kwargs or {}))

    loss = model(input_ids=input_ids, labels=input_ids).loss
    with CountMatmuls():
        loss.backward()
    return CountMatmuls.count


def test_recompute_really_happens(input_ids):
    """Backward runs the blocks' matmuls again: 6 per Llama block (q, k, v, o, gate, up).

    The down projection is not redone: its output is not needed for backward, and
    non-reentrant checkpointing stops recomputing once it has every saved tensor.
    """
    plain = _matmuls_in_backward(_model().train(), input_ids)
    model = _model().train()
    apply_gradient_checkpointing(model, "full")
    assert _matmuls_in_backward(model, input_ids) == plain + 6 * LAYERS


def test_plain_module_list_is_wrapped():
    """Models that are not Hugging Face models are checkpointed through torch.utils.checkpoint."""

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.GELU(), torch.nn.Linear(128, 32)) for _ in range(3))

        def forward(self, x):
            for block in self.blocks:
                x = x + block(x)
            return x.sum()

    torch.manual_seed(0)
    model, x = Tiny(), torch.randn(16, 32)
    model(x).backward()
    reference = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    assert apply_gradient_checkpointing(model, "full") == "full on 3 of 3 blocks"
    model(x).backward()
    for p, g in zip(model.parameters(), reference, strict=True):
        torch.testing.assert_close(p.grad, g)
