"""Measure what one transformer block keeps for backward, from the model's own code.

The closed forms of `memfit.prediction.activations` describe the blocks of the families they
were checked on (`CLOSED_FORM_FAMILIES`). Any other family the loader accepts is measured
instead: a two-block copy of the architecture (full width, the real module code) runs
one forward on fake tensors (no memory is allocated) at three short sequence lengths, and
every tensor autograd saves inside the second block is counted once per storage. The
bytes a block keeps at sequence length s are `c + a x s + b x s^2` (c: buffers whose size
does not follow the tokens, such as an MoE's per-expert adapter copies; b is non-zero only
where the attention keeps [heads, s, s] probabilities), so three lengths give the parabola
and any length and layer count follow analytically. Extra norms (Gemma 3's four per block,
Qwen 3's and OLMo 2's query/key norms), LayerNorm with biases, parallel attention and
MLP, non-gated MLPs: whatever the block saves is counted, not assumed.

Blocks that differ (DeepSeek-V3's and GLM-4-MoE's dense first layers before the MoE ones, Jamba's Mamba and
attention layers, experts on every other layer) are measured one kind at a time: each kind of block (its
modules and parameter shapes) is probed where it first occurs after the first block, and the bytes per
token are the average over the model's layers. Mixture-of-experts blocks run their routed path (transformers'
grouped_mm: every token's top-k expert rows, the permutation buffers) on fake tensors, fp32 included
(`memfit.prediction.fake_ops`). The config is probed as it is (a copy with fewer layers), never rebuilt from
its JSON: Falcon-H1 and Mamba-2 encode an infinite time-step limit that does not survive the round trip.

What it does not see: kernels chosen by device (the probe runs CPU kernels; CUDA
autocast also runs attention in 16 bits, so an autocast probe counts Q/K/V in fp32: an
upper bound).
"""

from __future__ import annotations

import contextlib
import copy
from functools import lru_cache
from typing import Any

from memfit.models.config_key import config_key

PROBE_SEQ_LENS = (64, 128, 256)


def probed_layer_bytes_per_token(hf_config: Any, weight_bytes: int, autocast: bool, attention: str,
                                 seq_len: int, lora_r: int = 0, efficient_norm: bool = False,
                                 efficient_lora: bool = False, tiled_experts: bool = False) -> float:
    """Bytes one block keeps for backward per token at `seq_len` (cached per architecture and precision).

    `lora_r` > 0: the base is frozen and every linear of the block gets a rank-`lora_r`
    adapter (PEFT, as `memfit train --lora-r` builds it). `efficient_norm`: the block's norms
    run memfit's memory-efficient RMSNorm where it applies, as `memfit train` runs them;
    `efficient_lora`: the adapters run memfit's memory-efficient path likewise; `tiled_experts`: every MoE
    layer's experts call runs over token tiles (techniques/tiled_experts.py), keeping its inputs only.
    """
    return probed_layer_parts(hf_config, weight_bytes, autocast, attention, seq_len, lora_r, efficient_norm,
                              efficient_lora, tiled_experts)[0]


def probed_layer_parts(hf_config: Any, weight_bytes: int, autocast: bool, attention: str, seq_len: int,
                       lora_r: int = 0, efficient_norm: bool = False,
                       efficient_lora: bool = False, tiled_experts: bool = False) -> tuple[float, float]:
    """(bytes one block keeps per token, the part its norm modules keep themselves), as above.

    The norms' part is what was saved while a module named like a norm (`...Norm`) ran:
    on an fp32 residual stream they run in fp32, autocast or not. Over blocks of several kinds
    both are the average per layer.
    """
    key = config_key(hf_config)  # memfit train's loaded config (use_cache off) shares the estimate's probes
    _CONFIGS.setdefault(key, copy.deepcopy(hf_config))
    attention = supported_attention(hf_config, attention)
    # FlexAttention (gpt-oss on CUDA: models.attention_support) cannot run on fake CPU tensors: probe
    # eager attention and keep its constant and per-token parts without the s x s scores, which flex
    # never keeps. FlexAttention saves query, key, value, its output and two fp32 values per head and
    # token (logsumexp and the row maxima: torch's FlexAttentionAutogradOp); the output and those are
    # added here. Eager's per-token part holds K and V repeated to every query head, which flex keeps
    # narrow where transformers runs it with enable_gqa (a power-of-two number of query heads; others
    # are repeated before the kernel as in eager): that difference comes off.
    scores = attention != "flex"
    probed = "eager" if attention == "flex" else attention
    per_token = [_measure(key, weight_bytes, autocast, probed, s, lora_r, efficient_norm, efficient_lora,
                          tiled_experts) for s in PROBE_SEQ_LENS]
    # A block keeps c + a*s + b*s^2 bytes at s tokens: a constant part (an MoE's per-expert adapter
    # buffers), a part per token, and eager attention's s x s scores. Three lengths fit all three
    # exactly; extrapolating the bytes per token along a line, as two lengths would, turns the
    # constant part's c/s into a slope that goes negative at long sequences.
    parts = [_parabola_through(PROBE_SEQ_LENS, [p * s for p, s in zip(column, PROBE_SEQ_LENS, strict=True)],
                               seq_len, scores) / seq_len for column in zip(*per_token, strict=True)]
    if not scores:
        heads = getattr(hf_config, "num_attention_heads", 0)
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // max(1, heads)
        element = 2 if autocast else weight_bytes
        parts[0] += element * heads * (head_dim + 4) + 4 * heads
        parts[0] -= flex_narrow_key_value_saving(hf_config, element)
    return tuple(parts)


