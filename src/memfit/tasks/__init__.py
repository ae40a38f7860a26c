"""What a run learns: one Task object per `--task` (memfit.tasks.base explains the seam).

    task = build_task(config)        # reads the training table's labels when the task has a head to size
    loaded = load_model_and_tokenizer(config, ..., auto_class=task.auto_class, head_config=task.model_config())
    task.prepare_model(loaded.model, loaded.tokenizer)
"""

from __future__ import annotations

from typing import Any

from memfit.tasks.base import Task
from memfit.tasks.grpo import GRPOTask
from memfit.tasks.heads import (
    MaskedLMTask,
    RegressionTask,
    SequenceClassificationTask,
    TableTask,
    TokenClassificationTask,
)
from memfit.tasks.metrics import METRIC_LABELS
from memfit.tasks.preference_objectives import PREFERENCE_TASK_CLASSES

TASK_CLASSES: dict[str, type[Task]] = {
    cls.name: cls
    for cls in (Task, MaskedLMTask, SequenceClassificationTask, TokenClassificationTask, RegressionTask,
                *PREFERENCE_TASK_CLASSES, GRPOTask)
}

__all__ = ["TASK_CLASSES", "Task", "build_task", "describe_task", "task_class"]


def build_task(config: Any) -> Task:
    """The task of `config` (its `task` section), its label space read from the training data when it needs one.

    Raises UsageError for data without the label columns, a bad label (naming the row), or settings the task refuses.
    """
    from memfit.errors import UsageError

    task = TASK_CLASSES[config.task.task](config)
    refused = task.refusals(config)
    if refused:
        raise UsageError("; ".join(refused))
    if isinstance(task, TableTask):
        task.read_labels(config.data.dataset)
        if task.spec is not None and config.data.packing == "auto":
            # One sample a row, padded to the longest of its micro-batch: a pooled head or a bidirectional
            # encoder must not see two samples in one row. What "auto" means for a table, not a fallback: the
            # task's facts (the report's task row) say so; --packing samples/wrapped on a table is refused.
            config.data.packing = "off"
    if isinstance(task, GRPOTask) and config.data.packing == "auto":
        # Each completion is a row of its own: what "auto" means for GRPO (the task's facts say so).
        config.data.packing = "off"
    # A preference task decides --packing itself (auto included: tasks/pair_packing.py), over each micro-batch's
    # sequences; its samples are never packed into windows (PreferenceSamples.packed_by_task).
    return task


def task_class(task: str | dict[str, Any] | None) -> type[Task]:
    """The class of a task by name, or by the facts a run recorded ({"name": ...}); causal LM when unknown.

    What the run summary and the report ask how to word a run's results (Task.eval_status, eval_scores, ...).
    """
    name = task.get("name") if isinstance(task, dict) else task
    return TASK_CLASSES.get(name or "", Task)


def describe_task(facts: dict[str, Any], evaluated: bool = True) -> str:
    """The task facts of a run (Task.facts) in words: the report's task row (`evaluated`: what its evaluations report)."""
    cls = task_class(facts)
    parts = [str(facts.get("head") or cls.auto_class), f"loss per {facts.get('loss_per') or cls.unit.removesuffix('s')}"]
    if facts.get("problem") in ("single-label", "multi-label"):
        parts.append(facts["problem"])
    measures = [METRIC_LABELS.get(name, name) for name in facts.get("eval_metrics") or cls.eval_metrics]
    if measures and evaluated:
        parts.append("eval: loss, " + ", ".join(measures))
    if facts.get("packing"):
        parts.append(f"packing {facts['packing']}")
    return f"{facts.get('name') or cls.name} ({'; '.join(parts)})"
