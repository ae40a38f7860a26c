"""`memfit train --optimizer apollo-adamw / galore-adamw / adam-mini` through the real CLI: it trains, says what ran
in the metrics, checkpoints, and a resume from the step-2 checkpoint ends with the uninterrupted run's weights
(the projections refresh at step 3, after the resume, from the saved step count)."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from memfit.cli.main import main
from memfit.train.metrics import read_metrics

pytest.importorskip("galore_torch")
pytest.importorskip("apollo_torch")
pytest.importorskip("adam_mini")


def _args(llama_dir, text_file, optimizer: str, extra: list[str]) -> list[str]:
    return ["train", "--model", str(llama_dir), "--dataset", str(text_file), "--seq-len", "32", "--batch-size", "2",
            "--max-steps", "4", "--optimizer", optimizer, "--lr", "1e-2", "--optim-rank", "4",
            "--optim-update-proj-gap", "3", "--no-report", *extra]


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, extra", [
    ("apollo-adamw", []),
    ("galore-adamw", ["--optimizer-in-backward"]),
    ("adam-mini", ["--gradient-accumulation-steps", "2"]),
])
def test_trains_checkpoints_and_resumes_exactly(optimizer, extra, llama_dir, text_file, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main([*_args(llama_dir, text_file, optimizer, extra), "--save-every", "2", "--output-dir", str(straight)]) == 0
    shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("final", "step-4", "metrics.jsonl", "step-3"))
    assert main([*_args(llama_dir, text_file, optimizer, extra), "--resume", "auto", "--output-dir", str(resumed)]) == 0
    steps = [r for r in read_metrics(straight / "metrics.jsonl") if "event" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert all(r["optimizer"].startswith(optimizer) for r in steps), steps[0]["optimizer"]
    resumed_steps = [r for r in read_metrics(resumed / "metrics.jsonl") if "event" not in r]
    assert [r["step"] for r in resumed_steps] == [3, 4]
    a = load_file(str(straight / "final" / "model.safetensors"))
    b = load_file(str(resumed / "final" / "model.safetensors"))
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
