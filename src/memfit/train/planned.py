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
    from memfit.errors import DoesNotFitError
    from memfit.prediction.planner import plan, plan_to_overrides

    given = config.data.seq_len is not None
    config = with_seq_len_from_data(config)  # plan for the length the run will take
    try:
        result = plan(config, budget_bytes=memory.memory_budget, gpu=memory.gpu)
    except DoesNotFitError as error:
        if given:
            raise
        raise DoesNotFitError(f"{error}; seq-len {config.data.seq_len} came from the data (its longest samples): a"
                              " shorter --seq-len with --truncate or --allow-drop needs less") from None
    overrides = plan_to_overrides(result)
    log.info("memfit: planned for %s: %s", memory.gpu or f"{memory.memory_budget} bytes", " ".join(f"--{k.replace('_', '-')} {v}" for k, v in overrides.items()))
    from memfit.train.trials import trial_then_record

    return trial_then_record(config.replace(**overrides), result)  # the fastest measured of the best few


def with_seq_len_from_data(config: TrainConfig) -> TrainConfig:
    """`config` at the --seq-len its data takes when none is given (memfit.data.lengths: whole samples from their
    lengths, plain text 256), for a plan made before the run reads its data. The data is read into a temporary
    cache (or --cache-dir), so a refusal leaves nothing behind; the run reads it again with the length set."""
    if config.data.seq_len is not None:
        return config
    import dataclasses
    import tempfile

    from memfit.config import DEFAULT_SEQ_LEN
    from memfit.data.samples import plain_text
    from memfit.models.loader import load_tokenizer
    from memfit.models.presets import resolve_model_config
    from memfit.models.rope import scaled_positions
    from memfit.tasks import build_task

    task = build_task(config)  # a table's labels: the same reader the run uses
    positions = scaled_positions(resolve_model_config(config.model.model, config.model.trust_remote_code),
                                 config.model.rope_scale, config.model.rope_scaling)
    if getattr(task, "spec", None) is None and plain_text(config.data):  # windows of 256: nothing to read for it
        return config.with_seq_len(min(DEFAULT_SEQ_LEN, positions or DEFAULT_SEQ_LEN))
    name = config.model.tokenizer or config.model.model
    tokenizer = load_tokenizer("tiny" if name.startswith("preset") else name, config.model.trust_remote_code)
    with tempfile.TemporaryDirectory(prefix="memfit-lengths-") as scratch:
        data_cfg = dataclasses.replace(config.data, cache_dir=config.data.cache_dir or scratch)
        dataset = task.load_data(data_cfg, tokenizer, max_positions=positions, min_samples=1, say=False)
    choice = getattr(getattr(dataset, "policy", None), "from_data", None)
    if choice is not None:  # the run reads the data again at this length and says the rest (drops, cuts) then
        log.info("memfit: %s", choice.describe())
    return config.with_seq_len(dataset.seq_len)


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
