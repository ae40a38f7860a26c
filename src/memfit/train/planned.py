"""What a run asks memfit to decide before it starts: `--memory-budget SIZE` / `--gpu NAME` (plan the
configuration, log it) and `--auto-batch-size` (probe the largest micro-batch that fits).

`decide_before_training` is called by `memfit train` and by the library's `memfit.train(config)` alike,
so both run the same configuration for the same settings."""

from __future__ import annotations

import logging

from memfit.config import TrainConfig

log = logging.getLogger("memfit")


def apply_plan_if_asked(config: TrainConfig) -> TrainConfig:
    """Return `config` changed by the planner when a budget or GPU is given (checkpointing auto excepted)."""
    memory = config.memory
    if memory.memory_budget is None and memory.gpu is None:
        return config
    if memory.gradient_checkpointing == "auto":
        return config  # the budget steers which blocks are checkpointed, nothing else
    from memfit.prediction.planner import plan, plan_to_overrides

    result = plan(config, budget_bytes=memory.memory_budget, gpu=memory.gpu)
    overrides = plan_to_overrides(result)
    log.info("memfit: planned for %s: %s", memory.gpu or f"{memory.memory_budget} bytes", " ".join(f"--{k.replace('_', '-')} {v}" for k, v in overrides.items()))
    from memfit.train.trials import trial_then_record

    return trial_then_record(config.replace(**overrides), result)  # the fastest measured of the best few


def decide_before_training(config: TrainConfig) -> TrainConfig:
    """`config` with the planner's and the batch-size finder's choices applied, where the run asks for them."""
    config = apply_plan_if_asked(config)
    if config.training.auto_batch_size:
        config = with_found_batch_size(config)
    return config


def with_found_batch_size(config: TrainConfig) -> TrainConfig:
    """--auto-batch-size: probe first, then train at the recommended split (same effective batch)."""
    import gc

    from memfit.train.batch_size import find_batch_size

    found = find_batch_size(config)
    gc.collect()  # the probing session's model and optimizer go before training starts
    log.info(
        "memfit: --auto-batch-size: micro-batch %d x %d accumulation (largest that fits: %d)",
        found.recommended_batch_size, found.gradient_accumulation_steps, found.max_batch_size,
    )
    changes = {"batch_size": found.recommended_batch_size, "auto_batch_size": False}
    if config.training.effective_batch_size is None:
        changes["gradient_accumulation_steps"] = found.gradient_accumulation_steps
    return config.replace(**changes)
