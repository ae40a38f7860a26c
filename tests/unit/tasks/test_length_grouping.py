"""--group-by-length: steps of similar lengths, with memfit's exactness kept.

The order must be a function of the seed and the effective batch only: accumulation and an
OOM split then train on the very samples of the plain single-micro-batch run, and a resumed
run sees the same steps. The fault twin groups as the Trainer's sampler does, by the
micro-batch (per-device) size: the steps then hold other samples and the weights differ.
"""

from __future__ import annotations

import shutil

import numpy as np
import pytest
from safetensors.torch import load_file

from fault_injection import (
    SGD_NO_CLIPPING,
    assert_same_weights,
    final_weights,
    largest_update,
    oom_in_backward_of_linear,
)
from memfit.checkpoint_files import list_checkpoints
from memfit.config_loading import load_config
from memfit.data.length_groups import LengthGroupedSchedule, padded_positions
from memfit.data.schedule import BatchSchedule
from memfit.train import setup as session_setup
from memfit.train.loop import train
from memfit.train.metrics import read_metrics
from tiny_encoders import dna_rows, write_csv


@pytest.fixture(scope="module")
def varied_csv(tmp_path_factory):
    return write_csv(tmp_path_factory.mktemp("varied") / "varied.csv", dna_rows(64, seed=3, min_length=8, max_length=60))


def _config(model_dir, data, out, **extra):
    values = dict(model=str(model_dir), dataset=str(data), task="sequence-classification", seq_len=64, batch_size=8,
                  max_steps=3, output_dir=str(out), lr=0.5, report=False, group_by_length=True, **SGD_NO_CLIPPING)
    return load_config(overrides=values | extra)


# -- the order itself ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("samples", "batch"), [(64, 8), (61, 8), (5, 8), (400, 4)])
def test_each_epoch_is_a_permutation_and_steps_sit_on_step_boundaries(samples, batch):
    lengths = np.random.default_rng(0).integers(3, 500, samples)
    schedule = LengthGroupedSchedule(lengths, batch, seed=7)
    for epoch in range(3):
        assert sorted(schedule.permutation(epoch).tolist()) == list(range(samples))
    steps = schedule.steps_for_epochs(3)
    seen = np.concatenate([schedule.global_batch_indices(k) for k in range(steps)])
    # The stream is epochs laid end to end, as the plain schedule's: the first epoch's samples come first, once each.
    assert sorted(seen[:samples].tolist()) == list(range(samples))


def test_order_depends_on_seed_and_effective_batch_only_and_ranks_split_the_same_steps():
    lengths = np.random.default_rng(1).integers(3, 500, 203)
    one = LengthGroupedSchedule(lengths, 8, seed=3)
    again = LengthGroupedSchedule(lengths, 8, seed=3)  # a resumed process builds it afresh
    two_ranks = [LengthGroupedSchedule(lengths, 8, seed=3, rank=r, world_size=2) for r in range(2)]
    for step in (0, 1, 24, 25, 26, 60):  # 203 samples: step 25 straddles epochs 0 and 1
        expected = one.global_batch_indices(step)
        assert again.global_batch_indices(step) == expected
        assert two_ranks[0].batch_indices(step) + two_ranks[1].batch_indices(step) == expected
    assert LengthGroupedSchedule(lengths, 8, seed=4).global_batch_indices(0) != one.global_batch_indices(0)


def test_steps_hold_similar_lengths_longest_first():
    lengths = np.random.default_rng(2).integers(3, 500, 800)
    grouped = LengthGroupedSchedule(lengths, 8, seed=0)
    plain = BatchSchedule(len(lengths), 8, seed=0)
    first = lengths[grouped.global_batch_indices(0)]
    assert int(first[0]) == int(lengths.max())  # the epoch's longest sample comes at the first step
    assert list(first) == sorted(first, reverse=True)

    def padding(schedule):
        return sum(padded_positions(lengths[schedule.global_batch_indices(k)], 2) - lengths[schedule.global_batch_indices(k)].sum()
                   for k in range(schedule.steps_per_epoch))

    assert padding(grouped) < 0.2 * padding(plain), (padding(grouped), padding(plain))


