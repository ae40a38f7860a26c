"""Every memory technique, in the order it is applied: the one list setup, prediction and the report loop over.

    for technique in techniques():          # memfit's own, then any registered beyond them
        ...

The order is data: each technique names the techniques it must come after (`Technique.after`), and
`check_order` refuses an order that breaks one, or a name given twice, when the registry is built and whenever a
technique is registered. A technique beyond memfit's own joins with `register` (one call, from its module): its
settings become flags and YAML keys, and every loop below sees it with no other edit.
"""

from __future__ import annotations

from collections.abc import Iterable

from memfit.config import register_section, unregister_section
from memfit.techniques import (
    attention,
    auto_checkpointing,
    compile,
    context_parallel,
    efficient_lora,
    expert_dequant_groups,
    expert_streaming,
    host_embedding,
    kernels,
    lora,
    loss,
    nf4_head,
    offload,
    optimizer_in_backward,
    optimizer_offload,
    optimizers,
    precision,
    rms_norm,
    staged_weights,
    tiled_experts,
)
from memfit.techniques.technique import STAGES, Technique

BUILT_IN: tuple[Technique, ...] = (
    # chosen before the model is loaded: what the device computes in, which attention kernel
    precision.TECHNIQUE,
    attention.TECHNIQUE,
    # applied to the model, in this order, before the engine wraps it
    auto_checkpointing.TECHNIQUE,  # first: LoRA must know whether blocks are checkpointed
    lora.TECHNIQUE,
    efficient_lora.TECHNIQUE,
    expert_streaming.TECHNIQUE,  # before tiled experts wrap the experts' call
    nf4_head.TECHNIQUE,
    host_embedding.TECHNIQUE,
    expert_dequant_groups.TECHNIQUE,
    staged_weights.TECHNIQUE,  # what a staged load left in host memory and no technique above took
    tiled_experts.TECHNIQUE,
    rms_norm.TECHNIQUE,  # liger's RMSNorm, applied next, replaces it where it runs
    kernels.TECHNIQUE,
    compile.TECHNIQUE,  # last: compiles the blocks as the techniques above left them
    # how the optimizer is built (engine.prepare), then how a micro-batch runs
    optimizers.TECHNIQUE,
    optimizer_in_backward.TECHNIQUE,
    optimizer_offload.TECHNIQUE,
    loss.TECHNIQUE,
    offload.TECHNIQUE,
    context_parallel.TECHNIQUE,  # each rank's shard of every row (distributed/context_parallel.py)
)

_registered: list[Technique] = []


def check_order(order: Iterable[Technique]) -> None:
    """Raise ValueError when a technique comes before one it must follow, a name repeats, or stages interleave."""
    seen: dict[str, Technique] = {}
    last_stage = 0
    for technique in order:
        if technique.name in seen:
            raise ValueError(f"technique {technique.name!r} is registered twice")
        missing = [name for name in technique.after if name not in seen]
        if missing:
            raise ValueError(f"technique {technique.name!r} must come after {', '.join(missing)}")
        stage = STAGES.index(technique.stage)
        if technique.stage == "model" and stage < last_stage:
            raise ValueError(f"technique {technique.name!r} changes the model after a later stage's technique")
        last_stage = max(last_stage, stage)
        seen[technique.name] = technique


def techniques(stage: str | None = None) -> tuple[Technique, ...]:
    """The registry in application order (only `stage`'s techniques when given)."""
    # a registered technique joins the end of its stage (a stable sort keeps the order within each stage)
    every = tuple(sorted((*BUILT_IN, *_registered), key=lambda t: STAGES.index(t.stage)))
    return every if stage is None else tuple(t for t in every if t.stage == stage)


def technique(name: str) -> Technique:
    for candidate in techniques():
        if candidate.name == name:
            return candidate
    raise KeyError(name)


def register(new: Technique) -> None:
    """Add a technique after memfit's own (in registration order); its settings section joins the config."""
    check_order(sorted((*BUILT_IN, *_registered, new), key=lambda t: STAGES.index(t.stage)))
    if new.section is not None:
        register_section(new.name, new.section)
    _registered.append(new)


def unregister(name: str) -> None:
    """Remove a registered technique (memfit's own stay)."""
    for index, registered in enumerate(_registered):
        if registered.name == name:
            del _registered[index]
            if registered.section is not None:
                unregister_section(registered.name)
            return
    raise KeyError(name)


check_order(BUILT_IN)


def memory_terms(run, facts) -> dict[str, float]:
    """Every technique's bytes at the estimate's peak moment, summed by category (see Technique.memory_terms)."""
    total: dict[str, float] = {}
    for each in techniques():
        if each.memory_terms is not None:
            for category, size in each.memory_terms(run, facts).items():
                total[category] = total.get(category, 0.0) + size
    return total


def speed_terms(run, facts) -> float:
    """Every technique's seconds added to a step (see Technique.speed_terms)."""
    return sum(each.speed_terms(run, facts) for each in techniques() if each.speed_terms is not None)


def planner_values(facts) -> list[dict]:
    """Every technique's config changes the planner may try, each as a {flat name: value} dict."""
    return [change for each in techniques() if each.planner_values is not None for change in each.planner_values(facts)]
