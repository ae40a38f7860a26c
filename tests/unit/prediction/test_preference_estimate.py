"""The estimate of a preference step (prediction/preference_step.py) against the tracked peak of memfit's real step.

The truth is `measure_step_with_tracker`: memfit's own step (StepRunner, the task's collate and loss, AdamW) on real
tensors on the CPU, counted by the MemoryTracker, with --batch-size pairs of two --seq-len rows each, the frozen copy
made of the built model before LoRA wraps it (as a training run's setup makes it) and the cached reference read from
the samples. Two tiny Llamas: one whose chunk of vocabulary logits is most of the step (the log-probabilities'
backward is the peak), one whose MLP outweighs its logits (the reference's no-grad forward, after the policy's, is the
peak). The analytical estimate stays within 5 % of each, for the copy, adapters-off (LoRA) and cached references and
for objectives without one; leaving out the copy's weights, counting a pair as one row, or the reference's forward,
takes it out of that band.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import memfit.train.traced  # noqa: F401  (registers the traced step)
from memfit.config_loading import load_config
from memfit.prediction import estimator, preference_step
from memfit.prediction.activations import Precision, architecture_of
from memfit.prediction.estimator import estimate, resolve_run
from memfit.prediction.preference_step import PreferenceStep, no_grad_forward_bytes
from memfit.prediction.traced import StepSetup
from memfit.techniques.reference_model import copy_logprobs, frozen_copy
from memfit.train.traced import measure_step_with_tracker
from tiny_llama import tiny_llama, tiny_llama_config

BAND = 0.05
HEAD_BOUND = dict(hidden=128, layers=2, vocab=4096)
"""Its logits are most of the step: 4 rows x 128 tokens x 4,096 entries are 8 MiB in fp32, a chunk of all of them."""
MLP_BOUND = dict(hidden=64, layers=2, vocab=256, intermediate=512)
"""A block's MLP outweighs its logits: the reference's forward, beside every kept activation, is the step's peak."""
SHAPES = {"head-bound": HEAD_BOUND, "mlp-bound": MLP_BOUND}
MODES = {
    "dpo copy": ({"task": "dpo"}, "copy"),
    "dpo adapters-off": ({"task": "dpo", "lora_r": 8}, "adapters-off"),
    "dpo cached": ({"task": "dpo", "reference": "cached"}, "cached"),
    "simpo": ({"task": "simpo"}, "none"),
    "kto copy": ({"task": "kto"}, "copy"),
}


def _config(**changes):
    return load_config(overrides={"seq_len": 128, "batch_size": 2, **changes})


_measured_peaks: dict[tuple[str, str], int] = {}


def _measured(shape: str, mode: str) -> int:
    """The tracked peak of the real step (measured once a module run: the failure checks below read it again)."""
    key = (shape, mode)
    if key not in _measured_peaks:
        hf_config, config = tiny_llama_config(**SHAPES[shape]), _config(**MODES[mode][0])
        run = resolve_run(config, hf_config, None)
        setup = StepSetup(config.training.batch_size, config.data.seq_len, torch.float32, None, run.attention,
                          run.checkpointing, run.checkpoint_every, run.loss_chunk_size, torch.device("cpu"))
        _measured_peaks[key] = measure_step_with_tracker(hf_config, config, setup)
    return _measured_peaks[key]


def _estimated(shape: str, mode: str) -> int:
    return estimate(_config(**MODES[mode][0]), hf_config=tiny_llama_config(**SHAPES[shape])).peak_bytes


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("mode", list(MODES))
def test_the_estimate_of_a_preference_step_is_within_5_percent_of_its_tracked_peak(shape, mode):
    changes, reference = MODES[mode]
    result = estimate(_config(**changes), hf_config=tiny_llama_config(**SHAPES[shape]))
    truth = _measured(shape, mode)
    print(f"{shape} {mode}: measured {truth / 2**20:.3f} MiB, estimated {result.peak_bytes / 2**20:.3f} MiB"
          f" ({result.peak_bytes / truth - 1:+.2%}, {result.details['peak_phase']})")
    facts = result.details["preference"]
    assert facts["reference"] == reference
    assert facts["rows_per_sample"] == 2
    assert (facts["reference_copy_bytes"] > 0) == (reference == "copy")
    assert abs(result.peak_bytes / truth - 1) <= BAND


def test_the_copy_adds_the_weights_alone_and_cached_or_adapters_off_add_none():
    hf_config = tiny_llama_config(**HEAD_BOUND)
    weights = sum(parameter.numel() * 4 for parameter in tiny_llama(**HEAD_BOUND).parameters())
    copy = estimate(_config(task="dpo"), hf_config=hf_config)
    cached = estimate(_config(task="dpo", reference="cached"), hf_config=hf_config)
    assert copy.details["preference"]["reference_copy_bytes"] == weights
    # the copy trains nothing: the gradients and the optimizer state are those of the one trained model
    assert copy.details["full_bytes"] == cached.details["full_bytes"]
    assert copy.breakdown["optimizer_states"] == cached.breakdown["optimizer_states"]
    assert copy.breakdown["parameters"] == cached.breakdown["parameters"] + weights
    lora = estimate(_config(task="dpo", lora_r=8), hf_config=hf_config)
    assert lora.details["preference"]["reference_copy_bytes"] == 0
    assert lora.breakdown["parameters"] == lora.details["full_bytes"]["parameters"]


