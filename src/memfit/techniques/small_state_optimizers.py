"""GaLore, APOLLO, Adam-mini and torchao's 4-bit AdamW: optimizers whose state is a fraction of AdamW's.

`--optimizer galore-adamw | galore-adamw-8bit | apollo-adamw | apollo-mini | adam-mini | adamw-4bit`
(the Trainer's optim names galore_adamw, apollo_adamw, adam_mini, adamw_torch_4bit are aliases).

Saves (bytes per optimizer, memfit.models.optimizer_state): GaLore and APOLLO keep AdamW's moments of
a rank-r projection of each selected matrix (--optim-target-modules) plus the projection itself, so a
4096 x 14336 MLP weight at rank 128 keeps 3.6 % of AdamW's state, APOLLO-Mini (rank 1) 0.03 %;
Adam-mini keeps the first moment and one second moment per head or row (about half of AdamW); 4-bit
AdamW keeps both moments in 4 bits (about 1/7 of fp32 AdamW's).
Costs: the low-rank updates are not AdamW's (the moments see only the projected gradient; GaLore
refreshes its projection by an SVD every --optim-update-proj-gap steps, which a step pays for then);
Adam-mini shares one learning rate per block; 4-bit moments are rounded, and torchao compiles its
step the first time each shape steps (tens of seconds on a CPU).

The implementations are the authors' packages (galore-torch, apollo-torch, adam-mini) and torchao;
memfit adds what a training run needs around them: the projections and their refresh state in the
checkpoint as plain tensors (resumes are exact and load with weights_only=True), the per-parameter
form for --optimizer-in-backward (the layer-wise form these methods were designed for), and a
one-line refusal where they cannot run (LoRA, FSDP2 or DeepSpeed shards).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from memfit.config import OptimizerConfig
from memfit.errors import UsageError
from memfit.models.optimizer_state import (
    SMALL_STATE_OPTIMIZERS,
    LowRankSettings,
    check_target_modules,
    is_projected,
    low_rank_settings,
    named_trainable,
)

log = logging.getLogger("memfit")

PACKAGES = {"galore": ("galore_torch", "galore-torch"), "apollo": ("apollo_torch", "apollo-torch"),
            "adam-mini": ("adam_mini", "adam-mini"), "adamw-4bit": ("torchao", "torchao")}


def _package(optimizer: str) -> str:
    return "galore" if optimizer.startswith("galore") else "apollo" if optimizer.startswith("apollo") else optimizer


def _import(optimizer: str):
    module, dist = PACKAGES[_package(optimizer)]
    try:
        return __import__(module)
    except ImportError:
        raise UsageError(f"--optimizer {optimizer} needs {dist}: pip install 'memfit[lowmem-optim]'"
                         f" (or pip install {dist})") from None


class _PlainStateDict:
    """Optimizer state as tensors and numbers only, so a checkpoint loads with weights_only=True.

    GaLore and APOLLO keep each projection in a Python object; its matrix (and APOLLO's seed of the
    next random matrix) are what a resume needs besides the step, which already decides the refresh.
    They are saved as `projection` / `projection_seed` and the object is rebuilt on load.
    """

    def _new_projector(self, group: dict, state: dict):  # pragma: no cover - each class defines it
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        saved = super().state_dict()
        plain = {}
        for index, state in saved["state"].items():
            state = dict(state)  # Optimizer.state_dict shares the live dicts: never edit them
            projector = state.pop("projector", None)
            if projector is not None:
                state["projection"] = projector.ortho_matrix  # the live state's own key (see step)
                if hasattr(projector, "seed"):
                    state["projection_seed"] = projector.seed
                    state["projection_svd_count"] = projector.svd_count
            plain[index] = state
        return {**saved, "state": plain}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            for parameter in group["params"]:
                state = self.state.get(parameter, {})
                if "projection" not in state:
                    continue
                projector = self._new_projector(group, state)
                projector.ortho_matrix = state["projection"]
                if "projection_seed" in state:
                    projector.seed = state.pop("projection_seed")
                    projector.svd_count = state.pop("projection_svd_count")
                state["projector"] = projector

    def step(self, closure=None):
        loss = super().step(closure)
        for state in self.state.values():
            projector = state.get("projector")
            if projector is None:
                continue
            matrix = projector.ortho_matrix
            if matrix.untyped_storage().nbytes() > matrix.numel() * matrix.element_size():
                # galore-torch keeps fp32 projections as a slice of the SVD's square factor (min(m, n)^2
                # values: 64 MiB per 4096-wide matrix): keep the slice alone, as it does for bf16.
                matrix = projector.ortho_matrix = _compact_copy(matrix)
            state["projection"] = matrix  # named in the state so that memory accounting sees it as optimizer state
        return loss


def _compact_copy(matrix: torch.Tensor) -> torch.Tensor:
    """A copy holding only `matrix`'s values, in the same order (row- or column-major): the matmuls that use it
    then run the same kernels and round the same way as on the slice."""
    rows, columns = matrix.shape
    strides = (1, rows) if matrix.stride(0) == 1 and columns > 1 else (columns, 1)
    return torch.empty_strided(matrix.shape, strides, dtype=matrix.dtype, device=matrix.device).copy_(matrix)


def _classes(optimizer: str) -> type[torch.optim.Optimizer]:
    """The library's optimizer class with plain-tensor checkpoints."""
    _import(optimizer)
    if optimizer.startswith("galore"):
        from galore_torch import GaLoreAdamW, GaLoreAdamW8bit
        from galore_torch.galore_projector import GaLoreProjector

        base = GaLoreAdamW8bit if optimizer.endswith("8bit") else GaLoreAdamW

        class GaLore(_PlainStateDict, base):
            def _new_projector(self, group, state):
                return GaLoreProjector(group["rank"], update_proj_gap=group["update_proj_gap"], scale=group["scale"],
                                       proj_type=group["proj_type"])

        return GaLore
    from apollo_torch import APOLLOAdamW

    from memfit.techniques.apollo_step import InPlaceApolloStep

    class Apollo(_PlainStateDict, InPlaceApolloStep, APOLLOAdamW):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.seeds = {p: state["seed"] for p, state in self.state.items() if "seed" in state}

        def set_seed(self, parameter, seed: int) -> None:
            self.seeds[parameter] = self.state[parameter]["seed"] = seed

        def step(self, closure=None):
            # APOLLO keeps each matrix's seed in the state from its constructor on; memfit's OOM recovery
            # clears the state before the first step is retried: give the seeds back.
            for parameter, seed in self.seeds.items():
                self.state[parameter].setdefault("seed", seed)
            return super().step(closure)

        def _new_projector(self, group, state):
            return self._initialize_projector(group, state)

    return Apollo


