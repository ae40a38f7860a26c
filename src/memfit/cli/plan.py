"""`memfit plan`: the fastest configuration that fits a GPU or a memory budget."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field

from memfit.cli.flags import help_text, parse_command_line
from memfit.units import format_bytes

SUMMARY = "Search micro-batch, checkpointing, precision, 8-bit optimizer, chunked loss, offload, LoRA/QLoRA for the fastest setup that fits."


@dataclass
class PlanOptions:
    allow: str = field(default="auto", metadata={"choices": ("auto", "full", "lora", "qlora", "any")})
    """What may be trained: full, lora, qlora, any; auto: full if it fits, else LoRA, else QLoRA."""
    json: bool = False
    """Print one JSON object on stdout and nothing else."""
    world_size: int = 1
    """Devices to plan for; above 1 the state is sharded (FSDP / ZeRO-3)."""


def run(argv: list[str]) -> int:
    if "--help" in argv or "-h" in argv:
        print(help_text("plan", SUMMARY, [PlanOptions]))
        return 0
    from memfit.memory.planner import plan

    config, extras = parse_command_line(argv, extras=[PlanOptions])
    options: PlanOptions = extras[PlanOptions]
    sharding = "zero3" if config.distributed.zero_stage == 3 else config.distributed.sharding
    result = plan(config, allow=options.allow, world_size=options.world_size, sharding=sharding)
    if options.json:
        sys.stdout.write(json.dumps(result.to_dict()) + "\n")
        return 0
    print(render(result))
    return 0


def _describe(changes: dict) -> str:
    mode = "full" if not changes.get("lora_r") else ("QLoRA" if changes.get("quantize") == "4bit" else "LoRA")
    parts = [
        mode,
        f"micro-batch {changes['batch_size']} x {changes['gradient_accumulation_steps']} accumulation",
        f"checkpointing {changes['gradient_checkpointing']}",
        changes["optimizer"],
        f"loss chunk {changes['loss_chunk_size'] or 'off'}",
    ]
    if changes.get("optimizer_offload"):
        parts.append("optimizer offload")
    return ", ".join(parts)


def render(result) -> str:
    lines = [f"fits in {format_bytes(result.budget_bytes)} (keeping 5% free):", ""]
    rows = [(_describe(result.plan), result.estimated_peak_bytes, 1.0)]
    rows += [(_describe(a["plan"]), a["estimated_peak_bytes"], a["relative_speed"]) for a in result.alternatives]
    for rank, (text, peak, speed) in enumerate(rows, 1):
        lines.append(f"  {rank}. {text}\n     peak {format_bytes(peak)}, relative speed {speed:.2f}")
    lines += ["", "run the best with:", f"  {result.command}"]
    return "\n".join(lines)
