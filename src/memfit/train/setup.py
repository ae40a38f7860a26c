"""Put a training run together: config -> device, engine, model, techniques, optimizer, data.

    build_session(config)
      device, ranks, precision, attention            what runs, with fallbacks said
      resolve(config)                                every technique's refusals, before anything is read
      choose_engine                                  one process, DDP, FSDP2 or DeepSpeed (train/engine.py)
      load the model, the data, the batch schedule   everything the user's input can get wrong
      resolve(config, model, device)                 the ResolvedRun at the data's length (resolution/resolve.py)
      apply_model_techniques                         every model technique of the registry, in its order
      engine.prepare(model, build_run_optimizer)     shard or wrap, then the optimizer the run resolved to
      the loss recipe, the LR schedule

Everything that can fail because of the user's input (a missing model, bad data, a
precision the device cannot run) fails here, before anything is written to the output
directory. Each choice is made once, in the resolved run (`session.run`), with the engine's needs known (its own
optimizer, no grad scaler, no OOM recovery). What applying a technique settles (the blocks auto checkpointing
chose, a kernel the model does not have) fills in the run or is recorded as a change; after the session is built
the run changes only through `TrainingSession.change_run`.
"""

from __future__ import annotations

import logging
import math
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from memfit.config import TrainConfig
from memfit.data import BatchSchedule, TokenizedDataset
from memfit.data.length_groups import build_schedule
from memfit.distributed.context import DistContext, init_distributed
from memfit.errors import UsageError
from memfit.hardware import supports_bf16, training_device
from memfit.memory.stats import configure_cuda_allocator
from memfit.models.loader import LoadedModel, load_model_and_tokenizer
from memfit.resolution.registry import techniques
from memfit.resolution.resolve import resolve
from memfit.tasks import Task, build_task
from memfit.techniques.attention import AttentionChoice, attention_that_ran, run_attention
from memfit.techniques.loss_recipe import LossFunction
from memfit.techniques.optimizer_stage import build_run_optimizer
from memfit.techniques.optimizers import build_scheduler
from memfit.techniques.packed_attention import pack_for_model
from memfit.techniques.precision import PrecisionChoice, run_precision
from memfit.techniques.resolved_run import ResolvedRun
from memfit.techniques.technique import ApplyContext
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
    run: ResolvedRun
    """What runs, typed (techniques/resolved_run.py): every part of the run reads its choices here. It changes only
    through `change_run`, which records why."""
    loss_function: LossFunction
    """The loss recipe, built once from `run` and the task (techniques/loss_recipe.py): the step only calls it."""
    applied: dict[str, str] = field(default_factory=dict)
    """Technique -> what applying it did, in words, for the log and the metrics (never parsed)."""
    fallbacks: dict[str, str] = field(default_factory=dict)
    """Technique -> what ran instead of what was asked, or what memfit chose, and why (log and metrics)."""
    eval_dataset: Any = None
    """The samples evaluation runs on (--eval-dataset or --eval-fraction; train/evaluation.py), or None."""
    task: Task = field(default_factory=Task)
    """What is learned (memfit.tasks): the head's class, the loss and its normalisation, the data, the metrics."""

    def change_run(self, technique: str, reason: str, step: int | None = None, **fields: Any) -> None:
        """Change what runs (an eager fallback of compiled blocks, an OOM escalation): a new resolved run, with the
        change recorded in its events."""
        self.run = self.run.changed(technique, reason, step, **fields)

    @property
    def model(self) -> torch.nn.Module:
        return self.loaded.model

    @property
    def scaler(self) -> torch.amp.GradScaler | None:
        return self.engine.scaler

    @property
    def effective_batch_size(self) -> int:
        return self.config.effective_batch_for(self.dist.data_world_size)

    @property
    def output_dir(self) -> Path:
        return Path(self.config.output.output_dir)

    @property
    def checkpointing(self) -> str:
        """What gradient checkpointing does, in words ('off', 'full on 4 of 4 blocks'): for people only."""
        return self.applied.get("gradient_checkpointing") or self.run.describe_checkpointing()

    @property
    def compiled(self) -> str:
        """What --compile compiled, in words, or 'off': for people only (code reads `run.compiled`)."""
        if not self.run.compiled:
            fell_back = any(event.technique == "compile" for event in self.run.events)
            return "off (asked, ran eager)" if fell_back else "off"
        return self.applied.get("compile", "on")


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


