"""Typed configuration of a memfit run: the sections (memfit.config_sections) put together.

TrainConfig holds one dataclass per concern; this module checks them against each other and
derives the defaults that depend on other settings. Every field has a docstring (shown by
`memfit train --help-all`). The same names work
on the command line (with dashes: `--seq-len 512`) and in a YAML file (with
underscores: `seq_len: 512`), flat or under a section (`data: {seq_len: 512}`).
Names of other trainers are accepted as aliases (the Hugging Face Trainer's
`per_device_train_batch_size`, AI-OS's `--window-size`, `optim: adamw_8bit`, ...).

`memfit.config_loading.load_config(yaml_path, overrides)` builds a `TrainConfig` from a
file and flags, flags winning; `TrainConfig.validate()` collects every problem and raises
once. Command-line parsing itself lives in `memfit.cli.flags`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from memfit.config_sections import (  # noqa: F401 (the sections' names are memfit.config's too)
    ATTENTION_KINDS,
    CHECKPOINTING_MODES,
    DATASET_FORMATS,
    DEFAULT_SEQ_LEN,
    EVAL_STRATEGIES,
    KERNEL_CHOICES,
    LR_SCHEDULES,
    OPTIMIZER_IMPLS,
    OPTIMIZERS,
    PACKING_MODES,
    PRECISIONS,
    PREFERENCE_TASKS,
    PROBLEM_TYPES,
    QUANTIZE_MODES,
    RL_TASKS,
    ROPE_SCALINGS,
    SECTIONS,
    SHARDING_MODES,
    SIZE,
    SMALL_STATE_OPTIMIZERS,
    TASKS,
    TRAIN_ON_CHOICES,
    WEIGHT_DTYPES,
    DataConfig,
    DistributedConfig,
    EvalConfig,
    LoraConfig,
    MemoryConfig,
    ModelConfig,
    OptimizerConfig,
    OutputConfig,
    RLConfig,
    TaskConfig,
    TrainingConfig,
)
from memfit.errors import UsageError


@dataclass
class TrainConfig:
    """Everything a `memfit train` run needs, one section per concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    output: OutputConfig = field(default_factory=OutputConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    rl: RLConfig = field(default_factory=RLConfig)

    def __post_init__(self) -> None:
        # Where the settings came from: not settings themselves, so not fields (to_dict and
        # flat leave them out).
        self.user_set: frozenset[str] | None = None
        """Flat names the user gave (file or flags); None for a config built in code."""
        self.derived: dict[str, str] = {}
        """Settings memfit chose because the user left them out: flat name -> why (log and metrics)."""
        self.extensions: dict[str, Any] = {name: cls() for name, cls in _EXTENSION_SECTIONS.items()}
        """The settings of techniques registered beyond memfit's own, one section each (`register_section`)."""

    def __getattr__(self, name: str) -> Any:
        # only reached for names that are not attributes: a registered technique's section, `config.<name>`
        extensions = self.__dict__.get("extensions", {})
        if name in extensions:
            return extensions[name]
        raise AttributeError(f"{type(self).__name__} has no attribute {name!r}")

    @classmethod
    def from_flat(cls, values: dict[str, Any], user_set: Iterable[str] | None = None) -> TrainConfig:
        """A validated TrainConfig from already-converted flat values.

        `user_set` names the settings the user gave (default: every name in `values`);
        defaults that depend on other settings are derived only for the names outside it.
        Raises UsageError naming every problem.
        """
        names = frozenset(values if user_set is None else user_set)
        values, derived = derive_defaults(values, names)
        index = field_index()
        sections: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for name, value in values.items():
            sections[index[name][0]][name] = value
        config = cls(**{name: SECTIONS[name](**settings) for name, settings in sections.items()
                         if name not in _EXTENSION_SECTIONS})
        config.extensions = {name: SECTIONS[name](**sections[name]) for name in _EXTENSION_SECTIONS}
        config.user_set, config.derived = names, derived
        config.validate()
        return config

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """Nested plain dict (what checkpoints store and YAML files can hold)."""
        return dataclasses.asdict(self) | {name: dataclasses.asdict(section) for name, section in self.extensions.items()}

    def flat(self) -> dict[str, Any]:
        """Every field by its flat name."""
        return {name: getattr(getattr(self, section), name) for name, (section, _) in field_index().items()}

    def replace(self, **changes: Any) -> TrainConfig:
        """A copy with some flat fields changed, validated; derived defaults are derived again."""
        values = {name: value for name, value in self.flat().items() if name not in self.derived}
        if self.user_set is None:  # built in code: what differs from the defaults was chosen
            defaults = TrainConfig().flat()
            user_set = {name for name, value in values.items() if value != defaults[name]}
        else:
            user_set = set(self.user_set)
        return TrainConfig.from_flat(values | changes, user_set | set(changes))

    def with_seq_len(self, seq_len: int | None = None) -> TrainConfig:
        """This config at `seq_len` (the length the data chose), or at DEFAULT_SEQ_LEN when --seq-len was not given
        and no data says otherwise (estimate and plan without a dataset); itself when nothing changes."""
        seq_len = seq_len if seq_len is not None else self.data.seq_len or DEFAULT_SEQ_LEN
        return self if seq_len == self.data.seq_len else self.replace(seq_len=seq_len)

    @property
    def lora_enabled(self) -> bool:
        return self.lora.lora_r > 0

    def accumulation_for(self, world_size: int = 1) -> int:
        """Micro-batches per optimizer step on each rank."""
        if self.training.effective_batch_size is None:
            return self.training.gradient_accumulation_steps
        per_step = self.training.batch_size * world_size
        return max(1, self.training.effective_batch_size // per_step)

    def effective_batch_for(self, world_size: int = 1) -> int:
        """Samples per optimizer step across all ranks."""
        return self.training.batch_size * self.accumulation_for(world_size) * world_size

    def validate(self, world_size: int = 1) -> None:
        """Raise one UsageError naming every problem found, by flag name."""
        problems = []
        t, d, o, m, lo = self.training, self.data, self.optimizer, self.memory, self.lora
        for name, value in (
            ("batch-size", t.batch_size),
            ("gradient-accumulation-steps", t.gradient_accumulation_steps),
            ("seq-len", DEFAULT_SEQ_LEN if d.seq_len is None else d.seq_len),  # None: from the data (memfit.data)
            ("checkpoint-every", m.checkpoint_every),
            ("chunk-size", m.chunk_size),
        ):
            if value < 1:
                problems.append(f"--{name} must be at least 1, got {value}")
        if t.max_steps < 1 and t.epochs is None:
            problems.append(f"--max-steps must be at least 1, got {t.max_steps}")
        if t.epochs is not None and t.epochs <= 0:
            problems.append(f"--epochs must be positive, got {t.epochs}")
        if d.stride < 0 or (d.seq_len is not None and d.stride >= d.seq_len):  # else checked once the length is known
            problems.append(f"--stride must be between 0 and --seq-len - 1 ({(d.seq_len or 1) - 1}), got {d.stride}")
        if t.effective_batch_size is not None:
            per_step = t.batch_size * world_size
            if t.effective_batch_size < 1:
                problems.append(f"--effective-batch-size must be at least 1, got {t.effective_batch_size}")
            elif t.effective_batch_size % per_step:
                problems.append(
                    f"--effective-batch-size {t.effective_batch_size} is not a multiple of --batch-size x ranks"
                    f" ({per_step}); pick a multiple or change --batch-size"
                )
        if o.lr <= 0:
            problems.append(f"--lr must be positive, got {o.lr}")
        if o.max_grad_norm < 0:
            problems.append(f"--max-grad-norm must be 0 (off) or positive, got {o.max_grad_norm}")
        if o.warmup_steps < 0:
            problems.append(f"--warmup-steps must be 0 or more, got {o.warmup_steps}")
        if not 0 <= o.warmup_ratio < 1:
            problems.append(f"--warmup-ratio must be at least 0 and below 1 (a share of the steps), got {o.warmup_ratio}")
        problems.extend(_small_state_optimizer_problems(o, lo, m.optimizer_offload))
        problems.extend(_frozen_weight_problems(m, lo))
        if m.embedding_on_host and (world_size > 1 or self.distributed.deepspeed):
            problems.append("--embedding-on-host runs in one process (DDP, FSDP2 and DeepSpeed keep every parameter on"
                            " the device): drop it or train on one GPU")
        if lo.quantize_head and (self.distributed.sharding == "fsdp" or self.distributed.zero_stage == 3):
            problems.append("--quantize-head cannot be sharded (FSDP2 and ZeRO-3 would split the packed NF4 head from"
                            " its quantization state): drop it or use --sharding ddp")
        problems.extend(_expert_offload_problems(m, lo))
        if m.activation_offload_blocks is not None:
            if m.activation_offload_blocks < 0:
                problems.append(f"--activation-offload-blocks must be 0 or more, got {m.activation_offload_blocks}")
            elif not m.activation_offload:
                problems.append("--activation-offload-blocks offloads part of the block inputs: drop --no-activation-offload")
            elif m.gradient_checkpointing not in ("full", "auto"):
                problems.append("--activation-offload-blocks counts checkpointed blocks: add --gradient-checkpointing full")
        if m.loss_chunk_size is not None and m.loss_chunk_size < 0:
            problems.append(f"--loss-chunk-size must be 0 (off) or positive, got {m.loss_chunk_size}")
        rope = self.model.rope_scale
        if rope is not None and not (rope >= 1 and rope != float("inf")):  # also refuses nan
            problems.append(f"--rope-scale must be a number of at least 1 (the factor the positions grow by), got {rope}")
        if self.model.rope_scaling != "auto" and rope is None:
            problems.append(f"--rope-scaling {self.model.rope_scaling} needs --rope-scale FACTOR")
        if lo.lora_r < 0:
            problems.append(f"--lora-r must be 0 (off) or positive, got {lo.lora_r}")
        if lo.quantize != "none" and lo.lora_r == 0:
            problems.append(f"--quantize {lo.quantize} freezes the base weights: add --lora-r (e.g. --lora-r 16)")
        if lo.merge_adapter and lo.lora_r == 0:
            problems.append("--merge-adapter needs LoRA: add --lora-r")
        if m.gradient_checkpointing == "auto" and m.memory_budget is None and m.gpu is None and m.memory_cap is None:
            problems.append("--gradient-checkpointing auto needs --memory-budget (or --gpu / --memory-cap) to aim at")
        if m.memory_budget is not None and m.gpu is not None:
            problems.append("give --memory-budget or --gpu, not both")
        out = self.output
        if out.save_every < 0 or out.save_every_minutes < 0 or out.save_total_limit < 0:
            problems.append("--save-every, --save-every-minutes and --save-total-limit must be 0 (off / keep all) or more")
        if out.preempt_grace_seconds <= 0:
            problems.append(f"--preempt-grace-seconds must be positive, got {out.preempt_grace_seconds}")
        if self.distributed.zero_stage is not None and self.distributed.zero_stage not in (1, 2, 3):
            problems.append(f"--zero-stage must be 1, 2 or 3, got {self.distributed.zero_stage}")
        if self.distributed.deepspeed and self.distributed.sharding == "fsdp":
            problems.append("--deepspeed and --sharding fsdp are two engines: pick one")
        problems.extend(self.evaluation.problems())
        problems.extend(self.task.problems())
        problems.extend(self.distributed.problems())
        problems.extend(_objective_setting_problems(self))
        if problems:
            raise UsageError("; ".join(problems))


def _DEFAULT_VALUES() -> dict[str, Any]:
    return {name: f.default for name, (_, f) in field_index().items() if f.default is not dataclasses.MISSING}


_PREFERENCE_ONLY = ("label_smoothing", "simpo_gamma", "cpo_alpha", "desirable_weight", "undesirable_weight",
                    "pair_layout")
_OBJECTIVE_SHARED = ("beta", "loss_type", "reference", "precompute_ref_log_probs")


def _objective_setting_problems(config: TrainConfig) -> list[str]:
    """Settings the user gave that the chosen --task never reads: one line naming the tasks that do."""
    # Given, and not at its default: a stored run's config lists every setting as given (a checkpoint, a plan).
    task_settings = {*_OBJECTIVE_SHARED, *_PREFERENCE_ONLY, *(f.name for f in dataclasses.fields(RLConfig))}
    asked = task_settings & (config.user_set or frozenset())
    if not asked:  # the common case, checked on every config the planner builds: nothing to read
        return []
    defaults, values = _DEFAULT_VALUES(), config.flat()
    given = {name for name in asked if name in defaults and values.get(name) != defaults[name]}
    task = config.task.task
    unread = []
    if task not in PREFERENCE_TASKS + RL_TASKS:
        unread += [name for name in _OBJECTIVE_SHARED if name in given]
    if task not in PREFERENCE_TASKS:
        unread += [name for name in _PREFERENCE_ONLY if name in given]
    if task not in RL_TASKS:
        unread += [f.name for f in dataclasses.fields(RLConfig) if f.name in given]
    if not unread:
        return []
    flags = ", ".join(f"--{name.replace('_', '-')}" for name in unread)
    readers = "grpo" if all(n in {f.name for f in dataclasses.fields(RLConfig)} for n in unread) else (
        ", ".join(PREFERENCE_TASKS) if all(n in _PREFERENCE_ONLY for n in unread) else ", ".join(PREFERENCE_TASKS + RL_TASKS))
    return [f"{flags} {'is' if len(unread) == 1 else 'are'} read by --task {readers}, not --task {task}: drop"
            f" {'it' if len(unread) == 1 else 'them'} or choose that task"]


def _expert_offload_problems(m: MemoryConfig, lo: LoraConfig) -> list[str]:
    """--expert-offload streams frozen experts, brought again by the recompute (techniques/expert_streaming.py)."""
    if not m.expert_offload:
        return []
    problems = []
    if lo.lora_r == 0:
        problems.append("--expert-offload streams frozen expert weights: add --lora-r (a full fine-tune trains them)")
    if m.gradient_checkpointing == "off":
        problems.append("--expert-offload needs --gradient-checkpointing full (without it autograd keeps every layer's"
                        " streamed experts on the device until backward)")
    if m.compile:
        problems.append("--expert-offload cannot run with --compile (compiled blocks capture the streamed weights)")
    if lo.merge_adapter:
        problems.append("--expert-offload keeps the experts in host memory: drop --merge-adapter and merge the saved"
                        " adapter afterwards")
    return problems


def _frozen_weight_problems(m: MemoryConfig, lo: LoraConfig) -> list[str]:
    """--embedding-on-host, --expert-dequant-group and --quantize-head act on frozen weights (techniques/host_embedding.py, expert_dequant_groups.py, nf4_head.py)."""
    problems = []
    if m.embedding_on_host and lo.lora_r == 0:
        problems.append("--embedding-on-host keeps a frozen embedding in host memory: add --lora-r (a full fine-tune trains it)")
    if m.expert_dequant_group < 0:
        problems.append(f"--expert-dequant-group must be 0 (whole stacks) or more experts, got {m.expert_dequant_group}")
    elif m.expert_dequant_group and lo.quantize != "4bit":
        problems.append("--expert-dequant-group splits the dequantization of NF4 expert stacks: add --quantize 4bit")
    if lo.quantize_head and lo.quantize != "4bit":
        problems.append("--quantize-head holds the frozen head in NF4 beside the 4-bit linears: add --quantize 4bit")
    if lo.quantize_head and lo.merge_adapter:
        problems.append("--quantize-head keeps only NF4 head bytes: drop --merge-adapter and merge the saved adapter afterwards")
    return problems


def _small_state_optimizer_problems(o: OptimizerConfig, lo: LoraConfig, optimizer_offload: bool) -> list[str]:
    """Settings of the projected and block-wise optimizers that cannot work."""
    problems = []
    for flag, value in (("optim-rank", o.optim_rank), ("optim-update-proj-gap", o.optim_update_proj_gap)):
        if value is not None and value < 1:
            problems.append(f"--{flag} must be at least 1, got {value}")
    if o.optim_scale is not None and not o.optim_scale > 0:
        problems.append(f"--optim-scale must be positive, got {o.optim_scale}")
    if lo.lora_r and o.optimizer in SMALL_STATE_OPTIMIZERS[:5]:
        what = "projects full weight gradients to low rank" if o.optimizer != "adam-mini" else (
            "partitions full weights into attention heads and rows")
        problems.append(f"--optimizer {o.optimizer} {what}; LoRA adapters are already small: drop --lora-r, or use"
                        " --optimizer adamw / adamw-8bit / adamw-4bit with LoRA")
    if optimizer_offload and o.optimizer in SMALL_STATE_OPTIMIZERS:
        problems.append(f"--optimizer-offload steps torch's AdamW on the host; --optimizer {o.optimizer} keeps its"
                        " small state on the device: drop one of them")
    return problems


# ---------------------------------------------------------------------------
# Field index, derived defaults
# ---------------------------------------------------------------------------


_EXTENSION_SECTIONS: dict[str, type] = {}
"""Sections of techniques registered beyond memfit's own (resolution/registry.py), by technique name."""


def register_section(name: str, section: type) -> None:
    """Add a registered technique's settings (a dataclass, a docstring per field) as a section of every config.

    Its fields become flags, YAML keys and help entries like every other setting. A field name another section
    already has is refused (a flat name means one setting).
    """
    if name in SECTIONS:
        raise ValueError(f"a config section named {name!r} exists already")
    taken = set(field_index())
    clashes = [f.name for f in dataclasses.fields(section) if f.name in taken]
    if clashes:
        raise ValueError(f"section {name!r}: the setting {clashes[0]!r} exists already")
    SECTIONS[name] = section
    _EXTENSION_SECTIONS[name] = section


def unregister_section(name: str) -> None:
    SECTIONS.pop(name, None)
    _EXTENSION_SECTIONS.pop(name, None)


_FIELD_INDEX: dict[tuple[tuple[str, type], ...], dict[str, tuple[str, dataclasses.Field]]] = {}


def field_index() -> dict[str, tuple[str, dataclasses.Field]]:
    """Flat field name -> (section name, dataclass field), for every section.

    Kept per set of sections (a registered section makes a new one): the planner builds thousands of configs, and
    each reads the index for every flat value. Callers only read it.
    """
    key = tuple(SECTIONS.items())
    index = _FIELD_INDEX.get(key)
    if index is None:
        index = {}
        for section, cls in SECTIONS.items():
            for f in dataclasses.fields(cls):
                index[f.name] = (section, f)
        _FIELD_INDEX.clear()
        _FIELD_INDEX[key] = index
    return index


def derive_defaults(values: dict[str, Any], user_set: frozenset[str]) -> tuple[dict[str, Any], dict[str, str]]:
    """Defaults that depend on other settings, for the names the user did not give.

    Returns the values with the derived ones added, and flat name -> why for each.
    """
    values, derived = dict(values), {}
    if values.get("activation_offload_blocks") is not None and "activation_offload" not in user_set:
        values["activation_offload"] = True
        derived["activation_offload"] = "activation offload is on: --activation-offload-blocks offloads part of the block inputs"
    if values.get("chunked_training"):
        _derive_chunked_training(values, user_set, derived)
    if values.get("task") in RL_TASKS:
        # TRL's GRPO defaults, which differ from the preference objectives' under the same names.
        if "beta" not in user_set:
            values["beta"] = 0.0
            derived["beta"] = "no KL term and no reference model: --task grpo's --beta is 0 unless given (TRL's default)"
        if "loss_type" not in user_set:
            values["loss_type"] = "dapo"
            derived["loss_type"] = "--task grpo averages the token losses over the batch's tokens (dapo, TRL's default)"
    if values.get("optimizer_in_backward") and "max_grad_norm" not in user_set:
        # Each parameter is updated as its gradient arrives, before the global norm exists.
        values["max_grad_norm"] = 0.0
        derived["max_grad_norm"] = (
            "gradient clipping is off: --optimizer-in-backward updates each parameter before the global gradient"
            " norm is known (--max-grad-norm 0 says so explicitly)"
        )
    return values, derived


def _derive_chunked_training(values: dict[str, Any], user_set: frozenset[str], derived: dict[str, str]) -> None:
    """AI-OS's chunked long-context training as memfit's sequence tiling, each part unless the user set it.

    AI-OS bounds activation memory by running a long sequence in chunks of `chunk_size` tokens. memfit
    gets the same bound without changing the numerics: each block's MLP over tiles of at most that many
    tokens, the output projection and loss in chunks of that many, blocks recomputed in backward (full
    checkpointing); attention stays the memory-efficient kernel `--attention auto` picks.
    """
    chunk = int(values.get("chunk_size") or MemoryConfig.chunk_size)
    seq_len = int(values.get("seq_len") or DEFAULT_SEQ_LEN)  # not given: 256 until the data says (then derived again)
    why = f"--use-chunked-training at --chunk-size {chunk}"
    if "tiled_mlp" not in user_set:
        tiles = max(1, -(-seq_len // chunk))
        values["tiled_mlp"] = tiles if tiles > 1 else 0
        derived["tiled_mlp"] = (f"tiled MLP over {tiles} tiles of <= {chunk} tokens ({why})" if tiles > 1
                                else f"tiled MLP off: --seq-len {seq_len} is one chunk ({why})")
    if "loss_chunk_size" not in user_set:
        values["loss_chunk_size"] = chunk
        derived["loss_chunk_size"] = f"chunked loss over {chunk} tokens at a time ({why})"
    if "gradient_checkpointing" not in user_set:
        values["gradient_checkpointing"] = "full"
        derived["gradient_checkpointing"] = f"full checkpointing, one chunk's activations live at a time ({why})"