def test_leaving_out_the_copys_weights_falls_outside_the_band(monkeypatch):
    truth = _measured("head-bound", "dpo copy")
    monkeypatch.setattr(estimator, "reference_copy_bytes", lambda *args: 0.0)
    without = _estimated("head-bound", "dpo copy")
    print(f"without the copy: {without / truth - 1:+.2%}")
    assert without / truth - 1 < -BAND


@pytest.mark.parametrize("mode", ["dpo copy", "simpo"])
def test_counting_a_pair_as_one_row_falls_outside_the_band(monkeypatch, mode):
    truth = _measured("head-bound", mode)
    choose = estimator.preference_step
    monkeypatch.setattr(estimator, "preference_step",
                        lambda config, run: dataclasses.replace(choose(config, run), trained_rows=1))
    one_row = _estimated("head-bound", mode)
    print(f"{mode}, one row a pair: {one_row / truth - 1:+.2%}")
    assert one_row / truth - 1 < -BAND


def test_leaving_out_the_references_forward_falls_outside_the_band(monkeypatch):
    truth = _measured("mlp-bound", "dpo copy")
    monkeypatch.setattr(preference_step, "no_grad_forward_bytes", lambda *args: 0.0)
    without = _estimated("mlp-bound", "dpo copy")
    print(f"without the reference's forward: {without / truth - 1:+.2%}")
    assert without / truth - 1 < -BAND


def test_the_estimate_of_a_pair_is_not_the_causal_lm_estimate_of_its_rows():
    """What memfit estimated before it knew preference steps: --batch-size windows, the plain loss, no reference."""
    # the MLP-bound model: its step is its activations, which a pair's two rows double (the head-bound model's
    # logits, chunked to the size of its hidden states, no longer dominate either step)
    truth = _measured("mlp-bound", "dpo copy")
    causal = estimate(_config(task="causal-lm"), hf_config=tiny_llama_config(**MLP_BOUND)).peak_bytes
    assert causal / truth - 1 < -BAND


@pytest.mark.parametrize(("shape", "dtype", "rows", "chunk"), [
    (HEAD_BOUND, torch.float32, 4, 1024), (HEAD_BOUND, torch.bfloat16, 16, 256),
    (MLP_BOUND, torch.float32, 8, 64), (MLP_BOUND, torch.bfloat16, 8, 64),
], ids=["logits fp32", "logits bf16", "mlp fp32", "mlp bf16"])
def test_the_no_grad_forward_term_is_the_tracked_peak_of_a_reference_forward(shape, dtype, rows, chunk):
    from memfit.memory.tracker import MemoryTracker

    reference, _ = frozen_copy(tiny_llama(**shape).to(dtype))
    seq_len = 128
    input_ids = torch.randint(0, shape["vocab"], (rows, seq_len), generator=torch.Generator().manual_seed(0))
    tracker = MemoryTracker(torch.device("cpu"))
    tracker.attach(reference)
    with tracker:
        with tracker.phase("forward"):
            before = tracker.current_bytes
            copy_logprobs(reference, input_ids, input_ids, None, chunk)
        peak = tracker.end_step().peak_bytes - before
    tracker.detach()
    width = 2 if dtype == torch.bfloat16 else 4
    step = PreferenceStep("dpo", "copy", "", 2, 0, chunk)
    term = no_grad_forward_bytes(step, architecture_of(tiny_llama_config(**shape)), Precision(width, width),
                                 rows * seq_len)
    print(f"no-grad forward: tracked {peak / 2**20:.3f} MiB, term {term / 2**20:.3f} MiB ({term / peak - 1:+.2%})")
    assert abs(term / peak - 1) <= BAND


@pytest.mark.parametrize("mode", ["dpo copy", "dpo adapters-off", "kto copy"])
def test_the_traced_estimate_runs_the_real_step_on_pairs(mode):
    """On fake tensors the same step, its pairs and its reference's copy and forward: exact where the reference's
    forward is the peak. (Where a trained head's chunk backward is, fake tensors count one [chunk, vocabulary] tensor
    short of the real kernels: prediction/preference_step.py.)"""
    traced = estimate(_config(**MODES[mode][0]), hf_config=tiny_llama_config(**MLP_BOUND), method="traced")
    assert abs(traced.peak_bytes / _measured("mlp-bound", mode) - 1) <= 0.005