def flex_narrow_key_value_saving(hf_config: Any, element_bytes: int) -> int:
    """Bytes a token's K and V repeated to every query head (what eager saves) hold beyond the narrow K and V
    FlexAttention saves when transformers runs it with enable_gqa: 0 where it repeats them too."""
    heads = getattr(hf_config, "num_attention_heads", 0)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    if not heads or heads & (heads - 1):
        return 0  # transformers repeats K and V before flex where the heads are not a power of two
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
    return 2 * element_bytes * (heads - kv_heads) * head_dim


def _parabola_through(xs: tuple[int, ...], ys: list[float], x: int, quadratic_term: bool = True) -> float:
    """The value at `x` of the parabola c + a*x + b*x^2 through the three points (xs, ys); without its b*x^2 term
    when `quadratic_term` is False."""
    (x0, x1, x2), (y0, y1, y2) = xs, ys
    d0, d1, d2 = (x0 - x1) * (x0 - x2), (x1 - x0) * (x1 - x2), (x2 - x0) * (x2 - x1)
    b = y0 / d0 + y1 / d1 + y2 / d2
    a = -(y0 * (x1 + x2) / d0 + y1 * (x0 + x2) / d1 + y2 * (x0 + x1) / d2)
    c = y0 * x1 * x2 / d0 + y1 * x0 * x2 / d1 + y2 * x0 * x1 / d2
    return c + a * x + (b * x * x if quadratic_term else 0.0)


_CONFIGS: dict[str, Any] = {}
"""The configs probed, by their JSON (the cache key): probed as given, never rebuilt from the JSON."""
_KINDS: dict[str, list[tuple]] = {}


def supported_attention(hf_config: Any, attention: str, device_type: str = "cpu") -> str:
    """`attention` (memfit's or transformers' name), or the kernel the family runs instead on `device_type`.

    What `memfit train`'s loader does (models.attention_support): gpt-oss (attention sinks) has no
    SDPA path in transformers and runs FlexAttention on CUDA, eager elsewhere; Mamba-2 runs eager.
    The estimate and the probe count the kernel that runs.
    """
    from memfit.models.attention_support import kernel_for_family

    names = {"sdpa": "sdpa", "flash": "flash_attention_2", "flash_attention_2": "flash_attention_2",
             "flex": "flex_attention", "flex_attention": "flex_attention"}
    if attention not in names:
        return attention
    runs, _ = kernel_for_family(hf_config, names[attention], device_type)
    if runs == names[attention]:
        return attention
    return {"flex_attention": "flex"}.get(runs, runs)


def block_kinds(hf_config: Any) -> list[tuple]:
    """One signature per layer of the model (its modules' types and parameter shapes): equal for alike blocks."""
    key = config_key(hf_config)
    if key not in _KINDS:
        from memfit.models.presets import build_meta_model

        _KINDS[key] = [_signature(block) for block in _blocks(build_meta_model(hf_config))]
    return _KINDS[key]


def _signature(block: Any) -> tuple:
    return tuple((name, type(module).__name__, tuple(tuple(p.shape) for p in module.parameters(recurse=False)))
                 for name, module in block.named_modules())


def probe_plan(kinds: list[tuple]) -> tuple[int, dict[int, int]]:
    """(layers of the probe model, {index of a block probed: how many layers of the model are of its kind}).

    Each kind is probed at its first occurrence after the first block (whose input is the embedding's),
    or at the first block when only that one has it.
    """
    counts: dict[tuple, int] = {}
    where: dict[tuple, int] = {}
    for index, kind in enumerate(kinds):
        counts[kind] = counts.get(kind, 0) + 1
        if where.get(kind, 0) == 0:
            where[kind] = index
    probed = {where[kind]: counts[kind] for kind in where}
    return min(len(kinds), max(2, max(probed) + 1)), probed


