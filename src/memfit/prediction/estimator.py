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
from dataclasses import replace
from typing import Any

from memfit.config import TrainConfig
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
    Precision,
    activation_bytes,
    flash_backward_workspace_bytes,
    layer_bytes_per_token,
    norm_module_bytes_per_token,
)
from memfit.prediction.chunked_head import chunked_loss_head_bytes
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
from memfit.prediction.load_peak import load_peak
from memfit.prediction.offload_terms import host_activations, offload_first_blocks
from memfit.prediction.padding_mask import padding_mask
from memfit.prediction.qlora_levers import with_qlora_levers
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
    from memfit.models.presets import resolve_model_config

    config = config.with_seq_len()  # not given: DEFAULT_SEQ_LEN

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
    run = resolve_run(config, hf_config, gpu_spec)
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
    if method == "analytical":
        moment, per_layer, notes = _analytical_peak(config, run, hf_config, inventory, parts, sharding)
    else:
        moment, per_layer, notes = traced_peak(config, run, hf_config, inventory, parts)
    moment = apply_sharding(moment, parts, sharding, world_size, hf_config, run,
                             notes.get("autocast_weight_copies_bytes", 0))
    packed_mask = packed_mask_estimate(config.data, config.training.batch_size, run.attention, run.checkpointing,
                                       architecture_for(hf_config), precision_of(run).attention,
                                       config.model.attention, run.device_type, hf_config)
    if method == "analytical":  # every MoE layer's router logits, kept for the balancing loss (traced: in the step)
        moment["activations"] += balancing_loss_bytes(hf_config, config.training.batch_size * config.data.seq_len,
                                                      precision_of(run).compute)
    if packed_mask:  # --packing samples under SDPA: the block-diagonal mask and its per-layer copies
        moment["activations"] += packed_mask
        notes["packed_mask_bytes"] = packed_mask
    loading = load_peak(config, hf_config, world_size, loaded_parameters, parts, inventory, run.lora_r, run.quantize,
                        run.weight_bytes)
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
    peak = int(sum(moment.values()))
    offloaded = notes.pop("host_activation_bytes", None)
    if offloaded is None:
        offloaded = host_activations(config, run, hf_config)
    host = host_breakdown(run, parts, offloaded)
    if parts["embedding_host_bytes"]:
        host["embedding"] = parts["embedding_host_bytes"]
    streamed_host, streamed_notes = streaming_host_and_notes(parts)
    host.update(streamed_host)
    notes.update(streamed_notes)
    if config.output.async_save:
        # --async-save copies the checkpoint to host memory and writes it while training goes on: the trainable
        # weights in their dtype and the whole optimizer state, held until the write ends
        host["checkpoint_snapshot"] = int(parts["trainable_count"] * run.weight_bytes + parts["optimizer_states_full"])
    if run.activation_offload:
        notes["pcie_bytes_per_micro_batch"] = 2 * host["activations"]  # out in forward, back in backward
    fits = headroom = None
    if budget_bytes is not None:
        headroom = int(budget_bytes - peak)
        fits = headroom >= 0
    details = {
        "device": gpu_spec.name if gpu_spec else run.device_type,
        "sharding": sharding,
        "world_size": world_size,
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
        model=config.model.model, method=method, peak_bytes=peak,
        breakdown={k: int(moment.get(k, 0)) for k in BREAKDOWN_KEYS}, budget_bytes=budget_bytes, fits=fits,
        headroom_bytes=headroom, error_band=ERROR_BAND[method], per_layer_activation_bytes=int(per_layer),
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


def _analytical_peak(config, run: RunShape, hf_config, inventory, parts,
                     sharding: str = "none") -> tuple[dict, float, dict]:
    arch = architecture_for(hf_config)
    head_shape = task_head(config, arch)  # the --task's head: vocabulary logits or a few labels (prediction.encoders)
    precision = precision_of(run)
    b, s = config.training.batch_size, config.data.seq_len
    padding = padding_mask(hf_config, run, precision, b, s)  # an encoder's padded micro-batch: its attention masks
    full_offload = run.activation_offload and run.activation_offload_blocks is None
    # Offloaded checkpoints of every block and the head peak on the device where offloading every
    # block's input alone does (tracked at 16 and 32 blocks: 21.27 and 21.24 MiB): the head's saved
    # tensors are back and freed before the blocks' backward peaks. The device side is modelled as
    # that partial offload (the closed form for everything was 19-21 % under the tracker); the host
    # side still holds everything (`offload_terms.host_activations`).
    device_run = replace(run, activation_offload_blocks=arch.layers) if (
        full_offload and run.checkpointing == "full") else run
    # MoE blocks under --tiled-mlp: their tiling (experts and dense MLPs) is counted by prediction.tiled_experts
    moe = tiled_moe_terms(run, arch, hf_config, precision, b * s, inventory.expert_params, parts["trainable_bytes"],
                          lambda tiled: _layer_per_token(run, arch, hf_config, precision, s, tiled))
    terms = activation_bytes(
        arch, precision, batch_size=b, seq_len=s, attention=run.attention,
        checkpointing=run.checkpointing, checkpoint_every=run.checkpoint_every, mlp_tiles=0 if moe else run.mlp_tiles,
        offload=device_run.activation_offload and device_run.activation_offload_blocks is None,
        layer_per_token=padding.on_layer(
            moe.layer_per_token if moe else tiled_layer_per_token(  # an encoder's tiled feed-forward: its norm too
                _layer_per_token(run, arch, hf_config, precision, s), arch, precision, run.mlp_tiles), b * s),
        unchunked_loss=not run.fused_loss and not 0 < run.loss_chunk_size < b * (s - 1),
    )
    terms = moe.with_backward(terms) if moe else terms
    terms = offload_first_blocks(terms, device_run, arch, precision, b * s)
    terms = terms._replace(kept=terms.kept + padding.kept)
    if device_run is not run:
        terms = terms._replace(host=host_activations(config, run, hf_config))
    activations, recompute, per_layer = terms.kept, terms.recompute, terms.per_layer
    recompute += flash_backward_workspace_bytes(arch, precision, b * s, run.attention, run.device_type)
    logits = head_logits_bytes(head_shape, arch, b, s, run.loss_chunk_size, precision.compute, run.fused_loss)
    # Backward frees a block's activations while its gradients appear: the peak is at the
    # first block (everything kept + the head's and one block's gradients) or the last
    # one (one block kept + every gradient), whichever is larger.
    head = head_shape.outputs * arch.hidden * parts["trainable_bytes"] if not run.lora_r else 0
    embedding_grad = trailing_embedding_gradient_bytes(head_shape, arch, parts["trainable_shapes"],
                                                       parts["trainable_bytes"], run.lora_r)  # made after the blocks'
    block_grads = (parts["gradients"] - head - embedding_grad) / max(1, arch.layers)
    largest_grad = parts["largest_trainable"] * parts["trainable_bytes"]
    step_temporaries = parts["optimizer_temporaries"]
    # A trainable tied embedding gets two gradients, the head's (first in backward) and the
    # embedding's (last); autograd adds them out of place before the weight's gradient exists:
    # the two and their sum are live together at the end of backward (measured with the tracker).
    tb, shapes = parts["trainable_bytes"], list(parts["trainable_shapes"])
    tied = head_shape.tied and not run.lora_r and (arch.vocab, arch.hidden) in shapes
    tied_grad = arch.vocab * arch.hidden * tb if tied else 0.0
    tied_end = 0.0
    if run.optimizer_in_backward:
        # Each gradient is applied and freed by its own hook: one tensor's gradient (and its
        # optimizer step's temporaries) at a time, never a block's or the model's. A tied
        # embedding is the exception: its hook fires only after both uses' gradients are
        # summed, so the head's gradient is held through the whole backward, and the tied
        # tensor is stepped last, when the blocks' activations are gone (the sum, then the
        # gradient and its step's temporaries).
        if tied:
            shapes.remove((arch.vocab, arch.hidden))
            tied_end = tied_grad + max(2 * tied_grad, 0 if run.optimizer_offload else in_backward_step_temporary_bytes(
                run.optimizer, arch.vocab * arch.hidden, tb))
        head, block_grads = tied_grad, 0.0
        # An untied head and embedding are stepped apart from the blocks (`untied_edge_steps`)
        untied_edges = [] if tied or run.lora_r else [shape for shape in shapes if arch.vocab in shape]
        largest = max((math.prod(shape) for shape in shapes if shape not in untied_edges), default=0)
        largest_grad = largest * tb
        step_temporaries = 0 if run.optimizer_offload else in_backward_step_temporary_bytes(run.optimizer, largest, tb)
    # A recomputed block's backward through fp32 adapters on a 16-bit or an fp32 base (not
    # under autocast) holds its MLP activation gradients at once (measured: about
    # 2 x intermediate x the compute bytes per token; 16 fp32 blocks: 25 MiB of gradients).
    adapter_working = 2 * precision.compute * arch.intermediate * b * s / max(1, run.mlp_tiles) if (
        run.checkpointing != "off" and run.lora_r and (run.weight_bytes == 2 or not run.autocast)) else 0.0
    if run.lora_r and precision.adapter_input == 0:
        # memfit's adapter path casts one slice of rows at a time in backward (at most
        # SLICE_ELEMENTS): about one fp32 input-wide slice is live beside the block's tensors
        # (tracked: 1.3 MiB at 1024 tokens x 352, where the slice is the whole input)
        from memfit.techniques.efficient_lora import SLICE_ELEMENTS

        tile_tokens = b * s / max(1, run.mlp_tiles)
        adapter_working += 4 * min(SLICE_ELEMENTS, tile_tokens * max(arch.intermediate, arch.hidden))
    # an encoder's own MLP backward (ESM's GELU; a plain MLP's under LoRA in place of the adapter terms), per tile
    recompute += backward_working_bytes(arch, precision, b * s, run.mlp_tiles, adapter_working)
    released = terms.released_per_block
    fixed = activations - arch.layers * released  # the embedding side, uncheckpointed or offloaded blocks
    # autocast caches a 16-bit copy of each weight from its first use until backward is past it
    # (the fused experts' 3-D weights too: autocast casts them for grouped_mm and caches the copies alike)
    cache = 2 * (inventory.linear_params + inventory.expert_params) if (
        run.autocast and run.weight_bytes == 4 and run.quantize == "none") else 0.0
    # Beside the head's gradient while the chunked loss's backward makes it, with every activation kept and
    # before any block's gradient: one chunk's logits (in place) or two more head-sized sums (prediction/chunked_head)
    head_one = head_shape.outputs * arch.hidden * tb if not run.lora_r else 0
    head_sums = chunked_loss_head_bytes(run, head_one, logits, b * (s - 1), sharding)
    edge_grads, edge_temporaries, end_grad, end_temporaries = untied_edge_steps(
        run, untied_edges, head_one // max(1, tb), tb, head_sums + head_one) if run.optimizer_in_backward else (0.0,) * 4
    if end_grad:  # the embedding, stepped last like a tied one
        tied_grad, tied_end = end_grad, end_grad + end_temporaries
    if run.optimizer_in_backward and not edge_grads and head_sums + head_one - head > largest_grad + step_temporaries:
        largest_grad, step_temporaries = head_sums + head_one - head, 0  # the head's hook waits for the sum
    first_grads = block_grads if run.optimizer_in_backward else max(block_grads, head_sums)
    at_first_block = activations + cache + first_grads
    at_last_block = max(0.0, fixed) + released + cache / max(1, arch.layers) + arch.layers * block_grads
    in_flight_grads = first_grads if at_first_block >= at_last_block else arch.layers * block_grads
    # What the techniques add by themselves (QLoRA's dequantized weight, paged state, ...: their TECHNIQUE's terms);
    # "other" is resident through every phase, the other categories join the peak moment.
    technique_terms = memory_terms(run, MemoryFacts(arch, inventory, hf_config, config, parts, b * s))
    other = technique_terms.pop("other", 0.0)
    resident = parts["parameters"] + parts["optimizer_states"] + other
    # Micro-batches after the first of an optimizer step run with the earlier ones' gradients
    # accumulated: the whole gradient is live through their forward and backward, and backward
    # adds each new gradient (one tensor at a time) into it.
    accumulated = parts["gradients"] if config.accumulation_for() > 1 and not run.optimizer_in_backward else 0.0
    forward_end = resident + accumulated + activations + cache + logits
    backward_activations = max(at_first_block, at_last_block) - in_flight_grads
    if accumulated:
        head, in_flight_grads = largest_grad, 0.0
    backward = resident + accumulated + backward_activations + recompute + head + in_flight_grads
    if run.optimizer_in_backward:
        backward += largest_grad + step_temporaries
        at_head_step = resident + backward_activations + edge_grads + edge_temporaries  # no block recomputed yet
        if edge_grads and at_head_step > backward:
            backward, recompute, head, in_flight_grads = at_head_step, 0.0, 0.0, 0.0
            largest_grad, step_temporaries = edge_grads, edge_temporaries
        optimizer_step = resident + tied_end  # the steps ran inside backward; a tied embedding's last
    else:
        # every gradient exists from the end of backward (a tied embedding's sum) through the step
        end_extra = max(parts["optimizer_temporaries"], 2 * tied_grad)
        optimizer_step = parts["parameters"] + parts["gradients"] + parts["optimizer_states"] + other + end_extra
    if max(forward_end, backward) >= optimizer_step:
        in_backward = backward > forward_end
        gradients = head + in_flight_grads + (largest_grad if run.optimizer_in_backward else 0)
        moment = {"parameters": parts["parameters"], "gradients": accumulated + (gradients if in_backward else 0),
                  "optimizer_states": parts["optimizer_states"],
                  "activations": backward_activations if in_backward else activations + cache,
                  # the block being recomputed (checkpointing) or brought back from host memory (offload)
                  "recomputed_activations": recompute if in_backward else 0,
                  "logits": 0 if in_backward else logits,
                  "other": other + (step_temporaries if in_backward and run.optimizer_in_backward else 0)}
        phase = "backward" if in_backward else "forward"
    elif run.optimizer_in_backward:  # the tied embedding's step at the end of backward
        moment = {"parameters": parts["parameters"], "gradients": tied_grad,
                  "optimizer_states": parts["optimizer_states"], "activations": 0, "logits": 0,
                  "other": other + tied_end - tied_grad}
        phase = "backward"
    else:
        moment = {"parameters": parts["parameters"], "gradients": parts["gradients"],
                  "optimizer_states": parts["optimizer_states"], "activations": 0, "logits": 0,
                  "other": other + end_extra}
        phase = "optimizer step" if parts["optimizer_temporaries"] >= 2 * tied_grad else "backward"
    for category, size in technique_terms.items():
        moment[category] = moment.get(category, 0) + size
    notes = {"peak_phase": phase, "activation_bytes": int(activations), "logits_bytes": int(logits),
             "autocast_weight_copies_bytes": int(cache), "host_activation_bytes": int(terms.host),
             "padding_mask_bytes": int(padding.at_peak()),
             "activations_measured_from_model": arch.model_type not in CLOSED_FORM_FAMILIES}
    return moment, per_layer, notes
