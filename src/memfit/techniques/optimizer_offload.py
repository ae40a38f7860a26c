"""Optimizer state in host memory: the step of the whole model, or of each parameter in backward, on the CPU.

Optimizer offload (`--optimizer-offload`, CUDA only, needs torchao)
    Saves: the optimizer state (8 bytes per parameter for AdamW) and the fp32 master
    copy used by the step live in host memory; the step runs on the CPU.
    Costs: each gradient crosses to the host in backward and each parameter comes back
    after the step (2 x 4 bytes per parameter over PCIe per step), and the CPU AdamW
    step time. Gradient clipping cannot be used: the gradients are copied to the host
    as they are produced, before the loop could clip them (`check_optimizer_offload`).
    With `--optimizer-in-backward` see `HostSteppedOptimizer` (any device).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from memfit.config import OptimizerConfig
from memfit.errors import UsageError
from memfit.techniques.host_memory import empty_host_like, host_allocations, mark_host_all

OPTIMIZER_NO_EFFECT_ON_CPU = "optimizer offload has no effect on CPU: optimizer state already lives in host memory"


def check_optimizer_offload(device: torch.device | str, max_grad_norm: float) -> None:
    """Raise UsageError for settings that optimizer offload on CUDA would silently ignore."""
    if torch.device(device).type == "cuda" and max_grad_norm > 0:
        raise UsageError(
            "--optimizer-offload copies gradients to the CPU as backward produces them, before clipping:"
            " set --max-grad-norm 0, or drop --optimizer-offload"
        )


# Options of a device optimizer that must not be carried to its CPU twin.
_DEVICE_ONLY_OPTIONS = ("fused", "foreach", "capturable", "differentiable")


def optimizer_offload(
    optimizer: torch.optim.Optimizer,
    groups: list[dict[str, Any]],
    optimizer_config: OptimizerConfig | None,
    device: torch.device | str,
) -> tuple[torch.optim.Optimizer, str | None]:
    """The same optimizer with its state and step on the CPU, or `optimizer` and why not.

    Args:
        optimizer: the optimizer built for the device (its state is created lazily, so
            it has cost nothing yet); its class and options are reused.
        groups: the parameter groups it was built from.
        optimizer_config: checked for gradient clipping (see `check_optimizer_offload`).
        device: the training device.
    Returns:
        On CUDA, torchao's `CPUOffloadOptimizer` (parameters under 4096 elements stay on
        the GPU with an ordinary optimizer) and None. Otherwise `optimizer` unchanged and
        the reason: CPU (no effect), torchao missing, or an optimizer class that is not
        one of torch's. The result works with LR schedulers, `state_dict()`, `zero_grad()`.
    Raises:
        UsageError: gradient clipping is on (CUDA only).
    """
    device = torch.device(device)
    if device.type != "cuda":
        if device.type == "cpu":
            return optimizer, OPTIMIZER_NO_EFFECT_ON_CPU
        return optimizer, f"optimizer offload supports CUDA only, not {device.type}"
    if optimizer_config is not None:
        check_optimizer_offload(device, optimizer_config.max_grad_norm)
    optimizer_class = type(optimizer)
    if not optimizer_class.__module__.startswith("torch.optim"):
        return (
            optimizer,
            f"optimizer offload runs torch optimizers on the CPU; {optimizer_class.__name__} stays on the GPU",
        )
    try:
        from torchao.optim import CPUOffloadOptimizer
    except ImportError:
        return (
            optimizer,
            "torchao is not installed, so the optimizer state stays on the GPU (pip install memfit[torchao])",
        )
    accepted = inspect.signature(optimizer_class.__init__).parameters
    options = {
        key: value
        for key, value in optimizer.defaults.items()
        if key in accepted and key not in _DEVICE_ONLY_OPTIONS  # AdamW's defaults hold more than it takes
    }
    # torchao takes the "params" out of the groups it is given: hand it copies.
    own_groups = [{**group, "params": list(group["params"])} for group in groups]
    return CPUOffloadOptimizer(own_groups, optimizer_class, offload_gradients=False, **options), None


class HostSteppedOptimizer:
    """The optimizer of one parameter, stepping a host copy of it: optimizer offload in backward.

    Built by `OptimizerInBackward` through `host_stepped(make_optimizer, device)`, once per
    trainable parameter. When backward completes the parameter's gradient, `step()`
    copies the gradient to host memory, runs the wrapped optimizer on the host copy of
    the parameter (its state is created there), and copies the result back; the caller
    then frees the device gradient.

    Device memory: the parameters and one gradient at a time. Host memory: a copy of
    each parameter and of its gradient (pinned on CUDA) and the optimizer state.
    Costs: per step, each gradient crosses to the host and each parameter back (on the
    compute stream: backward waits for the copy and the host step of each parameter);
    the step itself runs on the CPU. The numbers are the wrapped optimizer's on that
    CPU: on a CPU run they equal the plain run's exactly.

    The host copy follows the parameter: if anything else writes the parameter (loading
    a checkpoint), the next step starts from the parameter's new value.
    """

    def __init__(self, parameter: nn.Parameter, make_optimizer: Callable, pin: bool):
        self.parameter = parameter
        self._pin = pin
        master = empty_host_like(parameter, pin)
        master.copy_(parameter.detach())
        self.master = nn.Parameter(master)
        self.master.grad = empty_host_like(parameter, pin)
        with host_allocations():
            self.inner = make_optimizer([self.master])
        self._synced_version = parameter._version

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @torch.no_grad()
    def step(self, closure=None):
        parameter = self.parameter
        if parameter.grad is None:
            return None
        if parameter._version != self._synced_version:
            self.master.copy_(parameter)
        self.master.grad.copy_(parameter.grad)  # blocking on CUDA: the host step reads it next
        with host_allocations():  # the optimizer's state and temporaries are host memory
            self.inner.step()
        mark_host_all(value for state in self.inner.state.values() for value in state.values())
        parameter.copy_(self.master, non_blocking=self._pin)
        self._synced_version = parameter._version
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.parameter.grad = None

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        with host_allocations():
            self.inner.load_state_dict(state_dict)
        mark_host_all(value for state in self.inner.state.values() for value in state.values())


def host_stepped(make_optimizer: Callable, device: torch.device | str) -> Callable:
    """A per-parameter optimizer factory for `OptimizerInBackward` that steps on the host.

    `make_optimizer` builds the optimizer of a one-element parameter list, as for
    `OptimizerInBackward`; it receives the host copy of the parameter.
    """
    pin = torch.device(device).type == "cuda"

    def make(params: list[nn.Parameter]) -> HostSteppedOptimizer:
        (parameter,) = params
        return HostSteppedOptimizer(parameter, make_optimizer, pin)

    return make


def _resolve(facts, run) -> dict:
    distributed = facts.config.distributed
    own = facts.config.memory.optimizer_offload
    return {"optimizer_offload": own or distributed.zero_offload or distributed.fsdp_offload, "host_optimizer_step": own}


def _refusals(run, facts) -> list[str]:
    if not run.host_optimizer_step or facts.engine in ("", "--sharding ddp"):
        return []
    instead = "--fsdp-offload" if "fsdp" in facts.engine else "--zero-offload (or offload_optimizer in the file)"
    return [f"--optimizer-offload is single-process: with {facts.engine} use {instead}"]


CPU_ADAMW_PARAMETERS_PER_SECOND = 2e9
"""Parameters torch's AdamW steps per second on the host copies (the speed model's figure for the CPU step)."""


def _speed_terms(run, facts) -> float:
    """Each step the gradients go down and the updated weights come up over the host link (fp32, 4 bytes each way),
    and the CPU steps AdamW on the host copies."""
    if not run.optimizer_offload:
        return 0.0
    trainable = facts.trainable_parameters
    return 8 * trainable / facts.link_bytes_per_second + trainable / CPU_ADAMW_PARAMETERS_PER_SECOND


def _technique():
    from memfit.techniques.technique import Technique

    return Technique(
        name="optimizer_offload", stage="optimizer", settings=("optimizer_offload",), after=("optimizer",),
        resolve=_resolve, refusals=_refusals, speed_terms=_speed_terms,
        report=lambda run: {"optimizer_offload": True} if run.optimizer_offload else {},
        summary="the optimizer's state and step in host memory: no state on the device; the link carries gradients"
                " and weights each step",
    )


TECHNIQUE = _technique()
