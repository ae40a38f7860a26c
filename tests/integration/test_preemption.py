"""SIGTERM at 20 moments of a run: the exit code is 75, the checkpoint written is the uninterrupted run's state
after the same step bit for bit, and resuming ends on the uninterrupted run's final weights (SGD without
clipping, CPU).

17 moments are named through MEMFIT_PREEMPT_AT (forward, backward and inside the optimizer step of each
step, and as a checkpoint write starts); 3 are real-time signals at a random moment. The fault twin
applies the step in flight to half of the parameters only (fault_shim): the same check must then fail.
"""

from __future__ import annotations

import random
import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from fault_injection import SGD_FLAGS, fault_env
from memfit.checkpoint_files import checkpoint_problem, list_checkpoints
from memfit.train.metrics import read_metrics
from signal_runs import run_with_signals

STEPS = 6
PREEMPTED = 75
HOOKED = [(phase, step) for phase in ("forward", "backward", "optimizer") for step in range(1, STEPS)]
HOOKED += [("save", 2), ("save", 4)]


@pytest.fixture(scope="module")
def args(llama_dir, text_file, tmp_path_factory):
    cache = tmp_path_factory.mktemp("token-cache")

    def make(out, *extra) -> list[str]:
        return ["train", "--model", str(llama_dir), "--dataset", str(text_file), "--cache-dir", str(cache), "--seq-len",
                "32", "--batch-size", "1", "--gradient-accumulation-steps", "2", "--max-steps", str(STEPS),
                "--save-every", "2", "--loss-chunk-size", "0", "--no-report", *SGD_FLAGS, "--lr", "0.3",
                "--output-dir", str(out), *extra]

    return make


@pytest.fixture(scope="module")
def straight(warm_memfit, args, tmp_path_factory) -> Path:
    """The uninterrupted run, keeping the checkpoint of every step."""
    out = tmp_path_factory.mktemp("straight") / "run"
    done = warm_memfit.run(*args(out, "--save-every", "1", "--save-total-limit", "0"))
    assert done.returncode == 0, done.stderr[-3000:]
    return out


def _state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """Weights and optimizer state of a checkpoint, by name."""
    state = {f"model.{k}": v for k, v in load_file(str(checkpoint / "model.safetensors")).items()}
    optimizer = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    for index, values in optimizer["state"].items():
        state |= {f"optimizer.{index}.{k}": v for k, v in values.items() if isinstance(v, torch.Tensor)}
    return state


def assert_same_state(checkpoint: Path, reference: Path, context: str) -> None:
    a, b = _state(reference), _state(checkpoint)
    assert set(a) == set(b), context
    for name, tensor in a.items():
        assert torch.equal(b[name], tensor), f"{name} differs from the uninterrupted run ({context})"


def _assert_resumes_to(warm_memfit, args, out, straight, context: str) -> None:
    done = warm_memfit.run(*args(out, "--resume", "auto"))
    assert done.returncode == 0, done.stderr[-3000:]
    final, reference = load_file(str(out / "final" / "model.safetensors")), load_file(str(straight / "final" / "model.safetensors"))
    for name, tensor in reference.items():
        assert torch.equal(final[name], tensor), f"{name} differs after resuming ({context})"


def _preempted_checkpoint(out: Path, stderr: str) -> int:
    """The step the run stopped after: its checkpoint is complete and verified, and the metrics say so."""
    events = [r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "preempted"]
    assert len(events) == 1 and events[0]["signal"] == "SIGTERM", stderr[-2000:]
    newest = list_checkpoints(out)[-1]
    assert newest.name == f"step-{events[0]['step']}" and checkpoint_problem(newest) is None
    assert not list((out / "checkpoints").glob(".tmp-*"))
    errors = [line for line in stderr.splitlines() if "error:" in line]
    assert len(errors) == 1 and "--resume auto" in errors[0] and "Traceback" not in stderr
    return events[0]["step"]