@dataclass
class _Building:
    """What the phases of `_build_session` hand each other."""

    config: TrainConfig
    device: torch.device
    dist: DistContext
    task: Task
    fallbacks: dict[str, str]
    precision: PrecisionChoice
    attention: AttentionChoice
    engine: Engine
    asked: ResolvedRun
    """The run as the config alone resolves it (no model, no data yet): what loading needs to know."""
    loaded: LoadedModel | None = None
    attention_ran: str = ""


def _build_session(config: TrainConfig) -> TrainingSession:
    build = _choose_device_and_engine(config)
    _load_model(build)
    dataset, eval_dataset, schedule, total_steps = _load_data(build)
    config = build.config
    applied: dict[str, str] = {}
    build.loaded.model, run = apply_model_techniques(config, build.loaded.model, build.task.peft_task_type,
                                                     run=_resolve(build), device=build.device,
                                                     fallbacks=build.fallbacks, applied=applied)
    model = build.loaded.model
    chosen = build.engine.prepare(model, lambda m: build_run_optimizer(run, config.optimizer, m, build.device,
                                                                       build.fallbacks))
    from memfit.techniques.chunked_head_loss import head_gradient_path

    head_gradient = head_gradient_path(model, build.engine.name, run.loss_chunk_size if build.task.name == "causal-lm"
                                       else 0, run.fused_loss, build.fallbacks)
    run = run.applied("loss_chunking", build.fallbacks.get("chunked_head_loss", ""), head_gradient=head_gradient)
    from memfit.techniques.loss_recipe import build_loss_function

    return TrainingSession(
        config=config, device=build.device, dist=build.dist, precision=build.precision, attention=build.attention,
        loaded=build.loaded, dataset=dataset, schedule=schedule, engine=build.engine,
        optimizer=chosen.optimizer, optimizer_name=chosen.name,
        scheduler=build_scheduler(chosen.optimizer, config.optimizer, total_steps),
        total_steps=total_steps, accumulation_steps=config.accumulation_for(build.dist.data_world_size),
        run=run, loss_function=build.task.loss_function(build_loss_function(run, model)),
        applied=applied, fallbacks=build.fallbacks, eval_dataset=eval_dataset, task=build.task,
    )


def _choose_device_and_engine(config: TrainConfig) -> _Building:
    """Device, ranks, the task, precision, attention and the engine; every refusal the config alone shows."""
    if torch.cuda.is_available():
        configure_cuda_allocator()
    device = training_device()
    dist = init_distributed(device)
    _start_context_parallel(config, dist, device)
    config.validate(world_size=dist.data_world_size)
    check_trackers(config.output)  # --report-to / --tensorboard: a missing package stops the run before it writes
    task = build_task(config)  # reads the training table's labels (they size the head); may set packing off
    # Defaults memfit chose from the other settings; the loop logs each entry once.
    fallbacks: dict[str, str] = dict(config.derived)
    precision = run_precision(config, device)
    attention = run_attention(config, device, precision.autocast_dtype)
    if attention.fell_back:
        fallbacks["attention"] = attention.reason
    # What the techniques refuse in this config (under this engine too) stops the run before the model and the data
    # are read; the run is resolved again, at the data's length and on the loaded model's config, once both are known.
    asked = resolve(config, None, device.type, bf16_supported=supports_bf16(device), world_size=dist.world_size)
    engine = choose_engine(config, dist, device, precision, fallbacks, asked)
    return _Building(config, device, dist, task, fallbacks, precision, attention, engine, asked)


