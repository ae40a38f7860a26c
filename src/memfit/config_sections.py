"""The sections of a memfit run's configuration: one dataclass per concern, each field documented.

Every field's docstring is its `memfit train --help-all` text. memfit.config puts the sections
together (TrainConfig), checks them against each other and derives the defaults that depend on
other settings; the names here are imported from there too.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRECISIONS = ("auto", "amp", "fp32", "bf16", "fp16")
WEIGHT_DTYPES = ("fp32", "bf16", "fp16")
ATTENTION_KINDS = ("auto", "flash", "flex", "sdpa", "eager")
SMALL_STATE_OPTIMIZERS = ("galore-adamw", "galore-adamw-8bit", "apollo-adamw", "apollo-mini", "adam-mini", "adamw-4bit")
"""Optimizers with a fraction of AdamW's state (memfit.techniques.small_state_optimizers); the first five need full weights."""
OPTIMIZERS = ("adamw", "adamw-8bit", "paged-adamw-8bit", "adafactor", "sgd", *SMALL_STATE_OPTIMIZERS)
OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "for-loop")
LR_SCHEDULES = ("cosine", "linear", "constant")
CHECKPOINTING_MODES = ("off", "full", "selective", "auto")
QUANTIZE_MODES = ("none", "4bit", "8bit")
SHARDING_MODES = ("none", "ddp", "fsdp")
CONTEXT_PARALLEL_MODES = ("auto", "ulysses", "ring")
KERNEL_CHOICES = ("auto", "liger", "none")
ROPE_SCALINGS = ("auto", "linear", "yarn", "llama3")
DATASET_FORMATS = ("auto", "text", "prompt-completion", "messages", "alpaca", "sharegpt")
TRAIN_ON_CHOICES = ("assistant", "last", "all")
PACKING_MODES = ("auto", "samples", "off", "wrapped")
DEFAULT_SEQ_LEN = 256
"""--seq-len of plain text, and of estimate/plan without a dataset, when none is given (whole samples: from the data)."""


def _choices(*values: str) -> dict:
    return {"choices": values}


SIZE = {"size": True}


@dataclass
class ModelConfig:
    model: str = "tiny"
    """Model to train: 'tiny' (built-in), a local directory, a Hugging Face id, or preset:NAME (random weights of a preset's shape)."""
    tokenizer: str | None = None
    """Tokenizer to use; defaults to the model's own."""
    dtype: str = field(default="fp32", metadata=_choices(*WEIGHT_DTYPES))
    """Dtype the weights are stored in: fp32 (default for full training), bf16 or fp16."""
    trust_remote_code: bool = False
    """Run code shipped with a Hugging Face model. Off unless you trust the model's authors."""
    attention: str = field(default="auto", metadata=_choices(*ATTENTION_KINDS))
    """Attention kernel: auto picks flash-attn on a supporting GPU, else PyTorch SDPA (FlexAttention for packed samples on a GPU), else eager; flex asks for FlexAttention (CUDA)."""
    rope_scale: float | None = None
    """Multiply the model's positions by this factor through RoPE scaling (a context-extension fine-tune past its trained length; changes the rotary numerics). 1 leaves the model as it is."""
    rope_scaling: str = field(default="auto", metadata=_choices(*ROPE_SCALINGS))
    """RoPE scaling type of --rope-scale: linear, yarn, llama3 (models that already use it), or auto (the model's own scaling, else yarn)."""


