"""A change of what runs during a step (an OOM escalation, compile falling back to eager) is a line of the metrics:
each event of `session.run.events` once, as `RunEvent.as_record()`, with the step it happened in."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from fault_injection import SGD_NO_CLIPPING
from memfit.config import TrainConfig
from memfit.config_loading import load_config
from memfit.models.tiny import tiny_config
from memfit.resolution.resolve import resolve
from memfit.train.loop import train
from memfit.train.metrics import read_metrics
from memfit.train.observers import RunChangeLog
from memfit.train.step import StepResult
from memfit.train.step_observer import FinishedStep


class _Lines:
    """A metrics logger that keeps its lines."""

    def __init__(self):
        self.lines: list[dict] = []

    def log(self, record: dict) -> None:
        self.lines.append(record)

    def close(self) -> None:
        pass


def _finished(step: int) -> FinishedStep:
    result = StepResult(loss=1.0, grad_norm=None, target_tokens=8, input_tokens=8, micro_batch_size=1,
                        accumulation_steps=1)
    return FinishedStep(step=step, result=result, loss=1.0, tokens=8, seconds=0.1, is_first=step == 1)


def test_each_change_of_the_run_is_logged_once_with_its_step():
    config = TrainConfig().replace(model="tiny", seq_len=64, batch_size=2)
    # A change made while the run was built is in the start line's facts already: not a step's event.
    built = resolve(config, tiny_config(), "cpu").changed("compile", "while building", compiled=False)
    session = SimpleNamespace(run=built)
    logger = _Lines()
    changes = RunChangeLog(session, logger)

    changes.after_step(_finished(1))
    assert logger.lines == []  # nothing changed in step 1
    session.run = session.run.changed("loss_chunking", "out of memory in backward at micro-batch 1", loss_chunk_size=1024)
    changes.after_step(_finished(2))
    changes.after_step(_finished(3))
    event = session.run.events[-1]
    assert logger.lines == [{"step": 2, **event.as_record()}]
    assert logger.lines[0]["event"] == "run_changed" and logger.lines[0]["technique"] == "loss_chunking"


@contextlib.contextmanager
def _oom_in_the_first_two_backwards():
    """OOM in backward of the first block's MLP output, twice: micro-batch 2 splits to 1, then micro-batch 1 turns
    gradient checkpointing on (an escalation: a change of the run). Found through a global forward hook."""
    raised = {"n": 0}

    def boom(grad):
        raised["n"] += 1
        raise torch.OutOfMemoryError("injected: CUDA out of memory")

    def hook(module, inputs, output):
        shape = (getattr(module, "in_features", None), getattr(module, "out_features", None))
        if isinstance(module, torch.nn.Linear) and shape == (128, 64) and raised["n"] < 2 and output.requires_grad:
            output.register_hook(boom)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield raised
    finally:
        handle.remove()


def test_an_oom_escalation_is_a_line_of_the_metrics(llama_dir, text_file, tmp_path):
    config = load_config(overrides=dict(model=str(llama_dir), dataset=str(text_file), seq_len=64, batch_size=2,
                                        max_steps=2, loss_chunk_size=0, output_dir=str(tmp_path), lr=0.5,
                                        **SGD_NO_CLIPPING))
    with _oom_in_the_first_two_backwards() as raised:
        train(config)
    assert raised["n"] == 2
    lines = read_metrics(tmp_path / "metrics.jsonl")
    changed = [line for line in lines if line.get("event") == "run_changed"]
    assert len(changed) == 1  # once, not again after step 2
    assert changed[0]["step"] == 1 and changed[0]["technique"] == "gradient_checkpointing"
    assert changed[0]["from"] == "checkpointing='off', checkpointed_blocks=0"
    assert changed[0]["to"] == "checkpointing='full', checkpointed_blocks=2"
    assert changed[0]["reason"] == "out of memory in backward at micro-batch 1"
    # In the step's lines: after the OOM event that caused it, before the step's own line.
    index = lines.index(changed[0])
    assert "gradient checkpointing" in lines[index - 1]["action"]
    assert "event" not in lines[index + 1] and lines[index + 1]["step"] == 1
    oom = [line for line in lines if line.get("event") == "oom"]
    assert len(oom) == 2 and oom[0]["new_micro_batch_size"] == 1  # the split changes no technique: no line of its own


def test_a_run_that_does_not_change_logs_no_change(llama_dir, text_file, tmp_path):
    config = load_config(overrides=dict(model=str(llama_dir), dataset=str(text_file), seq_len=64, batch_size=2,
                                        max_steps=1, output_dir=str(tmp_path), **SGD_NO_CLIPPING))
    train(config)
    assert not [line for line in read_metrics(tmp_path / "metrics.jsonl") if line.get("event") == "run_changed"]
