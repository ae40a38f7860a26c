"""The HTML report of real runs: written at the end of train and profile, opened in headless Chromium.

The browser tests need a Chromium binary (Debian: apt-get install chromium) and are skipped
without one. Set MEMFIT_REPORT_SCREENSHOT=path.png to keep the screenshot of the tracked run.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

pytest.importorskip("plotly")

from memfit.reporting.browser import check_page, find_chromium, remote_references  # noqa: E402
from memfit.train.metrics import read_metrics  # noqa: E402

pytestmark = pytest.mark.slow  # real training runs in their own processes: seconds each
needs_chromium = pytest.mark.skipif(find_chromium() is None, reason="no Chromium binary (apt-get install chromium)")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _train(memfit, llama_dir, text_file, out, *extra):
    """`memfit train` on the tiny Llama (through `memfit`: the warm_memfit fixture)."""
    return memfit.run(
        "train", "--model", llama_dir, "--dataset", text_file, "--seq-len", "64", "--batch-size", "4",
        "--lr", "3e-3", "--output-dir", out, *extra,
    )


@pytest.fixture(scope="module")
def tracked_run(llama_dir, text_file, tmp_path_factory, warm_memfit):
    out = tmp_path_factory.mktemp("report") / "tracked"
    result = _train(warm_memfit, llama_dir, text_file, out, "--max-steps", "6", "--track-memory")
    assert result.returncode == 0, result.stderr
    return out, result


@pytest.fixture(scope="module")
def oom_resumed_run(tracked_run, llama_dir, text_file, tmp_path_factory, warm_memfit):
    """A run whose micro-batch of 4 does not fit under the cap (split to 2), stopped at step 4, resumed to 6."""
    summary = read_metrics(tracked_run[0] / "metrics.jsonl")[-1]
    breakdown = summary["tracked_breakdown"]
    state = breakdown["parameters"] + breakdown["gradients"] + breakdown["optimizer_states"]
    cap = state + (summary["tracked_peak_bytes"] - state) * 3 // 4  # a micro-batch of 2 needs about half
    out = tmp_path_factory.mktemp("report") / "oom"
    first = _train(warm_memfit, llama_dir, text_file, out, "--max-steps", "4", "--save-every", "2", "--memory-cap", str(cap))
    assert first.returncode == 0, first.stderr
    shutil.rmtree(out / "checkpoints" / "step-4")  # as if the run died after its step-2 checkpoint
    second = _train(warm_memfit, llama_dir, text_file, out, "--max-steps", "6", "--memory-cap", str(cap), "--resume", "auto")
    assert second.returncode == 0, second.stderr
    return out


def _charts(check):
    return {chart["id"]: chart for chart in check.charts}


def test_train_writes_the_report_and_the_memory_record(tracked_run):
    out, result = tracked_run
    assert "memfit: report in" in result.stderr and "report.html" in result.stderr
    page = (out / "report.html").read_text()
    assert remote_references(page) == []
    record = json.loads((out / "memory_timeline.json").read_text())
    assert record["timeline"]["event_index"] and record["profile"]["top_modules"]
    assert {"forward", "backward", "optimizer"} <= {phase for _, phase in record["timeline"]["phases"]}
    assert 1 <= record["peak_step"] <= 6
    assert record["estimate"] is not None and record["estimate"]["peak_bytes"] > 0


@needs_chromium
def test_report_of_a_real_run_renders_in_chromium(tracked_run, tmp_path):
    out, _ = tracked_run
    check = check_page(out / "report.html")
    assert check.console_errors == []
    assert check.blocked_requests == [] and all(url.startswith("file://") for url in check.requests), check.requests
    charts = _charts(check)
    assert set(charts) == {"curves", "breakdown", "timeline"}
    for chart in charts.values():
        assert chart["ready"] and chart["drawn"] == chart["series"] > 0, chart
    assert {"loss", "lr", "grad norm", "tokens per second", "live tensors (tracker)"} <= set(charts["curves"]["names"])
    assert charts["breakdown"]["names"] == ["measured", "estimated (analytical)"]
    assert {"parameters", "activations"} <= set(charts["timeline"]["names"])
    assert check.screenshot.startswith(PNG_SIGNATURE) and len(check.screenshot) > 50_000
    keep = os.environ.get("MEMFIT_REPORT_SCREENSHOT")
    (tmp_path / "report.png").write_bytes(check.screenshot)
    if keep:
        shutil.copy(tmp_path / "report.png", keep)


def test_report_shows_oom_recoveries_and_the_resume(oom_resumed_run):
    page = (oom_resumed_run / "report.html").read_text()
    assert "out of memory, recovered" in page and ">resumed<" in page
    assert "checkpoints/step-2" in page  # where the run resumed from
    assert '"name":"OOM recovered"' in page and '"name":"resumed"' in page


@needs_chromium
def test_oom_and_resume_markers_draw_in_chromium(oom_resumed_run):
    check = check_page(oom_resumed_run / "report.html")
    assert check.console_errors == [] and check.blocked_requests == []
    curves = _charts(check)["curves"]
    assert {"OOM recovered", "resumed", "micro batch size"} <= set(curves["names"])
    assert curves["drawn"] == curves["series"]


@needs_chromium
def test_compare_of_two_real_runs_renders(tracked_run, oom_resumed_run, tmp_path, warm_memfit):
    result = warm_memfit.run("compare", tracked_run[0], oom_resumed_run, "-o", tmp_path / "compare.html")
    assert result.returncode == 0, result.stderr
    check = check_page(tmp_path / "compare.html")
    assert check.console_errors == [] and check.blocked_requests == []
    charts = _charts(check)
    assert charts["compare"]["series"] == charts["compare"]["drawn"] == 6  # loss, tokens/s, memory for each run
    assert charts["compare-breakdown"]["drawn"] == charts["compare-breakdown"]["series"] > 0


def test_no_report_writes_none(llama_dir, text_file, tmp_path, warm_memfit):
    result = _train(warm_memfit, llama_dir, text_file, tmp_path / "run", "--max-steps", "1", "--no-report")
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "run" / "report.html").exists()
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_profile_writes_its_report(llama_dir, text_file, tmp_path, warm_memfit):
    out = tmp_path / "profile"
    result = warm_memfit.run(
        "profile", "--model", llama_dir, "--dataset", text_file, "--seq-len", "64", "--batch-size", "2", "--steps", "2",
        "--output-dir", out, "--json",
    )
    assert result.returncode == 0, result.stderr
    assert "timeline" not in json.loads(result.stdout)  # the report's data stays out of the JSON object
    page = (out / "report.html").read_text()
    assert "memfit profile" in page and 'id="timeline"' in page and remote_references(page) == []


@needs_chromium
def test_browser_check_catches_errors_and_remote_loads(tmp_path):
    """The checks above can fail: a console error, an exception and a remote image are all reported."""
    page = tmp_path / "bad.html"
    page.write_text(
        "<html><body><img src='http://example.invalid/x.png'>"
        "<script>console.error('boom'); undefinedFunction();</script></body></html>"
    )
    check = check_page(page)
    assert any("boom" in error for error in check.console_errors)
    assert any("undefinedFunction" in error for error in check.console_errors)
    assert check.blocked_requests == ["http://example.invalid/x.png"]
    assert remote_references(page.read_text()) != []


def test_train_without_plotly_skips_the_report_in_one_line(llama_dir, text_file, tmp_path, warm_memfit):
    out = tmp_path / "run"
    args = ["train", "--model", str(llama_dir), "--dataset", str(text_file), "--seq-len", "64", "--max-steps", "1",
            "--output-dir", str(out)]
    # forked from the session's warm server (tests/memfit_cli.py) with plotly hidden in the child: memfit imports it
    # only when it draws, so this is a fresh interpreter without plotly, less the import of torch
    result = warm_memfit.run(*args, hidden=("plotly",))
    assert result.returncode == 0, result.stderr
    assert [line for line in result.stderr.splitlines() if "HTML report" in line] == [
        "memfit: no HTML report: it needs plotly (pip install 'memfit[report]'); --no-report silences this line"
    ]
    assert not (out / "report.html").exists() and (out / "metrics.jsonl").exists()
