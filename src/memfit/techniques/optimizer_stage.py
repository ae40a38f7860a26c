"""The optimizer a run steps, built as its resolved run says: the optimizer technique, then in backward or offloaded.

    choice = build_run_optimizer(run, config.optimizer, model, device, fallbacks)   # engine.prepare calls it

Small-state optimizers (GaLore, APOLLO, Adam-mini, 4-bit AdamW) build themselves, at the end of backward or in it;
`run.optimizer_in_backward` gives each parameter its own optimizer, stepped by its gradient hook (on a host copy
under `run.host_optimizer_step`); otherwise one optimizer over the parameter groups, offloaded to host copies under
`run.host_optimizer_step`. What could not run as asked is said in `fallbacks`.
"""

from __future__ import annotations

import logging

import torch

from memfit.config import OptimizerConfig
from memfit.models.optimizer_state import SMALL_STATE_OPTIMIZERS
from memfit.techniques.optimizers import OptimizerChoice, build_optimizer, parameter_groups
from memfit.techniques.resolved_run import ResolvedRun

log = logging.getLogger("memfit")


def build_run_optimizer(run: ResolvedRun, settings: OptimizerConfig, model: torch.nn.Module, device: torch.device,
                        fallbacks: dict[str, str]) -> OptimizerChoice:
    """The optimizer of `run` over `model`'s trainable parameters (see the module docstring)."""
    groups = parameter_groups(model, settings.weight_decay)
    if run.optimizer in SMALL_STATE_OPTIMIZERS:
        from memfit.techniques.small_state_optimizers import build_run_optimizer as build_small_state

        return build_small_state(model, groups, settings, device, run.optimizer_in_backward, fallbacks)
    if run.optimizer_in_backward:
        return _in_backward(run, settings, groups, device)
    choice = build_optimizer(groups, settings, device)
    if run.host_optimizer_step:
        from memfit.techniques.optimizer_offload import optimizer_offload

        offloaded, reason = optimizer_offload(choice.optimizer, groups, settings, device)
        if reason:
            fallbacks["optimizer_offload"] = reason
            log.warning("memfit: %s", reason)
        else:
            choice = OptimizerChoice(offloaded, choice.name + " offloaded to CPU", choice.reason)
    if choice.reason:
        fallbacks["optimizer"] = choice.reason
    return choice


def _in_backward(run: ResolvedRun, settings: OptimizerConfig, groups: list[dict],
                 device: torch.device) -> OptimizerChoice:
    """One optimizer a parameter, each stepped by the parameter's gradient hook (techniques/optimizer_in_backward)."""
    from memfit.techniques.optimizer_in_backward import OptimizerInBackward

    made: list[OptimizerChoice] = []

    def make(params):
        choice = build_optimizer([{"params": params}], settings, device, impl="for-loop")
        made.append(choice)
        return choice.optimizer

    offload = run.host_optimizer_step  # each parameter's step then runs on a host copy of it
    if offload:
        from memfit.techniques.optimizer_offload import host_stepped
    # The groups' options (no weight decay on norms and biases) are applied to each per-parameter optimizer.
    optimizer = OptimizerInBackward(groups, host_stepped(make, device) if offload else make)
    name = (made[0].name if made else run.optimizer) + " in backward" + (" on the host" if offload else "")
    return OptimizerChoice(optimizer, name, made[0].reason if made else "")