def _low_rank_groups(model: torch.nn.Module, groups: list[dict], settings: LowRankSettings,
                     optimizer: str) -> list[dict]:
    """memfit's groups (weight decay on matrices) split into projected and full-moment parameters."""
    tensors = named_trainable(model)
    check_target_modules(tensors, settings.target_modules)
    names = {id(p): name for name, p in model.named_parameters()}
    projected = {t.name for t in tensors if is_projected(t, settings.target_modules)}
    split = []
    for group in groups:
        options = {k: v for k, v in group.items() if k != "params"}
        plain = [p for p in group["params"] if names.get(id(p)) not in projected]
        low = [p for p in group["params"] if names.get(id(p)) in projected]
        if plain:
            split.append({"params": plain, **options})
        if low:
            split.append({"params": low, **options, **settings.group_options(optimizer)})
    return split


def _adam_mini_kwargs(model: torch.nn.Module, config: OptimizerConfig) -> dict[str, Any]:
    hf = getattr(model, "config", None)
    dim, heads = getattr(hf, "hidden_size", None), getattr(hf, "num_attention_heads", None)
    if not dim or not heads:
        raise UsageError("--optimizer adam-mini needs a transformer with hidden_size and num_attention_heads in its"
                         " config: use --optimizer adamw-4bit for small state on this model")
    return {"lr": config.lr, "betas": (config.beta1, config.beta2), "eps": config.eps,
            "weight_decay": config.weight_decay, "dim": dim, "n_heads": heads,
            "n_kv_heads": getattr(hf, "num_key_value_heads", None) or heads, "verbose": False}


