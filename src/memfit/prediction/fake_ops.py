"""What memfit's fake-tensor traces (the traced estimate, the layer probe) answer in place of a kernel.

A fake tensor has no values and runs each operator's meta kernel. Two things a real step does need an answer:

- scalar reads ("is the attention mask all ones", target-token counts, the optimizer's step counter, the loss
  read at the end of a step): any plausible value;
- `torch.bincount(expert_ids, minlength=experts)` (tokens per expert, memfit's split LoRA): its length depends on
  the values, which a fake tensor lacks; the ids are below `minlength`, so that is its length;
- `torch._grouped_mm`, which transformers 5 runs for fused experts: its meta kernel accepts bf16 only, while the
  CPU kernel also runs fp32 and fp16 (a real fp32 MoE step works, its trace did not). The output of a grouped
  matmul is one new tensor whose shape follows from the inputs' shapes alone, so it is made here in the dtype the
  real kernel returns; nothing else of the step changes.

`quiet_meta_failures` keeps torch's fake-tensor logger from printing a meta kernel's whole traceback into the
user's output while memfit traces (the failure, if any, still propagates as an exception).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_META_LOGGER = "torch._subclasses.fake_tensor"


def grouped_mm_output_shape(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None) -> list[int]:
    """The output shape of `torch._grouped_mm(mat_a, mat_b, offs)` (2-D or 3-D operands, as its kernels define it)."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:  # groups split the shared (k) dimension
        return [offs.size(0), mat_a.size(0), mat_b.size(1)]
    if mat_a.dim() == 2:  # tokens sorted by expert x one weight per expert: the routed-expert forward
        return [mat_a.size(0), mat_b.size(-1)]
    if mat_b.dim() == 2:
        return [mat_a.size(1), mat_b.size(1)]
    return [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]


def _is_fake(tensor: object) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


class FakeStepAnswers(TorchDispatchMode):
    """Answer scalar reads and grouped matmuls in dtypes their meta kernel refuses (enter it inside FakeTensorMode)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            return {torch.bool: True}.get(args[0].dtype, 1)
        if func is torch.ops.aten._grouped_mm.default and _is_fake(args[0]) and args[0].dtype != torch.bfloat16:
            mat_a, mat_b = args[0], args[1]
            offs = args[2] if len(args) > 2 else kwargs.get("offs")
            out_dtype = (args[4] if len(args) > 4 else kwargs.get("out_dtype")) or mat_a.dtype
            return torch.empty(grouped_mm_output_shape(mat_a, mat_b, offs), dtype=out_dtype, device=mat_a.device)
        if func is torch.ops.aten.bincount.default and _is_fake(args[0]):
            minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
            if minlength:  # tokens per expert: the ids are below the expert count the caller passes as minlength
                weights = args[1] if len(args) > 1 else kwargs.get("weights")
                dtype = torch.int64 if weights is None else weights.dtype
                return torch.zeros(minlength, dtype=dtype, device=args[0].device)
        return func(*args, **kwargs)


@contextlib.contextmanager
def quiet_meta_failures() -> Iterator[None]:
    """Silence torch's log of a failing meta kernel (its traceback) for the duration; errors still raise."""
    logger = logging.getLogger(_META_LOGGER)
    previous = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(previous)
