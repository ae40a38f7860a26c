"""Expert streaming: frozen MoE expert weights live in host memory and come to the device one layer at a time.

Flag: `--expert-offload`. Under LoRA a mixture of experts' routed experts are frozen and hold most of its
bytes (Qwen3-30B-A3B: 29 of 30.5B parameters, 54 GiB in bf16). A frozen expert weight is read only while its
layer runs: in forward, and again when checkpointing recomputes the block in backward. So each MoE layer's
frozen expert weights (fused 3-D stacks `experts.gate_up_proj` / `experts.down_proj`, or the linears of a
list of expert MLPs; bf16 or NF4) are kept in host memory (pinned on CUDA) and each call of the layer's
experts copies them to the device first and lets the copy go after. On CUDA the next layer's copy starts on
a side stream while this layer computes (forward: the layer after; the recompute in backward: the one before),
so the device holds two layers' worth: the running one and the prefetched one. On a CPU-only machine the
host weights are filed as host memory (`host_memory.mark_host`) and each call makes a device copy, so the
tracker shows what a GPU would hold.

Saves: every streamed expert byte but two layers' worth. Costs: the streamed bytes cross the host link
twice a micro-batch (forward and the recompute), hidden under compute when the link is fast enough; pinned
host memory of the experts' size. Tiled experts call a layer's experts once a tile; they hold the layer on the
device for all their tiles (`HOLD_ATTRIBUTE`), so a micro-batch copies it three times (forward, the recompute,
and the tiled backward), not twice a tile.

What stays on the device: the adapters on the experts (split LoRA's A and B, trainable), NF4's quantization
statistics (small), the routers, shared experts and everything outside the experts.

Why a wrapper of the experts call rather than module hooks: tiled experts recompute the call from inside
their backward (no module hooks run there), and checkpointing's recompute stops early by raising once it has
what backward needs (a post-forward hook would not run). The wrapper brings the weights before the call and
lets them go in a `finally`. Autograd keeps the device copy only as long as something saved for backward
reads it: under checkpointing (non-reentrant, every MoE block) the forward saves nothing inside the block,
and the recompute's saved copy lives until that block's backward is done. Without checkpointing, every
layer's copy would stay saved until backward, so that is refused.

Refused in one line: trainable expert weights (a full fine-tune of the experts), an MoE block that is not
checkpointed, --compile (the compiled block would capture the swapped weights).
"""

from __future__ import annotations

import contextlib
import logging
import types
from dataclasses import dataclass, field

import torch
from torch import nn

from memfit.errors import UsageError
from memfit.models.experts import is_fused_experts
from memfit.techniques.host_memory import host_allocations, is_host_tensor, mark_host
from memfit.techniques.staged_weights import staged_device
from memfit.units import format_bytes

log = logging.getLogger("memfit")

STREAMER_ATTRIBUTE = "memfit_expert_streamer"
HOLD_ATTRIBUTE = "memfit_stream_hold"
"""On a streamed experts module: a context manager that keeps its layer on the device across several calls (the
tiles of tiled experts, techniques/tiled_experts.py), so the layer crosses the link once, not once a tile."""
"""Set on the model: the `ExpertStreamer` running its experts (read by the run facts)."""
_PREVIOUS = "_memfit_unstreamed_forward"


@dataclass
class StreamedLayer:
    """One MoE layer: the module whose call streams (the experts call, or the MoE block for expert lists)."""

    index: int
    name: str
    target: nn.Module
    weights: list[tuple[nn.Module, str, nn.Parameter]] = field(default_factory=list)
    """(owning module, parameter name, the host copy) of each frozen expert weight."""

    @property
    def nbytes(self) -> int:
        return sum(host.nbytes for _, _, host in self.weights)


def _is_adapter(name: str) -> bool:
    return any(part.startswith("lora_") for part in name.split("."))


def _unwrap(called: nn.Module) -> nn.Module:
    inner = called
    while not is_fused_experts(inner) and isinstance(getattr(inner, "base_layer", None), nn.Module):
        inner = inner.base_layer  # PEFT nests one ParamWrapper per adapted parameter
    return inner


def find_expert_layers(model: nn.Module) -> list[StreamedLayer]:
    """Each MoE layer in model order: the fused experts call, or the block holding a list of expert MLPs."""
    layers = []
    for name, module in model.named_modules():
        called = module._modules.get("experts")
        if called is None:
            continue
        if is_fused_experts(_unwrap(called)):
            layers.append(StreamedLayer(len(layers), f"{name}.experts", called))
        elif isinstance(called, nn.ModuleList) and len(called) > 1:
            # a list has no forward of its own: the block that indexes it is what runs its experts
            layers.append(StreamedLayer(len(layers), name, module))
    return layers


