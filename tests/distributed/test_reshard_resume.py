"""Resuming on another number of ranks (FSDP2): a 2-rank checkpoint resumed in one process, and a one-process
checkpoint resumed on 2 FSDP2 ranks, end on the weights of the runs that never changed (to 1e-5, the tolerance
between engines: the ranks sum in another order)."""

from __future__ import annotations

import json
import shutil

import pytest
from torchrun_helpers import assert_same_weights, final_weights, run_many

pytestmark = pytest.mark.distributed


def _checkpoint_copy(source, target):
    """What a run killed after its step-2 checkpoint leaves."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("final", "step-4", "metrics.jsonl"))
    return target


@pytest.fixture(scope="module")
def resharded(sgd_args, tmp_path_factory):
    root = tmp_path_factory.mktemp("reshard")
    args = [*sgd_args, "--max-steps", "4", "--save-every", "2", "--batch-size", "4"]
    run_many([{"name": "one", "args": [*args, "--gradient-accumulation-steps", "2", "--output-dir", str(root / "one")]}],
             root / "l1", nproc=1)
    one_to_two = _checkpoint_copy(root / "one", root / "one-to-two")
    logs = run_many([
        {"name": "two", "args": [*args, "--sharding", "fsdp", "--output-dir", str(root / "two")]},
        {"name": "one-to-two", "args": [*args, "--sharding", "fsdp", "--resume", "auto", "--output-dir", str(one_to_two)]},
    ], root / "l2")
    two_to_one = _checkpoint_copy(root / "two", root / "two-to-one")
    logs |= run_many([{"name": "two-to-one", "args": [*args, "--gradient-accumulation-steps", "2", "--resume", "auto",
                                                     "--output-dir", str(two_to_one)]}], root / "l3", nproc=1)
    return root, logs


def test_two_ranks_to_one(resharded):
    root, logs = resharded
    state = json.loads((root / "two" / "checkpoints" / "step-2" / "trainer_state.json").read_text())
    assert state["world_size"] == 2 and (root / "two" / "checkpoints" / "step-2" / "shards").is_dir()
    assert "resumed from" in logs["two-to-one"] and "world_size 2 -> 1" in logs["two-to-one"]
    assert_same_weights(final_weights(root / "two"), final_weights(root / "two-to-one"))
    assert_same_weights(final_weights(root / "one"), final_weights(root / "two-to-one"))


def test_one_rank_to_two(resharded):
    root, logs = resharded
    assert "resumed from" in logs["one-to-two"] and "world_size 1 -> 2" in logs["one-to-two"]
    assert_same_weights(final_weights(root / "one"), final_weights(root / "one-to-two"))
    assert_same_weights(final_weights(root / "two"), final_weights(root / "one-to-two"))
