"""Batch order: a pure function of (seed, effective batch, step), whatever the split, resume or ranks."""

from __future__ import annotations

from collections import Counter

import pytest

from memfit.data.schedule import BatchSchedule
from memfit.errors import UsageError


def micro_batches(indices, size):
    return [indices[i : i + size] for i in range(0, len(indices), size)]


def test_the_samples_of_a_step_do_not_depend_on_the_micro_batch_split():
    schedule = BatchSchedule(num_samples=103, effective_batch_size=12, seed=7)
    for step in range(30):
        batch = schedule.batch_indices(step)
        for micro in (1, 2, 3, 4, 6, 12):
            assert [i for chunk in micro_batches(batch, micro) for i in chunk] == batch


def test_order_is_deterministic_with_the_seed_and_changes_with_it():
    first = [BatchSchedule(50, 8, seed=1).batch_indices(s) for s in range(20)]
    again = [BatchSchedule(50, 8, seed=1).batch_indices(s) for s in range(20)]
    other = [BatchSchedule(50, 8, seed=2).batch_indices(s) for s in range(20)]
    assert first == again
    assert first != other


def test_resuming_at_step_k_gives_the_uninterrupted_batches():
    uninterrupted = BatchSchedule(37, 5, seed=3)
    expected = [uninterrupted.batch_indices(s) for s in range(40)]
    resumed = BatchSchedule(37, 5, seed=3)  # a fresh process, asked from step 23 on
    assert [resumed.batch_indices(s) for s in range(23, 40)] == expected[23:]
    assert resumed.batch_indices(5) == expected[5]


def test_every_sample_is_seen_once_per_epoch():
    schedule = BatchSchedule(num_samples=30, effective_batch_size=4, seed=0)
    stream = [i for step in range(schedule.steps_for_epochs(3)) for i in schedule.batch_indices(step)]
    for epoch in range(3):
        assert sorted(stream[epoch * 30 : (epoch + 1) * 30]) == list(range(30))
    assert stream[:30] != stream[30:60]  # a fresh permutation each epoch
    assert schedule.steps_per_epoch == 8
    assert schedule.epoch_at(15) == 2.0


def test_ranks_partition_the_global_batch():
    world = 4
    schedules = [BatchSchedule(101, 16, seed=5, rank=r, world_size=world) for r in range(world)]
    single = BatchSchedule(101, 16, seed=5)
    for step in range(20):
        parts = [s.batch_indices(step) for s in schedules]
        assert all(len(part) == 4 for part in parts)
        assert [i for part in parts for i in part] == single.batch_indices(step)
        assert single.global_batch_indices(step) == single.batch_indices(step)
    seen = Counter(i for step in range(101) for s in schedules for i in s.batch_indices(step))
    assert set(seen.values()) == {16}  # 101 steps x 16 samples = 16 epochs of 101


def test_a_batch_larger_than_the_dataset_wraps_into_the_next_epochs():
    schedule = BatchSchedule(num_samples=3, effective_batch_size=8, seed=0)
    batch = schedule.batch_indices(0)
    assert len(batch) == 8
    assert sorted(batch[:3]) == [0, 1, 2] and sorted(batch[3:6]) == [0, 1, 2]


@pytest.mark.parametrize(
    "args, message",
    [
        ((0, 4), "no samples"),
        ((10, 0), "at least 1"),
        ((10, 6, 0, 0, 4), "not divisible by the 4 ranks"),
        ((10, 4, 0, 2, 2), "rank 2"),
    ],
)
def test_bad_schedules_are_refused(args, message):
    with pytest.raises(UsageError, match=message):
        BatchSchedule(*args)
