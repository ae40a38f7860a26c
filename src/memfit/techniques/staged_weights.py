"""Staged loading: frozen weights that a technique shrinks or keeps in host memory reach the device only in
their final form.

A mixture of experts loaded the plain way puts every fused expert stack on the device in the load dtype
before QLoRA quantizes it or `--expert-offload` takes it back to host memory: gpt-oss-20b holds 36 GiB of
bf16 experts for a moment on a GPU its QLoRA step fits in 7 GiB, and the load, not the step, runs out of
memory. So where such a technique is on, the loader leaves the model in host memory
(`memfit.models.loader`, `on_host`) and `stage_on_host` moves everything but the staged weights to the
device, filing those as host memory (`host_memory.mark_host`). Each then meets the technique that takes it:

- QLoRA on the experts (`expert_quant.quantize_experts_module`): one stack at a time is copied to the
  device, quantized there and the copy dropped; under `--expert-offload` too, its NF4 bytes go straight back
  to host memory (the statistics stay), so the NF4 stacks never gather on the device either;
- expert streaming (`expert_streaming.apply_expert_streaming`) keeps them where they are;
- the NF4 head (`nf4_head.quantize_head`) is quantized in host memory and only its packed bytes move;
- the embedding on host (`host_embedding.embedding_to_host`) stays.

`settle_staged` runs after those techniques: whatever is still in host memory without being filed as host
memory on purpose (the adapters PEFT made beside a staged weight, a stack QLoRA kept as loaded, such as
MXFP4 blocks) goes to the device then, and the log line says what did.

Staged only in one process (a sharding engine places the weights itself) and for fused expert stacks (a
list of expert MLPs is quantized by bitsandbytes while loading, as the dense linears are). The device's peak
from the load to the first step is then the trained model's resident bytes plus one expert stack in the load
dtype (prediction/load_peak.py counts it; `memfit estimate` prints it). Costs: the whole model passes
through host memory (the staged weights in their load dtype until the techniques take them), and bitsandbytes
quantizes the dense linears on the host rather than on the GPU.

On a CPU-only machine the device is host memory too: staging marks the staged weights as host memory and the
quantization copies a stack before quantizing it, so the tracker sees what a GPU would hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from memfit.models.experts import EXPERT_PARAMETERS, fused_expert_modules
from memfit.techniques.host_memory import is_host_tensor, mark_host
from memfit.units import format_bytes

STAGED_DEVICE = "memfit_staged_device"
"""Attribute set on a module holding a staged weight: the device its final form is bound for."""
KEEP_ON_HOST = "memfit_staged_keeps_host"
"""Attribute set on a staged experts module whose weights stay in host memory (--expert-offload)."""


@dataclass(frozen=True)
class StagedWeights:
    """Which frozen weights a run loads into host memory first."""

    experts: bool = False
    """The fused expert stacks (QLoRA quantizes them one at a time on the device, or streaming keeps them)."""
    experts_stay_on_host: bool = False
    """--expert-offload: the experts' final home is host memory (their NF4 bytes too, under QLoRA)."""
    embedding: bool = False
    """--embedding-on-host: the input embedding never goes to the device."""
    head: bool = False
    """--quantize-head: the output head is quantized in host memory, only its NF4 bytes move."""

    @property
    def any(self) -> bool:
        return self.experts or self.embedding or self.head

    def describe(self) -> str:
        parts = [name for name, on in (("expert stacks", self.experts), ("input embedding", self.embedding),
                                       ("output head", self.head)) if on]
        return ", ".join(parts) or "nothing"


def staging_for_run(run, hf_config, world_size: int) -> StagedWeights:
    """`staging_for` of a resolved run (techniques/resolved_run.py) and the model's transformers config."""
    from memfit.models.experts import moe_shape

    return staging_for(is_moe=moe_shape(hf_config) is not None, **run_settings(run, world_size))


def run_settings(run, world_size: int) -> dict:
    """What `staging_for` reads of a resolved run (all but whether the model is a mixture of experts)."""
    return dict(lora_r=run.lora_r, quantize=run.quantize, expert_offload=run.expert_offload,
                embedding_on_host=run.embedding_on_host, quantize_head=run.quantize_head, world_size=world_size)


def staging_for(*, is_moe: bool, lora_r: int, quantize: str, expert_offload: bool, embedding_on_host: bool,
                quantize_head: bool, world_size: int) -> StagedWeights:
    """What a run stages (one rule for the loader and the estimate): a mixture of experts under LoRA in one
    process, whose experts QLoRA (4-bit) quantizes or `--expert-offload` streams. 8-bit QLoRA keeps the
    experts in the load dtype on the device and loads as before: bitsandbytes' 8-bit weights cannot be
    moved to the GPU once quantized in host memory."""
    if not is_moe or lora_r <= 0 or world_size != 1 or quantize not in ("none", "4bit"):
        return StagedWeights()
    if quantize != "4bit" and not expert_offload:
        return StagedWeights()
    return StagedWeights(experts=True, experts_stay_on_host=expert_offload, embedding=embedding_on_host,
                         head=quantize_head and quantize == "4bit")


