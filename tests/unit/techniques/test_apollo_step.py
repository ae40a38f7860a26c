"""memfit's APOLLO step: the library's update, with no temporary the size of the weight.

Each comparison runs apollo-torch's APOLLOAdamW and memfit's class on the same weights and the same gradients for
several steps (the projection refreshed every 2), on a wide and a tall matrix, channel-wise (APOLLO, rank 4) and
tensor-wise (APOLLO-Mini, rank 1) scales; the tracker then measures what one step allocates beyond what was live.
"""

from __future__ import annotations

import pytest
import torch

from memfit.memory.tracker import MemoryTracker

apollo = pytest.importorskip("apollo_torch")

from memfit.models import optimizer_state  # noqa: E402
from memfit.techniques.small_state_optimizers import _classes  # noqa: E402

SETTINGS = {"apollo-adamw": {"rank": 4, "scale": 1.0, "scale_type": "channel"},
            "apollo-mini": {"rank": 1, "scale": 128.0, "scale_type": "tensor"}}


def _optimizer(cls, weight: torch.nn.Parameter, name: str, scale_front: bool = False, gap: int = 2):
    group = {"params": [weight], "update_proj_gap": gap, "proj_type": "std", "proj": "random", **SETTINGS[name]}
    return cls([group], lr=1e-2, weight_decay=0.1, scale_front=scale_front)


def _gradients(shape, steps: int, dtype: torch.dtype) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    # growing gradients, so that the norm-growth limiter acts on some steps
    return [(torch.randn(shape, generator=generator) * (1 + step)).to(dtype) for step in range(steps)]


def _start(shape) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(3)) * 0.05  # an initializer's scale


def _trajectory(cls, name: str, shape, dtype: torch.dtype, scale_front: bool, steps: int = 5):
    weight = torch.nn.Parameter(_start(shape).to(dtype))
    optimizer = _optimizer(cls, weight, name, scale_front)
    for gradient in _gradients(shape, steps, dtype):
        weight.grad = gradient.clone()
        optimizer.step()
    return weight.detach()


@pytest.mark.parametrize("name", sorted(SETTINGS))
@pytest.mark.parametrize("shape", [(24, 40), (40, 24)], ids=["wide", "tall"])
@pytest.mark.parametrize("scale_front", [False, True], ids=["scale-after", "scale-front"])
@pytest.mark.parametrize("block_elements", [1 << 22, 7 * 40], ids=["one-block", "blocks-of-7-rows"])
def test_the_update_equals_the_library_in_fp32(name, shape, scale_front, block_elements, monkeypatch):
    monkeypatch.setattr(optimizer_state, "APOLLO_BLOCK_ELEMENTS", block_elements)  # 24 or 40 rows: the last block shorter
    start = _start(shape)
    ours = _trajectory(_classes(name), name, shape, torch.float32, scale_front)
    theirs = _trajectory(apollo.APOLLOAdamW, name, shape, torch.float32, scale_front)
    assert not torch.allclose(theirs, start, atol=1e-3)  # the weights moved: the comparison can fail
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", sorted(SETTINGS))
def test_the_update_equals_the_library_in_bf16_to_its_rounding(name):
    """In bf16 too (the norms of the blocks add up in another order than the whole tensor's)."""
    shape = (24, 40)
    start = _start(shape).to(torch.bfloat16).float()
    ours = _trajectory(_classes(name), name, shape, torch.bfloat16, False).float()
    theirs = _trajectory(apollo.APOLLOAdamW, name, shape, torch.bfloat16, False).float()
    moved = (theirs - start).abs().mean()
    assert moved > 1e-3
    assert (ours - theirs).abs().mean() < 0.01 * moved


def test_a_halved_update_fails_the_comparison():
    """The fault twin: the same trajectory with the scaled gradient's step halved."""
    name, shape = "apollo-mini", (24, 40)
    cls = _classes(name)

    class Halved(cls):
        def _add_scaled_gradient(self, group, state, parameter, low_rank, normalized, step_size):
            super()._add_scaled_gradient(group, state, parameter, low_rank, normalized, step_size / 2)

    theirs = _trajectory(apollo.APOLLOAdamW, name, shape, torch.float32, False)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(_trajectory(Halved, name, shape, torch.float32, False), theirs,
                                   rtol=1e-6, atol=1e-6)


def _step_temporaries(cls, name: str, dtype: torch.dtype, projected: bool = True) -> float:
    """Bytes one refreshing step allocates beyond what was live before it, in copies of the weight (blocks of a
    sixteenth of it: the 8B head's 525M values in blocks of 4M are 1/125 each)."""
    layer = torch.nn.Linear(512, 1024, bias=False).to(dtype)
    optimizer = _optimizer(cls, layer.weight, name, gap=1) if projected else cls([layer.weight], lr=1e-2)
    tracker = MemoryTracker("cpu")
    tracker.attach(layer, optimizer)
    weight_bytes = layer.weight.numel() * layer.weight.element_size()
    with tracker:
        for gradient in _gradients(layer.weight.shape, 2, dtype):
            layer.weight.grad = gradient
            before = tracker.current_bytes
            with tracker.phase("step"):
                optimizer.step()
            step = tracker.end_step()
    # the second step's state exists already: what rises above `before` is temporary
    return (next(p.peak_bytes for p in step.phases if p.name == "step") - before) / weight_bytes


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_a_step_allocates_a_small_fraction_of_the_weight_where_the_library_allocates_two_copies(dtype, monkeypatch):
    monkeypatch.setattr(optimizer_state, "APOLLO_BLOCK_ELEMENTS", 1024 * 512 // 16)
    ours = _step_temporaries(_classes("apollo-mini"), "apollo-mini", dtype)
    theirs = _step_temporaries(apollo.APOLLOAdamW, "apollo-mini", dtype)
    assert ours < 0.1  # a block (1/16) and the low-rank tensors
    assert theirs >= 1.9  # the library's scaled gradient and its limited copy (bf16: and the float32 copy)
    assert _step_temporaries(_classes("apollo-adamw"), "apollo-adamw", dtype) < 0.1


def test_an_unprojected_matrix_steps_with_one_temporary_where_the_library_makes_two():
    """APOLLO leaves the head unprojected at rank 128 (its largest tensor): AdamW's update, sqrt(v) the only copy."""
    ours = _step_temporaries(_classes("apollo-adamw"), "apollo-adamw", torch.float32, projected=False)
    theirs = _step_temporaries(apollo.APOLLOAdamW, "apollo-adamw", torch.float32, projected=False)
    assert 0.9 < ours < 1.1 and theirs > 1.9
