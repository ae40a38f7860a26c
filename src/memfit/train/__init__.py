"""Training: `setup` builds a run, `engine` says where its steps run (one process here; DDP, FSDP2
and DeepSpeed in memfit.distributed), `step` runs one optimizer step with exact accumulation and
OOM recovery, `loop` drives the steps, `metrics`, `progress` and `run_summary` report,
`batch_size` finds the largest micro-batch that fits, `profiling` runs `memfit profile`.
See docs/architecture.md."""
