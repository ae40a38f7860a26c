"""--async-save: the checkpoints written in the background are those of a synchronous run, bit for bit.

The writer here is made to lag: each write runs only when the next save (or the end of the run) comes,
so the following step has changed the live weights before the files are written. The host copy keeps
the checkpoint exact; the twin without it (the snapshot sharing the live tensors) must fail the check.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

import memfit.checkpoint_files as checkpoint_files
from fault_injection import SGD_NO_CLIPPING
from memfit.checkpoint_files import list_checkpoints
from memfit.checkpoint_files.writer import BackgroundWriter
from memfit.config_loading import load_config
from memfit.train.loop import train
from memfit.train.metrics import read_metrics


def _config(llama_dir, text_file, out, **extra):
    values = dict(model=str(llama_dir), dataset=str(text_file), seq_len=32, batch_size=1, gradient_accumulation_steps=2,
                  max_steps=4, lr=0.3, output_dir=str(out), report=False, loss_chunk_size=0, save_every=1,
                  save_total_limit=0, **(SGD_NO_CLIPPING | {"momentum": 0.9}))
    return load_config(overrides=values | extra)


class LaggingWriter(BackgroundWriter):
    """Runs a write only when the next one is submitted or waited for: after the next step has run."""

    def submit(self, write):
        self.wait()
        self._pending = write

    def wait(self):
        pending, self._pending = getattr(self, "_pending", None), None
        return pending() if pending is not None else None


def _checkpoint_state(path):
    state = {f"model.{k}": v for k, v in load_file(str(path / "model.safetensors")).items()}
    optimizer = torch.load(path / "optimizer.pt", weights_only=True)
    for index, values in optimizer["state"].items():
        state |= {f"optimizer.{index}.{k}": v for k, v in values.items() if isinstance(v, torch.Tensor)}
    return state


def _assert_same_checkpoints(a, b):
    names_a, names_b = [c.name for c in list_checkpoints(a)], [c.name for c in list_checkpoints(b)]
    assert names_a == names_b == ["step-1", "step-2", "step-3", "step-4"]
    for first, second in zip(list_checkpoints(a), list_checkpoints(b), strict=True):
        x, y = _checkpoint_state(first), _checkpoint_state(second)
        for name, tensor in x.items():
            assert torch.equal(y[name], tensor), f"{first.name} {name}"


@pytest.fixture(scope="module")
def synchronous(llama_dir, text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("sync") / "run"
    train(_config(llama_dir, text_file, out))
    return out


def test_async_checkpoints_equal_synchronous_ones(synchronous, llama_dir, text_file, tmp_path, monkeypatch):
    monkeypatch.setattr("memfit.train.saving.BackgroundWriter", LaggingWriter)
    result = train(_config(llama_dir, text_file, tmp_path / "run", async_save=True))
    _assert_same_checkpoints(synchronous, tmp_path / "run")
    events = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if r.get("event") == "checkpoint"]
    assert [e["step"] for e in events] == [1, 2, 3] and all(e["async"] for e in events)
    assert result.summary["checkpoint_saves"] == 3 and "async_save" not in result.summary["fallbacks"]


def test_async_checkpoints_without_the_host_copy_fail_the_check(synchronous, llama_dir, text_file, tmp_path, monkeypatch):
    monkeypatch.setattr("memfit.train.saving.BackgroundWriter", LaggingWriter)
    monkeypatch.setattr(checkpoint_files, "_host_copy", lambda value: value)  # the snapshot shares the live tensors
    train(_config(llama_dir, text_file, tmp_path / "run", async_save=True))
    with pytest.raises(AssertionError):
        _assert_same_checkpoints(synchronous, tmp_path / "run")


def test_real_background_writer_gives_the_same_checkpoints(synchronous, llama_dir, text_file, tmp_path):
    train(_config(llama_dir, text_file, tmp_path / "run", async_save=True))
    _assert_same_checkpoints(synchronous, tmp_path / "run")