def _frozen_weights(layer: StreamedLayer) -> list[tuple[str, nn.Module, str, nn.Parameter]]:
    experts = layer.target if is_fused_experts(_unwrap(layer.target)) else layer.target._modules["experts"]
    found = []
    for module_name, module in experts.named_modules():
        for name, parameter in module._parameters.items():
            full = f"{module_name}.{name}" if module_name else name
            if parameter is None or _is_adapter(full):
                continue  # adapters train and stay on the device
            if parameter.requires_grad:
                raise UsageError(
                    f"--expert-offload streams frozen expert weights only; {layer.name}.{full} trains in full."
                    " Use --lora-r with the experts frozen, or drop --expert-offload")
            found.append((full, module, name, parameter))
    return found


def _like(host: nn.Parameter, data: torch.Tensor) -> nn.Parameter:
    """A parameter of `data` standing for `host` (an NF4 weight keeps its quantization state, on the device)."""
    if type(host).__name__ == "Params4bit":
        from bitsandbytes.nn import Params4bit

        return Params4bit(data, requires_grad=False, quant_state=host.quant_state, blocksize=host.blocksize,
                          compress_statistics=host.compress_statistics, quant_type=host.quant_type,
                          quant_storage=host.quant_storage, bnb_quantized=True, module=getattr(host, "module", None))
    return nn.Parameter(data, requires_grad=False)


def host_parameter(parameter: nn.Parameter, pin: bool) -> nn.Parameter:
    """`parameter`'s weights in host memory, filed as host memory (pinned with `pin`); an NF4 weight keeps its
    statistics on the device. A parameter a staged load left there already (techniques/staged_weights.py) is kept."""
    if parameter.device.type == "cpu" and is_host_tensor(parameter) and (parameter.is_pinned() or not pin):
        return parameter
    with host_allocations():  # filed as host memory the moment it exists
        data = parameter.data.to("cpu", copy=True)
        if pin:
            data = data.pin_memory()
    mark_host(data)
    state = getattr(parameter, "quant_state", None)
    if state is not None and parameter.device.type != "cpu":
        state.to(parameter.device)  # the statistics (about 3% of an NF4 stack) stay on the device
    return _like(parameter, data)


class ExpertStreamer:
    """Brings each layer's frozen expert weights to the device for its call, the next layer's ahead on CUDA."""

    def __init__(self, layers: list[StreamedLayer], device: torch.device) -> None:
        self.layers, self.device = layers, device
        self.side = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.prefetched: tuple[int, list[torch.Tensor], torch.cuda.Event] | None = None
        self.streamed_bytes = 0
        """Bytes copied host -> device so far (every call: forward, recompute, evaluation)."""

    @property
    def host_bytes(self) -> int:
        return sum(layer.nbytes for layer in self.layers)

    def _copy(self, layer: StreamedLayer) -> list[torch.Tensor]:
        self.streamed_bytes += layer.nbytes
        if self.device.type == "cpu":
            return [host.data.clone() for _, _, host in layer.weights]  # a device copy the tracker counts
        return [host.data.to(self.device, non_blocking=True) for _, _, host in layer.weights]

    def bring(self, index: int, backward: bool) -> None:
        layer = self.layers[index]
        copies = None
        if self.prefetched is not None:
            ahead, tensors, ready = self.prefetched
            self.prefetched = None
            if ahead == index:
                torch.cuda.current_stream(self.device).wait_event(ready)
                for tensor in tensors:  # made on the side stream, used and freed on this one
                    tensor.record_stream(torch.cuda.current_stream(self.device))
                copies = tensors
        if copies is None:
            copies = self._copy(layer)
        for (module, name, host), data in zip(layer.weights, copies, strict=True):
            module._parameters[name] = _like(host, data)
        if self.side is not None:
            following = index - 1 if backward else index + 1
            if 0 <= following < len(self.layers):
                self.side.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(self.side):
                    tensors = self._copy(self.layers[following])
                    ready = torch.cuda.Event()
                    ready.record(self.side)
                self.prefetched = (following, tensors, ready)

    def drop(self, index: int) -> None:
        """Put the host copies back; the device copy is freed once nothing saved for backward reads it."""
        for module, name, host in self.layers[index].weights:
            module._parameters[name] = host


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def _install(streamer: ExpertStreamer, layer: StreamedLayer) -> None:
    target = layer.target
    previous = target.__dict__.get("forward")  # split LoRA's or NF4's forward on the instance, or the class's
    holding = [0]  # calls inside `hold` find the layer already on the device

    def forward(self, *args, _index=layer.index, _previous=previous, **kwargs):
        call = _previous or type(self).forward.__get__(self)
        if holding[0]:
            return call(*args, **kwargs)
        streamer.bring(_index, backward=_in_backward())
        try:
            return call(*args, **kwargs)
        finally:
            streamer.drop(_index)

    @contextlib.contextmanager
    def hold(_index=layer.index):
        """The layer's experts on the device for every call inside (tiled experts: all tiles, one copy)."""
        if holding[0]:
            holding[0] += 1
        else:
            streamer.bring(_index, backward=_in_backward())
            holding[0] = 1
        try:
            yield
        finally:
            holding[0] -= 1
            if not holding[0]:
                streamer.drop(_index)

    target.__dict__[_PREVIOUS] = previous
    target.forward = types.MethodType(forward, target)
    setattr(target, HOLD_ATTRIBUTE, hold)


