"""Faults the context-parallel tests inject into one run each (exactness_worker.py's "fault": MODULE:NAME)."""

from __future__ import annotations

import contextlib

import torch

from memfit.distributed import context_parallel, sequence_shards


@contextlib.contextmanager
def labels_shifted_after_split():
    """Each shard's labels cut to its own positions, then shifted in the loss: the shard's last position loses its
    target (the first token of the next shard)."""
    original = sequence_shards.shard_batch

    def after_split(batch, rank, shards):
        shard = original(batch, rank, shards)
        inputs = shard["input_ids"].size(1)
        shard["labels"] = torch.cat([shard["labels"][:, :1], shard["labels"][:, 1:inputs]], dim=1)  # length = inputs
        return shard

    sequence_shards.shard_batch = after_split
    try:
        yield
    finally:
        sequence_shards.shard_batch = original


@contextlib.contextmanager
def per_rank_token_count():
    """The loss normalizer counted once per rank: every sample's tokens N times over, the update N times too small."""
    original = context_parallel.loss_normalizer_share
    context_parallel.loss_normalizer_share = lambda size: 1.0
    try:
        yield
    finally:
        context_parallel.loss_normalizer_share = original


@contextlib.contextmanager
def positions_restart_per_shard():
    """Each shard's positions counted from 0, as if the shard were a row of its own: RoPE (and the document mask
    built from the positions) see the wrong place of every token after the first shard."""
    original = sequence_shards.shard_batch

    def restarted(batch, rank, shards):
        shard = original(batch, rank, shards)
        shard["position_ids"] = shard["position_ids"] - shard["position_ids"][:, :1]
        return shard

    sequence_shards.shard_batch = restarted
    try:
        yield
    finally:
        sequence_shards.shard_batch = original