# -- real runs --------------------------------------------------------------------------------------------------------


def test_group_by_length_pads_fewer_tokens_in_a_run(encoder_dirs, varied_csv, tmp_path):
    padding = {}
    for grouped in (False, True):
        out = tmp_path / str(grouped)
        train(_config(encoder_dirs["bert"], varied_csv, out, batch_size=2, gradient_accumulation_steps=4, max_steps=8,
                      group_by_length=grouped))
        steps = [r for r in read_metrics(out / "metrics.jsonl") if "event" not in r and "loss" in r and "step" in r]
        padding[grouped] = sum(r["padding_tokens"] for r in steps)
    assert padding[True] < 0.5 * padding[False], padding


@pytest.fixture(scope="module")
def reference(encoder_dirs, varied_csv, tmp_path_factory):
    """Grouped, one micro-batch of 8 a step."""
    return final_weights(train(_config(encoder_dirs["esm"], varied_csv, tmp_path_factory.mktemp("reference"))))


def test_accumulation_with_grouping_equals_one_micro_batch(reference, encoder_dirs, varied_csv, tmp_path):
    initial = load_file(str(encoder_dirs["esm"] / "model.safetensors"))
    assert largest_update({k: v for k, v in initial.items() if k in reference}, reference) > 1e-2
    result = train(_config(encoder_dirs["esm"], varied_csv, tmp_path, batch_size=2, gradient_accumulation_steps=4))
    assert_same_weights(reference, final_weights(result))


def test_oom_split_with_grouping_keeps_the_update_exact(reference, encoder_dirs, varied_csv, tmp_path):
    with oom_in_backward_of_linear(32, 64) as raised:
        result = train(_config(encoder_dirs["esm"], varied_csv, tmp_path))
    assert raised["n"] >= 2
    assert_same_weights(reference, final_weights(result))


def test_accumulation_check_fails_when_grouping_follows_the_micro_batch(reference, encoder_dirs, varied_csv, tmp_path,
                                                                        monkeypatch):
    """The fault: groups cut by the per-device micro-batch (as the Trainer's LengthGroupedSampler), not the step."""

    def micro_batch_grouping(dataset, effective, seed, rank, world_size, group_by_length):
        schedule = BatchSchedule(len(dataset), effective, seed, rank, world_size)
        by_micro_batch = LengthGroupedSchedule(dataset.lengths, 2, seed)
        schedule.permutation = by_micro_batch.permutation
        return schedule

    monkeypatch.setattr(session_setup, "build_schedule", micro_batch_grouping)
    result = train(_config(encoder_dirs["esm"], varied_csv, tmp_path, batch_size=2, gradient_accumulation_steps=4))
    with pytest.raises(AssertionError):
        assert_same_weights(reference, final_weights(result))


def test_resumed_grouped_run_sees_the_same_steps(encoder_dirs, varied_csv, tmp_path):
    straight = tmp_path / "straight"
    train(_config(encoder_dirs["bert"], varied_csv, straight, max_steps=4, save_every=2, momentum=0.9, batch_size=4,
                  gradient_accumulation_steps=2))
    killed = tmp_path / "killed"
    shutil.copytree(straight, killed)
    for checkpoint in list_checkpoints(killed):
        if checkpoint.name != "step-2":
            shutil.rmtree(checkpoint)
    shutil.rmtree(killed / "final", ignore_errors=True)
    resumed = train(_config(encoder_dirs["bert"], varied_csv, killed, max_steps=4, momentum=0.9, batch_size=4,
                            gradient_accumulation_steps=2, resume="auto"))
    assert_same_weights(load_file(str(straight / "final" / "model.safetensors")), final_weights(resumed), atol=1e-6)
