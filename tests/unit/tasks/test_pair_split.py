"""--pair-layout split (tasks/pair_split.py): the chosen rows and the rejected rows of a micro-batch in two forwards.

What it must give: the two-row layout's loss, metrics and every gradient (fp32, within 1e-5) for DPO, SimPO and
ORPO, with the frozen copy and the cached reference; each parameter's gradient reaching `.grad` once a micro-batch
(what keeps out-of-memory recovery exact); a lower tracked peak of a DPO step; and KTO, which has no pair of
answers to run apart, running two rows and saying so. Three SGD steps of `memfit train --task dpo --pair-layout
split`, with a micro-batch of 2 pairs and out-of-memory errors injected into forwards of more than 2 rows, end on the
two-row run's weights.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from test_pair_layout import (
    EDGE_LENGTHS,
    VOCAB,
    _loss_and_gradients,
    _policy_and_task,
    _tracked_dpo_step,
    random_pairs,
    two_rows,
)
from test_preference_task import preference_config, write_pairs

from fault_injection import assert_same_weights, final_weights, largest_update
from memfit.tasks.pair_layout import SPLIT, TWO_ROWS, PairLayout, choose_pair_layout
from tiny_llama import tiny_llama


def split() -> PairLayout:
    return PairLayout(SPLIT, SPLIT, "test")


def _assert_one_and_two_forwards_agree(handler, model, samples) -> None:
    """The loss, the metrics and every gradient of `samples` in one forward and in two, within 1e-5 (fp32)."""
    one = _loss_and_gradients(handler, model, samples, two_rows())
    two = _loss_and_gradients(handler, model, samples, split())
    assert max(float(g.abs().max()) for g in one[1].values()) > 1e-3  # the comparison is not of zeros
    torch.testing.assert_close(two[:2], one[:2], rtol=0, atol=1e-5)
    assert two[2] == pytest.approx(one[2], abs=1e-5)


@pytest.mark.numerics
@pytest.mark.parametrize("task", ["dpo", "simpo", "orpo"])
def test_losses_metrics_and_gradients_equal_the_one_forward_layouts(tmp_path, task):
    handler, model = _policy_and_task(task, "sdpa", tmp_path)
    _assert_one_and_two_forwards_agree(handler, model, random_pairs(EDGE_LENGTHS))


@pytest.mark.numerics
def test_the_cached_reference_gives_the_same_gradients(tmp_path):
    handler, model = _policy_and_task("dpo", "sdpa", tmp_path, reference="none")
    handler.reference_choice = SimpleNamespace(mode="cached")
    _assert_one_and_two_forwards_agree(handler, model, random_pairs(EDGE_LENGTHS, cached=True))


def test_each_gradient_reaches_its_parameter_once_a_micro_batch(tmp_path):
    """The step's out-of-memory recovery freezes the parameters whose `.grad` received a micro-batch: both sides'
    contributions must arrive together, never the chosen side's alone before the rejected rows run again."""
    handler, model = _policy_and_task("dpo", "sdpa", tmp_path)
    arrivals: dict[str, int] = {}
    for name, parameter in model.named_parameters():
        parameter.register_post_accumulate_grad_hook(lambda _, name=name: arrivals.update({name: arrivals.get(name, 0)
                                                                                            + 1}))
    _loss_and_gradients(handler, model, random_pairs(EDGE_LENGTHS), split())
    assert arrivals and set(arrivals.values()) == {1}, arrivals


def test_two_forwards_lower_the_tracked_peak_of_a_dpo_step(tmp_path):
    one_forward, loss = _tracked_dpo_step(two_rows(), tmp_path)
    two_forwards, split_loss = _tracked_dpo_step(split(), tmp_path)
    print(f"DPO step, 4 pairs, prompt 192, answers 32: one forward {one_forward / 2**20:.1f} MiB, two forwards"
          f" {two_forwards / 2**20:.1f} MiB ({1 - two_forwards / one_forward:.0%} less)")
    assert split_loss == pytest.approx(loss, abs=1e-4)
    # one side's activations instead of both; the weights and their gradients are the same in both
    assert two_forwards < 0.8 * one_forward


def test_engines_that_shard_are_refused_in_one_line(tmp_path):
    from memfit.errors import UsageError
    from memfit.tasks import build_task

    data = tmp_path / "unused.jsonl"
    for engine in ({"sharding": "fsdp"}, {"zero_stage": 3}):
        with pytest.raises(UsageError, match="--pair-layout split runs the rejected rows' forward again"):
            build_task(preference_config(tmp_path, data, tmp_path / "out", pair_layout="split", **engine))
    assert build_task(preference_config(tmp_path, data, tmp_path / "out", pair_layout="split")).pair_layout.split


def test_kto_runs_two_rows_and_says_why():
    kto = choose_pair_layout(SPLIT, tiny_llama(vocab=VOCAB), False, np.array([[20, 5]]))
    assert kto.layout == TWO_ROWS and "kto" in kto.reason and kto.fell_back
    dpo = choose_pair_layout(SPLIT, None, True, None)
    assert dpo.split and not dpo.fell_back and "asked for" in dpo.reason


@pytest.mark.slow
def test_three_sgd_steps_in_two_forwards_reach_the_one_forward_weights_through_ooms(llama_dir, tmp_path, monkeypatch):
    from transformers import LlamaForCausalLM

    from memfit.train.loop import train

    data = write_pairs(tmp_path / "pairs.jsonl")
    one = train(preference_config(llama_dir, data, tmp_path / "one", lr=0.1, gradient_accumulation_steps=2,
                                  batch_size=2))
    forward, raised = LlamaForCausalLM.forward, {"n": 0}

    def at_most_two_rows(self, input_ids=None, **kwargs):
        if input_ids is not None and input_ids.shape[0] > 2 and torch.is_grad_enabled():
            raised["n"] += 1
            raise torch.OutOfMemoryError("injected: CUDA out of memory")
        return forward(self, input_ids=input_ids, **kwargs)

    monkeypatch.setattr(LlamaForCausalLM, "forward", at_most_two_rows)
    # 4 pairs a micro-batch: one forward of 8 rows would fail; two forwards of 4 rows fail and split to 2 pairs
    two = train(preference_config(llama_dir, data, tmp_path / "two", lr=0.1, pair_layout="split", batch_size=4))
    assert raised["n"] >= 1 and two.summary["task"]["pair_layout"]["layout"] == SPLIT
    start = {name: tensor for name, tensor in final_weights(SimpleNamespace(final_dir=llama_dir)).items()
             if name in final_weights(one)}
    assert largest_update(start, final_weights(one)) > 1e-2
    assert_same_weights(final_weights(one), final_weights(two))
