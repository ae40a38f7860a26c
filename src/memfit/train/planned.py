"""`memfit train --memory-budget SIZE` / `--gpu NAME`: plan the configuration, print it, then train."""

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
    from memfit.memory.planner import plan, plan_to_overrides

    result = plan(config, budget_bytes=memory.memory_budget, gpu=memory.gpu)
    overrides = plan_to_overrides(result)
    log.info("memfit: planned for %s: %s", memory.gpu or f"{memory.memory_budget} bytes", " ".join(f"--{k.replace('_', '-')} {v}" for k, v in overrides.items()))
    return config.replace(**overrides)