@pytest.mark.parametrize(("phase", "step"), HOOKED, ids=[f"{p}-{s}" for p, s in HOOKED])
def test_sigterm_at_a_named_moment_saves_the_uninterrupted_state(phase, step, straight, warm_memfit, args, tmp_path,
                                                                 monkeypatch):
    out = tmp_path / "run"
    monkeypatch.setenv("MEMFIT_PREEMPT_AT", f"{phase}:{step}")
    done = warm_memfit.run(*args(out))
    monkeypatch.delenv("MEMFIT_PREEMPT_AT")
    assert done.returncode == PREEMPTED, done.stderr[-3000:]
    assert _preempted_checkpoint(out, done.stderr) == step  # the step in flight finished, nothing after it
    context = f"SIGTERM in {phase} of step {step}"
    assert_same_state(list_checkpoints(out)[-1], straight / "checkpoints" / f"step-{step}", context)
    if (phase, step) in (("backward", 3), ("save", 2)):  # resuming a checkpoint equal to the reference: once is enough
        _assert_resumes_to(warm_memfit, args, out, straight, context)


@pytest.mark.parametrize("attempt", range(3))
def test_sigterm_at_a_random_moment_saves_and_resumes_exactly(attempt, straight, warm_memfit, args, tmp_path):
    out = tmp_path / "run"
    delay = random.SystemRandom().uniform(0.0, 0.5)
    done = run_with_signals(warm_memfit, args(out), out, [signal.SIGTERM], delay)
    if done.returncode in (0, -signal.SIGTERM):
        # The signal came after the last step: the final save completes under the handler (exit 0), or, past
        # the training loop's end, the default action ends a process whose work is all written.
        assert list_checkpoints(out)[-1].name == f"step-{STEPS}", done.stderr[-3000:]
        assert checkpoint_problem(list_checkpoints(out)[-1]) is None and (out / "final").is_dir()
        return
    assert done.returncode == PREEMPTED, done.stderr[-3000:]
    stopped = _preempted_checkpoint(out, done.stderr)
    context = f"SIGTERM {delay:.3f} s after step 1, stopped after step {stopped}"
    assert_same_state(list_checkpoints(out)[-1], straight / "checkpoints" / f"step-{stopped}", context)
    _assert_resumes_to(warm_memfit, args, out, straight, context)


def test_second_signal_exits_at_once(warm_memfit, args, tmp_path):
    out = tmp_path / "run"
    done = run_with_signals(warm_memfit, args(out, "--max-steps", "200"), out,
                            [signal.SIGTERM, signal.SIGTERM], 0.0)
    assert done.returncode == 128 + signal.SIGTERM, done.stderr[-3000:]
    assert "second signal" in done.stderr
    assert all(checkpoint_problem(c) is None for c in list_checkpoints(out))


def test_fault_twin_half_applied_step_fails_the_check(straight, args, tmp_path, warm_memfit):
    """The step in flight applied to half of the parameters before the save: the checkpoint is no longer the
    uninterrupted run's state after that step. Forked from the warm server, which runs the fault shim in the child."""
    out = tmp_path / "run"
    env = {**fault_env(), "MEMFIT_FAULT_PREEMPT_PARTIAL": "1", "MEMFIT_PREEMPT_AT": "forward:3"}
    done = warm_memfit.run(*args(out), timeout=600, env=env)
    assert done.returncode == PREEMPTED, done.stderr[-3000:]
    assert _preempted_checkpoint(out, done.stderr) == 3
    with pytest.raises(AssertionError, match="differs from the uninterrupted run"):
        assert_same_state(list_checkpoints(out)[-1], straight / "checkpoints" / "step-3", "fault twin")


def test_preempt_signals_flag_is_checked(warm_memfit, args, tmp_path):
    done = warm_memfit.run(*args(tmp_path / "run", "--preempt-signals", "SIGTERM,SIGBOGUS"))
    assert done.returncode == 2 and "SIGBOGUS" in done.stderr
