"""A frozen reference copy kept in host memory and brought to the device one block at a time.

Flag: `--reference host-copy` (--task dpo and kto, and grpo with --beta > 0). `--reference copy` keeps a whole frozen
copy of the model on the device: the model's bytes once more for a forward that trains nothing. Here the copy's
weights live in host memory (pinned on CUDA), and the reference's no-grad forward brings each unit's weights to the
device just before the unit runs and lets them go just after: the input embedding, each decoder block, the final
norm (any module with weights of its own outside the blocks), and the output head. On CUDA the next unit's copy is
issued on a side stream while the current one computes (techniques/expert_streaming.py's `ExpertStreamer` does the
copies and the prefetch), so the device holds two units' weights at most; on a CPU-only machine the same code runs
synchronously, the host copy is filed as host memory (techniques/host_memory.py) and each unit's device copy is a
fresh tensor, so the tracker and --memory-cap see what a GPU would hold: one unit.

The head runs once a chunk of log-probabilities (techniques/sequence_logprobs.py): it is brought once, at its first
chunk, and kept until the pass ends (`reference_pass`), not copied once a chunk.

Saves: the copy's bytes on the device but the largest unit (two with the prefetch). Costs: the copy's bytes in host
memory (pinned on CUDA) and the copy's bytes over the host link every reference pass (one a micro-batch for DPO and
KTO, one a rollout for GRPO), hidden behind the blocks' compute where the link is fast enough. The numbers are those
of `--reference copy`: the same weights, the same kernels.

Runs under `torch.no_grad()` only (the reference never trains; a forward with a graph would keep every unit's
device copy saved for backward). Refused under --sharding fsdp and ZeRO-3, whose engines shard the loaded model
(`host_copy_problem`).
"""

from __future__ import annotations

import contextlib
import copy
import json
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from memfit.techniques.checkpointing import transformer_blocks
from memfit.techniques.expert_streaming import ExpertStreamer, StreamedLayer, host_parameter
from memfit.techniques.loss import unwrap_causal_lm
from memfit.units import format_bytes

HOST_COPY = "host-copy"
STREAMED_ATTRIBUTE = "memfit_streamed_reference"
"""Set on the streamed copy: its `StreamedReference` (read by `reference_pass`)."""
_PREVIOUS = "_memfit_unstreamed_forward"


