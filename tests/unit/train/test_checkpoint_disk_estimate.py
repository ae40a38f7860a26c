"""The disk check's arithmetic: how many checkpoints exist at once, and one checkpoint's predicted size
against the files a run really writes."""

from __future__ import annotations

import pytest

from memfit.checkpoint_files import list_checkpoints
from memfit.config_loading import load_config
from memfit.train.disk import SMALL_FILES_BYTES, checkpoint_size, checkpoints_to_hold
from memfit.train.loop import train
from memfit.train.setup import build_session


@pytest.mark.parametrize(("save_every", "limit", "existing", "expected"), [
    (0, 2, 0, 1),     # only the final checkpoint
    (10, 2, 0, 3),    # 10 saves, 2 kept + the one being written
    (10, 0, 0, 10),   # keep all: every save
    (10, 2, 2, 1),    # resuming beside 2 kept: one more at a time
])
def test_checkpoints_held_at_once(save_every, limit, existing, expected):
    config = load_config(overrides={"save_every": save_every, "save_total_limit": limit})
    assert checkpoints_to_hold(config, total_steps=100, start_step=0, existing=existing) == expected


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_predicted_checkpoint_size_matches_the_files_written(optimizer, llama_dir, text_file, tmp_path):
    config = load_config(overrides=dict(model=str(llama_dir), dataset=str(text_file), seq_len=32, batch_size=1,
                                        max_steps=1, optimizer=optimizer, momentum=0.9, output_dir=str(tmp_path),
                                        report=False))
    predicted = checkpoint_size(build_session(config))  # before any step: the optimizer state is predicted
    train(config)
    written = sum(f.stat().st_size for f in list_checkpoints(tmp_path)[-1].iterdir())
    assert predicted.checkpoint_bytes - SMALL_FILES_BYTES <= written <= predicted.checkpoint_bytes * 1.02


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_the_estimate_holds_an_async_snapshot_in_host_memory(optimizer, llama_dir, text_file, tmp_path):
    """--async-save keeps one checkpoint's weights and optimizer state on the host while it writes:
    the estimate counts them as host memory: the files a run writes, less the small ones (RNG, data position,
    config, manifest)."""
    from memfit.prediction.estimator import estimate

    settings = dict(model=str(llama_dir), dataset=str(text_file), seq_len=32, batch_size=1, max_steps=1,
                    optimizer=optimizer, momentum=0.9, output_dir=str(tmp_path), report=False)
    plain = estimate(load_config(overrides=settings))
    snapshot = estimate(load_config(overrides={**settings, "async_save": True}))
    assert "checkpoint_snapshot" not in plain.host_breakdown
    assert snapshot.host_bytes - plain.host_bytes == snapshot.host_breakdown["checkpoint_snapshot"]
    train(load_config(overrides=settings))
    written = sum(f.stat().st_size for f in list_checkpoints(tmp_path)[-1].iterdir())
    held = snapshot.host_breakdown["checkpoint_snapshot"]
    assert held <= written <= held + SMALL_FILES_BYTES, (held, written)
