"""Count the bytes of one real training step, on real or on fake tensors.

`LiveStorageCounter` is a dispatch mode that sees every tensor an operator creates
(forward, backward and optimizer alike), keeps a weak reference to its storage and
adds up the bytes of the storages still alive: the peak is exact for what the step
allocates, without an allocator in between. Run on fake tensors
(`torch._subclasses.fake_tensor.FakeTensorMode`) the same step allocates nothing, so
a 7B step is traced on a laptop in seconds; run on real tensors it is the measured
truth the estimator is checked against on CPU.

Why not the meta device: operators pick their kernel by device, and on "meta" the
attention falls back to the math path that keeps the [b, heads, s, s] probabilities,
which the CPU and CUDA kernels never store. Fake tensors keep the real device, hence
the real kernel choice. What a fake trace must not miss, and this counter handles:
storages are counted once however many views share them (`untyped_storage()`), the
optimizer's temporaries and states are created inside the traced region, and tensors
that existed before (parameters, buffers) are registered explicitly.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

CATEGORIES = ("parameters", "gradients", "optimizer_states", "activations", "logits", "other")


@dataclass
class TracedStep:
    """What one steady-state training step held at its peak."""

    peak_bytes: int
    breakdown: dict[str, int]
    """Live bytes per category at the peak moment (they add up to peak_bytes)."""
    phase_peaks: dict[str, int] = field(default_factory=dict)
    """Peak live bytes within each phase: forward, backward, optimizer."""
    peak_phase: str = ""


class LiveStorageCounter(TorchDispatchMode):
    """Adds up the bytes of live tensor storages; records the peak and what was live then."""

    def __init__(self, vocab_size: int | None = None) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.answer_scalar_reads = False
        self.live: dict[int, tuple[int, str, int]] = {}  # id(storage) -> (bytes, tag, serial)
        self._refs: dict[int, weakref.ref] = {}
        self._serial = 0
        self.live_bytes = 0
        self.peak_bytes = 0
        self.peak_snapshot: dict[int, tuple[int, str]] = {}  # serial -> (bytes, tag)
        self.phase = "setup"
        self.peak_phase = ""
        self.phase_peaks: dict[str, int] = {}

    def track(self, tensor: torch.Tensor, tag: str = "") -> None:
        """Count `tensor`'s storage from now until it is freed (no-op if already counted)."""
        storage = tensor.untyped_storage()
        key = id(storage)
        if key in self.live:
            return
        nbytes = storage.nbytes()
        if not tag and self.vocab_size and tensor.dim() and tensor.shape[-1] == self.vocab_size:
            tag = "logits"
        self._serial += 1
        self.live[key] = (nbytes, tag, self._serial)
        self.live_bytes += nbytes
        self._refs[key] = weakref.ref(storage, lambda _ref, key=key: self._release(key))
        if self.live_bytes > self.phase_peaks.get(self.phase, 0):
            self.phase_peaks[self.phase] = self.live_bytes
        if self.live_bytes > self.peak_bytes:
            # A snapshot per new peak would be quadratic; one per 0.2 % of growth is plenty.
            if self.live_bytes > self.peak_bytes * 1.002 or not self.peak_snapshot:
                self._take_snapshot()
            self.peak_bytes = self.live_bytes
            self.peak_phase = self.phase

    def track_all(self, tensors: Iterable[torch.Tensor], tag: str = "") -> None:
        for tensor in tensors:
            self.track(tensor, tag)

    def retag(self, tensors: Iterable[torch.Tensor], tag: str) -> None:
        """Give already-counted storages a category (gradients, optimizer states)."""
        # Storages are matched by a serial number: Python ids are reused once a storage dies.
        for tensor in tensors:
            key = id(tensor.untyped_storage())
            if key not in self.live:
                continue
            nbytes, _, serial = self.live[key]
            self.live[key] = (nbytes, tag, serial)
            if serial in self.peak_snapshot:
                self.peak_snapshot[serial] = (nbytes, tag)

    def _take_snapshot(self) -> None:
        self.peak_snapshot = {serial: (nbytes, tag) for nbytes, tag, serial in self.live.values()}

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes
        self._take_snapshot()
        self.phase_peaks = {}

    def _release(self, key: int) -> None:
        entry = self.live.pop(key, None)
        self._refs.pop(key, None)
        if entry is not None:
            self.live_bytes -= entry[0]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self.answer_scalar_reads and func is torch.ops.aten._local_scalar_dense.default:
            # A fake tensor has no value. The reads in a training step are "is the mask all
            # ones" (yes: windows are unpadded) and the optimizer's step counter (any number).
            return {torch.bool: True}.get(args[0].dtype, 1)
        out = func(*args, **(kwargs or {}))
        for value in tree_leaves(out):
            if isinstance(value, torch.Tensor):
                self.track(value)
        return out

    def breakdown_at_peak(self) -> dict[str, int]:
        """Bytes per category at the peak; untagged storages are activations or temporaries."""
        totals = dict.fromkeys(CATEGORIES, 0)
        for nbytes, tag in self.peak_snapshot.values():
            if tag in totals:
                totals[tag] += nbytes
            elif self.peak_phase == "optimizer":
                totals["other"] += nbytes
            else:
                totals["activations"] += nbytes
        # The snapshot may lag the exact peak by < 0.2 %: put the rest where most of it is.
        missing = self.peak_bytes - sum(totals.values())
        if missing:
            largest = max(("activations", "other", "gradients"), key=lambda k: totals[k])
            totals[largest] += missing
        return totals


