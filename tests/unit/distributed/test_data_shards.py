"""`memfit data --context-parallel N` shows where each sample's row is cut, as training cuts it.

The shard layout comes from the split training uses (memfit.distributed.sequence_shards.shard_batch): the
shards' targets add up to the row's, because the targets are taken before the split; a split that shifted the
targets after cutting would lose the last token of every shard but the last, and the sum would fall short.
"""

from __future__ import annotations

import torch

from memfit.cli.data import inspect_dataset, render
from memfit.config_loading import load_config
from memfit.distributed.sequence_shards import shard_layout


def test_the_shards_cover_the_row_and_their_targets_add_up_to_the_rows():
    ids = torch.arange(10)
    labels = ids.clone()
    labels[:3] = -100  # a prompt of 3 tokens: 7 targets (the first token is never one)
    layout = shard_layout(ids, labels, 4)  # 10 tokens padded to 12: 3 a shard
    assert [(s["first"], s["last"], s["first_position"]) for s in layout] == [(0, 2, 0), (3, 5, 3), (6, 8, 6),
                                                                               (9, 11, 9)]
    assert sum(s["targets"] for s in layout) == 7
    assert layout[0]["targets"] == 1  # position 2 predicts token 3, the first of the next shard


def test_memfit_data_prints_each_ranks_shard(llama_dir, text_file):
    config = load_config(None, [("dataset", str(text_file)), ("model", str(llama_dir)), ("seq_len", "64"),
                                ("context_parallel", "2")])
    report = inspect_dataset(config, show=1)
    shards = report["shown"][0]["context_shards"]
    assert [s["rank"] for s in shards] == [0, 1]
    assert sum(s["targets"] for s in shards) == report["shown"][0]["target_tokens"]
    assert "--context-parallel 2: rank 0: tokens 0-" in render(report)
