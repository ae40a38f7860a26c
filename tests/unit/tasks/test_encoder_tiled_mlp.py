"""Tiled MLP on encoder layers that compute their feed-forward in a method (BERT's and ESM's feed_forward_chunk).

The feed-forward (dense -> GELU -> dense -> dropout -> LayerNorm with the residual; ESM: a LayerNorm first) acts on
each token alone, so over 4 tiles it gives the plain loss and gradients (fp32; with dropout on, the recompute replays
the forward's masks), while its intermediates (tokens x intermediate) are no longer kept for backward: the
tracker's peak drops by most of them. The checks have twins that must fail: a doubled tile gradient, and a
feed-forward parameter left out of the tiled function (it would get no gradient from the recompute).
"""

from __future__ import annotations

import random

import pytest
import torch
from safetensors.torch import load_file
from transformers import BertForMaskedLM, BertForSequenceClassification, EsmForMaskedLM, EsmForSequenceClassification

from fault_injection import SGD_NO_CLIPPING
from memfit.config_loading import load_config
from memfit.techniques import tiled_mlp
from memfit.techniques.tiled_mlp import LayerFeedForward, TiledMLPFunction, apply_tiled_mlp, find_mlps
from memfit.train.loop import train
from memfit.train.metrics import read_metrics
from tiny_encoders import bert_config, dna_tokenizer, esm_config, write_csv

FAMILIES = ["bert", "esm"]
HIDDEN, INTERMEDIATE, LAYERS = 32, 512, 2
SEQ_LEN = 1024
TILES = 4
FEED_FORWARD_PARAMETERS = {
    "bert": ["intermediate.dense.weight", "intermediate.dense.bias", "output.dense.weight", "output.dense.bias",
             "output.LayerNorm.weight", "output.LayerNorm.bias"],
    "esm": ["LayerNorm.weight", "LayerNorm.bias", "intermediate.dense.weight", "intermediate.dense.bias",
            "output.dense.weight", "output.dense.bias"],
}
"""What each layer's feed-forward uses: exactly these, no attention parameter, reach the tiled function."""


def _config(family: str, dropout: float = 0.0):
    config = (bert_config if family == "bert" else esm_config)(layers=LAYERS, hidden=HIDDEN, max_positions=SEQ_LEN)
    config.intermediate_size = INTERMEDIATE  # the feed-forward's intermediates dominate a long row's activations
    config.hidden_dropout_prob = config.attention_probs_dropout_prob = dropout
    config.num_labels = 3
    return config


def _classifier(family: str, dropout: float = 0.0) -> torch.nn.Module:
    torch.manual_seed(0)
    model_class = BertForSequenceClassification if family == "bert" else EsmForSequenceClassification
    return model_class(_config(family, dropout)).train()


def _loss_and_grads(model, input_ids, seed: int = 7):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)  # the dropout masks of the forward
    loss = model(input_ids=input_ids, labels=torch.arange(input_ids.shape[0]) % 3).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same_gradients(actual: dict, expected: dict, rtol: float = 1e-5) -> None:
    assert actual.keys() == expected.keys()
    for name, grad in expected.items():
        # the tiles sum a weight's gradient in another order: compare each tensor as a whole
        error = ((actual[name] - grad).norm() / grad.norm()).item()
        assert error < rtol, (name, error)


