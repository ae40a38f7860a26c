"""What each small-state optimizer keeps, in bytes and in extra step work: the module each new optimizer extends.

The estimator (state bytes, step temporaries), the speed model (extra FLOPs of a step), the
planner (PLANNING: whether it is tried, how far it is from AdamW, what it trades in words) and
the optimizer factory (which tensors are projected, the settings) all read this module, so adding
an optimizer means its name among the config's choices (`memfit.config.SMALL_STATE_OPTIMIZERS`),
its rows here and a builder in `memfit.techniques.small_state_optimizers`; nothing in
memfit.prediction names an optimizer.

- GaLore (`galore-adamw`, `galore-adamw-8bit`): each projected m x n matrix keeps one orthonormal
  r x min(m, n) projection (refreshed by an SVD of the gradient every `update_proj_gap` steps) and
  AdamW's two moments of the r x max(m, n) projected gradient; 8-bit: those moments block-quantized.
- APOLLO (`apollo-adamw`, `apollo-mini`): the same shapes, a random projection (from a seed, refreshed
  every `update_proj_gap` steps) and one norm of the last update per matrix; APOLLO-Mini is rank 1
  with one scale per tensor.
- Adam-mini: the first moment in full and one second moment per block (per attention head for
  queries and keys, per output row for values, MLPs, embeddings and the head, one per other tensor);
  biases keep AdamW's two moments.
- `adamw-4bit` (torchao): both moments in 4 bits with one fp32 scale per 128 values, for tensors of at
  least 4096 values that 128 divides; others keep full-precision moments.
Tensors that are not projected keep AdamW's two moments in the parameters' dtype.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from memfit.config import SMALL_STATE_OPTIMIZERS  # noqa: F401  (the names, with the config's choices)
from memfit.errors import UsageError

LOW_RANK_OPTIMIZERS = ("galore-adamw", "galore-adamw-8bit", "apollo-adamw", "apollo-mini")
TARGET_CHOICES = ("all-linear", "all")
BNB_8BIT_MIN_SIZE = 4096
BNB_8BIT_BLOCK = 256
TORCHAO_4BIT_BLOCK = 128
TORCHAO_QMAP_VALUES = 16
"""torchao's 4-bit code books: 16 fp32 values, one per state tensor."""

