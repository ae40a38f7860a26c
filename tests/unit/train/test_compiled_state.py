"""Whether compiled code ran is one typed value (the resolved run's `compiled`) that the speed model and its
calibration both read; `session.compiled` is its description for people.

Before, both parsed the description: the loop wrote "off (asked, ran eager)" when Dynamo ran the blocks eager,
the speed model read `startswith("off")` (eager) and the calibration `!= "off"` (compiled), so a planned run that
fell back to eager taught the calibration a compiled step's time.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from memfit.config import TrainConfig
from memfit.models.tiny import tiny_config
from memfit.prediction import calibration
from memfit.resolution.resolve import resolve
from memfit.train.loop import _check_compiled
from memfit.train.metrics import NullLogger
from memfit.train.run_calibration import learn_from_run
from memfit.train.setup import TrainingSession
from memfit.train.speed import speed_line, techniques_that_run
from memfit.units import GIB


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))


class _Session(SimpleNamespace):
    """What `learn_from_run`, the loop's compile check and the speed model read of a TrainingSession."""

    change_run = TrainingSession.change_run
    compiled = TrainingSession.compiled


def _session(compiled: str, compiled_ran: bool) -> _Session:
    """A planned CPU run (`--memory-budget`) as `learn_from_run` and the speed model read it."""
    config = TrainConfig().replace(model="tiny", seq_len=64, batch_size=2, memory_budget=2 * GIB, compile=True)
    run = resolve(config, tiny_config(), "cpu").changed("compile", "test", compiled=compiled_ran)
    return _Session(config=config, device=torch.device("cpu"), dist=SimpleNamespace(world_size=1),
                    model=SimpleNamespace(config=tiny_config()), accumulation_steps=1, run=run,
                    applied={"compile": compiled}, fallbacks={})


def _learned(session) -> tuple[float, dict]:
    """The compile feature of the point the run taught the calibration, and what it noted of compile times."""
    learn_from_run(session, {"steps": 5, "measured_step_seconds": 0.5}, first_step_seconds=30.0)
    entry = calibration.read_cache()["calibration"][calibration.device_key("cpu")]
    return entry["points"][-1]["features"]["compile"], calibration.compile_facts("cpu")


def test_a_compile_that_fell_back_to_eager_calibrates_as_eager_and_is_predicted_eager():
    session = _session("4 of 4 blocks (inductor) and the loss", compiled_ran=True)
    # the first step ran under the tracker: Dynamo ran the blocks eager, and the loop says so
    _check_compiled(session, NullLogger(), tracked=True)
    assert session.compiled == "off (asked, ran eager)" and session.run.compiled is False
    assert session.run.events[-1].technique == "compile"  # the change is an event of the run, with its reason
    assert "ran eager" in session.fallbacks["compile"]
    compile_feature, compile_facts = _learned(session)
    assert compile_feature == 0.0  # the calibration learns an eager step
    assert "compile_seconds" not in compile_facts  # and no compile time from an eager first step
    assert techniques_that_run(session)["compile"] is False  # the speed model reads the same value


def test_a_compiled_run_calibrates_as_compiled():
    session = _session("4 of 4 blocks (inductor) and the loss", compiled_ran=True)
    compile_feature, compile_facts = _learned(session)
    assert compile_feature == 1.0 and compile_facts["compile_seconds"] == pytest.approx(29.5)
    assert techniques_that_run(session)["compile"] is True


@pytest.mark.parametrize("description", ["off", "off (asked, ran eager)", "4 of 4 blocks (inductor)", ""])
def test_the_description_is_never_parsed(description):
    """Whatever the words say, the typed value decides: both readers agree with it and with each other."""
    for ran in (False, True):
        session = _session(description, compiled_ran=ran)
        assert techniques_that_run(session)["compile"] is ran
        assert _learned(session)[0] == float(ran)
        line = speed_line({"measured_step_seconds": 1.0, "compile": description, "compiled_ran": ran})
        assert ("compiled " in line) is ran
