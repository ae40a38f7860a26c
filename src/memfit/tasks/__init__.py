"""What a run learns: one Task object per `--task` (memfit.tasks.base explains the seam).

    task = build_task(config)        # reads the training table's labels when the task has a head to size
    loaded = load_model_and_tokenizer(config, ..., auto_class=task.auto_class, head_config=task.model_config())
    task.prepare_model(loaded.model, loaded.tokenizer)
"""

from __future__ import annotations

from typing import Any

from memfit.tasks.base import Task
from memfit.tasks.heads import (
    MaskedLMTask,
    RegressionTask,
    SequenceClassificationTask,
    TableTask,
    TokenClassificationTask,
)

TASK_CLASSES: dict[str, type[Task]] = {
    cls.name: cls
    for cls in (Task, MaskedLMTask, SequenceClassificationTask, TokenClassificationTask, RegressionTask)
}

__all__ = ["TASK_CLASSES", "Task", "build_task"]


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
            # encoder must not see two samples in one row.
            config.data.packing = "off"
            config.derived["packing"] = f"packing off: --task {task.name} reads one table row a sample"
    return task
