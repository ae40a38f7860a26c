"""Partial offloaded checkpoints (`--activation-offload-blocks N`): the first N blocks' inputs go to host.

The numerics are those of the plain run and of full offload (SGD without clipping, so a
gradient off by any factor fails); the tracker (device and host apart, on CPU) shows the
device falling by exactly the offloaded inputs and the host holding only those.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memfit.memory.tracker import MemoryTracker
from memfit.techniques.checkpointing import apply_gradient_checkpointing
from memfit.techniques.offload import ActivationOffload, activation_offload


def checkpointed_llama(layers: int = 4, hidden: int = 32, tiles: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256, max_position_embeddings=8192)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    apply_gradient_checkpointing(model, "full")
    if tiles:
        from memfit.techniques.tiled_mlp import apply_tiled_mlp

        apply_tiled_mlp(model, tiles)  # the block inputs, not one block's MLP, decide the peak
    model.train()
    return model


def sgd_step(model, input_ids, context) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One SGD step (lr 0.5, no clipping, no momentum) from the same start; the loss and the new weights."""
    start = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    optimizer.zero_grad(set_to_none=True)
    with context:
        loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    optimizer.step()
    after = {name: p.detach().clone() for name, p in model.named_parameters()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(start[name])
    return loss.detach(), after


def test_partial_offload_updates_the_weights_as_no_offload_and_full_offload_do():
    model = checkpointed_llama(layers=4)
    input_ids = torch.randint(0, 256, (2, 96), generator=torch.Generator().manual_seed(0))
    plain_loss, plain = sgd_step(model, input_ids, contextlib.nullcontext())
    full = ActivationOffload(model, min_bytes=4096)
    full_loss, fully = sgd_step(model, input_ids, full)
    partial = ActivationOffload(model, min_bytes=4096, blocks=2)
    partial_loss, partly = sgd_step(model, input_ids, partial)

    # blocks 0 and 1 sent their inputs; the full run also the two later blocks' and the head's
    assert partial.offloaded_tensors == 2 and full.offloaded_tensors > 4
    assert partial.fetched_ahead == 2  # block 1's input came while block 2 ran, block 0's while block 1 did
    assert torch.equal(partial_loss, plain_loss) and torch.equal(full_loss, plain_loss)
    moved = 0
    for name, weight in plain.items():
        assert torch.equal(partly[name], weight), name
        assert torch.equal(fully[name], weight), name
        moved += int(not torch.equal(weight, dict(model.named_parameters())[name]))
    assert moved > 10  # the step changed the weights: equal updates, not no updates


def test_a_second_forward_counts_its_blocks_again():
    model = checkpointed_llama(layers=4)
    input_ids = torch.randint(0, 256, (1, 128), generator=torch.Generator().manual_seed(1))
    context = ActivationOffload(model, min_bytes=4096, blocks=3)
    with context:
        for _ in range(2):  # two micro-batches: the block count restarts at each forward
            model(input_ids=input_ids, labels=input_ids).loss.backward()
    assert context.offloaded_tensors == 2 * 3


def test_no_list_of_blocks_offloads_everything_and_says_why():
    context, reason = activation_offload("cpu", model=torch.nn.Linear(4, 4), blocks=2)
    assert isinstance(context, ActivationOffload) and context.blocks is None
    assert "no list of transformer blocks" in reason
    context, reason = activation_offload("cpu", model=checkpointed_llama(layers=2), blocks=2)
    assert reason is None and context.blocks == 2
    with pytest.raises(ValueError):
        ActivationOffload(None, blocks=2)


def tracked(model, input_ids, context) -> tuple[int, int]:
    """Device and host peaks of one forward and backward."""
    model.zero_grad(set_to_none=True)
    tracker = MemoryTracker("cpu")
    tracker.attach(model)
    with tracker:
        with context:
            loss = model(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
    tracker.detach()
    return tracker.peak_bytes, tracker.host_peak_bytes


@pytest.mark.slow
def test_the_device_sheds_and_the_host_holds_exactly_the_offloaded_inputs():
    layers, seq, hidden = 8, 2048, 64
    model = checkpointed_llama(layers=layers, hidden=hidden, tiles=4)
    input_ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(0))
    block_input = seq * hidden * 4
    plain_peak, plain_host = tracked(model, input_ids, contextlib.nullcontext())
    assert plain_host == 0
    for blocks in (2, 4):  # the kept inputs still decide the peak (with 2 kept, backward peaks later on)
        peak, host = tracked(model, input_ids, ActivationOffload(model, device="cpu", blocks=blocks))
        print(f"{blocks} of {layers} blocks offloaded: device peak {plain_peak} -> {peak} B, host peak {host} B")
        assert host == blocks * block_input  # only the first blocks' inputs, not the later ones' or the head's
        # Backward starts with the kept blocks' inputs on the device: the peak falls by the offloaded ones.
        assert plain_peak - peak == blocks * block_input


def test_a_leaf_input_the_graph_holds_is_not_copied():
    """Under LoRA with checkpointing the embedding output requires grad: the first block's input is a leaf."""
    layers, seq, hidden = 4, 2048, 64
    model = checkpointed_llama(layers=layers, hidden=hidden)
    model.model.embed_tokens.weight.requires_grad_(False)
    model.enable_input_require_grads()
    input_ids = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(0))
    context = ActivationOffload(model, device="cpu", blocks=2)
    _, host = tracked(model, input_ids, context)
    assert context.offloaded_tensors == 1 and host == seq * hidden * 4  # block 1's input only
