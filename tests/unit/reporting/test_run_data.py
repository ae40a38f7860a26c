"""Reading a run directory: steps, events, resumes, the saved memory record; thinning long series."""

from __future__ import annotations

import pytest

from memfit.errors import UsageError
from memfit.reporting.figures import downsample
from memfit.reporting.memory_record import thin_timeline, timeline_to_dict
from memfit.reporting.run_data import load_run


def test_steps_events_and_resume_are_read(make_run):
    run = load_run(make_run(steps=30, oom_at=(5, 12), resume_at=20))
    assert [record["step"] for record in run.steps] == list(range(1, 31))  # a step run twice appears once
    assert run.steps[20]["loss"] == 9.0  # step 21 was run again after the resume: the later value wins
    assert [event["step"] for event in run.oom_events] == [5, 12]
    assert run.resumes == [{"step": 20, "from": str(run.source) + "/checkpoints/step-20"}]
    assert run.summary is not None and run.summary["event"] == "summary"
    assert run.facts["fallbacks"] == {"optimizer": "adamw-8bit asked, bitsandbytes missing: adamw ran"}
    assert run.memory is not None and run.memory["timeline"]["step"] == 2
    assert run.peak("tracked_peak_bytes") == 48_000_000 + 160_000_000 + 1_000_000


def test_typical_speed_leaves_out_the_first_step(make_run):
    run = load_run(make_run(steps=5))
    run.steps[0]["tokens_per_second"] = 1.0  # warm-up
    speeds = sorted(record["tokens_per_second"] for record in run.steps[1:])
    assert run.typical_tokens_per_second() == pytest.approx(speeds[2] if len(speeds) % 2 else sum(speeds[1:3]) / 2)
    assert run.typical_mfu() is None  # the metrics carry no MFU


@pytest.mark.parametrize("what", ["missing", "empty", "no-metrics"])
def test_bad_run_directory_is_a_usage_error(tmp_path, what):
    directory = tmp_path / "run"
    if what != "missing":
        directory.mkdir()
    if what == "empty":
        (directory / "metrics.jsonl").write_text("")
    with pytest.raises(UsageError, match="run"):
        load_run(directory)


def test_thinned_timeline_keeps_the_peak_and_every_phase():
    samples = [(index, "forward" if index < 5000 else "backward", {"activations": index % 997, "parameters": 10})
               for index in range(9000)]
    samples[4321] = (4321, "forward", {"activations": 10**6, "parameters": 10})
    samples.append((9000, "optimizer", {"activations": 0, "parameters": 10}))
    thinned = thin_timeline(samples, max_samples=500)
    assert len(thinned) <= 502  # a phase change may close a bucket early
    assert max(sum(sizes.values()) for _, _, sizes in thinned) == 10**6 + 10
    assert {phase for _, phase, _ in thinned} == {"forward", "backward", "optimizer"}
    columns = timeline_to_dict(thinned)
    assert [phase for _, phase in columns["phases"]] == ["forward", "backward", "optimizer"]
    assert len(columns["bytes"]["activations"]) == len(columns["event_index"])


def test_downsampled_curve_keeps_maxima_and_the_last_step():
    xs = list(range(1, 10_001))
    ys = [float(x % 100) for x in xs]
    ys[7777] = 1e9
    out_x, out_y = downsample(xs, ys, "max", limit=1000)
    assert len(out_x) == 1000 and out_x[-1] == 10_000
    assert max(out_y) == 1e9
    mean_x, mean_y = downsample(xs, [1.0] * len(xs), "mean", limit=1000)
    assert mean_y == [1.0] * 1000
