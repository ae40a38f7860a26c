"""A default run tracks one early step, so its report shows the memory at the peak beside memfit's estimate.

--track-memory tracks every step, --no-track-memory none, and the tracked step changes no number of the run.
The report holds plotly.js once: it stays under 1.5x the library's size.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from safetensors.torch import load_file

from memfit.config_loading import load_config
from memfit.train.loop import train
from memfit.train.metrics import read_metrics
from memfit.train.run_summary import memory_report
from memfit.units import format_bytes


def _config(llama_dir, text_file, out, **extra):
    return load_config(overrides=dict(model=str(llama_dir), dataset=str(text_file), seq_len=64, batch_size=4,
                                      max_steps=4, lr=3e-3, loss_chunk_size=0, output_dir=str(out)) | extra)


def _steps(out) -> list[dict]:
    return [r for r in read_metrics(out / "metrics.jsonl") if "event" not in r]


@pytest.fixture(scope="module")
def default_run(llama_dir, text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("default") / "run"
    return out, train(_config(llama_dir, text_file, out))


def test_a_default_run_tracks_its_second_step_alone(default_run):
    out, result = default_run
    steps = _steps(out)
    assert [r["step"] for r in steps if "tracked_peak_bytes" in r] == [2]
    # The tracked step runs a few times slower: its time stays out of MFU and the measured step.
    if "mfu" in steps[0]:
        assert "mfu" not in steps[1] and all("mfu" in r for r in steps[2:])
    record = json.loads((out / "memory_timeline.json").read_text())
    assert record["peak_step"] == 2 and record["timeline"]["step"] == 2
    assert record["estimate"]["peak_bytes"] > 0
    summary = result.summary
    assert summary["tracked_step"] == 2 and summary["tracked_peak_bytes"] == steps[1]["tracked_peak_bytes"]
    assert summary["estimated_peak_bytes"] == record["estimate"]["peak_bytes"]
    text = memory_report(summary)
    assert f"tracked tensor peak: {format_bytes(summary['tracked_peak_bytes'])} (step 2" in text
    assert f"memfit's estimate: {format_bytes(record['estimate']['peak_bytes'])}" in text


def test_the_default_runs_report_shows_the_peak_beside_the_estimate_and_stays_small(default_run):
    pytest.importorskip("plotly")
    from plotly.offline import get_plotlyjs

    from memfit.reporting import write_report

    out, _ = default_run
    record = json.loads((out / "memory_timeline.json").read_text())
    path = write_report(out)
    page = path.read_text()
    memory = page[page.index("<h2>Memory at the peak</h2>"):]
    # The table's last row: the measured peak, its share, and the estimate with its band.
    peak_row = re.search(r"<tr><td>peak</td><td class=num>([^<]+)</td><td class=num>100%</td>"
                         r"<td class=num>([^<]+) \(\+-(\d+)%\)</td></tr>", memory)
    assert peak_row, memory[:2000]
    assert peak_row.group(1) == format_bytes(record["profile"]["peak_bytes"])
    assert peak_row.group(2) == format_bytes(record["estimate"]["peak_bytes"])
    assert 'id="breakdown"' in memory and 'id="timeline"' in memory
    assert "estimated (analytical)" in memory and "Run with --track-memory" not in page
    # At the top too: the tracker's peak and the estimate side by side in the cards.
    cards = re.findall(r'<div class="label">([^<]+)</div><div class="value">([^<]+)</div>', page)
    values = dict(cards)
    assert values["estimated peak"] == format_bytes(record["estimate"]["peak_bytes"])
    assert values["peak live tensors (tracker, step 2)"] == format_bytes(record["profile"]["peak_bytes"])
    # memfit compare overlays each run's first memory series: a curve over the steps, not the one tracked point.
    from memfit.reporting import load_run
    from memfit.reporting.figures import memory_series

    first_label, xs, _, _ = memory_series(load_run(out))[0]
    assert len(xs) == 4 and "tracker" not in first_label
    # plotly.js once (not once per chart): the page is the library and little else.
    library = get_plotlyjs()
    assert page.count(library[:300]) == 1
    assert path.stat().st_size < 1.5 * len(library.encode("utf-8")), path.stat().st_size


@pytest.mark.parametrize(("extra", "tracked"), [({"track_memory": False}, []), ({"report": False}, []),
                                                ({"track_memory": True}, [1, 2, 3])])
def test_track_memory_every_step_none_or_none_without_a_report(llama_dir, text_file, tmp_path, extra, tracked):
    out = tmp_path / "run"
    result = train(_config(llama_dir, text_file, out, max_steps=3, **extra))
    assert [r["step"] for r in _steps(out) if "tracked_peak_bytes" in r] == tracked
    assert (out / "memory_timeline.json").exists() == bool(tracked)
    assert result.summary["tracked_step"] is None
    if not tracked and extra.get("report", True):
        pytest.importorskip("plotly")
        from memfit.reporting import write_report

        page = write_report(out).read_text()
        assert "The tracker did not run" in page and "--track-memory" in page and 'id="breakdown"' not in page


def test_the_tracked_step_changes_no_number(default_run, llama_dir, text_file, tmp_path):
    """The tracker only watches: losses, gradient norms and the final weights equal an untracked run's bit for bit."""
    out, _ = default_run
    plain = tmp_path / "plain"
    train(_config(llama_dir, text_file, plain, track_memory=False))
    for tracked, untracked in zip(_steps(out), _steps(plain), strict=True):
        assert (tracked["loss"], tracked["grad_norm"]) == (untracked["loss"], untracked["grad_norm"])
    final, reference = load_file(str(out / "final" / "model.safetensors")), load_file(str(plain / "final" / "model.safetensors"))
    assert set(final) == set(reference) and all(torch.equal(final[name], reference[name]) for name in reference)


def test_a_resumed_runs_summary_starts_at_step_1_or_says_where_it_resumed(llama_dir, text_file, tmp_path):
    import shutil

    out = tmp_path / "run"
    common = dict(max_steps=6, save_every=2, save_total_limit=0, report=False)
    train(_config(llama_dir, text_file, out, **common))
    for later in ("step-4", "step-6"):  # as if the run had died after its step-2 checkpoint
        shutil.rmtree(out / "checkpoints" / later)
    summary = train(_config(llama_dir, text_file, out, resume="auto", **common)).summary
    step_one = next(r["loss"] for r in _steps(out) if r["step"] == 1)
    step_three = [r["loss"] for r in _steps(out) if r["step"] == 3][-1]
    assert summary["first_loss"] == step_one and summary["resumed_at_step"] == 2
    assert summary["launch_first_loss"] == step_three != step_one
    line = next(line for line in memory_report(summary).splitlines() if line.startswith("  loss"))
    assert line == (f"  loss {step_one:.4f} (step 1) -> {summary['final_loss']:.4f} (step 6); resumed at step 2:"
                    f" loss {step_three:.4f} -> {summary['final_loss']:.4f} over steps 3-6")
    # Without the metrics of the first steps the summary still says where the launch began.
    gone = {**summary, "first_loss": None}
    line = next(line for line in memory_report(gone).splitlines() if "loss" in line)
    assert line == f"  resumed at step 2: loss {step_three:.4f} -> {summary['final_loss']:.4f} over steps 3-6"
