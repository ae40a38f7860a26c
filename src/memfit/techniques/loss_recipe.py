"""The loss recipe: the one function a run's step calls, built once from the resolved run.

    loss_function = task.loss_function(build_loss_function(run, model))
    loss_sum = loss_function(model, input_ids, labels, attention_mask, chunk_size, position_ids=...)

What decides it, all read from the resolved run (techniques/resolved_run.py, `run.loss`): liger's fused linear
cross-entropy where it runs (the logits never exist); otherwise memfit's causal loss (techniques/loss.py), chunked
when `chunk_size` > 0, with the compiled logits-to-loss tail under --compile, the head's gradient made per chunk
where it cannot be accumulated in place, and the router's load-balancing loss of a mixture of experts added as the
model defines it. The task (memfit.tasks) may replace it with its own (a classification head's loss); the step
only calls what it is given.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from memfit.techniques.loss import causal_lm_loss_sum
from memfit.techniques.resolved_run import ResolvedRun

LossFunction = Callable[..., torch.Tensor]
"""(model, input_ids, labels, attention_mask, chunk_size, position_ids=...) -> summed loss of a micro-batch."""


def build_loss_function(run: ResolvedRun, model: torch.nn.Module) -> LossFunction:
    """The causal-LM loss `run` asks for, for `model` (see the module docstring)."""
    recipe = run.loss
    if recipe.fused:
        from memfit.techniques.kernels import fused_loss_sum

        return fused_loss_sum
    loss: LossFunction = causal_lm_loss_sum
    if recipe.compiled_tail:
        from memfit.techniques.compile import compile_token_loss

        loss = functools.partial(loss, token_loss=compile_token_loss())
    if recipe.head_gradient == "per chunk":  # the engine reduces it from hooks (chunked_head_loss.py)
        loss = functools.partial(loss, in_place_head=False)
    from memfit.techniques.router_balance import balancing_loss_on, with_balancing_loss

    # An MoE with output_router_logits adds its load-balancing loss as the model defines it (router_balance.py)
    return with_balancing_loss(loss) if balancing_loss_on(model) else loss