def _start_context_parallel(config: TrainConfig, dist: DistContext, device: torch.device) -> None:
    """--context-parallel N: refuse what cannot run, then build the ("dp", "cp") mesh (distributed/context_parallel.py)."""
    from memfit.distributed import context_parallel

    distributed = config.distributed
    context_parallel.check(distributed.context_parallel, distributed.context_parallel_mode, dist.world_size, device.type,
                           config.task.task)
    chosen = context_parallel.start(dist, distributed.context_parallel, device.type)
    if chosen is not None:
        config.derived["context_parallel"] = chosen.implementation
        if dist.is_main:
            log.info("memfit: context parallel: %s", chosen.implementation)


def _load_model(build: _Building) -> None:
    """The model and tokenizer (LoRA's quantization at load, MoE experts staged in host memory)."""
    config, device, task = build.config, build.device, build.task
    if build.asked.lora_r > 0 or build.asked.quantize != "none":
        from memfit.techniques.lora import quantization_config

        quantization = quantization_config(config.lora, build.precision.autocast_dtype or torch.float32)
        task.keep_head_unquantized(quantization)  # a new classifier (and pooler) is built, not loaded: never 4/8-bit
    else:
        quantization = None
    staged = _staging(config, build.asked, build.dist.world_size)  # MoE experts QLoRA shrinks or streaming keeps: loaded on host
    loaded = load_model_and_tokenizer(config, device, build.attention, quantization, auto_class=task.auto_class,
                                      head_config=task.model_config(), on_host=staged.any)
    if staged.any:
        from memfit.techniques.staged_weights import stage_on_host

        log.info("memfit: %s", stage_on_host(loaded.model, device, staged))
    task.prepare_model(loaded.model, loaded.tokenizer)
    if build.dist.context_parallel > 1:  # every rank attends the whole row on its share of the heads
        from memfit.distributed.context_parallel import use_ulysses_attention

        build.attention = AttentionChoice(build.attention.requested, use_ulysses_attention(loaded.model),
                                          "--context-parallel: Ulysses attention over the context group")
    ran = attention_that_ran(loaded.model)
    if ran != build.attention.implementation:
        build.fallbacks["attention"] = (f"{build.attention.implementation} requested, {ran} ran (the model does not"
                                        " support it)")
    build.loaded, build.attention_ran = loaded, ran


def _load_data(build: _Building):
    """The training and evaluation samples and the batch schedule; the data may choose the sequence length."""
    config, dist, loaded, task = build.config, build.dist, build.loaded, build.task
    if not dist.is_main:
        dist.barrier()  # rank 0 tokenizes into the shared cache first; the others then read it
    effective_batch = task.items_per_step(config.effective_batch_for(dist.data_world_size))
    # Data too short for one effective batch is refused before its token cache is written.
    dataset = task.load_data(
        _data_config(config), loaded.tokenizer, max_positions=loaded.max_positions, min_samples=effective_batch,
        rope_positions=loaded.rope_positions, say=dist.is_main,  # what the length did: said once, not per rank
    )
    if dataset.seq_len != config.data.seq_len:  # --seq-len not given: the data chose it (said by the data's loader)
        config = config.with_seq_len(dataset.seq_len)
        build.fallbacks.update(config.derived)  # what was derived from the length (--use-chunked-training's tiles)
    eval_source = load_eval_data(config, _data_config(config), loaded, load=task.load_data)  # read like training data
    if dist.is_main:
        dist.barrier()
    task.after_data_loaded(dist)  # every rank has the data now: work they share (no rank waits in a barrier for it)
    ran = build.attention_ran
    # --packing samples: whole samples share windows, attention restricted to each (or `off` for stateful layers).
    dataset = pack_for_model(dataset, config.data.packing, None, loaded.model, ran, config.data.seq_len,
                             effective_batch, build.fallbacks, build.attention.requested, build.device)
    if attention_that_ran(loaded.model) != ran:  # packed rows on a GPU switched SDPA to FlexAttention
        ran = attention_that_ran(loaded.model)
        build.attention = AttentionChoice(build.attention.requested, ran, "packed samples: FlexAttention's document mask")
    dataset, eval_dataset = split_for_evaluation(config, dataset, eval_source, loaded.model, ran, effective_batch)
    schedule = build_schedule(dataset, effective_batch, config.training.seed, dist.data_rank, dist.data_world_size,
                              config.data.group_by_length)  # --group-by-length: steps of similar lengths
    total_steps = (
        schedule.steps_for_epochs(config.training.epochs) if config.training.epochs is not None
        else config.training.max_steps
    )
    if config.optimizer.warmup_ratio and not config.optimizer.warmup_steps:  # a share of the steps, known only now
        config.optimizer.warmup_steps = math.ceil(config.optimizer.warmup_ratio * total_steps)  # as the Trainer rounds
    build.config = config
    return dataset, eval_dataset, schedule, total_steps


