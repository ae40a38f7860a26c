"""Packing whole samples: best-fit decreasing placement, packed rows, collation and the --packing setting."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from memfit.config_loading import load_config
from memfit.data import collate, target_token_count
from memfit.data.packing import (
    PackedDataset,
    best_fit_decreasing,
    pack_sample_dicts,
    packing_efficiency,
    resolve_packing,
)
from memfit.errors import UsageError
from synthetic_samples import SyntheticSamples


def reference_best_fit_decreasing(lengths, capacity):
    """The textbook O(n^2) algorithm, written independently: longest first, tightest open bin."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins, free = [], []
    for i in order:
        fitting = [b for b in range(len(bins)) if free[b] >= lengths[i]]
        if not fitting:
            bins.append([i])
            free.append(capacity - lengths[i])
            continue
        tightest = min(free[b] for b in fitting)
        b = [b for b in fitting if free[b] == tightest]
        chosen = b[-1] if len(b) > 1 else b[0]
        bins[chosen].append(i)
        free[chosen] -= lengths[i]
    return bins, free


@pytest.mark.parametrize("seed", range(5))
def test_best_fit_places_every_sample_once_within_capacity(seed):
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 65, size=200)
    bins = best_fit_decreasing(lengths, 64)
    placed = np.concatenate(bins)
    assert sorted(placed.tolist()) == list(range(200))
    assert all(int(lengths[b].sum()) <= 64 for b in bins)
    # Best fit never leaves two bins that one of them could have merged into, when both are at most half full.
    sums = sorted(int(lengths[b].sum()) for b in bins)
    assert not (len(sums) > 1 and sums[0] + sums[1] <= 64 and sums[1] <= 32)
    assert np.array_equal(np.concatenate(best_fit_decreasing(lengths, 64)), placed)  # deterministic


@pytest.mark.parametrize("seed", range(5))
def test_best_fit_matches_the_textbook_algorithm(seed):
    rng = np.random.default_rng(100 + seed)
    lengths = rng.integers(1, 40, size=120).tolist()
    bins = best_fit_decreasing(lengths, 50)
    reference, free = reference_best_fit_decreasing(lengths, 50)
    # Same number of windows and the same fill of each; ties between equally tight bins may go either way.
    assert len(bins) == len(reference)
    assert sorted(int(np.asarray(lengths)[b].sum()) for b in bins) == sorted(50 - f for f in free)


def test_best_fit_depends_on_lengths_only():
    lengths = [30, 10, 30, 20, 5, 64, 1]
    assert [b.tolist() for b in best_fit_decreasing(lengths, 64)] == [[5], [0, 2, 6], [3, 1, 4]]  # the 1 goes to the tightest room (4)


def test_efficiency_counts_used_positions():
    assert packing_efficiency([32, 32, 64], 64) == 1.0
    assert packing_efficiency([40, 40], 64) == pytest.approx(80 / 128)
    assert packing_efficiency([16] * 4, 64, num_rows=4) == 0.25


def test_sample_longer_than_the_window_is_refused_in_one_line():
    with pytest.raises(UsageError, match="sample 1 has 65 tokens.*--seq-len 64"):
        best_fit_decreasing([10, 65], 64)


def test_packed_row_restarts_positions_and_masks_each_first_label():
    samples = SyntheticSamples([5, 3, 4])
    row = pack_sample_dicts([samples[0], samples[1], samples[2]])
    assert row["position_ids"].tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]
    assert torch.equal(row["input_ids"], torch.cat([s["input_ids"] for s in samples.items]))
    starts = [0, 5, 8]
    assert all(row["labels"][s] == -100 for s in starts)
    # The loss shifts labels by one: the targets are exactly the samples' own, none predicts the next sample.
    assert target_token_count([row]) == sum(target_token_count([s]) for s in samples.items)


def test_packed_dataset_keeps_every_token_and_target():
    samples = SyntheticSamples(np.random.default_rng(0).integers(2, 60, size=50))
    packed = PackedDataset(samples, seq_len=64)
    assert len(packed) < len(samples)
    assert all(len(packed[i]["input_ids"]) == packed.lengths[i] <= 64 for i in range(len(packed)))
    assert sum(len(packed[i]["input_ids"]) for i in range(len(packed))) == int(samples.lengths.sum())
    rows = [packed[i] for i in range(len(packed))]
    assert target_token_count(rows) == target_token_count(samples.items) == packed.num_target_tokens
    assert packed.facts()["efficiency"] == pytest.approx(samples.lengths.sum() / (64 * len(packed)), abs=1e-4)
    assert "packed (--packing samples)" in packed.description


def test_packed_dataset_fewer_rows_than_one_batch_is_refused():
    with pytest.raises(UsageError, match="pack into 1 windows.*fewer than one effective batch \\(4\\)"):
        PackedDataset(SyntheticSamples([10, 10, 10]), seq_len=64, min_rows=4)


def test_collate_pads_positions_with_zeros_outside_every_sample():
    samples = SyntheticSamples([5, 3, 2])
    rows = [pack_sample_dicts([samples[0], samples[1]]), pack_sample_dicts([samples[2]])]
    batch = collate(rows, pad_token_id=257)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2], [0, 1, 0, 0, 0, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1] * 8, [1, 1, 0, 0, 0, 0, 0, 0]]
    assert batch["labels"][1, 2:].eq(-100).all()
    assert "position_ids" not in collate([samples[0]], 257)  # unpacked samples: as before


def test_prefetcher_drops_the_mask_of_packed_rows():
    from memfit.data.prefetch import BatchPrefetcher

    samples = SyntheticSamples([5, 3, 2])
    rows = [pack_sample_dicts([samples[0], samples[1]]), pack_sample_dicts([samples[2]])]
    prefetcher = BatchPrefetcher(lambda s: collate(s, 0), torch.device("cpu"), drop_full_attention_mask=True)
    batch = prefetcher.take(rows)
    assert "attention_mask" not in batch and "position_ids" in batch
    padded = prefetcher.take([samples[0], samples[2]])
    assert "attention_mask" in padded  # unpacked rows with padding keep their mask


def test_auto_packs_samples_for_supervised_data_and_wraps_plain_text():
    assert resolve_packing("auto", supervised=True) == "samples"
    assert resolve_packing("auto", supervised=False) == "wrapped"
    assert resolve_packing(True, supervised=False) == "wrapped"
    assert resolve_packing(False, supervised=True) == "off"
    with pytest.raises(UsageError, match="--packing wrapped .* would cut conversations"):
        resolve_packing("wrapped", supervised=True)


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], "auto"),
        (["--packing"], "auto"),
        (["--no-packing"], "off"),
        (["--packing", "samples"], "samples"),
        (["--packing=wrapped"], "wrapped"),
        (["--packing", "false"], "off"),
        (["--sample-packing"], "auto"),
    ],
)
def test_packing_flags(argv, expected):
    from memfit.cli.flags import parse_command_line

    config, _ = parse_command_line([*argv, "--seq-len", "64"])
    assert config.data.packing == expected
    assert config.data.seq_len == 64


@pytest.mark.parametrize(("value", "expected"), [(True, "auto"), (False, "off"), ("samples", "samples"), ("OFF", "off")])
def test_packing_in_yaml_keeps_old_booleans(tmp_path, value, expected):
    import yaml

    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({"data": {"packing": value}}))
    assert load_config(path).data.packing == expected


def test_unknown_packing_mode_is_one_line():
    with pytest.raises(UsageError, match="--packing must be one of auto, samples, off, wrapped"):
        load_config(overrides={"packing": "dense"})
