"""Tiled MLP: the same loss and gradients as the plain MLP, with a fraction of its working set."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaForCausalLM

from memfit.memory.tracker import MemoryTracker
from memfit.techniques.checkpointing import apply_gradient_checkpointing
from memfit.techniques.optimizer_in_backward import OptimizerInBackward
from memfit.techniques.tiled_mlp import AUTO_TILE_TOKENS, TiledMLPFunction, apply_tiled_mlp, find_mlps, tiles_for
from tiny_llama import tiny_llama as shared_tiny_llama

VOCAB = 200


def tiny_llama(hidden: int = 64, layers: int = 2, intermediate: int | None = None) -> LlamaForCausalLM:
    return shared_tiny_llama(hidden=hidden, layers=layers, vocab=VOCAB, intermediate=intermediate or 4 * hidden,
                             max_positions=1 << 16)


def tokens(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def loss_and_grads(model, input_ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=input_ids, labels=input_ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def assert_same_gradients(actual: dict, expected: dict, rtol: float = 1e-5) -> None:
    assert actual.keys() == expected.keys()
    for name, grad in expected.items():
        # Tiles sum a weight's gradient in another order: compare each tensor as a whole.
        error = ((actual[name] - grad).norm() / grad.norm()).item()
        assert error < rtol, (name, error)


@pytest.mark.parametrize("checkpointing", ["off", "full"])
@pytest.mark.parametrize("tiles", [2, 7])
def test_loss_and_gradients_equal_the_plain_mlp(tiles, checkpointing):
    model = tiny_llama()
    apply_gradient_checkpointing(model, checkpointing)
    model.train()
    input_ids = tokens(2, 96)
    plain_loss, plain_grads = loss_and_grads(model, input_ids)

    assert apply_tiled_mlp(model, tiles) == f"{tiles} tiles on 2 MLPs"
    tiled_loss, tiled_grads = loss_and_grads(model, input_ids)

    torch.testing.assert_close(tiled_loss, plain_loss, rtol=1e-6, atol=0)
    assert_same_gradients(tiled_grads, plain_grads)


def test_a_doubled_gradient_fails_the_comparison(monkeypatch):
    """The comparison above is strong enough to catch a scale error in the tiled backward."""
    model = tiny_llama()
    input_ids = tokens(1, 64)
    _, plain_grads = loss_and_grads(model, input_ids)
    apply_tiled_mlp(model, 4)
    backward = TiledMLPFunction.backward

    def doubled(ctx, grad_output):
        return tuple(None if g is None else 2 * g for g in backward(ctx, grad_output))

    monkeypatch.setattr(TiledMLPFunction, "backward", staticmethod(doubled))
    _, tiled_grads = loss_and_grads(model, input_ids)
    with pytest.raises(AssertionError):
        assert_same_gradients(tiled_grads, plain_grads)


def test_lora_adapters_inside_the_mlp_get_the_plain_gradients():
    peft = pytest.importorskip("peft")
    model = tiny_llama()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["gate_proj", "up_proj", "down_proj", "q_proj"])
    model = peft.get_peft_model(model, config)
    for name, parameter in model.named_parameters():
        if "lora_B" in name:  # B starts at zero; give the adapters something to differentiate
            torch.nn.init.normal_(parameter, std=0.02, generator=torch.Generator().manual_seed(2))
    input_ids = tokens(2, 80)
    plain_loss, plain_grads = loss_and_grads(model, input_ids)
    apply_tiled_mlp(model, 5)
    tiled_loss, tiled_grads = loss_and_grads(model, input_ids)

    assert any("mlp.gate_proj.lora_A" in name for name in plain_grads)
    assert all("lora_" in name for name in plain_grads)  # the base stays frozen
    torch.testing.assert_close(tiled_loss, plain_loss, rtol=1e-6, atol=0)
    assert_same_gradients(tiled_grads, plain_grads)


def test_dropout_in_the_mlp_is_replayed_by_the_recompute():
    """GPT-2's MLP ends in dropout: the recompute must see the masks the forward drew."""
    config = GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=256, resid_pdrop=0.3)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config).train()
    input_ids = tokens(1, 60)
    mlps = find_mlps(model)
    assert len(mlps) == 2

    # Reference: the same tiles, in the same order, with an ordinary graph.
    untiled = [mlp.forward for mlp in mlps]

    def graph_tiles(mlp_forward):
        return lambda hidden: torch.cat([mlp_forward(piece) for piece in hidden.tensor_split(3, dim=-2)], dim=-2)

    for mlp, forward in zip(mlps, untiled, strict=True):
        mlp.forward = graph_tiles(forward)
    torch.manual_seed(5)
    reference_loss, reference_grads = loss_and_grads(model, input_ids)
    for mlp in mlps:
        del mlp.forward

    apply_tiled_mlp(model, 3)
    torch.manual_seed(5)
    tiled_loss, tiled_grads = loss_and_grads(model, input_ids)
    torch.testing.assert_close(tiled_loss, reference_loss, rtol=1e-6, atol=0)
    assert_same_gradients(tiled_grads, reference_grads)


