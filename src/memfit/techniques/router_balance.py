"""The router's load-balancing loss of a mixture of experts, added to memfit's loss as the model defines it.

transformers' MoE models compute an auxiliary loss from the router logits when the config has
`output_router_logits=True` (`load_balancing_loss_func`: experts x the product of the fraction of tokens
routed to each expert and its mean router probability), and add `router_aux_loss_coef x aux_loss` to the
mean token loss. memfit computes the token loss itself (a sum, normalised once per optimizer step over
the effective batch), so it takes the model's `aux_loss` from the forward's output and adds it to each
micro-batch's sum as `coef x aux_loss x target tokens of the micro-batch`. After the step's division
by the effective batch's target tokens:

- one micro-batch (no accumulation, no OOM split): exactly the model's own `loss` (mean token loss +
  coef x aux_loss);
- a batch split into micro-batches: the mean token loss plus coef x the token-weighted mean of the
  micro-batches' balancing losses. The balancing loss is not linear in the batch (a product of two
  means over its tokens), so this differs from the whole batch's value: statistics per micro-batch,
  as the Hugging Face Trainer and most MoE fine-tuning recipes compute it under accumulation (not
  Qwen's global-batch balancing). The language-model part stays exact under any split.

With `output_router_logits=False` (the configs' default for fine-tuning) the model computes no balancing
loss and nothing is added.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch


def balancing_loss_on(model: torch.nn.Module) -> bool:
    """Whether `model`'s forward computes a load-balancing loss (config.output_router_logits)."""
    from memfit.techniques.loss import unwrap_causal_lm

    config = getattr(unwrap_causal_lm(model), "config", None)
    return bool(getattr(config, "output_router_logits", False)) and hasattr(config, "router_aux_loss_coef")


def with_balancing_loss(loss_fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """`loss_fn` (a summed token loss of a micro-batch) plus coef x aux_loss x the micro-batch's target tokens.

    The model's `aux_loss` is read from its forward's output by a hook, so the plain and the chunked loss
    paths are covered alike; a model that computes none adds nothing.
    """

    def loss_with_balancing(model: torch.nn.Module, input_ids: torch.Tensor, labels: torch.Tensor,
                            *args: Any, **kwargs: Any) -> torch.Tensor:
        from memfit.techniques.loss import IGNORE_INDEX, unwrap_causal_lm

        if not balancing_loss_on(model):
            return loss_fn(model, input_ids, labels, *args, **kwargs)
        lm = unwrap_causal_lm(model)
        seen: list[torch.Tensor] = []

        def keep_aux_loss(module, inputs, output):
            aux = getattr(output, "aux_loss", None)
            if isinstance(aux, torch.Tensor):
                seen.append(aux)

        handle = lm.register_forward_hook(keep_aux_loss)
        try:
            total = loss_fn(model, input_ids, labels, *args, **kwargs)
        finally:
            handle.remove()
        if not seen:
            return total
        targets = (labels[:, 1:] != IGNORE_INDEX).sum()  # position t predicts labels[t + 1], as the loss counts
        return total + lm.config.router_aux_loss_coef * seen[-1].float() * targets

    return loss_with_balancing
