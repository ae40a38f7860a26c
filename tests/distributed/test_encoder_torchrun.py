"""An encoder task under torchrun gives the single-process update, under SGD without clipping.

A tiny BERT-like sequence classifier (2 layers; rows of 8 to 40 bases, so each micro-batch
pads differently and its loss is per sample, not per token) trains 3 steps on 2 ranks with
FSDP2 and with DeepSpeed ZeRO-2, and must end with the weights of one process training the
same global batch of 8 (4 x 2 accumulation). As in test_exactness.py, each run has a twin
whose backward passes are halved (the normalizer not divided by the world size): it must differ.

Regression, token classification (normalised per labelled token) and masked LM (seeded masks, normalised per
masked token) on the same BERT, and sequence classification on a tiny ESM-like model, are checked the same way
(encoder_tasks.py), each with one halved-gradient twin under FSDP2.
"""

from __future__ import annotations

import pytest
from encoder_tasks import ENCODER_TASKS
from safetensors.torch import load_file
from torchrun_helpers import assert_same_weights, final_weights

from fault_injection import largest_update
from memfit.train.metrics import read_metrics

pytestmark = pytest.mark.distributed

# The runs are launched by the session fixtures of conftest.py: the reference in `references`, the FSDP2 pair in
# engine_runs, the ZeRO-2 pair in zero_runs.


@pytest.fixture(scope="module")
def encoder_single(references):
    return references["encoder-sgd"]


def test_encoder_reference_moves_the_weights_far_beyond_the_tolerance(encoder_single, bert_dir):
    initial = load_file(str(bert_dir / "model.safetensors"))  # a masked LM: its head is not the classifier's
    reference = final_weights(encoder_single)
    assert "classifier.weight" in reference
    # the encoder's own weights move by over 100x the tolerance of assert_same_weights (1e-5)
    assert largest_update({k: v for k, v in initial.items() if k in reference}, reference) > 1e-3


def test_encoder_under_fsdp2_equals_single_process_under_sgd(engine_runs, encoder_single):
    assert_same_weights(final_weights(encoder_single), final_weights(engine_runs["encoder-fsdp"]))
    summary = read_metrics(engine_runs["encoder-fsdp"] / "metrics.jsonl")[-1]
    assert summary["world_size"] == 2 and summary["optimizer"].startswith("sgd")
    # each of the 2 BERT layers is its own unit, the root the third: the encoder's blocks were found
    assert summary["parallel"] == "fsdp2 over 2 ranks (3 units)"


def test_encoder_under_fsdp2_check_fails_on_a_2x_gradient_error(engine_runs, encoder_single):
    with pytest.raises(AssertionError):
        assert_same_weights(final_weights(encoder_single), final_weights(engine_runs["encoder-fsdp-fault"]))


@pytest.mark.slow
def test_encoder_under_zero2_equals_single_process_under_sgd(zero_runs, encoder_single):
    assert_same_weights(final_weights(encoder_single), final_weights(zero_runs["encoder-zero2"]))
    summary = read_metrics(zero_runs["encoder-zero2"] / "metrics.jsonl")[-1]
    assert summary["world_size"] == 2 and summary["parallel"].startswith("deepspeed")


@pytest.mark.slow
def test_encoder_under_zero2_check_fails_on_a_2x_gradient_error(zero_runs, encoder_single):
    with pytest.raises(AssertionError):
        assert_same_weights(final_weights(encoder_single), final_weights(zero_runs["encoder-zero2-fault"]))


# Regression, token classification and masked LM on the tiny BERT, sequence classification on the tiny ESM
# (encoder_tasks.py): the same checks, in the same launches, one halved-gradient twin each (under FSDP2).
TASK_KEYS = list(ENCODER_TASKS)


@pytest.mark.parametrize("key", TASK_KEYS)
def test_encoder_task_reference_moves_the_weights_far_beyond_the_tolerance(references, bert_dir, esm_dir, key):
    initial = load_file(str({"bert": bert_dir, "esm": esm_dir}[ENCODER_TASKS[key][0]] / "model.safetensors"))
    reference = final_weights(references[f"encoder-{key}-sgd"])
    shared = {k: v for k, v in initial.items() if k in reference}
    assert len(shared) > 10  # the encoder's own weights, loaded from the masked LM
    assert largest_update(shared, reference) > 1e-3


@pytest.mark.parametrize("key", TASK_KEYS)
def test_encoder_task_under_fsdp2_equals_single_process_under_sgd(engine_runs, references, key):
    run = engine_runs[f"encoder-{key}-fsdp"]
    assert_same_weights(final_weights(references[f"encoder-{key}-sgd"]), final_weights(run))
    summary = read_metrics(run / "metrics.jsonl")[-1]
    assert summary["world_size"] == 2 and summary["parallel"] == "fsdp2 over 2 ranks (3 units)"


@pytest.mark.parametrize("key", TASK_KEYS)
def test_encoder_task_under_fsdp2_check_fails_on_a_2x_gradient_error(engine_runs, references, key):
    with pytest.raises(AssertionError):
        assert_same_weights(final_weights(references[f"encoder-{key}-sgd"]),
                            final_weights(engine_runs[f"encoder-{key}-fsdp-fault"]))


@pytest.mark.slow
@pytest.mark.parametrize("key", TASK_KEYS)
def test_encoder_task_under_zero2_equals_single_process_under_sgd(zero_runs, references, key):
    run = zero_runs[f"encoder-{key}-zero2"]
    assert_same_weights(final_weights(references[f"encoder-{key}-sgd"]), final_weights(run))
    summary = read_metrics(run / "metrics.jsonl")[-1]
    assert summary["world_size"] == 2 and summary["parallel"].startswith("deepspeed")
