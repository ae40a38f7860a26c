"""A disk too small for the checkpoints: refused at start (exit 2, one line); a save that runs out of space
keeps the previous checkpoint, leaves nothing half-written and exits 74 with one line.

The small disk is a tmpfs of its own (mounting needs root: skipped otherwise) or a file-size limit
(RLIMIT_FSIZE, `ulimit -f`) in the run's process.
"""

from __future__ import annotations

import subprocess

import pytest

from fault_injection import SGD_FLAGS
from memfit.checkpoint_files import checkpoint_problem, list_checkpoints

WRITE_FAILED = 74


@pytest.fixture(scope="module")
def args(llama_dir, text_file, tmp_path_factory):
    cache = tmp_path_factory.mktemp("token-cache")  # the token cache lives off the small disk

    def make(out, *extra) -> list[str]:
        return ["train", "--model", str(llama_dir), "--dataset", str(text_file), "--cache-dir", str(cache), "--seq-len",
                "32", "--batch-size", "1", "--max-steps", "6", "--save-every", "1", "--save-total-limit", "0",
                "--loss-chunk-size", "0", "--no-report", *SGD_FLAGS, "--output-dir", str(out), *extra]

    return make


@pytest.fixture
def small_disk(tmp_path):
    """A 1.2 MiB tmpfs: room for two checkpoints of the tiny Llama (about 0.47 MiB each), not three."""
    mount = tmp_path / "small"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({done.stderr.strip()[:100]}); the file-size limit tests still run")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _one_error_line(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in stderr, stderr[-3000:]
    return lines[0]


def test_start_check_refuses_a_run_whose_checkpoints_cannot_fit(small_disk, warm_memfit, args):
    done = warm_memfit.run(*args(small_disk / "run"))
    assert done.returncode == 2
    line = _one_error_line(done.stderr)
    assert "free" in line and "--save-total-limit" in line and "--no-disk-check" in line
    assert not list_checkpoints(small_disk / "run")


def test_save_out_of_space_keeps_the_previous_checkpoint_and_exits_74(small_disk, warm_memfit, args):
    out = small_disk / "run"
    done = warm_memfit.run(*args(out, "--no-disk-check"))
    assert done.returncode == WRITE_FAILED, done.stderr[-3000:]
    line = _one_error_line(done.stderr)
    kept = list_checkpoints(out)
    assert [c.name for c in kept] == ["step-1", "step-2"]
    assert f"the previous checkpoint {kept[-1].name} is intact" in line and "--resume auto" in line
    assert all(checkpoint_problem(c) is None for c in kept)
    assert not list((out / "checkpoints").glob(".tmp-*"))  # nothing half-written left behind


def test_file_size_limit_is_refused_at_start_and_a_failed_write_exits_74(args, tmp_path, warm_memfit):
    limit = 300 * 1024  # under the weights file (about 430 KiB), over the metrics and the token cache
    # Warm the token cache first, unlimited: the limit then applies only to what the run writes.
    assert warm_memfit.run(*args(tmp_path / "warm", "--max-steps", "1")).returncode == 0
    # The limited runs fork from the warm server too (the limit set in the child only): a fresh interpreter each
    # would import torch and transformers again
    refused = warm_memfit.run(*args(tmp_path / "refused"), file_size_limit=limit)
    assert refused.returncode == 2 and "file-size limit" in _one_error_line(refused.stderr)
    failed = warm_memfit.run(*args(tmp_path / "failed", "--no-disk-check"), file_size_limit=limit)
    assert failed.returncode == WRITE_FAILED, failed.stderr[-3000:]
    assert "could not write checkpoint step-1" in _one_error_line(failed.stderr)
    assert not list_checkpoints(tmp_path / "failed") and not list((tmp_path / "failed" / "checkpoints").glob(".tmp-*"))
