"""The HTML report and the comparison page, from synthetic run directories (no training, no browser)."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

pytest.importorskip("plotly")

from memfit.reporting import write_compare, write_report  # noqa: E402
from memfit.reporting.browser import remote_references  # noqa: E402
from memfit.reporting.compare import compare_figure  # noqa: E402
from memfit.reporting.figures import curves_figure  # noqa: E402
from memfit.reporting.run_data import load_run  # noqa: E402
from memfit_cli import REPO, run_memfit  # noqa: E402

# The stated bound (docs/report.md): plotly.js inline is about 4.6 MiB; a 2,000-step run adds under 400 KiB.
MAX_REPORT_BYTES = 5 * 1024**2
MAX_DATA_BYTES = 400 * 1024


def _plotly_js_bytes() -> int:
    from plotly.offline import get_plotlyjs

    return len(get_plotlyjs().encode("utf-8"))


def _trace_names(page: str, div_id: str) -> list[str]:
    """The names of the series a chart is given, read from its Plotly.newPlot call."""
    call = re.search(r'Plotly\.newPlot\(\s*"' + re.escape(div_id) + r'",\s*', page)
    assert call, f"no chart {div_id}"
    traces, _ = json.JSONDecoder().raw_decode(page, call.end())
    return [trace.get("name") for trace in traces]


def test_report_of_a_2000_step_run_stays_small(make_run):
    run_dir = make_run(steps=2000, oom_at=(100, 700), resume_at=1000)
    path = write_report(run_dir)
    size = path.stat().st_size
    assert size < MAX_REPORT_BYTES, size
    assert size - _plotly_js_bytes() < MAX_DATA_BYTES, size - _plotly_js_bytes()
    page = path.read_text()
    assert "this file: " in page and "MiB</footer>" in page  # the page states its own size
    assert remote_references(page) == []
    names = _trace_names(page, "curves")
    assert {"loss", "OOM recovered", "resumed"} <= set(names)
    assert ">resumed<" in page and "out of memory, recovered" in page


def test_report_shows_what_ran_the_memory_and_escapes_text(make_run):
    page = write_report(make_run(steps=12)).read_text()
    assert "adamw-8bit asked, bitsandbytes missing: adamw ran" in page  # the fallback and why
    assert "&lt;b&gt;checkpointing&lt;/b&gt;" in page and "<b>checkpointing</b>" not in page
    assert set(_trace_names(page, "timeline")) == {"parameters", "gradients", "optimizer states", "activations", "other"}
    assert _trace_names(page, "breakdown") == ["measured", "estimated (analytical)"]
    assert "model.layers.0.mlp" in page and "aten.mm" in page  # top modules and tensors
    assert "--gradient-checkpointing full" in page  # advice
    assert "in step 2 (backward)" in page  # the run's step number, not the tracker's


def test_mfu_and_the_predicted_step_time_are_shown(make_run):
    run_dir = make_run(steps=6, mfu=0.1234)
    page = write_report(run_dir).read_text()
    assert "12.3%" in page and "1.25 s" in page and "predicted 1.5 s" in page
    mfu = next(trace for trace in curves_figure(load_run(run_dir)).data if trace.name == "mfu")
    assert list(mfu.y) == pytest.approx([12.34] * 6)  # percent of the device's peak


def test_untracked_run_says_how_to_get_the_memory_sections(make_run):
    page = write_report(make_run(steps=5, tracked=False)).read_text()
    assert "--track-memory" in page
    assert 'id="timeline"' not in page
    assert 'id="breakdown"' not in page


def test_long_curves_are_downsampled_and_events_kept(make_run):
    run = load_run(make_run(steps=5000, oom_at=(4321,)))
    figure = curves_figure(run)
    loss = next(trace for trace in figure.data if trace.name == "loss")
    assert len(loss.x) <= 2000 and loss.x[-1] == 5000
    oom = next(trace for trace in figure.data if trace.name == "OOM recovered")
    assert list(oom.x) == [4321]


def test_compare_overlays_every_run(make_run):
    runs = [make_run("baseline", steps=50), make_run("checkpointed", steps=60, oom_at=(10,)), make_run("x/baseline", steps=5)]
    loaded = [load_run(run) for run in runs]
    figure = compare_figure(loaded)
    assert len(figure.data) == 3 * len(runs)  # loss, tokens/s and peak memory per run
    path = write_compare(runs, runs[0].parent / "compare.html")
    page = path.read_text()
    assert remote_references(page) == []
    names = _trace_names(page, "compare")
    assert "checkpointed" in names and "tmp" not in " ".join(names)
    assert "x/baseline" in page  # two runs named "baseline" are told apart by their parent


def test_cli_report_and_compare(make_run, tmp_path):
    run_dir = make_run(steps=10)
    result = run_memfit("report", run_dir, "-o", tmp_path / "out" / "r.html")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "out" / "r.html").is_file() and "MiB" in result.stdout
    other = make_run("other", steps=8)
    result = run_memfit("compare", run_dir, other, "--output", tmp_path / "c.html")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "c.html").stat().st_size > 1_000_000


@pytest.mark.parametrize(
    "args, expected",
    [
        (["report", "{missing}"], "does not exist"),
        (["report", "{run}", "-o", "{tmp}/r.png"], "give a .html file name"),
        (["report"], "give one run directory"),
        (["report", "{run}", "--bogus"], "unknown option --bogus"),
        (["compare", "{run}"], "give two or more run directories"),
        (["compare", "{run}", "{missing}", "-o", "{tmp}/c.html"], "does not exist"),
    ],
)
def test_cli_bad_input_is_one_line_exit_2_nothing_written(make_run, tmp_path, args, expected):
    run_dir = make_run(steps=3)
    before = sorted(path.name for path in run_dir.iterdir())
    values = {"run": run_dir, "missing": tmp_path / "nope", "tmp": tmp_path}
    result = run_memfit(*[arg.format(**values) for arg in args])
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and expected in lines[0], result.stderr
    assert sorted(path.name for path in run_dir.iterdir()) == before
    assert not list(tmp_path.glob("*.html")) and not list(tmp_path.glob("*.png"))


def test_without_plotly_report_says_so_in_one_line(make_run):
    run_dir = make_run(steps=3)
    hide = "import sys; sys.modules['plotly'] = None; from memfit.cli.main import main; sys.exit(main(sys.argv[1:]))"
    result = subprocess.run(
        [sys.executable, "-c", hide, "report", str(run_dir)], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert result.returncode == 2
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "pip install 'memfit[report]'" in lines[0], result.stderr
    assert not (run_dir / "report.html").exists()


def test_run_killed_before_its_first_step_still_has_a_report(tmp_path):
    from run_records import start_record

    run_dir = tmp_path / "killed"
    run_dir.mkdir()
    lines = [start_record(), {"step": 1, "loss": None, "lr": "inf", "grad_norm": None}]  # NaN and inf as JSON writes them
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    page = write_report(run_dir).read_text()
    assert "no summary: the run did not finish" in page
    assert remote_references(page) == []


def test_the_configuration_says_what_each_technique_reports_and_what_changed_while_running():
    from memfit.reporting.page import configuration_rows
    from memfit.reporting.run_data import from_records

    records = [
        {"event": "start", "precision": "fp32", "techniques": {"loss_chunk_size": 1024, "toy_level": 2}},
        {"step": 1, "loss": 2.0},
        {"step": 1, "event": "run_changed", "technique": "gradient_checkpointing", "from": "checkpointing='off'",
         "to": "checkpointing='full'", "reason": "out of memory in backward at micro-batch 1"},
        {"step": 2, "loss": 1.9},
    ]
    rows = dict(configuration_rows(from_records(records, "run", "memory")))
    assert rows["techniques"] == "loss chunk size 1024, toy level 2"
    assert rows["changed while running"] == ("step 1: gradient_checkpointing checkpointing='off' -> checkpointing='full'"
                                             " (out of memory in backward at micro-batch 1)")