@dataclass
class DataConfig:
    dataset: str | None = None
    """Training data: a .txt, .jsonl or .parquet file, hf:NAME[:CONFIG][@SPLIT], or builtin:chat (conversations shipped with memfit). Default: the bundled corpus."""
    text_field: str = "text"
    """Field holding the text in .jsonl, .parquet and Hugging Face datasets."""
    seq_len: int | None = None
    """Tokens per training sample (window); not given: from the data for whole samples (conversations, instructions, tables), 256 for plain text. From the data means the longest sample (or the length keeping 99% of the samples and target tokens when a few are far longer), rounded up to a multiple of 64, within the model's positions; estimate and plan without a dataset use 256. A length that drops more than 1% of the samples or target tokens stops the run: see --truncate, --allow-drop."""
    stride: int = 0
    """Tokens shared by consecutive windows of a long document (0: no overlap)."""
    packing: str = field(default="auto", metadata=_choices(*PACKING_MODES))
    """samples: several whole samples per window, attention and positions restart at each (no padding); off: one sample per row, padded; wrapped: plain text laid end to end and cut (attention crosses documents); auto: samples for chat/instruction data, wrapped for plain text. --packing/--no-packing: auto/off. dpo, simpo, orpo, kto: samples and auto pack each micro-batch's sequences end to end without padding, off pads them (docs/preference.md)."""
    cache_dir: str | None = None
    """Where tokenized datasets are cached. Default: <output-dir>/cache; share one between runs to tokenize once."""
    dataset_format: str = field(default="auto", metadata=_choices(*DATASET_FORMATS))
    """Record format: auto (from the first record's fields), text, prompt-completion, messages, alpaca or sharegpt (see docs/data.md)."""
    messages_field: str = "messages"
    """Field holding the list of {role, content} turns of a messages dataset."""
    prompt_field: str = "prompt"
    """Field holding the prompt of a prompt-completion dataset (a string or a list of messages)."""
    completion_field: str = "completion"
    """Field holding the completion of a prompt-completion dataset (a string or a list of messages)."""
    chat_template: str | None = None
    """Chat template for conversations: the tokenizer's own by default; chatml, llama3, system-default (shipped for base models) or a .jinja file."""
    train_on: str = field(default="assistant", metadata=_choices(*TRAIN_ON_CHOICES))
    """Tokens that carry loss in conversations and prompt-completion data: assistant (every answer, end of turn included), last (the final answer) or all (--train-on-prompt)."""
    truncate: bool = False
    """Cut samples longer than --seq-len to their first --seq-len tokens instead of dropping them (a cut answer teaches a wrong ending); the target tokens cut are counted and said."""
    allow_drop: bool = False
    """Train even when --seq-len drops more than 1% of the samples or target tokens (without it such a run stops before training, exit 2, saying the --seq-len that keeps them)."""
    group_by_length: bool = False
    """Train samples of similar length together (the Trainer's name): each step's samples come from a length-sorted group, so micro-batches pad less; the order stays a function of --seed and the effective batch."""

    @property
    def seq_len_or_default(self) -> int:
        """--seq-len, or DEFAULT_SEQ_LEN when it was not given and no data chose it yet (what a prediction assumes)."""
        return DEFAULT_SEQ_LEN if self.seq_len is None else self.seq_len


@dataclass
class OptimizerConfig:
    optimizer: str = field(default="adamw", metadata=_choices(*OPTIMIZERS))
    """Optimizer. 8-bit variants come from bitsandbytes and fall back visibly when it is missing."""
    optimizer_impl: str = field(default="auto", metadata=_choices(*OPTIMIZER_IMPLS))
    """Kernel of AdamW/SGD: auto (fused where the device has it), fused, foreach (fast, one temporary per parameter) or for-loop (least memory)."""
    lr: float = 1e-3
    """Peak learning rate."""
    beta1: float = 0.9
    """Adam's first-moment decay."""
    beta2: float = 0.95
    """Adam's second-moment decay."""
    eps: float = 1e-8
    """Adam's epsilon."""
    weight_decay: float = 0.0
    """Decoupled weight decay."""
    momentum: float = 0.0
    """Momentum of SGD."""
    lr_schedule: str = field(default="cosine", metadata=_choices(*LR_SCHEDULES))
    """Learning-rate schedule after warmup: cosine, linear or constant."""
    warmup_steps: int = 0
    """Optimizer steps of linear warmup."""
    warmup_ratio: float = 0.0
    """Warmup as a share of the run's optimizer steps (the Trainer's and DNALLM's name); used when --warmup-steps is 0."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value; 0 turns clipping off (the default under --optimizer-in-backward)."""
    optim_target_modules: str = "all-linear"
    """Weights GaLore and APOLLO project: all-linear (every Linear, the output head included), all (every matrix, embeddings too) or module names / regexes, comma-separated (q_proj,v_proj); the rest keep AdamW's full moments."""
    optim_rank: int | None = None
    """Rank of the GaLore / APOLLO projection (default 128; apollo-mini: 1). Lower: less state, further from AdamW."""
    optim_update_proj_gap: int | None = None
    """Optimizer steps between refreshes of each GaLore / APOLLO projection (default 200)."""
    optim_scale: float | None = None
    """Scale of the projected update (default: GaLore 0.25, APOLLO 1, APOLLO-Mini 128)."""
    optim_args: str | None = None
    """The Trainer's optim_args for GaLore / APOLLO: 'rank=64,update_proj_gap=100,scale=0.25,proj_type=std,proj=random,scale_type=channel'."""


