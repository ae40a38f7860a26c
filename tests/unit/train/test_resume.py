"""A run interrupted and resumed from its checkpoint continues exactly like an uninterrupted one."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from memfit.config_loading import load_config
from memfit.checkpoint_files import list_checkpoints
from memfit.errors import UsageError
from memfit.train.loop import train


def _config(llama_dir, text_file, out, **extra):
    values = dict(
        model=str(llama_dir), dataset=str(text_file), seq_len=64, batch_size=4, gradient_accumulation_steps=2,
        max_steps=6, lr=3e-3, warmup_steps=2, output_dir=str(out),
    )
    return load_config(overrides=values | extra)


def test_resumed_losses_equal_uninterrupted(llama_dir, text_file, tmp_path):
    straight = train(_config(llama_dir, text_file, tmp_path / "straight"))
    # First leg: stop after 3 steps (a checkpoint at step 3), then resume to 6.
    train(_config(llama_dir, text_file, tmp_path / "resumed", max_steps=6, save_every=3), )
    # Simulate the kill: keep only the step-3 checkpoint, as if the run died after it.
    resumed_dir = tmp_path / "resumed"
    for checkpoint in list_checkpoints(resumed_dir):
        if checkpoint.name != "step-3":
            import shutil

            shutil.rmtree(checkpoint)
    (resumed_dir / "metrics.jsonl").unlink()
    resumed = train(_config(llama_dir, text_file, resumed_dir, resume="auto"))
    assert resumed.steps == 6
    assert resumed.losses == pytest.approx(straight.losses[3:], abs=1e-6)
    a = load_file(str(straight.final_dir / "model.safetensors"))
    b = load_file(str(resumed.final_dir / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0)
    state = json.loads((list_checkpoints(resumed_dir)[-1] / "trainer_state.json").read_text())
    assert state["step"] == 6 and state["micro_batch_size"] == 4


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
            import shutil

            shutil.rmtree(checkpoint)
    saved = load_file(str(list_checkpoints(tmp_path / "resumed")[-1] / "model.safetensors"))
    assert saved and all("lora_" in name for name in saved)  # only the adapter is checkpointed
    resumed = train(_config(llama_dir, text_file, tmp_path / "resumed", resume="auto", **lora))
    assert resumed.losses == pytest.approx(straight.losses[2:], abs=1e-6)
    assert (resumed.final_dir / "adapter_model.safetensors").is_file()
