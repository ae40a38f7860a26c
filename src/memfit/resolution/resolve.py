"""One pure function from a config, the model's facts and the device to the resolved run.

    run = resolve(config, hf_config, device_type="cuda", bf16_supported=True)

The real run (train/setup.py), the analytical and traced estimates, the speed model and the planner's candidates
all call this function and read the value it returns; none works out again what a setting becomes. Each technique
of the registry decides its own fields (`Technique.resolve`, in registry order: a later technique reads what an
earlier one decided), then every technique's refusals are collected and raised at once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memfit.config import TrainConfig
from memfit.errors import UsageError
from memfit.resolution.registry import techniques
from memfit.techniques.resolved_run import ResolvedRun
from memfit.techniques.technique import RunFacts

WEIGHT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
_FIELDS = frozenset(f.name for f in dataclasses.fields(ResolvedRun))


def resolve(config: TrainConfig, hf_config: Any, device_type: str, *, bf16_supported: bool = True,
                world_size: int = 1, budget_bytes: int | None = None) -> ResolvedRun:
    """What `config` runs on a `device_type` device: every technique's choice, typed. Raises UsageError for a
    combination a technique refuses (every refusal, in one message)."""
    facts = RunFacts(config=config, hf_config=hf_config, device_type=device_type, bf16_supported=bf16_supported,
                     world_size=world_size, budget_bytes=budget_bytes, vocabulary_head=_vocabulary_head(config),
                     engine=engine_label(config, world_size))
    return resolve_from_facts(facts)


def resolve_from_facts(facts: RunFacts) -> ResolvedRun:
    run = ResolvedRun(device_type=facts.device_type, weight_bytes=WEIGHT_BYTES[facts.config.model.dtype])
    for technique in techniques():
        if technique.resolve is None:
            continue
        decided = technique.resolve(facts, run)
        own = {name: value for name, value in decided.items() if name in _FIELDS}
        run = dataclasses.replace(run, **own)
        for name, value in decided.items():
            if name not in _FIELDS:  # a registered technique's own value
                run = run.with_extra(name, value)
    problems = [problem for technique in techniques() if technique.refusals is not None
                for problem in technique.refusals(run, facts)]
    if problems:
        raise UsageError("; ".join(problems))
    return run


def report(run: ResolvedRun) -> dict[str, Any]:
    """What every technique says about this run for the metrics and the report ({name: value})."""
    facts: dict[str, Any] = {}
    for technique in techniques():
        if technique.report is not None:
            facts.update(technique.report(run))
    return facts


def engine_label(config: TrainConfig, world_size: int) -> str:
    """The engine `config` runs on over `world_size` ranks, as refusals name it (train/engine.py chooses it so)."""
    distributed = config.distributed
    if distributed.deepspeed or distributed.zero_stage is not None:
        return "DeepSpeed"
    if world_size <= 1:
        return ""
    return "--sharding fsdp" if distributed.sharding == "fsdp" else "--sharding ddp"


def _vocabulary_head(config: TrainConfig) -> bool:
    from memfit.tasks import TASK_CLASSES

    task = TASK_CLASSES.get(config.task.task)
    return task is None or task.auto_class in ("AutoModelForCausalLM", "AutoModelForMaskedLM")
