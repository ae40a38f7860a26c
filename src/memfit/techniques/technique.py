"""What a memory technique is to the rest of memfit: one object, exported by its module.

    TECHNIQUE = Technique(
        name="tiled_mlp",
        summary="each MLP runs over tiles of tokens: its intermediate activations are one tile's",
        settings=("tiled_mlp",),                       # the config fields it owns
        resolve=lambda facts: {"mlp_tiles": ...},      # what it sets in the resolved run
        apply=..., report=..., memory_terms=..., speed_terms=..., planner_values=...,
    )

`techniques/registry.py` lists the objects in the order they are applied (that order is data, checked there), and
every consumer loops over it: the resolver (`resolve`, then `refusals`), the run's setup (`apply`, in order), the
metrics and the report (`report`), the estimator (`memory_terms`), the speed model (`speed_terms`) and the planner
(`planner_values`). A hook left None means the technique has nothing to say there; much of what memfit's own
techniques change about memory and speed is structural (where the step peaks, what it recomputes) and stays in the
estimator's and the speed model's phases, which read the resolved run's fields the techniques set.

A technique beyond memfit's own declares its settings as a dataclass (`section`, a docstring per field): they become
flags, YAML keys and help entries like every other setting (config.register_section).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

    from memfit.config import TrainConfig
    from memfit.techniques.resolved_run import ResolvedRun

STAGES = ("choice", "model", "optimizer", "step")
"""When a technique acts: 'choice' (only chosen: precision, the attention kernel), 'model' (changes the model before
the engine wraps it), 'optimizer' (changes how the optimizer is built), 'step' (changes how a micro-batch runs)."""


@dataclass(frozen=True)
class RunFacts:
    """What a run is resolved from, besides its config: the model's facts and the device."""

    config: TrainConfig
    hf_config: Any
    """The model's transformers config (None where the model is not known yet)."""
    device_type: str
    """'cuda' or 'cpu': the device the step runs on (a named GPU plans as 'cuda')."""
    bf16_supported: bool = True
    world_size: int = 1
    engine: str = ""
    """Where the step runs, in the words a refusal uses: '' (one process), 'DeepSpeed', '--sharding fsdp' or
    '--sharding ddp'."""
    vocabulary_head: bool = True
    """The task's head makes vocabulary-sized logits (a causal or masked LM), the only ones a loss chunk applies to."""
    budget_bytes: int | None = None
    """The memory the run must fit (--memory-budget, --memory-cap or the named GPU's), where known."""


@dataclass(frozen=True)
class ApplyContext:
    """What a technique's `apply` may use besides the model and the resolved run."""

    config: TrainConfig
    device: Any
    """The torch.device the run trains on."""
    fallbacks: dict[str, str]
    """Technique -> what ran instead and why: an `apply` that falls back writes here (log and metrics)."""
    peft_task_type: str = "CAUSAL_LM"


@dataclass(frozen=True)
class Applied:
    """What a technique's `apply` did."""

    description: str = ""
    """One line for the log ('' when it did nothing worth saying)."""
    model: torch.nn.Module | None = None
    """The model when the technique replaced it (LoRA wraps it); None: changed in place, or not at all."""
    changes: dict[str, Any] = field(default_factory=dict)
    """Resolved-run fields the application settled (auto checkpointing's blocks): recorded as an event."""
    quiet: bool = False
    """Log the description at debug level: on by default, exact, nothing to act on."""


@dataclass(frozen=True)
class MemoryFacts:
    """What a technique's memory terms may read: the model's architecture and the run's state bytes."""

    architecture: Any
    """prediction.activations.Architecture of the model."""
    inventory: Any
    """models.state_bytes.ParameterInventory: the model's parameter shapes and counts."""
    hf_config: Any
    config: TrainConfig
    parts: dict[str, Any]
    """The estimator's state parts (parameters, gradients, optimizer_states, trainable shapes...)."""
    tokens: int
    """Tokens of one micro-batch (batch x sequence length)."""


