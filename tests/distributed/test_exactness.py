"""Every engine gives the single-process update, under SGD without clipping, and the check can fail.

Adam's update does not change when every gradient is scaled, and clipping at 1.0 hides most
of the rest, so an engine whose loss normalizer is wrong by the world size would pass an
AdamW comparison. Here every run trains with plain SGD (no momentum, no clipping, constant
rate): the final weights after 3 steps are the initial ones minus 0.5 x the summed gradients,
so comparing them compares the gradients. Each engine's twin run has every backward pass
halved (the normalizer not divided by the world size) and must then differ.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from torchrun_helpers import EXTENSIONS_CACHE, REPO, assert_same_weights, deepspeed_available, final_weights, single

from fault_injection import SGD_FLAGS, largest_update
from memfit.distributed.parallel import CAP_RANK_ENV
from memfit.train.metrics import read_metrics

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("exactness_worker.py")
FAULT = 0.5  # gradients half their size: the loss normalizer not divided by the world size


@pytest.fixture(scope="module")
def sgd_args(run_args) -> list[str]:
    return [*run_args, *SGD_FLAGS, "--lr", "0.5", "--no-report"]


@pytest.fixture(scope="module")
def sgd_single(sgd_args, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sgd-single")
    single(*sgd_args, "--batch-size", "4", "--gradient-accumulation-steps", "2", "--output-dir", out)
    return out


def _launch_runs(runs: list[dict], tmp_path: Path, env: dict | None = None) -> None:
    spec = tmp_path / "runs.json"
    spec.write_text(json.dumps(runs))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(WORKER), str(spec)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(EXTENSIONS_CACHE), **(env or {})}
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=REPO, env=env)
    assert done.returncode == 0, done.stderr[-4000:]


ENGINES = {"ddp": ["--sharding", "ddp"], "fsdp": ["--sharding", "fsdp"]}


@pytest.fixture(scope="module")
def engine_runs(sgd_args, tmp_path_factory) -> dict[str, Path]:
    """For each engine, a clean run and one with the fault, all in one torchrun launch."""
    root = tmp_path_factory.mktemp("engines")
    outputs, runs = {}, []
    for engine, flags in ENGINES.items():
        for scale in (None, FAULT):
            name = engine if scale is None else f"{engine}-fault"
            outputs[name] = root / name
            tracking = ["--track-memory"] if engine == "ddp" and scale is None else []  # calibrates the cap below
            runs.append({"args": [*sgd_args, "--batch-size", "4", *flags, *tracking, "--output-dir", str(root / name)],
                         "grad_scale": scale})
    _launch_runs(runs, root)
    return outputs


def test_sgd_reference_moves_the_weights_far_beyond_the_tolerance(sgd_single, llama_dir):
    initial = load_file(str(llama_dir / "model.safetensors"))
    assert largest_update(initial, final_weights(sgd_single)) > 1e-2


@pytest.mark.parametrize("engine", list(ENGINES))
def test_engine_equals_single_process_under_sgd(engine, engine_runs, sgd_single):
    assert_same_weights(final_weights(sgd_single), final_weights(engine_runs[engine]))
    summary = read_metrics(engine_runs[engine] / "metrics.jsonl")[-1]
    assert summary["world_size"] == 2 and summary["optimizer"].startswith("sgd")


@pytest.mark.parametrize("engine", list(ENGINES))
def test_engine_check_fails_on_a_2x_gradient_error(engine, engine_runs, sgd_single):
    with pytest.raises(AssertionError):
        assert_same_weights(final_weights(sgd_single), final_weights(engine_runs[f"{engine}-fault"]))


@pytest.fixture(scope="module")
def capped_runs(engine_runs, sgd_args, tmp_path_factory) -> dict[str, Path]:
    """DDP with a memory cap on rank 1 only (it splits its micro-batch of 4), clean and with the fault."""
    steps = [r for r in read_metrics(engine_runs["ddp"] / "metrics.jsonl") if "event" not in r]
    rank = steps[-1]["ranks"][1]
    static = rank["parameters"] + rank["gradients"] + rank["optimizer_states"]
    peak = max(s["ranks"][1]["tracked_peak_bytes"] for s in steps)
    cap = static + int(0.8 * (peak - static))  # fits a micro-batch of 2, not of 4
    root = tmp_path_factory.mktemp("capped")
    outputs = {"capped": root / "capped", "capped-fault": root / "capped-fault"}
    runs = [{"args": [*sgd_args, "--batch-size", "4", "--sharding", "ddp", "--memory-cap", str(cap), "--output-dir",
                      str(out)], "grad_scale": 2.0 if name.endswith("fault") else None} for name, out in outputs.items()]
    _launch_runs(runs, root, env={CAP_RANK_ENV: "1"})
    return outputs


def test_ddp_oom_recovery_on_one_rank_equals_single_process_under_sgd(capped_runs, sgd_single):
    ooms = [r for r in read_metrics(capped_runs["capped"] / "metrics.jsonl") if r.get("event") == "oom"]
    assert ooms and {r["rank"] for r in ooms} == {1} and ooms[0]["new_micro_batch_size"] == 2
    assert_same_weights(final_weights(sgd_single), final_weights(capped_runs["capped"]))


def test_ddp_oom_recovery_check_fails_on_a_2x_gradient_error(capped_runs, sgd_single):
    assert any(r.get("event") == "oom" for r in read_metrics(capped_runs["capped-fault"] / "metrics.jsonl"))
    with pytest.raises(AssertionError):
        assert_same_weights(final_weights(sgd_single), final_weights(capped_runs["capped-fault"]))


@pytest.fixture(scope="module")
def zero_runs(sgd_args, tmp_path_factory) -> dict[str, Path]:
    if not deepspeed_available():
        pytest.skip("deepspeed is not installed (pip install memfit[deepspeed]; make test installs it)")
    root = tmp_path_factory.mktemp("zero")
    zero = {"zero2": ["--zero-stage", "2"], "zero3-offload": ["--zero-stage", "3", "--zero-offload"]}
    outputs, runs = {}, []
    for name, flags in zero.items():
        for scale in (None, FAULT):
            key = name if scale is None else f"{name}-fault"
            outputs[key] = root / key
            runs.append({"args": [*sgd_args, "--batch-size", "2", "--gradient-accumulation-steps", "2", *flags,
                                  "--output-dir", str(root / key)], "grad_scale": scale})
    _launch_runs(runs, root)
    return outputs


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["zero2", "zero3-offload"])
def test_deepspeed_equals_single_process_under_sgd(stage, zero_runs, sgd_single):
    assert_same_weights(final_weights(sgd_single), final_weights(zero_runs[stage]))
    with pytest.raises(AssertionError):
        assert_same_weights(final_weights(sgd_single), final_weights(zero_runs[f"{stage}-fault"]))
