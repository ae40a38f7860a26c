"""What the planner tries: every combination of memory techniques worth estimating for a mode.

A mode is full fine-tuning, LoRA or QLoRA; `technique_grid` gives the flat config changes of
each combination (precision, optimizer, checkpointing, offload, tiled MLP, loss chunk, compile,
and the values registered techniques offer through the registry), which
`memfit.prediction.planner` estimates, times and ranks.
"""

from __future__ import annotations

import itertools
from typing import Any

from memfit.config import TrainConfig
from memfit.gpus import GpuSpec
from memfit.models.optimizer_state import PLANNING
from memfit.resolution.registry import techniques
from memfit.techniques.technique import PlannerFacts

DEFAULT_LORA_RANK = 16


def modes_of(allow: str) -> list[str]:
    return {"full": ["full"], "lora": ["lora"], "qlora": ["qlora"], "any": ["full", "lora", "qlora"],
            "auto": ["full", "lora", "qlora"]}[allow]


def mode_changes(mode: str, config: TrainConfig) -> dict[str, Any]:
    rank = config.lora.lora_r or DEFAULT_LORA_RANK
    if mode == "full":
        return {"lora_r": 0, "quantize": "none"}
    # A frozen base needs no fp32 master copy: store it in bf16.
    return {"lora_r": rank, "quantize": "4bit" if mode == "qlora" else "none", "dtype": "bf16",
            "lora_targets": config.lora.lora_targets}


def user_set(config: TrainConfig, name: str) -> bool:
    """Whether the user gave `name` (configs built in code: whether it differs from the default)."""
    names = getattr(config, "user_set", None)
    if names is not None:
        return name in names
    return TrainConfig().flat().get(name) != config.flat()[name]


