"""What a plan trades, in words, and the command line that runs it.

`trade_offs` names what each technique of a planned configuration costs (recomputation,
host-link traffic, an optimizer that is not AdamW, pure bf16 numerics, RoPE scaling) with the
figures that matter; `train_command` writes the `memfit train` line. What each small-state
optimizer trades is a row of memfit.models.optimizer_state, like its bytes.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from memfit.config import TrainConfig
from memfit.gpus import GpuSpec
from memfit.models.optimizer_state import PLANNING
from memfit.prediction.activations import architecture_of
from memfit.prediction.estimate_result import CUDA_CONTEXT_BYTES, FRAGMENTATION, Estimate
from memfit.prediction.expert_streaming import streaming_trades
from memfit.prediction.plan_result import Candidate
from memfit.prediction.qlora_levers import lever_trades
from memfit.prediction.speed_model import lever_step_seconds
from memfit.units import GIB


def trade_offs(candidate: Candidate, config: TrainConfig, hf_config: Any, gpu: GpuSpec | None,
               host_limit: int | None = None, memory_seq_len: int | None = None) -> list[str]:
    """What each technique of the plan costs, in plain words with the figures that matter."""
    link = (gpu.host_link_gbps if gpu is not None else 16.0) * 1e9
    return (_training_trades(candidate, config, gpu, link) + _step_trades(candidate, config, hf_config, gpu, link)
            + _memory_trades(candidate.estimate, host_limit) + _rope_trades(config, hf_config, memory_seq_len))


def _training_trades(candidate: Candidate, config: TrainConfig, gpu: GpuSpec | None, link: float) -> list[str]:
    """What the plan changes about what is trained and how it is updated: LoRA, bf16 weights, the optimizer."""
    c, est = candidate.changes, candidate.estimate
    lines = []
    if c.get("lora_r"):
        what = "QLoRA: the base weights are frozen in 4-bit nf4" if c.get("quantize") == "4bit" else "LoRA: the base weights are frozen"
        lines.append(f"{what}; only rank-{c['lora_r']} adapters train")
    elif c.get("dtype") == "bf16":
        lines.append("pure bf16 weights (no fp32 master copy): updates smaller than about 1/256 of a weight round away;"
                     " numerics differ from fp32 training")
    if c.get("optimizer") in ("adamw-8bit", "paged-adamw-8bit"):
        lines.append("8-bit AdamW: moments stored block-quantized (bitsandbytes), close to but not equal to AdamW")
    if c.get("optimizer") in PLANNING:
        lines.append(small_state_trade(c, config, est))
    if c.get("optimizer") == "paged-adamw-8bit" and gpu is not None:
        state = est.host_breakdown.get("optimizer_states", 0)
        lines.append(f"paged optimizer state: {state / GIB:.1f} GiB in CUDA unified memory, paged to host when the GPU"
                     f" is full; up to {2 * state / link:.2f} s of host-link traffic per step")
    if c.get("optimizer_in_backward"):
        lines.append("optimizer in backward: each weight is updated as its gradient arrives; no gradient accumulation,"
                     " no global gradient clipping (--max-grad-norm 0)")
    if c.get("optimizer_offload"):
        lines.append(f"optimizer offload: state and step on the CPU ({est.host_breakdown.get('optimizer_states', 0) / GIB:.1f}"
                     " GiB of host memory); gradients and weights cross the host link every step; no clipping")
    return lines


def _step_trades(candidate: Candidate, config: TrainConfig, hf_config: Any, gpu: GpuSpec | None,
                 link: float) -> list[str]:
    """What the plan's step runs again or moves over the host link: offload, the frozen-weight levers, streamed
    experts, checkpointing, tiles, the chunked loss, compiled blocks."""
    c, est = candidate.changes, candidate.estimate
    lines = []
    if c.get("activation_offload"):
        moved = est.details.get("pcie_bytes_per_micro_batch", 0)
        blocks = c.get("activation_offload_blocks")
        layers = architecture_of(hf_config).layers
        what = "activation offload" if blocks is None else (
            f"activation offload of the first {blocks} of {layers} blocks' inputs (the last {max(0, layers - blocks)}"
            " and the head's stay on the device)")
        lines.append(f"{what}: {est.host_breakdown.get('activations', 0) / GIB:.1f} GiB of pinned host memory;"
                     f" {moved / GIB:.1f} GiB over the host link per micro-batch ({moved / link:.2f} s at"
                     f" {link / 1e9:.0f} GB/s, overlapped with compute where the copies allow)")
    lines += lever_trades(c, est, hf_config, lever_step_seconds(c, config, hf_config, gpu))  # embedding on host, NF4 head, groups
    lines += streaming_trades(c, est, link)  # --expert-offload
    if c.get("gradient_checkpointing") == "full":
        lines.append("full checkpointing: each block's forward runs again in backward (about +33 % compute)")
    elif c.get("gradient_checkpointing") == "selective":
        lines.append("selective checkpointing: cheap operations are recomputed in backward (about +5 % compute)")
    if c.get("tiled_mlp"):
        lines.append(f"tiled MLP: {c['tiled_mlp']} sequence tiles, each recomputed in backward (one more MLP forward)")
    if c.get("loss_chunk_size"):
        lines.append(f"chunked loss ({c['loss_chunk_size']} tokens): the output projection runs again in backward")
    if c.get("compile"):
        lines.append("compiled blocks (--compile): the first step compiles one block with torch.compile (tens of"
                     " seconds on a CPU, once per run), which the planned tokens/s leave out")
    return lines


def _memory_trades(est: Estimate, host_limit: int | None) -> list[str]:
    """What the device peak is made of on a GPU, and the host memory the plan needs against this machine's."""
    lines = []
    allocated = est.details.get("allocated_peak_bytes")
    if allocated:
        lines.append(f"peak {est.peak_bytes / GIB:.2f} GiB: {allocated / GIB:.2f} GiB allocated to tensors (what"
                     f" torch.cuda.max_memory_allocated reports) + {CUDA_CONTEXT_BYTES / GIB:.1f} GiB CUDA context +"
                     f" {100 * FRAGMENTATION:.0f} % allocator slack")
    if est.host_bytes:
        host_gib = est.host_bytes / GIB
        available = est.host_available_bytes
        limit = f" (planned within {host_limit / GIB:.0f} GiB of host memory)" if host_limit else ""
        if available is None:
            lines.append(f"needs {host_gib:.1f} GiB of host memory{limit}; this machine's could not be read")
        else:
            verdict = "enough" if est.host_bytes <= available else "NOT enough"
            lines.append(f"needs {host_gib:.1f} GiB of host memory{limit}; this machine has {available / GIB:.1f} GiB"
                         f" available now ({verdict} here)")
    return lines


