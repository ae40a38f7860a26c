"""Faults injected into a subprocess run: put this directory on PYTHONPATH and set one of the variables.

Python imports `sitecustomize` at start-up, so a run under `python -m memfit` or `torchrun`
(every rank inherits the environment) gets the fault before memfit is imported. A command forked from the
warm server (tests/memfit_cli.py) runs it before the command, memfit already imported: every seam patched
here is looked up when it is called, so the fault reaches it all the same.

MEMFIT_FAULT_GRAD_SCALE=S   every backward pass propagates S times the gradient: what a loss
                            normalizer wrong by a factor 1/S does (S=0.5: the token count
                            not divided by the world size; S=2: counted on half the ranks).
MEMFIT_FAULT_KEEP_RNG=1     restoring a saved RNG state does nothing: a resumed run draws
                            dropout masks from wherever the fresh process's generator stands.
"""

import os

_scale = os.environ.get("MEMFIT_FAULT_GRAD_SCALE")
_keep_rng = os.environ.get("MEMFIT_FAULT_KEEP_RNG")

if _scale or _keep_rng:
    import torch

    if _scale:
        _backward = torch.Tensor.backward
        _factor = float(_scale)

        def _scaled_backward(self, gradient=None, *args, **kwargs):
            gradient = torch.full_like(self, _factor) if gradient is None else gradient * _factor
            return _backward(self, gradient, *args, **kwargs)

        torch.Tensor.backward = _scaled_backward

    if _keep_rng:
        torch.set_rng_state = lambda state: None
        torch.random.set_rng_state = lambda state: None

# MEMFIT_FAULT_PREEMPT_PARTIAL=1   once the run's SIGTERM handler has been called, the next optimizer
#                                 step updates only every other parameter: the step in flight half
#                                 applied when the checkpoint is written.
if os.environ.get("MEMFIT_FAULT_PREEMPT_PARTIAL"):
    import sys as _sys

    # The same fault the in-process tests use (fault_injection.py, one folder up), held for the whole process.
    _sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from fault_injection import half_applied_step_after_sigterm

    # Kept referenced: a context manager collected while entered would run its exit and lift the fault.
    _preempt_fault = half_applied_step_after_sigterm()
    _preempt_fault.__enter__()
