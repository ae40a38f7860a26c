"""GRPO under torchrun (2 CPU ranks, gloo): each rank generates its share of the step's completions, with the full
weights under FSDP2 and ZeRO-3 (sharded parameters), and the run reaches the one-process weights of the same effective batch.

Every completion is seeded by (seed, step, prompt, generation), not by the rank or the batch it runs in, so the two
ranks together sample the completions one process samples for the same prompts. Under SGD without clipping the final
weights compare the summed gradients. Two twins must differ: completions seeded by rank (grpo_faults.seeded_by_rank),
and the loss normalised by each rank's own completions and tokens (grpo_faults.counted_by_rank). With a reference
(--beta) and each rollout trained twice (--num-iterations 2) the loss's metrics (kl, clip_ratio/*) of the 2 ranks are
over both ranks' tokens, so they equal one process's; rank 0's tokens alone (grpo_faults.metrics_of_each_rank) must
not; that run also counts the task's collectives (grpo_faults.counted_collectives). One launch holds every 2-rank
run.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from safetensors.torch import load_file
from torchrun_helpers import assert_same_weights, deepspeed_available, exit_code, final_weights, run_many, steps_of

from fault_injection import SGD_FLAGS, largest_update

pytestmark = pytest.mark.distributed

REWARDS = """
def token_value(completions, completion_ids=None, **kwargs):
    return [sum(token % 10 for token in ids) / (10 * max(1, len(ids))) for ids in completion_ids]
"""
FAULTS = {"by-rank": "grpo_faults:seeded_by_rank", "counted-by-rank": "grpo_faults:counted_by_rank"}
"""The twins: completions seeded by rank; the loss normalised by each rank's own completions and tokens."""
LOSS_FLAGS = ["--beta", "0.1", "--num-iterations", "2"]
"""A KL term to a reference and a rollout trained twice: kl and clip_ratio/* are not 0 after the first step."""
LOSS_METRICS = ("kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")
ENGINES = {"fsdp": ["--batch-size", "4", "--sharding", "fsdp"]}
ZERO = {stage: ["--batch-size", "2", "--gradient-accumulation-steps", "2", "--zero-stage", stage[-1]]
        for stage in ("zero2", "zero3")}
"""ZeRO-3 shards the parameters too: DeepSpeed gathers each module's parameters in its forward, generation's included."""
BUILD_FAILED = re.compile(r"Error building extension|ninja: build stopped|CalledProcessError|fatal error:")
"""What a failed build of DeepSpeed's CPU op (torch.utils.cpp_extension) leaves in the log."""


def _grpo_args(model: Path, rewards: Path) -> list[str]:
    """3 SGD steps of GRPO on the built-in prompts: 4 prompts a step, 2 completions of at most 6 tokens each."""
    return ["--task", "grpo", "--model", str(model), "--chat-template", "chatml", "--reward-function",
            f"{rewards}:token_value", "--num-generations", "2", "--max-completion-length", "6",
            "--max-prompt-length", "48", "--max-steps", "3", "--no-report", *SGD_FLAGS, "--lr", "0.5"]


@pytest.fixture(scope="module")
def launches(llama_dir, tmp_path_factory) -> dict:
    """The one-process reference (4 completions x 2 accumulation), then one 2-rank launch: per engine the run and its
    twins (FAULTS), then the same under DeepSpeed ZeRO-2 and ZeRO-3 (2 completions x 2 accumulation a rank)
    when it imports."""
    root = tmp_path_factory.mktemp("grpo-ranks")
    rewards = root / "rewards.py"
    rewards.write_text(REWARDS)
    args = _grpo_args(llama_dir, rewards)
    one = [*args, "--batch-size", "4", "--gradient-accumulation-steps", "2"]
    single = [{"name": "one", "args": [*one, "--output-dir", str(root / "one")]},
              {"name": "one-kl", "args": [*one, *LOSS_FLAGS, "--output-dir", str(root / "one-kl")]}]
    run_many(single, root / "single", nproc=1)
    counted = {"fault": "grpo_faults:counted_collectives", "env": {"GRPO_COLLECTIVES_FILE": str(root / "collectives")}}
    runs = [{"name": "kl", "args": [*args, *ENGINES["fsdp"], *LOSS_FLAGS], **counted},
            {"name": "kl-rank0", "args": [*args, *ENGINES["fsdp"], *LOSS_FLAGS], "fault": "grpo_faults:metrics_of_each_rank"}]
    for engine, flags in ENGINES.items():
        runs.append({"name": engine, "args": [*args, *flags]})
        runs += [{"name": f"{engine}-{fault}", "args": [*args, *flags], "fault": where} for fault, where in FAULTS.items()]
    zero = deepspeed_available()
    if zero:  # last and "record": a DeepSpeed that cannot build its CPU op ends the launch there
        for stage, flags in ZERO.items():
            runs.append({"name": stage, "args": [*args, *flags], "record": True})
            runs += [{"name": f"{stage}-{fault}", "args": [*args, *flags], "fault": where, "record": True}
                     for fault, where in FAULTS.items()]
    for run in runs:
        run["args"] = [*run["args"], "--output-dir", str(root / run["name"])]
    logs = run_many(runs, root / "ranks", timeout=900)
    return {"dirs": {run["name"]: root / run["name"] for run in [*single, *runs]}, "logs": logs, "zero": zero,
            "root": root / "ranks"}


