"""Faults the GRPO distributed tests inject into one run each (exactness_worker.py's "fault": MODULE:NAME)."""

from __future__ import annotations

import contextlib

import torch

from memfit.tasks import grpo


@contextlib.contextmanager
def seeded_by_rank():
    """Each completion's seed mixed with the rank: the ranks sample other completions than one process would."""
    original = grpo.completion_seed

    def by_rank(seed, step, prompt_index, generation):
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return original(seed + rank, step, prompt_index, generation)

    grpo.completion_seed = by_rank
    try:
        yield
    finally:
        grpo.completion_seed = original


@contextlib.contextmanager
def counted_by_rank():
    """The step's completions and tokens counted on each rank alone: each rank's tokens weighed by its own count."""
    original = grpo._step_counts

    def own_rows(everyone, start, mine):
        return original(everyone[start:start + mine], 0, mine)

    grpo._step_counts = own_rows
    try:
        yield
    finally:
        grpo._step_counts = original


@contextlib.contextmanager
def metrics_of_each_rank():
    """The loss's metrics (kl, clip_ratio/*) over each rank's own tokens: rank 0's figures logged alone."""
    original = grpo._summed_over_ranks
    grpo._summed_over_ranks = lambda values: values
    try:
        yield
    finally:
        grpo._summed_over_ranks = original


@contextlib.contextmanager
def counted_collectives():
    """Not a fault: counts the collective calls memfit.tasks.grpo makes itself (all_gather_object, all_reduce, from
    grpo.py or from distributed/context.py's helpers it calls), written as JSON to $GRPO_COLLECTIVES_FILE.rankR."""
    import json
    import os
    import sys

    counts = {"all_gather_object": 0, "all_reduce": 0}
    originals = {name: getattr(torch.distributed, name) for name in counts}

    def made_by_grpo() -> bool:
        caller = sys._getframe(2)  # the frame that called the collective
        if caller.f_code.co_filename.endswith("distributed/context.py"):
            caller = caller.f_back
        return caller is not None and caller.f_code.co_filename.endswith("tasks/grpo.py")

    def counting(name):
        def collective(*args, **kwargs):
            if made_by_grpo():
                counts[name] += 1
            return originals[name](*args, **kwargs)
        return collective

    for name in counts:
        setattr(torch.distributed, name, counting(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.distributed, name, original)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        with open(f"{os.environ['GRPO_COLLECTIVES_FILE']}.rank{rank}", "w", encoding="utf-8") as file:
            json.dump(counts, file)
