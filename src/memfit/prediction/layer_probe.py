"""Measure what one transformer block keeps for backward, from the model's own code.

The closed forms of `memfit.prediction.activations` describe the blocks of the families they
were checked on (`CLOSED_FORM_FAMILIES`). Any other family the loader accepts is measured
instead: a two-block copy of the architecture (full width, the real module code) runs
one forward on fake tensors (no memory is allocated) at two short sequence lengths, and
every tensor autograd saves inside the second block is counted once per storage. The
bytes per token at sequence length s are `a + b x s` (b is non-zero only where the
attention keeps [heads, s, s] probabilities), so two lengths give the line and any
length and layer count follow analytically. Extra norms (Gemma 3's four per block,
Qwen 3's and OLMo 2's query/key norms), LayerNorm with biases, parallel attention and
MLP, non-gated MLPs: whatever the block saves is counted, not assumed.

What it does not see: kernels chosen by device (the probe runs CPU kernels; CUDA
autocast also runs attention in 16 bits, so an autocast probe counts Q/K/V in fp32: an
upper bound).
"""

from __future__ import annotations

import contextlib
import copy
from functools import lru_cache
from typing import Any

PROBE_SEQ_LENS = (64, 128)


def probed_layer_bytes_per_token(hf_config: Any, weight_bytes: int, autocast: bool, attention: str,
                                 seq_len: int, lora_r: int = 0, efficient_norm: bool = False,
                                 efficient_lora: bool = False) -> float:
    """Bytes one block keeps for backward per token at `seq_len` (cached per architecture and precision).

    `lora_r` > 0: the base is frozen and every linear of the block gets a rank-`lora_r`
    adapter (PEFT, as `memfit train --lora-r` builds it). `efficient_norm`: the block's norms
    run memfit's memory-efficient RMSNorm where it applies, as `memfit train` runs them;
    `efficient_lora`: the adapters run memfit's memory-efficient path likewise.
    """
    return probed_layer_parts(hf_config, weight_bytes, autocast, attention, seq_len, lora_r, efficient_norm,
                              efficient_lora)[0]


def probed_layer_parts(hf_config: Any, weight_bytes: int, autocast: bool, attention: str, seq_len: int,
                       lora_r: int = 0, efficient_norm: bool = False,
                       efficient_lora: bool = False) -> tuple[float, float]:
    """(bytes one block keeps per token, the part its norm modules keep themselves), as above.

    The norms' part is what was saved while a module named like a norm (`...Norm`) ran:
    on an fp32 residual stream they run in fp32, autocast or not.
    """
    key = hf_config.to_json_string(use_diff=False)
    short, long = (_measure(key, weight_bytes, autocast, attention, s, lora_r, efficient_norm, efficient_lora)
                   for s in PROBE_SEQ_LENS)
    span = PROBE_SEQ_LENS[1] - PROBE_SEQ_LENS[0]
    return tuple(a + (b - a) / span * (seq_len - PROBE_SEQ_LENS[0]) for a, b in zip(short, long, strict=True))


@lru_cache(maxsize=256)
def _measure(config_json: str, weight_bytes: int, autocast: bool, attention: str, seq_len: int,
             lora_r: int = 0, efficient_norm: bool = False, efficient_lora: bool = False) -> tuple[float, float]:
    import json

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from transformers import AutoConfig, AutoModelForCausalLM

    data = json.loads(config_json)
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    config = _two_blocks(config)
    dtype = torch.float32 if weight_bytes == 4 else torch.bfloat16
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with fake, _real_mask_path():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attention)
        model.config.use_cache = False
        if lora_r:
            model = _with_adapters(model, lora_r)
            if efficient_lora:
                from memfit.techniques.efficient_lora import apply_efficient_lora

                apply_efficient_lora(model)
        if efficient_norm:
            from memfit.techniques.rms_norm import apply_efficient_rms_norm

            apply_efficient_rms_norm(model)
        model.train()
        blocks = _blocks(model)
        parameters = {id(p.untyped_storage()) for p in model.parameters()}
        counted: dict[int, Any] = {}  # id(storage) -> storage, kept alive so ids stay unique
        in_norms: set[int] = set()  # ids of the storages first saved while a norm module ran
        inside, norm_depth = [False], [0]
        second = blocks[1]
        second.register_forward_pre_hook(lambda *_: inside.__setitem__(0, True))
        second.register_forward_hook(lambda *_: inside.__setitem__(0, False))
        for module in second.modules():
            if type(module).__name__.endswith("Norm"):
                module.register_forward_pre_hook(lambda *_: norm_depth.__setitem__(0, norm_depth[0] + 1))
                module.register_forward_hook(lambda *_: norm_depth.__setitem__(0, norm_depth[0] - 1))

        def pack(tensor):
            storage = tensor.untyped_storage()
            if inside[0] and id(storage) not in parameters and id(storage) not in counted:
                counted[id(storage)] = storage
                if norm_depth[0]:
                    in_norms.add(id(storage))
            return tensor

        input_ids = torch.zeros((1, seq_len), dtype=torch.long)
        cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with cast, _scalar_reads_mode(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
            backbone(input_ids=input_ids)
        total = sum(storage.nbytes() for storage in counted.values())
        norms = sum(storage.nbytes() for key, storage in counted.items() if key in in_norms)
    return total / seq_len, norms / seq_len


def _scalar_reads_mode():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class ScalarReads(TorchDispatchMode):
        """A fake tensor has no value: answer the mask code's reads ("is the mask all ones": yes)."""

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                return {torch.bool: True}.get(args[0].dtype, 1)
            return func(*args, **(kwargs or {}))

    return ScalarReads()


def _with_adapters(model: Any, rank: int) -> Any:
    """PEFT adapters on every linear, on fake tensors (whose storage cannot be swapped by Module.to)."""
    from unittest import mock

    import torch
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    lora = LoraConfig(r=rank, lora_alpha=16, target_modules="all-linear", task_type="CAUSAL_LM")
    # every module is already on the one fake device, and PEFT keeps adapters in fp32 either way
    with mock.patch.object(BaseTunerLayer, "_move_adapter_to_device_of_base_layer", lambda *a, **k: None), \
            mock.patch.object(torch.nn.Module, "to", lambda self, *a, **k: self):
        return get_peft_model(model, lora)


def _two_blocks(config: Any) -> Any:
    config = copy.deepcopy(config)
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(getattr(config, name, None), int):
            setattr(config, name, 2)
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list):
        config.layer_types = layer_types[:2]
    return config


def _blocks(model: Any) -> Any:
    """The model's list of transformer blocks: its longest ModuleList."""
    from torch import nn

    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList) and len(m) >= 2]
    if not lists:
        raise ValueError(f"{type(model).__name__} has no list of transformer blocks to measure")
    return max(lists, key=len)


def _real_mask_path():
    """Let transformers treat fake tensors as real ones while it builds attention masks.

    Seeing a fake tensor it would assume graph tracing and build an explicit
    [b, 1, s, s] mask, which also disables grouped-query SDPA (K and V copied to every
    head): memory a real run never uses.
    """
    from unittest import mock

    try:
        import transformers.masking_utils as masking_utils
        from transformers.utils import import_utils
    except ImportError:  # an older transformers builds masks without this check
        return contextlib.nullcontext()
    if not hasattr(masking_utils, "is_tracing"):
        return contextlib.nullcontext()
    return mock.patch.object(masking_utils, "is_tracing", lambda tensor=None: import_utils.is_tracing(None))
