"""The profile report: JSON schema, advice computed from measurements, leak warning, text view."""

from __future__ import annotations

import json

import torch
from tracker_helpers import build_llama, tracked_step

from memfit.memory.categories import CATEGORIES, OPTIMIZER_STATES, PeakSnapshot, StepMemory
from memfit.memory.report import ReportContext, build_report, detect_leak, render
from memfit.memory.tracker import MemoryTracker


def profile(model, optimizer, input_ids, steps=2, keep=None, checkpointing=False):
    """Run `steps` tracked steps; `keep` (a list) collects a tensor per step, like a leak."""
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    tracker = MemoryTracker("cpu")
    tracker.attach(model, optimizer)
    memories = []
    with tracker:
        for _ in range(steps):
            loss = tracked_step(tracker, model, optimizer, input_ids)
            if keep is not None:
                keep.append(torch.full((64, 64), float(loss)))  # 16 KiB kept per step
            memories.append(tracker.end_step())
    return memories, tracker


def flags(report) -> list[str]:
    return [entry["flag"] for entry in report.advice]


def test_report_json_has_the_schema():
    model = build_llama(layers=2)
    memories, tracker = profile(model, torch.optim.AdamW(model.parameters()), torch.randint(0, 256, (2, 64)))
    report = build_report(memories, tracker.peak_snapshot(), "cpu", ReportContext(vocab_size=256))
    data = json.loads(json.dumps(report.to_dict()))
    for key in ("device", "steps", "peak_bytes", "breakdown", "phases", "top_modules", "top_tensors", "advice", "leak"):
        assert key in data
    assert data["device"] == "cpu" and data["steps"] == 2
    assert list(data["breakdown"]) == list(CATEGORIES)
    assert sum(data["breakdown"].values()) == data["peak_bytes"] == tracker.peak_bytes
    assert [block["module"] for block in data["blocks"]] == ["model.layers.0", "model.layers.1"]
    assert [phase["name"] for phase in data["phases"]] == ["forward", "backward", "optimizer"]
    assert all(set(phase) == {"name", "peak_bytes", "breakdown"} for phase in data["phases"])
    assert data["top_modules"] and set(data["top_modules"][0]) == {"module", "activation_bytes"}
    assert set(data["top_tensors"][0]) >= {"shape", "dtype", "bytes", "category", "op", "module"}
    for entry in data["advice"]:
        assert set(entry) == {"technique", "flag", "saves_bytes", "message"}
    assert data["leak"] is None


def test_checkpointing_advice_when_activations_dominate_and_its_estimate():
    input_ids = torch.randint(0, 256, (2, 512))  # long sequence, small model
    plain_steps, plain = profile(build_llama(layers=4), None, input_ids, steps=1)
    report = build_report(plain_steps, plain.peak_snapshot(), "cpu")
    assert report.breakdown["activations"] > 0.6 * report.peak_bytes
    advice = report.advice[0]
    assert advice["flag"] == "--gradient-checkpointing full"
    assert advice["message"].startswith("activations are ")

    # The estimate is close to what checkpointing really saves.
    checkpointed_steps, _ = profile(build_llama(layers=4), None, input_ids, steps=1, checkpointing=True)
    real_saving = plain_steps[0].peak_bytes - checkpointed_steps[0].peak_bytes
    assert 0.6 * real_saving <= advice["saves_bytes"] <= 1.4 * real_saving, (advice["saves_bytes"], real_saving)

    # Not suggested again when it is already on.
    already = build_report(plain_steps, plain.peak_snapshot(), "cpu", ReportContext(gradient_checkpointing=True))
    assert "--gradient-checkpointing full" not in flags(already)


def test_optimizer_and_lora_advice_when_state_dominates():
    model = build_llama(layers=2, hidden=128, vocab=1024)
    memories, tracker = profile(model, torch.optim.AdamW(model.parameters()), torch.randint(0, 1024, (1, 8)))
    report = build_report(memories, tracker.peak_snapshot(), "cpu")
    state = max(memory.breakdown[OPTIMIZER_STATES] for memory in memories)
    eight_bit = next(entry for entry in report.advice if entry["flag"] == "--optimizer adamw-8bit")
    assert eight_bit["saves_bytes"] == int(0.75 * report.breakdown[OPTIMIZER_STATES])
    assert report.breakdown[OPTIMIZER_STATES] == state
    assert "75% of optimizer state" in eight_bit["message"]
    assert "--lora-r 16" in flags(report)
    assert "--gradient-checkpointing full" not in flags(report)

    using = ReportContext(optimizer="adamw-8bit", lora=True)
    assert not {"--optimizer adamw-8bit", "--lora-r 16"} & set(
        flags(build_report(memories, tracker.peak_snapshot(), "cpu", using))
    )