def technique_grid(mode: str, config: TrainConfig, gpu: GpuSpec | None, seq_len: int, accumulation: int,
                   long_context: bool = False, hf_config: Any = None) -> list[dict[str, Any]]:
    """Every combination of memory techniques worth estimating for `mode` (flat config changes).

    Offloading and paged state need a GPU (on a CPU everything is host memory already);
    optimizer-in-backward needs one micro-batch per step and no fp16 loss scaling; tiled
    MLP is tried where this memfit has it and the sequence is long. The chunked loss is
    tried in chunks of 1024 and 256 tokens (a large vocabulary's chunk of 1024 can be most
    of a small budget). `--compile` changes time, not memory: every combination gets it
    where the speed model measured its gain, the run is long enough to repay the compile time
    and it can run (`speed_model.compile_planned`; needs `hf_config`), unless the user chose.
    """
    from memfit.prediction.qlora_levers import lever_changes
    from memfit.prediction.run_shape import resolve_mlp_tiles, tiled_mlp_available
    from memfit.prediction.speed_model import compile_planned
    from memfit.techniques.loss import DEFAULT_LOSS_CHUNK_TOKENS

    cuda = gpu is not None
    full = mode == "full"
    dtypes = [config.model.dtype] if not full else (["fp32", "bf16"] if cuda and gpu.bf16 else [config.model.dtype])
    optimizers = ["adamw", "adamw-8bit"] + (["paged-adamw-8bit"] if cuda and full else [])
    if full:  # states a fraction of AdamW's (they need the full weights: LoRA is refused with most)
        optimizers += [name for name, facts in PLANNING.items() if facts.planned]
    in_backward = [False] + ([True] if accumulation == 1 and (gpu is None or gpu.bf16) else [])
    offloads = [False, True] if cuda else [False]
    compiled = (config.memory.compile if user_set(config, "compile")
                else compile_planned("cuda" if cuda else "cpu", config, hf_config))
    tiles = [0]
    if tiled_mlp_available() and (long_context or seq_len >= 4096):
        tiles.append(max(2, resolve_mlp_tiles(None, seq_len) or 2))
        if long_context:
            # tiles of half the automatic length: half the MLP working set in backward, where
            # the longest context is bound by the recomputed block
            tiles.append(2 * tiles[-1])
    grid = []
    for dtype, optimizer, oib, checkpointing, act_offload, tile, chunk, opt_offload in itertools.product(
        dtypes, optimizers, in_backward, ("off", "selective", "full"), offloads, tiles,
        (0, DEFAULT_LOSS_CHUNK_TOKENS, DEFAULT_LOSS_CHUNK_TOKENS // 4), offloads,
    ):
        if opt_offload and (not full or optimizer != "adamw"):
            continue  # CPU offload steps torch's AdamW on host copies (per step, or per parameter in backward)
        if optimizer == "galore-adamw" and oib and not cuda:
            continue  # on a CPU the SVD of each refresh dominates either way: one GaLore entry is enough
        if act_offload and checkpointing == "selective":
            continue  # the kept matmul outputs would all cross the host link: full checkpointing does better
        changes = {"gradient_checkpointing": checkpointing, "optimizer": optimizer, "loss_chunk_size": chunk,
                   "optimizer_offload": opt_offload, "optimizer_in_backward": oib,
                   "activation_offload": act_offload, "tiled_mlp": tile, "compile": compiled,
                   **mode_changes(mode, config)}
        if full:
            changes["dtype"] = dtype
        if oib or opt_offload:
            changes["max_grad_norm"] = 0.0  # neither sees all gradients before they are applied
        if optimizer in PLANNING and PLANNING[optimizer].planned_targets and not user_set(
                config, "optim_target_modules"):
            changes["optim_target_modules"] = PLANNING[optimizer].planned_targets
        grid.append(changes)
        if act_offload and oib and full and checkpointing == "full" and not user_set(config, "activation_offload_blocks"):
            # In backward an untied head is stepped with every checkpoint live: offloading them all lowers that
            # moment, where the fewest blocks that fit (the planner's default) would leave them on the device
            grid.append({**changes, "activation_offload_blocks": None})
    levers = lever_changes(mode, config, hf_config, user_set)  # frozen weights off the device (prediction/qlora_levers.py)
    if levers:  # tried with full checkpointing and a chunked loss, where the rest of memory is already smallest
        grid += [{**c, **levers} for c in grid if c["gradient_checkpointing"] == "full" and c["loss_chunk_size"]]
    from memfit.prediction.expert_streaming import streaming_changes

    streaming = streaming_changes(mode, config, hf_config, user_set)  # frozen experts from host memory per layer
    if streaming:  # it needs checkpointing; tried where the rest of memory is already smallest
        grid += [{**c, **streaming} for c in grid if c["gradient_checkpointing"] == "full" and c["loss_chunk_size"]]
    from memfit.prediction.preference_step import pair_layout_lever, reference_lever

    reference = reference_lever(config, mode, lambda name: user_set(config, name))
    if reference:  # a preference run's frozen copy, or its log-probabilities computed once before training
        grid += [{**changes, **reference} for changes in grid]
    layout = pair_layout_lever(config, lambda name: user_set(config, name))
    if layout:  # a preference pair's two sides in two forwards: one side's activations, one more forward
        grid += [{**changes, **layout} for changes in grid]
    if not cuda and config.memory.precision == "auto" and not user_set(config, "precision"):
        from memfit.prediction.calibration import native_bf16

        if native_bf16("cpu"):  # bf16 autocast where this CPU's matrix units run it (AVX-512 bf16, AMX)
            grid += [{**changes, "precision": "amp"} for changes in grid]
    facts = PlannerFacts(config=config, hf_config=hf_config, device_type="cuda" if cuda else "cpu",
                         bf16_supported=gpu.bf16 if cuda else True, mode=mode, seq_len=seq_len,
                         accumulation=accumulation, long_context=long_context)
    return with_planner_values(grid, facts)


def with_planner_values(grid: list[dict[str, Any]], facts: PlannerFacts) -> list[dict[str, Any]]:
    """`grid` with a variant of each combination for each value a registered technique offers (its TECHNIQUE's
    `planner_values`), technique after technique: two techniques with two values each make four variants.

    A value that changes a setting the user gave is not offered: what the user chose stays, as for the built-in
    choices above. memfit's own techniques offer nothing here: their values are the grid above, whose order is
    the order in which the plan command writes their flags and breaks ties between equally fast plans.
    """
    for technique in techniques():
        if technique.planner_values is None:
            continue
        offered = [change for change in technique.planner_values(facts)
                   if not any(user_set(facts.config, name) for name in change)]
        if offered:
            grid = [{**combination, **change} for combination in grid for change in offered]
    return grid
