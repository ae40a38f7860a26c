"""GRPO's loss gradient said ahead to the head (techniques/sequence_logprobs.py `token_gradient`): the head takes each
chunk's gradients in forward and backward scales them, with the same gradients as recomputing the chunks.

For every loss type, beta 0 and 0.04 and once- and twice-trained completions, padded and packed, the loss and every
parameter's gradient equal those of the recomputing path, and no chunk is recomputed. A gradient that is not the one
said (a wrong prediction) is caught: the chunks are recomputed, with the right gradients; without that check the
gradients would be wrong, which the last test shows.
"""

from __future__ import annotations

import logging

import pytest
import torch
from tests.unit.tasks.test_grpo_packing import CASES, _loss_and_gradients

from memfit.tasks import grpo, grpo_losses
from memfit.techniques import sequence_logprobs


def _counted(monkeypatch, name: str) -> dict[str, int]:
    """How many times sequence_logprobs calls its `name` from now on."""
    calls = {"n": 0}
    real = getattr(sequence_logprobs, name)

    def counted(*args, **kwargs):
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(sequence_logprobs, name, counted)
    return calls


@pytest.fixture
def recomputed(monkeypatch):
    """How many times backward recomputed the head's chunks."""
    return _counted(monkeypatch, "backward_by_chunks")


def _without_ahead(monkeypatch, packing: str, **settings):
    with monkeypatch.context() as patch:
        patch.setattr(grpo.GRPOTask, "_gradient_ahead", lambda self, *args: None)
        return _loss_and_gradients(packing, **settings)


def _assert_same(mine, theirs) -> None:
    torch.testing.assert_close(mine[0], theirs[0], rtol=1e-5, atol=1e-7)
    assert mine[1].keys() == theirs[1].keys()
    for name, gradient in theirs[1].items():  # float rounding: the gradients are scaled by the loss's factor
        torch.testing.assert_close(mine[1][name], gradient, rtol=1e-4, atol=1e-6, msg=name)
    assert mine[3].keys() == theirs[3].keys() and "entropy" in mine[3]  # the metrics: kl, clip ratios, entropy
    for name, value in theirs[3].items():
        assert mine[3][name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


@pytest.mark.parametrize("packing", ["off", "samples"])
@pytest.mark.parametrize(("loss_type", "beta", "num_iterations"), CASES,
                         ids=[f"{t}-beta{b}-mu{m}" for t, b, m in CASES])
def test_the_gradients_said_ahead_are_the_recomputed_ones(monkeypatch, recomputed, packing, loss_type, beta,
                                                          num_iterations):
    settings = dict(loss_type=loss_type, beta=beta, num_iterations=num_iterations)
    recomputing = _without_ahead(monkeypatch, packing, **settings)
    assert recomputed["n"] == 1  # the plain path recomputes the head's chunks in backward
    ahead = _loss_and_gradients(packing, **settings)
    assert recomputed["n"] == 1  # ... and the path with the gradient said ahead does not
    _assert_same(ahead, recomputing)


def _off_by_two(real):
    """gradient_ahead whose gradient is twice the true one at every other position: not a common factor."""
    def wrong(*args, **kwargs):
        gradient = real(*args, **kwargs)

        def doubled(positions, values):
            said = gradient(positions, values).clone()
            said[::2] *= 2
            return said

        return doubled

    return wrong


def test_a_gradient_other_than_the_one_said_is_recomputed(monkeypatch, recomputed, caplog):
    settings = dict(loss_type="dapo", beta=0.04, num_iterations=2)
    right = _without_ahead(monkeypatch, "samples", **settings)
    monkeypatch.setattr(grpo, "gradient_ahead", _off_by_two(grpo_losses.gradient_ahead))
    monkeypatch.setattr(sequence_logprobs._InPlaceHeadTokenLogprobs, "warned", False)
    with caplog.at_level(logging.WARNING, logger="memfit"):
        checked = _loss_and_gradients("samples", **settings)
    assert recomputed["n"] == 2
    assert "not the one their caller said ahead" in caplog.text
    _assert_same(checked, right)


def test_without_the_check_a_wrong_gradient_said_ahead_would_change_the_gradients(monkeypatch):
    """The comparison above can fail: trusting a wrong prediction gives other gradients."""
    settings = dict(loss_type="dapo", beta=0.04, num_iterations=2)
    right = _without_ahead(monkeypatch, "samples", **settings)
    monkeypatch.setattr(grpo, "gradient_ahead", _off_by_two(grpo_losses.gradient_ahead))
    monkeypatch.setattr(sequence_logprobs, "_common_factor", lambda received, said: torch.tensor(1.0))
    trusted = _loss_and_gradients("samples", **settings)
    with pytest.raises(AssertionError):
        _assert_same(trusted, right)


@pytest.fixture
def in_place(monkeypatch):
    """How many times the head's gradients were worked in place (techniques/head_gradients.py)."""
    return _counted(monkeypatch, "head_gradients_in_place")


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_the_in_place_head_runs_at_any_temperature_with_the_recomputed_numbers(monkeypatch, in_place, temperature):
    settings = dict(loss_type="grpo", beta=0.04, num_iterations=2, temperature=temperature)
    recomputing = _without_ahead(monkeypatch, "samples", **settings)
    ahead = _loss_and_gradients("samples", **settings)
    assert in_place["n"] == 1
    _assert_same(ahead, recomputing)


def test_a_soft_capped_head_takes_its_gradients_ahead_through_autograd(monkeypatch, in_place, recomputed):
    """Gemma's soft-capping is no multiple of the logits: the chunks' gradients are taken through autograd, still in
    forward (no recomputation), with the recomputed numbers."""
    def capped(config):
        def postprocess(logits):
            return torch.tanh(logits / 2.0) * 2.0

        postprocess.linear_factor = None
        return postprocess

    monkeypatch.setattr(sequence_logprobs, "logit_postprocessing", capped)
    settings = dict(loss_type="dapo", beta=0.04, num_iterations=2, temperature=0.7)
    recomputing = _without_ahead(monkeypatch, "samples", **settings)
    ahead = _loss_and_gradients("samples", **settings)
    assert in_place["n"] == 0 and recomputed["n"] == 1  # the second run recomputed nothing
    _assert_same(ahead, recomputing)