@dataclass
class TrainingConfig:
    batch_size: int = 8
    """Samples per micro-batch (per device). Halve it if you run out of memory."""
    gradient_accumulation_steps: int = 1
    """Micro-batches accumulated before each optimizer step."""
    effective_batch_size: int | None = None
    """Samples per optimizer step (all devices); accumulation is derived from it."""
    max_steps: int = 120
    """Optimizer steps to run (120 train the built-in tiny model in about a minute on 2 idle CPU cores)."""
    epochs: float | None = None
    """Train for this many passes over the data instead of --max-steps."""
    seed: int = 0
    """Seed of the data order and the initialisation; the sample order depends only on it and the effective batch."""
    auto_batch_size: bool = False
    """Find the largest micro-batch that fits before training (see memfit find-batch-size)."""


@dataclass
class MemoryConfig:
    precision: str = field(default="auto", metadata=_choices(*PRECISIONS))
    """Compute precision: auto (bf16 on Ampere+, fp16 on older GPUs, fp32 on CPU), amp (mixed precision wherever possible: bf16, else fp16; CPU included), fp32, bf16 or fp16."""
    gradient_checkpointing: str = field(default="off", metadata=_choices(*CHECKPOINTING_MODES))
    """Recompute activations in backward: off, full, selective (keep matmul outputs) or auto (fit --memory-budget)."""
    checkpoint_every: int = 1
    """Checkpoint only every Nth transformer block (with --gradient-checkpointing full)."""
    loss_chunk_size: int | None = None
    """Tokens per chunk of the output projection + loss; 0 turns chunking off; default: on where it saves memory."""
    optimizer_in_backward: bool = False
    """Update each parameter as soon as its gradient is ready and free the gradient."""
    activation_offload: bool = False
    """Move tensors saved for backward to host memory (with checkpointing: each block's input, two kept on the device); on CPU the copies count as host memory."""
    activation_offload_blocks: int | None = None
    """Offload only the first N transformer blocks' saved inputs (the later blocks and the output head keep theirs on the device, where backward needs them first); turns on --activation-offload; needs --gradient-checkpointing full or auto; default: offload everything saved."""
    optimizer_offload: bool = False
    """Keep optimizer state and run the optimizer step on the CPU (CUDA; with --optimizer-in-backward on any device)."""
    expert_offload: bool = False
    """Keep a mixture of experts' frozen expert weights in host memory and copy each layer's to the device just before it runs (LoRA; needs checkpointing; costs the experts' bytes over the host link twice a micro-batch)."""
    embedding_on_host: bool = False
    """Keep a frozen, untied input embedding in host memory: the lookup runs there and only the looked-up rows go to the device (LoRA/QLoRA; saves vocab x hidden x its bytes on the device; costs a host round trip of the ids and rows per forward)."""
    expert_dequant_group: int = 0
    """Dequantize QLoRA's NF4 expert stacks this many experts at a time for their grouped matmul instead of whole (0: whole; --quantize 4bit; saves that share of one dequantized stack; costs more, smaller matmuls)."""
    memory_cap: int | None = field(default=None, metadata=SIZE)
    """Behave as if the device had only this much memory (e.g. 16GiB), to rehearse a smaller GPU."""
    memory_budget: int | None = field(default=None, metadata=SIZE)
    """Plan the configuration to fit this much memory, then train with it."""
    gpu: str | None = None
    """Plan for this GPU preset (see memfit presets gpus), then train with the plan."""
    trial: bool = True
    """With --memory-budget / --gpu: time the planner's best few configurations for a few real steps under the same cap and train with the fastest measured (at most a tenth of the run's predicted time, cached per model, device and settings under $MEMFIT_CACHE_DIR or ~/.cache/memfit); --no-trial trusts the speed model."""
    oom_recovery: bool = True
    """On out-of-memory, split the micro-batch and redo it, keeping the exact update."""
    host_mmap_threshold: int | None = field(default=None, metadata=SIZE)
    """CPU runs under glibc: host blocks of this size and more are mapped by themselves and returned to the system when freed (default 4MiB; glibc's own threshold rises to 32 MiB, after which a step's freed blocks stay resident); 0 leaves glibc's setting (memory/host_heap.py)."""
    track_memory: bool | None = None
    """Track live tensor bytes by category during training and add them to the metrics: every step (a few times slower each); default: one early step, for the report's memory at the peak beside the estimate (one process, with the report, without --compile); --no-track-memory: none."""
    tiled_mlp: int | None = None
    """Run each block's MLP over N sequence tiles, recomputing one tile at a time in backward (0: off; default: on for long sequences)."""
    efficient_norm: bool = True
    """RMSNorm keeps only its input and the fp32 1/rms for backward, recomputing the rest (same forward bit for bit; Llama-family norms; liger's replaces it where it runs)."""
    efficient_lora: bool = True
    """LoRA adapters on a 16-bit base keep their input as it came (no fp32 copy per adapter) and cast it again in backward (same forward bit for bit; PEFT's one-adapter linears; PEFT's own path under autocast over fp32 weights and ZeRO-3)."""
    compile: bool = False
    """Compile each transformer block with torch.compile (regional compilation: short compile, no recompile per length)."""
    kernels: str = field(default="auto", metadata=_choices(*KERNEL_CHOICES))
    """Fused kernels: liger (liger-kernel's RMSNorm, SwiGLU, RoPE and fused linear cross-entropy; CUDA), none, or auto (liger where it is installed and supported)."""
    chunked_training: bool = False
    """AI-OS's chunked long-context training (--use-chunked-training): sequence tiling at --chunk-size, i.e. tiled MLP and chunked loss at that chunk with full checkpointing, each unless set."""
    chunk_size: int = 2048
    """Tokens per chunk of --chunked-training (AI-OS's chunk_size)."""


