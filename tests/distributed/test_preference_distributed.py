"""DPO under torchrun (2 CPU ranks, gloo): DDP, FSDP2 and DeepSpeed ZeRO-2 give the one-process update of the same
effective batch, with the reference as a frozen copy and as log-probabilities cached before training; FSDP2 and
ZeRO-3 shard the frozen copy like the policy (each rank holds about half of it) and still give that update.

The DPO loss is a mean over the pairs of the whole effective batch (8 pairs: 4 a rank, or 4 x 2 accumulation in one
process), so under SGD without clipping the final weights compare the summed gradients. Each engine's twin has every
backward pass halved (the pair count not divided by the world size) and must then differ. All the 2-rank runs share
one launch (starting the ranks costs more than these 3-step runs); the ZeRO-2 runs and the ZeRO-3 copy run come
last, marked "record": a DeepSpeed that cannot build its CPU op ends the launch there, and their tests say why and skip.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torchrun_helpers import assert_same_weights, deepspeed_available, exit_code, final_weights, run_many, steps_of

from fault_injection import SGD_FLAGS, largest_update
from memfit.train.metrics import read_metrics

pytestmark = pytest.mark.distributed

FAULT = 0.5  # every gradient halved: the pairs of the effective batch not divided by the world size
REFERENCES = ("copy", "cached")
ENGINES = {"ddp": ["--batch-size", "4", "--sharding", "ddp"], "fsdp": ["--batch-size", "4", "--sharding", "fsdp"]}
ZERO = ["--batch-size", "2", "--gradient-accumulation-steps", "2", "--zero-stage", "2"]
ZERO3_FILE = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "train_batch_size": "auto",
              "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}
"""ZeRO-3 partitioning every parameter: the tiny model's tensors are all under DeepSpeed's default threshold (1e5
elements), below which a parameter stays whole on every rank, the copy's as the policy's."""
BUILD_FAILED = re.compile(r"Error building extension|ninja: build stopped|CalledProcessError|fatal error:")
"""What a failed build of DeepSpeed's CPU op (torch.utils.cpp_extension) leaves in the log."""


def _dpo_args(model: Path) -> list[str]:
    """3 SGD steps of DPO on the built-in pairs cut to 96 tokens (29 of the 50 keep completion tokens: 24 are used)."""
    return ["--task", "dpo", "--model", str(model), "--dataset", "builtin:preferences", "--chat-template", "chatml",
            "--seq-len", "96", "--truncate", "--max-steps", "3", "--beta", "0.5", "--no-report", *SGD_FLAGS,
            "--lr", "0.5"]


@pytest.fixture(scope="module")
def launches(llama_dir, tmp_path_factory) -> dict:
    """The one-process references (4 pairs x 2 accumulation), then one 2-rank launch: per engine and reference the
    run, per engine a twin with the fault (copy reference), and last the ZeRO-2 runs and the ZeRO-3 copy run when DeepSpeed imports."""
    root = tmp_path_factory.mktemp("dpo-ranks")
    args = _dpo_args(llama_dir)
    single = [{"name": f"one-{reference}", "args": [*args, "--reference", reference, "--batch-size", "4",
                                                     "--gradient-accumulation-steps", "2",
                                                     "--output-dir", str(root / f"one-{reference}")]}
              for reference in REFERENCES]
    run_many(single, root / "single", nproc=1)
    runs = []
    for engine, flags in ENGINES.items():
        runs += [{"name": f"{engine}-{reference}", "args": [*args, *flags, "--reference", reference]}
                 for reference in REFERENCES]
        runs.append({"name": f"{engine}-fault", "args": [*args, *flags, "--reference", "copy"], "grad_scale": FAULT})
    zero = deepspeed_available()
    if zero:
        runs += [{"name": f"zero2-{reference}", "args": [*args, *ZERO, "--reference", reference], "record": True}
                 for reference in REFERENCES]
        runs.append({"name": "zero2-fault", "args": [*args, *ZERO, "--reference", "copy"], "grad_scale": FAULT,
                     "record": True})
        ds_file = root / "zero3.json"
        ds_file.write_text(json.dumps(ZERO3_FILE))
        runs.append({"name": "zero3-copy", "args": [*args, *ZERO[:4], "--deepspeed", str(ds_file), "--reference", "copy"],
                     "record": True})
    for run in runs:
        run["args"] = [*run["args"], "--output-dir", str(root / run["name"])]
    logs = run_many(runs, root / "ranks", timeout=1200)
    dirs = {run["name"]: root / run["name"] for run in [*single, *runs]}
    return {"dirs": dirs, "logs": logs, "zero": zero, "root": root / "ranks"}


def _reference_facts(out: Path) -> dict:
    start = next(r for r in read_metrics(out / "metrics.jsonl") if r.get("event") == "start")
    return start["task"]["reference"]


def _losses(out: Path) -> list[float]:
    return [step["loss"] for step in steps_of(out)]


def test_the_one_process_references_move_the_weights_and_agree(launches, llama_dir):
    dirs = launches["dirs"]
    initial = load_file(str(llama_dir / "model.safetensors"))
    assert largest_update(initial, final_weights(dirs["one-copy"])) > 1e-2
    assert_same_weights(final_weights(dirs["one-copy"]), final_weights(dirs["one-cached"]))
    assert _reference_facts(dirs["one-copy"])["mode"] == "copy"
    assert _reference_facts(dirs["one-cached"])["mode"] == "cached"


