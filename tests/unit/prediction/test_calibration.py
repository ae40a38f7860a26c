"""Calibration: measured step times on this device correct the speed model's ranking, per device."""

from __future__ import annotations

import math

import pytest

from memfit.config_loading import load_config
from memfit.prediction import calibration
from memfit.prediction.estimator import estimate
from memfit.prediction.planner import plan
from memfit.prediction.speed_model import compile_pays_after_flops, compute_dtype, estimated_step_seconds


@pytest.fixture(autouse=True)
def own_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMFIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)


def _spearman(a: list[float], b: list[float]) -> float:
    def ranks(values):
        order = sorted(range(len(values)), key=lambda i: values[i])
        out = [0.0] * len(values)
        for rank, i in enumerate(order):
            out[i] = float(rank)
        return out

    ra, rb = ranks(a), ranks(b)
    n = len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb, strict=True)) / (n * (n * n - 1))


def _setup():
    from memfit.models.presets import resolve_model_config

    config = load_config(overrides={"model": "tiny", "seq_len": 256, "batch_size": 8, "max_steps": 10})
    hf_config = resolve_model_config("tiny", False)
    result = plan(config, budget_bytes=1 << 30, hf_config=hf_config)
    return config, hf_config, result.ranked[:10]  # the ten best, as many as trials and runs measure in a few runs


def _seconds(config, hf_config, plans) -> list[float]:
    found = []
    for changes in plans:
        est = estimate(config.replace(**{k: v for k, v in changes.items() if k in config.flat()}), hf_config=hf_config)
        found.append(estimated_step_seconds(changes, config, est, None, hf_config))
    return found


def test_measurements_that_invert_the_model_turn_its_ranking_around():
    config, hf_config, ranked = _setup()
    plans = [r["plan"] for r in ranked]
    before = _seconds(config, hf_config, plans)
    assert len(set(before)) >= 4, "the ranked plans should differ in predicted time"
    # a device where the model's order is reversed: the slowest predicted measures fastest
    measured = [0.5 + 0.1 * rank for rank, _ in enumerate(sorted(before, reverse=True))]
    by_prediction = sorted(range(len(before)), key=lambda i: -before[i])
    truth = [0.0] * len(before)
    for position, i in enumerate(by_prediction):
        truth[i] = measured[position]
    assert _spearman(before, truth) < -0.5
    points = [(calibration.features(p, config, compute_dtype(p, config, "cpu")), s, t)
              for p, s, t in zip(plans, before, truth, strict=True)]
    calibration.record_points("cpu", points, "trial")
    after = _seconds(config, hf_config, plans)
    assert _spearman(after, truth) > 0.5
    # the plan it now predicts fastest is one of the two measured fastest (the ridge pull keeps it from fitting exactly)
    assert min(range(len(after)), key=after.__getitem__) in sorted(range(len(truth)), key=truth.__getitem__)[:2]
    # the rate term brings the seconds to this device's (the model's nominal rate is far faster than this)
    assert sum(after) / sum(truth) == pytest.approx(1.0, rel=0.3)
    # planning again ranks with the calibrated model (its figures are what the planner stores)
    again = plan(config, budget_bytes=1 << 30, hf_config=hf_config)
    assert again.ranked[0]["step_seconds"] <= min(after) * 1.0001


def test_uncalibrated_and_other_devices_are_untouched(monkeypatch):
    config, hf_config, ranked = _setup()
    plans = [r["plan"] for r in ranked]
    before = _seconds(config, hf_config, plans)
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")  # measured under another ISA: another device
    points = [(calibration.features(p, config, "fp32"), s, 10 * s) for p, s in zip(plans, before, strict=True)]
    calibration.record_points("cpu", points, "trial")
    assert _seconds(config, hf_config, plans) == pytest.approx([10 * s for s in before], rel=0.05)
    monkeypatch.delenv("ATEN_CPU_CAPABILITY")
    assert _seconds(config, hf_config, plans) == before


def test_native_bf16_follows_cpu_flags_and_the_onednn_cap(monkeypatch):
    monkeypatch.setattr(calibration, "cpu_flags", lambda: {"avx2", "avx512f", "avx512_bf16"})
    assert calibration.native_bf16("cpu")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert not calibration.native_bf16("cpu")
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_AMX")
    assert calibration.native_bf16("cpu")
    monkeypatch.setattr(calibration, "cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.delenv("ONEDNN_MAX_CPU_ISA")
    assert not calibration.native_bf16("cpu")


def test_bf16_planned_on_a_cpu_that_runs_it_natively(monkeypatch):
    from memfit.prediction.candidates import technique_grid

    config = load_config(overrides={"model": "tiny"})
    monkeypatch.setattr(calibration, "native_bf16", lambda device="cpu": False)
    assert not any(c.get("precision") == "amp" for c in technique_grid("full", config, None, 256, 1))
    monkeypatch.setattr(calibration, "native_bf16", lambda device="cpu": True)
    grid = technique_grid("full", config, None, 256, 1)
    assert sum(c.get("precision") == "amp" for c in grid) * 2 == len(grid)
    chosen = load_config(overrides={"model": "tiny", "precision": "fp32"})
    assert not any(c.get("precision") == "amp" for c in technique_grid("full", chosen, None, 256, 1))


def test_compile_repaid_after_what_this_device_measured():
    assert compile_pays_after_flops("cpu") is None  # nothing measured: the model's own threshold applies
    config, hf_config, ranked = _setup()
    plans = [r["plan"] for r in ranked[:3]]
    before = _seconds(config, hf_config, plans)
    calibration.record_points("cpu", [(calibration.features(p, config, "fp32"), s, 1e3 * s)
                                      for p, s in zip(plans, before, strict=True)], "run")
    calibration.record_compile("cpu", 40.0, None)
    slow_device = compile_pays_after_flops("cpu")
    calibration.record_compile("cpu", 80.0, None)
    assert compile_pays_after_flops("cpu") == pytest.approx(2 * slow_device)
    calibration.record_compile("cpu", 40.0, 0.9)  # compiled steps measured slower than eager: never repaid
    assert compile_pays_after_flops("cpu") == math.inf


def test_damaged_cache_is_ignored(tmp_path):
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "speed.json").write_text("{not json")
    assert calibration.correction({}, load_config(overrides={"model": "tiny"}), "cpu", "fp32") == 1.0
    calibration.record_points("cpu", [({"rate": 1.0}, 1.0, 2.0)], "trial")
    assert calibration.correction({}, load_config(overrides={"model": "tiny"}), "cpu", "fp32") == pytest.approx(2.0)
