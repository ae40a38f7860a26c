"""--pair-layout split: the two-row layout's chosen rows and rejected rows in two forwards, one side's activations
at the peak instead of both.

A preference loss couples the two sides only through each row's summed log-probability (a scalar a row), so the
update is exactly the one forward's when each side's graph is backpropagated apart with the loss's derivative with
respect to its sums. Autograd does that here, in the step's one backward, without another call to the engine (its
loss scaling, normalizer and gradient hooks stay as they are):

1. the rejected rows run first, under non-reentrant activation checkpointing: their forward keeps only its inputs;
2. the chosen rows run with their graph, and the objective reads both sides' sums as from one forward;
3. in backward, autograd runs the nodes made last first (the loss's, then the chosen graph's, whose activations are
   freed as it goes), and only then reaches the rejected rows' checkpoint, which runs their forward again with its
   graph and backpropagates it.

A parameter's two contributions meet in autograd's buffer and reach its `.grad` once, as in one forward, so the
step's out-of-memory recovery (which freezes the parameters whose gradient already holds a micro-batch) stays
exact. Costs: the rejected rows' forward twice; from the second micro-batch of a step on, the chosen side's
gradient of each parameter waits in that buffer beside its `.grad` while the rejected side runs (a gradient's
bytes); the reference's forward still reads both sides at once, without a graph.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from memfit.techniques.sequence_logprobs import SequenceLogprobs


def logprobs_in_two_forwards(score: Callable[[slice], SequenceLogprobs], chosen_rows: int) -> SequenceLogprobs:
    """The log-probabilities of a two-row batch (`[2 x pairs]`: every chosen row, then every rejected row) as one
    forward gives them, computed in two (module docstring). `score(rows)` runs the policy over the rows `rows` of
    the batch; the first `chosen_rows` rows are the chosen sides' (`pairs`, or the packed rows the chosen sequences
    fill: tasks/pair_packing.py). Without gradients (evaluation, the reference) there is nothing to keep: one
    forward."""
    if not torch.is_grad_enabled():
        return score(slice(None))
    rejected = checkpoint(score, slice(chosen_rows, None), use_reentrant=False)  # first: its backward comes last
    chosen = score(slice(0, chosen_rows))
    per_token = (None if chosen.per_token is None else torch.cat([chosen.per_token, rejected.per_token]))
    return SequenceLogprobs(torch.cat([chosen.sums, rejected.sums]),
                            torch.cat([chosen.token_counts, rejected.token_counts]), per_token)


def split_refusals(config: Any) -> list[str]:
    """What --pair-layout split cannot run with (`unchecked_engine`), one line each."""
    engine = unchecked_engine(config.distributed) if getattr(config.task, "pair_layout", "") == "split" else ""
    if not engine:
        return []
    return [f"--pair-layout split runs the rejected rows' forward again inside backward, which memfit has checked in"
            f" one process (and DDP's local step), not under {engine}: use --pair-layout two-rows there"]


def unchecked_engine(distributed: Any) -> str:
    """The flag of an engine that shards the weights or the sequence, whose hooks the rejected rows' forward inside
    backward has not been checked against (one process has; DDP runs its local step), or ''."""
    if distributed.sharding == "fsdp":
        return "--sharding fsdp"
    if distributed.deepspeed or distributed.zero_stage:
        return "DeepSpeed"
    return "--context-parallel" if distributed.context_parallel > 1 else ""
