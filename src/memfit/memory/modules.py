"""Which module is running, in forward and in backward: the tracker's attribution of new storages.

`ModuleWatcher` puts a forward pre-hook and hook on every module (a stack of running
modules; a forward that runs inside backward is a checkpointed block's recompute), and
on each module output's autograd node a pre-hook that notes, when the output's gradient
arrives in backward, that this module's backward is running. It also hands the
tracker the parameters a module holds right before its forward (FSDP2 swaps its
gathered full parameters in at that moment) and gradients as they are accumulated.
"""

from __future__ import annotations

import weakref

import torch
from torch import nn

from memfit.memory.categories import NO_MODULE


def graph_task() -> int:
    """The id of the backward pass running on this thread, or -1 outside backward."""
    return torch._C._current_graph_task_id()


class ModuleWatcher:
    """Forward and backward module attribution for one model, reported to an owner.

    The owner (a `MemoryTracker`) is held weakly and must offer `active` (bool),
    `parameter_in_use(tensor)` and `gradient_ready(tensor)`. The hooks live on the
    model and reach the watcher through a weak reference: model -> hook -> tracker ->
    model would be a cycle that keeps a whole model (and its GPU memory) alive until
    the garbage collector happens to run.
    """

    def __init__(self, owner) -> None:
        self._owner = weakref.ref(owner)
        self.stack: list[str] = []
        self.inputs: dict[str, int] = {}
        """Bytes of the first tensor input of each module's last forward."""
        self._backward: tuple[int, str] = (-1, NO_MODULE)  # (backward pass id, module)
        self._handles: list = []

    def attach(self, model: nn.Module) -> None:
        self.detach()
        root_name = type(model).__name__
        for name, module in model.named_modules():
            qualified = name or root_name
            self._handles.append(module.register_forward_pre_hook(self._pre_hook(qualified), with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_hook(qualified), always_call=True))
        grad_hook = self._grad_hook()
        for parameter in model.parameters():
            if parameter.requires_grad:
                self._handles.append(parameter.register_post_accumulate_grad_hook(grad_hook))

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.stack.clear()

    def forget_backward(self) -> None:
        self._backward = (-1, NO_MODULE)

    def where(self) -> tuple[str, bool, bool]:
        """(module, made by a recompute, made by backward) for a storage made now."""
        task = graph_task()
        if self.stack:
            # A module's forward running inside backward is a checkpointed block's recompute.
            return self.stack[-1], task != -1, False
        if task != -1:
            backward_task, module = self._backward
            return (module if backward_task == task else NO_MODULE), False, True
        return NO_MODULE, False, False

    def _active_owner(self):
        owner = self._owner()
        return owner if owner is not None and owner.active else None

    def _pre_hook(self, name: str):
        watcher_ref = weakref.ref(self)

        def pre_hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            watcher = watcher_ref()
            owner = watcher._active_owner() if watcher is not None else None
            if owner is None:
                return
            watcher.stack.append(name)
            for value in (*args, *kwargs.values()):
                if isinstance(value, torch.Tensor):
                    watcher.inputs[name] = value.nbytes
                    break
            # FSDP2 swaps gathered full parameters in just before forward: file them now.
            for parameter in module._parameters.values():
                if parameter is not None:
                    owner.parameter_in_use(parameter)

        return pre_hook

    def _post_hook(self, name: str):
        watcher_ref = weakref.ref(self)

        def post_hook(module: nn.Module, args: tuple, output) -> None:
            watcher = watcher_ref()
            if watcher is None:
                return
            # Pop down to this module: always_call runs this even when forward raised.
            if name in watcher.stack:
                while watcher.stack and watcher.stack.pop() != name:
                    pass
            if watcher._active_owner() is not None and graph_task() == -1 and torch.is_grad_enabled():
                watcher._watch_backward(name, output)

        return post_hook

    def _watch_backward(self, name: str, output) -> None:
        """When the gradient of `output` arrives in backward, that is `name`'s backward running."""
        watcher_ref = weakref.ref(self)

        def entered(grad_outputs):
            watcher = watcher_ref()
            if watcher is not None:
                watcher._backward = (graph_task(), name)

        seen: set[int] = set()
        for leaf in _tensor_leaves(output):
            grad_fn = leaf.grad_fn
            if grad_fn is not None and id(grad_fn) not in seen:
                seen.add(id(grad_fn))
                grad_fn.register_prehook(entered)

    def _grad_hook(self):
        watcher_ref = weakref.ref(self)

        def grad_hook(parameter: torch.Tensor) -> None:
            watcher = watcher_ref()
            owner = watcher._active_owner() if watcher is not None else None
            if owner is not None and parameter.grad is not None:
                owner.gradient_ready(parameter.grad)

        return grad_hook


def _tensor_leaves(output) -> list[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        return [output]
    if isinstance(output, dict):
        output = list(output.values())
    if isinstance(output, (list, tuple)):
        return [value for value in output if isinstance(value, torch.Tensor)]
    return []
