"""The router's load-balancing loss: included as the model defines it, per micro-batch when a batch is split.

With `output_router_logits=True` memfit's loss over one micro-batch equals the model's own `loss` (mean token
loss + router_aux_loss_coef x aux_loss); over micro-batches it is the mean token loss plus coef x the
token-weighted mean of the micro-batches' balancing losses (techniques/router_balance.py), which differs
from the whole batch's balancing loss: the statistics are per micro-batch, as documented.
"""

from __future__ import annotations

import pytest
import torch

from memfit.techniques.loss import causal_lm_loss_sum
from memfit.techniques.router_balance import balancing_loss_on, with_balancing_loss
from model_zoo import ZOO

FAMILIES = ["qwen3_moe", "mixtral", "gpt_oss"]


def _model(family: str, balancing: bool = True):
    from transformers import AutoModelForCausalLM

    config = ZOO[family]()
    config.output_router_logits = balancing
    config.router_aux_loss_coef = 0.5  # large enough that a missing or doubled term shows in the loss
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _tokens(rows: int = 4) -> torch.Tensor:
    return torch.randint(0, 256, (rows, 16), generator=torch.Generator().manual_seed(0))


def _targets(labels: torch.Tensor) -> int:
    return int((labels[:, 1:] != -100).sum())


@pytest.mark.parametrize("family", FAMILIES)
def test_one_micro_batch_equals_the_models_own_loss(family):
    model, tokens = _model(family), _tokens()
    assert balancing_loss_on(model)
    ours = with_balancing_loss(causal_lm_loss_sum)(model, tokens, tokens) / _targets(tokens)
    output = model(input_ids=tokens, labels=tokens)
    assert output.aux_loss is not None and float(output.aux_loss) > 0
    torch.testing.assert_close(ours, output.loss.float(), rtol=1e-6, atol=1e-6)
    # the twin: the token loss alone misses the model's balancing term
    without = causal_lm_loss_sum(model, tokens, tokens) / _targets(tokens)
    assert not torch.allclose(without, output.loss.float(), rtol=1e-6, atol=1e-6)


def test_split_batch_takes_per_micro_batch_statistics():
    model, tokens = _model("qwen3_moe"), _tokens()
    loss_fn = with_balancing_loss(causal_lm_loss_sum)
    halves = [tokens[:2], tokens[2:]]
    split = sum(loss_fn(model, half, half) for half in halves) / _targets(tokens)
    coef = model.config.router_aux_loss_coef
    token_mean = causal_lm_loss_sum(model, tokens, tokens) / _targets(tokens)
    per_half = [model(input_ids=half).aux_loss for half in halves]
    weights = [_targets(half) / _targets(tokens) for half in halves]
    expected = token_mean + coef * sum(w * a for w, a in zip(weights, per_half, strict=True))
    torch.testing.assert_close(split, expected.float(), rtol=1e-5, atol=1e-6)
    whole = model(input_ids=tokens, labels=tokens).loss
    assert not torch.allclose(split, whole.float(), rtol=1e-7, atol=1e-7)  # not linear in the batch


def test_nothing_is_added_when_the_model_computes_no_balancing_loss():
    model, tokens = _model("qwen3_moe", balancing=False), _tokens()
    assert not balancing_loss_on(model)
    assert torch.equal(with_balancing_loss(causal_lm_loss_sum)(model, tokens, tokens),
                       causal_lm_loss_sum(model, tokens, tokens))


def test_the_training_step_includes_it(text_file, tmp_path):
    """Through memfit's loop: a model saved with output_router_logits trains on loss + coef x aux."""
    from memfit.config_loading import load_config
    from memfit.models.tiny import byte_tokenizer
    from memfit.train.loop import train

    losses = {}
    for balancing in (False, True):
        directory = tmp_path / f"model-{balancing}"
        _model("qwen3_moe", balancing).save_pretrained(directory)
        byte_tokenizer().save_pretrained(directory)
        config = load_config(overrides=dict(model=str(directory), dataset=str(text_file), seq_len=32, batch_size=2,
                                            max_steps=1, packing=False, loss_chunk_size=0, report=False,
                                            output_dir=str(tmp_path / f"run-{balancing}")))
        losses[balancing] = train(config).losses[0]
    assert losses[True] > losses[False] + 0.1  # coef 0.5 x a balancing loss near 1 (its minimum for uniform routing)
