"""Prepare the next micro-batch while the current one computes.

    prefetcher = BatchPrefetcher(collate_fn, device)
    batch = prefetcher.take(piece)            # the prepared batch, or collated and copied now
    ... launch the forward of `batch` ...
    prefetcher.prepare(next_piece)            # collate + copy overlap with the current compute
    ... backward ...

On CUDA the next batch is collated on the host, pinned and copied with `non_blocking=True`
on a side stream while the GPU still runs the current forward and backward (the host
returns from launching kernels long before they finish); `take` makes the compute stream
wait for the copy and marks the tensors as used by it, so the allocator does not reuse
their memory early. On a CPU there is nothing to overlap: the same calls collate and keep
the batch (no copy, no pinning), so the code path is the same and is tested on CPU.

A prepared batch is used only by a `take` of the very same samples: when out-of-memory
recovery re-splits the micro-batches, the stale batch is dropped and the new piece is
collated on the spot.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

Batch = dict[str, torch.Tensor]


def _key(samples: Sequence[dict]) -> tuple[int, ...]:
    # Samples are the dataset's own dicts, alive for the whole step: their ids name a piece.
    return tuple(id(sample) for sample in samples)


class BatchPrefetcher:
    """Collates and copies one micro-batch ahead of the one that computes.

    Args:
        collate: samples -> {name: CPU tensor}.
        device: where the batch goes.
        pin: pin the host tensors before the copy (default: on CUDA), which lets the copy
            run asynchronously.
        drop_full_attention_mask: leave out an attention mask without padding, checked on
            the host before the copy (no device sync), so SDPA takes its causal fast path;
            and the mask of packed rows, whose position_ids say where each sample is.
    """

    def __init__(self, collate: Callable[[Sequence[dict]], Batch], device: torch.device, pin: bool | None = None,
                 drop_full_attention_mask: bool = False):
        self.collate = _without_full_mask(collate) if drop_full_attention_mask else collate
        self.device = torch.device(device)
        self.on_cuda = self.device.type == "cuda"
        self.pin = self.on_cuda if pin is None else pin
        self.stream = torch.cuda.Stream(self.device) if self.on_cuda else None
        self._ready: tuple[tuple[int, ...], Batch] | None = None
        self.prefetched = 0
        """Batches handed out that had been prepared ahead (for tests and metrics)."""
        self.collated_on_demand = 0
        """Batches that had to be collated when they were needed (first piece, re-split pieces)."""

    def prepare(self, samples: Sequence[dict]) -> None:
        """Start collating and copying `samples`; returns before the copy ends on CUDA."""
        if not samples:
            return
        self._ready = (_key(samples), self._load(samples))

    def take(self, samples: Sequence[dict]) -> Batch:
        """The batch of `samples` on the device: the prepared one when it matches, else made now."""
        ready, self._ready = self._ready, None
        if ready is not None and ready[0] == _key(samples):
            self.prefetched += 1
            batch = ready[1]
            if self.stream is not None:
                current = torch.cuda.current_stream(self.device)
                current.wait_stream(self.stream)
                for tensor in batch.values():
                    tensor.record_stream(current)  # memory made on the side stream, used on this one
            return batch
        self.collated_on_demand += 1
        host = self.collate(samples)
        return {name: tensor.to(self.device, non_blocking=True) for name, tensor in host.items()}

    def _load(self, samples: Sequence[dict]) -> Batch:
        host = self.collate(samples)
        if self.pin:
            host = {name: tensor.pin_memory() for name, tensor in host.items()}
        if self.stream is None:
            return {name: tensor.to(self.device) for name, tensor in host.items()}
        with torch.cuda.stream(self.stream):
            return {name: tensor.to(self.device, non_blocking=True) for name, tensor in host.items()}


def _without_full_mask(collate: Callable[[Sequence[dict]], Batch]) -> Callable[[Sequence[dict]], Batch]:
    def collate_without_full_mask(samples: Sequence[dict]) -> Batch:
        batch = collate(samples)
        mask = batch.get("attention_mask")
        # Packed rows: transformers finds sample boundaries from position_ids only when no mask is given;
        # padding has positions 0, 0, ... and so stays out of every sample (memfit.data.collate).
        if mask is not None and ("position_ids" in batch or bool(mask.all())):
            batch = {name: tensor for name, tensor in batch.items() if name != "attention_mask"}
        return batch

    return collate_without_full_mask
