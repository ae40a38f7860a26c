"""Context parallelism: one sequence split across the ranks of a context group (--context-parallel N).

Under torchrun the world is data-parallel x context-parallel: a 2-D device mesh ("dp", "cp"),
rank = dp_index x N + cp_index, so a context group is N neighbouring ranks. Every rank of a
context group reads the same samples (the data schedule's rank and world come from the dp
dimension: `DistContext.data_rank`, `data_world_size`) and trains its contiguous shard of every
row (memfit.distributed.sequence_shards); attention sees the whole row through Ulysses
(memfit.distributed.ulysses).

The gradients. Each rank's loss is the summed token loss of its shard; the step divides it by
the target tokens of the whole global batch (`loss_normalizer_share`: the engine's sum over all
ranks counts every sample N times, once per rank of its context group, so it is divided by N).
The gradient of a shared weight is then the sum of every rank's gradient, over the context group
and the data group alike: exactly what DDP's all-reduce and FSDP2's reduce-scatter over the
whole world already do. So the engines are unchanged: DDP and DeepSpeed sum over all ranks,
FSDP2 shards over dp x cp flattened (the whole world, as torchtitan does), because every rank
holds the same weights and needs the same summed gradient whatever its shard.

Which implementation runs: memfit's all-to-all over torch.distributed (gloo or NCCL), everywhere.
DeepSpeed's UlyssesSPAttentionHF runs on CPU gloo too and gives the same attention on plain
rows (tests/distributed/test_ulysses_parity.py), but with an SDPA core it does not keep packed
samples apart (only flash-attention's variable-length kernel reads the gathered positions), and
it fixes the batch and head shapes at registration; memfit's builds the document mask of the
whole row from the gathered positions. PyTorch's ring attention (mode ring) is not wired:
refused, with the reason.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from memfit.distributed.context import DistContext
from memfit.errors import UsageError
from memfit.techniques.context_parallel import context_parallel_refusals

log = logging.getLogger("memfit")


@dataclass
class ContextParallel:
    """This rank's place in its context group, and what runs there."""

    size: int
    """Ranks one sequence is split over (--context-parallel)."""
    rank: int
    """This rank's shard of every row (0 .. size - 1)."""
    group: object
    """The torch.distributed process group of the context group (None when size is 1)."""
    implementation: str
    """What runs, in words: 'ulysses (memfit's all-to-all over gloo) across 2 ranks'."""


_ACTIVE: list[ContextParallel] = []


def active() -> ContextParallel | None:
    """The context parallelism of this process's run, or None when sequences are not split."""
    return _ACTIVE[-1] if _ACTIVE else None


def check(size: int, mode: str, world_size: int, device_type: str, task: str = "causal-lm") -> None:
    """Raise one UsageError with every refusal the config and the launcher show (the model's heads are checked
    when the run is resolved on its config: memfit.techniques.context_parallel)."""
    found = context_parallel_refusals(size, mode, world_size, device_type, task=task)
    if found:
        raise UsageError("; ".join(found))


def start(dist: DistContext, size: int, device_type: str) -> ContextParallel | None:
    """Build the ("dp", "cp") mesh, register the attention and record the data dimension in `dist`."""
    _ACTIVE.clear()
    if size <= 1:
        return None
    import torch.distributed as tdist
    from torch.distributed.device_mesh import init_device_mesh

    from memfit.distributed.ulysses import use_context_group

    mesh = init_device_mesh(device_type, (dist.world_size // size, size), mesh_dim_names=("dp", "cp"))
    group = mesh["cp"].get_group()
    dist.context_parallel = size
    backend = tdist.get_backend(group)
    use_context_group(group, size)
    chosen = ContextParallel(size=size, rank=dist.rank % size, group=group,
                             implementation=f"ulysses (memfit's all-to-all over {backend}) across {size} ranks")
    _ACTIVE.append(chosen)
    return chosen


def use_ulysses_attention(model) -> str:
    """Switch `model`'s attention to memfit's Ulysses attention; returns the implementation name."""
    from memfit.distributed.ulysses import register_ulysses_attention

    name = register_ulysses_attention()
    model.set_attn_implementation(name)
    return name


def loss_normalizer_share(size: int) -> float:
    """The share of the engine's all-rank target count that is this run's: each sample is counted once per rank
    of its context group (see the module docstring)."""
    return 1.0 / size


def sharded_collate(collate, chosen: ContextParallel):
    """`collate`, then this rank's shard of the batch (memfit.distributed.sequence_shards)."""
    from memfit.distributed.sequence_shards import shard_batch

    def collate_shard(samples, pad_token_id):
        return shard_batch(collate(samples, pad_token_id), chosen.rank, chosen.size)

    return collate_shard


def sum_over_context_group(total):
    """`total` (a tensor of this rank's shard) summed over its context group: the whole rows' sum (evaluation)."""
    chosen = active()
    if chosen is None:
        return total
    import torch.distributed as tdist

    summed = total.clone()
    tdist.all_reduce(summed, group=chosen.group)
    return summed