def _rope_trades(config: TrainConfig, hf_config: Any, memory_seq_len: int | None) -> list[str]:
    """RoPE scaling's change of numerics, and how far memory alone would take the context past the positions."""
    from memfit.models.rope import can_scale, scaled_positions, suggested_scale

    lines = []
    own = scaled_positions(hf_config, None)
    trained = scaled_positions(hf_config, config.model.rope_scale, config.model.rope_scaling)
    scale = config.model.rope_scale
    if scale is not None and scale != 1:
        lines.append(f"RoPE scaling x{scale:g} (--rope-scale): the model's {own:,} positions become {trained:,}; the"
                     " rotary numerics change at every position, so this is a context-extension fine-tune")
    if memory_seq_len and trained and memory_seq_len > trained:
        where = f"the model handles {trained:,} positions" if scale is None else (
            f"--rope-scale {scale:g} gives the model {trained:,} positions")
        extend = ""
        if can_scale(hf_config):
            factor = suggested_scale(own, memory_seq_len)
            extend = (f"; --rope-scale {factor} extends them to {own * factor:,} (RoPE scaling, a context-extension"
                      " fine-tune)")
        lines.append(f"memory alone would allow {memory_seq_len:,} tokens, but {where} (memfit train refuses longer"
                     f" windows){extend}")
    return lines


def small_state_trade(changes: dict[str, Any], config: TrainConfig, est: Estimate) -> str:
    """What a small-state optimizer of the plan trades, with its state's size."""
    from dataclasses import replace

    from memfit.models.optimizer_state import projection_settings

    keys = ("optimizer", "optim_target_modules", "optim_rank", "optim_update_proj_gap", "optim_scale")
    optimizer = replace(config.optimizer, **{k: changes[k] for k in keys if k in changes})
    settings = projection_settings(optimizer)
    line = PLANNING[optimizer.optimizer].trade.format(
        rank=getattr(settings, "rank", 0), gap=getattr(settings, "update_proj_gap", 0),
        targets={"all": "every matrix, embeddings and head included", "all-linear": "every Linear weight"}.get(
            getattr(settings, "target_modules", ""), getattr(settings, "target_modules", "")))
    return f"{line}; optimizer state {est.details['full_bytes']['optimizer_states'] / GIB:.2f} GiB"


_KEPT_SECTIONS = ("data", "task", "rl")
"""What is learned and from which data: settings the plan never changes but the command must carry."""
_NOT_KEPT = frozenset({"seq_len", "dataset", "cache_dir"})


def _kept_settings(config: TrainConfig, changes: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """The task's, the RL objective's and the data's settings that differ from memfit's defaults and the plan leaves alone."""
    kept = {}
    for section in _KEPT_SECTIONS:
        for name, value in dataclasses.asdict(getattr(config, section)).items():
            if name in changes or name in _NOT_KEPT or value == defaults.get(name):
                continue
            if config.derived and name in config.derived:
                continue  # chosen by memfit from another setting: the command's own run derives it again
            kept[name] = value
    return kept


def _flag(name: str, value: Any) -> list[str]:
    """`--name value`, or `--name` alone for a switch that is on (nothing for one that is off)."""
    flag = "--" + name.replace("_", "-")
    if isinstance(value, bool):
        return [flag] if value else []
    return [flag, str(value)]


def train_command(config: TrainConfig, changes: dict[str, Any], gpu: GpuSpec | None, budget: int | None,
                  world_size: int = 1) -> str:
    """The `memfit train ...` command line that runs the plan."""
    seq_len = changes.get("seq_len", config.data.seq_len_or_default)
    parts = ["memfit", "train", "--model", config.model.model, "--seq-len", str(seq_len)]
    if config.data.dataset:
        parts += ["--dataset", config.data.dataset]
    defaults = TrainConfig().flat()
    for name, value in _kept_settings(config, changes, defaults).items():
        parts += _flag(name, value)
    for name, value in changes.items():
        if name == "seq_len":
            continue
        if name in ("lora_r", "quantize", "dtype", "lora_targets") and value == defaults.get(name):
            continue
        if name == "tiled_mlp" and not value and seq_len <= 8192:
            continue  # the automatic setting does not tile at this length either
        if value is None:
            continue  # the default (activation_offload_blocks: every block and the head offloaded)
        parts += _flag(name, value)
    if world_size > 1:
        return f"torchrun --nproc-per-node {world_size} -m " + " ".join(parts) + " --sharding fsdp"
    return " ".join(parts)
