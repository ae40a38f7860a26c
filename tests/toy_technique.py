"""A toy memory technique, written the way a new technique is added: one module, one `register` call.

It does nothing useful: `--toy-level N` marks the model, adds N MiB to the estimate's resident bytes and N ms to a
step's predicted time, and is refused above 3. Its test (tests/unit/resolution/test_adding_a_technique.py) sees it
validated, applied, reported, estimated and offered by the planner with no other edit to memfit.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.techniques.technique import Applied, Technique
from memfit.units import MIB

MAX_LEVEL = 3


@dataclass
class ToySettings:
    """The toy technique's settings: a section of every config while it is registered."""

    toy_level: int = 0
    """How strongly the toy technique acts (0: off); its bytes and seconds grow with it."""


def _resolve(facts, run) -> dict:
    return {"toy_level": facts.config.toy.toy_level}


def _refusals(run, facts) -> list[str]:
    level = run.extra["toy_level"]
    return [f"--toy-level {level}: at most {MAX_LEVEL}; use --toy-level {MAX_LEVEL}"] if level > MAX_LEVEL else []


def _apply(model, run, context) -> Applied:
    level = run.extra["toy_level"]
    if not level:
        return Applied()
    model.toy_level = level
    return Applied(f"toy technique: level {level}")


def _memory_terms(run, facts) -> dict[str, float]:
    return {"other": run.extra["toy_level"] * MIB}


def _speed_terms(run, facts) -> float:
    return run.extra["toy_level"] * 1e-3


TECHNIQUE = Technique(
    name="toy", summary="a toy: marks the model, costs N MiB and N ms", section=ToySettings, resolve=_resolve,
    refusals=_refusals, apply=_apply, memory_terms=_memory_terms, speed_terms=_speed_terms,
    report=lambda run: {"toy_level": run.extra["toy_level"]} if run.extra["toy_level"] else {},
    planner_values=lambda facts: [{"toy_level": 0}, {"toy_level": 2}],
)
