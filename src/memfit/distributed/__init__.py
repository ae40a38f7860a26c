"""Training on several ranks: FSDP2 and DeepSpeed ZeRO glue, launched by torchrun or deepspeed.

    torchrun --nproc_per_node 4 -m memfit train ... --sharding fsdp      # FSDP2
    torchrun --nproc_per_node 4 -m memfit train ... --sharding ddp       # replicate
    torchrun --nproc_per_node 4 -m memfit train ... --deepspeed ds.json  # ZeRO 1-3

`context` knows the rank and world size; the engines (`parallel.DataParallelEngine`,
`fsdp.FullyShardedEngine`, `zero.DeepSpeedEngine`) implement memfit.train.engine.Engine,
which also picks them (`choose_engine`); nothing here imports memfit.train.
`checkpoint_io` writes sharded checkpoints atomically; `memory` counts what a rank holds.
See docs/distributed.md.
"""
