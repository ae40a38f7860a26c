"""Predict the peak memory of a training step before running it.

    from memfit import load_config, estimate
    result = estimate(load_config(overrides={"model": "llama-3.1-8b", "seq_len": 2048, "lora_r": 16}), gpu="rtx-4090")
    print(result.to_dict())

Two methods:

- `analytical` (default, instant): closed forms from the architecture numbers. Bytes of
  weights, gradients and optimizer state are exact; activations follow
  `memfit.prediction.activations`.
- `traced`: runs two real training steps (forward, backward, clipping, the configured
  optimizer) on fake tensors and counts every live storage (`memfit.prediction.traced`):
  no memory is allocated, a 7B step takes seconds on a CPU.

The breakdown is what is alive at the peak moment, so its parts add up to the peak:
at a forward/backward peak the gradients are (mostly) not allocated yet; at an
optimizer peak the activations are gone. `details` gives the full size of each part.

The run's resolved shape, its state bytes and sharding come from `run_shape.py`, the per-token
activation terms from `activations.py`, the probe of families outside the closed forms from
`layer_probe.py`; this module takes the activation moment and puts the parts together.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from memfit.config import TrainConfig
from memfit.distributed.reference_shards import copy_bytes_per_rank
from memfit.errors import UsageError
from memfit.gpus import GpuSpec, get_gpu
from memfit.memory.categories import CATEGORIES
from memfit.models.state_bytes import (  # noqa: F401  (re-exported: the estimator's public closed forms)
    BNB_8BIT_BLOCK,
    BNB_8BIT_MIN_SIZE,
    NF4_BYTES_PER_PARAM,
    ParameterInventory,
    in_backward_step_temporary_bytes,
    optimizer_state_bytes_for_shapes,
    optimizer_step_temporary_bytes,
    parameter_inventory,
    small_state_optimizer_bytes,
)
from memfit.prediction.activations import (
    CLOSED_FORM_FAMILIES,
    ActivationTerms,
    Precision,
    activation_bytes,
    flash_backward_workspace_bytes,
    layer_bytes_per_token,
    norm_module_bytes_per_token,
)
from memfit.prediction.chunked_head import chunked_loss_head_bytes
from memfit.prediction.context_parallel import all_to_all_buffer_bytes, context_split, split_details
from memfit.prediction.encoder_tiles import tiled_layer_per_token
from memfit.prediction.encoders import (
    architecture_for,
    backward_working_bytes,
    head_logits_bytes,
    is_encoder,
    task_head,
    trailing_embedding_gradient_bytes,
)
from memfit.prediction.estimate_result import (  # noqa: F401  (re-exported: memfit.estimate's public names)
    CUDA_CONTEXT_BYTES,
    ERROR_BAND,
    FRAGMENTATION,
    Estimate,
)
from memfit.prediction.expert_streaming import streaming_host_and_notes, with_streamed_experts
from memfit.prediction.experts import balancing_loss_bytes, moe_details, with_nf4_experts
from memfit.prediction.in_backward import untied_edge_steps
from memfit.prediction.load_peak import LoadPeak, load_peak
from memfit.prediction.offload_terms import host_activations, offload_first_blocks
from memfit.prediction.padding_mask import PaddingMask, padding_mask
from memfit.prediction.preference_step import (
    PreferenceStep,
    micro_batch_rows,
    preference_step,
    reference_copy_bytes,
    with_streamed_reference,
)
from memfit.prediction.qlora_levers import with_qlora_levers
from memfit.prediction.rl_step import generation_phase, is_rl, rl_training_config, with_generation_phase
from memfit.prediction.rl_step import reference_bytes as rl_reference_bytes
from memfit.prediction.rl_step import scoring_bytes as rl_scoring_bytes
from memfit.prediction.run_shape import (
    RunShape,
    apply_sharding,
    host_available_bytes,
    host_breakdown,
    precision_of,
    resolve_run,
    sharding_of,
    state_parts,
)
from memfit.prediction.tiled_experts import tiled_moe_terms
from memfit.prediction.traced import traced_peak
from memfit.resolution.registry import memory_terms
from memfit.techniques.packed_attention import packed_mask_estimate
from memfit.techniques.technique import MemoryFacts

BREAKDOWN_KEYS = CATEGORIES  # the one category set: estimate, traced estimate and profile report the same

# ---------------------------------------------------------------------------
# The estimate
# ---------------------------------------------------------------------------


def estimate(
    config: TrainConfig,
    *,
    method: str = "analytical",
    world_size: int = 1,
    sharding: str = "none",
    gpu: GpuSpec | str | None = None,
    budget_bytes: int | None = None,
    hf_config: Any = None,
) -> Estimate:
    """Predict the peak device memory of one training step of `config`.

    Args:
        method: "analytical" (closed forms, instant) or "traced" (fake-tensor step, seconds).
        world_size: ranks sharing the work; with `sharding` they divide state.
        sharding: none, ddp, zero1 (optimizer state), zero2 (+ gradients),
            zero3 / fsdp (+ parameters); default: from the config's distributed section.
        gpu: GPU preset (name or GpuSpec); adds the CUDA context and allocator slack
            and is the budget when `budget_bytes` is not given.
        budget_bytes: memory to compare the peak with.
        hf_config: the model's transformers config (default: resolved from config.model.model).

    Without --seq-len (None: from the data, which an estimate does not read) the step is estimated at 256 tokens.

    Raises:
        UsageError: unknown method, sharding, GPU or model.
    """
    config = config.with_seq_len()  # not given: DEFAULT_SEQ_LEN
    config, world_size, split = context_split(config, world_size)  # --context-parallel N: one rank at seq/N tokens
    if is_rl(config):  # a row is a prompt and its completion; the task's log-probabilities are chunked
        from memfit.models.presets import resolve_model_config

        hf_config = hf_config or resolve_model_config(config.model.model, config.model.trust_remote_code)
        config = rl_training_config(config, hf_config)
    request = _request(config, method, world_size, sharding, gpu, budget_bytes, hf_config)
    run = resolve_run(config, request.hf_config, request.gpu)
    inventory, parts, loaded_parameters = _state(request, run)
    moment, per_layer, notes = _step_moment(request, run, inventory, parts, loaded_parameters)
    if split is not None:  # what Ulysses' all-to-all holds beside the step at seq/N tokens
        buffers = all_to_all_buffer_bytes(split, request.hf_config, precision_of(run).attention or precision_of(run).compute,
                                          config.training.batch_size, 1 if run.checkpointing != "off" else
                                          architecture_for(request.hf_config).layers)
        if notes.get("peak_phase") in ("forward", "backward"):  # live while attention runs, not at the optimizer's
            moment["activations"] += buffers
        notes.update(split_details(split, buffers))
    if is_rl(config):
        moment = _with_rl_generation(request, run, moment, loaded_parameters, notes)
    loading = load_peak(config, request.hf_config, world_size, loaded_parameters, parts, inventory, run.lora_r,
                        run.quantize, run.weight_bytes)
    moment = _with_load_and_device(moment, notes, loading, run)
    host = _host_side(request, run, parts, notes)
    return _result(request, run, inventory, parts, moment, per_layer, notes, host, loading)


@dataclass(frozen=True)
class _Request:
    """What an estimate is asked for, checked and resolved: the config, the method, the ranks, the device."""

    config: TrainConfig
    method: str
    world_size: int
    sharding: str
    """The sharding mode itself (never 'none' where the config's distributed section names one)."""
    gpu: GpuSpec | None
    budget_bytes: int | None
    hf_config: Any


def _request(config: TrainConfig, method: str, world_size: int, sharding: str, gpu: GpuSpec | str | None,
             budget_bytes: int | None, hf_config: Any) -> _Request:
    """The estimate's request, with its GPU, budget, sharding and model config resolved; UsageError for what
    cannot be estimated (an unknown method, no ranks, an encoder asked for a causal LM, RoPE scaling without RoPE)."""
    from memfit.models.presets import resolve_model_config

    if method not in ("analytical", "traced"):
        raise UsageError(f"--method must be analytical or traced, got {method!r}")
    if world_size < 1:
        raise UsageError(f"--world-size must be at least 1, got {world_size}")
    gpu_spec = get_gpu(gpu) if isinstance(gpu, str) else gpu
    if gpu_spec is None and config.memory.gpu:
        gpu_spec = get_gpu(config.memory.gpu)
    if budget_bytes is None:
        budget_bytes = config.memory.memory_budget or config.memory.memory_cap
        if budget_bytes is None and gpu_spec is not None:
            budget_bytes = gpu_spec.memory_bytes
    sharding = sharding_of(config, sharding)
    if hf_config is None:
        hf_config = resolve_model_config(config.model.model, config.model.trust_remote_code)
    if config.task.task == "causal-lm" and is_encoder(hf_config):
        raise UsageError(f"--model {config.model.model} is an encoder ({hf_config.model_type}) with no causal-LM head:"
                         " give --task masked-lm, sequence-classification, token-classification or regression")
    if config.model.rope_scale is not None:
        from memfit.models.rope import scaled_positions

        scaled_positions(hf_config, config.model.rope_scale, config.model.rope_scaling)  # refuses a model without RoPE
    return _Request(config, method, world_size, sharding, gpu_spec, budget_bytes, hf_config)


def _state(request: _Request, run: RunShape) -> tuple[ParameterInventory, dict[str, Any], int]:
    """The model's parameter inventory, the run's state parts after the techniques that shrink or move its frozen
    weights, and the parameters' bytes as loaded, before them (what the load holds)."""
    config, hf_config = request.config, request.hf_config
    if run.quantize != "none" and run.lora_r == 0:
        raise UsageError("--quantize needs LoRA: add --lora-r")
    inventory = parameter_inventory(hf_config, run.lora_r)
    parts = state_parts(config, run, inventory)
    loaded_parameters = parts["parameters"]  # as loaded, before the techniques shrink or move the frozen weights
    parts = with_nf4_experts(parts, run.quantize, inventory, run.lora_r, run.weight_bytes, precision_of(run).compute)
    parts = with_qlora_levers(parts, config, hf_config, inventory, run.lora_r, run.quantize, run.weight_bytes,
                              precision_of(run).compute)  # embedding on host, grouped expert dequantization
    parts = with_streamed_experts(parts, config, inventory, hf_config, run.lora_r, run.quantize, run.weight_bytes,
                                  run.device_type)  # --expert-offload: frozen experts in host memory
    return inventory, parts, loaded_parameters


def _step_moment(request: _Request, run: RunShape, inventory: ParameterInventory, parts: dict[str, Any],
                 loaded_parameters: int) -> tuple[dict[str, float], float, dict[str, Any]]:
    """The step's peak moment by the request's method, divided over the ranks, with what neither method counts
    itself: the balancing loss's router logits (analytical only) and a packed micro-batch's masks; and a preference
    run's frozen reference copy (analytical: the traced step holds it), a share a rank under fsdp and zero3, as the
    policy's weights (distributed/reference_shards.py), else whole on every rank."""
    config, hf_config, method = request.config, request.hf_config, request.method
    preference = with_streamed_reference(preference_step(config, run), request.hf_config, loaded_parameters,
                                         parts["trainable_count"], run)  # None but for a preference task
    if method == "analytical":
        moment, per_layer, notes = _analytical_peak(config, run, hf_config, inventory, parts, request.sharding,
                                                    preference)
    else:
        moment, per_layer, notes = traced_peak(config, run, hf_config, inventory, parts)
    moment = apply_sharding(moment, parts, request.sharding, request.world_size, hf_config, run,
                            notes.get("autocast_weight_copies_bytes", 0))
    packed_mask = packed_mask_estimate(config.data, config.training.batch_size, run.attention, run.checkpointing,
                                       architecture_for(hf_config), precision_of(run).attention,
                                       config.model.attention, run.device_type, hf_config) if preference is None else (
        preference.packed_mask_bytes(run, architecture_for(hf_config), precision_of(run).attention,
                                     config.data.seq_len))  # a preference step's packed rows (its own micro-batch)
    if method == "analytical":  # every MoE layer's router logits, kept for the balancing loss (traced: in the step)
        rows = micro_batch_rows(config.training.batch_size, preference)
        moment["activations"] += balancing_loss_bytes(hf_config, rows * config.data.seq_len, precision_of(run).compute)
        if preference is not None:  # its copy, sharded as the policy's weights are
            copy = copy_bytes_per_rank(reference_copy_bytes(preference, loaded_parameters, parts["trainable_count"],
                                                            run.lora_r), request.sharding, request.world_size)
            moment["parameters"] += copy
            notes.update(preference.details(copy))
    if packed_mask:  # --packing samples under SDPA: the block-diagonal mask and its per-layer copies
        moment["activations"] += packed_mask
        notes["packed_mask_bytes"] = packed_mask
    return moment, per_layer, notes


def _with_rl_generation(request: _Request, run: RunShape, moment: dict[str, float], loaded_parameters: int,
                        notes: dict[str, Any]) -> dict[str, float]:
    """An RL step's peak: its training pass with the reference's copy, generation's cache and prompt forward, or the
    no-grad forward that scores every completion of the step (prediction/rl_step.py)."""
    config = request.config
    copy, streamed = rl_reference_bytes(config, run, request.hf_config, loaded_parameters)
    copy = copy_bytes_per_rank(copy, request.sharding, request.world_size)  # sharded as the policy's weights are
    moment = dict(moment)
    moment["parameters"] += copy
    completions = config.training.batch_size * config.training.gradient_accumulation_steps
    arch, precision = architecture_for(request.hf_config), precision_of(run)
    phase = generation_phase(config, arch, precision, config.data.seq_len, completions)
    scoring = rl_scoring_bytes(config, arch, precision, config.data.seq_len, completions, run.loss_chunk_size,
                               streamed, run.attention)  # packed rows: SDPA's block mask in the scoring forward
    moment = with_generation_phase(moment, {}, phase, copy, notes, scoring)
    if streamed is not None:  # --reference host-copy: its copy in host memory, a unit at a time on the device
        notes["rl_step"] |= streamed.details()
    return moment


def _with_load_and_device(moment: dict[str, float], notes: dict[str, Any], loading: LoadPeak,
                          run: RunShape) -> dict[str, float]:
    """The peak moment with the load's, where the load is the larger, and the CUDA context and allocator slack on
    a GPU; the load's figures go to `notes`."""
    if loading.device_bytes > sum(moment.values()):  # the load, not the step, is the peak: its weights are all of it
        moment = {key: 0 for key in moment} | {"parameters": loading.device_bytes}
        notes["peak_phase"] = "load"
    if run.device_type == "cuda":
        allocated = sum(moment.values())
        moment["other"] += CUDA_CONTEXT_BYTES + int(FRAGMENTATION * allocated)
        notes["allocated_peak_bytes"] = allocated
    notes["load_peak_bytes"] = loading.device_bytes
    notes["load_host_bytes"] = loading.host_bytes
    notes["staged_load"] = loading.staged
    return moment


def _host_side(request: _Request, run: RunShape, parts: dict[str, Any], notes: dict[str, Any]) -> dict[str, int]:
    """Host bytes by part while training (offloaded activations, optimizer state, the embedding, streamed experts,
    an async checkpoint's snapshot); the host-link figures go to `notes`."""
    config = request.config
    offloaded = notes.pop("host_activation_bytes", None)
    if offloaded is None:
        offloaded = host_activations(config, run, request.hf_config)
    host = host_breakdown(run, parts, offloaded)
    if parts["embedding_host_bytes"]:
        host["embedding"] = parts["embedding_host_bytes"]
    streamed_host, streamed_notes = streaming_host_and_notes(parts)
    host.update(streamed_host)
    reference_host = (notes.get("preference") or notes.get("rl_step") or {}).get("reference_host_bytes")
    if reference_host:  # --reference host-copy
        host["reference"] = int(reference_host)
    notes.update(streamed_notes)
    if config.output.async_save:
        # --async-save copies the checkpoint to host memory and writes it while training goes on: the trainable
        # weights in their dtype and the whole optimizer state, held until the write ends
        host["checkpoint_snapshot"] = int(parts["trainable_count"] * run.weight_bytes + parts["optimizer_states_full"])
    if run.activation_offload:
        notes["pcie_bytes_per_micro_batch"] = 2 * host["activations"]  # out in forward, back in backward
    return host


def _result(request: _Request, run: RunShape, inventory: ParameterInventory, parts: dict[str, Any],
            moment: dict[str, float], per_layer: float, notes: dict[str, Any], host: dict[str, int],
            loading: LoadPeak) -> Estimate:
    """The Estimate: the peak against the budget, the breakdown, the host side and the details people read."""
    config, hf_config, gpu_spec, budget_bytes = request.config, request.hf_config, request.gpu, request.budget_bytes
    peak = int(sum(moment.values()))
    fits = headroom = None
    if budget_bytes is not None:
        headroom = int(budget_bytes - peak)
        fits = headroom >= 0
    details = {
        "device": gpu_spec.name if gpu_spec else run.device_type,
        "sharding": request.sharding,
        "world_size": request.world_size,
        "parameter_count": inventory.total,
        "parameters_total": inventory.total,
        "parameters_active": inventory.active or inventory.total,  # what one token runs (MoE: top-k experts)
        **moe_details(hf_config, inventory, config.training.batch_size * config.data.seq_len, precision_of(run).compute),
        "trainable_parameter_count": parts["trainable_count"],
        "full_bytes": {k: int(parts[k]) for k in ("parameters", "gradients", "optimizer_states")},
        "precision": run.autocast or {4: "fp32", 2: "bf16"}[run.weight_bytes],
        "attention": run.attention,
        "checkpointing": run.checkpointing,
        "loss_chunk_size": run.loss_chunk_size,
        **notes,
    }
    return Estimate(
        model=config.model.model, method=request.method, peak_bytes=peak,
        breakdown={k: int(moment.get(k, 0)) for k in BREAKDOWN_KEYS}, budget_bytes=budget_bytes, fits=fits,
        headroom_bytes=headroom, error_band=ERROR_BAND[request.method], per_layer_activation_bytes=int(per_layer),
        details=details, host_bytes=sum(host.values()), host_breakdown=host,
        host_available_bytes=host_available_bytes() if sum(host.values()) or loading.host_bytes else None,
        load_host_bytes=loading.host_bytes,
    )


def _layer_per_token(run: RunShape, arch, hf_config, precision: Precision, seq_len: int,
                     tiled_experts: bool = False) -> float | None:
    """A block's bytes per token measured from the model's code, for families the closed forms do not describe
    (`tiled_experts`: with each MoE layer's experts call tiled)."""
    if arch.model_type in CLOSED_FORM_FAMILIES:
        return None
    from memfit.prediction.layer_probe import probed_layer_bytes_per_token, probed_layer_parts

    attention = run.attention.replace("flash", "sdpa")
    if not (run.autocast and run.weight_bytes == 4):
        return probed_layer_bytes_per_token(hf_config, run.weight_bytes, False, attention, seq_len, run.lora_r,
                                            run.efficient_norm, run.efficient_lora, tiled_experts)
    # Autocast over fp32 weights: a fake-tensor probe under CPU autocast misses the casts it
    # saves (it counted 40 % of a Llama block); probe in fp32 and scale what is not the norms'
    # by the closed forms' autocast/fp32 ratio for this block shape. The norms run in fp32 on
    # the fp32 residual stream either way and keep their fp32 bytes: scaled with the rest, a
    # family with many norms (Gemma 3: four and two on Q and K) fell 12 % short at 512 tokens.
    fp32, norms = probed_layer_parts(hf_config, 4, False, attention, seq_len, run.lora_r, run.efficient_norm,
                                     run.efficient_lora, tiled_experts)
    plain = Precision(4, 4, 4, precision.lora_rank, precision.adapter_input, efficient_norm=precision.efficient_norm)
    closed_norms = norm_module_bytes_per_token(arch, precision)  # the same under autocast and in fp32
    rest_ratio = ((layer_bytes_per_token(arch, precision, run.attention, seq_len) - closed_norms)
                  / (layer_bytes_per_token(arch, plain, run.attention, seq_len) - closed_norms))
    return norms + (fp32 - norms) * rest_ratio


@dataclass(frozen=True)
class _Step:
    """What every phase of the analytical step reads: one micro-batch of `config`, run as `run`.

    Built once by `_analytical_peak` so that each phase takes one argument for the run, its state bytes and the
    model's shape instead of the same dozen.
    """

    config: TrainConfig
    run: RunShape
    hf_config: Any
    inventory: ParameterInventory
    parts: dict[str, Any]
    """The state parts (run_shape.state_parts, after the techniques that move frozen weights)."""
    sharding: str
    arch: Any
    """The model's Architecture (an encoder's or a decoder's: prediction.encoders.architecture_for)."""
    head: Any
    """The --task's head: vocabulary logits or a few labels (prediction.encoders.task_head)."""
    precision: Precision
    batch: int
    """Rows of one micro-batch: --batch-size, or the rows of its pairs (prediction.preference_step)."""
    seq_len: int
    preference: PreferenceStep | None = None
    """A preference task's step (its chunked log-probabilities and reference), None for any other task."""

    @property
    def tokens(self) -> int:
        """Tokens of one micro-batch."""
        return self.batch * self.seq_len

    @property
    def in_backward(self) -> bool:
        """Whether the optimizer steps each gradient inside backward (no whole gradient is ever held)."""
        return self.run.optimizer_in_backward


@dataclass(frozen=True)
class _Forward:
    """What the forward pass ends holding, over what stays resident through the whole step."""

    activations: float
    """Activations kept for backward on the device (the padded micro-batch's masks included)."""
    cache: float
    """autocast's 16-bit copies of the fp32 weights, from their first use until backward is past them."""
    logits: float
    resident: float
    """Weights, optimizer state on the device and the techniques' resident bytes ("other")."""
    other: float
    """The techniques' resident bytes alone (their memory terms' "other")."""
    accumulated: float
    """The whole gradient, held through a later micro-batch of an accumulating step (0 without accumulation)."""

    @property
    def total(self) -> float:
        return self.resident + self.accumulated + self.activations + self.cache + self.logits


@dataclass(frozen=True)
class _Gradients:
    """The gradients backward makes, as its peak sees them (optimizer in backward: as each is stepped)."""

    head: float
    """The head's gradient, made first and held through the blocks' backward."""
    block: float
    """One block's gradients (0 when each is stepped and freed as it arrives)."""
    largest: float
    """The largest single gradient (optimizer in backward: the one being stepped)."""
    step_temporaries: float
    """The optimizer step's temporaries (optimizer in backward: those of the largest tensor's step)."""
    head_sums: float
    """What the chunked loss's backward holds beside the head's gradient (prediction.chunked_head)."""
    tied: float
    """A tied embedding's gradient (optimizer in backward: also an untied embedding stepped last)."""
    tied_end: float
    """What a tensor stepped at the very end of backward holds (its gradient sum and its step's temporaries)."""
    edge: float = 0.0
    """An untied head's and embedding's gradients stepped apart from the blocks (prediction.in_backward)."""
    edge_temporaries: float = 0.0


@dataclass(frozen=True)
class _Backward:
    """The moment backward peaks at."""

    total: float
    activations: float
    """Activations still held at that moment."""
    recompute: float
    """The block being recomputed (checkpointing) or brought back from host memory (offload), and its working set."""
    gradients: float
    """Gradients in flight at that moment (not counting accumulated ones)."""
    temporaries: float
    """The in-backward optimizer step's temporaries at that moment (0 when the optimizer steps after backward)."""


@dataclass(frozen=True)
class _OptimizerStep:
    """What the optimizer step holds: every gradient and the step's temporaries, or (in backward) the last step."""

    total: float
    gradients: float
    other: float
    """The "other" category at that moment: the techniques' resident bytes, the step's temporaries or a tied
    gradient's sum."""
    phase: str
    """Where this moment falls: 'optimizer step', or 'backward' when it is a tied gradient's sum at its end."""


def _analytical_peak(config, run: RunShape, hf_config, inventory, parts, sharding: str = "none",
                     preference: PreferenceStep | None = None) -> tuple[dict, float, dict]:
    """The breakdown at the step's peak moment, a block's activation bytes and the notes of how it was found.

    The step is taken phase by phase (what forward ends holding, what backward peaks at, what the optimizer step
    holds) and the largest moment is its peak; the techniques' own memory terms (their TECHNIQUE's) join it.
    """
    arch = architecture_for(hf_config)
    step = _Step(config, run, hf_config, inventory, parts, sharding, arch, task_head(config, arch), precision_of(run),
                 micro_batch_rows(config.training.batch_size, preference), config.data.seq_len, preference)
    terms, padding = _saved_activations(step)
    # What the techniques add by themselves (QLoRA's dequantized weight, paged state, ...: their TECHNIQUE's terms);
    # "other" is resident through every phase, the other categories join the peak moment.
    technique_terms = memory_terms(run, MemoryFacts(arch, inventory, hf_config, config, parts, step.tokens))
    other = technique_terms.pop("other", 0.0)
    forward = _forward_phase(step, terms, other)
    gradients = _gradients(step, forward.logits)
    backward = _backward_phase(step, terms, forward, gradients)
    moment, phase = _peak_moment(step, forward, backward, _optimizer_step_phase(step, forward, gradients))
    for category, size in technique_terms.items():
        moment[category] = moment.get(category, 0) + size
    notes = {"peak_phase": phase, "activation_bytes": int(forward.activations), "logits_bytes": int(forward.logits),
             "autocast_weight_copies_bytes": int(forward.cache), "host_activation_bytes": int(terms.host),
             "padding_mask_bytes": int(padding.at_peak()),
             "activations_measured_from_model": arch.model_type not in CLOSED_FORM_FAMILIES}
    return moment, terms.per_layer, notes


def _saved_activations(step: _Step) -> tuple[ActivationTerms, PaddingMask]:
    """The activations one micro-batch saves for backward (kept, recomputed, offloaded), and its padding masks."""
    run, arch, precision, b, s = step.run, step.arch, step.precision, step.batch, step.seq_len
    padding = padding_mask(step.hf_config, run, precision, b, s)  # an encoder's padded micro-batch: its attention masks
    full_offload = run.activation_offload and run.activation_offload_blocks is None
    # Offloaded checkpoints of every block and the head peak on the device where offloading every
    # block's input alone does (tracked at 16 and 32 blocks: 21.27 and 21.24 MiB): the head's saved
    # tensors are back and freed before the blocks' backward peaks. The device side is modelled as
    # that partial offload (the closed form for everything was 19-21 % under the tracker); the host
    # side still holds everything (`offload_terms.host_activations`).
    device_run = replace(run, activation_offload_blocks=arch.layers) if (
        full_offload and run.checkpointing == "full") else run
    # MoE blocks under --tiled-mlp: their tiling (experts and dense MLPs) is counted by prediction.tiled_experts
    moe = tiled_moe_terms(run, arch, step.hf_config, precision, b * s, step.inventory.expert_params,
                          step.parts["trainable_bytes"],
                          lambda tiled: _layer_per_token(run, arch, step.hf_config, precision, s, tiled))
    terms = activation_bytes(
        arch, precision, batch_size=b, seq_len=s, attention=run.attention,
        checkpointing=run.checkpointing, checkpoint_every=run.checkpoint_every, mlp_tiles=0 if moe else run.mlp_tiles,
        offload=device_run.activation_offload and device_run.activation_offload_blocks is None,
        layer_per_token=padding.on_layer(
            moe.layer_per_token if moe else tiled_layer_per_token(  # an encoder's tiled feed-forward: its norm too
                _layer_per_token(run, arch, step.hf_config, precision, s), arch, precision, run.mlp_tiles), b * s),
        unchunked_loss=not run.fused_loss and not 0 < run.loss_chunk_size < b * (s - 1) and step.preference is None,
    )
    terms = moe.with_backward(terms) if moe else terms
    terms = offload_first_blocks(terms, device_run, arch, precision, b * s)
    terms = terms._replace(kept=terms.kept + padding.kept)
    if device_run is not run:
        terms = terms._replace(host=host_activations(step.config, run, step.hf_config))
    return terms, padding


def _forward_phase(step: _Step, terms: ActivationTerms, other: float) -> _Forward:
    """What the forward ends holding: the kept activations, autocast's weight copies and the logits."""
    run, parts = step.run, step.parts
    if step.preference is not None:  # a chunk of log-probabilities, or the reference's forward after the policy's
        logits = step.preference.forward_extra_bytes(step.arch, step.precision, step.config.training.batch_size,
                                                     step.seq_len)
    else:
        logits = head_logits_bytes(step.head, step.arch, step.batch, step.seq_len, run.loss_chunk_size,
                                   step.precision.compute, run.fused_loss)
    # autocast caches a 16-bit copy of each weight from its first use until backward is past it
    # (the fused experts' 3-D weights too: autocast casts them for grouped_mm and caches the copies alike)
    cache = 2 * (step.inventory.linear_params + step.inventory.expert_params) if (
        run.autocast and run.weight_bytes == 4 and run.quantize == "none") else 0.0
    resident = parts["parameters"] + parts["optimizer_states"] + other
    # Micro-batches after the first of an optimizer step run with the earlier ones' gradients
    # accumulated: the whole gradient is live through their forward and backward, and backward
    # adds each new gradient (one tensor at a time) into it.
    accumulated = parts["gradients"] if step.config.accumulation_for() > 1 and not step.in_backward else 0.0
    return _Forward(activations=terms.kept, cache=cache, logits=logits, resident=resident, other=other,
                    accumulated=accumulated)


def _gradients(step: _Step, logits: float) -> _Gradients:
    """The gradients backward makes: the head's, a block's, the largest tensor's, a tied embedding's."""
    run, arch, parts = step.run, step.arch, step.parts
    tb = parts["trainable_bytes"]
    # Backward frees a block's activations while its gradients appear: the peak is at the
    # first block (everything kept + the head's and one block's gradients) or the last
    # one (one block kept + every gradient), whichever is larger.
    head = step.head.outputs * arch.hidden * tb if not run.lora_r else 0
    embedding_grad = trailing_embedding_gradient_bytes(step.head, arch, parts["trainable_shapes"], tb,
                                                       run.lora_r)  # made after the blocks'
    # A trainable tied embedding gets two gradients, the head's (first in backward) and the
    # embedding's (last); autograd adds them out of place before the weight's gradient exists:
    # the two and their sum are live together at the end of backward (measured with the tracker).
    tied = step.head.tied and not run.lora_r and (arch.vocab, arch.hidden) in parts["trainable_shapes"]
    # Beside the head's gradient while the chunked loss's backward makes it, with every activation kept and
    # before any block's gradient: one chunk's logits (in place) or two more head-sized sums (prediction/chunked_head)
    head_sums = chunked_loss_head_bytes(run, head, logits, step.batch * (step.seq_len - 1), step.sharding) if (
        step.preference is None) else step.preference.head_working_bytes(run, arch, step.precision, step.tokens, head,
                                                                          step.sharding)
    gradients = _Gradients(head=head, block=(parts["gradients"] - head - embedding_grad) / max(1, arch.layers),
                           largest=parts["largest_trainable"] * tb, step_temporaries=parts["optimizer_temporaries"],
                           head_sums=head_sums, tied=arch.vocab * arch.hidden * tb if tied else 0.0, tied_end=0.0)
    return _stepped_in_backward(step, gradients, tied) if step.in_backward else gradients


def _stepped_in_backward(step: _Step, gradients: _Gradients, tied: bool) -> _Gradients:
    """The gradients as the optimizer in backward holds them.

    Each gradient is applied and freed by its own hook: one tensor's gradient (and its optimizer step's
    temporaries) at a time, never a block's or the model's. A tied embedding is the exception: its hook fires only
    after both uses' gradients are summed, so the head's gradient is held through the whole backward, and the tied
    tensor is stepped last, when the blocks' activations are gone (the sum, then the gradient and its step's
    temporaries).
    """
    run, arch, tb = step.run, step.arch, step.parts["trainable_bytes"]
    shapes = list(step.parts["trainable_shapes"])
    tied_grad, tied_end = gradients.tied, 0.0
    if tied:
        shapes.remove((arch.vocab, arch.hidden))
        tied_end = tied_grad + max(2 * tied_grad, 0 if run.optimizer_offload else in_backward_step_temporary_bytes(
            run.optimizer, arch.vocab * arch.hidden, tb))
    head_one = gradients.head  # the head's own gradient, before the tied embedding's takes its place
    head = tied_grad
    # An untied head and embedding are stepped apart from the blocks (`untied_edge_steps`)
    untied_edges = [] if tied or run.lora_r else [shape for shape in shapes if arch.vocab in shape]
    largest = max((math.prod(shape) for shape in shapes if shape not in untied_edges), default=0)
    largest_grad = largest * tb
    step_temporaries = 0 if run.optimizer_offload else in_backward_step_temporary_bytes(run.optimizer, largest, tb)
    edge_grads, edge_temporaries, end_grad, end_temporaries = untied_edge_steps(
        run, untied_edges, head_one // max(1, tb), tb, gradients.head_sums + head_one)
    if end_grad:  # the embedding, stepped last like a tied one
        tied_grad, tied_end = end_grad, end_grad + end_temporaries
    if not edge_grads and gradients.head_sums + head_one - head > largest_grad + step_temporaries:
        largest_grad, step_temporaries = gradients.head_sums + head_one - head, 0  # the head's hook waits for the sum
    return replace(gradients, head=head, block=0.0, largest=largest_grad, step_temporaries=step_temporaries,
                   tied=tied_grad, tied_end=tied_end, edge=edge_grads, edge_temporaries=edge_temporaries)


def _adapter_working_bytes(step: _Step) -> float:
    """What a recomputed block's backward through LoRA adapters holds beside its tensors."""
    run, arch, precision, tokens = step.run, step.arch, step.precision, step.tokens
    # A recomputed block's backward through fp32 adapters on a 16-bit or an fp32 base (not
    # under autocast) holds its MLP activation gradients at once (measured: about
    # 2 x intermediate x the compute bytes per token; 16 fp32 blocks: 25 MiB of gradients).
    adapter_working = 2 * precision.compute * arch.intermediate * step.batch * step.seq_len / max(1, run.mlp_tiles) if (
        run.checkpointing != "off" and run.lora_r and (run.weight_bytes == 2 or not run.autocast)) else 0.0
    if run.lora_r and precision.adapter_input == 0:
        # memfit's adapter path casts one slice of rows at a time in backward (at most
        # SLICE_ELEMENTS): about one fp32 input-wide slice is live beside the block's tensors
        # (tracked: 1.3 MiB at 1024 tokens x 352, where the slice is the whole input)
        from memfit.techniques.efficient_lora import SLICE_ELEMENTS

        tile_tokens = tokens / max(1, run.mlp_tiles)
        adapter_working += 4 * min(SLICE_ELEMENTS, tile_tokens * max(arch.intermediate, arch.hidden))
    return adapter_working


def _backward_phase(step: _Step, terms: ActivationTerms, forward: _Forward, gradients: _Gradients) -> _Backward:
    """The moment backward peaks at: at the first block or the last, the recomputed block and the gradients."""
    run, arch, precision = step.run, step.arch, step.precision
    recompute = terms.recompute + flash_backward_workspace_bytes(arch, precision, step.tokens, run.attention,
                                                                 run.device_type)
    # an encoder's own MLP backward (ESM's GELU; a plain MLP's under LoRA in place of the adapter terms), per tile
    recompute += backward_working_bytes(arch, precision, step.tokens, run.mlp_tiles, _adapter_working_bytes(step))
    released = terms.released_per_block
    fixed = forward.activations - arch.layers * released  # the embedding side, uncheckpointed or offloaded blocks
    block_grads = gradients.block
    # A preference step's last block's MLP backward, uncheckpointed, holds two intermediate-wide activation
    # gradients (a gated MLP's product's and one factor's) beside every kept activation, after the head's sums are
    # gone: the larger of the two moments counts. Its log-probabilities' chunks are sized to the hidden states
    # (sequence_logprobs.logprob_chunk_tokens), so this moment can be the larger (tracked on CPU, fp32: the 2-block
    # DPO step of intermediate 512 at 512 tokens, tests/unit/prediction/test_preference_estimate.py). The causal-LM
    # estimates, checked shape by shape against the tracker, keep their own terms.
    mlp_backward = (2.0 * precision.compute * arch.intermediate * step.tokens
                    if step.preference is not None and step.preference.forwards == 1 and run.checkpointing == "off"
                    and run.mlp_tiles <= 1 and arch.gated_mlp else 0.0)
    first_grads = block_grads if step.in_backward else max(block_grads + mlp_backward, gradients.head_sums)
    at_first_block = forward.activations + forward.cache + first_grads
    at_last_block = max(0.0, fixed) + released + forward.cache / max(1, arch.layers) + arch.layers * block_grads
    in_flight_grads = first_grads if at_first_block >= at_last_block else arch.layers * block_grads
    activations = max(at_first_block, at_last_block) - in_flight_grads
    head, largest_grad, step_temporaries = gradients.head, gradients.largest, gradients.step_temporaries
    if forward.accumulated:
        head, in_flight_grads = largest_grad, 0.0
    waiting = step.preference.waiting_gradient_bytes(step.parts["gradients"]) if step.preference else 0.0
    if waiting:  # --pair-layout split: the rejected rows' backward, every chosen-row gradient (the head's too) beside it
        head = waiting + (head if forward.accumulated else 0.0)
        if step.preference.chunk_of(arch, step.tokens) < step.tokens:  # and the rejected rows' own in-place head
            head += gradients.head  # gradient, summed over their chunks before it joins the chosen rows'
    total = forward.resident + forward.accumulated + activations + recompute + head + in_flight_grads
    if step.in_backward:
        total += largest_grad + step_temporaries
        at_head_step = forward.resident + activations + gradients.edge + gradients.edge_temporaries  # none recomputed
        if gradients.edge and at_head_step > total:
            total, recompute, head, in_flight_grads = at_head_step, 0.0, 0.0, 0.0
            largest_grad, step_temporaries = gradients.edge, gradients.edge_temporaries
    return _Backward(total=total, activations=activations, recompute=recompute,
                     gradients=head + in_flight_grads + (largest_grad if step.in_backward else 0),
                     temporaries=step_temporaries if step.in_backward else 0)


def _optimizer_step_phase(step: _Step, forward: _Forward, gradients: _Gradients) -> _OptimizerStep:
    """What the optimizer step holds: every gradient and its temporaries (in backward: the last tensor's step)."""
    parts = step.parts
    if step.in_backward:  # the steps ran inside backward; a tied embedding's last
        return _OptimizerStep(total=forward.resident + gradients.tied_end, gradients=gradients.tied,
                              other=forward.other + gradients.tied_end - gradients.tied, phase="backward")
    # every gradient exists from the end of backward (a tied embedding's sum) through the step
    end_extra = max(parts["optimizer_temporaries"], 2 * gradients.tied)
    return _OptimizerStep(
        total=parts["parameters"] + parts["gradients"] + parts["optimizer_states"] + forward.other + end_extra,
        gradients=parts["gradients"], other=forward.other + end_extra,
        phase="optimizer step" if parts["optimizer_temporaries"] >= 2 * gradients.tied else "backward")


def _peak_moment(step: _Step, forward: _Forward, backward: _Backward,
                 optimizer_step: _OptimizerStep) -> tuple[dict[str, float], str]:
    """The breakdown at the largest of the three moments, and its phase's name."""
    parts = step.parts
    if max(forward.total, backward.total) < optimizer_step.total:
        return {"parameters": parts["parameters"], "gradients": optimizer_step.gradients,
                "optimizer_states": parts["optimizer_states"], "activations": 0, "logits": 0,
                "other": optimizer_step.other}, optimizer_step.phase
    in_backward = backward.total > forward.total
    moment = {"parameters": parts["parameters"],
              "gradients": forward.accumulated + (backward.gradients if in_backward else 0),
              "optimizer_states": parts["optimizer_states"],
              "activations": backward.activations if in_backward else forward.activations + forward.cache,
              # the block being recomputed (checkpointing) or brought back from host memory (offload)
              "recomputed_activations": backward.recompute if in_backward else 0,
              "logits": 0 if in_backward else forward.logits,
              "other": forward.other + (backward.temporaries if in_backward else 0)}
    return moment, "backward" if in_backward else "forward"