@dataclass
class LoraConfig:
    lora_r: int = 0
    """Rank of the LoRA adapters; 0 trains the full model."""
    lora_alpha: float = 16.0
    """LoRA scaling numerator (the update is scaled by alpha / r)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input."""
    lora_targets: str = "auto"
    """Modules that get adapters: auto (attention + MLP linears), all-linear, or comma-separated names."""
    quantize: str = field(default="none", metadata=_choices(*QUANTIZE_MODES))
    """Load the frozen base weights quantized: 4bit (nf4, QLoRA) or 8bit; needs bitsandbytes and --lora-r."""
    quantize_head: bool = False
    """Under --quantize 4bit also hold the frozen, untied output head in NF4, projected a tile of vocabulary rows at a time (saves about 3/4 of its bytes; costs NF4 rounding of the head and no fused loss)."""
    merge_adapter: bool = False
    """Also write the model with the adapter merged in, to <output-dir>/merged/."""


@dataclass
class OutputConfig:
    output_dir: str = "runs/memfit"
    """Directory for metrics, checkpoints and the final model. memfit writes nowhere else."""
    log_file: str | None = None
    """Metrics JSONL file; default <output-dir>/metrics.jsonl."""
    save_every: int = 0
    """Save a resumable checkpoint every N optimizer steps (0: only at the end)."""
    save_every_minutes: float = 0.0
    """Also save a checkpoint when this many minutes have passed since the last one (0: off); a step boundary, never mid-step."""
    save_total_limit: int = 2
    """Keep the newest N checkpoints (0: all), plus the best by eval loss when best.json names one; an old one is deleted only after its successor is complete."""
    async_save: bool = False
    """Write checkpoints in a background thread from a host copy of the state: training goes on meanwhile (costs one checkpoint of host memory); the final save waits."""
    disk_check: bool = True
    """Before training, stop (exit 2) if the output directory's free space cannot hold the checkpoints kept plus the final model; --no-disk-check goes on."""
    preempt_signals: str = "SIGTERM,SIGUSR1"
    """Signals that make the run finish its step, save a checkpoint and exit 75 (resume with --resume auto), comma-separated; add SIGINT to save on Ctrl-C too (else Ctrl-C exits 130 at once); 'none': off."""
    preempt_grace_seconds: float = 25.0
    """After a preemption signal, exit (75) at the latest after this many seconds even if the save is not done; set it a little under your scheduler's time between signal and kill."""
    resume_allow_changes: bool = False
    """Resume even when the effective batch, the data or the model differ from the checkpoint's (logged); without it such a resume is refused."""
    resume: str | None = None
    """'auto' resumes from the latest complete checkpoint in --output-dir, or give a checkpoint directory."""
    log_every: int = 10
    """Print a progress line every N steps when the output is not a terminal."""
    tensorboard: bool = False
    """Also write TensorBoard events (needs the tensorboard package); same as --report-to tensorboard."""
    report_to: str = ""
    """Experiment trackers that also receive the metrics, comma-separated: tensorboard, wandb (offline), mlflow (local files)."""
    report: bool = True
    """Write a self-contained HTML report (report.html) in the output directory at the end of the run."""


