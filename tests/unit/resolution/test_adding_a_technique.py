"""Adding a technique takes one module and one registry line: the toy technique (tests/toy_technique.py) is
validated, applied, reported and estimated with no other edit, and the registry's order is checked."""

from __future__ import annotations

import json

import pytest

import toy_technique
from memfit.cli.main import main
from memfit.config import TrainConfig
from memfit.config_loading import load_config
from memfit.errors import UsageError
from memfit.prediction.estimator import estimate
from memfit.resolution import registry
from memfit.resolution.resolve import report, resolve
from memfit.techniques.technique import Technique
from memfit.units import MIB


@pytest.fixture
def toy():
    registry.register(toy_technique.TECHNIQUE)  # the one registry line
    try:
        yield toy_technique.TECHNIQUE
    finally:
        registry.unregister("toy")


def test_its_setting_is_a_flag_and_a_yaml_key(toy, tmp_path):
    assert load_config(None, [("--toy-level", "2")]).toy.toy_level == 2
    config_file = tmp_path / "run.yaml"
    config_file.write_text("toy:\n  toy_level: 1\n")
    assert load_config(config_file).toy.toy_level == 1
    assert TrainConfig().toy.toy_level == 0
    assert TrainConfig().to_dict()["toy"] == {"toy_level": 0}


def test_it_is_resolved_reported_and_refused(toy):
    run = resolve(TrainConfig().replace(toy_level=2), None, "cpu")
    assert run.extra["toy_level"] == 2
    assert report(run)["toy_level"] == 2
    with pytest.raises(UsageError, match="--toy-level 9: at most 3"):
        resolve(TrainConfig().replace(toy_level=9), None, "cpu")


def test_a_refused_value_stops_the_command_with_one_line(toy, tmp_path, capsys):
    out = tmp_path / "out"
    code = main(["train", "--model", "tiny", "--toy-level", "9", "--output-dir", str(out),
                 "--max-steps", "1"])
    assert code == 2
    assert "--toy-level 9: at most 3" in capsys.readouterr().err
    assert not out.exists()


def test_it_is_applied_to_the_model_and_reported_in_the_metrics(toy, tmp_path):
    out = tmp_path / "out"
    code = main(["train", "--model", "tiny", "--toy-level", "2", "--output-dir", str(out),
                 "--max-steps", "1", "--seq-len", "64", "--batch-size", "2"])
    assert code == 0
    start = next(json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                 if json.loads(line).get("event") == "start")
    assert start["techniques"]["toy_level"] == 2


def test_it_is_estimated(toy):
    base = TrainConfig().replace(model="tiny", seq_len=64, batch_size=2)
    without = estimate(base)
    with_toy = estimate(base.replace(toy_level=3))
    assert with_toy.peak_bytes - without.peak_bytes == 3 * MIB


def test_the_order_is_checked():
    first = Technique(name="first", summary="")
    second = Technique(name="second", summary="", after=("first",))
    registry.check_order([first, second])
    with pytest.raises(ValueError, match="'second' must come after first"):
        registry.check_order([second, first])
    with pytest.raises(ValueError, match="registered twice"):
        registry.check_order([first, first])
    with pytest.raises(ValueError, match="after a later stage"):
        registry.check_order([Technique(name="step", summary="", stage="step"), first])


def test_a_setting_name_that_exists_is_refused():
    from dataclasses import dataclass

    @dataclass
    class Clash:
        lora_r: int = 0
        """Clashes with LoRA's rank."""

    with pytest.raises(ValueError, match="'lora_r' exists already"):
        registry.register(Technique(name="clash", summary="", section=Clash))
    assert "clash" not in [t.name for t in registry.techniques()]


def test_setup_applies_it_in_registry_order(toy, tmp_path):
    from memfit.train.setup import build_session

    config = TrainConfig().replace(model="tiny", toy_level=2, seq_len=64, batch_size=2, max_steps=1,
                                   output_dir=str(tmp_path / "out"))
    session = build_session(config)
    assert session.model.toy_level == 2
    assert session.applied["toy"] == "toy technique: level 2"
    assert session.run.extra["toy_level"] == 2
