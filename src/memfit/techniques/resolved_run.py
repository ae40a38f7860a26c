"""The resolved run: what a config becomes on a device, as one immutable value.

    run = resolve_run(config, hf_config, device)     # techniques/registry.py: every technique's `resolve`
    run.checkpointing, run.loss.chunk_size, ...      # what runs, typed; the run, the estimate, the speed model,
                                                     # the planner and the report read these fields
    run = run.changed("compile", "Dynamo ran the blocks eager", compiled=False)   # a change at run time

A run changes after it starts only through `changed`, which returns a new value and records the change as an
event (what changed, from what to what, and why): an out-of-memory escalation switching checkpointing on,
compiled blocks that Dynamo ran eager, an automatic checkpointing choice made under a budget. Strings for people
(`describe`, the log and metrics lines) are made from the fields; no code parses them back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True)
class LossRecipe:
    """How the step turns hidden states into the summed loss: chosen once, called by the step."""

    chunk_size: int = 0
    """Tokens per loss chunk (0: the whole logits at once); techniques/loss.py."""
    fused: bool = False
    """liger-kernel's fused linear cross-entropy replaces the loss: the logits are never held."""
    compiled_tail: bool = False
    """--compile: the logits-to-loss tail (cast, softcap, log-softmax) is compiled."""
    head_gradient: str = ""
    """How the chunked loss makes the head's gradient: 'in place', 'per chunk', or '' (not chunked, no trained head)."""

    def describe(self) -> str:
        if self.fused:
            return "fused linear cross-entropy (liger)"
        parts = [f"chunked, {self.chunk_size} tokens a chunk" if self.chunk_size else "whole logits"]
        if self.head_gradient:
            parts.append(f"head gradient {self.head_gradient}")
        if self.compiled_tail:
            parts.append("compiled tail")
        return ", ".join(parts)


@dataclass(frozen=True)
class RunEvent:
    """One change of the resolved run after it was first resolved."""

    technique: str
    """The technique (or setting) that changed, by its registry name."""
    before: str
    after: str
    reason: str
    step: int | None = None
    """The optimizer step it happened at (None: while the run was built)."""

    def as_record(self) -> dict[str, Any]:
        return {"event": "run_changed", "technique": self.technique, "from": self.before, "to": self.after,
                "reason": self.reason, **({"step": self.step} if self.step is not None else {})}


