"""APOLLO's update computed with no temporary the size of the weight.

apollo-torch (1.0.3) steps a projected matrix by scaling its raw gradient into a new tensor, dividing that by the
norm-growth limiter into a second one, and builds each random projection from a float32 copy of the gradient, read
for its shape alone. Each is a copy of the largest tensor: on Llama-3.1-8B's untied head (128,256 x 4,096 in bf16)
two copies are 1.96 GiB, on top of everything live at the head's step. memfit runs the same operations a block of rows
at a time (optimizer_state.APOLLO_BLOCK_ELEMENTS), so the temporaries are a block's, and draws the random matrix from the shape alone.
The moments, the projection, the limiter and the operations on each element are the library's: the weights equal
the library's (tests/unit/techniques/test_apollo_step.py holds both to the library called directly, and measures
the temporaries with the tracker).
"""

from __future__ import annotations

import math

import torch

from memfit.models import optimizer_state

# apollo-torch is an optional dependency: the classes below are built when a run asks for APOLLO.


def projector_class():
    """apollo-torch's GradientProjector, with its random matrix drawn from the gradient's shape alone."""
    from apollo_torch.random_projector import GradientProjector, stable_randn

    class ShapeOnlyProjector(GradientProjector):
        def get_orthogonal_matrix(self, weights: torch.Tensor, rank: int, type: str, seed: int) -> torch.Tensor:
            # The library draws in float32 (it converts a bf16 gradient to float32 first, which only its shape
            # and device are read from) and casts the matrix back: the same draw without the copy.
            rows, columns = weights.shape
            shape = {"left": (rows, rank), "right": (rank, columns)}.get(type)
            if shape is None:
                raise ValueError(f"APOLLO projection type {type!r}: expected left or right")
            matrix = stable_randn(shape, seed=seed, device=weights.device, dtype=torch.float32) / math.sqrt(rank)
            return matrix if weights.dtype == torch.float32 else matrix.type(weights.dtype)

    return ShapeOnlyProjector


class InPlaceApolloStep:
    """Mixin over apollo_torch.APOLLOAdamW: its `step`, with no weight-sized temporary for projected matrices."""

    def _initialize_projector(self, group: dict, state: dict):
        if group["proj"] == "random":
            return projector_class()(group["rank"], update_proj_gap=group["update_proj_gap"], scale=group["scale"],
                                     proj_type=group["proj_type"], seed=state["seed"])
        return super()._initialize_projector(group, state)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for parameter in group["params"]:
                if parameter.grad is None:
                    continue
                if parameter.grad.is_sparse:
                    raise RuntimeError("APOLLO does not support sparse gradients")
                self._step_one(group, parameter)
        return loss

    def _step_one(self, group: dict, parameter: torch.Tensor) -> None:
        grad, state = parameter.grad, self.state[parameter]
        state.setdefault("step", 0)
        projected = "rank" in group
        if projected:
            if "projector" not in state:
                state["projector"] = self._initialize_projector(group, state)
            low_rank = state["projector"].project(grad, state["step"])
        else:
            low_rank = grad
        if "exp_avg" not in state:
            state["exp_avg"] = torch.zeros_like(low_rank)
            state["exp_avg_sq"] = torch.zeros_like(low_rank)
        exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
        beta1, beta2 = group["betas"]
        state["step"] += 1
        exp_avg.mul_(beta1).add_(low_rank, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(low_rank, low_rank, value=1.0 - beta2)
        denom = exp_avg_sq.sqrt().add_(group["eps"])
        step_size = group["lr"]
        if group["correct_bias"]:
            step_size = step_size * math.sqrt(1.0 - beta2 ** state["step"]) / (1.0 - beta1 ** state["step"])
        # exp_avg / denom into denom's storage: the same division, one tensor fewer
        normalized = torch.div(exp_avg, denom, out=denom)
        if not projected:
            parameter.add_(normalized, alpha=-step_size)
        else:
            self._add_scaled_gradient(group, state, parameter, low_rank, normalized, step_size)
        if group["weight_decay"] > 0.0:
            parameter.add_(parameter, alpha=-group["lr"] * group["weight_decay"])

    def _add_scaled_gradient(self, group: dict, state: dict, parameter: torch.Tensor, low_rank: torch.Tensor,
                             normalized: torch.Tensor, step_size: float) -> None:
        """The library's update of a projected matrix, a block of rows at a time.

        Element by element the operations are the library's (scale, limit, sqrt(scale), add), so the
        weights are the library's to the bit where the blocks' norms add up as the whole tensor's; the
        scaled gradient's norm, which the limiter needs before any row is updated, takes a first pass.
        """
        grad = parameter.grad
        norm_dim = 0 if grad.shape[0] < grad.shape[1] else 1
        if group["scale_type"] == "channel":
            factor = torch.norm(normalized, dim=norm_dim) / (torch.norm(low_rank, dim=norm_dim) + 1e-8)
            if norm_dim == 1:
                factor = factor.unsqueeze(1)
        elif group["scale_type"] == "tensor":
            factor = torch.norm(normalized) / (torch.norm(low_rank) + 1e-8)
        else:
            raise ValueError(f"APOLLO scale_type {group['scale_type']!r}: expected channel or tensor")
        root_scale = math.sqrt(group["scale"])
        rows = max(1, optimizer_state.APOLLO_BLOCK_ELEMENTS // max(1, grad.shape[1]))
        blocks = list(zip(grad.split(rows), parameter.split(rows),
                          factor.split(rows) if factor.ndim == 2 else [factor] * math.ceil(grad.shape[0] / rows),
                          strict=True))

        def scaled(gradient_rows: torch.Tensor, factor_rows: torch.Tensor) -> torch.Tensor:
            block = gradient_rows * factor_rows
            if self.scale_front:
                block *= root_scale
            return block

        limiter = None
        if not self.disable_nl:
            block_norms = torch.stack([torch.norm(scaled(rows_, factor_)).float() for rows_, _, factor_ in blocks])
            scaled_norm = block_norms.square().sum().sqrt().to(factor.dtype)
            if "scaled_grad" in state:
                limiter = max(scaled_norm / (state["scaled_grad"] + 1e-8), 1.01) / 1.01
                state["scaled_grad"] = scaled_norm / limiter
            else:
                state["scaled_grad"] = scaled_norm
        for gradient_rows, parameter_rows, factor_rows in blocks:
            block = scaled(gradient_rows, factor_rows)
            if limiter is not None:
                block.div_(limiter)  # the library divides into a new tensor: the same values
            if not self.scale_front:
                block *= root_scale
            parameter_rows.add_(block, alpha=-step_size)
            del block  # before the next block is made: one block at a time
