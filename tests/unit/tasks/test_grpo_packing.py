"""GRPO's training pass over packed completions (--packing samples): the same numbers as padded rows, less memory.

Given the same completions (the batch built directly, as the GRPO loss tests build theirs), the loss of a
micro-batch and the gradients it leaves are the same packed as padded for each loss type, beta 0 and 0.04, once-
and twice-trained completions (the old-policy log-probabilities of --num-iterations 2); the old-policy and reference
forwards, which pack too, give the same stored log-probabilities; the clip and KL metrics agree. With completions of
mixed lengths the tracked peak of the training pass is lower packed. A model that cannot restrict attention from
positions runs padded and says why. The estimate of a packed step counts SDPA's block mask.
"""

from __future__ import annotations

import pytest
import torch
from tests.tiny_llama import tiny_llama

from memfit.config_loading import load_config
from memfit.memory.tracker import MemoryTracker
from memfit.tasks.grpo import GRPOTask, PromptSamples
from memfit.tasks.grpo_losses import LOSS_TYPES
from memfit.techniques.loss import IGNORE_INDEX

PROMPT = 4
COMPLETION_LENGTHS = [12, 3, 7, 5, 2, 9, 4, 6]
"""Mixed lengths: packed, 8 completions fit 5 rows of 16 tokens (16 | 13+3 | 11+5 | 9+7 | 8+6+2 ...)."""


def _config(loss_type: str = "grpo", beta: float = 0.0, num_iterations: int = 1, packing: str = "samples",
            temperature: float = 1.0):
    config = load_config(overrides={"model": "tiny", "task": "grpo", "reward_function": "length", "beta": beta,
                                    "num_iterations": num_iterations, "num_generations": 4, "batch_size": 8,
                                    "max_completion_length": max(COMPLETION_LENGTHS), "packing": packing,
                                    "temperature": temperature})
    config.task.loss_type = loss_type  # set directly: the flag parser turns dr_grpo's underscore into a dash
    return config


def _task(model, **settings) -> GRPOTask:
    task = GRPOTask(_config(**settings))
    task.prepare_model(model, _Tokenizer())
    return task


class _Tokenizer:
    eos_token_id = None
    pad_token_id = 0
    unk_token_id = None

    def convert_tokens_to_ids(self, token):
        return None


def _completions(task: GRPOTask, seed: int = 0, lengths: list[int] = COMPLETION_LENGTHS) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    samples = []
    for length in lengths:
        prompt = torch.randint(3, 256, (PROMPT,), generator=generator).tolist()
        completion = torch.randint(3, 256, (length,), generator=generator).tolist()
        advantage = float(torch.randn((), generator=generator))
        samples.append(task._sample(prompt, completion, False, advantage))
    return samples


def _loss_and_gradients(packing: str, model_seed: int = 0, **settings):
    """The micro-batch's loss, the gradients it leaves, the stored log-probabilities and the loss's metrics."""
    model = tiny_llama(seed=model_seed)
    task = _task(model, packing=packing, **settings)
    samples = _completions(task)
    task._step_counts = (len(samples), sum(len(s["input_ids"]) - PROMPT for s in samples))
    if settings.get("num_iterations", 1) > 1:  # the policy has moved since the completions were generated
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.05)
        task._attach_logprobs(samples)
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.05)
    else:
        task._attach_logprobs(samples)
    if task.beta > 0:  # the reference (a frozen copy of the untouched weights) differs from the policy
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(torch.randn_like(parameter) * 0.05)
    batch = task.collate(samples, 0)
    inputs = task.loss_inputs(batch)
    loss = task.loss_sum(model, batch["input_ids"], batch["labels"], batch.get("attention_mask"), 0,
                         position_ids=batch.get("position_ids"), **inputs)
    loss.backward()
    gradients = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    stored = {name: [s[name] for s in samples] for name in ("old_logps", "ref_logps") if name in samples[0]}
    return loss.detach(), gradients, stored, dict(task._stats), batch


CASES = [(loss_type, beta, mu) for loss_type in LOSS_TYPES for beta in (0.0, 0.04) for mu in (1, 2)]


@pytest.mark.parametrize(("loss_type", "beta", "num_iterations"), CASES,
                         ids=[f"{t}-beta{b}-mu{m}" for t, b, m in CASES])
