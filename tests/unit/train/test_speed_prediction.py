"""A run's own predicted step time counts what its techniques cost: offload's host-link traffic, the tiled MLP.

Before, `memfit.train.speed` handed the speed model none of them, so an offloaded run was predicted at the
plain run's step time (every row of benchmarks/bench_offload_overlap.py on an H100 showed the same figure).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from memfit.config import TrainConfig
from memfit.models.flops import DevicePeak
from memfit.models.tiny import tiny_config
from memfit.prediction.estimator import estimate
from memfit.resolution.resolve import resolve
from memfit.train.speed import SpeedMeter, _planner_step_seconds, techniques_that_run

PEAK = DevicePeak(50e12, "test peak")  # a fast device next to a slow host link: the link decides
SLOW_LINK_GBPS = 0.5


def _config(**changes) -> TrainConfig:
    return TrainConfig().replace(seq_len=128, batch_size=4, gradient_checkpointing="full", **changes)


def _predicted(config: TrainConfig, link_gbps: float = SLOW_LINK_GBPS, techniques=None) -> float:
    return _planner_step_seconds(tiny_config(), config, PEAK, "full on 2 of 2 blocks", False, 1, "cuda",
                                 techniques, host_link_gbps=link_gbps)


def test_offload_makes_the_predicted_step_longer_by_its_traffic_over_a_slow_link():
    plain, offloaded = _config(), _config(activation_offload=True)
    moved = estimate(offloaded, hf_config=tiny_config()).details["pcie_bytes_per_micro_batch"]
    assert moved > 0
    slower = _predicted(offloaded) - _predicted(plain)
    assert slower > 0
    # the whole traffic at the link's rate: the planner's upper bound, now the run's too
    assert slower == pytest.approx(moved / (SLOW_LINK_GBPS * 1e9), rel=1e-6)
    # a faster link costs less
    assert _predicted(offloaded, link_gbps=64.0) - _predicted(plain, link_gbps=64.0) < slower


def test_the_tiled_mlp_and_optimizer_offload_reach_the_speed_model():
    plain = _predicted(_config())
    assert _predicted(_config(tiled_mlp=4)) > plain  # one more MLP forward per step
    assert _predicted(_config(optimizer_offload=True, max_grad_norm=0.0)) > plain  # gradients down, weights up


def test_what_the_run_really_does_decides_not_what_was_asked():
    config = _config(activation_offload=True, optimizer_offload=True, max_grad_norm=0.0, compile=True, tiled_mlp=4)
    # on a CPU optimizer offload falls back (the state is in host memory already) and compile may run eager
    run = resolve(config, tiny_config(), "cpu").changed("compile", "Dynamo ran the blocks eager", compiled=False)
    session = SimpleNamespace(config=config, fallbacks={"optimizer_offload": "no effect on CPU"}, run=run)
    ran = techniques_that_run(session)
    assert ran == {"activation_offload": True, "tiled_mlp": 4, "compile": False, "optimizer_offload": False}
    asked = techniques_that_run(None, config)
    assert asked["optimizer_offload"] and asked["compile"]
    assert _predicted(config, techniques=ran) < _predicted(config, techniques=asked)


def test_a_cpu_run_of_an_offloaded_config_is_predicted_slower_than_the_plain_one():
    def meter(config: TrainConfig) -> SpeedMeter:
        return SpeedMeter.for_run(tiny_config(), config, torch.device("cpu"), None, "full on 2 of 2 blocks",
                                  chunked_loss=False)

    assert meter(_config(activation_offload=True)).predicted_step_seconds > meter(_config()).predicted_step_seconds