@dataclass
class DistributedConfig:
    sharding: str = field(default="none", metadata=_choices(*SHARDING_MODES))
    """Under torchrun: none (single process), ddp (replicate) or fsdp (FSDP2 shards per block)."""
    fsdp_offload: bool = False
    """With --sharding fsdp: keep parameters, gradients and optimizer state on the CPU."""
    deepspeed: str | None = None
    """DeepSpeed JSON config file (ZeRO 1-3, offload); "auto" values are filled from memfit's config."""
    zero_stage: int | None = None
    """Generate a DeepSpeed config with this ZeRO stage (1, 2 or 3) when you have no file."""
    zero_offload: bool = False
    """With --zero-stage: offload optimizer state (and parameters at stage 3) to the CPU."""
    context_parallel: int = 1
    """Under torchrun: split every sequence into N contiguous shards, one per rank of a context group (world size = data-parallel x N); each rank holds 1/N of every sequence's activations (docs/distributed.md). Axolotl's context_parallel_size."""
    context_parallel_mode: str = field(default="auto", metadata=_choices(*CONTEXT_PARALLEL_MODES))
    """How attention sees the whole sequence under --context-parallel: ulysses (all-to-all of heads, memfit's over torch.distributed; the heads must divide by N), auto (ulysses); ring (PyTorch's ring attention) is refused: not wired yet."""

    def problems(self) -> list[str]:
        """What is wrong with these settings, by flag name (TrainConfig.validate reports them)."""
        found = []
        if self.context_parallel < 1:
            found.append(f"--context-parallel must be at least 1 (ranks a sequence is split over), got {self.context_parallel}")
        return found


EVAL_STRATEGIES = ("steps", "epoch", "no")


