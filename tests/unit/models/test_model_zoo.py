"""Every family of the model zoo (tests/model_zoo.py) through `memfit train` (full and LoRA) and `memfit profile`.

A technique that is on by default must never break a model transformers trains: each command ends with exit 0,
and nothing anywhere in its output is a traceback, stderr included (a library logging one through its own
handler counts). All commands share one process with tests/unit/prediction/test_zoo_estimates.py's (model_zoo.zoo_commands), so
torch and transformers are imported once and each family's layer probe runs once.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import model_zoo
from model_zoo import MOE_FAMILIES, ZOO

zoo_model_dirs = model_zoo.zoo_model_dirs  # the session fixtures, visible to this module's tests
zoo_commands = model_zoo.zoo_commands
pytestmark = pytest.mark.xdist_group(model_zoo.ZOO_GROUP)  # with test_zoo_estimates.py: one process for both

# --no-report: the HTML page is the same code for every family and costs more than the tiny step
LEGS = {
    "full": ["train", "--no-report"],
    "lora": ["train", "--lora-r", "4", "--no-report"],
    "profile": ["profile", "--steps", "1"],
}


def zoo_commands_of(zoo_model_dirs, text_file, out) -> dict[tuple[str, str], list[str]]:
    """(family, leg) -> its `memfit` command (model_zoo.zoo_commands runs them)."""
    return {(family, leg): [*head, "--model", str(directory), "--dataset", str(text_file), "--seq-len", "32",
                            "--batch-size", "2", "--max-steps", "1", "--output-dir", str(out / f"{family}-{leg}")]
            for family, directory in zoo_model_dirs.items() for leg, head in LEGS.items()}


@pytest.fixture(scope="module")
def zoo_runs(zoo_commands) -> dict[tuple[str, str], dict]:
    """(family, leg) -> the result of that command, run in the zoo's one process with test_zoo_estimates.py's
    commands (the runs' speed predictions and the estimates read the same layer probes)."""
    return zoo_commands[__name__]


def _failure(result: dict) -> str:
    return f"exit {result['returncode']} of memfit {' '.join(result['args'][:3])}:\n{result['stderr'][-4000:]}"


@pytest.mark.parametrize("leg", list(LEGS))
@pytest.mark.parametrize("family", list(ZOO))
def test_family_runs_without_a_traceback(zoo_runs, family, leg):
    result = zoo_runs[(family, leg)]
    assert result["returncode"] == 0, _failure(result)
    assert "Traceback" not in result["stderr"] + result["stdout"], _failure(result)


@pytest.mark.parametrize("family", list(ZOO))
def test_lora_log_counts_what_the_adapter_holds(zoo_runs, family):
    """The log's 'LoRA r=4 on N modules' equals the adapted modules the run's summary lists."""
    result = zoo_runs[(family, "lora")]
    line = next((ln for ln in result["stderr"].splitlines() if "LoRA r=4 on" in ln), None)
    assert line is not None, _failure(result)
    lora = _summary(result)["lora"]  # read from the wrapped model: what the adapter holds
    assert f"on {lora['modules']} modules" in line, (line, lora)
    if family in MOE_FAMILIES:
        assert lora["expert_weights"] > 0 and f"and {lora['expert_weights']} fused expert weights" in line, line


@pytest.mark.parametrize("family", list(ZOO))
def test_metrics_say_which_experts_implementation_ran(zoo_runs, family):
    experts = _summary(zoo_runs[(family, "full")])["experts"]
    if family not in MOE_FAMILIES:
        assert experts is None
        return
    assert experts["implementation"] == "grouped_mm"  # transformers' grouped path, never the loop over experts
    assert experts["active_parameters"] < experts["total_parameters"]
    lora_experts = _summary(zoo_runs[(family, "lora")])["experts"]
    assert lora_experts["implementation"] in ("grouped_mm + split LoRA", "grouped_mm, grouped_mm + split LoRA")


def _summary(result: dict) -> dict:
    output_dir = Path(result["args"][result["args"].index("--output-dir") + 1])
    lines = (output_dir / "metrics.jsonl").read_text().splitlines()
    return next(json.loads(line) for line in reversed(lines) if '"summary"' in line)
