"""FSDP2 on 2 ranks (torchrun, gloo, CPU): each rank's tracker sees its shards and every gather and free."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).with_name("tracker_fsdp_worker.py")
BLOCK_BYTES = (64 * 64 + 64) * 4  # one Linear(64, 64) in fp32


@pytest.mark.slow
def test_each_rank_tracks_its_shards_and_the_gathered_block(tmp_path):
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER)]
    result = subprocess.run(
        [*command, str(tmp_path / "rank")],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    for rank in (0, 1):
        steps = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for step in steps:
            sharded = step["sharded"]
            assert sharded == 3 * BLOCK_BYTES // 2  # half of every block lives on each rank
            # A block's forward sees its gathered full parameters; the resize to 0 after it frees them.
            assert step["seen"] == [
                entry
                for index in range(3)
                for entry in (["inside", index, sharded + BLOCK_BYTES], ["after", index, sharded])
            ]
            assert step["end"] == sharded