def test_optimizer_in_backward_sees_one_complete_gradient_per_parameter():
    model = tiny_llama()
    input_ids = tokens(1, 64)
    reference = {name: p.detach().clone() for name, p in model.named_parameters()}
    _, plain_grads = loss_and_grads(model, input_ids)
    model.zero_grad(set_to_none=True)

    apply_tiled_mlp(model, 4)
    calls: dict[str, int] = {}
    names = {p: name for name, p in model.named_parameters()}

    def make(params):
        return torch.optim.SGD(params, lr=1.0)

    optimizer = OptimizerInBackward(model, make)
    for parameter in model.parameters():
        parameter.register_post_accumulate_grad_hook(lambda p: calls.__setitem__(names[p], calls.get(names[p], 0) + 1))
    model(input_ids=input_ids, labels=input_ids).loss.backward()
    optimizer.remove()

    assert set(calls.values()) == {1}  # one hook call per parameter, tiles summed before it
    for name, parameter in model.named_parameters():
        # SGD with lr 1: the parameter moves by minus the gradient of the plain run.
        expected = reference[name] - plain_grads[name]
        torch.testing.assert_close(parameter.detach(), expected, rtol=1e-6, atol=1e-7, msg=name)


def test_tiled_mlp_lowers_the_tracked_peak_by_most_of_the_mlp_intermediates():
    """Full checkpointing, a long sequence: the recomputed MLP is the peak; tiling removes most of it."""
    seq, hidden, intermediate, tiles = 4096, 32, 512, 8
    model = tiny_llama(hidden=hidden, layers=2, intermediate=intermediate)
    apply_gradient_checkpointing(model, "full")
    model.train()
    input_ids = tokens(1, seq)
    peaks, grads = {}, {}
    for count in (0, tiles):
        apply_tiled_mlp(model, count)
        model.zero_grad(set_to_none=True)
        tracker = MemoryTracker("cpu")
        tracker.attach(model)
        with tracker:
            model(input_ids=input_ids, labels=input_ids).loss.backward()
        peaks[count] = tracker.peak_bytes
        grads[count] = {n: p.grad.clone() for n, p in model.named_parameters()}
        tracker.detach()

    # gate, up and their product (fp32), the plain MLP's saved intermediates of one block
    intermediates = 3 * seq * intermediate * 4
    saved = peaks[0] - peaks[tiles]
    print(f"tracked peak: plain MLP {peaks[0]} B, {tiles} tiles {peaks[tiles]} B, saved {saved} B")
    assert saved > 0.75 * intermediates, (peaks, intermediates)
    assert_same_gradients(grads[tiles], grads[0])


def test_automatic_tiles_and_switching_off(monkeypatch):
    assert tiles_for(AUTO_TILE_TOKENS, None) == 1
    assert tiles_for(AUTO_TILE_TOKENS + 1, None) == 2
    assert tiles_for(100_000, None) == 13
    assert tiles_for(100_000, 0) == 1 and tiles_for(5, 8) == 5

    model = tiny_llama()
    plain = [mlp.forward for mlp in find_mlps(model)]
    assert apply_tiled_mlp(model, None).startswith(f"1 tile per {AUTO_TILE_TOKENS} tokens")
    input_ids = tokens(1, 64)
    seen = []
    original_apply = TiledMLPFunction.apply

    def spy(*args):
        seen.append(args[1])
        return original_apply(*args)

    monkeypatch.setattr(TiledMLPFunction, "apply", spy)
    model(input_ids=input_ids).logits.sum().backward()  # 64 tokens: under the automatic threshold
    assert seen == []
    apply_tiled_mlp(model, 3)
    model(input_ids=input_ids).logits.sum().backward()
    assert seen == [3, 3]
    assert apply_tiled_mlp(model, 0) == "off"
    assert [mlp.forward for mlp in find_mlps(model)] == plain


def test_evaluation_without_a_graph_runs_the_tiles_and_equals_the_plain_mlp():
    model = tiny_llama().eval()
    input_ids = tokens(2, 96)
    with torch.no_grad():
        plain = model(input_ids=input_ids).logits
        apply_tiled_mlp(model, 5)
        tiled = model(input_ids=input_ids).logits
    torch.testing.assert_close(tiled, plain, rtol=1e-5, atol=1e-6)
