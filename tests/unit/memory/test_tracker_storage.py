"""The live-storage core under the tracker: exact counts, storage resizes (FSDP2), host vs device, the cap."""

from __future__ import annotations

import contextlib
import gc

import pytest
import torch
from tracker_helpers import build_llama, tracked_step

from memfit.memory.categories import ACTIVATIONS, PARAMETERS
from memfit.memory.tracker import MemoryTracker
from memfit.techniques.host_memory import host_allocations, mark_host


def bytes_of_every_live_tensor() -> int:
    """Bytes of the distinct CPU storages of every tensor the garbage collector knows, without the tracker."""
    sizes = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and obj.layout == torch.strided:
            try:
                storage = obj.untyped_storage()
                key = storage.data_ptr(), storage.nbytes()
            except RuntimeError:  # a wrapper without storage of its own (a fake tensor an earlier test left behind)
                continue
            sizes[key] = key[1]
    return sum(sizes.values())


@pytest.mark.slow  # each count walks every object of the process
def test_live_bytes_equal_an_independent_count_of_every_live_tensor_to_the_byte():
    model = build_llama(layers=2)
    optimizer = torch.optim.AdamW(model.parameters(), foreach=False)
    input_ids = torch.randint(0, 256, (2, 64))
    tracker = MemoryTracker("cpu")
    tracker.attach(model, optimizer)
    checks = []

    def check(label: str) -> None:
        checks.append((label, tracker.current_bytes - tracked_start, bytes_of_every_live_tensor() - counted_start))

    with tracker:
        tracked_step(tracker, model, optimizer, input_ids)  # optimizer state, buffers, inputs: first seen
        tracker.end_step()
        # Mid-forward, with a block's temporaries alive.
        model.model.layers[1].mlp.register_forward_hook(lambda module, args, output: check("inside a block"))
        gc.collect()
        tracked_start, counted_start = tracker.current_bytes, bytes_of_every_live_tensor()
        loss = model(input_ids=input_ids, labels=input_ids).loss
        check("after forward")
        loss.backward()
        del loss
        check("after backward")
        optimizer.step()
        check("after the optimizer step")
        optimizer.zero_grad(set_to_none=True)
        check("after zero_grad")
    assert len(checks) == 5
    for label, tracked, counted in checks:
        assert tracked == counted, (label, tracked, counted)
    assert checks[1][1] > 100_000  # the forward's saved tensors are really in the comparison


def test_storage_resize_is_counted_and_capped():
    tracker = MemoryTracker("cpu", cap_bytes=None)
    with tracker:
        start = tracker.current_bytes
        weight = torch.ones(1000)
        assert tracker.current_bytes - start == 4000
        weight.untyped_storage().resize_(0)  # how FSDP2 frees a gathered parameter
        assert tracker.current_bytes == start
        weight.untyped_storage().resize_(8000)  # and gathers it again
        assert tracker.current_bytes - start == 8000
        tracker.storages.cap_bytes = tracker.current_bytes + 1000
        with pytest.raises(torch.OutOfMemoryError, match="memory cap"):
            weight.untyped_storage().resize_(16000)
        assert weight.untyped_storage().nbytes() == 8000  # refused before the allocator ran
        assert tracker.current_bytes - start == 8000
    assert not isinstance(torch.UntypedStorage.__dict__.get("resize_"), type(lambda: 0))  # hook removed


@pytest.fixture
def one_process_group(tmp_path):
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is already running in this process")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_fsdp2_frees_of_gathered_parameters_are_tracked(one_process_group):
    """FSDP2 gathers a block's parameters for its forward and frees them by resizing storage to 0."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()) for _ in range(3)])
    for block in blocks:
        fully_shard(block)
    fully_shard(blocks)
    block_bytes = (64 * 64 + 64) * 4
    tracker = MemoryTracker("cpu")
    tracker.attach(blocks)
    seen: list[tuple[str, int, int]] = []
    for index, block in enumerate(blocks):
        block[0].register_forward_hook(
            lambda module, args, output, index=index: seen.append(("inside", index, tracker.breakdown()[PARAMETERS]))
        )
        block.register_forward_hook(
            lambda module, args, output, index=index: seen.append(("after", index, tracker.breakdown()[PARAMETERS]))
        )
    with tracker:
        for _ in range(2):  # the first step gathers into fresh storages, the second reuses them
            seen.clear()
            sharded = tracker.breakdown()[PARAMETERS]
            assert sharded == 3 * block_bytes  # one rank holds every shard
            blocks(torch.randn(8, 64)).sum().backward()
            assert seen == [
                entry
                for index in range(3)
                for entry in (("inside", index, sharded + block_bytes), ("after", index, sharded))
            ]
            assert tracker.breakdown()[PARAMETERS] == sharded
        assert tracker.peak_bytes >= sharded + block_bytes


def test_offloaded_copies_count_as_host_memory_not_device():
    leaf = torch.randn(64, 256, requires_grad=True)
    saved_bytes = 64 * 256 * 4

    def offload(tensor):
        with host_allocations():
            return tensor.to("cpu", copy=True)

    for offloaded in (False, True):
        tracker = MemoryTracker("cpu")
        hooks = torch.autograd.graph.saved_tensors_hooks(offload, lambda packed: packed)
        with tracker:
            with tracker.phase("forward"), hooks if offloaded else contextlib.nullcontext():
                out = (leaf.exp() * 2).sum()  # exp saves its output
            after_forward = tracker.breakdown()[ACTIVATIONS], tracker.host_bytes
            with tracker.phase("backward"):
                out.backward()
            memory = tracker.end_step()
        leaf.grad = None
        if offloaded:
            assert after_forward == (0, saved_bytes)  # the copy is host memory, not an activation
            assert memory.host_peak_bytes == tracker.host_peak_bytes == saved_bytes
            assert memory.host_bytes_at_end == 0  # freed with the graph
        else:
            assert after_forward == (saved_bytes, 0)
            assert memory.host_peak_bytes == 0


def test_mark_host_moves_bytes_and_the_cap_counts_device_bytes_only():
    tracker = MemoryTracker("cpu")
    with tracker:
        start = tracker.current_bytes
        tracker.storages.cap_bytes = start + 10_000
        with host_allocations():
            pinned_like = torch.zeros(100_000)  # 400 kB of host memory: far past the cap, still allowed
        assert tracker.host_bytes == 400_000 and tracker.current_bytes == start
        device = torch.zeros(2000)
        assert tracker.current_bytes - start == 8000
        mark_host(device)  # an offloaded copy marked after the fact
        assert tracker.current_bytes == start and tracker.host_bytes == 408_000
        kept = torch.zeros(2000)
        with pytest.raises(torch.OutOfMemoryError, match="memory cap"):
            torch.zeros(1000)  # 8000 + 4000 device bytes pass the 10,000-byte cap
        del pinned_like, device
        assert tracker.host_bytes == 0
        assert tracker.current_bytes - start == 8000
        del kept


def test_a_tensor_brought_back_from_a_host_copy_is_an_activation():
    tracker = MemoryTracker("cpu")
    with tracker:
        with host_allocations():
            offloaded = torch.ones(1000)
        fetched = offloaded.clone()  # what offloading hands back to backward
        assert tracker.breakdown()[ACTIVATIONS] == 4000 and tracker.host_bytes == 4000
        del fetched
        assert tracker.breakdown()[ACTIVATIONS] == 0
        assert (torch.ones(10) + 1).sum().item() == 20  # made from device tensors: not restored
        assert tracker.breakdown()[ACTIVATIONS] == 0
