"""Put a training run together: config -> device, engine, model, techniques, optimizer, data.

    build_session(config)
      device, ranks, precision, attention            what runs, with fallbacks said
      choose_engine                                  one process, DDP, FSDP2 or DeepSpeed (train/engine.py)
      load the model, the data, the batch schedule   everything the user's input can get wrong
      apply_model_techniques                         every memory technique on the model, in order
      engine.prepare(model, build_optimizer)         shard or wrap, then the optimizer over it
      LR schedule, loss chunk

Everything that can fail because of the user's input (a missing model, bad data, a
precision the device cannot run) fails here, before anything is written to the output
directory. Each choice is made once, with the engine's needs known (its own optimizer,
no grad scaler, no OOM recovery): nothing is changed after the session is built.
"""

from __future__ import annotations

import logging
import math
import shutil
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from memfit.config import TrainConfig
from memfit.data import BatchSchedule, TokenizedDataset
from memfit.data.length_groups import build_schedule
from memfit.distributed.context import DistContext, init_distributed
from memfit.errors import UsageError
from memfit.hardware import training_device
from memfit.memory.stats import configure_cuda_allocator
from memfit.models.loader import LoadedModel, load_model_and_tokenizer
from memfit.models.optimizer_state import SMALL_STATE_OPTIMIZERS
from memfit.tasks import Task, build_task
from memfit.techniques.attention import AttentionChoice, attention_that_ran, choose_attention
from memfit.techniques.checkpointing import apply_gradient_checkpointing
from memfit.techniques.compile import compile_blocks, compile_token_loss
from memfit.techniques.kernels import KernelChoice, apply_kernels
from memfit.techniques.optimizers import OptimizerChoice, build_optimizer, build_scheduler, parameter_groups
from memfit.techniques.packed_attention import pack_for_model
from memfit.techniques.precision import PrecisionChoice, resolve_precision
from memfit.train.engine import Engine, choose_engine
from memfit.train.evaluation import load_eval_data, split_for_evaluation
from memfit.train.metrics import check_trackers

log = logging.getLogger("memfit")


@dataclass
class TrainingSession:
    """Everything a run needs, built and checked before the first step."""

    config: TrainConfig
    device: torch.device
    dist: DistContext
    precision: PrecisionChoice
    attention: AttentionChoice
    loaded: LoadedModel
    dataset: TokenizedDataset
    schedule: BatchSchedule
    engine: Engine
    """Where the step's backward, reduction and update run, and who writes the files (train/engine.py)."""
    optimizer: torch.optim.Optimizer
    optimizer_name: str
    """What really steps: 'adamw (fused)', 'adamw-8bit (torchao)', '... (deepspeed zero-2 over 2 rank(s))'."""
    scheduler: Any
    total_steps: int
    accumulation_steps: int
    loss_chunk_size: int
    checkpointing: str
    """What gradient checkpointing really does ('off', 'full on 4 of 4 blocks', ...)."""
    fallbacks: dict[str, str] = field(default_factory=dict)
    """Technique -> what ran instead of what was asked, or what memfit chose, and why (log and metrics)."""
    kernels: KernelChoice = field(default_factory=KernelChoice)
    """Fused kernels that run (techniques/kernels.py); its fused_loss, when set, replaces the plain loss."""
    compiled: str = "off"
    """What --compile compiled ('4 of 4 blocks (inductor) and the loss'), or 'off': for people, never parsed."""
    compiled_ran: bool = False
    """Whether compiled blocks run: set where they are compiled, cleared after the first step when Dynamo ran them
    eager (train/loop.py). The speed model and its calibration read this, not `compiled`."""
    token_loss: Callable[..., torch.Tensor] | None = None
    """--compile: the compiled logits-to-loss tail (techniques.loss.token_loss_sum); None: the eager one."""
    eval_dataset: Any = None
    """The samples evaluation runs on (--eval-dataset or --eval-fraction; train/evaluation.py), or None."""
    task: Task = field(default_factory=Task)
    """What is learned (memfit.tasks): the head's class, the loss and its normalisation, the data, the metrics."""
    head_gradient: str = ""
    """How the chunked loss makes the head's gradient: 'in place', 'per chunk' (why: fallbacks), '' (not chunked or
    no trained head); techniques/chunked_head_loss.py."""

    @property
    def model(self) -> torch.nn.Module:
        return self.loaded.model

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self.engine.scaler

    @property
    def effective_batch_size(self) -> int:
        return self.config.effective_batch_for(self.dist.world_size)

    @property
    def output_dir(self) -> Path:
        return Path(self.config.output.output_dir)