@dataclass
class EvalConfig:
    eval_dataset: str | None = None
    """Evaluation data, in any format the training data takes (a file or hf:NAME[:CONFIG][@SPLIT]); evaluated every --eval-every steps and at the end."""
    eval_fraction: float = 0.0
    """Hold out this share of the training samples for evaluation, chosen by --seed (the same every run); training uses the rest."""
    eval_every: int = 0
    """Evaluate every N optimizer steps (0: only at the end of the run)."""
    eval_strategy: str = field(default="steps", metadata=_choices(*EVAL_STRATEGIES))
    """When to evaluate: steps (every --eval-every steps), epoch (after each pass over the training data) or no (never); at the end too, except with no."""
    eval_batch_size: int | None = None
    """Samples per evaluation forward (default: the training micro-batch); out of memory halves it, never training's."""
    save_best: bool = False
    """Keep the model of the lowest eval loss in <output-dir>/best/, its step and loss in best.json."""

    def problems(self) -> list[str]:
        """What is wrong with these settings, by flag name (TrainConfig.validate reports them)."""
        found = []
        if not 0 <= self.eval_fraction < 1:
            found.append(f"--eval-fraction must be at least 0 and below 1 (a share of the training samples), got {self.eval_fraction}")
        if self.eval_dataset and self.eval_fraction:
            found.append("give --eval-dataset or --eval-fraction, not both")
        if self.eval_every < 0:
            found.append(f"--eval-every must be 0 (only at the end) or positive, got {self.eval_every}")
        if self.eval_batch_size is not None and self.eval_batch_size < 1:
            found.append(f"--eval-batch-size must be at least 1, got {self.eval_batch_size}")
        has_set = bool(self.eval_dataset or self.eval_fraction)
        if not has_set and self.eval_strategy != "no":
            for flag, given in (("--eval-every", self.eval_every), ("--save-best", self.save_best)):
                if given:
                    found.append(f"{flag} needs an evaluation set: add --eval-dataset FILE or --eval-fraction 0.05")
        if self.save_best and self.eval_strategy == "no":
            found.append("--save-best needs evaluation: drop --eval-strategy no")
        return found


PREFERENCE_TASKS = ("dpo", "simpo", "orpo", "kto")
"""Objectives that learn from preferences (memfit.tasks.preference; docs/preference.md)."""
RL_TASKS = ("grpo",)
"""Objectives that learn from rewards on the model's own completions (memfit.tasks.grpo; docs/rl.md)."""
TASKS = ("causal-lm", "masked-lm", "sequence-classification", "token-classification", "regression",
         *PREFERENCE_TASKS, *RL_TASKS)
PROBLEM_TYPES = ("auto", "single-label", "multi-label")
DPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust")
"""--loss-type of --task dpo (tasks/preference_losses.py implements each; named here so the config needs no torch)."""
GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
"""--loss-type of --task grpo: how the per-token losses are averaged (TRL's names and semantics; docs/rl.md)."""
SCALE_REWARDS = ("group", "batch", "none")
REFERENCE_MODES = ("auto", "adapters-off", "copy", "host-copy", "cached")
"""--reference: where DPO's and KTO's reference log-probabilities come from (techniques/reference_model.py)."""


