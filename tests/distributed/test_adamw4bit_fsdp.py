"""torchao's 4-bit AdamW under FSDP2 (2 CPU ranks, gloo): exact resume through the sharded checkpoints, agreement
with DDP where the 4-bit blocks are the same, and a one-line refusal where another number of ranks would cut them
anew.

Each rank quantizes its own shard (blocks of 128 values of the flattened shard; shards under 4096 values or not a
multiple of 128 keep full-precision moments), so FSDP2 and DDP quantize the same tensors in the same blocks only
where every shard boundary falls on a block boundary of the whole tensor. The 2-rank runs are part of the session's
shared torchrun launch (adamw4bit_runs.py, conftest.py).
"""

from __future__ import annotations

import math

import pytest
import torch
from adamw4bit_runs import LR, PREFIX, adamw4bit_args
from torchrun_helpers import final_weights

pytestmark = pytest.mark.distributed
pytest.importorskip("torchao", reason="--optimizer adamw-4bit needs torchao (pip install 'memfit[lowmem-optim]')")

RANKS = 2
BLOCK, SMALLEST = 128, 4096  # torchao's 4-bit blocks, and the smallest tensor it quantizes


@pytest.fixture(scope="module")
def runs(shared_launch, llama_dir, text_file, warm_memfit, tmp_path_factory) -> dict:
    """The 2-rank runs of adamw4bit_runs.py, part of the session's shared torchrun launch (conftest.py). Then one
    plain process resumes fsdp4's step-2 checkpoint (refused)."""
    logs = {name.removeprefix(PREFIX): log for name, log in shared_launch["logs"].items() if name.startswith(PREFIX)}
    dirs = {name.removeprefix(PREFIX): path for name, path in shared_launch["dirs"].items() if name.startswith(PREFIX)}
    step2 = dirs["fsdp4"] / "checkpoints" / "step-2"
    # Forked from the session's warm server (tests/memfit_cli.py): a process of its own without importing torch again
    one = warm_memfit.run("train", *adamw4bit_args(llama_dir, text_file), "--max-steps", "4", "--resume", step2,
                          "--output-dir", tmp_path_factory.mktemp("adamw4bit") / "one-process")
    return {"dirs": dirs, "logs": logs, "one": one}


def _same_blocks(shape: torch.Size, ranks: int) -> bool:
    """Whether FSDP2's dim-0 shards over `ranks` are quantized (or not) in the same 128-value blocks as the whole
    tensor that DDP steps."""
    def quantized(numel: int) -> bool:
        return numel >= SMALLEST and numel % BLOCK == 0

    rows, row = shape[0], math.prod(shape[1:])
    per_rank = math.ceil(rows / ranks)
    shards = [(start * row, max(0, min(rows, start + per_rank) - start) * row) for start in range(0, rows, per_rank)]
    if not quantized(rows * row):
        return not any(quantized(numel) for _, numel in shards)
    return all(quantized(numel) and offset % BLOCK == 0 for offset, numel in shards)


def test_resumed_run_ends_on_the_uninterrupted_weights(runs):
    dirs = runs["dirs"]
    assert "resumed from" in runs["logs"]["fsdp4-resumed"]
    assert (dirs["fsdp4"] / "checkpoints" / "step-2" / "shards").is_dir()
    whole, resumed = final_weights(dirs["fsdp4"]), final_weights(dirs["fsdp4-resumed"])
    assert set(whole) == set(resumed)
    for name, tensor in whole.items():
        torch.testing.assert_close(resumed[name], tensor, atol=0, rtol=0, msg=name)  # bitwise


def test_dropping_the_4bit_state_changes_the_weights(runs):
    dirs = runs["dirs"]
    whole, zeroed = final_weights(dirs["fsdp4"]), final_weights(dirs["fsdp4-zeroed"])
    largest = max((zeroed[name] - tensor).abs().max().item() for name, tensor in whole.items())
    assert largest > 1e-4, f"the twin without the 4-bit state ends {largest:.2e} from the uninterrupted run"


def test_fsdp_agrees_with_ddp_where_the_blocks_agree(runs):
    """Step 1 updates from the fp32 moments (the same on both); step 2 reads the dequantized ones, so tensors
    quantized in the same blocks agree to the ranks' summation order (measured: 6e-8 at most), and the others
    (here the queries, the attention outputs, the embeddings and the head: their shards are under 4096 values, or
    cut inside a block) differ by the 4-bit rounding of their moments, up to one step's size (measured: 9.7e-3 at
    lr 1e-2). The second bound is that size, twice: both updates are at most about the learning rate."""
    dirs = runs["dirs"]
    ddp, fsdp = final_weights(dirs["ddp2"]), final_weights(dirs["fsdp2"])
    same = {name for name, tensor in ddp.items() if _same_blocks(tensor.shape, RANKS)}
    assert same and same != set(ddp), "the tiny model should have tensors of both kinds"
    gaps = {name: (fsdp[name].float() - tensor.float()).abs().max().item() for name, tensor in ddp.items()}
    assert max(gaps[name] for name in same) <= 1e-5, {name: gaps[name] for name in same}
    # The other layout shows: full-precision moments on one side, 4-bit ones on the other.
    assert 1e-4 < min(gaps[name] for name in set(ddp) - same) and max(gaps.values()) <= 2 * LR, gaps


def test_another_number_of_ranks_is_refused_in_one_line(runs):
    one = runs["one"]
    errors = [line for line in one.stderr.splitlines() if "error:" in line]
    assert one.returncode == 2 and len(errors) == 1 and "Traceback" not in one.stderr, one.stderr[-2000:]
    assert "--optimizer adamw-4bit" in errors[0] and "--nproc_per_node 2 --sharding fsdp" in errors[0]
    ddp_to_fsdp = [line for line in runs["logs"]["ddp-to-fsdp"].splitlines() if "error:" in line]
    assert len(ddp_to_fsdp) == 1 and "whole tensors" in ddp_to_fsdp[0], runs["logs"]["ddp-to-fsdp"][-2000:]
