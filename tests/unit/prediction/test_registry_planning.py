"""The estimate, the speed model and the planner read the registry: a technique registered beyond memfit's own is
estimated, timed and offered by the planner with no edit to memfit.

Two toy techniques, each a settings section with one level and the hooks a technique module would export:
`planned_toy` costs memory and time (2 MiB and 2 ms at level 2), `fast_toy` buys time with memory (level 2 runs
the step's compute 10 % faster and holds 1 GiB more).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from memfit.config_loading import load_config
from memfit.models.presets import resolve_model_config
from memfit.prediction import planner
from memfit.prediction.candidates import technique_grid
from memfit.prediction.estimator import estimate
from memfit.prediction.planner import plan
from memfit.prediction.speed_model import estimated_step_seconds
from memfit.resolution import registry
from memfit.techniques.technique import Technique
from memfit.units import GIB, MIB

TOY_BYTES_PER_LEVEL = MIB
TOY_SECONDS_PER_LEVEL = 1e-3


@dataclass
class PlannedToySettings:
    """The toy's settings: a section of every config while it is registered."""

    toy_level: int = 0
    """How strongly the toy acts (0: off): it holds toy_level MiB and costs toy_level ms a step."""


PLANNED_TOY = Technique(
    name="planned_toy", summary="a toy: costs N MiB and N ms", section=PlannedToySettings,
    resolve=lambda facts, run: {"toy_level": facts.config.planned_toy.toy_level},
    memory_terms=lambda run, facts: {"other": run.extra["toy_level"] * TOY_BYTES_PER_LEVEL},
    speed_terms=lambda run, facts: run.extra["toy_level"] * TOY_SECONDS_PER_LEVEL,
    planner_values=lambda facts: [{"toy_level": 0}, {"toy_level": 2}],
)


@dataclass
class FastToySettings:
    """The fast toy's settings: a section of every config while it is registered."""

    fast_level: int = 0
    """How strongly the fast toy acts (0: off): each level runs the step's compute 5 % faster and holds 512 MiB."""


FAST_TOY = Technique(
    name="fast_toy", summary="a toy: 5 % faster a level, 512 MiB a level", section=FastToySettings,
    resolve=lambda facts, run: {"fast_level": facts.config.fast_toy.fast_level},
    memory_terms=lambda run, facts: {"other": run.extra["fast_level"] * 512 * MIB},
    speed_terms=lambda run, facts: -0.05 * run.extra["fast_level"] * facts.compute_seconds,
    planner_values=lambda facts: [{"fast_level": 0}, {"fast_level": 2}],
)


def _registered(technique: Technique) -> Iterator[Technique]:
    registry.register(technique)
    try:
        yield technique
    finally:
        registry.unregister(technique.name)


@pytest.fixture
def toy() -> Iterator[Technique]:
    yield from _registered(PLANNED_TOY)


@pytest.fixture
def fast_toy() -> Iterator[Technique]:
    yield from _registered(FAST_TOY)


def _config(**overrides):
    return load_config(overrides={"model": "tiny", "seq_len": 64, "batch_size": 2, **overrides})


def _allocated(result) -> int:
    """The peak's bytes allocated to tensors (without a GPU's context and slack, which are not the toy's)."""
    return result.details.get("allocated_peak_bytes", result.peak_bytes)


def test_the_estimate_adds_its_bytes(toy):
    base = _config()
    assert _allocated(estimate(base.replace(toy_level=2))) - _allocated(estimate(base)) == 2 * TOY_BYTES_PER_LEVEL


def test_the_speed_model_adds_its_seconds(toy):
    config = _config()
    est, hf_config = estimate(config), resolve_model_config("tiny", False)
    shape = {"batch_size": 2, "gradient_accumulation_steps": 1}
    seconds = {level: estimated_step_seconds({**shape, "toy_level": level}, config, est, None, hf_config,
                                             calibrate=False) for level in (0, 2)}
    assert seconds[2] - seconds[0] == pytest.approx(2 * TOY_SECONDS_PER_LEVEL, rel=1e-9)


def test_every_combination_is_tried_with_each_value():
    config = _config()
    plain = technique_grid("full", config, None, 64, 1)
    registry.register(PLANNED_TOY)
    try:
        offered = technique_grid("full", config, None, 64, 1)
    finally:
        registry.unregister(PLANNED_TOY.name)
    assert offered == [{**combination, "toy_level": level} for combination in plain for level in (0, 2)]


def test_a_value_the_user_gave_is_kept(toy):
    grid = technique_grid("full", _config(toy_level=1), None, 64, 1)
    assert grid and not any("toy_level" in combination for combination in grid)


def test_the_plan_tries_it_and_keeps_the_faster_smaller_value(toy, monkeypatch):
    timed = []
    real = planner.estimated_step_seconds

    def spy(changes, *args, **kwargs):
        timed.append(changes.get("toy_level"))
        return real(changes, *args, **kwargs)

    monkeypatch.setattr(planner, "estimated_step_seconds", spy)
    result = plan(_config(), budget_bytes=4 * GIB)
    assert set(timed) == {0, 2}
    assert result.plan["toy_level"] == 0 and "--toy-level 0" in result.command


def test_the_plan_chooses_it_where_it_is_faster_and_fits(fast_toy):
    roomy = plan(_config(), budget_bytes=4 * GIB)
    assert roomy.plan["fast_level"] == 2 and "--fast-level 2" in roomy.command
    tight = plan(_config(), budget_bytes=512 * MIB)  # 1 GiB more does not fit: the slower level that fits
    assert tight.plan["fast_level"] == 0 and tight.estimated_peak_bytes <= 512 * MIB
