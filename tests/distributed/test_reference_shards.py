"""The frozen reference copy sharded by FSDP2 (distributed/reference_shards.py) on 2 CPU ranks (one torchrun launch
of reference_shards_worker.py): its log-probabilities are the whole copy's, and each rank holds about half of the
copy before a reference pass and again after it (the pass frees the root unit it keeps gathered for the head's
chunks). A copy left whole fails the first, a root left gathered after the pass the second. The whole run under
--sharding fsdp and ZeRO-3: tests/distributed/test_preference_distributed.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("reference_shards_worker.py")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("reference-shards")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER),
               str(out)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-4000:]
    return [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_the_sharded_copy_gives_the_whole_copys_logprobs(ranks):
    for rank in ranks:
        assert rank["engine"] == "fsdp"
        assert rank["got"] == pytest.approx(rank["expected"], abs=1e-5)


def test_each_rank_holds_about_half_the_copy_before_and_after_a_pass(ranks):
    for rank in ranks:
        assert 0.45 < rank["before_pass"] / rank["whole_bytes"] < 0.55
        assert rank["after_pass"] == rank["before_pass"] == rank["reported_bytes"]