@pytest.mark.parametrize("reference", REFERENCES)
@pytest.mark.parametrize("engine", list(ENGINES))
def test_engine_equals_one_process_on_the_same_effective_batch(engine, reference, launches):
    dirs = launches["dirs"]
    run, one = dirs[f"{engine}-{reference}"], dirs[f"one-{reference}"]
    assert_same_weights(final_weights(one), final_weights(run))
    assert _losses(run) == pytest.approx(_losses(one), abs=1e-5)  # each step's loss: the mean over its 8 pairs
    summary = read_metrics(run / "metrics.jsonl")[-1]
    assert summary["world_size"] == 2 and summary["optimizer"].startswith("sgd")
    assert _reference_facts(run)["mode"] == reference


@pytest.mark.parametrize("engine", list(ENGINES))
def test_engine_check_fails_on_a_2x_normalisation_error(engine, launches):
    dirs = launches["dirs"]
    with pytest.raises(AssertionError):
        assert_same_weights(final_weights(dirs["one-copy"]), final_weights(dirs[f"{engine}-fault"]))


@pytest.mark.parametrize("engine", list(ENGINES))
def test_the_cached_reference_holds_the_one_process_numbers(engine, launches):
    """Computed once before training, from the whole model (before the engine shards or wraps it), each rank a share
    of the items once every rank has the data (none waits in a barrier for it): the same file."""
    dirs = launches["dirs"]
    facts, one = _reference_facts(dirs[f"{engine}-cached"]), _reference_facts(dirs["one-cached"])
    assert facts["items"] == one["items"] == 29 and not facts["reused"]
    assert facts["ranks"] == 2 and one["ranks"] == 1
    assert "computed by 2 ranks, a share each, into" in launches["logs"][f"{engine}-cached"]
    stored, expected = load_file(facts["cache_file"])["logps"], load_file(one["cache_file"])["logps"]
    assert stored.shape == (29, 2) and (stored < 0).all()
    torch.testing.assert_close(stored, expected, atol=1e-5, rtol=0)


def _zero_run(launches, name: str) -> Path:
    """The ZeRO run NAME's output, or a skip that says why it has none."""
    if not launches["zero"]:
        pytest.skip("deepspeed is not installed (pip install memfit[deepspeed])")
    code = exit_code(launches["root"], name)
    log = launches["logs"].get(name, "")
    if code is None:
        pytest.skip(f"{name} did not run: an earlier ZeRO-2 run of the launch crashed")
    if code != 0 and BUILD_FAILED.search(log):
        pytest.skip(f"DeepSpeed could not build its CPU op here: {log.strip().splitlines()[-1][:300]}")
    assert code == 0, log[-4000:]
    return launches["dirs"][name]


@pytest.mark.slow
@pytest.mark.parametrize("reference", REFERENCES)
def test_zero2_equals_one_process_on_the_same_effective_batch(reference, launches):
    run = _zero_run(launches, f"zero2-{reference}")
    one = launches["dirs"][f"one-{reference}"]
    assert_same_weights(final_weights(one), final_weights(run))
    assert _losses(run) == pytest.approx(_losses(one), abs=1e-5)
    assert "zero-2" in read_metrics(run / "metrics.jsonl")[-1]["optimizer"]


@pytest.mark.slow
def test_zero2_check_fails_on_a_2x_normalisation_error(launches):
    run = _zero_run(launches, "zero2-fault")
    with pytest.raises(AssertionError):
        assert_same_weights(final_weights(launches["dirs"]["one-copy"]), final_weights(run))


@pytest.mark.parametrize("engine", list(ENGINES))
def test_the_copy_is_sharded_where_the_policy_is(engine, launches):
    """FSDP2 holds about half of the frozen copy on each of 2 ranks (its shards, plus the whole rotary buffers); DDP
    holds the whole copy, as one process does. A copy left whole under FSDP2 fails the first check."""
    facts, one = _reference_facts(launches["dirs"][f"{engine}-copy"]), _reference_facts(launches["dirs"]["one-copy"])
    assert facts["copy_bytes"] == one["copy_bytes"] == one["copy_rank_bytes"] > 0
    if engine == "fsdp":
        assert facts["copy_sharding"] == "fsdp" and facts["copy_ranks"] == 2
        assert 0.45 < facts["copy_rank_bytes"] / facts["copy_bytes"] < 0.55
        assert "MiB a rank for the frozen copy" in launches["logs"]["fsdp-copy"]
    else:
        assert "copy_sharding" not in facts and facts["copy_rank_bytes"] == facts["copy_bytes"]


@pytest.mark.slow
def test_zero3_shards_the_copy_and_equals_one_process(launches):
    """ZeRO-3 partitions the frozen copy as it partitions the policy (deepspeed.initialize without an optimizer): each
    rank holds about half of it, and the update is the one-process update with a whole copy."""
    run = _zero_run(launches, "zero3-copy")
    one = launches["dirs"]["one-copy"]
    assert_same_weights(final_weights(one), final_weights(run))
    assert _losses(run) == pytest.approx(_losses(one), abs=1e-5)
    facts = _reference_facts(run)
    assert facts["copy_sharding"] == "zero-3" and facts["copy_ranks"] == 2
    assert 0.45 < facts["copy_rank_bytes"] / facts["copy_bytes"] < 0.55
