"""8-bit AdamW's fallback chain, link by link: bitsandbytes -> torchao -> torch AdamW.

Each link runs the real `memfit train` in a child forked from the warm server (tests/memfit_cli.py) where the
packages ahead of it in the chain cannot be imported (their `sys.modules` entries set to None, which makes
`import` raise ImportError as for a missing package). Each link must train, write numeric metrics, checkpoint,
and resume to the uninterrupted weights.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from memfit.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]

def _installed(name: str) -> bool:
    try:
        __import__(name)
    except Exception:
        return False
    return True


LINKS = [
    pytest.param([], "adamw-8bit (bitsandbytes)", "bitsandbytes", id="bitsandbytes"),
    pytest.param(["bitsandbytes"], "adamw-8bit (torchao)", "torchao", id="torchao"),
    pytest.param(["bitsandbytes", "torchao", "torchao.optim"], "adamw (", None, id="torch"),
]


def _common(llama_dir, text_file) -> list[str]:
    return ["train", "--model", str(llama_dir), "--dataset", str(text_file), "--seq-len", "32", "--batch-size", "2",
            "--max-steps", "3", "--optimizer", "adamw-8bit", "--lr", "1e-2", "--warmup-steps", "1", "--no-report"]


@pytest.fixture(scope="module")
def link_runs(llama_dir, text_file, warm_memfit, tmp_path_factory) -> dict:
    """Every installed link: the whole run, then a resume of its step-2 checkpoint into a copy of its output."""
    finished = {}
    for link in LINKS:
        hidden, _, needs = link.values
        if needs is not None and not _installed(needs):
            continue
        root = tmp_path_factory.mktemp(link.id)
        straight, resumed = root / "straight", root / "resumed"
        first = warm_memfit.run(*_common(llama_dir, text_file), "--save-every", "1", "--output-dir", str(straight),
                                timeout=600, hidden=tuple(hidden))
        result = first
        if first.returncode == 0:
            shutil.copytree(straight, resumed, ignore=shutil.ignore_patterns("final", "step-3", "metrics.jsonl"))
            second = warm_memfit.run(*_common(llama_dir, text_file), "--resume", "auto", "--output-dir", str(resumed),
                                     timeout=600, hidden=tuple(hidden))
            result = subprocess.CompletedProcess(second.args, second.returncode, first.stdout + second.stdout,
                                                 first.stderr + second.stderr)
        finished[link.id] = (result, straight, resumed)
    return finished


@pytest.mark.slow
@pytest.mark.parametrize("hidden, ran, needs", LINKS)
def test_each_link_trains_logs_checkpoints_and_resumes(hidden, ran, needs, link_runs, request):
    if needs is not None and not _installed(needs):
        pytest.skip(f"{needs} is not installed")
    result, straight, resumed = link_runs[request.node.callspec.id]
    assert result.returncode == 0, result.stderr[-3000:]
    assert "Traceback" not in result.stderr

    records = read_metrics(straight / "metrics.jsonl")
    steps = [r for r in records if "event" not in r]
    assert [r["step"] for r in steps] == [1, 2, 3]
    assert all(r["optimizer"].startswith(ran) for r in steps), steps[0]["optimizer"]
    # The schedule's value, read as a number: warmup of 1 step, then cosine from 1e-2.
    assert [type(r["lr"]) for r in steps] == [float] * 3
    assert steps[0]["lr"] == pytest.approx(1e-2)
    assert steps[1]["lr"] < steps[0]["lr"]
    fallbacks = records[-1]["fallbacks"]
    if hidden:
        assert "optimizer" in fallbacks and hidden[0] in fallbacks["optimizer"], fallbacks
        assert f"No module named '{hidden[0]}'" in fallbacks["optimizer"] or hidden[0] in result.stderr
    else:
        assert "optimizer" not in fallbacks

    # The resumed leg redid step 3 from the step-2 checkpoint: same loss, same weights.
    resumed_steps = [r for r in read_metrics(resumed / "metrics.jsonl") if "event" not in r]
    assert [r["step"] for r in resumed_steps] == [3]
    assert resumed_steps[0]["loss"] == pytest.approx(steps[2]["loss"], abs=1e-6)
    assert resumed_steps[0]["lr"] == pytest.approx(steps[2]["lr"], rel=1e-6)
    a = load_file(str(straight / "final" / "model.safetensors"))
    b = load_file(str(resumed / "final" / "model.safetensors"))
    for name, tensor in a.items():
        torch.testing.assert_close(b[name], tensor, atol=0, rtol=0, msg=name)
