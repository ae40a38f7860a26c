"""A run interrupted and resumed from its checkpoint continues exactly like an uninterrupted one."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from fault_injection import largest_update, scaled_gradients
from memfit.checkpoint_files import list_checkpoints
from memfit.config_loading import load_config
from memfit.errors import UsageError
from memfit.train.loop import train


def _config(llama_dir, text_file, out, **extra):
    values = dict(
        model=str(llama_dir), dataset=str(text_file), seq_len=64, batch_size=4, gradient_accumulation_steps=2,
        max_steps=6, lr=3e-3, warmup_steps=2, output_dir=str(out),
    )
    return load_config(overrides=values | extra)


# SGD with momentum, no clipping: the resumed run must restore the momentum buffers and the
# schedule's position exactly, and a wrong gradient scale changes the weights.
SGD_MOMENTUM = dict(optimizer="sgd", momentum=0.9, max_grad_norm=0.0, lr=0.3, warmup_steps=2, lr_schedule="cosine")


def _keep_only(output_dir, name: str) -> None:
    """What a run killed right after checkpoint `name` leaves (and no metrics of later steps)."""
    for checkpoint in list_checkpoints(output_dir):
        if checkpoint.name != name:
            shutil.rmtree(checkpoint)
    shutil.rmtree(output_dir / "final", ignore_errors=True)
    (output_dir / "metrics.jsonl").unlink()


def _assert_same(a: dict, b: dict) -> None:
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0, msg=name)


@pytest.fixture(scope="module")
def straight_and_checkpointed(llama_dir, text_file, tmp_path_factory):
    """An uninterrupted 6-step SGD run, and a copy of its step-3 checkpoint as a killed run would leave it."""
    root = tmp_path_factory.mktemp("resume")
    straight = train(_config(llama_dir, text_file, root / "straight", save_every=3, **SGD_MOMENTUM))
    shutil.copytree(root / "straight", root / "killed")
    _keep_only(root / "killed", "step-3")
    return straight, root / "killed"


def _resume(llama_dir, text_file, checkpointed, out):
    shutil.copytree(checkpointed, out)
    return train(_config(llama_dir, text_file, out, resume="auto", **SGD_MOMENTUM))


def test_resumed_losses_equal_uninterrupted(straight_and_checkpointed, llama_dir, text_file, tmp_path):
    straight, checkpointed = straight_and_checkpointed
    initial = load_file(str(llama_dir / "model.safetensors"))
    final = load_file(str(straight.final_dir / "model.safetensors"))
    assert largest_update(initial, final) > 1e-2  # large beside the tolerance
    resumed = _resume(llama_dir, text_file, checkpointed, tmp_path / "resumed")
    assert resumed.steps == 6
    assert resumed.losses == pytest.approx(straight.losses[3:], abs=1e-6)
    _assert_same(final, load_file(str(resumed.final_dir / "model.safetensors")))
    state = json.loads((list_checkpoints(tmp_path / "resumed")[-1] / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["micro_batch_size"] == 4


def test_resume_check_fails_on_a_2x_gradient_error(straight_and_checkpointed, llama_dir, text_file, tmp_path):
    straight, checkpointed = straight_and_checkpointed
    with scaled_gradients(2.0):
        resumed = _resume(llama_dir, text_file, checkpointed, tmp_path / "resumed")
    with pytest.raises(AssertionError):
        _assert_same(load_file(str(straight.final_dir / "model.safetensors")),
                     load_file(str(resumed.final_dir / "model.safetensors")))


def test_half_written_checkpoint_is_ignored(llama_dir, text_file, tmp_path):
    train(_config(llama_dir, text_file, tmp_path, max_steps=2))
    complete = list_checkpoints(tmp_path)
    (tmp_path / "checkpoints" / ".tmp-step-9-123").mkdir()  # what a kill during a save leaves
    (tmp_path / "checkpoints" / "step-10").mkdir()  # no trainer_state.json: never completed
    assert list_checkpoints(tmp_path) == complete


def test_corrupt_checkpoint_is_a_clear_error(llama_dir, text_file, tmp_path):
    train(_config(llama_dir, text_file, tmp_path, max_steps=2))
    latest = list_checkpoints(tmp_path)[-1]
    (latest / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(UsageError, match="damaged"):
        train(_config(llama_dir, text_file, tmp_path, max_steps=3, resume="auto"))


def test_lora_run_resumes_from_its_adapter_checkpoint(llama_dir, text_file, tmp_path):
    pytest.importorskip("peft")
    lora = dict(lora_r=4, max_steps=4)
    straight = train(_config(llama_dir, text_file, tmp_path / "straight", **lora))
    train(_config(llama_dir, text_file, tmp_path / "resumed", save_every=2, **lora))
    for checkpoint in list_checkpoints(tmp_path / "resumed"):
        if checkpoint.name != "step-2":
            shutil.rmtree(checkpoint)
    saved = load_file(str(list_checkpoints(tmp_path / "resumed")[-1] / "model.safetensors"))
    assert saved and all("lora_" in name for name in saved)  # only the adapter is checkpointed
    resumed = train(_config(llama_dir, text_file, tmp_path / "resumed", resume="auto", **lora))
    assert resumed.losses == pytest.approx(straight.losses[2:], abs=1e-6)
    assert (resumed.final_dir / "adapter_model.safetensors").is_file()
