"""Advice from a measured profile: which technique would lower the peak, and by about how much.

`advise(breakdown, peak_bytes, snapshot, context)` looks at what holds the peak (categories,
modules, tensors, from `MemoryTracker`) and names the levers the run does not use yet:
checkpointing, an 8-bit optimizer, LoRA, optimizer-in-backward, a chunked loss, and for
a long-context peak held by backward's working set, tiled MLP and activation offload.
Each saving is an estimate from the measurement, not a promise: profile again with the flag.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from memfit.memory.categories import (
    ACTIVATION_GRADIENTS,
    ACTIVATIONS,
    GRADIENTS,
    LOGITS,
    OPTIMIZER_STATES,
    RECOMPUTED_ACTIVATIONS,
    PeakSnapshot,
)
from memfit.units import format_bytes

if TYPE_CHECKING:
    from memfit.techniques.resolved_run import ResolvedRun

# A path component that is a number marks a block of a stack: model.layers.3, transformer.h.3.
_BLOCK_PATTERN = re.compile(r"^(.*?\.\d+)(\.|$)")
# Module-name parts of a block's MLP across the families transformers ships.
_MLP_NAMES = ("mlp", "feed_forward", "ffn", "fc1", "fc2", "c_fc", "dense_h_to_4h", "dense_4h_to_h")
DEFAULT_TILES = 4


@dataclass
class ReportContext:
    """What the run already uses (so advice does not repeat it), plus optional model hints.

    Attributes:
        gradient_checkpointing: checkpointing is already on.
        optimizer: the optimizer name as in `--optimizer` ("adamw", "adamw-8bit", ...).
        lora: LoRA adapters are trained instead of the full model.
        loss_chunk_size: tokens per loss chunk (0 or None: not chunked).
        vocab_size: vocabulary size, to recognize logits (inferred when None).
        optimizer_in_backward: gradients are already freed as they are applied.
        tiled_mlp: tiles of the tiled MLP in use (0 or None: off).
        activation_offload: activation offload (or offloaded checkpoints) is on.
    """

    gradient_checkpointing: bool = False
    optimizer: str = "adamw"
    lora: bool = False
    loss_chunk_size: int | None = 0
    vocab_size: int | None = None
    optimizer_in_backward: bool = False
    tiled_mlp: int | None = 0
    activation_offload: bool = False

    @classmethod
    def from_run(cls, run: ResolvedRun, vocab_size: int | None = None) -> ReportContext:
        """The context of a run that resolved to `run` (techniques/resolved_run.py): what it already uses."""
        return cls(
            gradient_checkpointing=run.checkpointing_on,
            optimizer=run.optimizer,
            lora=run.lora_r > 0,
            loss_chunk_size=run.loss_chunk_size,
            vocab_size=vocab_size,
            optimizer_in_backward=run.optimizer_in_backward,
            tiled_mlp=run.mlp_tiles,
            activation_offload=run.activation_offload,
        )


def _entry(technique: str, flag: str, saves_bytes: int, message: str) -> dict:
    return {"technique": technique, "flag": flag, "saves_bytes": int(saves_bytes), "message": message}


def _percent(part: int, whole: int) -> str:  # also used by report.render
    return f"{100.0 * part / whole:.0f}%" if whole else "0%"


def block_activations(snapshot: PeakSnapshot) -> dict[str, int]:
    """Activation bytes per repeated block (model.layers.N), summed over its submodules."""
    blocks: dict[str, int] = {}
    for module, size in snapshot.module_activation_bytes.items():
        match = _BLOCK_PATTERN.match(module)
        if match:
            blocks[match.group(1)] = blocks.get(match.group(1), 0) + size
    return blocks


def estimate_checkpointing_savings(snapshot: PeakSnapshot, activation_bytes: int) -> int:
    """Bytes that full checkpointing would save at the peak, from the measured blocks.

    Full checkpointing keeps one input per block and, during backward, the
    recomputed activations of one block at a time; everything else the blocks
    saved is freed. Without recognizable blocks, half the activations is assumed.
    """
    blocks = block_activations(snapshot)
    if not blocks:
        return activation_bytes // 2
    kept_inputs = sum(snapshot.module_input_bytes.get(block, 0) for block in blocks)
    in_blocks = sum(blocks.values())
    # Scale from the activation maximum to the activation bytes alive at the peak.
    if snapshot.activation_peak_bytes > 0:
        in_blocks = in_blocks * min(1.0, activation_bytes / snapshot.activation_peak_bytes)
    saves = in_blocks - kept_inputs - max(blocks.values())
    return max(0, int(saves))


def _suggested_chunk(tokens: int) -> int:
    from memfit.techniques.loss import DEFAULT_LOSS_CHUNK_TOKENS

    if tokens > 4096:
        return DEFAULT_LOSS_CHUNK_TOKENS
    return max(16, 2 ** int(math.log2(max(tokens // 4, 1))))


def advise(breakdown: dict[str, int], peak_bytes: int, snapshot: PeakSnapshot, context: ReportContext) -> list[dict]:
    """What to switch on, largest saving first; each entry is technique, flag, saves_bytes, message.

    Only techniques the run does not use yet are suggested, and only when the
    category they shrink is a sizeable share of the peak.
    """
    if peak_bytes <= 0:
        return []
    advice: list[dict] = []
    activations = breakdown.get(ACTIVATIONS, 0)
    gradients = breakdown.get(GRADIENTS, 0)
    optimizer_states = breakdown.get(OPTIMIZER_STATES, 0)

    if not context.gradient_checkpointing and activations >= 0.25 * peak_bytes:
        saves = estimate_checkpointing_savings(snapshot, activations)
        if saves > 0.05 * peak_bytes:
            advice.append(
                _entry(
                    "gradient checkpointing",
                    "--gradient-checkpointing full",
                    saves,
                    f"activations are {_percent(activations, peak_bytes)} of the peak: "
                    f"--gradient-checkpointing full would save about {format_bytes(saves)} "
                    f"(recomputes each block's forward in backward, about 30% more compute)",
                )
            )

    eight_bit = "8bit" in context.optimizer or "8-bit" in context.optimizer
    if context.optimizer.startswith("adam") and not eight_bit and optimizer_states >= 0.15 * peak_bytes:
        saves = int(0.75 * optimizer_states)
        advice.append(
            _entry(
                "8-bit optimizer",
                "--optimizer adamw-8bit",
                saves,
                f"optimizer state is {_percent(optimizer_states, peak_bytes)} of the peak: "
                f"--optimizer adamw-8bit would save about {format_bytes(saves)} (75% of optimizer state)",
            )
        )

    if not context.lora and gradients + optimizer_states >= 0.3 * peak_bytes:
        # Adapters of rank 16 are a few percent of the model: their own grads and state stay.
        saves = int(0.97 * (gradients + optimizer_states))
        advice.append(
            _entry(
                "LoRA",
                "--lora-r 16",
                saves,
                f"gradients and optimizer state of full fine-tuning are "
                f"{_percent(gradients + optimizer_states, peak_bytes)} of the peak: --lora-r 16 trains "
                f"small adapters instead and would save about {format_bytes(saves)}",
            )
        )

    if not context.lora and not context.optimizer_in_backward and gradients >= 0.2 * peak_bytes:
        advice.append(
            _entry(
                "optimizer in backward",
                "--optimizer-in-backward",
                gradients,
                f"gradients are {_percent(gradients, peak_bytes)} of the peak: --optimizer-in-backward "
                f"applies and frees each gradient as soon as it is ready, saving about "
                f"{format_bytes(gradients)} (not with gradient accumulation)",
            )
        )

    advice.extend(_long_context_advice(breakdown, peak_bytes, snapshot, context))

    if not context.loss_chunk_size:
        # The tracker files logits, their fp32 copies and their gradient under "logits".
        logits = [tensor for tensor in snapshot.top_tensors if tensor.category == LOGITS]
        logits_bytes = breakdown.get(LOGITS, 0)
        if logits and logits_bytes >= 0.1 * peak_bytes:
            tokens = math.prod(max(logits, key=lambda tensor: tensor.bytes).shape[:-1])
            chunk = _suggested_chunk(tokens)
            saves = int(logits_bytes * max(0.0, 1.0 - chunk / tokens))
            if saves > 0:
                advice.append(
                    _entry(
                        "chunked loss",
                        f"--loss-chunk-size {chunk}",
                        saves,
                        f"logits and their gradients (vocabulary {logits[0].shape[-1]}) are "
                        f"{_percent(logits_bytes, peak_bytes)} of the peak: --loss-chunk-size {chunk} "
                        f"would save about {format_bytes(saves)}",
                    )
                )

    advice.sort(key=lambda entry: entry["saves_bytes"], reverse=True)
    return advice


def _is_mlp(module: str) -> bool:
    return any(part in _MLP_NAMES for part in module.split("."))


def compute_bytes_by_module(snapshot: PeakSnapshot, categories: Sequence[str]) -> dict[str, int]:
    """Bytes at the peak per module, summed over `categories` (from the snapshot's module table)."""
    totals: dict[str, int] = {}
    for category in categories:
        for module, size in snapshot.module_bytes.get(category, {}).items():
            totals[module] = totals.get(module, 0) + size
    return totals


def _long_context_advice(
    breakdown: dict[str, int], peak_bytes: int, snapshot: PeakSnapshot, context: ReportContext
) -> list[dict]:
    """Levers for a peak held by backward's working set: tiled MLP and activation offload."""
    advice = []
    backward_set = compute_bytes_by_module(snapshot, (RECOMPUTED_ACTIVATIONS, ACTIVATION_GRADIENTS, ACTIVATIONS))
    mlp_bytes = sum(size for module, size in backward_set.items() if _is_mlp(module))
    if not context.tiled_mlp and mlp_bytes >= 0.1 * peak_bytes:
        # One tile's working set stays instead of the whole sequence's.
        saves = int(mlp_bytes * (1 - 1 / DEFAULT_TILES))
        advice.append(
            _entry(
                "tiled MLP",
                f"--tiled-mlp {DEFAULT_TILES}",
                saves,
                f"MLP tensors (recomputed, saved and their gradients) are {_percent(mlp_bytes, peak_bytes)} of the "
                f"peak: --tiled-mlp {DEFAULT_TILES} computes the MLP over {DEFAULT_TILES} sequence tiles and "
                f"would save about {format_bytes(saves)} (recomputes each tile in backward)",
            )
        )
    kept = breakdown.get(ACTIVATIONS, 0)
    if context.gradient_checkpointing and not context.activation_offload and kept >= 0.1 * peak_bytes:
        # Offloaded checkpoints keep about two blocks' inputs on the device.
        blocks = block_activations(snapshot)
        resident = 2 * max(blocks.values()) if blocks else kept // 2
        saves = max(0, kept - resident)
        if saves > 0.05 * peak_bytes:
            advice.append(
                _entry(
                    "activation offload",
                    "--activation-offload",
                    saves,
                    f"checkpointed block inputs are {_percent(kept, peak_bytes)} of the peak: --activation-offload "
                    f"keeps them in host memory and would save about {format_bytes(saves)} of device memory "
                    f"(costs as much host memory and a copy each way per step)",
                )
            )
    return advice
