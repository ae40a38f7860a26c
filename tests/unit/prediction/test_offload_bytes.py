"""What activation offload really moves over the host link against the estimate's `pcie_bytes_per_micro_batch`.

One optimizer step of a small saved Llama runs through memfit's own step (`StepRunner`, in training mode as
the loop puts it) inside `ActivationOffload`, which counts the bytes it copies; the estimate must say the same
within 10 %, loss chunked and unchunked. Before the unchunked loss's fp32 log-softmax was counted at 4 bytes
(it was counted in the compute dtype), a bf16 run moved 1.5x the estimate here and 1.78x on an H100.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memfit.config_loading import load_config
from memfit.models.tiny import byte_tokenizer
from memfit.prediction.activations import Precision, architecture_of, offloaded_head_bytes
from memfit.prediction.estimator import estimate
from memfit.techniques.offload import ActivationOffload
from memfit.train.setup import build_session
from memfit.train.step import StepRunner

SEQ = 512  # hidden 128 at 512 tokens: a block input is 128 KiB in bf16, above the offload's 64 KiB floor


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("offload_bytes_llama")
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
                         eos_token_id=256, pad_token_id=256, bos_token_id=256)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)
    byte_tokenizer().save_pretrained(directory)
    return directory


def _config(model_dir: Path, tmp_path: Path, changes: dict):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("memory gradient batch token model layer training offload\n" * 200)
    return load_config(overrides={
        "model": str(model_dir), "dataset": str(corpus), "seq_len": SEQ, "batch_size": 1, "max_steps": 1,
        "output_dir": str(tmp_path / "run"), "report": False, "gradient_checkpointing": "full",
        "activation_offload": True, "tiled_mlp": 0, **changes,
    })


def _moved_per_micro_batch(config) -> tuple[int, float]:
    """(bytes the offload copied out and back in one step of one micro-batch, the estimate's figure)."""
    session = build_session(config)
    session.model.train()  # as the training loop does: checkpointing runs in training mode only
    samples = session.task.prepare([session.dataset[0]], [0], 0)
    offload = ActivationOffload(session.model, device=session.device)
    runner = StepRunner.from_session(session)
    try:
        with offload:
            runner.run(samples)
    finally:
        runner.close()
    predicted = estimate(config, hf_config=session.model.config).details["pcie_bytes_per_micro_batch"]
    return 2 * offload.offloaded_bytes, predicted  # out in forward, back in backward


CASES = {
    "bf16, loss unchunked": {"dtype": "bf16", "precision": "bf16", "loss_chunk_size": 0},
    "bf16, loss chunked": {"dtype": "bf16", "precision": "bf16", "loss_chunk_size": 256},
    "bf16 autocast over fp32, loss unchunked": {"dtype": "fp32", "precision": "bf16", "loss_chunk_size": 0},
}


@pytest.mark.parametrize("name", list(CASES))
def test_offloaded_bytes_match_the_estimate(name, model_dir, tmp_path):
    moved, predicted = _moved_per_micro_batch(_config(model_dir, tmp_path, CASES[name]))
    assert moved > 0
    assert abs(predicted / moved - 1) <= 0.10, (name, moved, predicted)


def test_unchunked_loss_sends_its_fp32_log_softmax_whatever_the_compute_dtype(model_dir):
    """The twin of the fault the H100 run showed: the log-softmax counted at 2 bytes instead of 4."""
    arch = architecture_of(LlamaConfig.from_pretrained(model_dir))
    tokens = 4096
    for precision in (Precision(compute=2, residual=2, efficient_norm=True),
                      Precision(compute=4, residual=4, efficient_norm=True)):
        unchunked = offloaded_head_bytes(arch, precision, tokens, unchunked_loss=True)
        chunked = offloaded_head_bytes(arch, precision, tokens, unchunked_loss=False)
        # the head's input changes dtype (compute instead of residual: equal here); the rest is the log-softmax
        assert unchunked - chunked == 4 * arch.vocab * tokens