@dataclass
class TaskConfig:
    task: str = field(default="causal-lm", metadata=_choices(*TASKS))
    """What is learned: causal-lm (next token), masked-lm, sequence-classification, token-classification, regression (memfit.tasks; docs/tasks.md), from preferences: dpo, simpo, orpo, kto (docs/preference.md), or from rewards on generated completions: grpo (docs/rl.md)."""
    problem_type: str = field(default="auto", metadata=_choices(*PROBLEM_TYPES))
    """sequence-classification: single-label (one class a sample) or multi-label (each label column 0/1); auto: multi-label when several --label-fields are given."""
    num_labels: int | None = None
    """Classes (or regression targets) of the head; default: what the training data holds."""
    label_names: str | None = None
    """Class names in id order, comma-separated (default: the names found in the training data, sorted); saved as id2label with the model."""
    sequence_field: str = "sequence"
    """Column holding the sequence in CSV/TSV/JSONL/Parquet tables (DNALLM's name)."""
    label_fields: str = "label"
    """Label column(s) of a table, comma-separated: several mean multi-label classification or multi-target regression."""
    mlm_probability: float = 0.15
    """masked-lm: share of tokens masked (80% become the mask token, 10% a random token, 10% stay), drawn from (--seed, step, sample)."""
    threshold: float = 0.5
    """multi-label: probability at which a label counts as predicted, for the evaluation metrics."""
    label_table: str | None = None
    """FASTA data: a CSV/TSV/JSONL table of labels by record id (--id-field column, then the --label-fields), instead of labels in the headers."""
    id_field: str = "id"
    """--label-table: the column holding each FASTA record's id (the header up to the first space or '|')."""
    # The preference objectives' settings, under TRL's names and with TRL 1.16's defaults (docs/preference.md).
    beta: float = 0.1
    """dpo, simpo, orpo, kto: the objective's scale (TRL's beta): how far DPO and KTO let the policy move from the reference, SimPO's reward scale, ORPO's weight of the odds-ratio term. grpo: the KL coefficient, 0 by default (no reference model)."""
    loss_type: str = field(default="sigmoid", metadata=_choices(*DPO_LOSS_TYPES, *GRPO_LOSS_TYPES))
    """dpo: sigmoid (DPO), hinge (SLiC), ipo (IPO, per-token log-ratios) or robust (rDPO, reads --label-smoothing). grpo: grpo, bnpo, dr_grpo or dapo (the default), how the token losses are averaged."""
    label_smoothing: float = 0.0
    """dpo --loss-type robust: the probability that a pair's preference is flipped, below 0.5; simpo: the weight of the flipped-preference term."""
    simpo_gamma: float = 0.5
    """simpo: the target reward margin (the loss wants beta x the difference of average log-probabilities above it)."""
    cpo_alpha: float = 1.0
    """simpo: weight of the chosen completions' NLL added to the loss (TRL's CPO default; the SimPO paper uses 0)."""
    desirable_weight: float = 1.0
    """kto: weight of each desirable completion's loss (raise it when desirable completions are the fewer)."""
    undesirable_weight: float = 1.0
    """kto: weight of each undesirable completion's loss."""
    reference: str = field(default="auto", metadata=_choices(*REFERENCE_MODES))
    """dpo, kto, grpo with --beta > 0: the reference model. auto: adapters-off under --lora-r (the model with its adapters disabled, no second copy), else copy (a frozen copy on the device); host-copy: the frozen copy kept in host memory and brought to the device one block at a time (about one block's bytes on the device instead of the model's, the copy's bytes over the host link each micro-batch; never chosen by auto); cached: every item's reference log-probabilities computed in one pass before training and kept beside the token cache."""
    precompute_ref_log_probs: bool = False
    """dpo, kto: TRL's name for --reference cached: compute the reference log-probabilities once, before training."""
    pair_layout: str = field(default="two-rows", metadata=_choices("auto", "two-rows", "shared-prompt", "split"))
    """dpo, simpo, orpo: how a pair reaches the model. two-rows: prompt + chosen and prompt + rejected in one forward (the fastest); split: the same rows in two forwards, the chosen rows' and the rejected rows', which holds one side's activations at the peak instead of both (about half) for one more forward of the rejected rows; shared-prompt: one row, prompt + chosen + rejected, the prompt computed once (a 4D mask keeps each answer from seeing the other; SDPA or eager attention, else two rows, said in the log); auto: shared-prompt where the kernel takes the mask and the prompts are at least as long as the shorter answers, else two rows. The same numbers every way (docs/preference.md)."""

    def problems(self) -> list[str]:
        """What is wrong with these settings, by flag name (TrainConfig.validate reports them)."""
        found = []
        if self.task in RL_TASKS:
            if self.beta < 0:
                found.append(f"--beta must be 0 (no reference model) or positive (the KL coefficient), got {self.beta}")
            if self.loss_type not in GRPO_LOSS_TYPES:
                found.append(f"--loss-type {self.loss_type} is not a --task grpo loss; choose one of {', '.join(GRPO_LOSS_TYPES)}")
        else:
            if self.beta <= 0:
                found.append(f"--beta must be positive (the scale of the preference objective), got {self.beta}")
            if self.loss_type not in DPO_LOSS_TYPES:
                found.append(f"--loss-type {self.loss_type} is a --task grpo loss; --task {self.task} takes one of"
                             f" {', '.join(DPO_LOSS_TYPES)}")
        if not 0 <= self.label_smoothing < 0.5:
            found.append(f"--label-smoothing must be at least 0 and below 0.5 (a flip probability), got {self.label_smoothing}")
        for name in ("cpo_alpha", "desirable_weight", "undesirable_weight"):
            if getattr(self, name) < 0:
                found.append(f"--{name.replace('_', '-')} must be 0 or more (a weight), got {getattr(self, name)}")
        if self.precompute_ref_log_probs and self.reference not in ("auto", "cached"):
            found.append(f"--precompute-ref-log-probs is --reference cached; it contradicts --reference {self.reference}:"
                         " drop one of them")
        if self.num_labels is not None and self.num_labels < 1:
            found.append(f"--num-labels must be at least 1, got {self.num_labels}")
        if not 0 < self.mlm_probability < 1:
            found.append(f"--mlm-probability must be between 0 and 1 (a share of the tokens), got {self.mlm_probability}")
        if not 0 < self.threshold < 1:
            found.append(f"--threshold must be between 0 and 1 (a probability), got {self.threshold}")
        if self.label_table and self.task in ("causal-lm", "masked-lm"):
            found.append(f"--label-table labels FASTA records for a task with labels; --task {self.task} reads none: drop it")
        if self.problem_type == "multi-label" and self.task != "sequence-classification":
            found.append(f"--problem-type multi-label is for --task sequence-classification, not {self.task}")
        return found