@dataclass
class StreamedReference:
    """The streamed copy's units, where they are, and what its passes cost so far."""

    streamer: ExpertStreamer
    """Brings a unit's weights to the device (the next one ahead on CUDA) and puts the host copies back."""
    head_index: int
    """The output head's unit: kept on the device from its first chunk to the end of the pass."""
    resident_bytes: int
    """The copy's buffers (rotary frequencies and the like), left on the device: small."""
    held: int | None = None
    """The unit kept on the device across calls now (the head during its chunks), else None."""
    seconds: float = 0.0
    """Wall seconds of the streamed passes so far (CUDA: between events on the compute stream)."""
    passes: int = 0
    """Streamed passes so far (one a reference call: a micro-batch's, or a rollout's)."""
    steps: set[int] = field(default_factory=set)
    """Training steps whose samples were prepared so far (`note_step`): the passes' time is divided by them."""
    _timings: list[tuple[Any, Any]] = field(default_factory=list)
    """CUDA: (start, end) events of passes not read yet; read when the facts are asked for, not in the step."""

    @property
    def host_bytes(self) -> int:
        """Bytes of the copy's weights in host memory (a weight tied to another counted once)."""
        seen: dict[int, int] = {}
        for layer in self.streamer.layers:
            for _, _, host in layer.weights:
                seen[id(host)] = host.nbytes
        return sum(seen.values())

    @property
    def device_peak_bytes(self) -> int:
        """The most weight bytes on the device at once: the largest unit, or two in a row where the next is
        prefetched (CUDA), plus the resident buffers."""
        sizes = [layer.nbytes for layer in self.streamer.layers]
        peak = max(sizes, default=0)
        if self.streamer.side is not None:
            peak = max([peak, *(a + b for a, b in zip(sizes, sizes[1:], strict=False))])
        return peak + self.resident_bytes

    def release(self) -> None:
        """Put back the unit held across calls (the head), at the end of a pass or before another unit comes."""
        if self.held is not None:
            held, self.held = self.held, None
            self.streamer.drop(held)

    def facts(self) -> dict[str, Any]:
        """For the metrics' reference record: host and device bytes, the units, the passes' time so far."""
        self._settle()
        per_pass = self.seconds / self.passes if self.passes else 0.0
        per_step = self.seconds / len(self.steps) if self.steps else 0.0
        return {"host_bytes": self.host_bytes, "device_peak_bytes": self.device_peak_bytes,
                "units": len(self.streamer.layers), "prefetch": self.streamer.side is not None,
                "pinned": self.streamer.side is not None, "passes": self.passes,
                "seconds": round(self.seconds, 4), "seconds_per_pass": round(per_pass, 5),
                "seconds_per_step": round(per_step, 5),
                "streamed_bytes": self.streamer.streamed_bytes}

    def describe(self) -> str:
        """The cost in words, for the log line."""
        ahead = "; the next unit prefetched on a side stream" if self.streamer.side is not None else ""
        timing = f"; {self.seconds / self.passes:.3f} s a streamed pass so far" if self.passes else ""
        if self.passes and self.steps:
            timing += f" ({self.seconds / len(self.steps):.3f} s a step)"
        return (f"{format_bytes(self.host_bytes)} frozen copy in host memory"
                f"{' (pinned)' if self.streamer.side is not None else ''}, {len(self.streamer.layers)} units brought"
                f" one at a time: {format_bytes(self.device_peak_bytes)} of its weights on the device at the peak"
                f"{ahead}; every unit crosses the host link once a reference pass{timing}")

    def _settle(self) -> None:
        for start, end in self._timings:
            end.synchronize()
            self.seconds += start.elapsed_time(end) / 1000
        self._timings.clear()


def host_copy_problem(distributed: Any) -> str:
    """Why `--reference host-copy` cannot run under these distributed settings, in one line, or ''."""
    if distributed.sharding == "fsdp":
        engine = "--sharding fsdp"
    elif distributed.zero_stage == 3 or (distributed.zero_stage is None and _file_stage(distributed.deepspeed) == 3):
        engine = "DeepSpeed ZeRO-3"
    else:
        return ""
    return (f"--reference host-copy streams a whole copy of the loaded model, which {engine} shards: use --reference"
            " copy (sharded like the policy there) or cached (no copy, computed before training)")