_DEFAULTS = {
    # Each as the Hugging Face Trainer sets it for optim=...; APOLLO-Mini as its authors' recipe.
    "galore": {"rank": 128, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"},
    "apollo-adamw": {"rank": 128, "update_proj_gap": 200, "scale": 1.0, "proj_type": "std", "proj": "random",
                     "scale_type": "channel"},
    "apollo-mini": {"rank": 1, "update_proj_gap": 200, "scale": 128.0, "proj_type": "std", "proj": "random",
                    "scale_type": "tensor"},
}
_ARG_TYPES = {"rank": int, "update_proj_gap": int, "scale": float, "proj_type": str, "proj": str, "scale_type": str}
_ARG_VALUES = {"proj_type": ("std", "reverse_std", "left", "right"), "proj": ("random", "svd"),
               "scale_type": ("channel", "tensor")}


def refusal_under_sharding(optimizer: str, fsdp: bool = False) -> str | None:
    """Why `optimizer` cannot run on DeepSpeed ZeRO partitions, or on FSDP2 shards when `fsdp` (None: it can or is
    not one of these)."""
    if optimizer in LOW_RANK_OPTIMIZERS:
        return (f"--optimizer {optimizer} projects each whole weight gradient (an SVD or a random projection of its"
                " full matrix), which sharded training splits over ranks: use --sharding ddp")
    if optimizer == "adam-mini":
        return ("--optimizer adam-mini averages its second moment over whole attention heads and rows, which"
                " sharded training splits over ranks, and adam-mini reduces them across ranks only on CUDA (it counts"
                " ranks with torch.cuda.device_count()): use --sharding ddp")
    if optimizer == "adamw-4bit" and not fsdp:
        # FSDP2 runs it: each rank quantizes its own shard, and torch.distributed.checkpoint saves and restores
        # those 4-bit tensors exactly on the same number of ranks (distributed/checkpoint_io.py).
        return ("--optimizer adamw-4bit under DeepSpeed ZeRO would quantize one flat partition of many parameters,"
                " whose 4-bit state DeepSpeed's checkpoints are not known to save and resume: use --sharding ddp"
                " (or --sharding fsdp)")
    return None


@dataclass(frozen=True)
class LowRankSettings:
    """Settings of a GaLore / APOLLO projection (the Trainer's `optim_args`)."""

    rank: int
    update_proj_gap: int
    scale: float
    proj_type: str = "std"
    proj: str = "svd"
    scale_type: str = "channel"
    target_modules: str = "all-linear"

    def group_options(self, optimizer: str) -> dict[str, Any]:
        """The options the library reads from a projected parameter group."""
        options = {"rank": self.rank, "update_proj_gap": self.update_proj_gap, "scale": self.scale,
                   "proj_type": self.proj_type}
        if optimizer.startswith("apollo"):
            options.update(proj=self.proj, scale_type=self.scale_type)
        return options


def low_rank_settings(optimizer_config: Any) -> LowRankSettings:
    """Defaults of `optimizer_config.optimizer`, then --optim-args, then --optim-rank / --optim-update-proj-gap / --optim-scale."""
    name = optimizer_config.optimizer
    values = dict(_DEFAULTS["galore" if name.startswith("galore") else name])
    values.update(parse_optim_args(optimizer_config.optim_args))
    for key, flag in (("rank", "optim_rank"), ("update_proj_gap", "optim_update_proj_gap"), ("scale", "optim_scale")):
        if getattr(optimizer_config, flag) is not None:
            values[key] = getattr(optimizer_config, flag)
    if name.startswith("galore"):
        if values.pop("proj", "svd") != "svd":
            raise UsageError("GaLore projects by SVD only: drop proj= from --optim-args")
        values.pop("scale_type", None)
    return LowRankSettings(target_modules=optimizer_config.optim_target_modules, **values)


def projection_settings(optimizer_config: Any) -> LowRankSettings | None:
    """`low_rank_settings` for the projected optimizers (GaLore, APOLLO); None for every other."""
    return low_rank_settings(optimizer_config) if optimizer_config.optimizer in LOW_RANK_OPTIMIZERS else None


def parse_optim_args(text: str | None) -> dict[str, Any]:
    """'rank=64,update_proj_gap=100,scale=0.25' (the Trainer's optim_args) -> typed values; UsageError when bad."""
    values: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        key, _, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if key not in _ARG_TYPES or not raw:
            raise UsageError(f"--optim-args takes key=value pairs of {', '.join(_ARG_TYPES)}; got {item!r}")
        try:
            value = _ARG_TYPES[key](raw)
        except ValueError:
            raise UsageError(f"--optim-args {key} must be a {_ARG_TYPES[key].__name__}, got {raw!r}") from None
        if key in _ARG_VALUES and value not in _ARG_VALUES[key]:
            raise UsageError(f"--optim-args {key} must be one of {', '.join(_ARG_VALUES[key])}, got {raw!r}")
        values[key] = value
    return values


@dataclass(frozen=True)
class NamedTensor:
    """A trainable tensor as an optimizer sees it."""

    name: str
    shape: tuple[int, ...]
    kind: str
    """'linear' (the weight of a Linear, output head included), 'embedding' or 'other'."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def parameter_kinds(model: Any) -> dict[str, str]:
    """Parameter name -> 'linear' / 'embedding' for the weights of those modules (others are 'other')."""
    from torch import nn

    kinds = {}
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D":
            kinds[prefix + "weight"] = "linear"
        elif isinstance(module, nn.Embedding):
            kinds[prefix + "weight"] = "embedding"
    return kinds


def named_trainable(model: Any) -> list[NamedTensor]:
    """The trainable parameters of `model` (tied weights once) with their kinds."""
    kinds = parameter_kinds(model)
    return [NamedTensor(name, tuple(p.shape), kinds.get(name, "other"))
            for name, p in model.named_parameters() if p.requires_grad]


def is_projected(tensor: NamedTensor, target_modules: str) -> bool:
    """Whether GaLore / APOLLO project `tensor` under --optim-target-modules.

    all-linear: every Linear weight, the output head included (the Trainer's meaning); all: every
    matrix (embeddings too); else comma-separated module names, each matching a module whose name
    contains it or that it matches in full as a regular expression.
    """
    if len(tensor.shape) != 2:
        return False
    if target_modules == "all":
        return True
    if tensor.kind != "linear":
        return False
    if target_modules == "all-linear":
        return True
    module = tensor.name.rsplit(".", 1)[0]
    return any(key in module or re.fullmatch(key, module) for key in _target_keys(target_modules))


def _target_keys(target_modules: str) -> list[str]:
    return [key.strip() for key in target_modules.split(",") if key.strip()]


def check_target_modules(tensors: list[NamedTensor], target_modules: str) -> None:
    """UsageError when --optim-target-modules selects no matrix or is not a valid pattern."""
    if target_modules not in TARGET_CHOICES:
        for key in _target_keys(target_modules):
            try:
                re.compile(key)
            except re.error as error:
                raise UsageError(f"--optim-target-modules {key!r} is not a valid pattern ({error})") from None
    if not any(is_projected(t, target_modules) for t in tensors):
        raise UsageError(f"--optim-target-modules {target_modules!r} selects no Linear weight of this model:"
                         " use all-linear, all, or module names such as q_proj,v_proj")


def _projected_shapes(shape: tuple[int, int], rank: int) -> tuple[int, int]:
    """(elements of the projection, elements of the projected gradient) of an m x n matrix."""
    m, n = shape
    r = min(rank, m, n)  # the SVD (and the library's slicing) gives at most min(m, n) directions
    return r * min(m, n), r * max(m, n)


def _bnb_8bit_state(numel: int) -> int:
    if numel >= BNB_8BIT_MIN_SIZE:
        return 2 * numel + 2 * 4 * math.ceil(numel / BNB_8BIT_BLOCK)
    return 8 * numel


def adam_mini_block_count(tensor: NamedTensor, head_block: int) -> int:
    """Second moments Adam-mini 1.1.1 keeps for `tensor`, from its name as its partition reads it."""
    name = tensor.name.lower()
    if "bias" in name:
        return tensor.numel  # AdamW's own second moment
    if any(key in name for key in ("k_proj", "q_proj", "wq", "wk", "query", "key")):
        return tensor.numel // head_block  # one per attention head
    if any(key in name for key in ("embed", "embd", "wte", "lm_head", "output", "final_layer", "v_proj", "wv",
                                   "value", "feed_forward", "linear", "mlp", "o_proj", "wo", "attn.proj")):
        return tensor.shape[0]  # one per output row
    return 1


def state_bytes(optimizer: str, tensors: list[NamedTensor], param_bytes: int, settings: LowRankSettings | None,
                head_block: int = 1, in_backward: bool = False) -> int:
    """Bytes of optimizer state of `optimizer` (one of SMALL_STATE_OPTIMIZERS) over `tensors`."""
    total = 0
    for tensor in tensors:
        n = tensor.numel
        if optimizer in LOW_RANK_OPTIMIZERS and is_projected(tensor, settings.target_modules):
            projection, moments = _projected_shapes(tensor.shape, settings.rank)
            total += projection * param_bytes
            if optimizer == "galore-adamw-8bit":
                total += _bnb_8bit_state(moments)
            else:
                total += 2 * moments * param_bytes
            if optimizer.startswith("apollo"):
                total += param_bytes  # the norm of the last scaled update (its growth limiter)
        elif optimizer == "galore-adamw-8bit":
            total += _bnb_8bit_state(n)
        elif optimizer == "adam-mini":
            total += (n + adam_mini_block_count(tensor, head_block)) * param_bytes
        elif optimizer == "adamw-4bit":
            if n >= 4096 and n % TORCHAO_4BIT_BLOCK == 0:
                total += 2 * (n // 2 + 4 * (n // TORCHAO_4BIT_BLOCK) + 4 * TORCHAO_QMAP_VALUES)
            else:
                total += 2 * n * param_bytes
            total += 4  # its step count, an fp32 tensor on the host
        elif optimizer in LOW_RANK_OPTIMIZERS:
            total += 2 * n * param_bytes
        else:
            raise UsageError(f"unknown optimizer {optimizer!r}")
    if optimizer == "galore-adamw-8bit":
        # bitsandbytes' two quantization maps, one pair per optimizer (one per parameter in backward)
        total += 2 * BNB_8BIT_BLOCK * 4 * (len(tensors) if in_backward else 1)
    return total


@dataclass(frozen=True)
class PlanningFacts:
    """What the planner and the plan's words need to know of a small-state optimizer."""

    distance_from_adamw: int
    """How far its update is from AdamW's (AdamW and 8-bit AdamW: 0): the tie-break among equally fast plans."""
    planned: bool
    """Whether `memfit plan` tries it for full fine-tuning (variants of a planned one are not tried again)."""
    planned_targets: str | None
    """The weights it projects when the planner picks it and the user did not say (None: its default)."""
    trade: str
    """What it trades, in words; {rank}, {gap} and {targets} are filled from its settings."""


PLANNING = {
    "galore-adamw": PlanningFacts(
        2, True, None, "GaLore: AdamW's moments of a rank-{rank} projection of each gradient ({targets}), refreshed"
        " by an SVD every {gap} steps; not AdamW: updates stay in the projected subspace between refreshes"),
    "galore-adamw-8bit": PlanningFacts(
        2, False, None, "GaLore 8-bit: 8-bit moments of a rank-{rank} projection ({targets}), SVD every {gap} steps;"
        " not AdamW"),
    "apollo-adamw": PlanningFacts(
        2, False, None, "APOLLO: AdamW's moments of a rank-{rank} random projection ({targets}) only scale the raw"
        " gradient per channel; not AdamW (close to it in the APOLLO paper's pre-training runs)"),
    # APOLLO-Mini projects the embeddings and the head too: their AdamW moments would be most of
    # what is left (2 GiB of 4 for Llama-3.1-8B in bf16).
    "apollo-mini": PlanningFacts(
        2, True, "all", "APOLLO-Mini: a rank-{rank} random projection ({targets}) gives one scale per tensor for the"
        " raw gradient: SGD-like updates with an adaptive step; furthest from AdamW of the choices"),
    "adam-mini": PlanningFacts(
        1, True, None, "Adam-mini: one second moment per attention head or row instead of per weight; close to but"
        " not equal to AdamW"),
    "adamw-4bit": PlanningFacts(
        1, True, None, "4-bit AdamW (torchao): moments in 4 bits with one scale per 128 values, rounder than 8-bit"
        " AdamW; its step is compiled the first time"),
}
"""One row per small-state optimizer: with STEP_TEMPORARY_FACTOR, state_bytes and step_extra_flops, all the
estimator, the speed model and the planner know of it."""


def distance_from_adamw(optimizer: str | None) -> int:
    """PlanningFacts.distance_from_adamw, 0 for AdamW, 8-bit AdamW and the rest."""
    facts = PLANNING.get(optimizer or "")
    return facts.distance_from_adamw if facts else 0


STEP_TEMPORARY_FACTOR = {"galore-adamw": 3.3, "galore-adamw-8bit": 4.3, "apollo-adamw": 1.0, "apollo-mini": 1.1,
                         "adam-mini": 2.0, "adamw-4bit": 2.0}
"""Temporaries of one tensor's step, in copies of that tensor, at the step that refreshes the projection;
APOLLO-Mini's in copies of one block of APOLLO_BLOCK_ELEMENTS (or of the tensor, where it is smaller).

Measured with the tracker on CPU (torch 2.13, a 1024 x 512 weight, default settings, the
projection refreshed at that step; the same in backward): GaLore 3.26 (the SVD's factors, the
projected-back update and its scaled copy), Adam-mini 2.01 (the squared gradient, the update).
APOLLO's step is memfit's (memfit.techniques.apollo_step, tests/unit/techniques/test_apollo_step.py):
a block of the scaled gradient and the low-rank tensors, 1.1 blocks at rank 1; at rank 128 the
largest tensor is the head, which APOLLO leaves unprojected, and its AdamW step holds sqrt(v): 1.0.
(apollo-torch's own step: 2.88 at rank 128 and 2.01 at rank 1, the scaled gradient and its limited
copy.) Not measured: GaLore 8-bit (one more copy: it clones the weight around bitsandbytes' step) and
torchao's compiled 4-bit step (taken as two copies, the dequantized moments of one tensor).
"""

APOLLO_BLOCK_ELEMENTS = 1 << 22
"""Elements of a projected gradient memfit's APOLLO step scales at a time (8 MiB in bf16)."""


def step_temporary_bytes(optimizer: str, largest_numel: int, param_bytes: int) -> int:
    """Bytes one step allocates on top of the state: these optimizers work a tensor at a time."""
    copied = min(largest_numel, APOLLO_BLOCK_ELEMENTS) if optimizer == "apollo-mini" else largest_numel
    return int(STEP_TEMPORARY_FACTOR[optimizer] * param_bytes * copied)


SVD_FLOP_RATE = 0.05
"""Fraction of the matmul rate an SVD reaches (LAPACK / cuSOLVER on one matrix at a time; not measured on a GPU)."""


def step_extra_flops(optimizer: str, tensors: list[NamedTensor], settings: LowRankSettings | None) -> float:
    """Matmul-equivalent FLOPs one step of `optimizer` costs beyond AdamW's element-wise work.

    GaLore: projecting the gradient and the update back (2 x 2mnr), plus an SVD of each projected
    gradient (about 4mn min(m, n) at SVD_FLOP_RATE) every update_proj_gap steps. APOLLO: projecting
    the gradient (2mnr) and a new random matrix every update_proj_gap steps. Adam-mini: its block
    means of the squared gradient. torchao 4-bit: quantizing both moments, about 20 operations an element.
    """
    flops = 0.0
    for tensor in tensors:
        if optimizer in LOW_RANK_OPTIMIZERS and is_projected(tensor, settings.target_modules):
            m, n = tensor.shape
            r = min(settings.rank, m, n)
            if optimizer.startswith("galore"):
                flops += 4 * m * n * r + 4 * m * n * min(m, n) / SVD_FLOP_RATE / settings.update_proj_gap
            else:
                flops += 2 * m * n * r + 10 * r * max(m, n) / settings.update_proj_gap
        elif optimizer == "adamw-4bit":
            flops += 20 * tensor.numel
        elif optimizer == "adam-mini":
            flops += 4 * tensor.numel  # the squared gradient and its block means
    return flops
