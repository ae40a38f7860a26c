"""`memfit estimate` on a tiny model of every causal-LM family of the zoo (tests/model_zoo.py): both methods, fp32
and bf16 weights, full training and LoRA.

Each command ends with exit 0 and prints no traceback anywhere, stderr included (torch logs a failing meta
kernel's traceback through its own logger: that counts). The analytical estimate lies within the bands of the two
methods of the traced one (the traced step is checked against the tracker on real steps in test_moe_estimate.py
and docs/accuracy.md). All commands share one process with tests/unit/models/test_model_zoo.py's (model_zoo.zoo_commands), so torch
and transformers are imported once and each family's layer probe runs once.
"""

from __future__ import annotations

import json

import pytest

import model_zoo
from memfit.prediction.estimator import ERROR_BAND
from model_zoo import ZOO

zoo_model_dirs = model_zoo.zoo_model_dirs  # the session fixtures, visible to this module's tests
zoo_commands = model_zoo.zoo_commands
pytestmark = pytest.mark.xdist_group(model_zoo.ZOO_GROUP)  # with test_model_zoo.py: one process for both

VARIANTS = {
    "fp32": ["--dtype", "fp32"],
    "bf16": ["--dtype", "bf16"],
    "lora": ["--dtype", "fp32", "--lora-r", "4"],
}
METHODS = ("analytical", "traced")
TRACED_VARIANTS = {"fp32": ZOO, "bf16": (), "lora": ("qwen3_moe", "gpt_oss", "deepseek_v3", "mamba2")}
"""Where the traced step also runs: fp32 everywhere (the grouped path's meta kernel wants bf16), LoRA on one family
of each kind (experts split LoRA, attention sinks, shared experts, state space); the rest analytical only, to keep
the whole module to one short process."""
AGREE = ERROR_BAND["analytical"] + ERROR_BAND["traced"]
HYBRID_AGREEMENT = {"jamba": 0.20}
"""Mamba layers' reference scan keeps what the probe's one forward at 64 and 128 tokens extrapolates loosely."""


def zoo_commands_of(zoo_model_dirs, text_file, out) -> dict[tuple[str, str, str], list[str]]:
    """(family, variant, method) -> `memfit estimate ... --json` (model_zoo.zoo_commands runs them)."""
    commands = {}
    for family, directory in zoo_model_dirs.items():
        for variant, flags in VARIANTS.items():
            for method in METHODS:
                if method == "traced" and family not in TRACED_VARIANTS[variant]:
                    continue
                commands[family, variant, method] = ["estimate", "--model", str(directory), "--method", method,
                                                     "--seq-len", "32", "--batch-size", "2", "--json", *flags]
    return commands


@pytest.fixture(scope="module")
def zoo_estimates(zoo_commands) -> dict[tuple[str, str, str], dict]:
    """(family, variant, method) -> the result of its command, run in the zoo's one process (with test_model_zoo's
    commands, which read the layer probes these fill)."""
    return zoo_commands[__name__]


@pytest.mark.parametrize("family", sorted(ZOO))
def test_estimate_runs_on_every_family_without_a_traceback(zoo_estimates, family):
    for (name, variant, method), result in zoo_estimates.items():
        if name != family:
            continue
        where = f"{family} {variant} {method}: exit {result['returncode']}\n{result['stderr'][-2500:]}"
        assert result["returncode"] == 0, where
        assert "Traceback" not in result["stderr"] + result["stdout"], where
        estimate = json.loads(result["stdout"])
        assert estimate["peak_bytes"] > 0, where
        assert estimate["parameters_total"] >= estimate["parameters_active"] > 0, where


@pytest.mark.parametrize("family", sorted(ZOO))
def test_analytical_estimate_agrees_with_the_traced_step(zoo_estimates, family):
    for variant in VARIANTS:
        if (family, variant, "traced") not in zoo_estimates:
            continue
        analytical, traced = (json.loads(zoo_estimates[family, variant, method]["stdout"])["peak_bytes"]
                              for method in METHODS)
        tolerance = HYBRID_AGREEMENT.get(family, AGREE)
        assert analytical / traced - 1 == pytest.approx(0, abs=tolerance), f"{family} {variant}"


def test_moe_families_report_active_below_total(zoo_estimates):
    for family in model_zoo.MOE_FAMILIES:
        estimate = json.loads(zoo_estimates[family, "bf16", "analytical"]["stdout"])
        assert estimate["parameters_active"] < estimate["parameters_total"], family
        assert estimate["details"]["experts"] == 4 and estimate["details"]["experts_per_token"] == 2, family
