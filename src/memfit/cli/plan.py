"""`memfit plan`: the fastest configuration that fits a GPU or a memory budget."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from memfit.cli.flags import parse_command_line
from memfit.cli.help_text import CommandHelp, answer_help
from memfit.units import format_bytes

SUMMARY = (
    "Search micro-batch, checkpointing, precision, 8-bit optimizer, chunked loss, offload, LoRA/QLoRA for the fastest setup that fits.\n"
    "Without --seq-len it plans 256 tokens a sample, or with --dataset the length memfit train takes from the data."
)


@dataclass
class PlanOptions:
    allow: str = field(default="auto", metadata={"choices": ("auto", "full", "lora", "qlora", "any")})
    """What may be trained: full, lora, qlora, any; auto: full if it fits, else LoRA, else QLoRA."""
    json: bool = False
    """Print one JSON object on stdout and nothing else."""
    world_size: int = 1
    """Devices to plan for; above 1 the state is sharded (FSDP / ZeRO-3)."""
    gpus: int | None = None
    """GPUs to plan for (same as --world-size); with --maximize seq-len they are also tried as context-parallel groups."""
    maximize: str | None = field(default=None, metadata={"choices": ("seq-len", "batch-size", "completion-length")})
    """seq-len: the longest context that fits (micro-batch 1 unless --batch-size is given); batch-size: the largest micro-batch at --seq-len; completion-length (--task grpo): the longest --max-completion-length that fits. Default: the fastest setup at --seq-len."""
    host_memory: int | None = field(default=None, metadata={"size": True})
    """Host memory of the training machine, for offloaded activations and optimizer state (e.g. 64GiB); default: this machine's."""


HELP = CommandHelp(
    "plan", "memfit plan (--gpu GPU | --memory-budget SIZE) [--FLAG VALUE ...]", SUMMARY, (PlanOptions,),
    first=("config", "model", "dataset", "seq_len", "gpu", "memory_budget", "batch_size", "precision"),
    first_title="the training flags it reads most (it takes every memfit train flag):",
)


def run(argv: list[str]) -> int:
    if (code := answer_help(argv, HELP)) is not None:
        return code
    from memfit.prediction.planner import plan

    config, extras = parse_command_line(argv, extras=[PlanOptions])
    from memfit.models.model_names import check_model_flags

    check_model_flags(config, weights=False)  # no such model: one line, before anything is read
    options: PlanOptions = extras[PlanOptions]
    basis = None
    if config.data.dataset and "dataset" in (config.user_set or ()):  # plan from the data's own lengths
        from memfit.cli.data import describe_plan_basis, plan_from_dataset
        from memfit.cli.output import stdout_to_stderr

        with stdout_to_stderr(options.json):
            config, basis = plan_from_dataset(config)
    config = config.with_seq_len()  # not given and no dataset: 256 (trials cached for this length match)
    sharding = "zero3" if config.distributed.zero_stage == 3 else config.distributed.sharding
    result = plan(config, allow=options.allow, world_size=options.gpus or options.world_size, sharding=sharding,
                  maximize=options.maximize, host_memory=options.host_memory)
    from memfit.train.trials import attach_cached

    attach_cached(config, result)  # what earlier trials on this device measured of these plans
    if options.json:
        sys.stdout.write(json.dumps(result.to_dict() | ({"dataset_lengths": basis} if basis else {})) + "\n")
        return 0
    if basis:
        print(describe_plan_basis(config.data.dataset, basis))
    print(render(result))
    return 0


def _describe(changes: dict) -> str:
    from memfit.prediction.rl_plan import describe_generation

    mode = "full" if not changes.get("lora_r") else ("QLoRA" if changes.get("quantize") == "4bit" else "LoRA")
    parts = [
        mode + (" (bf16 weights)" if mode == "full" and changes.get("dtype") == "bf16" else ""),
        f"seq-len {changes['seq_len']:,}" if "seq_len" in changes else "",
        f"micro-batch {changes['batch_size']} x {changes['gradient_accumulation_steps']} accumulation",
        f"precision {changes['precision']}" if changes.get("precision", "auto") != "auto" else "",
        f"checkpointing {changes['gradient_checkpointing']}",
        changes["optimizer"],
        f"loss chunk {changes['loss_chunk_size'] or 'off'}",
    ]
    for name, text in (("optimizer_offload", "optimizer offload"), ("optimizer_in_backward", "optimizer in backward"),
                       ("activation_offload", "activation offload")):
        if changes.get(name):
            parts.append(text)
    if changes.get("activation_offload") and changes.get("activation_offload_blocks") is not None:
        parts[-1] += f" (first {changes['activation_offload_blocks']} blocks)"
    if changes.get("expert_offload"):
        parts.append("experts streamed from host")
    if changes.get("tiled_mlp"):
        parts.append(f"tiled MLP x{changes['tiled_mlp']}")
    if changes.get("rope_scale"):
        parts.append(f"RoPE scale x{changes['rope_scale']:g}")
    if changes.get("context_parallel", 1) > 1:
        parts.append(f"context-parallel {changes['context_parallel']} (Ulysses, per-rank peak)")
    parts.append(describe_generation(changes))  # --task grpo: the completions' length and the generation batch
    return ", ".join(p for p in parts if p)


def render(result) -> str:
    """The plan for people: the best and its runners-up in rank order, each with its peak and expected speed relative
    to the best. The rank is by speed; a plan ranked before a faster one (for what it trades, or its headroom) says
    why under it, and the title says the order is not by speed alone."""
    rows = [(_describe(result.plan), result.estimated_peak_bytes, 1.0, getattr(result, "rank_note", ""))]
    rows += [(_describe(a["plan"]), a["estimated_peak_bytes"], a["relative_speed"], a.get("rank_note", ""))
             for a in result.alternatives]
    noted = any(note for *_, note in rows)
    goal = {"seq-len": "the longest context", "batch-size": "the largest micro-batch",
            "completion-length": "the longest completion"}.get(
        result.maximize, "the best setup" if noted else "the fastest setup")
    order = ", fastest first except where a plan says why it ranks higher" if noted else ""
    lines = [f"{goal} that fits in {format_bytes(result.budget_bytes)} on {result.device} (keeping 5% free){order}:",
             ""]
    for rank, (text, peak, speed, note) in enumerate(rows, 1):
        host = f", host memory {format_bytes(result.host_bytes)}" if rank == 1 and result.host_bytes else ""
        if rank == 1 and result.load_host_bytes > result.host_bytes:
            host += f" ({format_bytes(result.load_host_bytes)} while it loads: the staged load)"
        lines.append(f"  {rank}. {text}\n     peak {format_bytes(peak)}{host}, relative speed {speed:.2f}")
        if note:
            lines.append(f"     {note}")
    if result.trials:
        from memfit.train.trials import describe_trial

        lines += ["", "measured here before (trials; predicted seconds from the calibrated speed model):"]
        lines += [f"  - {describe_trial(t)}" for t in result.trials]
    if result.trades:
        lines += ["", "what it trades:"] + [f"  - {line}" for line in result.trades]
    lines += ["", "run the best with:", f"  {result.command}"]
    return "\n".join(lines)
