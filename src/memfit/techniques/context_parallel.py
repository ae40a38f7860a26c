"""Context parallelism as a technique: what --context-parallel N resolves to and what it refuses.

Saves: each rank of a context group holds 1/N of every row's activations (and logits); the
weights, gradients and optimizer state are as the engine keeps them (replicated under DDP,
sharded over all ranks under FSDP2 and DeepSpeed ZeRO, whose averaging over the whole world
the loss normalizer undoes as under FSDP2). Costs: per layer two all-to-alls of the attention's
q, k, v and output (memfit.distributed.ulysses), and the ranks of a group read the same samples,
so the data-parallel width is the world over N. The mesh, the split and the attention live in
memfit.distributed (context_parallel.py, sequence_shards.py, ulysses.py); this module only
decides and refuses, before anything starts.
"""

from __future__ import annotations

from typing import Any


def context_parallel_refusals(size: int, mode: str, world_size: int | None, device_type: str, *,
                              heads: int | None = None, fused_loss: bool = False,
                              task: str = "causal-lm") -> list[str]:
    """Why --context-parallel SIZE cannot run here, one line each (empty: it runs).

    Every engine composes (DDP, FSDP2 and DeepSpeed reduce over the whole world, as the split's gradients need).
    `world_size`: the ranks launched, checked at the run's start (None: not checked; the estimates and the plan
    resolve a run per rank, with no launcher). `heads`: the model's attention heads where known (Ulysses splits them over the group; key-value
    heads that do not divide are repeated per query head, so only the query heads must).
    """
    if size <= 1:
        return []
    found = []
    if world_size is None:
        pass
    elif world_size <= 1:
        found.append(f"--context-parallel {size} splits each sequence over ranks: launch with torchrun"
                     f" --nproc_per_node {size} (or a multiple), or drop it")
    elif world_size % size:
        found.append(f"--context-parallel {size} must divide the number of ranks ({world_size}): pick a divisor")
    if mode == "ring":
        found.append("--context-parallel-mode ring (PyTorch's ring attention) is not wired in memfit"
                     + ("" if device_type == "cuda" else " and needs CUDA") + ": use --context-parallel-mode ulysses")
    if heads is not None and heads % size:
        found.append(f"--context-parallel {size} (Ulysses) needs the attention heads ({heads}) divisible by it:"
                     " pick a divisor of the head count")
    if fused_loss:
        found.append("--context-parallel needs memfit's loss (a shard's last target comes from the next shard):"
                     " use --kernels none")
    if task != "causal-lm":
        found.append(f"--context-parallel splits causal-LM rows; the {task} task is not split: drop it")
    return found


def _resolve(facts, run) -> dict[str, Any]:
    return {"context_parallel": facts.config.distributed.context_parallel}


def _refusals(run, facts) -> list[str]:
    distributed = facts.config.distributed
    heads = getattr(facts.hf_config, "num_attention_heads", None) if facts.hf_config is not None else None
    return context_parallel_refusals(distributed.context_parallel, distributed.context_parallel_mode,
                                     None, facts.device_type, heads=heads,
                                     fused_loss=run.fused_loss, task=facts.config.task.task)


def _report(run) -> dict[str, Any]:
    size = run.extra.get("context_parallel", 1)
    return {"context_parallel": size} if size > 1 else {}


def _technique():
    from memfit.techniques.technique import Technique

    return Technique(
        name="context_parallel", stage="step", settings=("context_parallel", "context_parallel_mode"),
        resolve=_resolve, refusals=_refusals, report=_report,
        summary="each rank of a context group holds 1/N of every sequence's activations: two all-to-alls per layer",
    )


TECHNIQUE = _technique()
