"""Every task keeps memfit's exactness: accumulation, OOM recovery and resume equal the plain run.

Sequence classification, regression and token classification, on a tiny BERT-like and a tiny
ESM-like encoder, train with SGD without clipping (a 2x gradient error moves every weight by a
whole update). The reference is one micro-batch of 8 samples a step; samples have varied lengths,
so each micro-batch pads differently and the loss normalisation (per sample, per labelled token)
is what keeps the update exact. Each check has a twin that injects a fault and sees it fail.
"""

from __future__ import annotations

import contextlib
import shutil

import pytest
from safetensors.torch import load_file

from fault_injection import (
    SGD_NO_CLIPPING,
    assert_same_weights,
    final_weights,
    freezing_ignored,
    largest_update,
    oom_in_backward_of_linear,
    scaled_gradients,
)
from memfit.checkpoint_files import list_checkpoints
from memfit.config_loading import load_config
from memfit.train.loop import train

TASKS = {
    "sequence-classification": {},
    "regression": {"label_fields": "value"},
    "token-classification": {"label_fields": "tags"},
}
CASES = [(family, task) for family in ("bert", "esm") for task in TASKS]


def _config(model_dir, data, out, task, **extra):
    values = dict(model=str(model_dir), dataset=str(data), task=task, seq_len=64, batch_size=8, max_steps=2,
                  output_dir=str(out), lr=0.5, report=False, **SGD_NO_CLIPPING, **TASKS[task])
    return load_config(overrides=values | extra)


@pytest.fixture(scope="module")
def references(encoder_dirs, dna_csv, tmp_path_factory):
    """The plain run of each case: 2 steps of one micro-batch of 8."""
    root = tmp_path_factory.mktemp("references")
    return {case: final_weights(train(_config(encoder_dirs[case[0]], dna_csv, root / "-".join(case), case[1])))
            for case in CASES}


@pytest.mark.parametrize(("family", "task"), CASES)
def test_accumulation_equals_one_micro_batch(references, encoder_dirs, dna_csv, tmp_path, family, task):
    reference = references[(family, task)]
    initial = load_file(str(encoder_dirs[family] / "model.safetensors"))
    assert largest_update({k: v for k, v in initial.items() if k in reference}, reference) > 1e-2
    result = train(_config(encoder_dirs[family], dna_csv, tmp_path, task, batch_size=2, gradient_accumulation_steps=4))
    assert_same_weights(reference, final_weights(result))


@pytest.mark.parametrize(("family", "task"), [("bert", "sequence-classification"), ("esm", "token-classification")])
def test_accumulation_check_fails_on_a_2x_gradient_error(references, encoder_dirs, dna_csv, tmp_path, family, task):
    with scaled_gradients(2.0):
        result = train(_config(encoder_dirs[family], dna_csv, tmp_path, task, batch_size=2, gradient_accumulation_steps=4))
    with pytest.raises(AssertionError):
        assert_same_weights(references[(family, task)], final_weights(result))


def _oom_in_backward_above_two_samples():
    """An OOM when backward reaches the first encoder layer's MLP (hidden 32 -> 64), for micro-batches above 2.

    The head and the later layers already hold their gradients then: recovery must not count them twice.
    """
    return oom_in_backward_of_linear(32, 64)


@pytest.mark.parametrize(("family", "task"), CASES)
def test_oom_in_backward_keeps_the_update_exact(references, encoder_dirs, dna_csv, tmp_path, family, task):
    with _oom_in_backward_above_two_samples() as raised:
        result = train(_config(encoder_dirs[family], dna_csv, tmp_path, task))
    assert raised["n"] >= 2  # 8 failed, then 4
    assert_same_weights(references[(family, task)], final_weights(result))


@pytest.mark.parametrize(("family", "task"), [("esm", "regression"), ("bert", "token-classification")])
def test_oom_check_fails_when_recovery_counts_gradients_twice(references, encoder_dirs, dna_csv, tmp_path, family, task):
    with _oom_in_backward_above_two_samples() as raised, freezing_ignored():
        result = train(_config(encoder_dirs[family], dna_csv, tmp_path, task))
    assert raised["n"] >= 2
    with pytest.raises(AssertionError):
        assert_same_weights(references[(family, task)], final_weights(result))


def _resumed(model_dir, data, root, task, scale: float | None = None) -> dict:
    """Train 4 steps saving at 2, keep only step-2 (as a killed run leaves it), resume to step 4."""
    straight = root / "straight"
    train(_config(model_dir, data, straight, task, max_steps=4, save_every=2, momentum=0.9))
    killed = root / "killed"
    shutil.copytree(straight, killed)
    for checkpoint in list_checkpoints(killed):
        if checkpoint.name != "step-2":
            shutil.rmtree(checkpoint)
    shutil.rmtree(killed / "final", ignore_errors=True)
    context = scaled_gradients(scale) if scale else contextlib.nullcontext()
    with context:
        resumed = train(_config(model_dir, data, killed, task, max_steps=4, momentum=0.9, resume="auto"))
    return {"straight": load_file(str(straight / "final" / "model.safetensors")), "resumed": final_weights(resumed)}


@pytest.mark.parametrize(("family", "task"), CASES)
def test_resume_equals_the_uninterrupted_run(encoder_dirs, dna_csv, tmp_path, family, task):
    runs = _resumed(encoder_dirs[family], dna_csv, tmp_path, task)
    assert_same_weights(runs["straight"], runs["resumed"], atol=1e-6)


def test_resume_check_fails_on_a_2x_gradient_error(encoder_dirs, dna_csv, tmp_path):
    runs = _resumed(encoder_dirs["bert"], dna_csv, tmp_path, "regression", scale=2.0)
    with pytest.raises(AssertionError):
        assert_same_weights(runs["straight"], runs["resumed"], atol=1e-6)
