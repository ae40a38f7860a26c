"""Every technique on mixture-of-experts models: the update equals the plain run's.

On tiny Qwen3-MoE, gpt-oss and Mixtral models saved by transformers (tests/model_zoo.py), trained through
memfit's real loop with SGD without clipping (a wrong gradient moves the weights by a whole update):
gradient accumulation, OOM recovery (an OOM injected midway through backward), resume from a checkpoint and
full gradient checkpointing (routing recomputed in backward) give the weights of the plain run within 1e-5.
Each has a twin with a 2x gradient error that the same comparison catches. The load-balancing loss is off
(the configs' default, `output_router_logits=False`): it is not linear in the batch (docs/moe.md).
"""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

import model_zoo
from fault_injection import SGD_NO_CLIPPING, largest_update, oom_in_backward_of_linear, scaled_gradients
from memfit.checkpoint_files import list_checkpoints
from memfit.config_loading import load_config
from memfit.train.loop import train

FAMILIES = ["qwen3_moe", "gpt_oss", "mixtral"]
zoo_model_dirs = model_zoo.zoo_model_dirs  # the session fixture


def _config(model_dir, text_file, out, **extra):
    values = dict(
        model=str(model_dir), dataset=str(text_file), seq_len=32, batch_size=4, max_steps=2, packing=False,
        loss_chunk_size=0, output_dir=str(out), lr=1.0, report=False, **SGD_NO_CLIPPING,
    )
    return load_config(overrides=values | extra)


def _weights(result) -> dict[str, torch.Tensor]:
    return load_file(str(result.final_dir / "model.safetensors"))


def _assert_same(reference: dict, weights: dict, atol: float = 1e-5) -> None:
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, atol=atol, rtol=0, msg=name)


@pytest.fixture(scope="module")
def plain(zoo_model_dirs, text_file, tmp_path_factory):
    """family -> (model dir, the plain run's weights after 2 SGD steps of 4 samples)."""
    torch.set_num_threads(1)  # a shared 2-core machine: torch's pool spinning against other runs is 100x slower
    root = tmp_path_factory.mktemp("moe-plain")
    runs = {}
    for family in FAMILIES:
        directory = zoo_model_dirs[family]
        weights = _weights(train(_config(directory, text_file, root / family)))
        assert largest_update(load_file(str(directory / "model.safetensors")), weights) > 1e-3
        runs[family] = (directory, weights)
    return runs


@pytest.mark.parametrize("family", FAMILIES)
def test_accumulation_equals_the_whole_batch(plain, family, text_file, tmp_path):
    directory, reference = plain[family]
    _assert_same(reference, _weights(train(_config(directory, text_file, tmp_path, batch_size=1,
                                                   gradient_accumulation_steps=4))))


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpointing_equals_no_checkpointing(plain, family, text_file, tmp_path):
    directory, reference = plain[family]
    result = train(_config(directory, text_file, tmp_path, gradient_checkpointing="full"))
    assert result.summary["gradient_checkpointing"].startswith("full")
    _assert_same(reference, _weights(result))


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_selective_checkpointing_equals_no_checkpointing(plain, family, text_file, tmp_path):
    directory, reference = plain[family]
    result = train(_config(directory, text_file, tmp_path, gradient_checkpointing="selective"))
    assert result.summary["gradient_checkpointing"].startswith("selective")
    _assert_same(reference, _weights(result))


@pytest.mark.parametrize("family", FAMILIES)
def test_oom_in_backward_is_recovered_exactly(plain, family, text_file, tmp_path):
    """An OOM raised when backward reaches the first block's query projection, for micro-batches above 2."""
    directory, reference = plain[family]
    with oom_in_backward_of_linear(32, 32) as raised:
        result = train(_config(directory, text_file, tmp_path))
    assert raised["n"] >= 1
    _assert_same(reference, _weights(result))


@pytest.mark.parametrize("family", FAMILIES)
def test_resume_equals_the_uninterrupted_run(plain, family, text_file, tmp_path):
    directory, reference = plain[family]
    first = tmp_path / "killed"
    train(_config(directory, text_file, first, save_every=1))
    for checkpoint in list_checkpoints(first):
        if checkpoint.name != "step-1":
            shutil.rmtree(checkpoint)
    shutil.rmtree(first / "final")
    (first / "metrics.jsonl").unlink()
    _assert_same(reference, _weights(train(_config(directory, text_file, first, resume="auto"))))


@pytest.mark.parametrize("technique", ["accumulation", "checkpointing", "oom"])
def test_fault_twins_fail(plain, technique, text_file, tmp_path):
    """A 2x gradient error in the technique's run is caught by the same comparison."""
    directory, reference = plain["qwen3_moe"]
    extra = {"accumulation": dict(batch_size=1, gradient_accumulation_steps=4),
             "checkpointing": dict(gradient_checkpointing="full"), "oom": {}}[technique]
    with scaled_gradients(2.0), (oom_in_backward_of_linear(32, 32) if technique == "oom" else _nothing()):
        result = train(_config(directory, text_file, tmp_path, **extra))
    with pytest.raises(AssertionError):
        _assert_same(reference, _weights(result))


def _nothing():
    import contextlib

    return contextlib.nullcontext()
