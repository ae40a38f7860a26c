"""A DPO run killed with SIGKILL in the middle of a step resumes to the uninterrupted run's losses and weights, with
the reference as a frozen copy and as log-probabilities cached before training; the cached ones are read back on
resume (the key of the file matches), never computed again from the resumed weights.

Every run is a `memfit train` process forked from the warm server (tests/memfit_cli.py), one after another. A 4-step
run takes well under a second, so the killed run is held in the optimizer step after its step-K checkpoint (a
`sitecustomize` on its PYTHONPATH sleeps in torch's global optimizer pre-hook: the step's gradients are there, its
update not yet) and sent SIGKILL by its process id there.
"""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fault_injection import SGD_FLAGS, largest_update
from memfit.train.metrics import read_metrics
from signal_runs import children

STEPS = 4
REFERENCES = ("copy", "cached")
HOLD = '''
import os
import pathlib
import time

from torch.optim.optimizer import register_optimizer_step_pre_hook

_steps = [0]


def _hold(optimizer, args, kwargs):
    _steps[0] += 1
    if _steps[0] == int(os.environ["MEMFIT_TEST_HOLD_STEP"]):
        pathlib.Path(os.environ["MEMFIT_TEST_HOLD_MARK"]).touch()
        time.sleep(600)


_handle = register_optimizer_step_pre_hook(_hold)
'''


def _command(model: Path, out: Path, reference: str, *extra: str) -> list[str]:
    """4 SGD steps of DPO, 2 pairs x 2 accumulation a step, on the built-in pairs cut to 96 tokens."""
    return ["train", "--task", "dpo", "--model", str(model), "--dataset", "builtin:preferences", "--chat-template",
            "chatml", "--seq-len", "96", "--truncate", "--batch-size", "2", "--gradient-accumulation-steps", "2",
            "--max-steps", str(STEPS), "--beta", "0.5", "--reference", reference, "--no-report", *SGD_FLAGS,
            "--lr", "0.5", "--output-dir", str(out), *extra]


def _records_after_last_start(out: Path) -> list[dict]:
    records = read_metrics(out / "metrics.jsonl")
    last_start = max(i for i, r in enumerate(records) if r.get("event") == "start")
    return records[last_start:]


def _losses_after_last_start(out: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in _records_after_last_start(out) if "event" not in r}


def _weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(out / "final" / "model.safetensors"))


def _killed_in_step(warm_memfit, command: list[str], out: Path, step: int, hold_dir: Path) -> None:
    """Run `command`, and SIGKILL it while it is held in optimizer step `step` (its step `step - 1` saved)."""
    mark = hold_dir / f"held-{out.name}"
    env = {"PYTHONPATH": os.pathsep.join(p for p in (str(hold_dir), os.environ.get("PYTHONPATH", "")) if p),
           "MEMFIT_TEST_HOLD_STEP": str(step), "MEMFIT_TEST_HOLD_MARK": str(mark)}
    result = {}
    thread = threading.Thread(target=lambda: result.update(done=warm_memfit.run(*command, env=env)))
    thread.start()
    saved = out / "checkpoints" / f"step-{step - 1}" / "trainer_state.json"
    deadline = time.monotonic() + 300
    while not (mark.exists() and saved.exists()) and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.02)
    for child in children(warm_memfit._server.pid):  # the forked run: the server runs one command at a time
        os.kill(child, signal.SIGKILL)
    thread.join(timeout=600)
    done = result["done"]
    assert done.returncode == -signal.SIGKILL, f"not killed in step {step}: {done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def runs(llama_dir, warm_memfit, tmp_path_factory) -> dict:
    """Per reference: the uninterrupted run; a run killed in a random step after the first (held there, SIGKILL),
    and the same directory resumed (--resume auto), the cache file's mtime noted before the resume."""
    root = tmp_path_factory.mktemp("dpo-sigkill")
    hold_dir = root / "hold"
    hold_dir.mkdir()
    (hold_dir / "sitecustomize.py").write_text(HOLD)
    kill_in = random.SystemRandom().randint(2, STEPS)
    found: dict = {"root": root, "kill_in": kill_in}
    for reference in REFERENCES:
        straight, killed = root / f"straight-{reference}", root / f"killed-{reference}"
        done = warm_memfit.run(*_command(llama_dir, straight, reference))
        assert done.returncode == 0, done.stderr[-3000:]
        _killed_in_step(warm_memfit, _command(llama_dir, killed, reference, "--save-every", "1"), killed, kill_in,
                        hold_dir)
        cache = next(iter((killed / "cache").glob("reference-logps-*.safetensors")), None)
        mtime = cache.stat().st_mtime_ns if cache else None
        resumed = warm_memfit.run(*_command(llama_dir, killed, reference, "--save-every", "1", "--resume", "auto"))
        assert resumed.returncode == 0, resumed.stderr[-3000:]
        assert "Traceback" not in resumed.stderr
        found[reference] = {"straight": straight, "killed": killed, "stderr": resumed.stderr, "cache": cache,
                            "mtime": mtime}
    return found


@pytest.mark.parametrize("reference", REFERENCES)
def test_killed_dpo_run_resumes_to_the_uninterrupted_run(reference, runs, llama_dir):
    run, kill_in = runs[reference], runs["kill_in"]
    context = f"{reference} reference, killed in step {kill_in}"
    assert f"resumed from {run['killed'] / 'checkpoints' / f'step-{kill_in - 1}'}" in run["stderr"], context
    expected = _losses_after_last_start(run["straight"])
    losses = _losses_after_last_start(run["killed"])
    assert sorted(losses) == list(range(kill_in, STEPS + 1)), context
    assert losses == pytest.approx({step: expected[step] for step in losses}, abs=1e-6), context
    straight, resumed = _weights(run["straight"]), _weights(run["killed"])
    assert largest_update(load_file(str(llama_dir / "model.safetensors")), straight) > 1e-2
    for name, tensor in straight.items():
        torch.testing.assert_close(resumed[name], tensor, atol=1e-6, rtol=0, msg=f"{name} ({context})")
    start = next(r for r in _records_after_last_start(run["killed"]) if r.get("event") == "start")
    assert start["task"]["reference"]["mode"] == reference


def test_the_cached_reference_is_read_back_on_resume_not_computed(runs):
    run = runs["cached"]
    assert run["cache"] is not None and run["cache"].is_file(), "the killed run left no cached reference"
    assert run["cache"].stat().st_mtime_ns == run["mtime"], "the resumed run wrote the cache file again"
    assert f"read back from {run['cache']}" in run["stderr"]
    start = next(r for r in _records_after_last_start(run["killed"]) if r.get("event") == "start")
    facts = start["task"]["reference"]
    assert facts["reused"] and facts["cache_file"] == str(run["cache"]) and facts["items"] == 29
    # the numbers read back are those the uninterrupted run computed from the same weights
    straight = load_file(str(run["straight"] / "cache" / run["cache"].name))["logps"]
    assert torch.equal(load_file(str(run["cache"]))["logps"], straight)
