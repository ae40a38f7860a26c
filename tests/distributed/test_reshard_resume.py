"""Resuming on another number of ranks (FSDP2): a 2-rank checkpoint resumed in one process, and a one-process
checkpoint resumed on 2 FSDP2 ranks, end on the weights of the runs that never changed (to 1e-5, the tolerance
between engines: the ranks sum in another order)."""

from __future__ import annotations

import json

import pytest
from torchrun_helpers import assert_same_weights, checkpoint_copy, final_weights

pytestmark = pytest.mark.distributed


@pytest.fixture(scope="module")
def resharded(references, engine_runs, later_runs, reshard_args, warm_memfit, tmp_path_factory):
    """Starting ranks costs more than these 4-step runs, so three of the four share the session's launches
    (conftest.py): the one-process run `one` with the references, the 2-rank run `two` with engine_runs, `one`'s
    step-2 checkpoint resumed on 2 ranks (`one-to-two`) with later_runs. Only `two`'s checkpoint resumed in one
    process (`two-to-one`) runs on its own, in a child forked from the session's warm server (tests/memfit_cli.py)."""
    root = tmp_path_factory.mktemp("reshard")
    for name, source in (("one", references["reshard-one"]), ("two", engine_runs["reshard-two"]),
                         ("one-to-two", later_runs["reshard-one-to-two"])):
        (root / name).symlink_to(source, target_is_directory=True)
    two_to_one = checkpoint_copy(root / "two", root / "two-to-one", 4)
    done = warm_memfit.run("train", *reshard_args, "--gradient-accumulation-steps", "2", "--resume", "auto",
                           "--output-dir", two_to_one)
    assert done.returncode == 0, done.stderr[-4000:]
    return root, {"two-to-one": done.stderr, "one-to-two": later_runs["logs"]["reshard-one-to-two"]}


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
