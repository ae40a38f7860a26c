"""Memory techniques on encoder tasks, each on a tiny BERT-like and a tiny ESM-like model: the saving measured by
memfit's tracker, the numerics against the plain run, and what cannot apply refused in one line.

Activation techniques (checkpointing every N blocks, selective checkpointing, offloaded checkpoints, mixed
precision) run on long rows, where activations dominate; state techniques (optimizer in backward, 8-bit AdamW,
QLoRA) on short rows of a wider model, where weights, gradients and optimizer state do. Exact techniques are
compared under SGD without clipping (1e-5); inexact ones (bf16, 8-bit state, 4-bit base) within stated tolerances.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from fault_injection import SGD_NO_CLIPPING
from memfit.config_loading import load_config
from memfit.train.loop import train
from memfit.train.metrics import read_metrics
from tiny_encoders import dna_rows, save_encoder, write_csv

FAMILIES = ["bert", "esm"]


@pytest.fixture(scope="module")
def long_csv(tmp_path_factory):
    return write_csv(tmp_path_factory.mktemp("long") / "long.csv", dna_rows(16, seed=1, min_length=180, max_length=250))


@pytest.fixture(scope="module")
def wide_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("wide")
    return {family: save_encoder(root / family, family, hidden=128) for family in FAMILIES}


def _run(model_dir, data, out, seq_len=256, batch_size=8, **extra):
    values = dict(model=str(model_dir), dataset=str(data), task="sequence-classification", seq_len=seq_len,
                  batch_size=batch_size, max_steps=2, lr=0.5, output_dir=str(out), report=False, track_memory=True)
    result = train(load_config(overrides=values | extra))
    steps = [r for r in read_metrics(out / "metrics.jsonl") if "event" not in r and "tracked_peak_bytes" in r]
    return result, steps


def _peak(steps) -> int:
    return max(r["tracked_peak_bytes"] for r in steps)


def _weights(result) -> dict[str, torch.Tensor]:
    return load_file(str(result.final_dir / "model.safetensors"))


def _max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[name].float() - b[name].float()).abs().max()) for name in a)


@pytest.fixture(scope="module")
def plain_long(encoder_dirs, long_csv, tmp_path_factory):
    root = tmp_path_factory.mktemp("plain-long")
    return {family: _run(encoder_dirs[family], long_csv, root / family, **SGD_NO_CLIPPING) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("technique", "settings", "most"), [
    ("checkpoint every 2nd block", dict(gradient_checkpointing="full", checkpoint_every=2), 0.8),
    ("selective checkpointing", dict(gradient_checkpointing="selective"), 0.9),
    ("offloaded checkpoints", dict(gradient_checkpointing="full", activation_offload=True), 0.8),
])
def test_activation_techniques_save_tracked_bytes_with_the_same_update(plain_long, encoder_dirs, long_csv, tmp_path,
                                                                       family, technique, settings, most):
    plain, plain_steps = plain_long[family]
    result, steps = _run(encoder_dirs[family], long_csv, tmp_path, **SGD_NO_CLIPPING, **settings)
    assert result.summary["gradient_checkpointing"] != "off", technique
    assert _peak(steps) < most * _peak(plain_steps), (technique, _peak(steps), _peak(plain_steps))
    assert _max_difference(_weights(plain), _weights(result)) < 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_mixed_precision_saves_activation_bytes_and_stays_close(plain_long, encoder_dirs, long_csv, tmp_path, family):
    plain, plain_steps = plain_long[family]
    result, steps = _run(encoder_dirs[family], long_csv, tmp_path, precision="amp", **SGD_NO_CLIPPING)
    assert result.summary["precision"] == "bf16"
    assert steps[-1]["tracked_breakdown"]["activations"] < 0.8 * plain_steps[-1]["tracked_breakdown"]["activations"]
    assert result.losses[0] == pytest.approx(plain.losses[0], rel=2e-2)
    assert _max_difference(_weights(plain), _weights(result)) < 5e-2  # bf16 matmuls, fp32 weights


@pytest.fixture(scope="module")
def plain_adamw(wide_dirs, dna_csv, tmp_path_factory):
    root = tmp_path_factory.mktemp("plain-adamw")
    return {family: _run(wide_dirs[family], dna_csv, root / family, seq_len=64, batch_size=2, lr=1e-3,
                         max_grad_norm=0.0) for family in FAMILIES}


@pytest.mark.parametrize("family", FAMILIES)
def test_optimizer_in_backward_frees_gradients_with_the_same_update(plain_adamw, wide_dirs, dna_csv, tmp_path, family):
    plain, plain_steps = plain_adamw[family]
    result, steps = _run(wide_dirs[family], dna_csv, tmp_path, seq_len=64, batch_size=2, lr=1e-3, max_grad_norm=0.0,
                         optimizer_in_backward=True)
    assert "in backward" in result.summary["optimizer"]
    # AdamW's step holds every gradient at once; in backward each is applied and freed as it is ready.
    assert _peak(steps) < _peak(plain_steps) - 0.25 * 4 * _parameters(wide_dirs[family]), (_peak(steps), _peak(plain_steps))
    assert _max_difference(_weights(plain), _weights(result)) < 1e-5


def _parameters(model_dir) -> int:
    return sum(t.numel() for t in load_file(str(model_dir / "model.safetensors")).values())


@pytest.mark.parametrize("family", FAMILIES)
def test_8bit_adamw_keeps_smaller_state_and_close_weights(plain_adamw, wide_dirs, dna_csv, tmp_path, family):
    pytest.importorskip("bitsandbytes")
    plain, plain_steps = plain_adamw[family]
    result, steps = _run(wide_dirs[family], dna_csv, tmp_path, seq_len=64, batch_size=2, lr=1e-3, max_grad_norm=0.0,
                         optimizer="adamw-8bit")
    assert result.summary["optimizer"].startswith("adamw-8bit")
    state = steps[-1]["tracked_breakdown"]["optimizer_states"]
    assert 0 < state < 0.5 * plain_steps[-1]["tracked_breakdown"]["optimizer_states"]
    assert _max_difference(_weights(plain), _weights(result)) < 5e-3  # lr 1e-3, two steps: 8-bit moments, same sign


def test_paged_8bit_adamw_without_cuda_falls_back_visibly(wide_dirs, dna_csv, tmp_path):
    pytest.importorskip("bitsandbytes")
    result, _ = _run(wide_dirs["esm"], dna_csv, tmp_path, seq_len=64, batch_size=2, optimizer="paged-adamw-8bit")
    assert "paged optimizers need CUDA" in result.summary["fallbacks"]["optimizer"]


@pytest.mark.parametrize("family", FAMILIES)
def test_qlora_quantizes_the_base_and_trains_the_new_head_in_full(wide_dirs, dna_csv, tmp_path, family):
    pytest.importorskip("bitsandbytes")
    lora, lora_steps = _run(wide_dirs[family], dna_csv, tmp_path / "lora", seq_len=64, batch_size=2, lora_r=4,
                            **SGD_NO_CLIPPING)
    qlora, qlora_steps = _run(wide_dirs[family], dna_csv, tmp_path / "qlora", seq_len=64, batch_size=2, lora_r=4,
                              quantize="4bit", **SGD_NO_CLIPPING)
    weights = qlora_steps[-1]["tracked_breakdown"]["parameters"]
    assert weights < 0.5 * lora_steps[-1]["tracked_breakdown"]["parameters"], (weights,)
    adapter = load_file(str(qlora.final_dir / "adapter_model.safetensors"))
    head = [name for name in adapter if "classifier" in name and "lora_" not in name]
    assert head and any("lora_" in name for name in adapter)
    assert all(adapter[name].dtype == torch.float32 for name in head)  # kept out of the 4-bit quantization
    assert qlora.losses[0] == pytest.approx(lora.losses[0], abs=0.05)  # a 4-bit base: the same model, rounded


@pytest.mark.parametrize("family", FAMILIES)
def test_tiled_mlp_runs_through_the_command_on_the_layers_feed_forward(encoder_dirs, dna_csv, tmp_path, family,
                                                                       warm_memfit):
    """BERT and ESM compute their feed-forward in the layer's own method: the command tiles it
    (numerics and the saving: test_encoder_tiled_mlp.py)."""
    # forked from the warm server (tests/memfit_cli.py): the real command, without a fresh import
    run = warm_memfit.run("train", "--model", str(encoder_dirs[family]), "--task", "sequence-classification",
                          "--dataset", str(dna_csv), "--max-steps", "1", "--seq-len", "64", "--tiled-mlp", "4",
                          "--no-report", "--output-dir", str(tmp_path / "out"))
    assert run.returncode == 0, run.stderr[-2000:]
    assert "tiled MLP: 4 tiles on 2 MLPs" in run.stderr


def test_tiled_mlp_is_refused_where_the_blocks_have_neither_an_mlp_module_nor_a_feed_forward_method(
        dna_csv, tmp_path, warm_memfit):
    """DeBERTa-v2 calls its intermediate and output inline in the layer's forward: nothing to tile through."""
    from transformers import DebertaV2Config, DebertaV2ForMaskedLM

    from tiny_encoders import SPECIALS, dna_tokenizer

    model_dir = tmp_path / "deberta"
    torch.manual_seed(0)
    DebertaV2ForMaskedLM(DebertaV2Config(vocab_size=len(SPECIALS) + 5, hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
                                         pad_token_id=0)).save_pretrained(model_dir, safe_serialization=True)
    dna_tokenizer().save_pretrained(model_dir)
    run = warm_memfit.run("train", "--model", str(model_dir), "--task", "sequence-classification",
                          "--dataset", str(dna_csv), "--max-steps", "1", "--seq-len", "64", "--tiled-mlp", "4",
                          "--no-report", "--output-dir", str(tmp_path / "out"))
    assert run.returncode == 2, run.stderr[-2000:]
    assert "--tiled-mlp 4: the blocks of" in run.stderr and "nor a feed_forward_chunk method" in run.stderr
    assert "Traceback" not in run.stderr
    assert not (tmp_path / "out").exists()