def _resolve(build: _Building) -> ResolvedRun:
    """The run at the data's length, on the loaded model's config, with the kernel the model really runs."""
    from memfit.techniques.auto_checkpointing import checkpointing_budget

    run = resolve(build.config, build.loaded.model.config, build.device.type,
                  bf16_supported=supports_bf16(build.device), world_size=build.dist.world_size,
                  budget_bytes=checkpointing_budget(build.config))
    # the model may run another kernel than the one resolved (it has no SDPA path, packed rows need FlexAttention)
    return run.applied("attention", build.fallbacks.get("attention", "the kernel the model runs"),
                       attention=build.attention_ran)


def apply_model_techniques(config: TrainConfig, model: torch.nn.Module, peft_task_type: str = "CAUSAL_LM", *,
                           run: ResolvedRun | None = None, device: torch.device | None = None,
                           fallbacks: dict[str, str] | None = None,
                           applied: dict[str, str] | None = None) -> tuple[torch.nn.Module, ResolvedRun]:
    """Apply every technique that changes the model, in registry order (resolution/registry.py); returns the model
    and the run with what the application settled (blocks checkpointed, whether compiled blocks or liger's loss run).

    `run`: the resolved run (default: resolved here from `config` and the model's config, on `device`). What each
    technique did, in words, goes to `applied` when given; what fell back, to `fallbacks`. The engine shards or
    wraps the result afterwards (engine.prepare).
    """
    device = device or next(model.parameters()).device
    fallbacks = {} if fallbacks is None else fallbacks
    if run is None:
        run = resolve(config, model.config, device.type, bf16_supported=supports_bf16(device))
    context = ApplyContext(config=config, device=device, fallbacks=fallbacks, peft_task_type=peft_task_type)
    for technique in techniques("model"):
        done = technique.apply(model, run, context)
        if done.model is not None:
            model = done.model
        if done.description:
            if applied is not None:
                applied[technique.name] = done.description
            (log.debug if done.quiet else log.info)("memfit: %s", done.description)
        if done.changes:
            run = run.applied(technique.name, fallbacks.get(technique.name, "as applied to the model"), **done.changes)
    return model, run


def _staging(config: TrainConfig, run: ResolvedRun, world_size: int):
    """What this run loads into host memory first (techniques/staged_weights.py); nothing for a dense model."""
    from memfit.techniques.staged_weights import StagedWeights, run_settings, staging_for, staging_for_run

    if not staging_for(is_moe=True, **run_settings(run, world_size)).any:
        return StagedWeights()  # nothing to stage even for a mixture of experts: the model's config is not read
    from memfit.models.presets import resolve_model_config

    try:
        hf_config = resolve_model_config(config.model.model, config.model.trust_remote_code)
    except UsageError:  # the loader says what is wrong with the model, in its own words
        return StagedWeights()
    return staging_for_run(run, hf_config, world_size)


def _data_config(config: TrainConfig):
    """Token caches live in the output directory unless --cache-dir says otherwise: memfit writes nowhere else."""
    from dataclasses import replace

    cache_dir = config.data.cache_dir or str(Path(config.output.output_dir) / "cache")
    return replace(config.data, cache_dir=cache_dir)