@lru_cache(maxsize=256)
def _measure(config_json: str, weight_bytes: int, autocast: bool, attention: str, seq_len: int,
             lora_r: int = 0, efficient_norm: bool = False, efficient_lora: bool = False,
             tiled_experts: bool = False) -> tuple[float, float]:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from memfit.prediction.fake_ops import FakeStepAnswers, quiet_meta_failures

    full = _CONFIGS[config_json]
    kinds = block_kinds(full)
    probe_layers, probed = probe_plan(kinds)
    config = _with_layers(full, probe_layers)
    dtype = torch.float32 if weight_bytes == 4 else torch.bfloat16
    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with quiet_meta_failures(), fake, _real_mask_path():
        from transformers.initialization import no_init_weights

        from memfit.prediction.encoders import is_encoder, probe_model_class  # an encoder's blocks: under its MLM head

        # fake weights need no values: ModernBERT's trunc_normal_ initialisation stalls on them
        with no_init_weights() if is_encoder(config) else contextlib.nullcontext():
            model = probe_model_class(config).from_config(config, dtype=dtype, attn_implementation=attention)
        model.config.use_cache = False
        if lora_r:
            model = _with_adapters(model, lora_r)
            if efficient_lora:
                from memfit.techniques.efficient_lora import apply_efficient_lora

                apply_efficient_lora(model)
        if tiled_experts:  # after the adapters, as memfit train applies it: their forward is what each tile runs
            from memfit.techniques.tiled_experts import apply_tiled_experts

            apply_tiled_experts(model, 2)  # what the block keeps does not depend on the number of tiles
        if efficient_norm:
            from memfit.techniques.rms_norm import apply_efficient_rms_norm

            apply_efficient_rms_norm(model)
        model.train()
        blocks = _blocks(model)
        parameters = {id(p.untyped_storage()) for p in model.parameters()}
        counted: dict[int, tuple[Any, int, bool]] = {}  # id(storage) -> (storage kept alive, block, saved in a norm)
        inside, norm_depth = [None], [0]
        for index in probed:
            blocks[index].register_forward_pre_hook(lambda *_, i=index: inside.__setitem__(0, i))
            blocks[index].register_forward_hook(lambda *_: inside.__setitem__(0, None))
            for module in blocks[index].modules():
                if type(module).__name__.endswith("Norm"):
                    module.register_forward_pre_hook(lambda *_: norm_depth.__setitem__(0, norm_depth[0] + 1))
                    module.register_forward_hook(lambda *_: norm_depth.__setitem__(0, norm_depth[0] - 1))

        def pack(tensor):
            storage = tensor.untyped_storage()
            if inside[0] is not None and id(storage) not in parameters and id(storage) not in counted:
                counted[id(storage)] = (storage, inside[0], bool(norm_depth[0]))
            return tensor

        input_ids = torch.zeros((1, seq_len), dtype=torch.long)
        cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
        with cast, FakeStepAnswers(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.base_model
            if is_encoder(config):  # ModernBERT's masked LM names its vocabulary projection `decoder`
                backbone = (model.get_base_model() if hasattr(model, "get_base_model") else model).base_model
            backbone(input_ids=input_ids)
        # the average block: each kind's bytes weighted by how many of the model's layers have it
        total = sum(storage.nbytes() * probed[block] for storage, block, _ in counted.values())
        norms = sum(storage.nbytes() * probed[block] for storage, block, in_norm in counted.values() if in_norm)
    return total / len(kinds) / seq_len, norms / len(kinds) / seq_len


def _with_adapters(model: Any, rank: int) -> Any:
    """PEFT adapters where `memfit train --lora-r` puts them, on fake tensors (whose storage Module.to cannot swap)."""
    from unittest import mock

    import torch
    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    from memfit.techniques.lora import peft_wrapping_quietly, resolve_targets

    # memfit train's default targets: the blocks' linears PEFT accepts for the family (not Mamba's out_proj or
    # conv1d) and the fused experts, run by memfit's split LoRA
    targets = resolve_targets(model, "auto")
    experts = targets.experts.parameters
    lora = LoraConfig(r=rank, lora_alpha=16, target_modules=targets.modules, target_parameters=experts or None,
                      task_type="CAUSAL_LM")
    from memfit.prediction.encoders import is_encoder

    if is_encoder(model.config):  # a masked LM generates nothing: PEFT's plain wrapper, as the task's LoRA
        lora.task_type = "FEATURE_EXTRACTION"
    # every module is already on the one fake device, and PEFT keeps adapters in fp32 either way
    with mock.patch.object(BaseTunerLayer, "_move_adapter_to_device_of_base_layer", lambda *a, **k: None), \
            mock.patch.object(torch.nn.Module, "to", lambda self, *a, **k: self), peft_wrapping_quietly():
        model = get_peft_model(model, lora)
    if experts:
        from memfit.techniques.expert_lora import apply_split_lora

        apply_split_lora(model)
    return model


def _with_layers(config: Any, layers: int) -> Any:
    """A copy of `config` with `layers` blocks (the same kinds in the same places)."""
    config = copy.deepcopy(config)
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        if isinstance(getattr(config, name, None), int):
            setattr(config, name, layers)
    if isinstance(getattr(config, "layer_types", None), list):
        try:
            config.layer_types = config.layer_types[:layers]
        except AttributeError:  # derived from other fields (Jamba's periods, Falcon-H1's block types), not stored
            pass
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