def _check_adam_mini_heads(model: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """Adam-mini views each query/key weight as heads of dim*dim/n_heads values: refuse where that does not divide."""
    from memfit.models.optimizer_state import adam_mini_block_count

    head_block = kwargs["dim"] * kwargs["dim"] // kwargs["n_heads"]
    for tensor in named_trainable(model):
        if adam_mini_block_count(tensor, head_block) * head_block != tensor.numel and (
                "q_proj" in tensor.name or "k_proj" in tensor.name):
            raise UsageError(f"--optimizer adam-mini cannot split {tensor.name} {tensor.shape} into heads of"
                             f" {head_block} values (head size x heads != hidden size): use --optimizer adamw-4bit")


def _compile_4bit_steps_per_rank(groups: list[dict]) -> None:
    """Under FSDP2 each rank quantizes its own shard, so a moment can be 4-bit on one rank and full precision on
    another inside DTensors that look alike; AOT autograd's on-disk cache, shared by a machine's ranks, does not
    tell them apart and hands one rank the other's compiled step ("'Tensor' object has no attribute 'codes'", seen
    with torch 2.13 and torchao 0.18). Each process compiles its own step instead: off for this process."""
    from torch.distributed.tensor import DTensor

    if any(isinstance(p, DTensor) for group in groups for p in group["params"]):
        import torch._functorch.config as functorch_config

        if functorch_config.enable_autograd_cache:
            functorch_config.enable_autograd_cache = False
            log.info("memfit: adamw-4bit under FSDP2: AOT autograd's on-disk cache is off in this process (ranks"
                     " quantize different shards and would share compiled steps)")


def build_small_state_optimizer(model: torch.nn.Module, groups: list[dict], config: OptimizerConfig,
                                device: torch.device) -> tuple[torch.optim.Optimizer, str, str]:
    """(optimizer, what runs, why it differs from the request) for one of SMALL_STATE_OPTIMIZERS."""
    name = config.optimizer
    betas = (config.beta1, config.beta2)
    if name == "adamw-4bit":
        _import(name)
        from torchao.optim import AdamW4bit

        _compile_4bit_steps_per_rank(groups)
        return AdamW4bit(groups, lr=config.lr, betas=betas, eps=config.eps, weight_decay=config.weight_decay), \
            "adamw-4bit (torchao)", ""
    if name == "adam-mini":
        _import(name)
        from adam_mini import Adam_mini

        kwargs = _adam_mini_kwargs(model, config)
        _check_adam_mini_heads(model, kwargs)
        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        return Adam_mini(trainable, **kwargs), "adam-mini", ""
    settings = low_rank_settings(config)
    run, reason = _low_rank_choice(name, device)
    optimizer = _classes(run)(_low_rank_groups(model, groups, settings, run), lr=config.lr, betas=betas, eps=config.eps,
                              weight_decay=config.weight_decay, **_library_kwargs(run))
    return optimizer, f"{name if not reason else run} (rank {settings.rank})", reason


def _low_rank_choice(name: str, device: torch.device) -> tuple[str, str]:
    if name == "galore-adamw-8bit" and device.type != "cuda":
        # galore-torch's 8-bit step synchronizes CUDA after each tensor (bitsandbytes' kernels).
        reason = "galore-adamw-8bit needs CUDA (galore-torch's 8-bit step); galore-adamw ran (fp moments)"
        log.warning("memfit: %s", reason)
        return "galore-adamw", reason
    if name == "galore-adamw-8bit":
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            raise UsageError("--optimizer galore-adamw-8bit needs bitsandbytes: pip install 'memfit[bnb]'") from None
    return name, ""


def _library_kwargs(optimizer: str) -> dict[str, Any]:
    if optimizer == "galore-adamw":
        return {"no_deprecation_warning": True}
    if optimizer.startswith("apollo"):
        return {"scale_front": False}
    return {}


def in_backward_factory(model: torch.nn.Module, groups: list[dict], config: OptimizerConfig,
                        device: torch.device) -> tuple[list[dict], Callable[[list], torch.optim.Optimizer], list[str]]:
    """(groups, per-parameter factory, what runs) for OptimizerInBackward with one of SMALL_STATE_OPTIMIZERS.

    Each parameter's optimizer is the library's own over that one parameter: GaLore and APOLLO
    with the projected group's options (OptimizerInBackward copies a group's options onto the
    optimizer it builds), Adam-mini with the parameter's name (its partition reads names), APOLLO
    with the seed the whole-model optimizer would give the parameter.
    """
    name = config.optimizer
    betas = (config.beta1, config.beta2)
    ran: list[str] = []
    if name == "adamw-4bit":
        _import(name)
        from torchao.optim import AdamW4bit

        ran.append("adamw-4bit (torchao)")
        return groups, lambda params: AdamW4bit(params, lr=config.lr, betas=betas, eps=config.eps,
                                                weight_decay=config.weight_decay), ran
    if name == "adam-mini":
        _import(name)
        from adam_mini import Adam_mini

        kwargs = _adam_mini_kwargs(model, config)
        _check_adam_mini_heads(model, kwargs)
        names = {id(p): n for n, p in model.named_parameters()}
        ran.append("adam-mini")
        # Adam-mini sets each block's weight decay from its name: the groups carry no options.
        plain = [{"params": [p for group in groups for p in group["params"]]}]
        return plain, lambda params: Adam_mini([(names[id(params[0])], params[0])], **kwargs), ran
    settings = low_rank_settings(config)
    run, reason = _low_rank_choice(name, device)
    ran.append(f"{name if not reason else run} (rank {settings.rank})")
    split = _low_rank_groups(model, groups, settings, run)
    positions = {id(p): i for i, p in enumerate((p for group in split for p in group["params"]), start=1)}
    cls = _classes(run)

    def make(params: list) -> torch.optim.Optimizer:
        optimizer = cls([{"params": params}], lr=config.lr, betas=betas, eps=config.eps,
                        weight_decay=config.weight_decay, **_library_kwargs(run))
        if hasattr(optimizer, "set_seed"):
            # APOLLO seeds each random projection by the parameter's position in its optimizer (1 here)
            optimizer.set_seed(params[0], positions[id(params[0])])
        return optimizer

    if reason:
        ran.append(reason)
    return split, make, ran


def is_small_state(optimizer: str) -> bool:
    return optimizer in SMALL_STATE_OPTIMIZERS


def build_run_optimizer(model: torch.nn.Module, groups: list[dict], config: OptimizerConfig, device: torch.device,
                        in_backward: bool, fallbacks: dict) -> Any:
    """The OptimizerChoice of a run with one of SMALL_STATE_OPTIMIZERS, stepped at the end or in backward."""
    from memfit.techniques.optimizers import OptimizerChoice

    if in_backward:
        from memfit.techniques.optimizer_in_backward import OptimizerInBackward

        split, make, ran = in_backward_factory(model, groups, config, device)
        optimizer = OptimizerInBackward(split, make)
        name, reason = ran[0] + " in backward", ran[1] if len(ran) > 1 else ""
    else:
        optimizer, name, reason = build_small_state_optimizer(model, groups, config, device)
    if reason:
        fallbacks["optimizer"] = reason
    return OptimizerChoice(optimizer, name, reason)