ROLLOUT_METRICS = ("reward", "reward_std", "frac_reward_zero_std", "rewards/token_value/mean", "completions/mean_length",
                   "completions/max_length", "completions/clipped_ratio")
"""The step's rollout metrics: over every rank's completions, so each is one process's figure."""


def _rewards(out: Path) -> list[float]:
    return [step[name] for step in steps_of(out) for name in ROLLOUT_METRICS]


def test_the_one_process_reference_moves_the_weights(launches, llama_dir):
    initial = load_file(str(llama_dir / "model.safetensors"))
    assert largest_update(initial, final_weights(launches["dirs"]["one"])) > 1e-3


@pytest.mark.parametrize("engine", list(ENGINES))
def test_engine_equals_one_process_on_the_same_effective_batch(engine, launches):
    dirs = launches["dirs"]
    assert_same_weights(final_weights(dirs["one"]), final_weights(dirs[engine]))
    assert _rewards(dirs[engine]) == pytest.approx(_rewards(dirs["one"]), abs=1e-6)


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("engine", list(ENGINES))
def test_engine_check_fails_on_a_fault(engine, fault, launches):
    with pytest.raises(AssertionError):
        assert_same_weights(final_weights(launches["dirs"]["one"]), final_weights(launches["dirs"][f"{engine}-{fault}"]))


def _loss_metrics(out: Path) -> list[float]:
    return [step[name] for step in steps_of(out) for name in LOSS_METRICS]


def test_loss_metrics_are_over_both_ranks_tokens(launches):
    """kl and clip_ratio/* of 2 ranks are one process's over the same completions (the ranks' own figures differ, so
    rank 0's alone fails: the twin), and they are not 0, so the comparison says something."""
    dirs = launches["dirs"]
    assert_same_weights(final_weights(dirs["one-kl"]), final_weights(dirs["kl"]))
    expected = _loss_metrics(dirs["one-kl"])
    assert max(step["kl"] for step in steps_of(dirs["one-kl"])) > 1e-4
    assert max(step["clip_ratio/region_mean"] for step in steps_of(dirs["one-kl"])) > 0
    assert _loss_metrics(dirs["kl"]) == pytest.approx(expected, rel=1e-4, abs=1e-7)
    with pytest.raises(AssertionError):
        assert _loss_metrics(dirs["kl-rank0"]) == pytest.approx(expected, rel=1e-4, abs=1e-7)


def test_grpo_makes_one_gather_a_rollout_and_one_all_reduce_a_step(launches):
    """The kl run (3 steps, --num-iterations 2: rollouts at steps 1 and 3): the task's own collectives on each rank are
    one all_gather_object a rollout (rewards, lengths, counts) and one all_reduce a step's metrics, plus the one that
    forgets what came before the first step."""
    steps = len(steps_of(launches["dirs"]["kl"]))
    for rank in (0, 1):
        counts = json.loads((launches["dirs"]["kl"].parent / f"collectives.rank{rank}").read_text())
        assert counts == {"all_gather_object": 2, "all_reduce": steps + 1}, counts


def _zero_run(launches, name: str) -> Path:
    """The ZeRO run NAME's output, or a skip that says why it has none."""
    if not launches["zero"]:
        pytest.skip("deepspeed is not installed (pip install memfit[deepspeed])")
    code, log = exit_code(launches["root"], name), launches["logs"].get(name, "")
    if code is None:
        pytest.skip(f"{name} did not run: an earlier ZeRO run of the launch crashed")
    if code != 0 and BUILD_FAILED.search(log):
        pytest.skip(f"DeepSpeed could not build its CPU op here: {log.strip().splitlines()[-1][:300]}")
    assert code == 0, log[-4000:]
    return launches["dirs"][name]


@pytest.mark.parametrize("stage", list(ZERO))
def test_zero_equals_one_process_on_the_same_effective_batch(stage, launches):
    run = _zero_run(launches, stage)
    assert_same_weights(final_weights(launches["dirs"]["one"]), final_weights(run))
    assert _rewards(run) == pytest.approx(_rewards(launches["dirs"]["one"]), abs=1e-6)


@pytest.mark.parametrize("fault", list(FAULTS))
@pytest.mark.parametrize("stage", list(ZERO))
def test_zero_check_fails_on_a_fault(stage, fault, launches):
    run = _zero_run(launches, f"{stage}-{fault}")
    with pytest.raises(AssertionError):
        assert_same_weights(final_weights(launches["dirs"]["one"]), final_weights(run))