# ---------------------------------------------------------------------------
# One training step, as the training loop runs it
# ---------------------------------------------------------------------------

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StepSetup:
    """The choices the step is traced with (resolved from a TrainConfig)."""

    batch_size: int
    seq_len: int
    weight_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    attention: str  # transformers' attn_implementation
    checkpointing: str
    checkpoint_every: int
    loss_chunk_size: int
    device: torch.device


def build_model(hf_config, setup: StepSetup, train_config, fake_mode=None) -> torch.nn.Module:
    """The model of the step, on fake tensors when `fake_mode` is given, with LoRA and checkpointing applied."""
    import contextlib

    from transformers import AutoModelForCausalLM

    from memfit.techniques.checkpointing import apply_gradient_checkpointing

    context = fake_mode if fake_mode is not None else contextlib.nullcontext()
    with context:
        # Under fake tensors model.to(dtype) fails: the dtype is given at construction instead.
        model = AutoModelForCausalLM.from_config(hf_config, dtype=setup.weight_dtype, attn_implementation=setup.attention)
        model.config.use_cache = False
        if train_config.lora_enabled:
            model = _add_lora(model, train_config, fake=fake_mode is not None)
        model.train()
        apply_gradient_checkpointing(model, setup.checkpointing, setup.checkpoint_every)
    return model


def _add_lora(model, train_config, fake: bool = False):
    import contextlib
    from unittest import mock

    from peft import LoraConfig, get_peft_model
    from peft.tuners.tuners_utils import BaseTunerLayer

    targets = train_config.lora.lora_targets
    target_modules = "all-linear" if targets in ("auto", "all-linear") else [t.strip() for t in targets.split(",")]
    lora = LoraConfig(
        r=train_config.lora.lora_r, lora_alpha=train_config.lora.lora_alpha,
        lora_dropout=train_config.lora.lora_dropout, target_modules=target_modules, task_type="CAUSAL_LM",
    )
    # On fake tensors `Module.to()` must swap tensors, which fake tensors refuse. Every
    # module is already on the one (fake) device, and PEFT keeps adapters in fp32 either way.
    with contextlib.ExitStack() as stack:
        if fake:
            stack.enter_context(
                mock.patch.object(BaseTunerLayer, "_move_adapter_to_device_of_base_layer", lambda *a, **k: None)
            )
            stack.enter_context(mock.patch.object(torch.nn.Module, "to", lambda self, *a, **k: self))
        model = get_peft_model(model, lora)
    if train_config.memory.gradient_checkpointing != "off":
        model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    return model


def make_optimizer(model, train_config, setup: StepSetup) -> torch.optim.Optimizer:
    """The optimizer the training loop builds (memfit.techniques.optimizers)."""
    from memfit.techniques.optimizers import build_optimizer, parameter_groups

    groups = parameter_groups(model, train_config.optimizer.weight_decay)
    return build_optimizer(groups, train_config.optimizer, setup.device).optimizer


def run_training_steps(model, train_config, setup: StepSetup, counter: LiveStorageCounter, steps: int = 2) -> None:
    """Run `steps` optimizer steps as the loop does; the counter's peak is reset after the first."""
    optimizer = make_optimizer(model, train_config, setup)
    trainable = [p for p in model.parameters() if p.requires_grad]
    vocab = model.get_output_embeddings().weight.shape[0]
    tokens = setup.batch_size * (setup.seq_len - 1)
    for step in range(steps):
        if step == 1:
            counter.reset_peak()
        counter.phase = "forward"
        loss = _forward(model, setup, vocab, tokens)
        counter.phase = "backward"
        loss.backward()
        del loss
        counter.retag([p.grad for p in trainable if p.grad is not None], "gradients")
        counter.phase = "optimizer"
        _optimizer_step(optimizer, trainable, train_config)
        counter.retag(
            [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)],
            "optimizer_states",
        )


