"""Helpers of the fault-injection tests: a 2x gradient error must make every equality check fail.

Adam's update is invariant to a uniform gradient scale and clipping removes most of the
rest, so the equality tests compare runs under SGD without clipping; these helpers put a
known scale error into one of the two runs, in this process or in a subprocess, through
seams that do not depend on memfit's internals (torch.Tensor.backward, torch.set_rng_state,
Parameter.requires_grad_).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import torch

SHIM_DIR = Path(__file__).resolve().parent / "fault_shim"

# SGD, no momentum, no clipping, no warmup, constant rate: the update is -lr x gradient,
# so any error in the gradient's scale shows in the weights.
SGD_NO_CLIPPING = dict(optimizer="sgd", momentum=0.0, max_grad_norm=0.0, warmup_steps=0, lr_schedule="constant")
SGD_FLAGS = ["--optimizer", "sgd", "--momentum", "0", "--max-grad-norm", "0", "--warmup-steps", "0",
             "--lr-schedule", "constant"]


def fault_env(grad_scale: float | None = None, keep_rng: bool = False) -> dict[str, str]:
    """Environment for a subprocess that runs with the fault (see fault_shim/sitecustomize.py)."""
    path = os.pathsep.join(p for p in (str(SHIM_DIR), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path}
    if grad_scale is not None:
        env["MEMFIT_FAULT_GRAD_SCALE"] = str(grad_scale)
    if keep_rng:
        env["MEMFIT_FAULT_KEEP_RNG"] = "1"
    return env


@contextlib.contextmanager
def scaled_gradients(scale: float):
    """In this process: every backward pass propagates `scale` times the gradient."""
    original = torch.Tensor.backward

    def backward(self, gradient=None, *args, **kwargs):
        gradient = torch.full_like(self, scale) if gradient is None else gradient * scale
        return original(self, gradient, *args, **kwargs)

    torch.Tensor.backward = backward
    try:
        yield
    finally:
        torch.Tensor.backward = original


@contextlib.contextmanager
def half_applied_step_after_sigterm():
    """In this process: once the run's SIGTERM handler has been called, the next optimizer step updates only every
    other parameter (the step in flight half applied when the checkpoint is written).

    MEMFIT_FAULT_PREEMPT_PARTIAL enters it for a whole subprocess (fault_shim/sitecustomize.py); as a context it
    lets a worker that runs several trainings in one launch put the fault into one of them only. The seams are the
    `signal.signal` that installs the handler (looked up at call time) and torch's global optimizer hook.
    """
    import signal

    from torch.optim.optimizer import register_optimizer_step_pre_hook

    state = {"signalled": False, "done": False}
    install = signal.signal

    def noting_signal(number, handler):
        if number == signal.SIGTERM and callable(handler):
            def noted(signum, frame, _handler=handler):
                state["signalled"] = True
                return _handler(signum, frame)

            return install(number, noted)
        return install(number, handler)

    def half_step(optimizer, args, kwargs):
        if state["signalled"] and not state["done"]:
            state["done"] = True
            parameters = [p for group in optimizer.param_groups for p in group["params"]]
            for parameter in parameters[1::2]:
                parameter.grad = None

    signal.signal = noting_signal
    handle = register_optimizer_step_pre_hook(half_step)
    try:
        yield state
    finally:
        handle.remove()
        signal.signal = install


@contextlib.contextmanager
def freezing_ignored():
    """Parameters cannot be frozen: OOM recovery that redoes a micro-batch counts gradients twice."""
    original = torch.nn.Parameter.__dict__.get("requires_grad_")

    def requires_grad_(self, requires_grad=True):
        if requires_grad:
            return torch.Tensor.requires_grad_(self, True)
        return self

    torch.nn.Parameter.requires_grad_ = requires_grad_
    try:
        yield
    finally:
        if original is None:
            del torch.nn.Parameter.requires_grad_
        else:
            torch.nn.Parameter.requires_grad_ = original


def largest_update(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> float:
    """The largest change of any weight: an equality check is only as strong as this is large."""
    return max(float((after[name].float() - tensor.float()).abs().max()) for name, tensor in before.items())


@contextlib.contextmanager
def oom_in_backward_of_linear(in_features: int, out_features: int, above_batch: int = 2):
    """Raise an OOM in backward when it reaches the first Linear of this shape, for micro-batches above
    `above_batch`; yields {"n": times raised}.

    Layers after that one already hold their gradients then, so a recovery that counts them twice shows.
    Found through a global forward hook, not memfit's internals.
    """
    first: list[int] = []
    raised = {"n": 0}

    def boom(grad):
        raised["n"] += 1
        raise torch.OutOfMemoryError("injected: CUDA out of memory")

    def hook(module, inputs, output):
        if not (isinstance(module, torch.nn.Linear) and (module.in_features, module.out_features) == (in_features, out_features)):
            return
        if not first:
            first.append(id(module))
        if id(module) == first[0] and output.shape[0] > above_batch and output.requires_grad:
            output.register_hook(boom)

    handle = torch.nn.modules.module.register_module_forward_hook(hook)
    try:
        yield raised
    finally:
        handle.remove()


def final_weights(result) -> dict[str, torch.Tensor]:
    """The final model's weights of a `memfit.train` result, read back from its safetensors file."""
    from safetensors.torch import load_file

    return load_file(str(result.final_dir / "model.safetensors"))


def assert_same_weights(reference: dict, weights: dict, atol: float = 1e-5) -> None:
    """Every tensor of `weights` equals `reference`'s within `atol` (no relative slack: SGD twins move far beyond it)."""
    assert reference.keys() == weights.keys()
    for name, tensor in reference.items():
        torch.testing.assert_close(weights[name], tensor, atol=atol, rtol=0, msg=name)

