"""The traced estimate: memfit's own training step, run on fake tensors under the memory tracker.

`trace_step` builds the model from its config (no weights), applies the same model
techniques as a training run (`apply_model_techniques`: checkpointing, LoRA with the
same target mapping), prepares it with the single-process engine and the run's
optimizer, and runs two optimizer steps through `StepRunner` (the step the
training loop runs), all under `FakeTensorMode` and the `MemoryTracker`. Fake tensors allocate
nothing, so a 7B step traces on a laptop in seconds; the tracker counts every storage
the step would hold, in the categories `memfit profile` reports. The second step is
the answer (the optimizer state exists by then).

Why fake tensors and not the meta device: operators pick their kernel by device, and on
"meta" the attention falls back to the math path that keeps the [b, heads, s, s]
probabilities, which the CPU and CUDA kernels never store. Fake tensors keep the real
device, hence the real kernel choice.

`fake=False` runs the same two steps on real tensors: the measured truth on CPU that
the estimate is checked against (`measure_step_with_tracker`); on CUDA,
`measure_step_with_allocator` reads the allocator's peak for the same step instead.

Importing this module registers `trace_step` as the estimator's tracer
(`memfit.prediction.traced.step_tracer`).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator
from unittest import mock

import torch

from memfit.config import TrainConfig
from memfit.memory.tracker import MemoryTracker
from memfit.prediction.fake_ops import FakeStepAnswers, quiet_meta_failures
from memfit.prediction.traced import StepSetup, TracedStep, register_step_tracer
from memfit.resolution.resolve import resolve
from memfit.techniques.loss_recipe import build_loss_function
from memfit.techniques.optimizer_stage import build_run_optimizer
from memfit.techniques.precision import PrecisionChoice
from memfit.train.engine import SingleProcessEngine
from memfit.train.setup import apply_model_techniques
from memfit.train.step import StepRunner

TRACED_STEPS = 2


def trace_step(hf_config, train_config: TrainConfig, setup: StepSetup, fake: bool = True) -> TracedStep:
    """Peak live bytes of a steady-state training step (the second one: optimizer state exists).

    `fake=True` runs on fake tensors (no memory, any model size); `fake=False` runs the
    same step on real tensors, which is the measured truth on CPU.
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    fake_mode = FakeTensorMode(allow_non_fake_inputs=True) if fake else None
    previous_dtype = torch.get_default_dtype()
    try:
        # The answers cover building too: an 8-bit optimizer reads its state's values when made. A fake step
        # answers scalar reads and fp32 grouped matmuls (fused experts) whose meta kernel wants bf16.
        answers = FakeStepAnswers() if fake else None
        quiet = quiet_meta_failures() if fake else None
        with _maybe(quiet), _maybe(fake_mode), _maybe(_real_mask_path() if fake else None), _maybe(answers):
            runner, samples = _build_step(hf_config, train_config, setup, fake)
            tracker = MemoryTracker(setup.device)
            tracker.attach(runner.model, runner.engine.optimizer)
            runner.tracker = tracker
            with tracker:
                memory = None
                for _ in range(TRACED_STEPS):
                    runner.run(samples)
                    memory = tracker.end_step()
            tracker.detach()
            runner.close()
    finally:
        torch.set_default_dtype(previous_dtype)
    phase_peaks = {phase.name: phase.peak_bytes for phase in memory.phases}
    peak_phase = max(phase_peaks, key=phase_peaks.get) if phase_peaks else ""
    return TracedStep(memory.peak_bytes, memory.breakdown, phase_peaks, peak_phase, memory.host_peak_bytes)


def measure_step_with_tracker(hf_config, train_config: TrainConfig, setup: StepSetup, steps: int = TRACED_STEPS) -> int:
    """Peak live bytes of the last of two real training steps, counted by the MemoryTracker.

    The same step as `trace_step`, on real tensors: the reference the estimates are checked against.
    """
    return trace_step(hf_config, train_config, setup, fake=False).peak_bytes


def measure_step_with_allocator(
    hf_config, train_config: TrainConfig, setup: StepSetup, steps: int = TRACED_STEPS
) -> int:
    """CUDA only: `torch.cuda.max_memory_allocated` over the last of `steps` real training steps.

    The allocator's view of the step `measure_step_with_tracker` counts: what the
    estimate is checked against on a GPU (allocator rounding included, context excluded).
    """
    runner, samples = _build_step(hf_config, train_config, setup, fake=False)
    try:
        for _ in range(steps):
            torch.cuda.synchronize(setup.device)
            torch.cuda.reset_peak_memory_stats(setup.device)
            runner.run(samples)
        torch.cuda.synchronize(setup.device)
        return torch.cuda.max_memory_allocated(setup.device)
    finally:
        runner.close()


