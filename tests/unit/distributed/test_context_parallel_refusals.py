"""What --context-parallel refuses before anything starts, and the other tools' names for it."""

from __future__ import annotations

import pytest

from memfit.config_loading import load_config
from memfit.errors import UsageError
from memfit.resolution.resolve import resolve
from memfit.techniques.context_parallel import context_parallel_refusals


def test_one_rank_ring_mode_and_indivisible_heads_are_refused_in_one_line_each():
    assert context_parallel_refusals(1, "ring", 1, "cpu") == []
    assert context_parallel_refusals(2, "ulysses", 4, "cpu", heads=4) == []
    found = context_parallel_refusals(2, "ring", 3, "cpu", heads=6)
    assert any("must divide the number of ranks (3)" in line for line in found)
    assert any("use --context-parallel-mode ulysses" in line for line in found)
    assert context_parallel_refusals(4, "auto", 4, "cpu", heads=6) == [
        "--context-parallel 4 (Ulysses) needs the attention heads (6) divisible by it: pick a divisor of the head count"]
    assert "torchrun" in context_parallel_refusals(2, "auto", 1, "cpu")[0]
    assert context_parallel_refusals(2, "auto", 2, "cpu") == []  # every engine composes: ZeRO averages over all ranks


def test_the_resolver_refuses_through_the_technique():
    config = load_config(overrides=dict(model="tiny", context_parallel=2, context_parallel_mode="ring"))
    with pytest.raises(UsageError, match="use --context-parallel-mode ulysses"):
        resolve(config, None, "cpu", world_size=2)
    config = load_config(overrides=dict(model="tiny", context_parallel=2))
    assert resolve(config, None, "cpu").extra["context_parallel"] == 2  # estimates resolve with no launcher


def test_the_launcher_is_checked_at_the_start():
    from memfit.distributed.context_parallel import check

    with pytest.raises(UsageError, match="launch with torchrun"):
        check(2, "auto", 1, "cpu")
    check(2, "auto", 4, "cpu")


@pytest.mark.parametrize("name", ["context_parallel_size", "cp_size"])
def test_axolotl_and_accelerate_names_set_context_parallel(name, tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text(f"model: tiny\n{name}: 2\n")
    assert load_config(str(path)).distributed.context_parallel == 2