def _forward(model, setup: StepSetup, vocab: int, tokens: int) -> torch.Tensor:
    from memfit.techniques.loss import causal_lm_loss_sum

    input_ids = torch.randint(0, vocab, (setup.batch_size, setup.seq_len), device=setup.device)
    labels = input_ids.clone()
    with _autocast(setup):
        return causal_lm_loss_sum(model, input_ids, labels, None, setup.loss_chunk_size) / tokens


def _optimizer_step(optimizer, trainable, train_config) -> None:
    if train_config.optimizer.max_grad_norm > 0:
        torch.nn.utils.clip_grad_norm_(trainable, train_config.optimizer.max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def measure_step_with_tracker(hf_config, train_config, setup: StepSetup, steps: int = 2) -> int:
    """Peak live bytes of the last of `steps` real training steps, measured by MemoryTracker.

    The same step as `trace_step`, on real tensors, counted by the tracker the training
    loop uses: the reference the estimates are checked against.
    """
    from memfit.memory.tracker import MemoryTracker

    model = build_model(hf_config, setup, train_config)
    optimizer = make_optimizer(model, train_config, setup)
    trainable = [p for p in model.parameters() if p.requires_grad]
    vocab = model.get_output_embeddings().weight.shape[0]
    tokens = setup.batch_size * (setup.seq_len - 1)
    tracker = MemoryTracker(setup.device)
    tracker.attach(model, optimizer)
    peak = 0
    with tracker:
        for _ in range(steps):
            with tracker.phase("forward"):
                loss = _forward(model, setup, vocab, tokens)
            with tracker.phase("backward"):
                loss.backward()
                del loss
            with tracker.phase("optimizer"):
                _optimizer_step(optimizer, trainable, train_config)
            peak = tracker.end_step().peak_bytes
    tracker.detach()
    return peak


def measure_step_with_allocator(hf_config, train_config, setup: StepSetup, steps: int = 2) -> int:
    """CUDA only: `torch.cuda.max_memory_allocated` over the last of `steps` real training steps.

    The allocator's view of the same step `measure_step_with_tracker` counts: what the
    estimate is checked against on a GPU (allocator rounding included, context excluded).
    """
    model = build_model(hf_config, setup, train_config)
    optimizer = make_optimizer(model, train_config, setup)
    trainable = [p for p in model.parameters() if p.requires_grad]
    vocab = model.get_output_embeddings().weight.shape[0]
    tokens = setup.batch_size * (setup.seq_len - 1)
    for _ in range(steps):
        torch.cuda.synchronize(setup.device)
        torch.cuda.reset_peak_memory_stats(setup.device)
        loss = _forward(model, setup, vocab, tokens)
        loss.backward()
        del loss
        _optimizer_step(optimizer, trainable, train_config)
    torch.cuda.synchronize(setup.device)
    return torch.cuda.max_memory_allocated(setup.device)


def _autocast(setup: StepSetup):
    import contextlib

    if setup.autocast_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device_type=setup.device.type, dtype=setup.autocast_dtype)


def trace_step(hf_config, train_config, setup: StepSetup, fake: bool = True) -> TracedStep:
    """Peak live bytes of a steady-state training step (the second one: optimizer state exists).

    `fake=True` runs on fake tensors (no memory, any model size); `fake=False` runs the
    same step on real tensors, which is the measured truth on CPU.
    """
    import contextlib

    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    previous_dtype = torch.get_default_dtype()
    try:
        model = build_model(hf_config, setup, train_config, fake_mode)
        counter = LiveStorageCounter(vocab_size=model.get_output_embeddings().weight.shape[0])
        counter.answer_scalar_reads = fake
        patch = _real_mask_path() if fake else contextlib.nullcontext()
        with patch, fake_mode if fake_mode is not None else contextlib.nullcontext(), counter:
            counter.track_all(model.parameters(), "parameters")
            counter.track_all(model.buffers(), "other")
            run_training_steps(model, train_config, setup, counter)
    finally:
        torch.set_default_dtype(previous_dtype)
    breakdown = counter.breakdown_at_peak()
    return TracedStep(counter.peak_bytes, breakdown, dict(counter.phase_peaks), counter.peak_phase)


def _real_mask_path():
    """Make transformers treat fake tensors as real ones while building attention masks.

    Seeing a fake tensor, transformers assumes graph tracing and builds an explicit
    [b, 1, s, s] mask, which also disables grouped-query SDPA and makes it copy K and V
    to every head: memory the real run never uses.
    """
    import contextlib
    from unittest import mock

    import transformers.masking_utils as masking_utils
    from transformers.utils import import_utils

    def is_tracing(tensor=None) -> bool:
        return import_utils.is_tracing(None)

    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(masking_utils, "is_tracing", is_tracing))
    return stack