def _staged_parameters(model: nn.Module, staged: StagedWeights) -> list[tuple[nn.Module, str]]:
    """(module, parameter name) of each weight `staged` keeps in host memory."""
    found = []
    if staged.experts:
        for _, experts in fused_expert_modules(model):
            found += [(experts, name) for name in EXPERT_PARAMETERS
                      if isinstance(experts._parameters.get(name), nn.Parameter)
                      and experts._parameters[name].dim() == 3 and experts._parameters[name].is_floating_point()]
    for wanted, getter in ((staged.embedding, "get_input_embeddings"), (staged.head, "get_output_embeddings")):
        module = getattr(model, getter)() if wanted and hasattr(model, getter) else None
        if module is not None and isinstance(module._parameters.get("weight"), nn.Parameter):
            found.append((module, "weight"))
    embedding, head = (getattr(model, g)() if hasattr(model, g) else None
                       for g in ("get_input_embeddings", "get_output_embeddings"))
    if embedding is not None and head is not None and embedding.weight is head.weight:  # tied: one table, on the device
        found = [(m, n) for m, n in found if m is not embedding and m is not head]
    return found


def stage_on_host(model: nn.Module, device: torch.device, staged: StagedWeights) -> str:
    """Move `model` (loaded in host memory) to `device` but for its staged weights, filed as host memory.

    Returns one line for the log. Call right after loading, before any technique changes the model.
    """
    held = []
    for module, name in _staged_parameters(model, staged):
        held.append((module, name, module._parameters.pop(name)))  # out of the move below
    try:
        model.to(device)
        if getattr(model, "hf_device_map", None) is not None:  # bitsandbytes loaded it with device_map {"": "cpu"}
            model.hf_device_map = {"": str(device)}
    finally:
        for module, name, parameter in held:
            module._parameters[name] = parameter
    staged_bytes = 0
    for module, name, parameter in held:
        mark_host(parameter)
        staged_bytes += parameter.nbytes
        setattr(module, STAGED_DEVICE, torch.device(device))
        setattr(module, KEEP_ON_HOST, staged.experts_stay_on_host and name in EXPERT_PARAMETERS)
    model.memfit_staged_load = {"weights": staged.describe(), "tensors": len(held), "host_bytes": staged_bytes,
                                "device": str(device)}
    return (f"staged load: {staged.describe()} ({format_bytes(staged_bytes)} in {len(held)} weights) held in"
            f" host memory, the rest on {device}; each reaches the device in its final form only")


def staged_load_facts(model: nn.Module) -> dict | None:
    """For the metrics: what a staged load held in host memory (weights, tensors, bytes, device); None when off."""
    facts = getattr(model, "memfit_staged_load", None)  # PEFT's wrappers pass attribute reads to the base model
    return dict(facts) if isinstance(facts, dict) else None


def staged_device(module: nn.Module) -> torch.device | None:
    """The device a staged weight of `module` is bound for, or None when `module` holds none."""
    return getattr(module, STAGED_DEVICE, None)


def keeps_on_host(module: nn.Module) -> bool:
    """Whether the staged weights of `module` stay in host memory (streamed experts)."""
    return bool(getattr(module, KEEP_ON_HOST, False))


def device_copy(weight: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A copy of a staged host weight on `device`, to quantize there (a new storage even on a CPU: the device's)."""
    return weight.detach().to(device, copy=True)


def settle_staged(model: nn.Module) -> str | None:
    """Move to the staged device what staging left in host memory that no technique took; a line for the log,
    or None (nothing was staged, or the techniques took it all).

    Weights filed as host memory on purpose (streamed experts, the embedding on host) stay. On a CPU-only run
    the device is host memory: a staged weight no technique took is filed as device memory again.
    """
    device = next((staged_device(m) for m in model.modules() if staged_device(m) is not None), None)
    if device is None:
        return None
    moved, count = 0, 0
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, tensor in list(table.items()):
                if tensor is None or tensor.is_meta:
                    continue
                on_host = tensor.device.type == "cpu"
                take = device.type != "cpu" and on_host and not is_host_tensor(tensor)
                # on a CPU the device is host memory: a staged weight nothing took is filed as device memory again
                take = take or (device.type == "cpu" and staged_device(module) is not None
                                and is_host_tensor(tensor) and not keeps_on_host(module)
                                and not getattr(module, "memfit_on_host", False))
                if take:
                    _move(table, name, tensor, device)
                    moved += tensor.nbytes
                    count += 1
        if staged_device(module) is not None:
            delattr(module, STAGED_DEVICE)
    if not count:
        return None
    return f"staged load: {count} tensors ({format_bytes(moved)}) no technique took moved to {device}"


def _move(table: dict, name: str, tensor: torch.Tensor, device: torch.device) -> None:
    """Put `tensor` on `device` in place: a parameter keeps its identity (its data changes, as `Module.to` does),
    an NF4 weight its QuantState (`Params4bit.to` moves it along)."""
    new = tensor.data.clone() if device.type == "cpu" else tensor.to(device)  # on a CPU: a new, device-filed storage
    if isinstance(tensor, nn.Parameter):
        tensor.data = new
    else:
        table[name] = new


def _apply(model: nn.Module, run, context):
    from memfit.techniques.technique import Applied

    settled = settle_staged(model)  # what a staged load left in host memory and no technique took
    return Applied(settled or "")


def _technique():
    from memfit.techniques.technique import Technique

    return Technique(
        name="staged_weights", after=("lora", "expert_offload", "nf4_head", "embedding_on_host",
                                      "expert_dequant_group"), apply=_apply,
        summary="a mixture of experts loads in host memory first; what no technique keeps there then moves",
    )


TECHNIQUE = _technique()
