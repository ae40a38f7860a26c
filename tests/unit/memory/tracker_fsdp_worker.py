"""One rank of test_tracker_fsdp: FSDP2 over 3 linear blocks under the MemoryTracker; writes what it saw as JSON."""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

from memfit.memory.categories import PARAMETERS
from memfit.memory.tracker import MemoryTracker


def main(out_prefix: str) -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()) for _ in range(3)])
    for block in blocks:
        fully_shard(block)
    fully_shard(blocks)
    tracker = MemoryTracker("cpu")
    tracker.attach(blocks)
    seen: list = []
    for index, block in enumerate(blocks):
        block[0].register_forward_hook(
            lambda module, args, output, index=index: seen.append(["inside", index, tracker.breakdown()[PARAMETERS]])
        )
        block.register_forward_hook(
            lambda module, args, output, index=index: seen.append(["after", index, tracker.breakdown()[PARAMETERS]])
        )
    steps = []
    with tracker:
        for _ in range(2):
            seen.clear()
            sharded = tracker.breakdown()[PARAMETERS]
            blocks(torch.randn(8, 64)).sum().backward()
            steps.append({"sharded": sharded, "seen": list(seen), "end": tracker.breakdown()[PARAMETERS]})
    with open(f"{out_prefix}{dist.get_rank()}.json", "w") as handle:
        json.dump(steps, handle)
    dist.barrier()  # neither rank tears gloo down while the other still talks to it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    # Leave without interpreter teardown: a background thread destroyed there has aborted a rank
    # ("terminate called without an active exception") after its results were written.
    os._exit(0)
