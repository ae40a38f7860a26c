"""kill -9 at 20 random moments of a run that saves after every step: each time, --resume auto finds a
complete checkpoint whose files match its manifest, and the next start goes on from it."""

from __future__ import annotations

import random
import signal

from fault_injection import SGD_FLAGS
from memfit.checkpoint_files import checkpoint_problem, list_checkpoints, resolve_resume
from signal_runs import run_with_signals

TRIES = 20


def test_kill_9_at_random_moments_always_leaves_a_complete_checkpoint(warm_memfit, llama_dir, text_file, tmp_path):
    out = tmp_path / "run"
    args = ["train", "--model", str(llama_dir), "--dataset", str(text_file), "--cache-dir", str(tmp_path / "cache"),
            "--seq-len", "32", "--batch-size", "1", "--max-steps", "1000", "--save-every", "1", "--loss-chunk-size", "0",
            "--no-report", *SGD_FLAGS, "--output-dir", str(out), "--resume", "auto"]
    rng = random.SystemRandom()
    mid_save, steps = 0, []
    for attempt in range(TRIES):
        done = run_with_signals(warm_memfit, args, out, [signal.SIGKILL], rng.uniform(0.0, 0.4))
        assert done.returncode == -signal.SIGKILL, f"try {attempt}: {done.stderr[-2000:]}"
        mid_save += bool(list((out / "checkpoints").glob(".tmp-*"))) if (out / "checkpoints").is_dir() else 0
        checkpoint = resolve_resume("auto", out)  # raises when every checkpoint is damaged
        if checkpoint is None:
            assert attempt == 0 and not list_checkpoints(out), "a checkpoint existed and none was found"
            continue
        assert checkpoint == list_checkpoints(out)[-1] and checkpoint_problem(checkpoint) is None, f"try {attempt}"
        steps.append(int(checkpoint.name.removeprefix("step-")))
    assert steps == sorted(steps) and len(steps) >= TRIES - 1, steps  # each start went on from the last checkpoint
    print(f"{mid_save} of {TRIES} kills left a checkpoint half-written; the newest complete ones: {steps}")
