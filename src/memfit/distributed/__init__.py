"""Training on several ranks: FSDP2 and DeepSpeed ZeRO glue, launched by torchrun or deepspeed.

    torchrun --nproc_per_node 4 -m memfit train ... --sharding fsdp      # FSDP2
    torchrun --nproc_per_node 4 -m memfit train ... --sharding ddp       # replicate
    torchrun --nproc_per_node 4 -m memfit train ... --deepspeed ds.json  # ZeRO 1-3

`context` knows the rank and world size; `parallel.prepare_parallel` picks the engine
(`parallel.DataParallel`, `fsdp.FullyShardedParallel`, `zero.DeepSpeedParallel`);
`checkpoint_io` writes sharded checkpoints atomically; `memory` counts what a rank holds.
See docs/distributed.md.
"""