def resolve_loss_chunk_size(config: TrainConfig, vocab_size: int) -> int:
    """--loss-chunk-size, or by default on where the logits are large (see techniques.loss)."""
    if config.memory.loss_chunk_size is not None:
        return config.memory.loss_chunk_size
    try:
        from memfit.techniques.loss import default_loss_chunk_size
    except ImportError:
        return 0
    return default_loss_chunk_size(vocab_size, config.data.seq_len_or_default, config.training.batch_size)


def build_session(config: TrainConfig) -> TrainingSession:
    """Build the run described by `config`. Raises UsageError for anything the user must fix.

    Bad input leaves nothing behind: the output and cache directories that building made (the
    token cache is written before, say, a missing package is found) are removed before the error.
    """
    made_here = [Path(p) for p in (config.output.output_dir, _data_config(config).cache_dir) if not Path(p).exists()]
    try:
        return _build_session(config)
    except UsageError:
        for path in made_here:
            shutil.rmtree(path, ignore_errors=True)
        raise


def _build_session(config: TrainConfig) -> TrainingSession:
    if torch.cuda.is_available():
        configure_cuda_allocator()
    device = training_device()
    dist = init_distributed(device)
    config.validate(world_size=dist.world_size)
    check_trackers(config.output)  # --report-to / --tensorboard: a missing package stops the run before it writes
    task = build_task(config)  # reads the training table's labels (they size the head); may set packing off
    # Defaults memfit chose from the other settings; the loop logs each entry once.
    fallbacks: dict[str, str] = dict(config.derived)
    precision = resolve_precision(config.memory.precision, device)
    attention = choose_attention(config.model.attention, device, precision.autocast_dtype)
    if attention.fell_back:
        fallbacks["attention"] = attention.reason
    engine = choose_engine(config, dist, device, precision, fallbacks)
    if config.memory.optimizer_in_backward:  # refused combinations stop the run before the data is read
        from memfit.techniques.optimizer_in_backward import check_optimizer_in_backward

        check_optimizer_in_backward(
            config.accumulation_for(dist.world_size), config.optimizer.max_grad_norm, uses_grad_scaler=precision.grad_scaler
        )
    if config.lora.lora_r > 0 or config.lora.quantize != "none":
        from memfit.techniques.lora import quantization_config

        quantization = quantization_config(config.lora, precision.autocast_dtype or torch.float32)
        task.keep_head_unquantized(quantization)  # a new classifier (and pooler) is built, not loaded: never 4/8-bit
    else:
        quantization = None
    if config.model.dtype == "fp16" and config.lora.lora_r == 0:
        raise UsageError("--dtype fp16 cannot be trained in full (fp16 gradients underflow); use --dtype bf16, fp32, or LoRA")
    staged = _staging(config, dist.world_size)  # MoE experts QLoRA shrinks or streaming keeps: loaded on the host
    loaded = load_model_and_tokenizer(config, device, attention, quantization, auto_class=task.auto_class,
                                      head_config=task.model_config(), on_host=staged.any)
    if staged.any:
        from memfit.techniques.staged_weights import stage_on_host

        log.info("memfit: %s", stage_on_host(loaded.model, device, staged))
    task.prepare_model(loaded.model, loaded.tokenizer)
    ran = attention_that_ran(loaded.model)
    if ran != attention.implementation:
        fallbacks["attention"] = f"{attention.implementation} requested, {ran} ran (the model does not support it)"

    if not dist.is_main:
        dist.barrier()  # rank 0 tokenizes into the shared cache first; the others then read it
    effective_batch = config.effective_batch_for(dist.world_size)
    # Data too short for one effective batch is refused before its token cache is written.
    dataset = task.load_data(
        _data_config(config), loaded.tokenizer, max_positions=loaded.max_positions, min_samples=effective_batch,
        rope_positions=loaded.rope_positions, say=dist.is_main,  # what the length did: said once, not per rank
    )
    if dataset.seq_len != config.data.seq_len:  # --seq-len not given: the data chose it (said by the data's loader)
        config = config.with_seq_len(dataset.seq_len)
        fallbacks.update(config.derived)  # what was derived from the length (--use-chunked-training's tiles)
    eval_source = load_eval_data(config, _data_config(config), loaded, load=task.load_data)  # --eval-dataset: read like the training data
    if dist.is_main:
        dist.barrier()
    # --packing samples: whole samples share windows, attention restricted to each (or `off` for stateful layers).
    dataset = pack_for_model(dataset, config.data.packing, None, loaded.model, ran, config.data.seq_len,
                             effective_batch, fallbacks, config.model.attention, device)
    if attention_that_ran(loaded.model) != ran:  # packed rows on a GPU switched SDPA to FlexAttention
        ran = attention_that_ran(loaded.model)
        attention = AttentionChoice(config.model.attention, ran, "packed samples: FlexAttention's document mask")
    dataset, eval_dataset = split_for_evaluation(config, dataset, eval_source, loaded.model, ran, effective_batch)
    schedule = build_schedule(dataset, effective_batch, config.training.seed, dist.rank, dist.world_size,
                              config.data.group_by_length)  # --group-by-length: steps of similar lengths
    total_steps = (
        schedule.steps_for_epochs(config.training.epochs) if config.training.epochs is not None else config.training.max_steps
    )
    if config.optimizer.warmup_ratio and not config.optimizer.warmup_steps:  # a share of the steps, known only now
        config.optimizer.warmup_steps = math.ceil(config.optimizer.warmup_ratio * total_steps)  # as the Trainer rounds
    # Only once the data is checked (its sequence length against the model too): techniques log what they do.
    loaded.model, checkpointing = apply_model_techniques(config, loaded.model, task.peft_task_type)
    kernels = apply_kernels(loaded.model, config.memory.kernels, device, fallbacks)  # liger on CUDA, else PyTorch's
    compiled, compiled_ran, token_loss = "off", False, None
    if config.memory.compile:
        choice = compile_blocks(loaded.model, device, fallbacks=fallbacks)
        compiled, compiled_ran = choice.description, choice.compiled_blocks > 0
        if choice.compiled_blocks and kernels.fused_loss is None:  # liger's fused loss never builds the logits
            token_loss, compiled = compile_token_loss(), f"{compiled} and the loss"
    model = loaded.model
    chosen = engine.prepare(model, lambda m: _build_optimizer(config, m, device, fallbacks))
    head = model.get_output_embeddings()
    loss_chunk_size = resolve_loss_chunk_size(config, head.weight.shape[0] if head is not None else 0)
    from memfit.techniques.chunked_head_loss import head_gradient_path

    head_gradient = head_gradient_path(model, engine.name, loss_chunk_size if task.name == "causal-lm" else 0,
                                       kernels.fused_loss is not None, fallbacks)
    return TrainingSession(
        config=config,
        device=device,
        dist=dist,
        precision=precision,
        attention=attention,
        loaded=loaded,
        dataset=dataset,
        schedule=schedule,
        engine=engine,
        optimizer=chosen.optimizer,
        optimizer_name=chosen.name,
        scheduler=build_scheduler(chosen.optimizer, config.optimizer, total_steps),
        total_steps=total_steps,
        accumulation_steps=config.accumulation_for(dist.world_size),
        loss_chunk_size=loss_chunk_size,
        checkpointing=checkpointing,
        fallbacks=fallbacks,
        kernels=kernels,
        compiled=compiled,
        compiled_ran=compiled_ran,
        token_loss=token_loss,
        eval_dataset=eval_dataset,
        task=task,
        head_gradient=head_gradient,
    )