def _ids(batch: int, seq: int) -> torch.Tensor:
    return torch.randint(5, 10, (batch, seq), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", FAMILIES)
def test_the_feed_forward_of_each_layer_is_found_with_exactly_its_parameters(family):
    model = _classifier(family)
    found = find_mlps(model)
    assert len(found) == LAYERS and all(isinstance(module, LayerFeedForward) for module in found)
    for layer, feed_forward in zip(model.base_model.encoder.layer, found, strict=True):
        own = dict(layer.named_parameters())
        assert sorted(n for n, _ in feed_forward.named_parameters()) == sorted(FEED_FORWARD_PARAMETERS[family])
        assert all(p is own[n] for n, p in feed_forward.named_parameters())  # the layer's, not copies
    names = list(model.state_dict())
    assert apply_tiled_mlp(model, TILES) == f"{TILES} tiles on {LAYERS} MLPs"
    assert list(model.state_dict()) == names  # the layer's tree is unchanged: checkpoints load as before
    assert apply_tiled_mlp(model, 0) == "off"
    assert all("feed_forward_chunk" not in layer.__dict__ for layer in model.base_model.encoder.layer)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dropout", [0.0, 0.2], ids=["no dropout", "dropout"])
def test_tiled_feed_forward_gives_the_plain_loss_and_gradients(family, dropout, monkeypatch):
    """With dropout the recompute must draw the forward's masks again (a fresh draw would change every gradient).

    One row: the CPU generator draws a tile's mask as the next stretch of the whole row's, so the tiled
    forward's masks are the plain forward's and the two runs compare with dropout on.
    """
    model = _classifier(family, dropout)
    input_ids = _ids(1, 400)
    plain_loss, plain_grads = _loss_and_grads(model, input_ids)
    apply_tiled_mlp(model, TILES)
    given = []
    original = TiledMLPFunction.apply

    def spy(*args):
        given.append({id(p) for p in args[4:]})
        return original(*args)

    monkeypatch.setattr(TiledMLPFunction, "apply", spy)
    tiled_loss, tiled_grads = _loss_and_grads(model, input_ids)
    assert len(given) == LAYERS
    for layer, parameters in zip(model.base_model.encoder.layer, given, strict=True):
        own = dict(layer.named_parameters())
        assert parameters == {id(own[name]) for name in FEED_FORWARD_PARAMETERS[family]}
    torch.testing.assert_close(tiled_loss, plain_loss, rtol=1e-6, atol=0)
    _assert_same_gradients(tiled_grads, plain_grads)
    if dropout:  # the masks matter: another seed gives other gradients
        _, other = _loss_and_grads(model, input_ids, seed=8)
        with pytest.raises(AssertionError):
            _assert_same_gradients(other, plain_grads)


def _doubled_tile_gradients(monkeypatch):
    backward = TiledMLPFunction.backward

    def doubled(ctx, grad_output):
        return tuple(None if g is None else 2 * g for g in backward(ctx, grad_output))

    monkeypatch.setattr(TiledMLPFunction, "backward", staticmethod(doubled))


def _last_parameter_left_out(monkeypatch):
    """The bug the parameter selection guards against: a feed-forward parameter not handed to the tiled function."""
    original = TiledMLPFunction.apply
    monkeypatch.setattr(TiledMLPFunction, "apply", lambda *args: original(*args[:-1]))


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("fault", [_doubled_tile_gradients, _last_parameter_left_out], ids=["doubled", "left out"])
def test_the_gradient_comparison_fails_on_a_faulty_tiling(family, fault, monkeypatch):
    model = _classifier(family, dropout=0.2)
    input_ids = _ids(1, 400)
    _, plain_grads = _loss_and_grads(model, input_ids)
    apply_tiled_mlp(model, TILES)
    fault(monkeypatch)
    _, tiled_grads = _loss_and_grads(model, input_ids)
    with pytest.raises(AssertionError):
        _assert_same_gradients(tiled_grads, plain_grads)


def test_modernbert_keeps_its_mlp_module_tiled_as_before():
    from transformers import ModernBertConfig, ModernBertForSequenceClassification

    config = ModernBertConfig(vocab_size=10, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, max_position_embeddings=512, pad_token_id=0, num_labels=3,
                              global_attn_every_n_layers=1, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = ModernBertForSequenceClassification(config).train()
    found = find_mlps(model)
    assert [type(m).__name__ for m in found] == ["ModernBertMLP"] * 2
    input_ids = _ids(1, 256)
    plain_loss, plain_grads = _loss_and_grads(model, input_ids)
    apply_tiled_mlp(model, TILES)
    tiled_loss, tiled_grads = _loss_and_grads(model, input_ids)
    torch.testing.assert_close(tiled_loss, plain_loss, rtol=1e-6, atol=0)
    _assert_same_gradients(tiled_grads, plain_grads)


def test_a_layer_with_neither_an_mlp_module_nor_a_feed_forward_method_has_nothing_to_tile():
    """DeBERTa-v2 calls its intermediate and output inline in the layer's forward: no seam to tile through."""
    from transformers import DebertaV2Config, DebertaV2ForSequenceClassification

    model = DebertaV2ForSequenceClassification(DebertaV2Config(
        vocab_size=10, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4))
    assert find_mlps(model) == []
    assert apply_tiled_mlp(model, TILES) == "off (no MLP found in the blocks)"


# ---------------------------------------------------------------------------
# Through `memfit train`: the tracker's peak and the update
# ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def long_encoders(tmp_path_factory):
    """Saved tiny masked LMs (intermediate 512) and a table of rows that fill --seq-len 1024 exactly."""
    root = tmp_path_factory.mktemp("long-encoders")
    dirs = {}
    for family in FAMILIES:
        torch.manual_seed(0)
        model = (BertForMaskedLM if family == "bert" else EsmForMaskedLM)(_config(family))
        model.save_pretrained(root / family, safe_serialization=True)
        dna_tokenizer().save_pretrained(root / family)
        dirs[family] = root / family
    rng = random.Random(0)
    rows = [{"sequence": "".join(rng.choice("ACGT") for _ in range(SEQ_LEN - 2)), "label": "abc"[i % 3]}
            for i in range(4)]
    return dirs, write_csv(root / "long.csv", rows)


def _train(model_dir, table, out, **extra):
    values = dict(model=str(model_dir), dataset=str(table), task="sequence-classification", seq_len=SEQ_LEN,
                  batch_size=2, max_steps=2, lr=0.5, output_dir=str(out), report=False, track_memory=True,
                  **SGD_NO_CLIPPING)
    result = train(load_config(overrides=values | extra))
    steps = [r for r in read_metrics(out / "metrics.jsonl") if "event" not in r and "tracked_peak_bytes" in r]
    return load_file(str(result.final_dir / "model.safetensors")), max(r["tracked_peak_bytes"] for r in steps)


def feed_forward_intermediates(family: str, tokens: int) -> int:
    """fp32 bytes of what every layer's feed-forward keeps beyond its input, untiled: BERT's dense output (the
    GELU's input) and GELU output; ESM's written-out GELU keeps three tensors beside its output."""
    per_layer = (2 if family == "bert" else 4) * tokens * INTERMEDIATE * 4
    return LAYERS * per_layer


@pytest.mark.parametrize("family", FAMILIES)
def test_tiled_mlp_lowers_the_tracked_peak_of_a_training_run_with_the_same_update(long_encoders, tmp_path, family):
    dirs, table = long_encoders
    plain, plain_peak = _train(dirs[family], table, tmp_path / "plain")
    tiled, tiled_peak = _train(dirs[family], table, tmp_path / "tiled", tiled_mlp=TILES)
    intermediates = feed_forward_intermediates(family, 2 * SEQ_LEN)
    saved = plain_peak - tiled_peak
    print(f"{family}: tracked peak {plain_peak} B plain, {tiled_peak} B over {TILES} tiles: saved {saved} B "
          f"of {intermediates} B of feed-forward intermediates")
    # the recompute holds one tile's intermediates and their gradients (1.5 x a quarter) at a time
    assert saved > 0.6 * intermediates, (saved, intermediates)
    assert plain.keys() == tiled.keys()
    assert max(float((plain[k] - tiled[k]).abs().max()) for k in plain) < 1e-5


def test_a_tiling_bug_in_training_is_seen_by_the_weights_check(long_encoders, tmp_path, monkeypatch):
    """The weights check above fails when the tiles' gradients are doubled."""
    dirs, table = long_encoders
    plain, _ = _train(dirs["bert"], table, tmp_path / "plain", max_steps=1)
    _doubled_tile_gradients(monkeypatch)
    tiled, _ = _train(dirs["bert"], table, tmp_path / "tiled", max_steps=1, tiled_mlp=TILES)
    assert max(float((plain[k] - tiled[k]).abs().max()) for k in plain) > 1e-3


def test_tiles_are_recomputed_by_the_module_the_layer_calls(monkeypatch):
    """transformers' apply_chunking_to_forward counts the parameters of feed_forward_chunk: the replacement keeps one."""
    model = _classifier("bert")
    for layer in model.base_model.encoder.layer:
        layer.chunk_size_feed_forward = 100  # transformers' own chunking around the tiled feed-forward
    input_ids = _ids(1, 400)
    plain_loss, plain_grads = _loss_and_grads(model, input_ids)
    calls = []
    monkeypatch.setattr(tiled_mlp, "_call_feed_forward",
                        lambda module, x: calls.append(x.shape[-2]) or module(x))
    apply_tiled_mlp(model, TILES)
    tiled_loss, tiled_grads = _loss_and_grads(model, input_ids)
    assert calls == [100] * 4 * LAYERS
    torch.testing.assert_close(tiled_loss, plain_loss, rtol=1e-6, atol=0)
    _assert_same_gradients(tiled_grads, plain_grads)


def test_compiled_layers_run_the_tiled_feed_forward_outside_compiled_code():
    """--compile around a tiled BERT layer compiles its children apart (the tiling's autograd function cannot be
    traced), and the tiles run the compiled intermediate and output: the same loss and gradients."""
    from memfit.techniques.compile import compile_blocks

    model = _classifier("bert")
    input_ids = _ids(1, 256)
    plain_loss, plain_grads = _loss_and_grads(model, input_ids)
    apply_tiled_mlp(model, TILES)
    choice = compile_blocks(model, torch.device("cpu"), backend="aot_eager")
    assert "each child and each MLP tile compiled apart" in choice.description
    tiled_loss, tiled_grads = _loss_and_grads(model, input_ids)
    torch.testing.assert_close(tiled_loss, plain_loss, rtol=1e-6, atol=0)
    _assert_same_gradients(tiled_grads, plain_grads)