def test_packed_completions_give_the_padded_loss_gradients_and_metrics(loss_type, beta, num_iterations):
    settings = dict(loss_type=loss_type, beta=beta, num_iterations=num_iterations)
    padded = _loss_and_gradients("off", **settings)
    packed = _loss_and_gradients("samples", **settings)
    assert "position_ids" in packed[4] and "attention_mask" not in packed[4]
    assert packed[4]["input_ids"].shape[0] < padded[4]["input_ids"].shape[0]  # fewer rows: it really packed
    torch.testing.assert_close(packed[0], padded[0], rtol=1e-5, atol=1e-6)
    assert packed[1].keys() == padded[1].keys()
    for name, gradient in padded[1].items():
        torch.testing.assert_close(packed[1][name], gradient, rtol=1e-4, atol=1e-6, msg=name)
    assert packed[2].keys() == padded[2].keys() == ({"ref_logps"} if beta > 0 else set()) | (
        {"old_logps"} if num_iterations > 1 else set())
    for name, rows in padded[2].items():
        for mine, theirs in zip(packed[2][name], rows, strict=True):
            torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-6)
    assert packed[3].keys() == padded[3].keys()
    for name, value in padded[3].items():
        assert packed[3][name] == pytest.approx(value, rel=1e-5, abs=1e-6), name


def test_a_moved_policy_changes_the_packed_loss():
    """The comparison can fail: a different model gives another loss and other gradients."""
    first = _loss_and_gradients("samples", beta=0.04, num_iterations=2)
    other = _loss_and_gradients("samples", model_seed=1, beta=0.04, num_iterations=2)
    assert not torch.allclose(first[0], other[0], rtol=1e-3)


MIXED = [60, 4, 6, 8, 5, 7, 3, 9]
"""One long completion and seven short ones: padded, 8 rows of 64 tokens; packed, 3."""


def _tracked_training_pass(packing: str, lengths: list[int] = MIXED) -> tuple[int, float]:
    """(tracked peak, fastest of three wall times) of one training pass over completions of `lengths`."""
    import time

    model = tiny_llama(seed=0, hidden=64, layers=2, vocab=256)
    task = _task(model, packing=packing)
    samples = _completions(task, lengths=lengths)
    task._step_counts = (len(samples), sum(len(s["input_ids"]) - PROMPT for s in samples))
    peak, seconds = 0, []
    for _ in range(3):
        tracker = MemoryTracker(torch.device("cpu"))
        tracker.attach(model)
        started = time.perf_counter()
        with tracker:
            batch = task.collate(samples, 0)
            loss = task.loss_sum(model, batch["input_ids"], batch["labels"], batch.get("attention_mask"), 0,
                                 position_ids=batch.get("position_ids"), **task.loss_inputs(batch))
            loss.backward()
            peak = tracker.end_step().peak_bytes
        seconds.append(time.perf_counter() - started)
        tracker.detach()
        model.zero_grad(set_to_none=True)
    return peak, min(seconds)


def test_packed_mixed_lengths_hold_less_than_padded():
    (padded, padded_s), (packed, packed_s) = _tracked_training_pass("off"), _tracked_training_pass("samples")
    print(f"training pass: padded {padded / 2**20:.3f} MiB {padded_s * 1e3:.1f} ms,"
          f" packed {packed / 2**20:.3f} MiB {packed_s * 1e3:.1f} ms")
    assert packed < 0.8 * padded
    (even, _), (even_packed, _) = (_tracked_training_pass(p, [60] * 8) for p in ("off", "samples"))
    print(f"one length: padded {even / 2**20:.3f} MiB, packed {even_packed / 2**20:.3f} MiB (no row saved:"
          " auto pads these)")
    assert even_packed >= even


def test_a_model_that_cannot_pack_runs_padded_and_says_why(caplog):
    model = tiny_llama(seed=0)
    model.config.model_type = "mamba"  # stateful layers: a completion's state would leak into the next
    with caplog.at_level("WARNING", logger="memfit"):
        task = _task(model, packing="samples")
    assert task.packing.mode == "off" and task.packing.fallback
    assert "mamba layers carry state" in task.packing.reason
    assert any("packing" in r.getMessage() and "mamba" in r.getMessage() for r in caplog.records)
    facts = task.facts()["packing"]
    assert facts.startswith("off") and "mamba" in facts
    batch = task.collate(_completions(task), 0)
    assert "position_ids" not in batch and "attention_mask" in batch


def test_grpo_refuses_wrapped_packing_only():
    from memfit.errors import UsageError
    from memfit.tasks import build_task

    with pytest.raises(UsageError, match="--packing wrapped"):
        build_task(_config(packing="wrapped"))
    assert build_task(_config(packing="samples")).packing.requested == "samples"


def test_the_labels_of_unpacked_rows_are_the_padded_ones():
    model = tiny_llama(seed=0)
    task = _task(model, packing="samples")
    samples = _completions(task)
    packed, padded = task.collate(samples, 0), task.padded(samples, 0)
    rows = {k: v for k, v in packed.items()}
    _, labels, _ = task._per_token(model, rows, 0)
    kept = padded["labels"][:, 1:] != IGNORE_INDEX
    assert torch.equal(labels[:, 1:] != IGNORE_INDEX, kept)


