"""LoRA and QLoRA: train small low-rank adapters on a frozen (optionally quantized) base.

LoRA (`--lora-r R`, PEFT)
    Saves: gradients and optimizer state exist only for the adapters. Each adapted
    `d_out x d_in` linear gets `R x (d_in + d_out)` trainable parameters, typically
    0.1-1% of the model, so the 4 + 8 bytes per parameter of fp32 gradients and AdamW
    moments almost vanish (a 7B model: ~75 GiB of them in full fine-tuning, < 0.5 GiB
    with r=16). The frozen weights can stay in bf16.
    Costs: the adapters' small extra matmuls (a few percent of a step); the
    activations are about those of full training (the base layers' inputs are still
    saved to backpropagate through them); quality depends on the rank.
QLoRA (`--quantize 4bit` with `--lora-r`, bitsandbytes)
    Saves: the frozen weights are stored in 4-bit NF4 with double-quantized scales:
    about 0.5 byte per parameter instead of 2 (bf16). `--quantize 8bit`: 1 byte. A mixture
    of experts' fused 3-D expert stacks, which bitsandbytes leaves in the load dtype, are
    held in NF4 by memfit under 4bit (techniques/expert_quant.py), dequantized one stack at
    a time for their grouped matmuls; under 8bit they stay in the load dtype.
    Costs: each quantized matmul dequantizes its weight on the fly (slower than bf16
    on GPU, much slower on CPU); small rounding of the frozen weights. The weights left
    unquantized (embeddings, norms, head) stay in the load dtype under bf16, so the
    residual stream is bf16 as in any bf16 run; an fp16 base gets them upcast to fp32
    against overflow (PEFT's `prepare_model_for_kbit_training`), and its residual
    stream is fp32.

Targets (`--lora-targets`): `auto` puts adapters on every linear layer inside the
transformer blocks (attention and MLP projections, the dense MLPs and shared experts of
an MoE model included) and on the fused experts of an MoE model; `all-linear` on every
linear layer except the output head, and the experts; or comma-separated names: module
names (`q_proj,v_proj`), `experts` (every fused expert weight) or one fused projection
(`gate_up_proj,down_proj`), and `router` (the routers, trained in full; they stay frozen
otherwise). The experts' adapters run as split LoRA (techniques/expert_lora.py): x A then
B per expert group, never the per-expert weight delta. Modules PEFT refuses for the
family (Mamba's `out_proj` and `conv1d`) are left out of `auto` and `all-linear`, and
refused in one line when named.

After training, `save_adapter` writes the adapter in PEFT's format (a few MB) and
`lora_merge.merge_and_save` writes a plain Hugging Face model with the adapter folded in. A 4-bit
or 8-bit base is dequantized for the merge (to `dtype`, default the model's dtype or
fp32), so the merged model loads with `AutoModelForCausalLM.from_pretrained` without
bitsandbytes; it is a full-precision model, as large as the unquantized base.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from memfit.config import LoraConfig
from memfit.errors import UsageError
from memfit.models.experts import fused_expert_parameter_names, router_modules
from memfit.techniques.expert_lora import ExpertTargets

log = logging.getLogger("memfit")

BNB_HINT = "pip install memfit[bnb]"
PEFT_HINT = "pip install memfit[peft]"


@dataclass
class LoraSummary:
    rank: int
    modules: int
    """Number of linear layers that got an adapter."""
    trainable_parameters: int
    total_parameters: int
    """All parameters, quantized ones counted by their unpacked size."""
    quantize: str = "none"
    expert_weights: int = 0
    """Fused 3-D expert weights that got adapters (one per projection and layer)."""
    routers: int = 0
    """Router modules trained in full (--lora-targets router)."""

    def describe(self) -> str:
        """One line for the log: 'LoRA r=16 on 14 modules: 0.52M trainable of 124M (0.42%)'."""
        kind = {"none": "LoRA", "4bit": "QLoRA (4-bit base)", "8bit": "LoRA (8-bit base)"}[self.quantize]
        share = 100 * self.trainable_parameters / max(self.total_parameters, 1)
        experts = f" and {self.expert_weights} fused expert weights" if self.expert_weights else ""
        routers = f", {self.routers} routers in full" if self.routers else ""
        return (
            f"{kind} r={self.rank} on {self.modules} modules{experts}{routers}:"
            f" {_millions(self.trainable_parameters)} trainable of {_millions(self.total_parameters)} ({share:.2f}%)"
        )

    def facts(self) -> dict:
        """What trains, for the metrics' start and summary lines."""
        return {"rank": self.rank, "modules": self.modules, "expert_weights": self.expert_weights,
                "routers": self.routers, "trainable_parameters": self.trainable_parameters,
                "total_parameters": self.total_parameters, "quantize": self.quantize}


