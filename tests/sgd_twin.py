"""Two models, the same SGD steps: where a technique changes nothing, the updated weights agree.

SGD without clipping or momentum moves each weight by exactly its gradient, so a gradient a
technique got wrong (twice too large, missing a term) shows in the weights after a step.
"""

from __future__ import annotations

import torch


def assert_same_after_sgd(plain: torch.nn.Module, other: torch.nn.Module, input_ids: torch.Tensor,
                          steps: int = 2, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Train both on `input_ids` for `steps` SGD steps (lr 1) and compare every parameter."""
    for model in (plain, other):
        optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            model(input_ids=input_ids, labels=input_ids).loss.backward()
            optimizer.step()
    for (name, p), q in zip(plain.named_parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(q, p, rtol=rtol, atol=atol, msg=name)
