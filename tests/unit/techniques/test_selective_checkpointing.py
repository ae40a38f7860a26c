"""Selective checkpointing keeps matmul outputs; auto checkpoints the fewest blocks that fit."""

from __future__ import annotations

import functools
import itertools
import random
import warnings
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import LlamaConfig, LlamaForCausalLM

from memfit.techniques.auto_checkpointing import (
    choose_blocks_to_checkpoint,
    measure_block_activation_bytes,
    predicted_peak_bytes,
)
from memfit.techniques.checkpointing import selective_checkpoint_kwargs


class LiveBytes(TorchDispatchMode):
    """Bytes of tensor storages created under the mode and still alive."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self._seen: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                storage = tensor.untyped_storage()
                if storage._cdata not in self._seen:
                    self._seen.add(storage._cdata)
                    self.live += storage.nbytes()
                    weakref.finalize(storage, self._free, storage._cdata, storage.nbytes())
        return out

    def _free(self, key: int, nbytes: int) -> None:
        self._seen.discard(key)
        self.live -= nbytes


def tiny_llama(layers: int = 2) -> LlamaForCausalLM:
    config = LlamaConfig(
        hidden_size=64,
        intermediate_size=256,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=512,
    )
    torch.manual_seed(0)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config)


def enable(model, mode: str) -> None:
    if mode == "off":
        return
    kwargs = {"use_reentrant": False} if mode == "full" else selective_checkpoint_kwargs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # the deprecated name the loop uses
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def run(mode: str, input_ids: torch.Tensor):
    """Activation bytes alive after forward, the loss, and all gradients."""
    model = tiny_llama()
    model.train()
    enable(model, mode)
    with LiveBytes() as meter:
        loss = model(input_ids=input_ids, labels=input_ids).loss
        activation_bytes = meter.live
        loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return activation_bytes, loss.detach(), grads


@pytest.mark.numerics
def test_selective_saves_between_off_and_full_with_identical_numerics():
    input_ids = torch.randint(0, 256, (2, 128), generator=torch.Generator().manual_seed(0))
    off_bytes, off_loss, off_grads = run("off", input_ids)
    full_bytes, full_loss, _ = run("full", input_ids)
    selective_bytes, selective_loss, selective_grads = run("selective", input_ids)

    assert full_bytes < selective_bytes < off_bytes, (full_bytes, selective_bytes, off_bytes)
    assert torch.equal(selective_loss, off_loss) and torch.equal(full_loss, off_loss)
    for name, grad in off_grads.items():
        torch.testing.assert_close(selective_grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_hugging_face_passes_the_kwargs_to_checkpoint():
    model = tiny_llama()
    enable(model, "selective")
    layer = model.model.layers[0]
    assert layer.gradient_checkpointing
    bound = layer._gradient_checkpointing_func
    assert isinstance(bound, functools.partial)
    assert bound.func is torch.utils.checkpoint.checkpoint
    assert bound.keywords["use_reentrant"] is False and callable(bound.keywords["context_fn"])


def test_measured_block_bytes_are_equal_per_block_and_within_the_total():
    model = tiny_llama(layers=3)
    input_ids = torch.randint(0, 256, (2, 64))
    per_block = measure_block_activation_bytes(model, {"input_ids": input_ids})
    assert len(per_block) == 3
    assert per_block[1] == per_block[2] > 0
    # Block 0 also saves the rotary cos/sin tables that every block shares (counted once).
    assert 0 <= per_block[0] - per_block[1] <= 2 * (2 * 64 * 16 * 4)
    with LiveBytes() as meter:
        loss = model(input_ids=input_ids, labels=input_ids).loss
        assert sum(per_block) < meter.live
    del loss
    # At least the block input and the MLP's 4x-wide intermediate per token.
    assert per_block[0] > 2 * 64 * (64 + 256) * 4


def brute_force_fewest(per_block, fixed, budget, kept):
    for count in range(len(per_block) + 1):
        fits = [
            list(chosen)
            for chosen in itertools.combinations(range(len(per_block)), count)
            if predicted_peak_bytes(per_block, fixed, kept, list(chosen)) <= budget
        ]
        if fits:
            return count
    return None


@pytest.mark.parametrize("budget", [5_000, 3_500, 3_000, 2_600, 2_200, 1_000])
def test_auto_picks_the_fewest_blocks_that_fit(budget):
    per_block = [900, 400, 700, 600]
    fixed, kept = 500, 50
    chosen = choose_blocks_to_checkpoint(per_block, fixed, budget, kept)
    fewest = brute_force_fewest(per_block, fixed, budget, kept)
    if fewest is None:
        assert chosen is None
        return
    assert chosen is not None and len(chosen) == fewest
    assert predicted_peak_bytes(per_block, fixed, kept, chosen) <= budget


def test_auto_matches_brute_force_on_random_blocks():
    generator = random.Random(0)
    for _ in range(200):
        count = generator.randint(1, 6)
        per_block = [generator.randint(50, 1000) for _ in range(count)]
        kept = [generator.randint(1, 60) for _ in range(count)]
        fixed = generator.randint(0, 500)
        budget = generator.randint(0, fixed + sum(per_block) + 100)
        chosen = choose_blocks_to_checkpoint(per_block, fixed, budget, kept)
        fewest = brute_force_fewest(per_block, fixed, budget, kept)
        assert (None if chosen is None else len(chosen)) == fewest, (per_block, kept, fixed, budget)


def test_auto_checkpoints_nothing_when_it_fits_and_the_biggest_block_first():
    assert choose_blocks_to_checkpoint([100, 100], 0, 10_000, 10) == []
    # None checkpointed: 600 at the loss. Checkpointing block 1 peaks at 410 (at the loss 310;
    # its rebuild: block 0's 100 + its input 10 + its 300); block 0 or 2 instead: 510 or 610.
    assert choose_blocks_to_checkpoint([100, 300, 200], 0, 500, [10, 10, 10]) == [1]
    # Gradients exist from a block's backward on, not at the loss: with 300 of gradients (100 a
    # block) block 1's rebuild peaks at 610 (100 + 10 + 300 + the 200 of blocks 1 and 2) and the
    # loss's moment at 330 (310 + the 20 of its backward); nothing checkpointed, the last block's
    # backward: 700 (600 + its 100).
    assert predicted_peak_bytes([100, 300, 200], 300, 10, [1], gradient_bytes=300, loss_backward_bytes=20) == 610
    assert predicted_peak_bytes([100, 300, 200], 300, 10, [], gradient_bytes=300, loss_backward_bytes=20) == 700
    assert choose_blocks_to_checkpoint([100, 300, 200], 0, 300, 10) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_selective_on_cuda_holds_between_off_and_full():
    input_ids = torch.randint(0, 256, (4, 1024), device="cuda")
    held, losses = {}, {}
    for mode in ("off", "selective", "full"):
        model = tiny_llama().cuda().to(torch.bfloat16)
        model.train()
        enable(model, mode)
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        loss = model(input_ids=input_ids, labels=input_ids).loss
        torch.cuda.synchronize()
        held[mode] = torch.cuda.memory_allocated() - before
        loss.backward()
        losses[mode] = loss.detach().float()
        del model, loss
    assert held["full"] < held["selective"] < held["off"], held
    assert torch.equal(losses["selective"], losses["off"])


def measured_training_peak(model, input_ids) -> int:
    """Peak bytes over two AdamW steps as memfit's MemoryTracker counts them, parameters included.

    The second step is the steady state: the optimizer state exists through its backward.
    (A plain dispatch-mode count would take a parameter's storage for a new one when an
    operator first returns a view of it, `weight.t()`, and count the weights twice.)
    """
    from memfit.memory.tracker import MemoryTracker

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
    tracker = MemoryTracker("cpu")
    tracker.attach(model, optimizer)
    with tracker:
        for _ in range(2):
            with tracker.phase("forward"):
                loss = model(input_ids=input_ids, labels=input_ids).loss
            with tracker.phase("backward"):
                loss.backward()
                del loss
            with tracker.phase("optimizer"):
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            tracker.end_step()
    return tracker.peak_bytes


def test_auto_checkpointing_fits_the_budget_with_the_fewest_blocks():
    from memfit.config import TrainConfig
    from memfit.resolution.resolve import resolve
    from memfit.techniques.auto_checkpointing import (
        AUTO_BUDGET_SHARE,
        auto_checkpointing,
        measure_saved_bytes,
        static_training_parts,
    )

    config = TrainConfig()
    config.data.seq_len, config.training.batch_size = 64, 2
    input_ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    model = tiny_llama(layers=4).train()
    sample = input_ids[:1]
    per_sample, outside = measure_saved_bytes(model, {"input_ids": sample, "labels": sample})
    per_block = [2 * size for size in per_sample]
    run = resolve(config, model.config, "cpu")
    weights, gradients, states = static_training_parts(model, config, run)
    fixed = weights + gradients + states + 2 * outside
    kept = 2 * 64 * 64 * 4  # batch x seq x hidden x fp32
    moments = {"gradient_bytes": gradients, "loss_backward_bytes": 2 * 4 * 2 * 64 * 256}  # fp32 logits' gradients
    predicted = [predicted_peak_bytes(per_block, fixed, kept, list(range(k)), **moments) for k in range(5)]

    for blocks in (0, 2, 3):
        budget = int(predicted[blocks] / AUTO_BUDGET_SHARE) + 1
        model = tiny_llama(layers=4).train()
        description = auto_checkpointing(model, config, budget, run)
        checkpointed = [layer.gradient_checkpointing for layer in model.model.layers]
        assert sum(checkpointed) == blocks, description
        # What fits is the promise: the measured peak stays within the budget. The prediction itself
        # is within 5% of the tracker's peak (docs/accuracy.md: +0.2% to +4.2%), inside the 10% the
        # budget keeps back (AUTO_BUDGET_SHARE).
        measured = measured_training_peak(model, input_ids)
        print(f"{blocks} blocks checkpointed: predicted {predicted[blocks]} B, measured {measured} B")
        assert measured <= budget, description
        assert abs(measured - predicted[blocks]) <= 0.05 * predicted[blocks], description
        assert measured <= 1.01 * predicted[blocks], description  # and on the safe side

    model = tiny_llama(layers=4).train()
    description = auto_checkpointing(model, config, min(predicted) // 2, resolve(config, model.config, "cpu"))
    assert all(layer.gradient_checkpointing for layer in model.model.layers)
    assert "exceeds" in description
