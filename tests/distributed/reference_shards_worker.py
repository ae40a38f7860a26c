"""Run by test_reference_shards.py under torchrun (2 CPU ranks, gloo): a tiny Llama's frozen copy sharded by FSDP2
as a --sharding fsdp run shards it, its log-probabilities beside the whole copy's, and the bytes the rank holds of it
before and after a reference pass; one JSON file a rank in the directory given."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the tiny Llama

from memfit.config_loading import load_config  # noqa: E402
from memfit.distributed.reference_shards import rank_bytes, shard_copy  # noqa: E402
from memfit.techniques.reference_model import copy_logprobs, frozen_copy  # noqa: E402
from tiny_llama import tiny_llama  # noqa: E402

CHUNK = 16
"""Tokens a chunk of the head: 3 rows of 20 tokens run the head 4 times after the root's forward."""


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    model = tiny_llama(hidden=64, layers=2, vocab=256)
    whole, whole_bytes = frozen_copy(model)
    sharded, _ = frozen_copy(model)
    sharded, sharding = shard_copy(sharded, whole_bytes, load_config(overrides={"sharding": "fsdp"}),
                                   torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 256, (3, 20), generator=generator)
    labels = input_ids.clone()
    labels[:, :5] = -100  # a prompt, not scored
    expected = copy_logprobs(whole, input_ids, labels, None, CHUNK)
    before = rank_bytes(sharded)
    got = copy_logprobs(sharded, input_ids, labels, None, CHUNK)
    result = {"engine": sharding.engine if sharding else None, "whole_bytes": whole_bytes,
              "reported_bytes": sharding.rank_bytes if sharding else whole_bytes, "before_pass": before,
              "after_pass": rank_bytes(sharded), "expected": expected.tolist(), "got": got.tolist()}
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