@dataclass
class RLConfig:
    """--task grpo: generation and the policy-gradient objective, under TRL's GRPOConfig names and defaults."""

    reward_function: str | None = None
    """grpo: where each completion's reward comes from: FILE.py:NAME (a TRL reward function: completions, prompts and the data's other columns as keyword arguments, one float per completion) or a built-in (answer-match, format, length, overlong); several: repeat the flag or separate with commas."""
    reward_weights: str | None = None
    """grpo: a weight per --reward-function, comma-separated, in the same order (default: 1 each); the reward is their weighted sum."""
    num_generations: int = 8
    """grpo: completions generated per prompt (the group whose rewards are compared)."""
    max_prompt_length: int | None = None
    """grpo: keep at most this many prompt tokens (the last ones, as a left truncation side keeps them); default: whole prompts (TRL 1.16's GRPOConfig has no such setting and never truncates)."""
    max_completion_length: int = 512
    """grpo: tokens generated per completion at most (TRL's default, 512); Dr. GRPO's loss divides by it."""
    temperature: float = 1.0
    """grpo: sampling temperature of generation."""
    top_p: float = 1.0
    """grpo: nucleus sampling: sample from the smallest set of tokens whose probability reaches this."""
    generation_batch_size: int | None = None
    """grpo: completions generated at once (default: the completions of one optimizer step); an out-of-memory while generating halves it and goes on with the same completions."""
    epsilon: float = 0.2
    """grpo: lower clipping range of the probability ratio."""
    epsilon_high: float | None = None
    """grpo: upper clipping range of the ratio (default: --epsilon; DAPO uses 0.28)."""
    num_iterations: int = 1
    """grpo: optimizer steps taken on each batch of completions (mu); above 1, the ratio is to the policy that generated them."""
    scale_rewards: str = field(default="group", metadata=_choices(*SCALE_REWARDS))
    """grpo: divide advantages by the reward's standard deviation over the group, the batch, or none (Dr. GRPO)."""
    mask_truncated_completions: bool = False
    """grpo: leave completions cut at --max-completion-length out of the loss."""
    use_vllm: bool = False
    """grpo: generate with vLLM on the same GPU where it is installed (weights synced after each optimizer step); else transformers' generate, said in the log."""

    def problems(self) -> list[str]:
        """What is wrong with these settings, by flag name (TrainConfig.validate reports them)."""
        found = []
        for name in ("num_generations", "max_completion_length", "num_iterations"):
            if getattr(self, name) < 1:
                found.append(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        for name in ("max_prompt_length", "generation_batch_size"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                found.append(f"--{name.replace('_', '-')} must be at least 1, got {getattr(self, name)}")
        if self.temperature <= 0:
            found.append(f"--temperature must be positive, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            found.append(f"--top-p must be above 0 and at most 1, got {self.top_p}")
        if self.epsilon < 0 or (self.epsilon_high is not None and self.epsilon_high < 0):
            found.append("--epsilon and --epsilon-high must be 0 or more (clipping ranges)")
        return found


SECTIONS: dict[str, type] = {
    "model": ModelConfig,
    "data": DataConfig,
    "optimizer": OptimizerConfig,
    "training": TrainingConfig,
    "memory": MemoryConfig,
    "lora": LoraConfig,
    "output": OutputConfig,
    "distributed": DistributedConfig,
    "evaluation": EvalConfig,
    "task": TaskConfig,
    "rl": RLConfig,
}
