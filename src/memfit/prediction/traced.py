"""What the traced estimate asks and answers; the tracing itself lives in `memfit.train.traced`.

The traced estimate (`memfit estimate --method traced`) runs memfit's own training step
(`memfit.train.step.StepRunner`) on fake tensors under the memory tracker. The step
belongs to train/, which sits above memory/, so the estimator reaches it through a
tracer registered here: `memfit.train.traced` registers itself when imported, and the
CLI and `memfit.estimate` import it. A caller may also pass a tracer explicitly.

    from memfit.prediction.traced import StepSetup, step_tracer
    traced = step_tracer()(hf_config, config, StepSetup(...))   # -> TracedStep
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from memfit.memory.categories import CATEGORIES


@dataclass
class StepSetup:
    """The choices the step is traced with (resolved from a TrainConfig by the estimator)."""

    batch_size: int
    seq_len: int
    weight_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    attention: str  # transformers' attn_implementation
    checkpointing: str
    checkpoint_every: int
    loss_chunk_size: int
    device: torch.device


@dataclass
class TracedStep:
    """What one steady-state training step held at its peak, in the tracker's categories."""

    peak_bytes: int
    breakdown: dict[str, int]
    """Live device bytes per category (`memfit.memory.categories.CATEGORIES`) at the peak; they add up to it."""
    phase_peaks: dict[str, int] = field(default_factory=dict)
    """Peak live bytes within each phase: forward, backward, optimizer."""
    peak_phase: str = ""
    host_peak_bytes: int = 0
    """Host memory held on purpose (offloaded copies) at most during the step."""

    def __post_init__(self) -> None:
        self.breakdown = {category: int(self.breakdown.get(category, 0)) for category in CATEGORIES}


StepTracer = Callable[..., TracedStep]
"""tracer(hf_config, train_config, setup: StepSetup, fake: bool = True) -> TracedStep"""

_registered: StepTracer | None = None


def register_step_tracer(tracer: StepTracer) -> None:
    """Make `tracer` the one the traced estimate uses (memfit.train.traced does this on import)."""
    global _registered
    _registered = tracer


def step_tracer(explicit: StepTracer | None = None) -> StepTracer:
    """`explicit`, else the registered tracer.

    Raises:
        RuntimeError: none is registered (import memfit.train.traced first).
    """
    tracer: Any = explicit or _registered
    if tracer is None:
        raise RuntimeError(
            "the traced estimate runs memfit's training step: import memfit.train.traced first "
            "(the memfit CLI and memfit.estimate do)"
        )
    return tracer


def traced_peak(config, run, hf_config, inventory, parts) -> tuple[dict, float, dict]:
    """The traced estimate's moment at the peak, a layer's activations and notes: memfit's step on fake tensors,
    with the quantized and frozen-weight bytes the trace cannot hold taken from the state parts."""
    from memfit.prediction.activations import activation_bytes
    from memfit.prediction.encoders import architecture_for
    from memfit.prediction.padding_mask import padding_mask
    from memfit.prediction.run_shape import precision_of

    dtypes = {4: torch.float32, 2: torch.bfloat16}
    # Fake tensors cannot be 4-bit quantized: trace the 16-bit base and swap in the quantized bytes.
    quantized = run.quantize != "none"
    weight_dtype = torch.bfloat16 if quantized else dtypes[run.weight_bytes]
    autocast = {"bf16": torch.bfloat16, "fp16": torch.bfloat16, None: None}[run.autocast]
    setup = StepSetup(
        config.training.batch_size, config.data.seq_len_or_default, weight_dtype, autocast, run.attention.replace("flash", "sdpa"),
        run.checkpointing, run.checkpoint_every, run.loss_chunk_size, torch.device("cpu"),
    )
    traced_config = config.replace(optimizer_impl="fused") if (
        run.device_type == "cuda" and getattr(config.optimizer, "optimizer_impl", "auto") == "auto") else config
    # the frozen-weight levers run on real weights only: traced without them, their bytes taken from the parts
    traced_config = traced_config.replace(embedding_on_host=False, quantize_head=False, expert_dequant_group=0)
    if quantized:
        traced_config = traced_config.replace(quantize="none")
    step = step_tracer()(hf_config, traced_config, setup, fake=True)  # memfit.train.traced: the real step
    moment = {k: float(v) for k, v in step.breakdown.items()}
    if config.accumulation_for() > 1 and not run.optimizer_in_backward:  # one micro-batch is traced: from the
        moment["gradients"] = max(moment["gradients"], parts["gradients"])  # second on, every gradient is live
    if quantized:
        moment["parameters"] += parts["parameters"] - (inventory.total * 2 + 4 * parts["trainable_count"])
    else:  # the quantized parts above already leave the embedding out
        moment["parameters"] -= parts["embedding_host_bytes"]
    if run.optimizer_offload or run.paged_optimizer:
        moment["optimizer_states"] = 0
    arch = architecture_for(hf_config)
    per_layer = activation_bytes(arch, precision_of(run), batch_size=config.training.batch_size,
                                 seq_len=config.data.seq_len_or_default, attention=run.attention, checkpointing="off")[2]
    notes = {"peak_phase": step.peak_phase, "phase_peaks": step.phase_peaks}
    padding = padding_mask(hf_config, run, precision_of(run), config.training.batch_size, config.data.seq_len_or_default,
                           probed=False)
    if step.peak_phase != "optimizer":  # fake tensors read every mask as all ones: the trace ran unpadded
        moment["activations"] += padding.at_peak()
        notes["padding_mask_bytes"] = int(padding.at_peak())
    untraced = [name for name, on in (("optimizer in backward", run.optimizer_in_backward),
                                      ("activation offload", run.activation_offload),
                                      ("tiled MLP", run.mlp_tiles > 1), ("fused loss", run.fused_loss)) if on]
    if untraced:
        # the fake-tensor step runs the plain loop: an upper bound for these (use --method analytical)
        notes["not_traced"] = untraced
    return moment, per_layer, notes
