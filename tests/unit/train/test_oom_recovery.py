"""OOM recovery under the emulated memory cap: splits keep the exact update; escalation; exit 3.

The equality checks train with SGD without clipping (a 2x gradient error moves the weights by
a full update), and each has a twin that injects such an error and sees the check fail.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from fault_injection import (
    SGD_FLAGS,
    SGD_NO_CLIPPING,
    freezing_ignored,
    largest_update,
    oom_in_backward_of_linear,
    scaled_gradients,
)
from memfit.checkpoint_files import list_checkpoints
from memfit.config_loading import load_config
from memfit.train.loop import train
from memfit.train.metrics import read_metrics


def _config(llama_dir, text_file, out, **extra):
    values = dict(
        model=str(llama_dir), dataset=str(text_file), seq_len=128, batch_size=8, max_steps=2,
        loss_chunk_size=0, output_dir=str(out), lr=0.5, **SGD_NO_CLIPPING,
    )
    return load_config(overrides=values | extra)


def _weights(result):
    return load_file(str(result.final_dir / "model.safetensors"))


def _assert_same(reference: dict, weights: dict, atol: float = 1e-5) -> None:
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, atol=atol, rtol=0, msg=name)


def _tracked_peak(llama_dir, text_file, out, **extra) -> dict:
    result = train(_config(llama_dir, text_file, out, track_memory=True, **extra))
    steps = [r for r in read_metrics(out / "metrics.jsonl") if "event" not in r]
    return {"peak": max(r["tracked_peak_bytes"] for r in steps), "phases": steps[-1]["tracked_phase_peaks"], "result": result}


@pytest.fixture(scope="module")
def peaks(llama_dir, text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("peaks")
    return {mb: _tracked_peak(llama_dir, text_file, out / str(mb), batch_size=mb, gradient_accumulation_steps=8 // mb) for mb in (1, 2, 8)}


def _split_cap(peaks) -> int:
    """Fits a micro-batch of 2, not of 8."""
    return peaks[2]["peak"] + (peaks[8]["peak"] - peaks[2]["peak"]) // 4


def test_capped_run_splits_and_equals_uncapped(peaks, llama_dir, text_file, tmp_path):
    reference = _weights(peaks[8]["result"])
    assert largest_update(load_file(str(llama_dir / "model.safetensors")), reference) > 1e-2
    result = train(_config(llama_dir, text_file, tmp_path, memory_cap=_split_cap(peaks), save_every=1, max_steps=2))
    _assert_same(reference, _weights(result))
    events = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r.get("event") == "oom"]
    assert events and events[0]["old_micro_batch_size"] == 8
    assert events[-1]["new_micro_batch_size"] <= 4
    steps = [r for r in read_metrics(tmp_path / "metrics.jsonl") if "event" not in r]
    assert steps[-1]["micro_batch_size"] * steps[-1]["gradient_accumulation_steps"] == 8
    # The checkpoint records the split, so a resumed run starts there.
    state = json.loads((list_checkpoints(tmp_path)[-1] / "trainer_state.json").read_text())
    assert state["micro_batch_size"] == steps[-1]["micro_batch_size"] < 8


def test_capped_run_check_fails_on_a_2x_gradient_error(peaks, llama_dir, text_file, tmp_path):
    with scaled_gradients(2.0):
        result = train(_config(llama_dir, text_file, tmp_path, memory_cap=_split_cap(peaks), max_steps=2))
    assert any(r.get("event") == "oom" for r in read_metrics(tmp_path / "metrics.jsonl"))
    with pytest.raises(AssertionError):
        _assert_same(_weights(peaks[8]["result"]), _weights(result))


def _oom_in_backward_of_big_micro_batches():
    """Raise an OOM in backward when it reaches the first block's MLP output, for micro-batches above 2.

    By then the head, the final norm and the last block hold their gradients: recovery must
    not count them twice. Found through a global forward hook, not memfit's internals.
    """
    return oom_in_backward_of_linear(128, 64)


@pytest.fixture(scope="module")
def one_update(llama_dir, text_file, tmp_path_factory):
    """The reference: one update of 8 samples, nothing injected."""
    return _weights(train(_config(llama_dir, text_file, tmp_path_factory.mktemp("one-update"), max_steps=1)))


def test_oom_in_backward_keeps_the_update_exact(one_update, llama_dir, text_file, tmp_path):
    """An OOM raised midway through backward: params already accumulated are not counted twice."""
    with _oom_in_backward_of_big_micro_batches() as raised:
        result = train(_config(llama_dir, text_file, tmp_path, max_steps=1))
    assert raised["n"] >= 2  # the 8 failed, then a 4 failed
    _assert_same(one_update, _weights(result))
    events = [r for r in read_metrics(tmp_path / "metrics.jsonl") if r.get("event") == "oom"]
    assert {e["phase"] for e in events} == {"backward"}


def test_oom_in_backward_check_fails_when_recovery_does_not_freeze(one_update, llama_dir, text_file, tmp_path):
    """Recovery without freezing counts the head's and the last block's gradients twice: the check must see it."""
    with _oom_in_backward_of_big_micro_batches() as raised, freezing_ignored():
        result = train(_config(llama_dir, text_file, tmp_path, max_steps=1))
    assert raised["n"] >= 2
    with pytest.raises(AssertionError):
        _assert_same(one_update, _weights(result))


def test_oom_in_optimizer_step_is_recovered(llama_dir, text_file, tmp_path):
    """foreach AdamW needs whole-model temporaries; under a cap memfit redoes the step per parameter."""
    small = dict(batch_size=1, gradient_accumulation_steps=1, seq_len=16, max_steps=1, optimizer="adamw")
    foreach = _tracked_peak(llama_dir, text_file, tmp_path / "foreach", optimizer_impl="foreach", **small)
    loop = _tracked_peak(llama_dir, text_file, tmp_path / "loop", optimizer_impl="for-loop", **small)
    assert foreach["phases"]["optimizer"] > loop["phases"]["optimizer"]
    cap = max(loop["peak"], (loop["phases"]["optimizer"] + foreach["phases"]["optimizer"]) // 2)
    assert cap < foreach["phases"]["optimizer"]
    result = train(_config(llama_dir, text_file, tmp_path / "capped", optimizer_impl="foreach", memory_cap=cap, **small))
    events = [r for r in read_metrics(tmp_path / "capped" / "metrics.jsonl") if r.get("event") == "oom"]
    assert events and events[0]["phase"] == "optimizer"
    _assert_same(_weights(foreach["result"]), _weights(result), atol=1e-6)


def test_one_sample_too_big_turns_on_checkpointing(peaks, llama_dir, text_file, tmp_path):
    checkpointed = _tracked_peak(llama_dir, text_file, tmp_path / "ckpt", batch_size=1, gradient_accumulation_steps=8,
                                 gradient_checkpointing="full")
    assert checkpointed["peak"] < peaks[1]["peak"]
    cap = (checkpointed["peak"] + peaks[1]["peak"]) // 2
    result = train(_config(llama_dir, text_file, tmp_path / "capped", memory_cap=cap))
    events = [r for r in read_metrics(tmp_path / "capped" / "metrics.jsonl") if r.get("event") == "oom"]
    assert any("gradient checkpointing" in e.get("action", "") for e in events)
    _assert_same(_weights(peaks[8]["result"]), _weights(result))


def test_hopeless_cap_exits_3_and_keeps_the_checkpoint(peaks, llama_dir, text_file, tmp_path, warm_memfit):
    out = tmp_path / "run"
    common = ["train", "--model", llama_dir, "--dataset", text_file, "--seq-len", "128", "--output-dir", out, *SGD_FLAGS]
    assert warm_memfit.run(*common, "--max-steps", "2", "--save-every", "1").returncode == 0
    before = list_checkpoints(out)[-1]
    breakdown = [r for r in read_metrics(peaks[1]["result"].output_dir / "metrics.jsonl") if "event" not in r][-1]["tracked_breakdown"]
    model_states = breakdown["parameters"] + breakdown["gradients"] + breakdown["optimizer_states"]
    cap = model_states + 64 * 1024  # the weights fit; one sample's activations never do
    result = warm_memfit.run(*common, "--max-steps", "4", "--resume", "auto", "--memory-cap", str(cap))
    assert result.returncode == 3, result.stderr
    assert "Traceback" not in result.stderr
    error_lines = [line for line in result.stderr.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and "micro-batch 1" in error_lines[0]
    assert list_checkpoints(out)[-1] == before and (before / "model.safetensors").is_file()


def test_no_oom_recovery_stops_with_a_clear_message(peaks, llama_dir, text_file, tmp_path, warm_memfit):
    cap = peaks[2]["peak"]
    result = warm_memfit.run("train", "--model", llama_dir, "--dataset", text_file, "--seq-len", "128", "--max-steps", "1",
                        "--memory-cap", str(cap), "--no-oom-recovery", "--loss-chunk-size", "0", "--output-dir", tmp_path)
    assert result.returncode == 3, result.stderr
    assert "memory cap" in result.stderr and "Traceback" not in result.stderr