@dataclass(frozen=True)
class SpeedFacts:
    """What a technique's speed terms may read: the step's shape, the device's rates and the estimate's numbers.

    The speed model (prediction/speed_model.py) fills it for each configuration it times; a term returns the seconds
    its technique adds to one optimizer step, on top of `compute_seconds`.
    """

    accumulation: int
    """Micro-batches per optimizer step."""
    tokens: int
    """Tokens of one micro-batch."""
    compute_seconds: float
    """The step's compute time before any host traffic: its FLOPs at the device's rate, and the optimizer's step."""
    overlap_seconds: float
    """The part of `compute_seconds` a copy made ahead of the layer that needs it runs under: the forward and
    recompute passes (backward reads no new layer first)."""
    rate: float
    """The step's matmul rate in FLOP/s (what a cost measured in FLOPs is written in)."""
    link_bytes_per_second: float
    """The host link's rate: the GPU preset's, else 16 GB/s."""
    trainable_parameters: int
    host_optimizer_state_bytes: int
    """Optimizer state the estimate puts in host memory (offloaded or paged)."""
    activation_transfer_bytes: float
    """Bytes offloaded activations move over the host link in one micro-batch (out in forward, back in backward)."""
    expert_stream_bytes: float
    """Bytes streamed experts move over the host link in one micro-batch."""


@dataclass(frozen=True)
class PlannerFacts:
    """What a technique's planner values may read: the run being planned and the shape of the combinations tried."""

    config: TrainConfig
    """The configuration being planned (the user's settings; `mode` says what is trained)."""
    hf_config: Any
    device_type: str
    """'cuda' (a GPU preset or this machine's GPU) or 'cpu'."""
    bf16_supported: bool
    mode: str
    """'full', 'lora' or 'qlora'."""
    seq_len: int
    accumulation: int
    """Micro-batches per optimizer step of the combinations tried."""
    long_context: bool = False
    """The longest sequence that fits is searched (--maximize seq-len)."""


@dataclass(frozen=True)
class Technique:
    """One memory technique, as every part of memfit sees it (see the module docstring)."""

    name: str
    """Its registry name; also the key of its fallbacks and of its resolved value in ResolvedRun.extra."""
    summary: str
    """What it saves and what it costs, in one line (docs and --help)."""
    settings: tuple[str, ...] = ()
    """The config fields (flat names) it owns: only its module and the resolver read them from the config."""
    stage: str = "model"
    """One of STAGES."""
    after: tuple[str, ...] = ()
    """Techniques that must be applied before it (the registry checks its order against these)."""
    section: type | None = None
    """A dataclass of its own settings (techniques beyond memfit's own); its fields become flags and YAML keys."""
    resolve: Callable[[RunFacts], dict[str, Any]] | None = None
    """The ResolvedRun fields it decides (a registered technique's own value goes under its name in `extra`)."""
    refusals: Callable[[ResolvedRun, RunFacts], list[str]] | None = None
    """What it refuses in this run and what to do instead: one line each (exit code 2 before anything is written)."""
    apply: Callable[[torch.nn.Module, ResolvedRun, ApplyContext], Applied] | None = None
    """Change the model ('model' stage), in registry order."""
    report: Callable[[ResolvedRun], dict[str, Any]] | None = None
    """What the run's metrics and report say about it: {metric name: value}; nothing when it is off."""
    memory_terms: Callable[[ResolvedRun, MemoryFacts], dict[str, float]] | None = None
    """Bytes it adds to (or, negative, removes from) the estimate's peak moment, by category (parameters,
    gradients, optimizer_states, activations, logits, other)."""
    speed_terms: Callable[[ResolvedRun, SpeedFacts], float] | None = None
    """Seconds it adds to a step (its extra traffic or recomputation), given the speed model's facts."""
    planner_values: Callable[[PlannerFacts], list[dict[str, Any]]] | None = None
    """Config changes the planner may try for it (each a {flat name: value} dict), where it applies: every
    combination the planner tries gets a variant with each (none where the user set one of its settings)."""

    def __post_init__(self) -> None:
        if self.stage not in STAGES:
            raise ValueError(f"technique {self.name}: stage must be one of {STAGES}, got {self.stage!r}")
        if self.apply is not None and self.stage != "model":
            raise ValueError(f"technique {self.name}: only a 'model' stage technique has an apply")


def apply_when_on(field: str, label: str, action: Callable[[torch.nn.Module], str]) -> Callable[..., Applied]:
    """The `apply` of a technique switched by one boolean field of the resolved run: `action(model)` when it is on,
    said as '<label>: <what action returned>'."""

    def apply(model: torch.nn.Module, run: ResolvedRun, context: ApplyContext) -> Applied:
        return Applied(f"{label}: {action(model)}") if getattr(run, field) else Applied()

    return apply


def report_when_on(field: str) -> Callable[[ResolvedRun], dict[str, Any]]:
    """The `report` of a technique switched by one field of the resolved run: the field's value while it is on."""
    return lambda run: {field: getattr(run, field)} if getattr(run, field) else {}
