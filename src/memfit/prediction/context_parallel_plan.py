"""The longest context on N GPUs: `memfit plan --gpus N --maximize seq-len` searches context-parallel sizes.

Each size N_cp that divides the GPUs and the model's key-value heads (so Ulysses exchanges K and V
without repeating them; the query heads then divide too) is planned as the planner plans one:
the longest sequence that fits, over the same levers (checkpointing, tiled MLP, chunked loss,
offloaded checkpoints, the optimizer), with every estimate one rank's of the split (the
estimator's step at seq/N_cp tokens and the all-to-all buffers, FSDP2 over all N GPUs) and every
step time with Ulysses' traffic over the GPU's link. The longest context wins; at the same length
the faster plan. The plan says the split, and its command carries --context-parallel.
"""

from __future__ import annotations

from typing import Any

from memfit.config import TrainConfig
from memfit.errors import DoesNotFitError
from memfit.prediction.plan_result import PlanResult
from memfit.prediction.trade_offs import train_command


def context_parallel_sizes(hf_config: Any, gpus: int) -> list[int]:
    """The context-parallel sizes a plan on `gpus` GPUs tries: divisors of `gpus` that divide the key-value heads
    (and the query heads), smallest first."""
    heads = getattr(hf_config, "num_attention_heads", None) or 1
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    return [size for size in range(1, gpus + 1) if gpus % size == 0 and kv_heads % size == 0 and heads % size == 0]


def searches_context_parallel(config: TrainConfig, maximize: str | None, world_size: int) -> bool:
    """Whether a plan searches the context-parallel sizes: the longest context on more than one GPU, with no
    --context-parallel given (a given size is planned as it is) and a causal LM (the only task the split runs)."""
    from memfit.prediction.candidates import user_set

    return (maximize == "seq-len" and world_size > 1 and config.task.task == "causal-lm"
            and not user_set(config, "context_parallel"))


def _reach(size: int, result: PlanResult) -> tuple[int, int, float]:
    """How far a plan goes: the planned length, what memory alone allows (past the model's positions), its speed
    (the planner counts a row per GPU; a context group of `size` GPUs trains one)."""
    seq_len = result.plan["seq_len"]
    return seq_len, result.memory_limit_seq_len or seq_len, result.tokens_per_second / size


def plan_longest_context(config: TrainConfig, *, gpus: int, hf_config: Any, plan_one, **plan_options) -> PlanResult:
    """The longest-context plan over every context-parallel size on `gpus` GPUs (see the module docstring).

    `plan_one(config, world_size=..., sharding=..., maximize=..., hf_config=..., explain=..., **plan_options)` is
    the planner's `plan`; each size is planned with `--context-parallel` set on `config`.

    Raises:
        DoesNotFitError: no size fits (the message is the plan's without context parallelism).
    """
    found: list[tuple[int, PlanResult]] = []
    for size in context_parallel_sizes(hf_config, gpus):
        try:
            result = plan_one(config.replace(context_parallel=size), world_size=gpus, sharding="fsdp",
                              maximize="seq-len", hf_config=hf_config, explain=False, **plan_options)
        except DoesNotFitError:
            continue
        found.append((size, result))
    if not found:  # the planner's own message: how much is needed, what to try
        return plan_one(config.replace(context_parallel=1), world_size=gpus, sharding="fsdp", maximize="seq-len",
                        hf_config=hf_config, explain=True, **plan_options)
    size, best = max(found, key=lambda pair: _reach(*pair))
    return _with_split(config, best, size, gpus, {each: _reach(each, result)[1] for each, result in found},
                       plan_options.get("gpu"))


def _with_split(config: TrainConfig, result: PlanResult, size: int, gpus: int, reached: dict[int, int],
                gpu) -> PlanResult:
    """`result` saying its split: --context-parallel in the plan and the command, the longest context of each
    size tried in what it trades."""
    result.plan["context_parallel"] = size
    result.command = train_command(config, dict(result.plan), gpu, result.budget_bytes, gpus)
    tried = ", ".join(f"{gpus // each} x {each}: {seq_len:,}" for each, seq_len in sorted(reached.items()))
    result.trades = [f"context parallelism: {gpus // size} data-parallel x {size} context-parallel (Ulysses); each"
                     f" rank holds {-(-result.plan['seq_len'] // size):,} tokens of every sequence and needs"
                     f" {result.host_bytes / 1024 ** 3:.1f} GiB of host memory; longest context memory allows by dp x cp: {tried}",
                     *result.trades]
    return result