def test_auto_packs_a_micro_batch_only_when_that_saves_rows():
    model = tiny_llama(seed=0)
    task = _task(model, packing="auto")
    assert task.packing.mode == "samples" and "saves rows" in task.packing.reason
    mixed = task.collate(_completions(task), 0)
    assert "position_ids" in mixed and len(mixed["input_ids"]) < len(COMPLETION_LENGTHS)
    even = task.collate(_completions(task, lengths=[6] * 4), 0)
    assert "position_ids" not in even and "attention_mask" in even and len(even["input_ids"]) == 4
    assert "position_ids" in _task(model, packing="samples").collate(_completions(task, lengths=[6] * 4), 0)


def test_the_run_never_packs_the_prompts_themselves():
    from memfit.data.prompts import PromptItem
    from memfit.techniques.packed_attention import pack_for_model, packing_facts

    prompts = PromptSamples([PromptItem("q", [5, 6, 7], {}) for _ in range(4)], 8, "test prompts")
    model = tiny_llama(seed=0)
    assert pack_for_model(prompts, "samples", None, model, "sdpa", 16, 1, {}) is prompts
    task = _task(model, packing="samples")
    prompts.packing_facts = task.packing.facts
    assert packing_facts(prompts)["mode"] == "samples" and packing_facts(prompts)["requested"] == "samples"


def test_memfit_train_packed_reaches_the_padded_weights_through_an_oom_split(llama_dir, tmp_path):
    """End to end under SGD without clipping (a 2x gradient moves the weights out of tolerance): --packing samples
    with --beta 0.04 and --num-iterations 2, a training micro-batch split by an out-of-memory error, reaches the
    weights of the padded run; the start record says what packed."""
    import json

    from fault_injection import SGD_NO_CLIPPING, assert_same_weights, final_weights, oom_in_backward_of_linear
    from memfit.train.loop import train

    rewards = tmp_path / "rewards.py"
    rewards.write_text("def token_value(completions, completion_ids=None, **kwargs):\n"
                       "    return [sum(t % 10 for t in ids) / (10 * max(1, len(ids))) for ids in completion_ids]\n")

    prompts = tmp_path / "prompts.jsonl"  # lengths far apart: a short prompt's completions share a packed row
    prompts.write_text("".join(json.dumps({"prompt": text}) + "\n" for text in
                               ("Hi", "one two three four five six seven eight nine ten " * 3)))

    def run(name: str, packing: str):
        out = tmp_path / name
        config = load_config(overrides=dict(
            model=str(llama_dir), task="grpo", dataset=str(prompts), reward_function=f"{rewards}:token_value",
            num_generations=2, max_completion_length=6, batch_size=4, max_steps=2, beta=0.04, num_iterations=2,
            packing=packing, output_dir=str(out), lr=0.5, report=False, cache_dir=str(out / "cache"),
            **SGD_NO_CLIPPING))
        return final_weights(train(config)), [json.loads(line) for line in (out / "metrics.jsonl").open()]

    padded, padded_lines = run("padded", "off")
    with oom_in_backward_of_linear(64, 128, above_batch=1) as raised:
        packed, lines = run("packed", "samples")
    assert raised["n"] > 0 and any(line.get("event") == "oom" for line in lines)
    start = next(line for line in lines if line.get("packing"))
    assert start["packing"]["mode"] == "samples", start["packing"]
    assert_same_weights(padded, packed)
    padding = [sum(line["padding_tokens"] for line in found if "padding_tokens" in line)
               for found in (padded_lines, lines)]
    assert padding[1] < padding[0]  # the step's metrics count the packed rows' positions


ESTIMATED = dict(sizes=dict(hidden=64, layers=2, vocab=256),
                 settings=dict(max_completion_length=48, num_generations=4, batch_size=8, gradient_accumulation_steps=1,
                               generation_batch_size=2))
"""Training-bound: eight rows of 16 + 48 tokens trained at once, two completions generated at a time."""


def _estimate_config(packing: str, beta: float):
    from tests.unit.prediction.test_rl_step import PROMPT as ESTIMATE_PROMPT

    return load_config(overrides={"model": "tiny", "task": "grpo", "reward_function": "length",
                                  "seq_len": ESTIMATE_PROMPT, "max_prompt_length": ESTIMATE_PROMPT, "beta": beta,
                                  "packing": packing, **ESTIMATED["settings"]})