def _millions(count: int) -> str:
    if count >= 10_000_000:
        return f"{count / 1e6:.0f}M"
    return f"{count / 1e6:.2f}M"


def _require(module: str, hint: str, what: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise UsageError(f"{what} needs {module}, which is not installed: {hint}")


def quantization_config(lora_cfg: LoraConfig, compute_dtype: torch.dtype):
    """The `transformers.BitsAndBytesConfig` to load the base with, or None for `--quantize none`.

    4bit: NF4 with double quantization, matmuls in `compute_dtype` (bf16 or fp16 on a GPU
    that has it, else fp32). 8bit: LLM.int8(). Raises UsageError when bitsandbytes is missing.
    """
    if lora_cfg.quantize == "none":
        return None
    _require("bitsandbytes", BNB_HINT, f"--quantize {lora_cfg.quantize}")
    from transformers import BitsAndBytesConfig

    if lora_cfg.quantize == "8bit":
        return BitsAndBytesConfig(load_in_8bit=True)
    if compute_dtype not in (torch.bfloat16, torch.float16, torch.float32):
        compute_dtype = torch.float32
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )


# ---------------------------------------------------------------------------
# Target modules
# ---------------------------------------------------------------------------


def _is_linear(module: nn.Module) -> bool:
    # bitsandbytes' Linear4bit/Linear8bitLt subclass nn.Linear; GPT-2 style models use Conv1D.
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def linear_module_names(model: nn.Module) -> list[str]:
    """Full names of the linear layers a LoRA adapter can go on, output head excluded."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [name for name, module in model.named_modules() if _is_linear(module) and module is not head]


def resolve_lora_targets(model: nn.Module, targets: str) -> list[str]:
    """Full module names of the linear layers `--lora-targets` adapts (auto, all-linear, or comma-separated names)."""
    return resolve_targets(model, targets).modules


@dataclass
class LoraTargets:
    modules: list[str]
    """Full names of the linear layers that get adapters (PEFT's target_modules)."""
    experts: ExpertTargets
    """Fused expert weights that get adapters, routers trained in full."""
    refused: list[str]
    """Linear layers PEFT refuses for this family (Mamba's out_proj), left out."""


def _matches(full: str, name: str) -> bool:
    return full == name or full.endswith("." + name)


def resolve_targets(model: nn.Module, targets: str) -> LoraTargets:
    """What `--lora-targets` adapts: linear modules, fused expert weights, routers. Raises UsageError, naming the
    flag, for names that match nothing, expert names on a dense model and modules PEFT refuses for the family."""
    from memfit.techniques.expert_lora import split_target_names

    routers = {name for name, _ in router_modules(model)}
    every_linear = linear_module_names(model)
    refused = [name for name in every_linear if _peft_refuses(model, name)]
    # The router scores the experts: trained only when named (`router`), never by auto or all-linear.
    linear = [name for name in every_linear if name not in refused and name not in routers]
    if targets in ("auto", "all-linear"):
        _, experts = split_target_names(model, [], auto=True)
        modules = linear
        if targets == "auto":
            from memfit.techniques.checkpointing import transformer_blocks

            try:
                blocks = transformer_blocks(model)
                prefix = next(name for name, module in model.named_modules() if module is blocks) + "."
                modules = [name for name in linear if name.startswith(prefix)] or linear
            except ValueError:
                pass
        if not modules and not experts.parameters:
            raise UsageError(f"{type(model).__name__} has no linear layers for LoRA adapters; train it without --lora-r")
        return LoraTargets(modules, experts, refused)
    wanted = [name.strip() for name in targets.split(",") if name.strip()]
    rest, experts = split_target_names(model, wanted, auto=False)
    named_refused = sorted({name for name in rest if any(_matches(full, name) for full in refused)})
    if named_refused:
        raise UsageError(
            f"--lora-targets {', '.join(named_refused)}: PEFT refuses adapters on these modules of a"
            f" {getattr(getattr(model, 'config', None), 'model_type', type(model).__name__)} model; leave them out"
        )
    expert_leaves = {full.rsplit(".", 1)[-1] for full in experts.parameters}
    unknown = [name for name in rest if not any(_matches(full, name) for full in linear) and name not in expert_leaves]
    if unknown or not wanted:
        valid = sorted({name.rsplit(".", 1)[-1] for name in linear})
        extra = ", experts, " + ", ".join(sorted(expert_leaves | _expert_leaves(model))) if _expert_leaves(model) else ""
        raise UsageError(
            f"--lora-targets {', '.join(unknown) or targets!r} matches no linear layer of this model;"
            f" valid names: {', '.join(valid)}{extra} (or auto, all-linear)"
        )
    modules = [full for full in linear if any(_matches(full, name) for name in rest)]
    return LoraTargets(modules, experts, refused)


def _expert_leaves(model: nn.Module) -> set[str]:
    return {full.rsplit(".", 1)[-1] for full in fused_expert_parameter_names(model)}


def _peft_refuses(model: nn.Module, name: str) -> bool:
    """Whether PEFT refuses a LoRA adapter on module `name` of this model (Mamba's out_proj and conv1d)."""
    try:
        import peft
        from peft.tuners.tuners_utils import _check_lora_target_modules_mamba
    except ImportError:  # without peft nothing is wrapped; an older PEFT has no such check
        return False
    try:
        _check_lora_target_modules_mamba(peft.LoraConfig(), model, name.rsplit(".", 1)[-1])
    except ValueError:
        return True
    return False


@contextlib.contextmanager
def _without_v4_target_conversion():
    """PEFT renames gate_proj/up_proj/down_proj targets of some MoE families to their fused expert weights,
    to load adapters trained with transformers 4; on a new adapter that drops the dense MLPs and shared
    experts of DeepSeek-V3 and GLM-4-MoE, which keep those names as linear layers. memfit's targets are
    this model's own names already."""
    try:
        import peft.utils.transformers_weight_conversion as conversion
    except ImportError:
        yield
        return
    original = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original


@contextlib.contextmanager
def peft_wrapping_quietly():
    """Silence one FutureWarning that memfit cannot avoid: PEFT's `PeftModel.__init__` (0.21) asks
    `getattr(model, "is_gradient_checkpointing", True)`, a property transformers 5.23 deprecated in favour of
    `is_activation_checkpointing`, so every LoRA run printed "`is_gradient_checkpointing` is deprecated".
    memfit reads neither (apply_lora makes the embedding output require grad itself). Only that message is
    ignored, only while PEFT wraps a model (here and in the estimate's layer probe); drop this once PEFT reads
    the new name."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


# ---------------------------------------------------------------------------
# Wrapping
# ---------------------------------------------------------------------------


def keep_nf4_layout(model: nn.Module) -> int:
    """Keep every bitsandbytes 4-bit linear's weights in the standard NF4 layout; returns how many were found.

    On a CPU with AVX-512 bf16, bitsandbytes repacks a `Linear4bit`'s weights in place into an inference layout the
    first time it runs in eval mode on an input without gradient (an evaluation pass, `memfit generate`). memfit
    reads those weights in the standard layout afterwards (the merge, the NF4 head's and experts' dequantization),
    and the repack itself fails on rows shorter than a 64-weight block. Training never takes that path, so the
    repack buys nothing here.
    """
    linears = [m for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    for module in linears:
        module.support_avx512bf16_for_cpu = False
    return len(linears)


def apply_lora(model: nn.Module, lora_cfg: LoraConfig, gradient_checkpointing: bool,
               task_type: str = "CAUSAL_LM") -> tuple[nn.Module, LoraSummary]:
    """Wrap `model` with LoRA adapters (PEFT); freeze everything else.

    Call after loading (with `quantization_config` for QLoRA) and after switching
    gradient checkpointing on. `gradient_checkpointing` says whether it is on: the
    embedding output is then made to require grad, so every checkpointed block has an
    input that requires grad even though the embeddings are frozen.
    `task_type`: PEFT's name of the task (memfit.tasks): SEQ_CLS and TOKEN_CLS keep the head
    (`classifier`, `score`) trainable in full as PEFT's modules_to_save, saved with the adapters.
    Returns the PEFT model (use it in place of `model`) and a summary for the log.
    """
    _require("peft", PEFT_HINT, "--lora-r")
    import peft

    targets = resolve_targets(model, lora_cfg.lora_targets)
    from memfit.techniques.expert_lora import check_expert_lora

    expert_note = check_expert_lora(model, targets.experts, lora_cfg.lora_dropout, lora_cfg.quantize)
    if expert_note:
        log.info("memfit: %s", expert_note)
    quantized = bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))
    keep_nf4_layout(model)
    if quantized and any(p.dtype == torch.float16 for p in model.parameters()):
        # PEFT's preparation freezes the base and upcasts every weight it did not quantize
        # to fp32: fp16's range would overflow in the residual stream. Checkpointing is left
        # alone: memfit set it up already (non-reentrant), PEFT would redo it reentrant.
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    elif quantized:
        # A bf16 (or fp32) base stays as loaded. The upcast would make the embeddings and the
        # head fp32 (4 GiB more on Llama-3.1-8B) and with them the whole residual stream (twice
        # the bytes of every saved block input) to guard against an overflow bf16 cannot have;
        # the frozen weights take no update whose precision it could help.
        for parameter in model.parameters():
            parameter.requires_grad_(False)
    if gradient_checkpointing and hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()
    config = peft.LoraConfig(
        r=lora_cfg.lora_r,
        lora_alpha=lora_cfg.lora_alpha,
        lora_dropout=lora_cfg.lora_dropout,
        target_modules=targets.modules,
        target_parameters=targets.experts.parameters or None,
        modules_to_save=targets.experts.routers or None,
        bias="none",
        task_type=task_type,
    )
    with _without_v4_target_conversion(), peft_wrapping_quietly():
        peft_model = peft.get_peft_model(model, config)
    if targets.experts.parameters:
        from memfit.techniques.expert_lora import apply_split_lora

        log.info("memfit: split LoRA on the experts: %s", apply_split_lora(peft_model))
    if getattr(model, "is_loaded_in_4bit", False) and fused_expert_parameter_names(peft_model):
        from memfit.techniques.expert_lora import quantize_fused_experts

        # bitsandbytes left the 3-D expert stacks in the load dtype; memfit holds them in NF4 (expert_quant.py)
        log.info("memfit: QLoRA: %s", quantize_fused_experts(peft_model))
    trainable, total = peft_model.get_nb_trainable_parameters()
    quantize = "4bit" if getattr(model, "is_loaded_in_4bit", False) else "8bit" if quantized else "none"
    modules, expert_weights = adapted_counts(peft_model)
    return peft_model, LoraSummary(lora_cfg.lora_r, modules, trainable, total, quantize, expert_weights,
                                   len(targets.experts.routers))


def lora_facts(model: nn.Module, lora_cfg: LoraConfig) -> dict | None:
    """What trains under LoRA, read from the wrapped model (what the adapter holds), or None without LoRA."""
    if lora_cfg.lora_r <= 0 or not hasattr(model, "get_nb_trainable_parameters"):
        return None
    modules, expert_weights = adapted_counts(model)
    trainable, total = model.get_nb_trainable_parameters()
    routers = [name for name, _ in router_modules(model.get_base_model())]
    trained = [name for name, p in model.get_base_model().named_parameters() if p.requires_grad and "lora_" not in name]
    trained_routers = sum(1 for router in routers if any(name.startswith(router + ".") for name in trained))
    return LoraSummary(lora_cfg.lora_r, modules, trainable, total, lora_cfg.quantize, expert_weights,
                       trained_routers).facts()


def adapted_counts(model: nn.Module) -> tuple[int, int]:
    """(linear layers, fused expert weights) that hold an adapter in `model`: what the log reports."""
    from peft.tuners.lora import LoraLayer
    from peft.tuners.lora.layer import ParamWrapper

    layers = [module for module in model.modules() if isinstance(module, LoraLayer)]
    expert_weights = sum(1 for module in layers if isinstance(module, ParamWrapper))
    return len(layers) - expert_weights, expert_weights


def save_adapter(model: nn.Module, directory: str | Path) -> Path:
    """Write the adapter weights and config in PEFT's format (`PeftModel.from_pretrained` reads them)."""
    directory = Path(directory)
    model.save_pretrained(directory)
    return directory


def load_adapter_weights(model: nn.Module, directory: str | Path) -> None:
    """Load adapter weights saved by `save_adapter` into an already wrapped model (for resume)."""
    from peft import set_peft_model_state_dict
    from peft.utils import load_peft_weights

    result = set_peft_model_state_dict(model, load_peft_weights(str(directory), device="cpu"))
    missing = [key for key in result.missing_keys if "lora_" in key]
    if missing:
        raise UsageError(
            f"adapter in {directory} does not match this model (missing {missing[0]}); check --lora-r and --lora-targets"
        )


def _resolve(facts, run) -> dict:
    lora = facts.config.lora
    changes = {"lora_r": lora.lora_r, "quantize": lora.quantize}
    if lora.quantize != "none" and facts.config.model.dtype == "fp16":
        changes["weight_bytes"] = 4  # PEFT upcasts an fp16 base's unquantized weights, and so the residual stream
    return changes


def _refusals(run, facts) -> list[str]:
    if run.quantize != "none" and run.lora_r == 0:
        return ["--quantize needs LoRA: add --lora-r"]
    if facts.config.model.dtype == "fp16" and run.lora_r == 0:
        return ["--dtype fp16 cannot be trained in full (fp16 gradients underflow); use --dtype bf16, fp32, or LoRA"]
    problems = []
    if facts.engine not in ("", "--sharding ddp"):  # a sharding engine: its shards cannot hold quantized weights
        if run.quantize != "none":
            problems.append(f"--quantize {run.quantize} cannot be sharded by {facts.engine}: use --sharding ddp")
        if facts.config.lora.merge_adapter:
            problems.append(f"--merge-adapter is not supported with {facts.engine}: merge the saved adapter afterwards")
    return problems


def _apply(model: nn.Module, run, context):
    from memfit.techniques.technique import Applied

    if run.lora_r <= 0:
        return Applied()
    # The task's PEFT type: a classification head (new, so never pretrained) trains in full beside the adapters.
    model, summary = apply_lora(model, context.config.lora, gradient_checkpointing=run.checkpointing_on,
                                task_type=context.peft_task_type)
    return Applied(summary.describe(), model=model)


def _memory_terms(run, facts) -> dict[str, float]:
    """QLoRA dequantizes one linear weight at a time (the embedding and head stay 16-bit), or one NF4 expert stack."""
    if run.quantize != "4bit":
        return {}
    import math

    architecture, parts = facts.architecture, facts.parts
    one_linear = 2 * max((math.prod(s) for s in facts.inventory.shapes if len(s) == 2 and architecture.vocab not in s),
                         default=0)
    return {"other": max(one_linear, parts["experts_dequantized_bytes"])}


def _technique():
    from memfit.techniques.technique import Technique

    return Technique(
        name="lora", settings=("lora_r", "quantize"), after=("gradient_checkpointing",),
        resolve=_resolve, refusals=_refusals, apply=_apply, memory_terms=_memory_terms,
        report=lambda run: {"lora_r": run.lora_r, "quantize": run.quantize} if run.lora_r else {},
        summary="low-rank adapters train beside a frozen (or 4/8-bit) base: no gradients or optimizer state for it",
    )


TECHNIQUE = _technique()