def test_chunked_loss_advice_when_logits_are_large():
    model = build_llama(layers=1, hidden=32, vocab=4096)
    memories, tracker = profile(model, None, torch.randint(0, 4096, (2, 256)), steps=1)
    report = build_report(memories, tracker.peak_snapshot(), "cpu", ReportContext(vocab_size=4096))
    chunk = next(entry for entry in report.advice if entry["technique"] == "chunked loss")
    assert chunk["flag"].startswith("--loss-chunk-size ")
    logits_bytes = 2 * 256 * 4096 * 4
    assert logits_bytes < chunk["saves_bytes"] < 4 * logits_bytes
    chunked = ReportContext(vocab_size=4096, loss_chunk_size=128)
    assert all(
        entry["technique"] != "chunked loss"
        for entry in build_report(memories, tracker.peak_snapshot(), "cpu", chunked).advice
    )


def test_leak_warning_fires_on_a_growing_loop_and_not_on_a_clean_one():
    input_ids = torch.randint(0, 256, (1, 16))
    model = build_llama(layers=1)
    kept: list[torch.Tensor] = []
    leaky, tracker = profile(model, torch.optim.AdamW(model.parameters()), input_ids, steps=5, keep=kept)
    report = build_report(leaky, tracker.peak_snapshot(), "cpu")
    assert report.leak is not None
    assert report.leak["growth_bytes_per_step"] == 64 * 64 * 4
    assert "per step" in report.leak["message"]

    model = build_llama(layers=1)
    clean, tracker = profile(model, torch.optim.AdamW(model.parameters()), input_ids, steps=5)
    assert build_report(clean, tracker.peak_snapshot(), "cpu").leak is None


def test_detect_leak_needs_steady_growth_over_three_steps():
    assert detect_leak([1000_000, 1100_000, 1200_000]) is not None
    assert detect_leak([1000_000, 1100_000]) is None
    assert detect_leak([1000_000, 1100_000, 1100_200, 1200_000]) is None  # one step within tolerance
    assert detect_leak([5000_000, 1000_000, 1000_000, 1000_000]) is None  # the first step is left out
    assert detect_leak([1000_000, 1200_000, 1100_000, 1300_000, 1400_000]) is None


def test_render_shows_peak_categories_phases_tensors_and_advice():
    input_ids = torch.randint(0, 256, (2, 256))
    model = build_llama(layers=2)
    memories, tracker = profile(model, torch.optim.AdamW(model.parameters()), input_ids)
    text = render(build_report(memories, tracker.peak_snapshot(), "cpu"))
    assert text.splitlines()[1].startswith("peak ")
    for word in (
        *CATEGORIES,
        "forward",
        "backward",
        "optimizer",
        "largest tensors",
        "advice:",
        "MiB",
        "per block: 2 blocks",
    ):
        assert word in text
    assert "%" in text


def test_report_from_synthetic_records_without_torch_run():
    breakdown = {"parameters": 10, "gradients": 10, "optimizer_states": 20, "activations": 50, "other": 10}
    snapshot = PeakSnapshot(peak_bytes=100, breakdown=breakdown, phase="backward", step=0, top_tensors=[])
    steps = [StepMemory(step=0, peak_bytes=100, breakdown=breakdown, phases=[], live_bytes_at_end=40)]
    report = build_report(steps, snapshot, "cpu")
    assert report.peak_bytes == 100 and report.leak is None
    text = render(report).splitlines()
    assert text[1] == "peak 0.10 KiB in step 0 (backward)"
    # Each category's line carries its share of the peak.
    shares = {line.split()[0]: line.split()[-1] for line in text[2:2 + len(CATEGORIES)]}
    assert shares == {c: f"{100 * breakdown.get(c, 0) // 100}%" for c in CATEGORIES}


def test_report_without_closed_steps_uses_the_snapshot():
    model = build_llama(layers=1)
    tracker = MemoryTracker("cpu")
    tracker.attach(model)
    with tracker:
        model(input_ids=torch.randint(0, 256, (1, 8))).logits.sum().backward()
    report = build_report([], tracker.peak_snapshot(), "cpu")
    assert report.steps == 0 and report.peak_bytes == tracker.peak_bytes


def test_context_from_config_turns_off_advice_for_what_the_run_uses():
    from memfit.config_loading import load_config
    from memfit.resolution.resolve import resolve

    config = load_config(
        overrides={"gradient_checkpointing": "full", "optimizer": "adamw-8bit", "lora_r": 8, "loss_chunk_size": 0}
    )
    context = ReportContext.from_run(resolve(config, None, "cpu"), vocab_size=256)
    assert context.gradient_checkpointing and context.lora and context.optimizer == "adamw-8bit"
    assert context.loss_chunk_size == 0 and context.vocab_size == 256
    assert not ReportContext.from_run(resolve(load_config(), None, "cpu")).gradient_checkpointing
