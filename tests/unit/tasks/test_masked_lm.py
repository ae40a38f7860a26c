"""Masked LM: masks drawn from (seed, step, sample), so a resumed run masks exactly as an uninterrupted one."""

from __future__ import annotations

import contextlib
import shutil

import pytest
import torch
from safetensors.torch import load_file

from memfit.checkpoint_files import list_checkpoints
from memfit.config_loading import load_config
from memfit.tasks import heads
from memfit.tasks.masking import mask_tokens
from memfit.train.loop import train

SGD_MOMENTUM = dict(optimizer="sgd", momentum=0.9, max_grad_norm=0.0, lr=0.5, warmup_steps=0, lr_schedule="constant")


def test_masks_are_a_function_of_seed_step_and_sample():
    ids = torch.arange(5, 10).repeat(40)
    ids[0], ids[-1] = 2, 3  # [CLS] ... [SEP]
    draw = dict(probability=0.3, mask_token_id=4, vocab_size=10, special_ids=[0, 1, 2, 3])
    first = mask_tokens(ids, seed=1, step=3, index=7, **draw)
    assert all(torch.equal(a, b) for a, b in zip(first, mask_tokens(ids, seed=1, step=3, index=7, **draw), strict=True))
    for other in (dict(seed=2, step=3, index=7), dict(seed=1, step=4, index=7), dict(seed=1, step=3, index=8)):
        assert not torch.equal(first[1], mask_tokens(ids, **other, **draw)[1])
    masked, labels = first
    chosen = labels != -100
    assert 0.15 < chosen.float().mean() < 0.45
    assert not chosen[0] and not chosen[-1]  # special tokens are never masked
    assert torch.equal(labels[chosen], ids[chosen])
    assert (masked[chosen] == 4).float().mean() > 0.6  # most chosen tokens become the mask token
    assert torch.equal(masked[~chosen], ids[~chosen])


def _config(model_dir, data, out, **extra):
    values = dict(model=str(model_dir), dataset=str(data), task="masked-lm", seq_len=64, batch_size=4,
                  gradient_accumulation_steps=2, max_steps=4, output_dir=str(out), report=False, mlm_probability=0.3,
                  **SGD_MOMENTUM)
    return load_config(overrides=values | extra)


@contextlib.contextmanager
def _masks_from_a_process_counter():
    """The bug class this guards against: masks drawn from state the checkpoint does not hold (a call counter
    standing in for a global RNG), so a resumed process draws other masks."""
    original, calls = heads.mask_tokens, {"n": 0}

    def counted(input_ids, *, step, **kwargs):
        calls["n"] += 1
        return original(input_ids, step=calls["n"], **kwargs)

    heads.mask_tokens = counted
    try:
        yield
    finally:
        heads.mask_tokens = original


def _straight_and_resumed(model_dir, data, root):
    straight = train(_config(model_dir, data, root / "straight", save_every=2))
    killed = root / "killed"
    shutil.copytree(root / "straight", killed)
    for checkpoint in list_checkpoints(killed):
        if checkpoint.name != "step-2":
            shutil.rmtree(checkpoint)
    shutil.rmtree(killed / "final")
    resumed = train(_config(model_dir, data, killed, resume="auto"))
    return straight, resumed


@pytest.mark.parametrize("family", ["bert", "esm"])
def test_resumed_run_masks_as_the_uninterrupted_one(encoder_dirs, dna_csv, tmp_path, family):
    straight, resumed = _straight_and_resumed(encoder_dirs[family], dna_csv, tmp_path)
    assert resumed.losses == pytest.approx(straight.losses[2:], abs=1e-6)
    a = load_file(str(straight.final_dir / "model.safetensors"))
    b = load_file(str(resumed.final_dir / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-6, rtol=0, msg=name)


def test_resume_check_fails_when_masks_depend_on_process_state(encoder_dirs, dna_csv, tmp_path):
    with _masks_from_a_process_counter():
        straight, resumed = _straight_and_resumed(encoder_dirs["bert"], dna_csv, tmp_path)
    assert resumed.losses != pytest.approx(straight.losses[2:], abs=1e-6)


def test_micro_batch_split_does_not_change_the_masks(encoder_dirs, dna_csv, tmp_path):
    whole = train(_config(encoder_dirs["esm"], dna_csv, tmp_path / "whole", batch_size=8, gradient_accumulation_steps=1,
                          max_steps=2, momentum=0.0))
    split = train(_config(encoder_dirs["esm"], dna_csv, tmp_path / "split", batch_size=2, gradient_accumulation_steps=4,
                          max_steps=2, momentum=0.0))
    assert split.losses == pytest.approx(whole.losses, abs=1e-5)
    a = load_file(str(whole.final_dir / "model.safetensors"))
    b = load_file(str(split.final_dir / "model.safetensors"))
    for name in a:
        torch.testing.assert_close(b[name], a[name], atol=1e-5, rtol=0, msg=name)
