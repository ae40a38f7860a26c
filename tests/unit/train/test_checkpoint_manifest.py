"""Checkpoints carry a manifest; --resume auto skips a damaged newest one; retention keeps the newest N and the best."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file

from fault_injection import SGD_NO_CLIPPING
from memfit.checkpoint_files import checkpoint_problem, list_checkpoints, prune_checkpoints, resolve_resume
from memfit.config_loading import load_config
from memfit.errors import UsageError
from memfit.train.loop import train


def _config(llama_dir, text_file, out, **extra):
    values = dict(model=str(llama_dir), dataset=str(text_file), seq_len=64, batch_size=2, gradient_accumulation_steps=2,
                  max_steps=4, lr=0.3, output_dir=str(out), report=False, loss_chunk_size=0, **SGD_NO_CLIPPING)
    return load_config(overrides=values | extra)


@pytest.fixture(scope="module")
def saved_run(llama_dir, text_file, tmp_path_factory):
    """A 4-step run that kept every checkpoint (--save-every 1 --save-total-limit 0)."""
    out = tmp_path_factory.mktemp("manifest") / "run"
    train(_config(llama_dir, text_file, out, save_every=1, save_total_limit=0))
    return out


def _copy(saved_run, tmp_path):
    shutil.copytree(saved_run, tmp_path / "run")
    return tmp_path / "run"


def test_every_checkpoint_has_a_manifest_of_its_files(saved_run):
    checkpoints = list_checkpoints(saved_run)
    assert [c.name for c in checkpoints] == ["step-1", "step-2", "step-3", "step-4"]
    manifest = json.loads((checkpoints[-1] / "manifest.json").read_text())
    on_disk = {p.name for p in checkpoints[-1].iterdir()} - {"manifest.json"}
    assert set(manifest["files"]) == on_disk and "trainer_state.json" in on_disk
    assert manifest["torch_version"] == torch.__version__ and manifest["memfit_version"]
    assert manifest["config"]["output"]["save_total_limit"] == 0
    assert all(checkpoint_problem(c) is None for c in checkpoints)


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_newest_checkpoint_is_skipped_for_the_previous_one(saved_run, tmp_path, damage, caplog):
    run = _copy(saved_run, tmp_path)
    newest = list_checkpoints(run)[-1] / ("optimizer.pt" if damage == "delete" else "model.safetensors")
    data = newest.read_bytes()
    if damage == "truncate":
        newest.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        position = len(data) - 100  # inside a weight: the file still parses, only the checksum can tell
        newest.write_bytes(data[:position] + bytes([data[position] ^ 0x01]) + data[position + 1 :])
    else:
        newest.unlink()
    with caplog.at_level(logging.WARNING, logger="memfit"):
        assert resolve_resume("auto", run) == list_checkpoints(run)[-2]
    lines = [r.getMessage() for r in caplog.records if "damaged" in r.getMessage()]
    assert len(lines) == 1 and "step-4" in lines[0] and newest.name in lines[0], lines


def test_every_checkpoint_damaged_is_one_clear_error(saved_run, tmp_path):
    run = _copy(saved_run, tmp_path)
    for checkpoint in list_checkpoints(run):
        (checkpoint / "rng.pt").write_bytes(b"x")
    with pytest.raises(UsageError, match="every checkpoint .* is damaged"):
        resolve_resume("auto", run)
    with pytest.raises(UsageError, match="rng.pt has 1 bytes"):
        resolve_resume(str(list_checkpoints(run)[0]), run)


def test_run_resumed_past_a_damaged_checkpoint_ends_where_the_straight_run_ends(saved_run, llama_dir, text_file, tmp_path):
    run = _copy(saved_run, tmp_path)
    shutil.rmtree(run / "final")
    (list_checkpoints(run)[-1] / "model.safetensors").write_bytes(b"cut short")
    result = train(_config(llama_dir, text_file, run, resume="auto"))
    assert result.steps == 4 and len(result.losses) == 1  # resumed at step 3, ran step 4 again
    straight, resumed = load_file(str(saved_run / "final" / "model.safetensors")), load_file(str(result.final_dir / "model.safetensors"))
    for name, tensor in straight.items():
        assert torch.equal(resumed[name], tensor), name


def test_retention_keeps_the_newest_and_the_best(saved_run, tmp_path):
    run = _copy(saved_run, tmp_path)
    (run / "best.json").write_text(json.dumps({"step": 1, "eval_loss": 3.0}))
    deleted = prune_checkpoints(run, keep_last=2)
    assert [c.name for c in deleted] == ["step-2"]
    assert [c.name for c in list_checkpoints(run)] == ["step-1", "step-3", "step-4"]


def test_save_total_limit_is_applied_only_after_the_new_checkpoint_is_complete(llama_dir, text_file, tmp_path):
    train(_config(llama_dir, text_file, tmp_path / "run", save_every=1, save_total_limit=1))
    assert [c.name for c in list_checkpoints(tmp_path / "run")] == ["step-4"]
    assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))


def test_resume_with_another_micro_batch_split_is_allowed_and_a_changed_batch_is_refused(saved_run, llama_dir, text_file,
                                                                                     tmp_path):
    run = _copy(saved_run, tmp_path)
    shutil.rmtree(run / "final")
    for checkpoint in list_checkpoints(run)[2:]:
        shutil.rmtree(checkpoint)
    with pytest.raises(UsageError, match=r"effective batch 4 -> 8.*--resume-allow-changes"):
        train(_config(llama_dir, text_file, run, resume="auto", gradient_accumulation_steps=4))
    with pytest.raises(UsageError, match=r"data content"):
        other = tmp_path / "other.txt"
        other.write_text(text_file.read_text()[::-1])
        train(_config(llama_dir, other, run, resume="auto"))
    allowed = train(_config(llama_dir, text_file, run, resume="auto", gradient_accumulation_steps=4,
                            resume_allow_changes=True, output_dir=str(run)))
    assert "resume_changes" in allowed.summary["fallbacks"]
    shutil.rmtree(run / "final")
    resplit = train(_config(llama_dir, text_file, _copy(saved_run, tmp_path / "b"), resume=str(list_checkpoints(saved_run)[1]),
                            batch_size=1, gradient_accumulation_steps=4))
    straight = load_file(str(saved_run / "final" / "model.safetensors"))
    resumed = load_file(str(resplit.final_dir / "model.safetensors"))
    for name, tensor in straight.items():  # another split sums in another order: equal up to rounding
        torch.testing.assert_close(resumed[name], tensor, atol=1e-6, rtol=0)
