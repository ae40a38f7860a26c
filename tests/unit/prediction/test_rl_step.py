"""memfit estimate of a --task grpo step against the tracked peak of memfit's real step, generation included.

The truth is memfit's own GRPO step on real tensors on the CPU, counted by the MemoryTracker (the tracker memfit
profile uses): the task's rollout (memfit.tasks.rollout, a key-value cache, --generation-batch-size completions at
once), the reference's scoring forward under --beta > 0 (a frozen copy), then the StepRunner's micro-batches and
AdamW. The first step runs untracked (the optimizer state exists by the second, as in a run's steady state); the
second is tracked from its rollout to its optimizer step. Every completion runs to --max-completion-length (no EOS),
the length the estimate counts. Three shapes: one whose generation (prompt logits and cache of every completion at
once) is the peak, one whose training pass is, one whose reference scoring forward over every completion is. The estimate stays within 10 % of each, with and without the copy;
leaving out the generation terms (the cache and the prompt's forward) or the copy takes it out of that band.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from memfit.config_loading import load_config
from memfit.data.prompts import PromptItem
from memfit.memory.tracker import MemoryTracker
from memfit.prediction import estimator, rl_step
from memfit.prediction.activations import Precision, architecture_of
from memfit.prediction.estimator import estimate
from memfit.prediction.rl_step import generation_phase
from tiny_llama import tiny_llama, tiny_llama_config

BAND = 0.10
PROMPT = 16
GENERATION_BOUND = dict(sizes=dict(hidden=32, layers=16, vocab=512),
                        settings=dict(max_completion_length=16, num_generations=8, batch_size=8,
                                      gradient_accumulation_steps=4, gradient_checkpointing="full",
                                      loss_chunk_size=64))
"""32 completions generated at once, their cache of 16 + 15 tokens over 16 layers the largest tensors (the
reference's no-grad forward over them holds one layer's at a time); training runs eight checkpointed rows at a time."""
TRAINING_BOUND = dict(sizes=dict(hidden=64, layers=2, vocab=256),
                      settings=dict(max_completion_length=12, num_generations=4, batch_size=8,
                                    gradient_accumulation_steps=1, generation_batch_size=2))
"""Two completions generated at a time (fewer than the step's 8); training runs all 8 rows at once, unchecked."""
SCORING_BOUND = dict(sizes=dict(hidden=32, layers=2, vocab=256, intermediate=512),
                     settings=dict(max_completion_length=8, num_generations=8, batch_size=4,
                                   gradient_accumulation_steps=8, gradient_checkpointing="full",
                                   generation_batch_size=4))
"""Under --beta > 0 the reference scores all 32 completions in one no-grad forward, whose MLP (512 wide) outweighs
four completions generated at a time and four checkpointed rows trained at a time."""
SHAPES = {"generation-bound": GENERATION_BOUND, "training-bound": TRAINING_BOUND, "scoring-bound": SCORING_BOUND}
BETAS = {"no reference": 0.0, "reference copy": 0.04}


class _Tokenizer:
    """What the task reads of a tokenizer: no EOS (every completion runs to its length), pad 0, text for rewards."""

    eos_token_id = None
    pad_token_id = 0
    unk_token_id = None

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(str(i) for i in ids)

    def convert_tokens_to_ids(self, token):
        return None


def _config(shape: str, beta: float):
    settings = SHAPES[shape]["settings"]
    return load_config(overrides={"model": "tiny", "task": "grpo", "reward_function": "length", "seq_len": PROMPT,
                                  "max_prompt_length": PROMPT, "beta": beta, **settings})


def _runner(config, model, task):
    from memfit.resolution.resolve import resolve
    from memfit.techniques.loss_recipe import build_loss_function
    from memfit.techniques.optimizer_stage import build_run_optimizer
    from memfit.techniques.precision import PrecisionChoice
    from memfit.train.engine import SingleProcessEngine
    from memfit.train.setup import apply_model_techniques
    from memfit.train.step import StepRunner

    cpu = torch.device("cpu")
    run = resolve(config, model.config, "cpu")
    model, run = apply_model_techniques(config, model, task.peft_task_type, run=run, device=cpu)
    precision = PrecisionChoice("fp32", None, False, "as estimated")
    engine = SingleProcessEngine(cpu, precision, config.optimizer.max_grad_norm,
                                 updates_in_backward=run.optimizer_in_backward)
    engine.prepare(model, lambda m: build_run_optimizer(run, config.optimizer, m, cpu, {}))
    return StepRunner(model=model, engine=engine, device=cpu, precision=precision, pad_token_id=0,
                      micro_batch_size=config.training.batch_size, loss_chunk_size=run.loss_chunk_size,
                      oom_recovery=False, checkpointing_on=run.checkpointing_on,
                      loss_fn=task.loss_function(build_loss_function(run, model)), task=task)


def measure_rl_step(shape: str, beta: float) -> int:
    """The tracked peak of the second of two real GRPO steps, rollout included (module docstring)."""
    from memfit.tasks.grpo import GRPOTask, PromptSamples

    config = _config(shape, beta)
    model = tiny_llama(seed=0, **SHAPES[shape]["sizes"])
    model.config.use_cache = False
    model.train()
    task = GRPOTask(config)
    task.prepare_model(model, _Tokenizer())  # the frozen copy, as a run's setup makes it
    runner = _runner(config, model, task)
    prompts = config.training.batch_size * config.training.gradient_accumulation_steps // config.rl.num_generations
    generator = torch.Generator().manual_seed(1)
    vocab = SHAPES[shape]["sizes"]["vocab"]
    items = [PromptItem("q", torch.randint(3, vocab, (PROMPT,), generator=generator).tolist(), {})
             for _ in range(prompts)]
    task._prompts = PromptSamples(items, config.rl.max_completion_length, "test prompts")
    indices = list(range(prompts))

    def step(number: int) -> None:
        runner.run(task.prepare([task._prompts[i] for i in indices], indices, number))

    step(0)
    tracker = MemoryTracker(torch.device("cpu"))
    tracker.attach(runner.model, runner.engine.optimizer)
    runner.tracker = tracker
    with tracker:
        if task._copy is not None:  # a run's tracker has seen the copy since its first step's scoring: so does this one
            for parameter in task._copy.parameters():
                parameter.sum()
        step(1)
        peak = tracker.end_step().peak_bytes
    tracker.detach()
    runner.close()
    return peak


_measured_peaks: dict[tuple[str, float], int] = {}


def _measured(shape: str, beta: float) -> int:
    if (shape, beta) not in _measured_peaks:
        _measured_peaks[(shape, beta)] = measure_rl_step(shape, beta)
    return _measured_peaks[(shape, beta)]


def _estimated(shape: str, beta: float):
    return estimate(_config(shape, beta), hf_config=tiny_llama_config(**SHAPES[shape]["sizes"]))


@pytest.mark.parametrize("beta", list(BETAS))
@pytest.mark.parametrize("shape", ["generation-bound", "training-bound"])
def test_the_estimate_of_an_rl_step_is_within_10_percent_of_its_tracked_peak(shape, beta):
    truth, result = _measured(shape, BETAS[beta]), _estimated(shape, BETAS[beta])
    facts = result.details["rl_step"]
    print(f"{shape}, {beta}: measured {truth / 2**20:.3f} MiB, estimated {result.peak_bytes / 2**20:.3f} MiB"
          f" ({result.peak_bytes / truth - 1:+.2%}, {facts['peak_phase']})")
    assert facts["peak_phase"] == shape.removesuffix("-bound")
    assert (facts["reference_copy_bytes"] > 0) == (BETAS[beta] > 0)
    assert abs(result.peak_bytes / truth - 1) <= BAND


def test_the_references_scoring_forward_over_every_completion_is_counted(monkeypatch):
    truth, result = _measured("scoring-bound", 0.04), _estimated("scoring-bound", 0.04)
    print(f"scoring-bound: measured {truth / 2**20:.3f} MiB, estimated {result.peak_bytes / 2**20:.3f} MiB"
          f" ({result.peak_bytes / truth - 1:+.2%}, {result.details['rl_step']['peak_phase']})")
    assert result.details["rl_step"]["peak_phase"] == "scoring"
    assert abs(result.peak_bytes / truth - 1) <= BAND
    monkeypatch.setattr(estimator, "rl_scoring_bytes", lambda *args: 0.0)
    short = _estimated("scoring-bound", 0.04).peak_bytes
    print(f"without the scoring forward: {short / truth - 1:+.2%}")
    assert short / truth - 1 < -BAND


def test_leaving_out_the_cache_and_the_prompts_logits_falls_outside_the_band(monkeypatch):
    truth = _measured("generation-bound", 0.0)
    real = rl_step.generation_phase

    def without(*args, **kwargs):
        return dataclasses.replace(real(*args, **kwargs), kv_cache_bytes=0, prompt_moment_bytes=0)

    monkeypatch.setattr(estimator, "generation_phase", without)
    short = _estimated("generation-bound", 0.0).peak_bytes
    print(f"without the cache and the prompt's forward: {short / truth - 1:+.2%}")
    assert short / truth - 1 < -BAND


def test_leaving_out_the_reference_copy_falls_outside_the_band(monkeypatch):
    truth = _measured("training-bound", 0.04)
    monkeypatch.setattr(estimator, "_with_rl_generation", _without_copy(estimator._with_rl_generation))
    short = _estimated("training-bound", 0.04).peak_bytes
    print(f"without the reference copy: {short / truth - 1:+.2%}")
    assert short / truth - 1 < -BAND


def _without_copy(real):
    def hook(request, run, moment, loaded_parameters, notes):
        plain = dataclasses.replace(request, config=request.config.replace(beta=0.0))
        return real(plain, run, moment, loaded_parameters, notes)
    return hook


def test_the_cache_term_is_the_bytes_of_a_real_cache():
    model = tiny_llama(seed=0).eval()
    rows, prompt, new = 3, 10, 6
    with torch.no_grad():
        output = model(input_ids=torch.randint(0, 100, (rows, prompt)), use_cache=True)
        cache = output.past_key_values if output.past_key_values is not None else output.cache
        for _ in range(new - 1):
            output = model(input_ids=torch.randint(0, 100, (rows, 1)), cache=cache, use_cache=True)
    tensors = [t for layer in cache.layers for t in (layer.keys, layer.values)]
    held = sum(t.numel() * t.element_size() for t in tensors)
    config = load_config(overrides={"model": "tiny", "task": "grpo", "max_completion_length": new,
                                    "generation_batch_size": rows})
    phase = generation_phase(config, architecture_of(tiny_llama_config()), Precision(4, 4), prompt + new,
                             completions_in_step=8)
    assert phase.completions == rows and phase.kv_cache_bytes == held


def _long_config(**settings):
    return load_config(overrides={"model": "tiny", "task": "grpo", "seq_len": 32, "max_completion_length": 2048,
                                  "num_generations": 4, "batch_size": 4, "gradient_accumulation_steps": 16,
                                  "gradient_checkpointing": "full", **settings})


def test_the_peak_is_the_larger_phase_and_both_are_said():
    short = estimate(load_config(overrides={"model": "tiny", "task": "grpo", "seq_len": 32,
                                            "max_completion_length": 32, "num_generations": 4,
                                            "batch_size": 8})).details["rl_step"]
    assert short["peak_phase"] == "training" and short["row_tokens"] == 64
    many = estimate(_long_config())
    long = many.details["rl_step"]
    assert long["peak_phase"] == "generation" and long["completions_generated_at_once"] == 64
    assert many.peak_bytes == long["generation_bytes"] > long["training_bytes"]
    halved = estimate(_long_config(generation_batch_size=32)).details["rl_step"]
    assert halved["kv_cache_bytes"] * 2 == long["kv_cache_bytes"]


@pytest.mark.parametrize(("rows", "group", "prompt", "new", "vocab"),
                         [(4, 1, 4, 40, 256), (16, 4, 96, 2, 256), (16, 1, 96, 2, 256)],
                         ids=["cache-bound", "prompt-bound, 4 completions a prompt", "prompt-bound, distinct prompts"])
def test_the_generation_terms_are_the_tracked_peak_of_a_rollout(rows, group, prompt, new, vocab):
    """Generation alone: long completions (the whole cache at the end is the peak) and short ones after a long
    prompt (its first forward, each distinct prompt once, is): the phase's bytes beside the weights are within 10 %
    of the tracked peak."""
    from memfit.tasks.rollout import Sampling, sample_completions

    model = tiny_llama(seed=0, vocab=vocab)
    tracker = MemoryTracker(torch.device("cpu"))
    tracker.attach(model)
    prompts = [list(range(3 + row // group, 3 + row // group + prompt)) for row in range(rows)]
    with tracker:
        weights = tracker.current_bytes
        sample_completions(model, prompts, list(range(rows)), Sampling(new, eos_token_ids=(), pad_token_id=0), rows)
        held = tracker.end_step().peak_bytes - weights
    tracker.detach()
    config = load_config(overrides={"model": "tiny", "task": "grpo", "max_completion_length": new,
                                    "num_generations": group})
    phase = generation_phase(config, architecture_of(tiny_llama_config(vocab=vocab)), Precision(4, 4),
                             prompt + new, completions_in_step=rows)
    print(f"generation {rows} x ({prompt} + {new}), {group} a prompt: tracked {held} B, estimated"
          f" {phase.working_bytes} B ({phase.working_bytes / held - 1:+.2%}; prompt forward {phase.prompt_moment_bytes}"
          f" B, late decoding {phase.kv_cache_bytes + phase.logits_bytes} B)")
    assert abs(phase.working_bytes / held - 1) <= BAND
