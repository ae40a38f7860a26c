"""Optimizer step in backward: update each parameter as soon as its gradient is ready.

Flag `--optimizer-in-backward`.

Saves: the gradients of the whole model never coexist. Each trainable parameter gets its
own optimizer, stepped from the parameter's post-accumulate-grad hook, and its gradient
is freed right after; at most about one parameter's gradient is alive at a time instead
of all of them (for full fine-tuning in fp32, 4 bytes per parameter: 4 GiB for a 1B model).
Costs: nothing in speed for element-wise optimizers such as AdamW (the for-loop kernel per
parameter instead of a fused multi-tensor kernel is a little slower on GPU). It rules out
what needs all gradients at once: gradient accumulation over micro-batches, global
gradient-norm clipping, and fp16 loss scaling (see `check_optimizer_in_backward`).

With `--optimizer-offload` too, each per-parameter optimizer steps a host copy of its
parameter (`memfit.techniques.optimizer_offload.host_stepped`): the device then holds no optimizer
state either, only the weights and one gradient at a time.

The loop uses `OptimizerInBackward` like any optimizer: it calls `loss.backward()`, then
`step()` and `zero_grad()`, which are no-ops. It is a `torch.optim.Optimizer` whose
`param_groups` are the per-parameter optimizers' own groups, so an LR scheduler
(`LambdaLR(opt, ...)`) changes the learning rate that the hooks use: call
`scheduler.step()` after each `backward()` as usual. The rate set when backward runs is
the one applied. `state_dict()` / `load_state_dict()` save and restore every
per-parameter optimizer; `remove()` unhooks the model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from memfit.errors import UsageError

OptimizerFactory = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]


def check_optimizer_in_backward(accumulation_steps: int, max_grad_norm: float, uses_grad_scaler: bool = False) -> None:
    """Raise UsageError when the run needs all gradients at once.

    Args:
        accumulation_steps: micro-batches per optimizer step; must be 1.
        max_grad_norm: global clipping; must be 0 (clipping per parameter is not the same).
        uses_grad_scaler: fp16 loss scaling unscales all gradients before the step.
    """
    if accumulation_steps > 1:
        raise UsageError(
            f"--optimizer-in-backward steps at every backward, so it cannot accumulate {accumulation_steps}"
            " micro-batches: use --gradient-accumulation-steps 1 with a larger --batch-size,"
            " or drop --optimizer-in-backward"
        )
    if max_grad_norm > 0:
        raise UsageError(
            "--optimizer-in-backward never holds all gradients, so it cannot clip their global norm:"
            " set --max-grad-norm 0, or drop --optimizer-in-backward"
        )
    if uses_grad_scaler:
        raise UsageError(
            "--optimizer-in-backward cannot unscale fp16 gradients before the step: use --precision bf16"
            " or fp32, or drop --optimizer-in-backward"
        )


class OptimizerInBackward(torch.optim.Optimizer):
    """One optimizer per trainable parameter, stepped from the parameter's gradient hook.

    Args:
        params: a model, parameters, or parameter groups (dicts with "params" and
            per-group options such as "weight_decay"); frozen parameters are skipped.
        make_optimizer: builds the optimizer of one parameter from a one-element list,
            e.g. `lambda params: torch.optim.AdamW(params, lr=1e-3, foreach=False)`. The
            options of the parameter's group are then set on that optimizer's group,
            as a torch optimizer would do with per-group options.
    """

    def __init__(self, params: nn.Module | Iterable, make_optimizer: OptimizerFactory):
        if isinstance(params, nn.Module):
            params = params.parameters()
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        self.optimizers: dict[torch.nn.Parameter, torch.optim.Optimizer] = {}
        for group in groups:
            options = {key: value for key, value in group.items() if key != "params"}
            for parameter in group["params"]:
                if parameter.requires_grad and parameter not in self.optimizers:
                    optimizer = make_optimizer([parameter])
                    optimizer.param_groups[0].update(options)
                    self.optimizers[parameter] = optimizer
        if not self.optimizers:
            raise ValueError("OptimizerInBackward got no trainable parameter")
        # Optimizer.__init__ sets up the hook and state machinery that schedulers rely on;
        # the groups it builds are then replaced by the per-parameter optimizers' own.
        super().__init__(list(self.optimizers), defaults={})
        self.param_groups = [group for optimizer in self.optimizers.values() for group in optimizer.param_groups]
        self._handles = [
            parameter.register_post_accumulate_grad_hook(self._step_parameter) for parameter in self.optimizers
        ]

    @torch.no_grad()
    def _step_parameter(self, parameter: torch.Tensor) -> None:
        optimizer = self.optimizers[parameter]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)  # frees this gradient now: the point of it all

    def step(self, closure=None):  # noqa: D102 - the work happened in backward
        return closure() if closure is not None else None

    def zero_grad(self, set_to_none: bool = True) -> None:  # noqa: D102 - gradients are already freed
        return None

    def state_dict(self) -> dict[str, Any]:
        """The per-parameter optimizers' states, in parameter order."""
        return {"per_parameter": [optimizer.state_dict() for optimizer in self.optimizers.values()]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore states saved by `state_dict` from the same model and settings."""
        states = state_dict.get("per_parameter")
        if states is None or len(states) != len(self.optimizers):
            found = "none" if states is None else len(states)
            raise ValueError(
                f"optimizer state holds {found} per-parameter states, this model has {len(self.optimizers)};"
                " it was saved without --optimizer-in-backward or from another model"
            )
        for optimizer, state in zip(self.optimizers.values(), states, strict=True):
            optimizer.load_state_dict(state)
        # Optimizer.load_state_dict replaces each optimizer's group dicts: point at the new ones, or an LR
        # scheduler would set the rate on the old dicts and the hooks would keep the checkpoint's rate.
        self.param_groups = [group for optimizer in self.optimizers.values() for group in optimizer.param_groups]

    def remove(self) -> None:
        """Unhook the parameters: backward leaves gradients in `.grad` again."""
        for handle in self._handles:
            handle.remove()
        self._handles = []


def _refusals(run, facts) -> list[str]:
    """What a step that applies each gradient in its own backward hook cannot do."""
    if not run.optimizer_in_backward:
        return []
    if facts.engine:
        return [f"--optimizer-in-backward does not work with {facts.engine}: drop it"]
    config = facts.config
    try:
        check_optimizer_in_backward(config.accumulation_for(facts.world_size), config.optimizer.max_grad_norm,
                                    uses_grad_scaler=run.autocast == "fp16")
    except UsageError as error:
        return [str(error)]
    return []


def _technique():
    from memfit.techniques.technique import Technique

    return Technique(
        name="optimizer_in_backward", stage="optimizer", settings=("optimizer_in_backward",), after=("optimizer",),
        resolve=lambda facts, run: {"optimizer_in_backward": facts.config.memory.optimizer_in_backward},
        refusals=_refusals,
        report=lambda run: {"optimizer_in_backward": True} if run.optimizer_in_backward else {},
        summary="each gradient is applied and freed in backward: one tensor's gradient alive, not the model's",
    )


TECHNIQUE = _technique()