def _checkpointed(model: nn.Module, layers: list[StreamedLayer]) -> list[str]:
    """Names of the MoE layers outside a checkpointed block (their streamed copies would stay saved)."""
    from memfit.techniques.checkpointing import CheckpointedBlock, transformer_blocks

    blocks = transformer_blocks(model)
    checkpointed = [b for b in blocks if isinstance(b, CheckpointedBlock) or getattr(b, "gradient_checkpointing", False)]
    inside = {id(m) for block in checkpointed for m in block.modules()}
    return [layer.name for layer in layers if id(layer.target) not in inside]


def apply_expert_streaming(model: nn.Module) -> str:
    """Move every MoE layer's frozen expert weights to host memory and stream them per call; one line for the log.

    Call after LoRA (split LoRA and NF4 experts in place) and checkpointing, before tiled experts.
    Raises UsageError for trainable experts, a model without experts, or an MoE layer outside checkpointing.
    """
    layers = find_expert_layers(model)
    if not layers:
        raise UsageError(f"--expert-offload: {type(model).__name__} has no mixture-of-experts layers; drop --expert-offload")
    found = [_frozen_weights(layer) for layer in layers]  # every refusal before anything moves
    outside = _checkpointed(model, layers)
    if outside:
        raise UsageError(f"--expert-offload: {len(outside)} MoE layer(s) ({outside[0]}...) are not checkpointed; use"
                         " --gradient-checkpointing full with --checkpoint-every 1 so each layer's experts are"
                         " brought again in backward")
    device = found[0][0][3].device if found[0] else torch.device("cpu")
    staged = [staged_device(module) for weights in found for _, module, _, _ in weights if staged_device(module)]
    device = staged[0] if staged else device  # a staged load: the experts never left host memory
    streamer = ExpertStreamer(layers, device)
    for layer, weights in zip(layers, found, strict=True):
        for _, module, name, parameter in weights:
            host = host_parameter(parameter, pin=device.type == "cuda")
            module._parameters[name] = host  # the device weight goes now: one weight extra at a time
            layer.weights.append((module, name, host))
        _install(streamer, layer)
    setattr(model, STREAMER_ATTRIBUTE, streamer)
    per_layer = max(layer.nbytes for layer in layers)
    return (f"{format_bytes(streamer.host_bytes)} of frozen experts in {len(layers)} MoE layers kept in host memory"
            f"{' (pinned)' if device.type == 'cuda' else ''}, streamed per layer ({format_bytes(per_layer)} each,"
            f" {format_bytes(2 * streamer.host_bytes)} a micro-batch: forward and recompute"
            f"{'; the next layer prefetched on a side stream' if device.type == 'cuda' else ''})")


def expert_streaming_facts(model: nn.Module) -> dict | None:
    """For the metrics: host bytes of the streamed experts, bytes streamed per micro-batch and so far; None when off."""
    streamer = getattr(model, STREAMER_ATTRIBUTE, None)
    if streamer is None:
        base = getattr(model, "get_base_model", None)
        streamer = getattr(base(), STREAMER_ATTRIBUTE, None) if base else None
    if streamer is None:
        return None
    return {"layers": len(streamer.layers), "host_bytes": streamer.host_bytes,
            "bytes_per_micro_batch": 2 * streamer.host_bytes, "streamed_bytes": streamer.streamed_bytes}


def _speed_terms(run, facts) -> float:
    """The frozen experts cross the host link a layer at a time, beside the compute: what the forward and recompute
    passes cannot hide is added."""
    if not run.expert_offload:
        return 0.0
    moved = facts.accumulation * facts.expert_stream_bytes
    return max(0.0, moved / facts.link_bytes_per_second - facts.overlap_seconds)


def _technique():
    from memfit.techniques.technique import Technique, apply_when_on, report_when_on

    return Technique(
        name="expert_offload", settings=("expert_offload",), after=("lora",), speed_terms=_speed_terms,
        resolve=lambda facts, run: {"expert_offload": facts.config.memory.expert_offload},
        # frozen experts in host memory, brought per layer (before tiled experts wrap them)
        apply=apply_when_on("expert_offload", "expert offload", apply_expert_streaming),
        report=report_when_on("expert_offload"),
        summary="a mixture of experts' frozen expert weights stay in host memory, brought one layer at a time",
    )


TECHNIQUE = _technique()