def _file_stage(path: str | None) -> int | None:
    """The ZeRO stage a DeepSpeed config file names, None without a file or a readable stage."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            return int(json.load(handle).get("zero_optimization", {}).get("stage", 0))
    except (OSError, ValueError, TypeError, AttributeError):
        return None  # the engine reports an unreadable file itself


def streamed_copy(model: nn.Module) -> tuple[nn.Module, StreamedReference]:
    """A frozen copy of `model` (eval mode, no gradients) whose weights live in host memory and reach the device one
    unit at a time when it runs (module docstring), with its `StreamedReference`.

    The device copy of the weights is never made whole: each weight goes straight from `model` to host memory.
    """
    device = next(model.parameters()).device
    pinned = device.type == "cuda"
    memo: dict[int, Any] = {}
    for parameter in model.parameters():  # tied weights: one host copy, shared as in the model
        if id(parameter) not in memo:
            host = host_parameter(parameter, pin=pinned)
            if host is parameter:  # a staged load left it in host memory: the copy still needs its own
                host = nn.Parameter(parameter.detach().clone(), requires_grad=False)
            memo[id(parameter)] = host
    reference = copy.deepcopy(model, memo).requires_grad_(False).eval()
    layers = _units(reference)
    streamer = ExpertStreamer(layers, device)
    resident = sum(buffer.nbytes for buffer in reference.buffers())
    stream = StreamedReference(streamer, len(layers) - 1, resident)
    for layer in layers:
        _install(stream, layer)
    setattr(reference, STREAMED_ATTRIBUTE, stream)
    return reference, stream


def _units(reference: nn.Module) -> list[StreamedLayer]:
    """The streamed units in the order a forward runs them: the input embedding, each block, every other module
    with weights of its own outside them (the final norm), and the output head last."""
    lm = unwrap_causal_lm(reference)
    head = lm.get_output_embeddings()
    whole = [lm.get_input_embeddings(), *transformer_blocks(lm)]
    inside = {id(m) for unit in [*whole, head] if unit is not None for m in unit.modules()}
    for module in lm.modules():
        if id(module) not in inside and any(p is not None for p in module._parameters.values()):
            whole.append(module)
            inside.update(id(m) for m in module.modules())
    if head is not None:
        whole.append(head)
    layers = []
    for index, unit in enumerate(whole):
        layer = StreamedLayer(index, type(unit).__name__, unit)
        for owner in unit.modules():
            layer.weights += [(owner, name, parameter) for name, parameter in owner._parameters.items()
                              if parameter is not None]
        layers.append(layer)
    return layers


def _install(stream: StreamedReference, layer: StreamedLayer) -> None:
    """Wrap `layer`'s forward: its weights come to the device before it runs and go back after (the head: when the
    pass ends)."""
    target = layer.target
    previous = target.__dict__.get("forward")
    held_across_calls = layer.index == stream.head_index

    def forward(self, *args, _index=layer.index, _previous=previous, **kwargs):
        call = _previous or type(self).forward.__get__(self)
        if torch.is_grad_enabled():
            raise RuntimeError("the host-copy reference runs under torch.no_grad() only: it never trains")
        if stream.held == _index:
            return call(*args, **kwargs)
        stream.release()
        stream.streamer.bring(_index, backward=False)
        if held_across_calls:
            stream.held = _index
            return call(*args, **kwargs)
        try:
            return call(*args, **kwargs)
        finally:
            stream.streamer.drop(_index)

    target.__dict__[_PREVIOUS] = previous
    target.forward = types.MethodType(forward, target)


def streamed(reference: nn.Module | None) -> StreamedReference | None:
    """The `StreamedReference` of a streamed copy, None for any other module."""
    return getattr(reference, STREAMED_ATTRIBUTE, None) if reference is not None else None


def _free_gathered_root(reference: nn.Module | None) -> None:
    """A copy sharded by FSDP2 (distributed/reference_shards.py) keeps its root unit (embeddings, final norm, head)
    gathered after its forward, for the head's chunks that run after it: freed once the pass is done."""
    reshard = getattr(reference, "reshard", None)  # FSDPModule.reshard; a plain module has none
    if callable(reshard):
        reshard()


def note_step(reference: nn.Module | None, step: int) -> None:
    """Count training step `step` (not an evaluation's, which is negative) for a streamed copy's time a step."""
    stream = streamed(reference)
    if stream is not None and step >= 0:
        stream.steps.add(step)


@contextlib.contextmanager
def reference_pass(reference: nn.Module | None) -> Iterator[None]:
    """Around one reference call: for a streamed copy, time it and put back the head at its end; for a copy sharded
    by FSDP2, free its gathered root unit at its end; else nothing."""
    stream = streamed(reference)
    if stream is None:
        try:
            yield
        finally:
            _free_gathered_root(reference)
        return
    device = stream.streamer.device
    events = None
    if device.type == "cuda":
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record()
    started = time.perf_counter()
    try:
        yield
    finally:
        stream.release()
        stream.passes += 1
        if events is not None:
            events[1].record()
            stream._timings.append(events)
        else:
            stream.seconds += time.perf_counter() - started