@dataclass(frozen=True)
class ResolvedRun:
    """The choices of a run that decide its memory and speed, resolved for the target device.

    Field names are the estimator's: `RunShape` (prediction/run_shape.py) is this class.
    """

    device_type: str = "cpu"
    """'cuda' or 'cpu': where the step runs."""
    weight_bytes: int = 4
    """Bytes per element of the model's weights as loaded (an fp16 base under QLoRA: 4, PEFT upcasts it)."""
    autocast: str | None = None
    """'bf16', 'fp16', or None (no autocast)."""
    attention: str = "sdpa"
    """The attention kernel that runs: sdpa, flash, flex or eager."""
    checkpointing: str = "off"
    """'off', 'full' or 'selective' ('auto' resolves to 'full', its upper bound, until blocks are chosen)."""
    checkpoint_every: int = 1
    loss_chunk_size: int = 0
    optimizer: str = "adamw"
    optimizer_impl: str = "auto"
    lora_r: int = 0
    quantize: str = "none"
    optimizer_offload: bool = False
    """The optimizer's state (and its step) in host memory: --optimizer-offload, ZeRO's or FSDP2's offload."""
    host_optimizer_step: bool = False
    """--optimizer-offload: memfit itself steps the optimizer on host copies (ZeRO's and FSDP2's offloads are done by
    their engines)."""
    optimizer_in_backward: bool = False
    activation_offload: bool = False
    paged_optimizer: bool = False
    """Paged 8-bit AdamW on CUDA: the state lives in unified memory that the driver pages to host."""
    mlp_tiles: int = 0
    fused_loss: bool = False
    """liger-kernel's fused linear cross-entropy: the logits are never held."""
    activation_offload_blocks: int | None = None
    """Partial offload: only the first N blocks' saved inputs go to host (None: everything saved)."""
    efficient_norm: bool = False
    """memfit's RMSNorm keeps its input and the fp32 1/rms only (techniques/rms_norm.py)."""
    efficient_lora: bool = False
    """memfit's adapter path keeps no fp32 copy of an adapter's input (techniques/efficient_lora.py)."""
    checkpoint_auto: bool = False
    """--gradient-checkpointing auto: the blocks are chosen under the budget when the model is built."""
    checkpointed_blocks: int | None = None
    """Blocks that really checkpoint, once the model is built (None: not built yet)."""
    compiled: bool = False
    """Compiled blocks run (--compile where it can; cleared when Dynamo ran them eager)."""
    kernels: str = "none"
    """The fused kernels asked for ('none', 'liger', 'auto'); `fused_loss` says whether liger's loss runs."""
    head_gradient: str | None = None
    """The chunked loss's head gradient path ('in place', 'per chunk', '': none), known once the engine is chosen
    (None: not yet)."""
    expert_offload: bool = False
    embedding_on_host: bool = False
    quantize_head: bool = False
    expert_dequant_group: int = 0
    extra: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Resolved values of techniques registered beyond memfit's own, by technique name (read-only)."""
    events: tuple[RunEvent, ...] = ()
    """What changed after the run was first resolved, in order."""

    @property
    def loss(self) -> LossRecipe:
        """The loss recipe of this run (techniques/loss.py runs it)."""
        return LossRecipe(chunk_size=self.loss_chunk_size, fused=self.fused_loss, compiled_tail=self.compiled and not
                          self.fused_loss, head_gradient=self.head_gradient or "")

    def changed(self, technique: str, reason: str, step: int | None = None, **fields: Any) -> ResolvedRun:
        """This run with `fields` changed, and the change recorded as an event (the only way a run changes)."""
        unknown = [name for name in fields if name not in _FIELD_NAMES]
        if unknown:
            raise TypeError(f"ResolvedRun has no field {unknown[0]!r}")
        if not any(getattr(self, name) != value for name, value in fields.items()):
            return self
        before = ", ".join(f"{name}={getattr(self, name)!r}" for name in fields)
        after = ", ".join(f"{name}={value!r}" for name, value in fields.items())
        event = RunEvent(technique, before, after, reason, step)
        return dataclasses.replace(self, **fields, events=(*self.events, event))

    def applied(self, technique: str, reason: str, **fields: Any) -> ResolvedRun:
        """This run with what applying `technique` settled: a field not known before (None) is filled in
        silently; one that differs from what was resolved is a change, recorded with `reason`."""
        unknown = {name: value for name, value in fields.items() if getattr(self, name) is None}
        run = dataclasses.replace(self, **unknown) if unknown else self
        known = {name: value for name, value in fields.items() if name not in unknown}
        return run.changed(technique, reason, **known) if known else run

    def with_extra(self, name: str, value: Any) -> ResolvedRun:
        """This run with a registered technique's resolved value (while resolving, not an event)."""
        return dataclasses.replace(self, extra=MappingProxyType({**self.extra, name: value}))

    def describe_checkpointing(self) -> str:
        """What gradient checkpointing does, for people: 'off', 'full on 4 of 4 blocks', 'full (auto)'."""
        if self.checkpointing == "off" and not self.checkpoint_auto:
            return "off"
        if self.checkpointed_blocks == 0:
            return "off"
        mode = self.checkpointing + (" (auto)" if self.checkpoint_auto else "")
        return mode if self.checkpointed_blocks is None else f"{mode} on {self.checkpointed_blocks} blocks"

    @property
    def checkpointing_on(self) -> bool:
        """Whether any block recomputes its activations in backward."""
        return self.checkpointing != "off" and self.checkpointed_blocks != 0


_FIELD_NAMES = frozenset(f.name for f in dataclasses.fields(ResolvedRun)) - {"events"}