def _tracked_packed_step(beta: float) -> int:
    """The tracked peak of the second of two real packed GRPO steps, rollout included (as test_rl_step measures:
    every completion runs to its length, the estimate's case)."""
    from tests.unit.prediction.test_rl_step import PROMPT as ESTIMATE_PROMPT
    from tests.unit.prediction.test_rl_step import _runner
    from tests.unit.prediction.test_rl_step import _Tokenizer as NoEosTokenizer

    from memfit.data.prompts import PromptItem

    config = _estimate_config("samples", beta)
    model = tiny_llama(seed=0, **ESTIMATED["sizes"])
    model.config.use_cache = False
    model.train()
    task = GRPOTask(config)
    task.prepare_model(model, NoEosTokenizer())
    assert task.packing.mode == "samples"
    runner = _runner(config, model, task)
    prompts = config.training.batch_size // config.rl.num_generations
    generator = torch.Generator().manual_seed(1)
    task._prompts = PromptSamples([PromptItem("q", torch.randint(3, 256, (ESTIMATE_PROMPT,), generator=generator)
                                              .tolist(), {}) for _ in range(prompts)], 48, "test prompts")
    indices = list(range(prompts))
    runner.run(task.prepare([task._prompts[i] for i in indices], indices, 0))
    tracker = MemoryTracker(torch.device("cpu"))
    tracker.attach(runner.model, runner.engine.optimizer)
    runner.tracker = tracker
    with tracker:
        if task._copy is not None:
            for parameter in task._copy.parameters():
                parameter.sum()
        runner.run(task.prepare([task._prompts[i] for i in indices], indices, 1))
        peak = tracker.end_step().peak_bytes
    tracker.detach()
    runner.close()
    return peak


@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_the_estimate_of_a_packed_step_is_within_10_percent_and_counts_the_block_mask(beta):
    from memfit.prediction.estimator import estimate
    from memfit.techniques.packed_attention import block_mask_bytes
    from tiny_llama import tiny_llama_config

    hf_config = tiny_llama_config(**ESTIMATED["sizes"])
    truth = _tracked_packed_step(beta)
    packed = estimate(_estimate_config("samples", beta), hf_config=hf_config)
    padded = estimate(_estimate_config("off", beta), hf_config=hf_config)
    print(f"beta {beta}: measured {truth / 2**20:.3f} MiB, estimated {packed.peak_bytes / 2**20:.3f} MiB"
          f" ({packed.peak_bytes / truth - 1:+.2%}; padded estimate {padded.peak_bytes / 2**20:.3f} MiB)")
    assert packed.details["rl_step"]["peak_phase"] == "training"
    assert abs(packed.peak_bytes / truth - 1) <= 0.10
    rows, width, heads_bytes = 8, 16 + 48, 2 * (64 - 32) * 4  # fp32; 4 query heads of 16, 2 key-value heads
    assert packed.details["packed_mask_bytes"] == block_mask_bytes(rows, width, "sdpa", 2, 4, heads_bytes)
    assert packed.peak_bytes - padded.peak_bytes == packed.details["packed_mask_bytes"]


def test_the_scoring_forward_of_packed_completions_holds_one_layers_mask():
    from memfit.prediction.activations import Precision, architecture_of
    from memfit.prediction.rl_step import scoring_bytes
    from memfit.techniques.packed_attention import block_mask_bytes
    from tiny_llama import tiny_llama_config

    arch = architecture_of(tiny_llama_config(**ESTIMATED["sizes"]))
    packed, padded = (scoring_bytes(_estimate_config(p, 0.04), arch, Precision(4, 4), 64, 32, 64)
                      for p in ("samples", "off"))
    assert packed - padded == block_mask_bytes(32, 64, "sdpa", 1, 4, 2 * (arch.q_width - arch.kv_width) * 4)
    assert scoring_bytes(_estimate_config("samples", 0.0), arch, Precision(4, 4), 64, 32, 64) == 0.0


def test_the_estimate_under_auto_counts_no_mask_even_for_conversational_prompts():
    """Every completion at its length saves no row, so auto pads: no mask, whatever the prompts' format."""
    from memfit.prediction.estimator import estimate
    from tiny_llama import tiny_llama_config

    hf_config = tiny_llama_config(**ESTIMATED["sizes"])
    auto = _estimate_config("auto", 0.0).replace(dataset_format="conversational")
    assert "packed_mask_bytes" not in estimate(auto, hf_config=hf_config).details
    assert estimate(_estimate_config("samples", 0.0), hf_config=hf_config).details["packed_mask_bytes"] > 0


def test_the_steps_positions_are_the_rows_collate_lays_out():
    model = tiny_llama(seed=0)
    for packing, lengths in (("samples", COMPLETION_LENGTHS), ("samples", [6] * 4), ("auto", [6] * 4),
                             ("auto", COMPLETION_LENGTHS), ("off", COMPLETION_LENGTHS)):
        task = _task(model, packing=packing)
        samples = _completions(task, lengths=lengths)
        assert task.row_positions(samples) == task.collate(samples, 0)["input_ids"].numel(), (packing, lengths)
