"""What holds a long-context peak under full checkpointing: recomputed activations and activation gradients."""

from __future__ import annotations

import pytest
import torch
from tracker_helpers import build_llama, tracked_step

from memfit.memory.categories import (
    ACTIVATION_GRADIENTS,
    ACTIVATIONS,
    LOGITS,
    NO_MODULE,
    OTHER,
    RECOMPUTED_ACTIVATIONS,
)
from memfit.memory.report import ReportContext, build_report, render
from memfit.memory.tracker import MemoryTracker

SEQ_LEN = 1024


def profile_step(checkpointing: bool):
    # An MLP 4x wider than the model, as in Llama: at long sequences its tensors dominate backward.
    model = build_llama(layers=2, hidden=64, intermediate=256, vocab=256)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    tracker = MemoryTracker("cpu")
    tracker.attach(model, optimizer)
    with tracker:
        tracked_step(tracker, model, optimizer, torch.randint(0, 256, (1, SEQ_LEN)))
        memory = tracker.end_step()
    return memory, tracker.peak_snapshot()


@pytest.mark.slow
def test_checkpointed_long_context_peak_is_named_by_category_and_module():
    memory, snapshot = profile_step(checkpointing=True)
    peak, breakdown = memory.peak_bytes, memory.breakdown
    assert snapshot.phase == "backward"
    assert breakdown[OTHER] < 0.05 * peak
    assert breakdown[RECOMPUTED_ACTIVATIONS] + breakdown[ACTIVATION_GRADIENTS] > 0.6 * peak
    # What backward made is filed under the module whose recompute or backward made it.
    for category in (RECOMPUTED_ACTIVATIONS, ACTIVATION_GRADIENTS):
        by_module = snapshot.module_bytes[category]
        assert by_module.get(NO_MODULE, 0) < 0.1 * sum(by_module.values())
    largest_module, largest_category, _ = build_report([memory], snapshot, "cpu").peak_modules[0]
    assert largest_module.startswith("model.layers.1.mlp") and largest_category != OTHER
    # The MLP's [tokens, 256] tensors are no logits although 256 is the vocabulary size.
    assert breakdown[LOGITS] < 0.2 * peak

    context = ReportContext(gradient_checkpointing=True, loss_chunk_size=0, vocab_size=256)
    report = build_report([memory], snapshot, "cpu", context)
    assert report.advice[0]["flag"] == "--tiled-mlp 4"
    assert "MLP" in report.advice[0]["message"] and "--tiled-mlp 4" in render(report)
    tiled = ReportContext(gradient_checkpointing=True, loss_chunk_size=0, vocab_size=256, tiled_mlp=4)
    assert all(entry["technique"] != "tiled MLP" for entry in build_report([memory], snapshot, "cpu", tiled).advice)


def test_without_checkpointing_nothing_is_recomputed():
    memory, snapshot = profile_step(checkpointing=False)
    assert memory.breakdown[RECOMPUTED_ACTIVATIONS] == 0
    assert memory.breakdown[ACTIVATIONS] > 0.3 * memory.peak_bytes
    assert snapshot.module_bytes.get(RECOMPUTED_ACTIVATIONS, {}) == {}
