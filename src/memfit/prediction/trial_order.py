"""The order in which trials (memfit.train.trials) meet a plan's ranked configurations: shapes first.

A trial's few slots should go to configurations whose speed differs (micro-batch, checkpointing,
optimizer in backward, precision, weight dtype, compile), not to one shape's loss-chunk or optimizer
variants, which run at its speed (and over the cap where it does). The planner orders its ranked list
this way before it cuts it, so that the runners-up of every shape that fits reach the trials, and the
speed model's rank correlation can be measured over several shapes.
"""

from __future__ import annotations

from typing import Any

SHAPE_KEYS = ("batch_size", "gradient_checkpointing", "optimizer_in_backward", "precision", "dtype", "compile")
"""The switches that change a step's speed by more than noise on the same model and data."""


def shape_of(plan: dict[str, Any]) -> tuple:
    return tuple(plan.get(key) for key in SHAPE_KEYS)


def shapes_first(items: list[Any], plan_of: Any = lambda item: item["plan"]) -> list[Any]:
    """`items` (best first) with the best of each shape first, in rank order, then the rest in rank order.
    The first item stays first (the planner's choice)."""
    seen, first, rest = set(), [], []
    for item in items:
        shape = shape_of(plan_of(item))
        (rest if shape in seen else first).append(item)
        seen.add(shape)
    return first + rest
