"""The emulated memory cap: a real torch.OutOfMemoryError on CPU, and a clean recovery."""

from __future__ import annotations

import pytest
import torch
from tracker_helpers import build_llama, tracked_step

from memfit.memory.cap import apply_memory_cap, cap_exceeded_error, is_out_of_memory
from memfit.memory.categories import ACTIVATIONS
from memfit.memory.tracker import MemoryTracker


def measure_step_peak(input_ids) -> int:
    model = build_llama(layers=2)
    optimizer = torch.optim.AdamW(model.parameters())
    tracker = MemoryTracker("cpu")
    tracker.attach(model, optimizer)
    with tracker:
        tracked_step(tracker, model, optimizer, input_ids)
        return tracker.end_step().peak_bytes


def test_cap_below_the_peak_raises_above_it_completes_and_recovery_frees():
    input_ids = torch.randint(0, 256, (2, 128))
    peak = measure_step_peak(input_ids)

    model = build_llama(layers=2)
    optimizer = torch.optim.AdamW(model.parameters())
    tracker = MemoryTracker("cpu", cap_bytes=peak - 1)
    tracker.attach(model, optimizer)
    with tracker:
        model(input_ids=input_ids[:, :2])  # first sight of inputs and buffers
        before = tracker.current_bytes
        with pytest.raises(
            torch.OutOfMemoryError, match=r"memfit memory cap: tried to allocate .* live; cap is .*--memory-cap"
        ):
            tracked_step(tracker, model, optimizer, input_ids)
        # Everything the failed attempt made is gone once the exception is dropped.
        optimizer.zero_grad(set_to_none=True)
        assert tracker.current_bytes == before
        assert tracker.breakdown()[ACTIVATIONS] == 0
        assert tracker.peak_bytes <= peak - 1

        # Retry in two halves (what OOM recovery does): it fits under the same cap.
        for half in input_ids.split(1):
            with tracker.phase("forward"):
                loss = model(input_ids=half, labels=half).loss / 2
            with tracker.phase("backward"):
                loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        assert tracker.end_step().peak_bytes <= peak - 1

    fresh = build_llama(layers=2)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters())
    roomy = MemoryTracker("cpu", cap_bytes=peak + 1)
    roomy.attach(fresh, fresh_optimizer)
    with roomy:
        tracked_step(roomy, fresh, fresh_optimizer, input_ids)
        assert roomy.end_step().peak_bytes == peak


def test_cap_hit_in_backward_recovers():
    input_ids = torch.randint(0, 256, (2, 128))
    model = build_llama(layers=2)
    tracker = MemoryTracker("cpu")
    tracker.attach(model)
    with tracker:
        tracked_step(tracker, model, None, input_ids)
        memory = tracker.end_step()
    forward_peak = next(phase.peak_bytes for phase in memory.phases if phase.name == "forward")
    backward_peak = next(phase.peak_bytes for phase in memory.phases if phase.name == "backward")
    assert backward_peak > forward_peak

    model.zero_grad(set_to_none=True)
    capped = MemoryTracker("cpu", cap_bytes=forward_peak + 1)
    capped.attach(model)
    with capped:
        model(input_ids=input_ids[:, :2])
        before = capped.current_bytes
        with pytest.raises(torch.OutOfMemoryError):
            tracked_step(capped, model, None, input_ids)
        model.zero_grad(set_to_none=True)
        assert capped.current_bytes == before


def test_is_out_of_memory_recognizes_cuda_cap_and_cpu_allocator_errors():
    assert is_out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert is_out_of_memory(cap_exceeded_error(2**20, 2**30, 2**30))
    try:
        torch.empty(2**60, dtype=torch.uint8)  # more than any machine: malloc fails at once
    except RuntimeError as error:
        assert is_out_of_memory(error)
    else:
        pytest.skip("this machine allocated 1 EiB")
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("DefaultCPUAllocator: can't allocate memory"))


def test_cap_error_message_names_sizes_and_flag():
    message = str(cap_exceeded_error(512 * 2**20, 3 * 2**30, 2**30 + 2**29))
    assert message == (
        "memfit memory cap: tried to allocate 512.00 MiB with 3.00 GiB live; cap is 1.50 GiB (--memory-cap)"
    )


def test_apply_memory_cap_is_a_no_op_off_cuda():
    assert apply_memory_cap("cpu", 2**30) is None


@pytest.mark.gpu
def test_apply_memory_cap_on_cuda_raises_past_the_cap():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    import gc

    device = torch.device("cuda")
    gc.collect()
    torch.cuda.empty_cache()
    try:
        # The cap covers all the process reserves, earlier tests' leftovers included.
        apply_memory_cap(device, torch.cuda.memory_reserved(device) + 512 * 2**20)
        small = torch.empty(128 * 2**20, dtype=torch.uint8, device=device)
        with pytest.raises(torch.OutOfMemoryError) as caught:
            torch.empty(1024 * 2**20, dtype=torch.uint8, device=device)
        assert is_out_of_memory(caught.value)
        del small
    finally:
        apply_memory_cap(device, None)
        torch.cuda.empty_cache()
