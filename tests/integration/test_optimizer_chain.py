"""8-bit AdamW's fallback chain, link by link: bitsandbytes -> torchao -> torch AdamW.

Each link runs the real `memfit train` (its `main`) in a fresh interpreter where the
packages ahead of it in the chain cannot be imported (their `sys.modules` entries set to
None, which makes `import` raise ImportError as for a missing package). Each link must
train, write numeric metrics, checkpoint, and resume to the uninterrupted weights.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from memfit.train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[2]

# Runs memfit's main twice in one interpreter with some packages hidden:
# the whole run, then a resume of its step-2 checkpoint into a copy of the output directory.
RUNNER = """
import json, shutil, sys
hidden, first, second, resume_dir = json.loads(sys.argv[1])
for name in hidden:
    sys.modules[name] = None
from memfit.cli.main import main
if main(first) != 0:
    sys.exit(10)
shutil.copytree(first[first.index("--output-dir") + 1], resume_dir,
                ignore=shutil.ignore_patterns("final", "step-3", "metrics.jsonl"))
sys.exit(main(second))
"""


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
def link_runs(llama_dir, text_file, tmp_path_factory) -> dict:
    """Every installed link's interpreter, started together (each mostly imports and waits on one core)."""
    started = {}
    for link in LINKS:
        hidden, _, needs = link.values
        if needs is not None and not _installed(needs):
            continue
        root = tmp_path_factory.mktemp(link.id)
        straight, resumed = root / "straight", root / "resumed"
        first = [*_common(llama_dir, text_file), "--save-every", "1", "--output-dir", str(straight)]
        second = [*_common(llama_dir, text_file), "--resume", "auto", "--output-dir", str(resumed)]
        log = root / "stderr.txt"
        with open(log, "w") as stderr:  # a file, not a pipe: no run waits on a reader busy with another
            process = subprocess.Popen([sys.executable, "-c", RUNNER, json.dumps([hidden, first, second, str(resumed)])],
                                       stdout=subprocess.DEVNULL, stderr=stderr, cwd=REPO)
        started[link.id] = (process, log, straight, resumed)
    finished = {}
    for name, (process, log, straight, resumed) in started.items():
        try:
            process.wait(timeout=600)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        finished[name] = (subprocess.CompletedProcess(process.args, process.returncode, "", log.read_text()), straight,
                          resumed)
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