def _build_step(hf_config, train_config: TrainConfig, setup: StepSetup, fake: bool) -> tuple[StepRunner, list[dict]]:
    """The model, engine and step runner of a run shaped by `setup`, and one effective batch of samples."""
    import transformers

    from memfit.prediction.encoders import is_encoder, traced_task
    from memfit.prediction.preference_step import prepare_traced_model

    task, head_config, make_sample = traced_task(train_config, hf_config)  # the --task's head, loss and batches

    config = train_config.replace(
        gradient_checkpointing=setup.checkpointing,
        checkpoint_every=setup.checkpoint_every,
        # The estimator models an offloaded optimizer state itself; its CPU copies cannot be faked.
        optimizer_offload=False,
        # Compiling and fused kernels change time, not what the step holds: the traced step runs eager PyTorch.
        compile=False,
        kernels="none",
    )
    with _fake_module_moves() if fake else contextlib.nullcontext():
        # Under fake tensors model.to(dtype) fails: the dtype is given at construction instead.
        hf_config = copy.deepcopy(hf_config)
        for key, value in head_config.items():
            setattr(hf_config, key, value)
        from transformers.initialization import no_init_weights

        # fake weights need no values (ModernBERT's trunc_normal_ initialisation stalls on them)
        with no_init_weights() if fake and is_encoder(hf_config) else contextlib.nullcontext():
            model = getattr(transformers, task.auto_class).from_config(
                hf_config, dtype=setup.weight_dtype, attn_implementation=setup.attention
            )
        if fake and is_encoder(hf_config):
            # skipping initialisation skips the tying too: an untied masked-LM decoder would count a second
            # vocabulary matrix with its gradient and optimizer state
            model.tie_weights()
        model.config.use_cache = False
        model.train()
        prepare_traced_model(task, model, setup.device)  # a preference task's frozen copy, before LoRA wraps the model
        run = dataclasses.replace(resolve(config, hf_config, setup.device.type), loss_chunk_size=setup.loss_chunk_size)
        model, run = apply_model_techniques(config, model, task.peft_task_type, run=run, device=setup.device)
    if not fake:
        model.to(setup.device)
    name = {None: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[setup.autocast_dtype]
    precision = PrecisionChoice(name, setup.autocast_dtype, False, "as estimated")
    engine = SingleProcessEngine(
        setup.device, precision, config.optimizer.max_grad_norm, updates_in_backward=run.optimizer_in_backward
    )
    engine.prepare(model, lambda m: build_run_optimizer(run, config.optimizer, m, setup.device, {}))
    runner = StepRunner(
        model=model, engine=engine, device=setup.device, precision=precision, pad_token_id=0,
        micro_batch_size=setup.batch_size, loss_chunk_size=run.loss_chunk_size, oom_recovery=False,
        checkpointing_on=run.checkpointing_on, loss_fn=task.loss_function(build_loss_function(run, model)), task=task,
    )
    vocab = model.get_input_embeddings().weight.shape[0]
    generator = torch.Generator().manual_seed(0)
    samples = [make_sample(torch.randint(0, vocab, (setup.seq_len,), generator=generator))
               for _ in range(setup.batch_size)]
    return runner, samples


@contextlib.contextmanager
def _maybe(context) -> Iterator[None]:
    if context is None:
        yield
    else:
        with context:
            yield


def _fake_module_moves():
    """On fake tensors `Module.to()` must swap tensors, which fake tensors refuse.

    Every module is already on the one (fake) device, and PEFT keeps adapters in fp32
    either way, so moves are skipped while the model is built.
    """
    stack = contextlib.ExitStack()
    stack.enter_context(mock.patch.object(torch.nn.Module, "to", lambda self, *a, **k: self))
    try:
        from peft.tuners.tuners_utils import BaseTunerLayer
    except ImportError:  # no LoRA without peft: nothing more to skip
        return stack
    stack.enter_context(
        mock.patch.object(BaseTunerLayer, "_move_adapter_to_device_of_base_layer", lambda *a, **k: None)
    )
    return stack


def _real_mask_path():
    """Make transformers treat fake tensors as real ones while building attention masks.

    Seeing a fake tensor, transformers assumes graph tracing and builds an explicit
    [b, 1, s, s] mask, which also disables grouped-query SDPA and makes it copy K and V
    to every head: memory the real run never uses.
    """
    import transformers.masking_utils as masking_utils
    from transformers.utils import import_utils

    def is_tracing(tensor=None) -> bool:
        return import_utils.is_tracing(None)

    return mock.patch.object(masking_utils, "is_tracing", is_tracing)


register_step_tracer(trace_step)
