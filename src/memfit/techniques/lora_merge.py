"""Merging LoRA adapters into a plain Hugging Face model (`--merge`, `memfit merge`): adapters folded into the
weights, quantized weights (bitsandbytes linears, NF4 experts) dequantized, written with save_pretrained."""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from torch import nn

from memfit.checkpoint_files.pretrained import save_pretrained
from memfit.techniques.expert_quant import cpu_weight


def merge_and_save(model: nn.Module, directory: str | Path, dtype: torch.dtype | None = None) -> Path:
    """Write a plain Hugging Face model with the adapters folded into the weights.

    The live model is not changed. A quantized base is dequantized first; `dtype`
    (default: the base's configured dtype, else fp32) is the dtype of the weights
    written. Memory: one full-precision copy of the model on the CPU while writing.
    """
    from transformers import AutoModelForCausalLM

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = copy.deepcopy(base.config)
    for attribute in ("quantization_config", "_pre_quantization_dtype"):
        if hasattr(config, attribute):
            delattr(config, attribute)
    if dtype is None:
        configured = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        dtype = configured if isinstance(configured, torch.dtype) and configured.is_floating_point else torch.float32
    state = merged_state_dict(base, dtype)
    with torch.device("meta"):
        merged = AutoModelForCausalLM.from_config(config, dtype=dtype)
    merged.load_state_dict(state, strict=False, assign=True)
    merged.tie_weights()
    leftover = [name for name, tensor in merged.state_dict().items() if tensor.is_meta]
    if leftover:
        raise RuntimeError(f"merging left {leftover[0]} without a value")
    directory = Path(directory)
    save_pretrained(merged, directory)
    return directory


@torch.no_grad()
def merged_state_dict(base: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The base model's weights on the CPU, adapters folded in and quantized weights dequantized."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import ParamWrapper

    state: dict[str, torch.Tensor] = {}
    skip: tuple[str, ...] = ()
    for name, module in base.named_modules():
        if skip and name.startswith(skip):
            continue
        prefix = f"{name}." if name else ""
        if isinstance(module, ParamWrapper):
            skip = (prefix,)
            state.update(_merged_expert_weights(module, prefix, dtype))
            continue
        if isinstance(module, LoraLayer):
            skip = (prefix,)  # its children (base layer, lora_A/B) are handled here
            layer = module.get_base_layer()
            weight = _dense_weight(layer)
            for adapter in module.active_adapters:
                if adapter in module.lora_A:
                    weight = weight + module.get_delta_weight(adapter).float().cpu()
            state[prefix + "weight"] = weight.to(dtype)
            if getattr(layer, "bias", None) is not None:
                state[prefix + "bias"] = layer.bias.detach().cpu().to(dtype)
            continue
        if _is_quantized(module):
            state[prefix + "weight"] = _dense_weight(module).to(dtype)
            if module.bias is not None:
                state[prefix + "bias"] = module.bias.detach().cpu().to(dtype)
            continue
        for key, parameter in module.named_parameters(recurse=False):
            value = cpu_weight(parameter)
            state[prefix + key] = value.to(dtype) if value.is_floating_point() else value
        for key, buffer in module.named_buffers(recurse=False):
            if key not in module._non_persistent_buffers_set:
                state[prefix + key] = buffer.detach().cpu()
    return state


def _merged_expert_weights(outer: nn.Module, prefix: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """An experts module's parameters under PEFT's nested ParamWrappers, each adapter's delta folded in.

    The delta is built per weight here (the merge is offline, on the CPU); training never builds it."""
    from peft.tuners.lora.layer import ParamWrapper

    deltas: dict[str, torch.Tensor] = {}
    layer = outer
    while isinstance(layer, ParamWrapper):
        for adapter in layer.active_adapters:
            if adapter in layer.lora_A:
                delta = layer.get_delta_weight(adapter).float().cpu()
                deltas[layer.parameter_name] = deltas.get(layer.parameter_name, 0) + delta
        layer = layer.base_layer
    state = {}
    for key, parameter in layer.named_parameters():
        value = cpu_weight(parameter)
        if key in deltas:
            value = value.float() + deltas[key]
        state[prefix + key] = value.to(dtype) if value.is_floating_point() else value
    for key, buffer in layer.named_buffers():
        state[prefix + key] = buffer.detach().cpu()
    return state


def _is_quantized(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return type(weight).__name__ in ("Params4bit", "Int8Params")


def _dense_weight(layer: nn.Module) -> torch.Tensor:
    """A linear layer's weight as an fp32 CPU tensor, dequantized if bitsandbytes holds it."""
    weight = layer.weight
    if type(weight).__name__ == "Params4bit":
        import bitsandbytes.functional as bnb_functional

        data, quant_state = weight.data, weight.quant_state
        if getattr(quant_state, "packing_format_for_cpu", False):
            # bitsandbytes repacks 4-bit weights in place for its CPU inference kernel
            # (after an eval forward); undo that on a copy before dequantizing.
            data, quant_state = bnb_functional._convert_weight_packed_for_cpu_inverse(data, quant_state)
        weight = bnb_functional.dequantize_4bit(data, quant_state)
    elif _is_quantized(layer):
        from peft.utils.integrations import dequantize_bnb_weight

        weight = dequantize_bnb_weight(weight, getattr(layer, "state", None))
    return weight.detach().float().cpu()