def apply_model_techniques(config: TrainConfig, model: torch.nn.Module,
                           peft_task_type: str = "CAUSAL_LM") -> tuple[torch.nn.Module, str]:
    """Apply the memory techniques that change the model, in this order; returns the model and
    what gradient checkpointing does.

    1. gradient checkpointing (off, full, selective, or auto under a budget)   techniques/checkpointing.py
    2. LoRA adapters (after checkpointing, which they must know about)          techniques/lora.py
       and their memory-efficient path (--no-efficient-lora: off)               techniques/efficient_lora.py
    3. tiled MLP past 8192 tokens or with --tiled-mlp (adapters inside included) techniques/tiled_mlp.py
       and each MoE layer's experts call alike                                   techniques/tiled_experts.py
    4. memory-efficient RMSNorm (--no-efficient-norm: off; liger's, applied      techniques/rms_norm.py
       after, replaces it where it runs)
    Between 2 and 3: expert offload, the NF4 head, the embedding on host, grouped expert dequantization, then
    what a staged load left in host memory and none of them took goes to the device (techniques/staged_weights.py).
    The engine shards or wraps the result afterwards (engine.prepare). Precision (autocast),
    attention, the chunked loss and the optimizer techniques are chosen in build_session
    and applied by the step.
    """
    if config.memory.gradient_checkpointing in ("off", "full", "selective"):
        checkpointing = apply_gradient_checkpointing(
            model, config.memory.gradient_checkpointing, config.memory.checkpoint_every
        )
    else:
        checkpointing = _auto_checkpointing(config, model)
    if config.lora.lora_r > 0:
        from memfit.techniques.lora import apply_lora

        # The task's PEFT type: a classification head (new, so never pretrained) trains in full beside the adapters.
        model, summary = apply_lora(model, config.lora, gradient_checkpointing=checkpointing != "off",
                                    task_type=peft_task_type)
        log.info("memfit: %s", summary.describe())
        if config.memory.efficient_lora:
            from memfit.techniques.efficient_lora import apply_efficient_lora

            # On by default and nothing to act on: the debug log (MEMFIT_LOG_LEVEL=DEBUG). An adapter that falls back
            # to PEFT's path at run time is still said, as a fallback (loop._check_efficient_lora).
            log.debug("memfit: efficient LoRA: %s", apply_efficient_lora(model))
    if config.memory.expert_offload:  # frozen experts in host memory, brought per layer (before tiled experts wrap it)
        from memfit.techniques.expert_streaming import apply_expert_streaming

        log.info("memfit: expert offload: %s", apply_expert_streaming(model))
    if config.lora.quantize_head:  # the frozen head in NF4, projected a tile of vocabulary rows at a time
        from memfit.techniques.nf4_head import quantize_head

        log.info("memfit: NF4 head: %s", quantize_head(model))
    if config.memory.embedding_on_host:  # the frozen input embedding's lookup in host memory
        from memfit.techniques.host_embedding import embedding_to_host

        log.info("memfit: embedding on host: %s", embedding_to_host(model))
    if config.memory.expert_dequant_group:  # NF4 expert stacks dequantized a group of experts at a time
        from memfit.techniques.expert_dequant_groups import set_dequant_group

        log.info("memfit: expert dequant group: %s", set_dequant_group(model, config.memory.expert_dequant_group))
    from memfit.techniques.staged_weights import settle_staged

    settled = settle_staged(model)  # what a staged load left in host memory and no technique took
    if settled:
        log.info("memfit: %s", settled)
    from memfit.techniques.tiled_mlp import apply_tiled_mlp, tiles_for

    tiles = tiles_for(config.data.seq_len_or_default, config.memory.tiled_mlp)
    if tiles > 1:
        tiled = apply_tiled_mlp(model, tiles)
        from memfit.techniques.tiled_experts import with_tiled_experts

        tiled = with_tiled_experts(model, tiles, tiled)  # each MoE layer's experts call, over token tiles
        if config.memory.tiled_mlp and tiled.startswith("off"):  # asked for and nothing to tile: refused, not ignored
            raise UsageError(f"--tiled-mlp {config.memory.tiled_mlp}: the blocks of {type(model).__name__} have no MLP"
                             " module (mlp, feed_forward or ffn) nor a feed_forward_chunk method to tile;"
                             " drop --tiled-mlp")
        log.info("memfit: tiled MLP: %s", tiled)
    if config.memory.efficient_norm:
        from memfit.techniques.rms_norm import apply_efficient_rms_norm

        # On by default, exact, and nothing to act on ("0 of 5 norms" on an encoder's LayerNorms): the debug log.
        log.debug("memfit: efficient RMSNorm: %s", apply_efficient_rms_norm(model))
    return model, checkpointing


