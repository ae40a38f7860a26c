"""Fixtures of the distributed tests: the run arguments and the single-process reference."""

from __future__ import annotations

from pathlib import Path

import pytest
from torchrun_helpers import single


@pytest.fixture(scope="session")
def run_args(llama_dir, text_file) -> list[str]:
    """A 3-step run with a global batch of 8 samples of 64 tokens."""
    return [
        "--model",
        str(llama_dir),
        "--dataset",
        str(text_file),
        "--seq-len",
        "64",
        "--max-steps",
        "3",
        "--loss-chunk-size",
        "0",
    ]


@pytest.fixture(scope="session")
def single_run(run_args, tmp_path_factory) -> Path:
    """The reference: one process, micro-batch 4 x 2 accumulation."""
    out = tmp_path_factory.mktemp("single")
    single(*run_args, "--batch-size", "4", "--gradient-accumulation-steps", "2", "--output-dir", out)
    return out