def _staging(config: TrainConfig, world_size: int):
    """What this run loads into host memory first (techniques/staged_weights.py); nothing for a dense model."""
    from memfit.techniques.staged_weights import StagedWeights, run_settings, staging_for, staging_for_run

    if not staging_for(is_moe=True, **run_settings(config, world_size)).any:
        return StagedWeights()  # nothing to stage even for a mixture of experts: the model's config is not read
    from memfit.models.presets import resolve_model_config

    try:
        hf_config = resolve_model_config(config.model.model, config.model.trust_remote_code)
    except UsageError:  # the loader says what is wrong with the model, in its own words
        return StagedWeights()
    return staging_for_run(config, hf_config, world_size)


def _data_config(config: TrainConfig):
    """Token caches live in the output directory unless --cache-dir says otherwise: memfit writes nowhere else."""
    from dataclasses import replace

    cache_dir = config.data.cache_dir or str(Path(config.output.output_dir) / "cache")
    return replace(config.data, cache_dir=cache_dir)


def _build_optimizer(
    config: TrainConfig, model: torch.nn.Module, device: torch.device, fallbacks: dict
) -> OptimizerChoice:
    groups = parameter_groups(model, config.optimizer.weight_decay)
    if config.optimizer.optimizer in SMALL_STATE_OPTIMIZERS:  # GaLore, APOLLO, Adam-mini, 4-bit AdamW
        from memfit.techniques.small_state_optimizers import build_run_optimizer

        return build_run_optimizer(model, groups, config.optimizer, device, config.memory.optimizer_in_backward, fallbacks)
    if config.memory.optimizer_in_backward:
        from memfit.techniques.optimizer_in_backward import OptimizerInBackward
        made: list[OptimizerChoice] = []

        def make(params):
            choice = build_optimizer([{"params": params}], config.optimizer, device, impl="for-loop")
            made.append(choice)
            return choice.optimizer

        offload = config.memory.optimizer_offload  # each parameter's step then runs on a host copy of it
        if offload:
            from memfit.techniques.optimizer_offload import host_stepped
        # The groups' options (no weight decay on norms and biases) are applied to each per-parameter optimizer.
        optimizer = OptimizerInBackward(groups, host_stepped(make, device) if offload else make)
        name = (made[0].name if made else config.optimizer.optimizer) + " in backward" + (" on the host" if offload else "")
        return OptimizerChoice(optimizer, name, made[0].reason if made else "")
    choice = build_optimizer(groups, config.optimizer, device)
    if config.memory.optimizer_offload:
        from memfit.techniques.optimizer_offload import optimizer_offload

        offloaded, reason = optimizer_offload(choice.optimizer, groups, config.optimizer, device)
        if reason:
            fallbacks["optimizer_offload"] = reason
            log.warning("memfit: %s", reason)
        else:
            choice = OptimizerChoice(offloaded, choice.name + " offloaded to CPU", choice.reason)
    if choice.reason:
        fallbacks["optimizer"] = choice.reason
    return choice


def _auto_checkpointing(config: TrainConfig, model: torch.nn.Module) -> str:
    from memfit.techniques.auto_checkpointing import auto_checkpointing

    budget = config.memory.memory_budget or config.memory.memory_cap
    if budget is None and config.memory.gpu:
        from memfit.gpus import lookup_gpu

        budget = lookup_gpu(config.memory.gpu).memory_bytes
    return auto_checkpointing(model, config, budget)
